"""The op with a low-rank term in its logits (a LoRA adapter on the head) against float64 references.

The term is ``logits += low_rank_hidden @ low_rank_weight.T``; the reference is the plain op on the
concatenations ``[hidden | low_rank_hidden]`` and ``[weight | low_rank_weight]``, which is the same
logit matrix. The low-rank hidden is built the way LoRA builds it, ``scale * hidden @ A.T``, so the
tests also check the gradients that reach ``A`` and ``hidden`` through it. fp32 results match the
float64 reference to 1e-5 relative (a few ulps times sqrt(V), as for the plain op).
"""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_cross_entropy, fused_linear_log_probs
from lce_patch.ops.linear_cross_entropy import naive_linear_cross_entropy, naive_token_outputs

from .devices import BACKENDS, TRITON_BF16, device_of, on
from .helpers import (
    LORA_SCALE,
    LOW_RANK_OPTION_SETS,
    check_low_rank,
    lora_leaves,
    lora_reference_loss,
    make_lora_inputs,
    rel_err,
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weight_trainable", [False, True], ids=["frozen_weight", "trainable_weight"])
@pytest.mark.parametrize(
    "options", LOW_RANK_OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default"
)
def test_matches_float64_reference(backend, weight_trainable, options):
    check_low_rank(options, backend=backend, weight_trainable=weight_trainable)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("precompute_grad", [False, True])
def test_token_outputs_with_entropy(backend, precompute_grad):
    """Per-token log-probabilities and a differentiable entropy (the recompute backward), and the
    precomputed-gradient path (an NLL mean upstream), as TRL's fused heads use them."""
    hidden, weight, lora_a, lora_b, labels, _ = make_lora_inputs(batch=2, n=13, seed=5)
    ref_h, ref_w, ref_a, ref_b = lora_leaves((hidden, weight, lora_a, lora_b), torch.float64, (True,) * 4)
    low = LORA_SCALE * ref_h @ ref_a.t()
    log_probs, entropy, is_top1 = naive_token_outputs(
        torch.cat([ref_h, low], -1), torch.cat([ref_w, ref_b], 1), labels, softcap=4.0
    )
    valid = labels != -100
    up_lp = torch.randn_like(log_probs) if not precompute_grad else valid.double() / valid.sum()
    up_ent = torch.randn_like(entropy) if not precompute_grad else torch.zeros_like(entropy)
    ref_grads = torch.autograd.grad((log_probs * up_lp + entropy * up_ent).sum(), [ref_h, ref_w, ref_a, ref_b])

    h, w, a, b_up = lora_leaves((hidden, weight, lora_a, lora_b), torch.float32, (True,) * 4, device_of(backend))
    out = fused_linear_log_probs(
        h,
        w,
        on(backend, labels),
        softcap=4.0,
        return_entropy=True,
        return_is_top1=True,
        backend=backend,
        chunk_size=8,
        precompute_grad=precompute_grad,
        low_rank_hidden=LORA_SCALE * h @ a.t(),
        low_rank_weight=b_up,
    )
    assert rel_err(out.log_probs, log_probs) < 1e-5 and rel_err(out.entropy, entropy) < 1e-5
    assert torch.equal(out.is_top1.cpu(), is_top1)
    up_lp, up_ent = on(backend, up_lp.float(), up_ent.float())
    if precompute_grad:
        (out.log_probs * up_lp).sum().backward()
    else:
        (out.log_probs * up_lp + out.entropy * up_ent).sum().backward()
    for name, tensor, want in zip(("hidden", "weight", "A", "B"), (h, w, a, b_up), ref_grads):
        assert rel_err(tensor.grad, want) < 1e-5, (name, rel_err(tensor.grad, want))


def test_float64_on_torch():
    hidden, weight, lora_a, lora_b, labels, _ = make_lora_inputs(seed=1)
    h, w, a, b_up = lora_leaves((hidden, weight, lora_a, lora_b), torch.float64, (True, False, True, True))
    ref = lora_reference_loss(h, w, a, b_up, labels, None, {})
    ref_grads = torch.autograd.grad(ref, [h, a, b_up])
    out = fused_linear_cross_entropy(
        h, w, labels, low_rank_hidden=LORA_SCALE * h @ a.t(), low_rank_weight=b_up, backend="torch", chunk_size=8
    )
    assert out.dtype == torch.float64
    grads = torch.autograd.grad(out, [h, a, b_up])
    assert rel_err(out, ref) < 1e-12
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_model_with_fp32_adapter(backend, dtype):
    """PEFT keeps the adapter in fp32 beside a half-precision model: the term is cast to the model's dtype
    (as PEFT's output is), and A and B get fp32 gradients. Tolerances: bf16 rounds to 2**-9 relative,
    fp16 to 2**-12, on logits and on the gradient products."""
    if backend == "triton" and dtype == torch.bfloat16 and not TRITON_BF16:
        pytest.skip("bf16 tl.dot is broken in the Triton CPU interpreter")
    hidden, weight, lora_a, lora_b, labels, _ = make_lora_inputs(n=64, d=32, v=96, rank=8, seed=2)
    ref_h, ref_w, ref_a, ref_b = lora_leaves((hidden, weight, lora_a, lora_b), torch.float64, (True, False, True, True))
    ref = lora_reference_loss(ref_h, ref_w, ref_a, ref_b, labels, None, {})
    ref_grads = torch.autograd.grad(ref, [ref_h, ref_a, ref_b])

    device = device_of(backend)
    h = hidden.to(device, dtype).requires_grad_()
    w = weight.to(device, dtype)
    a, b_up = lora_leaves((lora_a, lora_b), torch.float32, (True, True), device)
    low = LORA_SCALE * h.float() @ a.t()  # PEFT casts the input to the adapter's dtype
    out = fused_linear_cross_entropy(
        h, w, on(backend, labels), low_rank_hidden=low, low_rank_weight=b_up, backend=backend
    )
    out.backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert rel_err(out, ref) < tol / 4
    assert h.grad.dtype == dtype and a.grad.dtype == torch.float32 and b_up.grad.dtype == torch.float32
    for name, got, want in zip(("hidden", "A", "B"), (h.grad, a.grad, b_up.grad), ref_grads):
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs(backend):
    """A transposed low-rank weight (a view of [r, V]), a non-contiguous low-rank hidden (a column slice)
    and an expanded one (the same term for every row of a batch)."""
    hidden, weight, lora_a, lora_b, labels, _ = make_lora_inputs(batch=3, n=7, seed=4)
    rank = lora_b.shape[1]
    wide = torch.randn(3, 7, 2 * rank, dtype=torch.float64)
    for low in (wide[..., ::2], torch.randn(1, 7, rank, dtype=torch.float64).expand(3, 7, rank)):
        up_t = on(backend, lora_b).t().contiguous().t()  # [V, r] with strides (1, V)
        ref = naive_linear_cross_entropy(torch.cat([hidden, low], -1), torch.cat([weight, lora_b], 1), labels)
        up = up_t.float().requires_grad_()
        out = fused_linear_cross_entropy(
            *on(backend, hidden.float(), weight.float(), labels), low_rank_hidden=on(backend, low.float()),
            low_rank_weight=up, backend=backend,
        )  # fmt: skip
        out.backward()
        ref_up = lora_b.clone().requires_grad_()
        ref2 = naive_linear_cross_entropy(torch.cat([hidden, low], -1), torch.cat([weight, ref_up], 1), labels)
        ref2.backward()
        assert rel_err(out, ref) < 1e-5
        assert rel_err(up.grad, ref_up.grad) < 1e-5


@pytest.mark.parametrize("output", ["mean", "log_probs", "log_probs_precomputed"])
def test_compiled_is_one_graph_with_eager_numbers(output):
    """Under torch.compile the low-rank op is the custom operator (one graph, no break) and gives the eager
    numbers: a scalar loss, per-token log-probs (recomputed backward) and precomputed log-prob gradients."""
    hidden, weight, lora_a, lora_b, labels, _ = make_lora_inputs(seed=6)
    labels[::5] = -100
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def loss_fn(h, w, a, b_up, labels):
        low_rank = dict(low_rank_hidden=LORA_SCALE * h @ a.t(), low_rank_weight=b_up, softcap=3.0, chunk_size=8)
        if output == "mean":
            return fused_linear_cross_entropy(h, w, labels, skip_ignored=True, **low_rank)
        outputs = fused_linear_log_probs(
            h, w, labels, precompute_grad=output == "log_probs_precomputed", skip_ignored=True, **low_rank
        )
        weights = 1.0 if output == "log_probs_precomputed" else torch.linspace(0.5, 1.5, labels.numel())
        return -(outputs.log_probs.reshape(-1) * weights).sum()

    results = []
    for fn in (loss_fn, torch.compile(loss_fn, backend=capture, fullgraph=True)):
        h, w, a, b_up = lora_leaves((hidden, weight, lora_a, lora_b), torch.float32, (True, False, True, True))
        loss = fn(h, w, a, b_up, labels)
        loss.backward()
        results.append((loss.detach(), h.grad, a.grad, b_up.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count("lce_patch.linear_cross_entropy.default") == 1, targets


def test_bad_low_rank_inputs():
    hidden, weight, lora_a, lora_b, labels, _ = make_lora_inputs(seed=7)
    h, w = hidden.float(), weight.float()
    low, up = (h @ lora_a.float().t()), lora_b.float()
    with pytest.raises(ValueError, match="pass both or neither"):
        fused_linear_cross_entropy(h, w, labels, low_rank_hidden=low)
    with pytest.raises(ValueError, match=r"low_rank_weight must be a \[V, r\] tensor"):
        fused_linear_cross_entropy(h, w, labels, low_rank_hidden=low, low_rank_weight=up[:-1])
    with pytest.raises(ValueError, match="low_rank_hidden must have shape"):
        fused_linear_cross_entropy(h, w, labels, low_rank_hidden=low[:, :2], low_rank_weight=up)
    with pytest.raises(ValueError, match="unsupported dtype"):
        fused_linear_cross_entropy(h, w, labels, low_rank_hidden=low.long(), low_rank_weight=up)
