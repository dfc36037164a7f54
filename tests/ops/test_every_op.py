"""What every op must do, one suite parametrized over the ops: one graph under torch.compile with the eager
numbers, the same result for [B, T, D] and [N, D] inputs, and a named error for a bad argument or dtype."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from lce_patch import (
    fused_linear_cross_entropy,
    fused_linear_divergence,
    fused_linear_log_probs,
    fused_linear_sparse_divergence,
)

from .devices import BACKENDS, device_of, on, placed
from .helpers import cross_entropy_problem, divergence_problem, sparse_divergence_problem


class Op(NamedTuple):
    """An op as the suite calls it. function: the public function; make_problem(seed, bias=, leading=): its
    float64 keyword inputs of N rows; outputs: the options every compiled call adds (extra outputs, compared too;
    a case's options override them); per_token: the options of one loss per row; named: the name its messages
    start with, when not the function's."""

    function: Callable
    make_problem: Callable[..., dict]
    outputs: dict
    per_token: dict = {"reduction": "none"}
    named: str | None = None

    @property
    def name(self) -> str:
        return self.named or self.function.__name__


DIVERGENCE_OUTPUTS = dict(beta=0.3, return_entropy=True)
OPS = {
    "divergence": Op(fused_linear_divergence, divergence_problem, DIVERGENCE_OUTPUTS),
    "sparse_divergence": Op(fused_linear_sparse_divergence, sparse_divergence_problem, DIVERGENCE_OUTPUTS),
    "cross_entropy": Op(
        fused_linear_cross_entropy,
        cross_entropy_problem,
        dict(return_lse=True, return_token_accuracy=True, return_predicted_tokens=True),
    ),
    # per-token log-probabilities, no reduction; it shares the cross-entropy op's checks and their name
    "log_probs": Op(
        fused_linear_log_probs,
        cross_entropy_problem,
        dict(return_entropy=True, return_is_top1=True, return_mean_logits=True, return_log_sum_sq_probs=True),
        per_token={},
        named="fused_linear_cross_entropy",
    ),
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
    ("cross_entropy", "mean", dict()),
    ("cross_entropy", "none-softcap", dict(reduction="none", softcap=3.0, label_smoothing=0.1, z_loss=1e-3)),
    ("cross_entropy", "sum-num-items", dict(reduction="sum", num_items_in_batch=torch.tensor(9))),
    ("cross_entropy", "num-items-number", dict(num_items_in_batch=23, logit_scale=0.5)),
    ("cross_entropy", "fp32-sum-softcap", dict(fp32_weight_grad=True, reduction="sum", softcap=3.0)),
    ("cross_entropy", "ignore-index-shift-skip", dict(ignore_index=3, shift=True, skip_ignored=True)),
    ("cross_entropy", "num-valid-tokens", dict(num_valid_tokens=12)),
    ("log_probs", "plain", dict()),
    ("log_probs", "softcap-temperature-shift", dict(softcap=3.0, temperature=0.7, shift=True, skip_ignored=True)),
]


def _tensors(result) -> list[torch.Tensor]:
    """An op's outputs as a list, the loss (or log-probabilities) first, without those not asked for."""
    return [t for t in (result if isinstance(result, tuple) else (result,)) if t is not None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "op_name, options",
    [(op, options) for op, _, options in COMPILE_CASES],
    ids=[f"{op}-{case}" for op, case, _ in COMPILE_CASES],
)
def test_torch_compile_is_one_graph_with_eager_numbers(backend, op_name, options):
    # the op is one custom operator (lce_patch::linear_divergence, ...); fullgraph fails on any graph break
    op = OPS[op_name]
    torch._dynamo.reset()
    # a cross-entropy problem marks its ignored labels with the case's ignore_index
    marks = {"ignore_index": options["ignore_index"]} if "ignore_index" in options else {}
    problem = op.make_problem(12, bias=True, **marks)
    problem = {k: v.float() if v.is_floating_point() else v for k, v in problem.items()}
    problem = dict(zip(problem, on(backend, *problem.values())))
    options = {**op.outputs, **placed(options, device_of(backend))}

    def step(hidden, weight, bias):
        inputs = dict(problem, hidden=hidden, weight=weight, bias=bias)
        return op.function(**inputs, backend=backend, chunk_size=4, **options)

    results = {}
    for name, fn in (("eager", step), ("compiled", torch.compile(step, fullgraph=True))):
        leaves = [problem[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
        loss, *outputs = _tensors(fn(*leaves))
        upstream = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).reshape(loss.shape)
        (loss * upstream).sum().backward()
        results[name] = (loss.detach(), *outputs, *(leaf.grad for leaf in leaves))
    for eager, compiled in zip(results["eager"], results["compiled"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("op_name", sorted(OPS))
def test_every_call_is_counted_once_eager_and_compiled_without_a_recompile(op_name):
    """The call count (lce_patch.ops.op_calls, what the Trainer callback's line reads) under the public function's
    name: one per eager call, one per run of a compiled graph, and the count never guards the graph (a guard on
    it recompiled every step)."""
    from lce_patch.ops import calls_since, op_calls

    op = OPS[op_name]
    torch._dynamo.reset()
    problem = {k: v.float() if v.is_floating_point() else v for k, v in op.make_problem(13, bias=True).items()}

    def step(hidden, weight):
        return _tensors(op.function(**dict(problem, hidden=hidden, weight=weight), backend="torch"))[0].sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    leaves = [problem[k].clone().requires_grad_(True) for k in ("hidden", "weight")]
    for fn, label in ((step, "eager"), (compiled, "compiled")):
        fn(*leaves).backward()  # the compiled step compiles here
        before = op_calls()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(3):
                fn(*leaves).backward()
        assert calls_since(before) == {op.function.__name__: 3}, label
    torch._dynamo.reset()


@pytest.mark.parametrize("op_name", sorted(OPS))
def test_three_dim_inputs_give_the_flat_result(op_name):
    op = OPS[op_name]
    flat = op.make_problem(3, leading=(12,))
    batched = {k: v.reshape(3, 4, *v.shape[1:]) if v.dim() >= 1 and v.shape[0] == 12 else v for k, v in flat.items()}
    (batched_loss, *_), (flat_loss, *_) = (
        _tensors(op.function(**inputs, **op.per_token, backend="torch")) for inputs in (batched, flat)
    )
    assert batched_loss.shape == (3, 4)
    torch.testing.assert_close(batched_loss.reshape(-1), flat_loss)


BAD_INPUTS = {
    "not-a-tensor": (lambda p: p.update(hidden=p["hidden"].tolist()), "hidden must be a torch.Tensor"),
    "integer-dtype": (lambda p: p.update(hidden=p["hidden"].long()), "hidden has unsupported dtype"),
    "hidden-size": (lambda p: p.update(weight=p["weight"][:, :-1]), "does not match weight's D"),
    "device": (lambda p: p.update(weight=p["weight"].to("meta")), "one device"),
    "reduction": (lambda p: p.update(reduction="items"), "reduction must be one of"),
    "chunk-size": (lambda p: p.update(chunk_size=0), "chunk_size must be"),
}


def _takes(op_name: str, case: str) -> bool:
    """Whether the op has the argument a case changes: the log-probs op has no reduction."""
    return case != "reduction" or "reduction" in inspect.signature(OPS[op_name].function).parameters


@pytest.mark.parametrize("op_name, case", [(op, case) for op in sorted(OPS) for case in BAD_INPUTS if _takes(op, case)])
def test_bad_input_names_the_argument(op_name, case):
    op = OPS[op_name]
    change, message = BAD_INPUTS[case]
    problem = op.make_problem(4)
    change(problem)
    with pytest.raises(ValueError, match=f"^{op.name}: .*{message}"):
        op.function(**problem, backend="torch")
