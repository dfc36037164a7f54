"""``fused_linear_log_probs``: per-token log-probabilities, entropy, top-1 flags and distribution statistics
against the float64 reference, with their gradients (recomputed, or precomputed and rescaled).
"""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_log_probs
from lce_patch.ops.linear_cross_entropy import (
    naive_distribution_statistics,
    naive_logits,
    naive_token_outputs,
)
from lce_patch.ops.linear_cross_entropy.launchers import _BLOCK_V_STATS as BLOCK

from .devices import BACKENDS, device_of, on
from .helpers import leaf, make_inputs, rel_err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options", [{}, {"softcap": 2.0, "temperature": 0.7}, {"logit_scale": 1.3, "temperature": 1.5}]
)
def test_token_outputs_and_their_gradients(backend, options):
    hidden, weight, labels, b = make_inputs(bias=True, batch=2, n=11)
    ref_inputs = [hidden.requires_grad_(), weight.requires_grad_(), b.requires_grad_()]
    log_probs, entropy, is_top1 = naive_token_outputs(hidden, weight, labels, bias=b, **options)
    up_lp, up_ent = torch.randn_like(log_probs), torch.randn_like(entropy)
    ref_grads = torch.autograd.grad((log_probs * up_lp + entropy * up_ent).sum(), ref_inputs)

    h, w, bb = (leaf(t, torch.float32, device=device_of(backend)) for t in (hidden, weight, b))
    out = fused_linear_log_probs(
        h, w, on(backend, labels), bias=bb, return_entropy=True, return_is_top1=True, backend=backend, chunk_size=4,
        **options,
    )  # fmt: skip
    assert out.log_probs.shape == labels.shape and out.entropy.shape == labels.shape
    assert rel_err(out.log_probs, log_probs) < 1e-5
    assert rel_err(out.entropy, entropy) < 1e-5
    assert torch.equal(out.is_top1.cpu(), is_top1)
    assert torch.equal(out.label_mask.cpu(), labels != -100)
    (out.log_probs * on(backend, up_lp.float()) + out.entropy * on(backend, up_ent.float())).sum().backward()
    for got, want in zip((h, w, bb), ref_grads):
        assert rel_err(got.grad, want) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"softcap": 2.0, "temperature": 0.7},
        {"logit_scale": 1.3, "temperature": 1.5, "skip_ignored": True},
        {"softcap": 30.0, "logit_shift": -29.0},  # logits near -softcap: e^(2 (z - bound)) would underflow
        {"logit_spread": 50.0},  # peaked distributions: sum p**2 near 1, log near 0
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain",
)
def test_mean_logits_and_log_sum_sq_probs(backend, options):
    # TRL's DPO/KTO metrics (logits/*) and WPO weights; no gradient, and they leave the others' untouched.
    options = dict(options)
    shift, spread = options.pop("logit_shift", 0.0), options.pop("logit_spread", 1.0)
    skip_ignored = options.pop("skip_ignored", False)
    hidden, weight, labels, b = make_inputs(bias=True, batch=2, n=11, v=3 * BLOCK // 2 if backend == "triton" else 101)
    weight = weight * spread
    b = b * 0.0 + shift
    ref_inputs = [hidden.requires_grad_(), weight.requires_grad_()]
    log_probs, entropy, _ = naive_token_outputs(hidden, weight, labels, bias=b, **options)
    mean_logits, log_sum_sq = naive_distribution_statistics(hidden, weight, labels, bias=b, **options)
    up_lp, up_ent = torch.randn_like(log_probs), torch.randn_like(entropy)
    ref_grads = torch.autograd.grad((log_probs * up_lp + entropy * up_ent).sum(), ref_inputs)

    device = device_of(backend)
    h, w = leaf(hidden, torch.float32, device=device), leaf(weight, torch.float32, device=device)
    bb = leaf(b, torch.float32, False, device=device)
    out = fused_linear_log_probs(
        h, w, on(backend, labels), bias=bb, return_entropy=True, return_mean_logits=True,
        return_log_sum_sq_probs=True, backend=backend, chunk_size=4, skip_ignored=skip_ignored, **options,
    )  # fmt: skip
    assert out.is_top1 is None
    # fp32 logits carry an absolute error of a few ulps of the largest logit; both statistics are sums of
    # (differences of) logits, so their error is bounded by about that: 1e-6 of the largest |logit|, floored at 1e-5.
    largest_logit = naive_logits(hidden, weight, b, logit_scale=options.get("logit_scale", 1.0)).abs().max().item()
    atol = 1e-6 * max(10.0, largest_logit)
    for got, want in ((out.mean_logits, mean_logits), (out.log_sum_sq_probs, log_sum_sq)):
        assert got.shape == labels.shape and got.dtype == torch.float32 and not got.requires_grad
        got = got.cpu()
        assert torch.isfinite(got).all()
        assert (got[labels == -100] == 0).all()
        assert (got - want).abs().max() < atol, (got, want)
    log_probs_error = (out.log_probs.detach().cpu() - log_probs).abs().max()
    assert log_probs_error < atol and (out.entropy.detach().cpu() - entropy).abs().max() < atol
    (out.log_probs * on(backend, up_lp.float()) + out.entropy * on(backend, up_ent.float())).sum().backward()
    for got, want in zip((h, w), ref_grads):
        assert rel_err(got.grad, want) < 1e-5 * spread


def test_statistics_are_only_computed_when_asked():
    hidden, weight, labels, _ = make_inputs()
    out = fused_linear_log_probs(hidden.float(), weight.float(), labels, backend="torch")
    assert out.mean_logits is None and out.log_sum_sq_probs is None and out.entropy is None
    with pytest.raises(ValueError, match="return_mean_logits must be a bool"):
        fused_linear_log_probs(hidden.float(), weight.float(), labels, return_mean_logits=1)


def test_float64_statistics_stay_float64():
    hidden, weight, labels, _ = make_inputs()
    out = fused_linear_log_probs(
        hidden, weight, labels, return_mean_logits=True, return_log_sum_sq_probs=True, backend="torch"
    )
    mean_logits, log_sum_sq = naive_distribution_statistics(hidden, weight, labels)
    assert out.mean_logits.dtype == torch.float64 and out.log_sum_sq_probs.dtype == torch.float64
    assert torch.allclose(out.mean_logits, mean_logits, rtol=0, atol=1e-12)
    assert torch.allclose(out.log_sum_sq_probs, log_sum_sq, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("skip_ignored", [False, True])
@pytest.mark.parametrize("upstream", ["mean", "weighted"])
def test_precomputed_token_gradients(backend, skip_ignored, upstream, monkeypatch):
    # precompute_grad: a mean of log_probs is served from the forward's gradients (no recompute GEMMs);
    # any other upstream gradient falls back to the recompute. Both must equal the reference, and a
    # second backward (retain_graph) too.
    from lce_patch.ops.linear_cross_entropy import chunked

    projections = []
    real_matmul = chunked.logits_into
    monkeypatch.setattr(chunked, "logits_into", lambda *a: projections.append(1) or real_matmul(*a))
    hidden, weight, labels, b = make_inputs(bias=True, batch=2, n=11, seed=5)
    labels[:, :3] = -100
    log_probs, _, _ = naive_token_outputs(hidden.requires_grad_(), weight.requires_grad_(), labels, bias=b)
    weights = torch.ones_like(log_probs) if upstream == "mean" else torch.rand(log_probs.shape, dtype=torch.float64)
    ref_loss = -(log_probs * weights).sum() / (labels != -100).sum()
    ref_grads = torch.autograd.grad(ref_loss, [hidden, weight])

    device = device_of(backend)
    h, w = leaf(hidden, torch.float32, device=device), leaf(weight, torch.float32, device=device)
    out = fused_linear_log_probs(
        h, w, on(backend, labels), bias=leaf(b, torch.float32, requires_grad=False, device=device),
        return_entropy=True, backend=backend, chunk_size=4, skip_ignored=skip_ignored, precompute_grad=True,
    )  # fmt: skip
    forward_projections = len(projections)
    loss = -(out.log_probs * on(backend, weights.float())).sum() / out.label_mask.sum()
    for attempt in range(2):
        grads = torch.autograd.grad(loss, [h, w], retain_graph=True)
        for got, want in zip(grads, ref_grads):
            assert rel_err(got, want) < 1e-5, (attempt, rel_err(got, want))
        recomputed = len(projections) > forward_projections
        assert recomputed == (upstream == "weighted" or attempt == 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("skip_ignored", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
def test_precomputed_token_gradients_of_a_frozen_softcapped_head(backend, skip_ignored, entropy):
    # TRL's SFT path under LoRA on a Gemma-2 head: per-token log-probs (and entropy) with precompute_grad, dh only.
    # Without the entropy this runs the one-pass softcapped gradient (rows scaled by row_factor); with it the
    # two-pass one (the entropy needs the running max): both must give the reference's dh.
    hidden, weight, labels, _ = make_inputs(batch=2, n=11, seed=6)
    labels[:, :3] = -100
    log_probs, _, _ = naive_token_outputs(hidden.requires_grad_(), weight, labels, softcap=5.0)
    ref_grad = torch.autograd.grad(-log_probs.sum() / (labels != -100).sum(), hidden)[0]

    device = device_of(backend)
    h = leaf(hidden, torch.float32, device=device)
    w = leaf(weight, torch.float32, requires_grad=False, device=device)
    out = fused_linear_log_probs(
        h, w, on(backend, labels), softcap=5.0, return_entropy=entropy, backend=backend, chunk_size=4,
        skip_ignored=skip_ignored, precompute_grad=True,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(-out.log_probs.sum() / out.label_mask.sum(), [h])
    assert rel_err(grad, ref_grad) < 1e-5, rel_err(grad, ref_grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_top1_when_target_is_the_argmax(backend):
    hidden, weight, labels, _ = make_inputs(ignore_every=0)
    logits = hidden @ weight.T
    labels[:10] = logits[:10].argmax(-1)
    out = fused_linear_log_probs(
        *on(backend, hidden.float(), weight.float(), labels), return_is_top1=True, backend=backend
    )
    assert out.is_top1[:10].all()
    assert torch.equal(out.is_top1.cpu(), logits.argmax(-1) == labels)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("first, second", [(8, 11), (3, 4100), (4100, 4101)], ids=str)
def test_is_top1_breaks_ties_at_the_first_index_like_argmax(backend, first, second):
    """Two equal maximal logits: only the first counts as the argmax (torch.argmax's rule), whether
    they share a lane of the Triton kernel (8 consecutive logits), sit in different blocks, or in the
    masked tail block."""
    generator = torch.Generator().manual_seed(first + second)
    hidden = torch.rand(6, 8, generator=generator) + 0.5
    weight = torch.randn(4104, 8, generator=generator) * 0.1
    weight[first] = weight[second] = 3.0
    labels = torch.tensor([first, second] * 3)
    out = fused_linear_log_probs(*on(backend, hidden, weight, labels), return_is_top1=True, backend=backend)
    assert torch.equal(out.is_top1.cpu(), torch.tensor([True, False] * 3))
