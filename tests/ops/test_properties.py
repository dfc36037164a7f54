"""Property-based checks (hypothesis): random shapes, dtypes, options and label patterns on both
backends against the float64 reference, plus non-finite inputs (Triton on the GPU under LCE_TEST_GPU=1, else
under the CPU interpreter; devices.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lce_patch import fused_linear_cross_entropy
from lce_patch.ops.linear_cross_entropy import naive_linear_cross_entropy

from .devices import BACKENDS, device_of, on
from .helpers import rel_err

# Tolerances per dtype: fp32 accumulates exactly enough for 1e-5; fp16 operands round to 2^-11.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 8e-3}


@st.composite
def problems(draw):
    n = draw(st.integers(0, 40))
    d = draw(st.integers(1, 24))
    v = draw(st.integers(1, 70))
    label_pattern = draw(st.sampled_from(["random", "all_ignored", "none_ignored", "first_and_last"]))
    options = {
        "softcap": draw(st.one_of(st.none(), st.floats(0.5, 50.0))),
        "logit_scale": draw(st.sampled_from([1.0, 0.5, 2.3])),
        "label_smoothing": draw(st.sampled_from([0.0, 0.1])),
        "z_loss": draw(st.sampled_from([0.0, 1e-3])),
        "reduction": draw(st.sampled_from(["mean", "sum", "none"])),
    }
    if options["reduction"] != "none" and draw(st.booleans()):
        options["num_items_in_batch"] = draw(st.integers(1, 50))
    return n, d, v, label_pattern, options, draw(st.integers(0, 2**31 - 1)), draw(st.integers(1, 16))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems())
def test_random_problems_match_reference(backend, dtype, problem):
    n, d, v, label_pattern, options, seed, chunk_size = problem
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype).double()
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64).to(dtype).double()
    labels = torch.randint(0, v, (n,), generator=gen)
    if label_pattern == "random":
        labels[torch.rand(n, generator=gen) < 0.3] = -100
    elif label_pattern == "all_ignored":
        labels.fill_(-100)
    elif label_pattern == "first_and_last" and n > 2:
        labels[1:-1] = -100

    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = naive_linear_cross_entropy(ref_h, ref_w, labels, **options)
    upstream = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref.backward(upstream)

    h = hidden.to(device_of(backend), dtype).requires_grad_()
    w = weight.to(device_of(backend), dtype).requires_grad_()
    out = fused_linear_cross_entropy(h, w, on(backend, labels), backend=backend, chunk_size=chunk_size, **options)
    out.backward(on(backend, upstream.float()))
    out = out.detach().cpu()
    tol = TOLERANCE[dtype]
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol or (out - ref).abs().max() < tol
    for got, want in ((h.grad.cpu(), ref_h.grad), (w.grad.cpu(), ref_w.grad)):
        assert rel_err(got, want) < tol or (got.double() - want).abs().max() < tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["hidden", "weight"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("vocab_size, bad_row", [(17, 2), (17, 0), (17, 16), (2100, 5), (2100, 2060)])
def test_non_finite_input_gives_nan_like_the_unfused_path(backend, where, value, vocab_size, bad_row):
    # bad_row: the hidden row or vocabulary entry hit. The Triton kernel's lanes hold 8 consecutive
    # logits: at 17 the bad logit 16 shares its lane only with padding; at 2100 it is the first value
    # its lane sees (5) or comes after finite ones (2060).
    generator = torch.Generator().manual_seed(vocab_size + bad_row)
    hidden = torch.randn(9, 8, generator=generator)
    weight = torch.randn(vocab_size, 8, generator=generator)
    labels = torch.randint(0, vocab_size, (9,), generator=generator)
    if where == "hidden":
        hidden[bad_row % 9, 3] = value
    else:
        weight[bad_row, 3] = value
    ref = naive_linear_cross_entropy(hidden.double(), weight.double(), labels)
    hidden, weight, labels = on(backend, hidden, weight, labels)
    loss = fused_linear_cross_entropy(
        hidden.requires_grad_(), weight.requires_grad_(), labels, backend=backend, chunk_size=4
    )
    loss.backward()
    assert not torch.isfinite(ref)  # the unfused path is NaN (or inf) here...
    assert torch.isnan(loss) or not torch.isfinite(loss)  # ...and so are we: never a finite wrong number


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [30.0, 100.0])  # the kernel's bounded-exponent path (<= 40) and the running max
@pytest.mark.parametrize("bad_row", [5, 2060])
def test_nan_with_softcap_gives_nan(backend, softcap, bad_row):
    generator = torch.Generator().manual_seed(bad_row)
    hidden = torch.randn(9, 8, generator=generator)
    weight = torch.randn(2100, 8, generator=generator)
    labels = torch.randint(0, 2100, (9,), generator=generator)
    weight[bad_row, 3] = math.nan
    loss = fused_linear_cross_entropy(
        *on(backend, hidden, weight, labels), softcap=softcap, backend=backend, chunk_size=4
    )
    assert torch.isnan(loss)
