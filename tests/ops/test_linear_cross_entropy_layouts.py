"""Every tensor layout a user may pass gives the float64 reference's answer, on both backends.

Each case builds its inputs as *views* of contiguous base tensors (transposed, sliced, permuted,
expanded), runs the op on the views, and compares the loss (or the per-token outputs) and the
gradients of the base tensors with the same views of float64 bases through the unfused reference.
The Triton backend runs on the GPU under LCE_TEST_GPU=1, else under the CPU interpreter, in fp32 and
fp16 (bf16 dots are broken in the interpreter; ``benchmarks/checks/gpu_check.py`` runs the same matrix on a
GPU in bf16 too); its views are taken on its device (devices.py). Tolerances: fp32 1e-5 (a few
ulps times sqrt(V)); fp16 5e-3 (every logit is rounded to 11 bits, as in test_half_precision).
"""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_cross_entropy, fused_linear_log_probs
from lce_patch.ops.linear_cross_entropy import (
    naive_distribution_statistics,
    naive_linear_cross_entropy,
    naive_token_outputs,
)

from .devices import BACKENDS, CPU, device_of, on
from .helpers import rel_err

N, T, B, D, V = 24, 12, 2, 16, 70
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3}


def _labels(generator, shape, ignore_every=5):
    labels = torch.randint(0, V, shape, generator=generator)
    labels.view(-1)[::ignore_every] = -100
    return labels


# Each case: name -> function(generator) returning (bases, make) where ``bases`` are the float64
# tensors that carry gradients (hidden_base, weight_base, bias_base or None) plus integer label bases,
# and ``make(hidden_base, weight_base, bias_base)`` returns (hidden, weight, bias, labels, shift) views.
def _hidden_transposed(g):  # column-major hidden: stride (1, N)
    return dict(hidden=torch.randn(D, N, generator=g)), lambda t: t["hidden"].t()


def _hidden_column_strided(g):  # every other feature of a wider tensor
    return dict(hidden=torch.randn(N, 2 * D, generator=g)), lambda t: t["hidden"][:, ::2]


def _hidden_row_strided(g):
    return dict(hidden=torch.randn(2 * N, D, generator=g)), lambda t: t["hidden"][1::2]


def _hidden_permuted_3d(g):  # [T, B, D] permuted to [B, T, D]: no [N, D] view exists
    return dict(hidden=torch.randn(T, B, D, generator=g)), lambda t: t["hidden"].permute(1, 0, 2)


def _hidden_expanded(g):  # one hidden state per sequence, broadcast over its positions
    return dict(hidden=torch.randn(B, 1, D, generator=g)), lambda t: t["hidden"].expand(B, T, D)


HIDDEN_CASES = {
    "contiguous": lambda g: (dict(hidden=torch.randn(N, D, generator=g)), lambda t: t["hidden"]),
    "transposed": _hidden_transposed,
    "column_strided": _hidden_column_strided,
    "row_strided": _hidden_row_strided,
    "permuted_3d": _hidden_permuted_3d,
    "expanded_3d": _hidden_expanded,
}
WEIGHT_CASES = {
    "contiguous": lambda g: torch.randn(V, D, generator=g),
    "transposed": lambda g: torch.randn(D, V, generator=g).t(),
    "row_strided": lambda g: torch.randn(2 * V, D, generator=g)[::2],
    "column_strided": lambda g: torch.randn(V, 3 * D, generator=g)[:, 1::3],
}
LABEL_CASES = ("contiguous", "sliced", "expanded", "transposed")


def _make_labels(case: str, shape: tuple, generator, device=CPU) -> torch.Tensor:
    # the view is taken on ``device``: a copy to another device would not keep the layout
    if case == "contiguous":
        return _labels(generator, shape).to(device)
    if case == "sliced":
        return _labels(generator, (*shape[:-1], 2 * shape[-1])).to(device)[..., ::2]
    if case == "expanded":  # one label repeated along the last dim
        first = _labels(generator, (*shape[:-1], 1), ignore_every=3)
        return first.to(device).expand(shape)
    if len(shape) == 2:  # transposed 2-D
        return _labels(generator, shape[::-1]).to(device).t()
    return _labels(generator, (2, shape[0])).to(device)[1]  # 1-D: a row of a 2-D tensor, stride 1 but offset


def _run_case(
    hidden_case, weight_case, label_case, *, backend, dtype, bias, shift=False, per_token=False, chunk_size=7
):
    g = torch.Generator().manual_seed(hash((hidden_case, weight_case, label_case, bias, shift, per_token)) % 2**31)
    device = device_of(backend)
    hidden_bases, make_hidden = HIDDEN_CASES[hidden_case](g)
    weight_base = WEIGHT_CASES[weight_case](g)
    bias_base = torch.randn(2 * V, generator=g)[::2] if bias else None  # strided bias
    hidden_base = hidden_bases["hidden"].double()
    with torch.no_grad():
        weight_base = weight_base.double() / D**0.5 * 2
    hidden_shape = make_hidden({"hidden": hidden_base}).shape
    labels = _make_labels(label_case, tuple(hidden_shape[:-1]), g, device)
    ref_labels = labels.cpu()

    # The float64 leaves are the bases themselves; the copies in ``dtype`` (on the backend's device) keep
    # their strides, so the op sees the layout under test.
    def as_layout(t, dtype_):
        out = torch.empty_strided(t.shape, t.stride(), dtype=dtype_, device=device)
        out.copy_(t)
        return out

    ref_h = hidden_base.detach().requires_grad_()
    ref_w = weight_base.detach().requires_grad_()
    ref_b = None if bias_base is None else bias_base.double().detach().requires_grad_()
    h = as_layout(hidden_base, dtype).requires_grad_()
    w = as_layout(weight_base, dtype).requires_grad_()
    b = None if bias_base is None else as_layout(bias_base, dtype).requires_grad_()
    assert w.stride() == weight_base.stride() and h.stride() == hidden_base.stride()

    if per_token:
        ref = naive_token_outputs(make_hidden({"hidden": ref_h}), ref_w, ref_labels, bias=ref_b)
        out = fused_linear_log_probs(
            make_hidden({"hidden": h}), w, labels, bias=b, shift=shift, return_entropy=True, return_is_top1=True,
            return_mean_logits=True, return_log_sum_sq_probs=True, backend=backend, chunk_size=chunk_size,
        )  # fmt: skip
        statistics = naive_distribution_statistics(make_hidden({"hidden": ref_h}), ref_w, ref_labels, bias=ref_b)
        for got, want in zip((out.mean_logits, out.log_sum_sq_probs), statistics, strict=True):
            assert rel_err(got, want) < TOLERANCE[dtype]
        g_lp, g_ent = torch.randn_like(ref[0]), torch.randn_like(ref[1])
        ref_loss = (ref[0] * g_lp + ref[1] * g_ent).sum()
        loss = (out.log_probs * on(backend, g_lp.float()) + out.entropy * on(backend, g_ent.float())).sum()
        tol = TOLERANCE[dtype]
        assert rel_err(out.log_probs, ref[0]) < tol and rel_err(out.entropy, ref[1]) < tol
        if dtype == torch.float32:
            assert torch.equal(out.is_top1.cpu(), ref[2])
    else:
        ref_loss = naive_linear_cross_entropy(
            make_hidden({"hidden": ref_h}), ref_w, ref_labels, bias=ref_b, shift=shift
        )
        loss = fused_linear_cross_entropy(
            make_hidden({"hidden": h}), w, labels, bias=b, shift=shift, backend=backend, chunk_size=chunk_size
        )
        assert rel_err(loss, ref_loss) < TOLERANCE[dtype], (float(loss), float(ref_loss))
    ref_loss.backward()
    loss.backward()
    for name, got, want in (("hidden", h, ref_h), ("weight", w, ref_w), ("bias", b, ref_b)):
        if got is None:
            continue
        assert got.grad is not None and got.grad.shape == got.shape, name
        assert rel_err(got.grad, want.grad) < TOLERANCE[dtype], (name, rel_err(got.grad, want.grad))


DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hidden_case", list(HIDDEN_CASES))
def test_hidden_layouts(backend, dtype, hidden_case):
    _run_case(hidden_case, "contiguous", "contiguous", backend=backend, dtype=dtype, bias=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weight_case", [c for c in WEIGHT_CASES if c != "contiguous"])
def test_weight_and_bias_layouts(backend, dtype, weight_case):
    _run_case("contiguous", weight_case, "contiguous", backend=backend, dtype=dtype, bias=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label_case", [c for c in LABEL_CASES if c != "contiguous"])
def test_label_layouts(backend, dtype, label_case):
    _run_case("contiguous", "contiguous", label_case, backend=backend, dtype=dtype, bias=False)
    _run_case("permuted_3d", "contiguous", label_case, backend=backend, dtype=dtype, bias=False, shift=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_outputs_of_views(backend, dtype):
    _run_case("transposed", "transposed", "sliced", backend=backend, dtype=dtype, bias=True, per_token=True)
    _run_case("permuted_3d", "column_strided", "transposed", backend=backend, dtype=dtype, bias=False, per_token=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_view_at_once_with_skipped_rows(backend):
    """Transposed hidden and weight, strided bias and sliced labels, with skip_ignored (rows gathered)."""
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(D, N, generator=g, dtype=torch.float64).t()
    weight = (torch.randn(D, V, generator=g, dtype=torch.float64) / D**0.5 * 2).t()
    bias = torch.randn(2 * V, generator=g, dtype=torch.float64)[::2]
    label_base = _labels(g, (2 * N,))
    labels = label_base[::2]
    ref_inputs = [t.detach().requires_grad_() for t in (hidden, weight, bias)]
    ref = naive_linear_cross_entropy(ref_inputs[0], ref_inputs[1], labels, bias=ref_inputs[2])
    ref.backward()
    ours = []
    for t in (hidden, weight, bias):
        copy = torch.empty_strided(t.shape, t.stride(), dtype=torch.float32, device=device_of(backend))
        ours.append(copy.copy_(t).requires_grad_())
    loss = fused_linear_cross_entropy(
        ours[0], ours[1], on(backend, label_base)[::2], bias=ours[2], backend=backend, chunk_size=5, skip_ignored=True
    )
    loss.backward()
    assert rel_err(loss, ref) < 1e-5
    for got, want in zip(ours, ref_inputs):
        assert rel_err(got.grad, want.grad) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_views_through_the_default_chunks_with_a_folded_tail(backend, dtype, monkeypatch):
    """Transposed hidden and weight, strided bias, sliced labels at the default chunking, made to end in a
    folded tail (10-row chunks, a 4-row remainder joined to the last: 10 + 14 rows)."""
    from lce_patch.ops.core import chunking

    monkeypatch.setattr(chunking, "default_chunk_rows", lambda *args, **kwargs: 10)
    monkeypatch.setattr(chunking, "TAIL_FOLD_FRACTION", 2)
    assert chunking.chunk_spans(N, 10, fold_tail=True) == ((0, 10), (10, N))
    for per_token in (False, True):
        _run_case(
            "transposed", "transposed", "sliced", backend=backend, dtype=dtype, bias=True, per_token=per_token,
            chunk_size=None,
        )  # fmt: skip
