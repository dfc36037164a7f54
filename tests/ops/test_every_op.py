"""What every op must do, one suite parametrized over the ops: one graph under torch.compile with the eager
numbers, the same result for [B, T, D] and [N, D] inputs, and a named error for a bad argument or dtype."""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_divergence, fused_linear_sparse_divergence

from . import test_linear_divergence as divergence
from . import test_linear_sparse_divergence as sparse
from .devices import BACKENDS, device_of, on

# op name -> (the public function, its test problem of N rows, its module's ``placed``)
OPS = {
    "divergence": (fused_linear_divergence, divergence.make_problem, divergence.placed),
    "sparse_divergence": (fused_linear_sparse_divergence, sparse.make_problem, sparse.placed),
}
COMPILE_CASES = [
    ("divergence", "mean", dict()),
    ("divergence", "none-softcap", dict(reduction="none", softcap=3.0)),
    ("divergence", "sum-num-items", dict(reduction="sum", num_items_in_batch=torch.tensor(5), beta=1.0)),
    ("divergence", "fp32", dict(fp32_logits=True, fp32_weight_grad=True)),
    ("sparse_divergence", "mean", dict()),
    ("sparse_divergence", "none-softcap-tail", dict(reduction="none", softcap=3.0, add_tail_bucket=True)),
    (
        "sparse_divergence",
        "sum-num-items-as-given",
        dict(reduction="sum", num_items_in_batch=torch.tensor(5), beta=1.0, renormalize=False),
    ),
    ("sparse_divergence", "fp32", dict(fp32_logits=True, fp32_weight_grad=True)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "op_name, options",
    [(op, options) for op, _, options in COMPILE_CASES],
    ids=[f"{op}-{case}" for op, case, _ in COMPILE_CASES],
)
def test_torch_compile_is_one_graph_with_eager_numbers(backend, op_name, options):
    # the op is one custom operator (lce_patch::linear_divergence, ...); fullgraph fails on any graph break
    op, make_problem, placed = OPS[op_name]
    torch._dynamo.reset()
    problem = {k: v.float() if v.is_floating_point() else v for k, v in make_problem(12, bias=True).items()}
    problem = dict(zip(problem, on(backend, *problem.values())))
    options = dict(dict(beta=0.3), **placed(options, device_of(backend)))

    def step(hidden, weight, bias):
        inputs = dict(problem, hidden=hidden, weight=weight, bias=bias)
        return op(**inputs, backend=backend, chunk_size=4, return_entropy=True, **options)

    results = {}
    for name, fn in (("eager", step), ("compiled", torch.compile(step, fullgraph=True))):
        leaves = [problem[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
        loss, entropy = fn(*leaves)
        upstream = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).reshape(loss.shape)
        (loss * upstream).sum().backward()
        results[name] = (loss.detach(), entropy, *(leaf.grad for leaf in leaves))
    for eager, compiled in zip(results["eager"], results["compiled"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("op_name", sorted(OPS))
def test_three_dim_inputs_give_the_flat_result(op_name):
    op, make_problem, _ = OPS[op_name]
    flat = make_problem(3, leading=(12,))
    batched = {k: v.reshape(3, 4, *v.shape[1:]) if v.dim() >= 1 and v.shape[0] == 12 else v for k, v in flat.items()}
    torch.testing.assert_close(
        op(**batched, reduction="none", backend="torch").reshape(-1), op(**flat, reduction="none", backend="torch")
    )


@pytest.mark.parametrize("op_name", sorted(OPS))
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p.update(hidden=p["hidden"].tolist()), "hidden must be a torch.Tensor"),
        (lambda p: p.update(hidden=p["hidden"].long()), "hidden has unsupported dtype"),
        (lambda p: p.update(weight=p["weight"][:, :-1]), "does not match weight's D"),
        (lambda p: p.update(weight=p["weight"].to("meta")), "one device"),
        (lambda p: p.update(reduction="items"), "reduction must be one of"),
        (lambda p: p.update(chunk_size=0), "chunk_size must be"),
    ],
    ids=["not-a-tensor", "integer-dtype", "hidden-size", "device", "reduction", "chunk-size"],
)
def test_bad_input_names_the_argument(op_name, change, message):
    op, make_problem, _ = OPS[op_name]
    problem = make_problem(4)
    change(problem)
    with pytest.raises(ValueError, match=f"^{op.__name__}: .*{message}"):
        op(**problem, backend="torch")
