"""fused_linear_divergence against the float64 full-logits reference and TRL's own loss.

The torch backend runs in float64 here on the CPU; the Triton kernels run on the GPU under LCE_TEST_GPU=1,
else under TRITON_INTERPRET=1 on the CPU (set in conftest.py), in fp32, fp16 and bf16 (the kernel does no
tl.dot, so bf16 is right in the interpreter too); devices.py places each backend's inputs.
"""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_divergence
from lce_patch.ops.linear_divergence import naive_linear_divergence

from .devices import BACKENDS, CPU, TRITON_DEVICE, device_of, on, placed
from .helpers import D_TEACHER, D, N, V, divergence_problem, rel_err

BETAS = [0.0, 0.3, 0.5, 1.0]


def leaves(problem: dict, dtype: torch.dtype, device: torch.device = CPU) -> dict:
    out = {}
    for name, value in problem.items():
        value = value.to(device)
        if value.is_floating_point():
            value = value.to(dtype)
            if name in ("hidden", "weight", "bias"):
                value = value.clone().requires_grad_(True)
        out[name] = value
    return out


def run(fn, inputs: dict, upstream: torch.Tensor | None = None, **options):
    loss, entropy = (
        fn(**inputs, **options, return_entropy=True) if fn is fused_linear_divergence else fn(**inputs, **options)
    )
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
    "softcaps_and_scales": dict(softcap=3.0, teacher_softcap=5.0, logit_scale=1.5, teacher_logit_scale=0.5),
    "sum": dict(reduction="sum"),
    "num_items": dict(num_items_in_batch=23),
    "num_items_tensor": dict(num_items_in_batch=torch.tensor(7)),
}


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("case", list(OPTIONS))
def test_float64_equals_the_reference(beta, case):
    problem = divergence_problem(hash((beta, case)) % 1000, bias=case == "softcaps_and_scales")
    options = dict(OPTIONS[case], beta=beta)
    reference = run(naive_linear_divergence, leaves(problem, torch.float64), **options)
    fused = run(fused_linear_divergence, leaves(problem, torch.float64), chunk_size=4, **options)
    assert_matches(fused, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton unavailable")
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("case", list(OPTIONS))
def test_triton_kernels_equal_the_reference(beta, case):
    # fp32 logits and softmaxes, as in the low-precision test's fp32 row below
    problem = divergence_problem(hash((beta, case, "triton")) % 1000, bias=case == "softcaps_and_scales")
    options = dict(OPTIONS[case], beta=beta)
    reference = run(naive_linear_divergence, leaves(problem, torch.float64), **options)
    fused = run(
        fused_linear_divergence,
        leaves(problem, torch.float32, TRITON_DEVICE),
        backend="triton",
        chunk_size=4,
        **placed(options, TRITON_DEVICE),
    )
    assert_matches(fused, reference, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
def test_per_token_loss_with_uneven_upstream_gradients(beta, backend):
    # reduction="none" recomputes each chunk in the backward with every token's own upstream gradient
    problem = divergence_problem(5)
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    reference = run(naive_linear_divergence, leaves(problem, torch.float64), upstream, beta=beta, reduction="none")
    dtype, rtol, atol = (torch.float64, 1e-10, 1e-12) if backend == "torch" else (torch.float32, 2e-5, 2e-5)
    fused = run(
        fused_linear_divergence,
        leaves(problem, dtype, device_of(backend)),
        upstream.to(dtype),
        beta=beta,
        reduction="none",
        chunk_size=5,
        backend=backend,
    )
    assert_matches(fused, reference, rtol=rtol, atol=atol)
    assert torch.all(fused[0].cpu()[~problem["mask"]] == 0)


# fp32: logits and softmaxes in fp32 (rounding ~1e-7 relative, amplified by V-term sums);
# fp16 / bf16: inputs rounded to 11 / 8 mantissa bits before the GEMMs, on the reference too.
TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 8e-2}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_low_precision_inputs_against_float64_of_the_same_inputs(dtype, beta, backend):
    problem = divergence_problem(11, bias=True)
    rounded = {k: (v.to(dtype).double() if v.is_floating_point() else v) for k, v in problem.items()}
    reference = run(naive_linear_divergence, leaves(rounded, torch.float64), beta=beta, softcap=4.0)
    fused = run(
        fused_linear_divergence,
        leaves(problem, dtype, device_of(backend)),
        beta=beta,
        softcap=4.0,
        chunk_size=6,
        backend=backend,
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
    # difference of probabilities (p - q and the like): that rounding sets most of the default's error
    # (~1e-2 here). fp32 logits leave the bf16 rounding of G and of the GEMMs' outputs (~2-4e-3).
    gen = torch.Generator().manual_seed(int(beta * 10) + (reduction == "none"))
    rows, vocab, width, teacher_width = 32, 300, 32, 40
    problem = dict(
        hidden=torch.randn(rows, width, generator=gen),
        weight=torch.randn(vocab, width, generator=gen),  # logits of a few units to ~20, as real heads give
        bias=torch.randn(vocab, generator=gen),
        teacher_hidden=torch.randn(rows, teacher_width, generator=gen),
        teacher_weight=torch.randn(vocab, teacher_width, generator=gen),
    )
    problem = {k: v.to(torch.bfloat16) for k, v in problem.items()}
    upstream = None
    if reduction == "none":  # bf16-exact, so that the reference's upstream is the op's
        upstream = (torch.rand(rows, generator=gen) + 0.5).to(torch.bfloat16).double()
    options = dict(beta=beta, softcap=30.0, reduction=reduction)
    reference = run(naive_linear_divergence, leaves(problem, torch.float64), upstream, **options)
    errors = {}
    for precise in (False, True):
        fused = run(
            fused_linear_divergence,
            leaves(problem, torch.bfloat16, device_of(backend)),
            None if upstream is None else upstream.to(torch.bfloat16),
            chunk_size=16,
            backend=backend,
            fp32_logits=precise,
            fp32_weight_grad=precise,
            **options,
        )
        assert all(grad.dtype == torch.bfloat16 for grad in fused[2].values())
        errors[precise] = {name: rel_err(fused[2][name], reference[2][name]) for name in fused[2]}
        loss_error = rel_err(fused[0], reference[0])
        assert loss_error < (5e-3 if not precise else 1e-5), loss_error
    assert all(error < 6e-3 for error in errors[True].values()), errors
    # dbias is a sum over rows rounded once to bf16 (2^-9): its share of the gain is smaller
    assert sum(errors[True].values()) < 0.5 * sum(errors[False].values()), errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_logits_on_views_equal_the_contiguous_result(backend):
    # bf16 (where the option acts): a transposed hidden, a transposed weight, a strided bias, an expanded teacher
    problem = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in divergence_problem(14, bias=True).items()
    }
    problem = dict(zip(problem, on(backend, *problem.values())))

    def run_on(inputs):
        leaves = {k: v.detach().requires_grad_(k in ("hidden", "weight", "bias")) for k, v in inputs.items()}
        loss = fused_linear_divergence(
            **leaves, beta=0.5, backend=backend, chunk_size=4, fp32_logits=True, fp32_weight_grad=True
        )
        loss.backward()
        return [loss.float()] + [leaves[k].grad.float() for k in ("hidden", "weight", "bias")]

    viewed = dict(
        problem,
        hidden=problem["hidden"].T.contiguous().T,
        weight=problem["weight"].T.contiguous().T,
        bias=torch.stack([problem["bias"], problem["bias"]], dim=1)[:, 0],
        teacher_hidden=problem["teacher_hidden"][:1].expand(N, D_TEACHER),
    )
    reference = dict(problem, teacher_hidden=viewed["teacher_hidden"].contiguous())
    for got, want in zip(run_on(viewed), run_on(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("beta", BETAS)
def test_equals_trl_generalized_jsd_loss(beta):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    problem = divergence_problem(3, leading=(2, 7))
    labels = torch.where(problem["mask"], 1, -100)
    student = problem["hidden"] @ problem["weight"].T
    teacher = problem["teacher_hidden"] @ problem["teacher_weight"].T
    expected = gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=0.9)
    loss = fused_linear_divergence(**problem, beta=beta, temperature=0.9)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)


def test_padded_teacher_vocabulary_uses_the_shared_tokens():
    problem = divergence_problem(7, vocab_teacher=V + 9, bias=True)
    sliced = dict(problem, teacher_weight=problem["teacher_weight"][:V], teacher_bias=problem["teacher_bias"][:V])
    assert torch.equal(fused_linear_divergence(**problem), fused_linear_divergence(**sliced))
    with pytest.raises(ValueError, match="teacher's vocabulary .* smaller than the student's"):
        fused_linear_divergence(**dict(problem, teacher_weight=problem["teacher_weight"][: V - 1], teacher_bias=None))


def test_no_gradient_reaches_the_teacher():
    problem = leaves(divergence_problem(2), torch.float32)
    problem["teacher_hidden"].requires_grad_(True)
    problem["teacher_weight"].requires_grad_(True)
    fused_linear_divergence(**problem).backward()
    assert problem["teacher_hidden"].grad is None and problem["teacher_weight"].grad is None
    assert problem["hidden"].grad is not None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_selected_token_gives_zero_and_zero_gradients(reduction, backend):
    problem = leaves(divergence_problem(4), torch.float32, device_of(backend))
    problem["mask"] = torch.zeros(N, dtype=torch.int64, device=device_of(backend))
    loss = fused_linear_divergence(**problem, reduction=reduction, backend=backend)
    loss.sum().backward()
    assert torch.all(loss == 0)
    assert torch.all(problem["hidden"].grad == 0) and torch.all(problem["weight"].grad == 0)
    if reduction != "none":
        zero_items = fused_linear_divergence(**problem, reduction=reduction, num_items_in_batch=0, backend=backend)
        assert zero_items.item() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_and_batched_layouts(backend):
    # on the backend's device first: the views below are taken there
    problem = {
        k: v.float() if v.is_floating_point() else v
        for k, v in divergence_problem(8, leading=(3, 5), bias=True).items()
    }
    problem = dict(zip(problem, on(backend, *problem.values())))
    tol = dict(rtol=1e-6, atol=1e-7)

    def loss(inputs):
        return fused_linear_divergence(**inputs, beta=0.4, backend=backend, chunk_size=4)

    contiguous = loss(problem)
    # transposed views of the same [3, 5, D] hidden and mask, non-contiguous heads and strided biases
    viewed = dict(
        problem,
        hidden=problem["hidden"].transpose(0, 1).contiguous().transpose(0, 1),
        weight=problem["weight"].T.contiguous().T,
        teacher_hidden=problem["teacher_hidden"].transpose(0, 1).contiguous().transpose(0, 1),
        teacher_weight=problem["teacher_weight"].T.contiguous().T,
        bias=torch.stack([problem["bias"], problem["bias"]], dim=1)[:, 0],
        teacher_bias=torch.stack([problem["teacher_bias"], problem["teacher_bias"]], dim=1)[:, 1],
        mask=problem["mask"].T.contiguous().T,
    )
    for name in ("hidden", "weight", "teacher_hidden", "teacher_weight", "bias", "teacher_bias", "mask"):
        assert not viewed[name].is_contiguous(), name
    torch.testing.assert_close(loss(viewed), contiguous, **tol)
    flat = {k: v.reshape(15, -1) if k in ("hidden", "teacher_hidden") else v for k, v in problem.items()}
    flat["mask"] = problem["mask"].reshape(15)
    torch.testing.assert_close(loss(flat), contiguous, **tol)
    # an expanded (stride-0) teacher state, as a broadcast prompt representation would give
    row = problem["teacher_hidden"][0, :1]
    expanded = dict(problem, teacher_hidden=row.expand(3, 5, D_TEACHER))
    torch.testing.assert_close(
        loss(expanded), loss(dict(problem, teacher_hidden=row.expand(3, 5, D_TEACHER).clone())), **tol
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(beta=1.5), "beta must be in"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(reduction="batchmean"), "reduction must be one of"),
        (dict(backend="cuda"), "unknown backend 'cuda'"),
        (dict(backend="triton", hidden=torch.randn(N, D, dtype=torch.float64)), "must have one dtype"),
        (dict(chunk_size=0), "chunk_size must be a positive int"),
        (dict(mask=torch.ones(N)), "mask must be a bool or integer"),
        (dict(mask=torch.ones(N + 1, dtype=torch.bool)), "mask must have shape"),
        (dict(teacher_hidden=torch.randn(N + 1, D_TEACHER)), "teacher_hidden must have"),
        (dict(teacher_weight=torch.randn(V, D_TEACHER + 1)), "teacher_hidden's last dim"),
        (dict(reduction="none", num_items_in_batch=3), "needs a scalar reduction"),
        (dict(num_items_in_batch=-1), "num_items_in_batch must be >= 0"),
        (dict(weight=torch.randn(V, D, dtype=torch.float16)), "must have one dtype"),
        (dict(fp32_logits=1), "fp32_logits must be a bool"),
        (dict(fp32_weight_grad="yes"), "fp32_weight_grad must be a bool"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(change, message):
    problem = {k: v.float() if v.is_floating_point() else v for k, v in divergence_problem(9).items()}
    with pytest.raises(ValueError, match=message):
        fused_linear_divergence(**{**problem, **change})


def test_torch_compile_still_checks_num_items():
    torch._dynamo.reset()
    problem = {k: v.float() if v.is_floating_point() else v for k, v in divergence_problem(13).items()}
    compiled = torch.compile(lambda items: fused_linear_divergence(**problem, num_items_in_batch=items), fullgraph=True)
    with pytest.raises(ValueError, match="num_items_in_batch must be finite and > 0"):
        compiled(torch.tensor(-2.0))
    torch._dynamo.reset()
