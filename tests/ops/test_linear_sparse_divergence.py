"""fused_linear_sparse_divergence against its float64 full-logits reference, TRL's and axolotl's own losses.

The torch backend runs in float64 here on the CPU; the Triton kernels run on the GPU under LCE_TEST_GPU=1, else
under TRITON_INTERPRET=1 on the CPU (set in conftest.py), in fp32 (bf16 where devices.py's TRITON_BF16 says so);
devices.py places each backend's inputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lce_patch
from lce_patch import fused_linear_sparse_divergence
from lce_patch.ops.linear_sparse_divergence import naive_linear_sparse_divergence

from .devices import BACKENDS, CPU, TRITON_BF16, TRITON_DEVICE, device_of, on, placed
from .helpers import D, K, N, V, rel_err, sparse_divergence_problem

REPO = Path(__file__).resolve().parents[2]
BETAS = [0.0, 0.5, 1.0]
# the three supports: renormalized over the candidates (TRL without the tail), TRL's tail bucket, and the
# candidates as given (axolotl's top-K forward KL)
SUPPORTS = {
    "renormalized": dict(),
    "tail": dict(add_tail_bucket=True),
    "as_given": dict(renormalize=False),
}


def leaves(problem: dict, dtype: torch.dtype, device: torch.device = CPU) -> dict:
    out = {}
    for name, value in problem.items():
        value = value.to(device)
        if name in ("hidden", "weight", "bias"):
            value = value.to(dtype).clone().requires_grad_(True)
        out[name] = value
    return out


def run(fn, inputs: dict, upstream: torch.Tensor | None = None, **options):
    if fn is fused_linear_sparse_divergence:
        loss, entropy = fn(**inputs, **options, return_entropy=True)
    else:
        loss, entropy = fn(**inputs, **options)
    (loss * upstream.to(loss.device)).sum().backward() if upstream is not None else loss.backward()
    grads = {name: inputs[name].grad for name in ("hidden", "weight", "bias") if name in inputs}
    return loss.detach(), entropy.detach(), grads


def assert_matches(fused, reference, rtol: float, atol: float) -> None:
    loss, entropy, grads = fused
    ref_loss, ref_entropy, ref_grads = reference
    torch.testing.assert_close(loss.cpu().double(), ref_loss.double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(entropy.cpu().double(), ref_entropy.double(), rtol=rtol, atol=atol)
    for name, grad in ref_grads.items():
        scale = max(float(grad.abs().max()), 1e-12)
        torch.testing.assert_close(
            grads[name].cpu().double() / scale, grad.double() / scale, rtol=rtol, atol=atol, msg=name
        )


OPTIONS = {
    "plain": {},
    "temperature": dict(temperature=0.7),
    "softcap_scale_bias": dict(softcap=3.0, logit_scale=1.5, temperature=1.3),
    "sum": dict(reduction="sum"),
    "num_items": dict(num_items_in_batch=23),
    "num_items_tensor": dict(num_items_in_batch=torch.tensor(7)),
}


# float64 against float64: the two differ only in the order of floating-point sums (~1e-15 relative)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("support", list(SUPPORTS))
@pytest.mark.parametrize("case", list(OPTIONS))
def test_float64_equals_the_reference(beta, support, case):
    problem = sparse_divergence_problem(hash((beta, support, case)) % 1000, bias=case == "softcap_scale_bias")
    options = dict(OPTIONS[case], **SUPPORTS[support], beta=beta)
    reference = run(naive_linear_sparse_divergence, leaves(problem, torch.float64), **options)
    fused = run(fused_linear_sparse_divergence, leaves(problem, torch.float64), chunk_size=4, **options)
    assert_matches(fused, reference, rtol=1e-10, atol=1e-12)


# fp32 logits and statistics against float64 (rounding ~1e-7 relative, amplified by V-term sums)
@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton unavailable")
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("support", list(SUPPORTS))
@pytest.mark.parametrize("case", ["plain", "softcap_scale_bias", "num_items_tensor"])
def test_triton_kernels_equal_the_reference(beta, support, case):
    problem = sparse_divergence_problem(hash((beta, support, case, "triton")) % 1000, bias=case == "softcap_scale_bias")
    options = dict(OPTIONS[case], **SUPPORTS[support], beta=beta)
    reference = run(naive_linear_sparse_divergence, leaves(problem, torch.float64), **options)
    fused = run(
        fused_linear_sparse_divergence,
        leaves(problem, torch.float32, TRITON_DEVICE),
        backend="triton",
        chunk_size=4,
        **placed(options, TRITON_DEVICE),
    )
    assert_matches(fused, reference, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("support", ["renormalized", "tail"])
def test_per_token_loss_with_uneven_upstream_gradients(beta, support, backend):
    # reduction="none" recomputes each chunk in the backward with every position's own upstream gradient
    problem = sparse_divergence_problem(5, leading=(3, 5), bias=True)
    upstream = torch.randn(3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    options = dict(SUPPORTS[support], beta=beta, reduction="none", softcap=4.0)
    reference = run(naive_linear_sparse_divergence, leaves(problem, torch.float64), upstream, **options)
    dtype, rtol, atol = (torch.float64, 1e-10, 1e-12) if backend == "torch" else (torch.float32, 2e-5, 2e-5)
    fused = run(
        fused_linear_sparse_divergence,
        leaves(problem, dtype, device_of(backend)),
        upstream.to(dtype),
        chunk_size=4,
        backend=backend,
        **options,
    )
    assert_matches(fused, reference, rtol=rtol, atol=atol)
    no_candidate = ~problem["candidate_mask"].any(-1)
    assert no_candidate.any() and torch.all(fused[0].cpu()[no_candidate] == 0)


# fp32: logits and statistics in fp32; fp16 / bf16: inputs rounded to 11 / 8 mantissa bits before the GEMM (on the
# reference too), the GEMM's output and G rounded to them once more, dW summed over chunks in that dtype (bf16)
TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 8e-2}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("beta", BETAS)
def test_low_precision_inputs_against_float64_of_the_same_inputs(dtype, beta, backend):
    if backend == "triton" and dtype == torch.bfloat16 and not TRITON_BF16:
        pytest.skip("bf16 on the Triton backend: compiled kernels only (devices.py)")
    problem = sparse_divergence_problem(11, bias=True)
    rounded = {k: (v.to(dtype).double() if k in ("hidden", "weight", "bias") else v) for k, v in problem.items()}
    options = dict(beta=beta, softcap=4.0, add_tail_bucket=beta == 0.5)
    reference = run(naive_linear_sparse_divergence, leaves(rounded, torch.float64), **options)
    fused = run(
        fused_linear_sparse_divergence,
        leaves(problem, dtype, device_of(backend)),
        chunk_size=6,
        backend=backend,
        **options,
    )
    assert fused[0].dtype == torch.float32 and fused[1].dtype == torch.float32
    assert all(grad.dtype == dtype for grad in fused[2].values())
    tol = TOLERANCES[dtype]
    assert_matches(fused, reference, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("beta", "reduction"), [(0.0, "mean"), (0.5, "none"), (1.0, "mean")])
def test_fp32_logits_cut_the_bf16_gradient_error(beta, reduction, backend):
    # bf16 inputs; the reference is float64 on the same rounded inputs, so what is left is the op's own rounding.
    # Rounding the logits to bf16 moves each probability by ~2^-9 |z| relative, and the gradient is a small
    # difference of probabilities: that rounding sets most of the default's error. fp32 logits leave the
    # bf16 rounding of G and of the GEMMs' outputs.
    gen = torch.Generator().manual_seed(int(beta * 10) + 7 * (reduction == "none"))
    rows, vocab, width, candidates = 32, 300, 32, 8
    weight = torch.randn(vocab, width, generator=gen)  # logits of a few units to ~20, as real heads give
    hidden = torch.randn(rows, width, generator=gen)
    # the teacher's top-K: the student's own likeliest tokens, with log-probabilities of a sharper softmax
    top = (hidden @ weight.T).topk(candidates, dim=-1)
    problem = dict(
        hidden=hidden.to(torch.bfloat16),
        weight=weight.to(torch.bfloat16),
        bias=torch.randn(vocab, generator=gen).to(torch.bfloat16),
        candidate_ids=top.indices,
        teacher_logprobs=torch.log_softmax(top.values.double() * 1.3, -1),
    )
    upstream = None
    if reduction == "none":  # bf16-exact, so that the reference's upstream is the op's
        upstream = (torch.rand(rows, generator=gen) + 0.5).to(torch.bfloat16).double()
    options = dict(beta=beta, softcap=30.0, reduction=reduction, add_tail_bucket=beta == 0.5)
    reference = run(naive_linear_sparse_divergence, leaves(problem, torch.float64), upstream, **options)
    errors = {}
    for precise in (False, True):
        fused = run(
            fused_linear_sparse_divergence,
            leaves(problem, torch.bfloat16, device_of(backend)),
            None if upstream is None else upstream.float(),
            chunk_size=16,
            backend=backend,
            fp32_logits=precise,
            fp32_weight_grad=precise,
            **options,
        )
        assert all(grad.dtype == torch.bfloat16 for grad in fused[2].values())
        errors[precise] = {name: rel_err(fused[2][name], reference[2][name]) for name in fused[2]}
    assert all(error < 6e-3 for error in errors[True].values()), errors
    assert sum(errors[True].values()) < 0.5 * sum(errors[False].values()), errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_logits_on_views_equal_the_contiguous_result(backend):
    # bf16 (where the option acts): a transposed hidden and weight, a strided bias, transposed candidate tensors
    # (the kernels do no tl.dot, so bf16 is right in the CPU interpreter too)
    problem = sparse_divergence_problem(15, bias=True)
    problem = {k: v.to(torch.bfloat16) if k in ("hidden", "weight", "bias") else v for k, v in problem.items()}
    problem = dict(zip(problem, on(backend, *problem.values())))

    def run_on(inputs):
        leaves = {k: v.detach().requires_grad_(k in ("hidden", "weight", "bias")) for k, v in inputs.items()}
        loss = fused_linear_sparse_divergence(
            **leaves, beta=0.5, add_tail_bucket=True, backend=backend, chunk_size=4, fp32_logits=True,
            fp32_weight_grad=True,
        )  # fmt: skip
        loss.backward()
        return [loss.float()] + [leaves[k].grad.float() for k in ("hidden", "weight", "bias")]

    viewed = dict(
        problem,
        hidden=problem["hidden"].T.contiguous().T,
        weight=problem["weight"].T.contiguous().T,
        bias=torch.stack([problem["bias"], problem["bias"]], dim=1)[:, 0],
        candidate_ids=problem["candidate_ids"].T.contiguous().T,
        teacher_logprobs=problem["teacher_logprobs"].T.contiguous().T,
    )
    for got, want in zip(run_on(viewed), run_on(problem), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-4)


def _trl_inputs(problem: dict) -> dict:
    """TRL's trainer passes only positions with a candidate (``has_teacher_signal``); its log-probabilities at
    padded slots are replaced by -inf inside."""
    keep = problem["candidate_mask"].any(-1)
    return {name: value[keep] if name != "weight" and name != "bias" else value for name, value in problem.items()}


def _trl_loss(trl, problem: dict, *, beta, add_tail_bucket, softcap, logit_scale, temperature):
    return trl._chunked_jsd_loss(
        problem["hidden"],
        problem["weight"],
        problem.get("bias"),
        logit_scale,
        softcap,
        problem["candidate_ids"],
        problem["teacher_logprobs"],
        problem["candidate_mask"],
        beta,
        temperature,
        add_tail_bucket,
        None,
        1,
        4,
    )[0]


TRL_CASES = {
    "plain": dict(softcap=None, logit_scale=1.0, temperature=1.0, bias=False),
    "softcap_scale_bias_temperature": dict(softcap=3.0, logit_scale=1.5, temperature=0.8, bias=True),
}


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("add_tail_bucket", [False, True])
@pytest.mark.parametrize("case", list(TRL_CASES))
def test_equals_trl_chunked_jsd_loss_in_float64(beta, add_tail_bucket, case, monkeypatch):
    trl = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")
    settings = dict(TRL_CASES[case])
    problem = _trl_inputs(sparse_divergence_problem(21, bias=settings.pop("bias")))
    # TRL upcasts with Tensor.float(): kept as float64 here, so both sides run in float64
    upcast = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t, *a, **k: t if t.dtype == torch.float64 else upcast(t, *a, **k))
    expected_inputs = leaves(problem, torch.float64)
    expected = _trl_loss(trl, expected_inputs, beta=beta, add_tail_bucket=add_tail_bucket, **settings)
    expected.backward()
    monkeypatch.undo()
    inputs = leaves(problem, torch.float64)
    loss = fused_linear_sparse_divergence(
        **inputs, beta=beta, add_tail_bucket=add_tail_bucket, reduction="sum", chunk_size=5, **settings
    )
    loss.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12)
    for name in ("hidden", "weight", "bias"):
        if name in inputs:
            torch.testing.assert_close(inputs[name].grad, expected_inputs[name].grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
def test_equals_trl_as_shipped_in_float32(beta, backend):
    # TRL computes its logits and softmax in fp32: agreement to fp32 rounding (~1e-7, summed over V)
    trl = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")
    problem = {
        k: v.float() if v.is_floating_point() else v
        for k, v in _trl_inputs(sparse_divergence_problem(22, bias=True)).items()
    }
    settings = dict(softcap=3.0, logit_scale=1.5, temperature=0.8)
    expected = _trl_loss(trl, problem, beta=beta, add_tail_bucket=True, **settings)
    loss = fused_linear_sparse_divergence(
        **dict(zip(problem, on(backend, *problem.values()))),
        beta=beta,
        add_tail_bucket=True,
        reduction="sum",
        backend=backend,
        **settings,
    )
    torch.testing.assert_close(loss.cpu(), expected, rtol=2e-5, atol=2e-5)


def _axolotl_problem(seed: int, *, normalized: bool) -> dict:
    """[B, T, K] inputs as axolotl's collator makes them: padded slots with id 0 and log-probability -1e9, whole
    positions masked (prompt tokens); with ``normalized`` the kept log-probabilities of a position sum to 1 and
    a position is kept or masked whole (what its ``kd_normalize_topk`` expects)."""
    problem = sparse_divergence_problem(seed, leading=(2, 7), padded=False)
    gen = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(2, 7, K, generator=gen) > 0.2
    mask[:, :2] = False  # prompt positions
    if normalized:
        mask = mask.all(-1, keepdim=True).expand(2, 7, K).clone()
        mask[0, 3] = True
        problem["teacher_logprobs"] = torch.log_softmax(problem["teacher_logprobs"] * 3, -1)
    problem["candidate_mask"] = mask.int()
    problem["candidate_ids"] = problem["candidate_ids"].masked_fill(~mask, 0)
    problem["teacher_logprobs"] = problem["teacher_logprobs"].masked_fill(~mask, -1e9)
    return problem


AXOLOTL_CASES = [
    # (name, axolotl's function and arguments, the op's arguments, factor on the op's loss): axolotl's Liger loss
    # reports kd_temperature**2 times the sum but back-propagates the sum's gradient (its forward scales only the
    # value), so the factor applies to the loss and not to the gradients compared
    ("forward_kl_mean", dict(function="forward_kl", num_items_in_batch=-1, temperature=1.0), dict(), 1.0),
    ("forward_kl_items_t2", dict(function="forward_kl", num_items_in_batch=9, temperature=2.0), dict(), 1.0),
    *[
        (
            f"liger_beta{beta}_normalize{normalize}",
            dict(function="liger", beta=beta, normalize_topk=normalize, temperature=1.5, chunk_size=4),
            dict(beta=beta, renormalize=normalize, temperature=1.5, reduction="sum"),
            1.5**2,
        )
        for beta in BETAS
        for normalize in (False, True)
    ],
]


def _op_arguments(problem: dict, case: dict, options: dict) -> dict:
    """axolotl's arguments mapped onto the op (the docstring's recipe)."""
    if case["function"] == "liger":
        return options
    items = case["num_items_in_batch"]
    return dict(
        renormalize=False,
        temperature=case["temperature"],
        num_items_in_batch=items if items > 0 else problem["candidate_mask"].sum(),
    )


def _op_result(problem: dict, case: dict, options: dict, factor: float):
    inputs = leaves(problem, torch.float64)
    loss = fused_linear_sparse_divergence(**inputs, **_op_arguments(problem, case, options))
    loss.backward()
    reference = naive_linear_sparse_divergence(
        **leaves(problem, torch.float64), **_op_arguments(problem, case, options)
    )
    return loss.detach() * factor, reference[0].detach() * factor, inputs["hidden"].grad, inputs["weight"].grad


@pytest.mark.parametrize(("name", "case", "options", "factor"), AXOLOTL_CASES, ids=[c[0] for c in AXOLOTL_CASES])
def test_equals_axolotl_topk_kd_when_importable(name, case, options, factor):
    # axolotl lives in an environment of its own (see the next test); in one that has it, its functions run here
    forward_kl = pytest.importorskip("axolotl.integrations.kd.topk_logprob.forward_kl")
    if case["function"] != "forward_kl":
        pytest.skip("the Liger loss is checked in axolotl's own environment")
    problem = _axolotl_problem(31, normalized=False)
    inputs = leaves(problem, torch.float32)
    expected = forward_kl.loss(
        inputs["hidden"] @ inputs["weight"].T,
        inputs["candidate_ids"],
        inputs["teacher_logprobs"],
        inputs["candidate_mask"],
        num_items_in_batch=case["num_items_in_batch"],
        kd_temperature=case["temperature"],
    )
    loss, reference, _, _ = _op_result(problem, case, options, factor)
    # axolotl upcasts to fp32: agreement to fp32 rounding
    torch.testing.assert_close(loss.float(), expected.detach(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(reference, loss, rtol=1e-10, atol=1e-12)


def _axolotl_python() -> str | None:
    configured = os.environ.get("LCE_PATCH_AXOLOTL_PYTHON")
    if configured:
        return configured
    default = REPO / ".ci-deps" / "axolotl" / "bin" / "python"
    return str(default) if default.exists() else None


@pytest.fixture(scope="module")
def axolotl_results(tmp_path_factory):
    python = _axolotl_python()
    if python is None:
        pytest.skip("no axolotl environment (.ci-deps/axolotl or LCE_PATCH_AXOLOTL_PYTHON)")
    workdir = tmp_path_factory.mktemp("axolotl_kd")
    results = {}
    for normalized in (False, True):
        problem = _axolotl_problem(31, normalized=normalized)
        cases = [dict(case, name=name) for name, case, _, _ in AXOLOTL_CASES]
        source, target = workdir / f"inputs_{normalized}.pt", workdir / f"outputs_{normalized}.pt"
        torch.save(
            dict(
                hidden=problem["hidden"],
                weight=problem["weight"],
                ids=problem["candidate_ids"],
                logprobs=problem["teacher_logprobs"],
                mask=problem["candidate_mask"],
                cases=cases,
            ),
            source,
        )
        script = Path(__file__).with_name("axolotl_topk_kd.py")
        proc = subprocess.run(
            [python, str(script), str(source), str(target)], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results[normalized] = (problem, torch.load(target))
    return results


@pytest.mark.slow  # imports axolotl in its own environment: about 20 s
@pytest.mark.parametrize(("name", "case", "options", "factor"), AXOLOTL_CASES, ids=[c[0] for c in AXOLOTL_CASES])
def test_equals_axolotl_topk_kd_in_its_environment(axolotl_results, name, case, options, factor):
    # axolotl's losses evaluated in float64 (axolotl_topk_kd.py) on the inputs its collator would make; the
    # renormalizing Liger loss on positions kept or masked whole, whose teacher log-probabilities sum to 1
    normalized = case.get("normalize_topk", False)
    problem, outputs = axolotl_results[normalized]
    expected = outputs[name]
    loss, reference, hidden_grad, weight_grad = _op_result(problem, case, options, factor)
    torch.testing.assert_close(loss, expected["loss"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(reference, expected["loss"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hidden_grad, expected["hidden"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(weight_grad, expected["weight"], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("support", list(SUPPORTS))
def test_no_position_with_a_candidate_gives_zero_and_zero_gradients(reduction, support, backend):
    problem = leaves(sparse_divergence_problem(4, bias=True), torch.float32, device_of(backend))
    problem["candidate_mask"] = torch.zeros(N, K, dtype=torch.int64, device=device_of(backend))
    options = dict(SUPPORTS[support], reduction=reduction, backend=backend, beta=0.5)
    loss = fused_linear_sparse_divergence(**problem, **options)
    loss.sum().backward()
    assert torch.all(loss == 0)
    assert all(torch.all(problem[name].grad == 0) for name in ("hidden", "weight", "bias"))
    if reduction != "none":
        zero_items = fused_linear_sparse_divergence(**problem, **options, num_items_in_batch=0)
        assert zero_items.item() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_slots_ignore_their_ids_and_log_probabilities(backend):
    problem = {k: v.float() if v.is_floating_point() else v for k, v in sparse_divergence_problem(6).items()}
    problem = dict(zip(problem, on(backend, *problem.values())))
    padded = ~problem["candidate_mask"]
    garbage = dict(
        problem,
        candidate_ids=problem["candidate_ids"].masked_fill(padded, 10**9),
        teacher_logprobs=problem["teacher_logprobs"].masked_fill(padded, float("inf")),
    )
    clean = dict(problem, teacher_logprobs=problem["teacher_logprobs"].masked_fill(padded, 0.0))
    for support in SUPPORTS.values():
        options = dict(support, beta=0.5, backend=backend, reduction="none")
        torch.testing.assert_close(
            fused_linear_sparse_divergence(**garbage, **options), fused_linear_sparse_divergence(**clean, **options)
        )


@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_chunking_does_not_change_the_result(chunk_size):
    problem = sparse_divergence_problem(14, bias=True)
    options = dict(beta=0.5, add_tail_bucket=True, softcap=5.0)
    reference = run(fused_linear_sparse_divergence, leaves(problem, torch.float64), chunk_size=N, **options)
    fused = run(fused_linear_sparse_divergence, leaves(problem, torch.float64), chunk_size=chunk_size, **options)
    assert_matches(fused, reference, rtol=1e-12, atol=1e-14)


def test_no_gradient_reaches_the_teacher_and_entropy_has_none():
    problem = leaves(sparse_divergence_problem(2), torch.float32)
    problem["teacher_logprobs"] = problem["teacher_logprobs"].float().requires_grad_(True)
    loss, entropy = fused_linear_sparse_divergence(**problem, return_entropy=True)
    loss.backward()
    assert problem["teacher_logprobs"].grad is None and not entropy.requires_grad
    assert problem["hidden"].grad is not None


def test_backward_twice_through_a_scalar_loss_is_refused():
    problem = leaves(sparse_divergence_problem(2), torch.float32)
    loss = fused_linear_sparse_divergence(**problem)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same scalar loss twice"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_and_batched_layouts(backend):
    # on the backend's device first: the views below are taken there
    problem = {
        k: v.float() if v.is_floating_point() else v
        for k, v in sparse_divergence_problem(8, leading=(3, 5), bias=True).items()
    }
    problem = dict(zip(problem, on(backend, *problem.values())))
    tol = dict(rtol=1e-6, atol=1e-7)

    def loss(inputs):
        return fused_linear_sparse_divergence(**inputs, beta=0.4, backend=backend, chunk_size=4)

    contiguous = loss(problem)
    # transposed views of the same [3, 5, ...] tensors, a non-contiguous head and a strided bias
    viewed = dict(
        problem,
        hidden=problem["hidden"].transpose(0, 1).contiguous().transpose(0, 1),
        weight=problem["weight"].T.contiguous().T,
        bias=torch.stack([problem["bias"], problem["bias"]], dim=1)[:, 0],
        candidate_ids=problem["candidate_ids"].transpose(0, 1).contiguous().transpose(0, 1),
        teacher_logprobs=problem["teacher_logprobs"].transpose(0, 1).contiguous().transpose(0, 1),
        candidate_mask=problem["candidate_mask"].transpose(0, 1).contiguous().transpose(0, 1),
    )
    for name in viewed:
        assert not viewed[name].is_contiguous(), name
    torch.testing.assert_close(loss(viewed), contiguous, **tol)
    flat = {k: v.reshape(15, -1) if k not in ("weight", "bias") else v for k, v in problem.items()}
    torch.testing.assert_close(loss(flat), contiguous, **tol)
    # an expanded (stride-0) hidden state, with gradients
    row = problem["hidden"][0, :1].clone().requires_grad_(True)
    expanded_loss = loss(dict(problem, hidden=row.expand(3, 5, D)))
    expanded_loss.backward()
    row_copy = row.detach().clone().requires_grad_(True)
    copied_loss = loss(dict(problem, hidden=row_copy.expand(3, 5, D).clone()))
    copied_loss.backward()
    torch.testing.assert_close(expanded_loss, copied_loss, **tol)
    torch.testing.assert_close(row.grad, row_copy.grad, **tol)


def test_torch_compile_still_checks_the_candidates():
    torch._dynamo.reset()
    problem = {k: v.float() if v.is_floating_point() else v for k, v in sparse_divergence_problem(13).items()}
    compiled = torch.compile(
        lambda ids: fused_linear_sparse_divergence(**dict(problem, candidate_ids=ids)), fullgraph=True
    )
    bad = problem["candidate_ids"].clone()
    bad[0, 0] = V
    with pytest.raises(ValueError, match=f"candidate id {V} is outside"):
        compiled(bad)
    torch._dynamo.reset()


def _float32(problem: dict) -> dict:
    return {k: v.float() if v.is_floating_point() else v for k, v in problem.items()}


def _with(problem: dict, name: str, index, value) -> dict:
    changed = problem[name].clone()
    changed[index] = value
    return dict(problem, **{name: changed})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(beta=1.5), "beta must be in"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(softcap=-1.0), "softcap must be > 0"),
        (dict(reduction="batchmean"), "reduction must be one of"),
        (dict(backend="cuda"), "unknown backend 'cuda'"),
        (dict(backend="triton", hidden=torch.randn(N, D, dtype=torch.float64)), "must have one dtype"),
        (dict(chunk_size=0), "chunk_size must be >= 1"),
        (dict(add_tail_bucket=True, renormalize=False), "renormalize=False applies without the tail bucket"),
        (dict(reduction="none", num_items_in_batch=3), "needs a scalar reduction"),
        (dict(num_items_in_batch=-1), "num_items_in_batch must be >= 0"),
        (dict(weight=torch.randn(V, D, dtype=torch.float16)), "must have one dtype"),
        (dict(hidden=torch.randn(D)), "hidden must be a"),
        (dict(weight=torch.randn(V, D + 1)), "does not match weight's D"),
        (dict(bias=torch.randn(V + 1)), "bias must have shape"),
        (dict(candidate_ids=torch.zeros(N, K, dtype=torch.float32)), "candidate_ids must be an integer tensor"),
        (dict(candidate_ids=torch.zeros(N + 1, K, dtype=torch.int64)), "candidate_ids must have shape"),
        (dict(candidate_ids=torch.zeros(N, 0, dtype=torch.int64)), "no candidate slot"),
        (dict(teacher_logprobs=torch.zeros(N, K + 1)), "teacher_logprobs must have candidate_ids' shape"),
        (dict(teacher_logprobs=torch.zeros(N, K, dtype=torch.int64)), "teacher_logprobs has unsupported dtype"),
        (dict(candidate_mask=torch.ones(N, K)), "candidate_mask must be a bool or integer"),
        (dict(candidate_mask=torch.ones(N, K - 1, dtype=torch.bool)), "candidate_mask must have"),
        (dict(fp32_logits=1), "fp32_logits must be a bool"),
        (dict(fp32_weight_grad="yes"), "fp32_weight_grad must be a bool"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(change, message):
    problem = _float32(sparse_divergence_problem(9))
    with pytest.raises(ValueError, match=f"^fused_linear_sparse_divergence: .*{message}"):
        fused_linear_sparse_divergence(**{**problem, **change})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("candidate_ids", V, f"candidate id {V} is outside"),
        ("candidate_ids", -1, "candidate id -1 is outside"),
        ("teacher_logprobs", float("nan"), "teacher_logprobs must be finite"),
        ("teacher_logprobs", float("-inf"), "teacher_logprobs must be finite"),
        ("teacher_logprobs", float("inf"), "teacher_logprobs must be finite"),
    ],
)
def test_bad_candidate_values_are_refused_inside_the_op(name, value, message, backend):
    if device_of(backend).type == "cuda":
        pytest.skip("a device assert on CUDA (it would end the process)")
    problem = _with(_float32(sparse_divergence_problem(9)), name, (0, 0), value)  # slot (0, 0) is always kept
    with pytest.raises(ValueError, match=f"^fused_linear_sparse_divergence: {message}"):
        fused_linear_sparse_divergence(**problem, backend=backend)
    with pytest.raises(ValueError, match="num_items_in_batch must be finite and > 0"):
        fused_linear_sparse_divergence(
            **_float32(sparse_divergence_problem(9)), num_items_in_batch=torch.tensor(float("nan"))
        )


def test_exported_from_the_package():
    assert lce_patch.fused_linear_sparse_divergence is fused_linear_sparse_divergence
    assert lce_patch.ops.fused_linear_sparse_divergence is fused_linear_sparse_divergence
    assert "fused_linear_sparse_divergence" in lce_patch.__all__


def test_empty_batch_gives_a_zero_loss_with_gradients():
    problem = leaves(sparse_divergence_problem(3), torch.float32)
    empty = dict(
        problem,
        hidden=problem["hidden"][:0],
        candidate_ids=problem["candidate_ids"][:0],
        teacher_logprobs=problem["teacher_logprobs"][:0],
        candidate_mask=problem["candidate_mask"][:0],
    )
    loss = fused_linear_sparse_divergence(**empty)
    loss.backward()
    assert loss.item() == 0 and torch.all(problem["weight"].grad == 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-o", "addopts="]))
