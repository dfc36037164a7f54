"""``torch.compile`` of code that calls the op: one graph (``fullgraph=True``), eager's numbers.

Under compile the op is the custom operator ``lce_patch::linear_cross_entropy`` (custom_op.py), so
dynamo captures it as one node; these tests compile whole functions with ``fullgraph=True`` (any
graph break fails them) and compare loss and gradients with the same call in eager mode and with
the float64 reference, on both backends (Triton on the GPU under LCE_TEST_GPU=1, else under the CPU
interpreter; devices.py).
"""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_cross_entropy, fused_linear_log_probs
from lce_patch.ops.linear_cross_entropy import naive_linear_cross_entropy

from .devices import BACKENDS, CPU, device_of, on
from .test_linear_cross_entropy import make_inputs, rel_err

OPTION_SETS = [
    {},
    {"reduction": "sum", "softcap": 3.0, "bias": True},
    {"reduction": "none", "label_smoothing": 0.1, "z_loss": 1e-3},
    {"num_items_in_batch": 23, "logit_scale": 0.5},
    {"num_items_in_batch": "tensor"},
    {"skip_ignored": True, "shift": True},
    {"num_valid_tokens": 29},
]


def _leaves(*tensors, dtype=torch.float32, device=CPU):
    return [None if t is None else t.to(device, dtype).detach().requires_grad_() for t in tensors]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_compiled_loss_equals_eager_and_reference(backend, options):
    options = dict(options)
    with_bias = options.pop("bias", False)
    hidden, weight, labels, bias = make_inputs(bias=with_bias, seed=int(torch.randint(0, 2**31, ()).item()))
    if options.get("num_items_in_batch") == "tensor":
        options["num_items_in_batch"] = torch.tensor(31)
    reduction = options.get("reduction", "mean")
    upstream = torch.randn(labels.shape) if reduction == "none" else torch.tensor(0.7)
    device = device_of(backend)
    op_options = dict(options)
    if isinstance(options.get("num_items_in_batch"), torch.Tensor):
        op_options["num_items_in_batch"] = options["num_items_in_batch"].to(device)
    op_labels = labels.to(device)

    def step(h, w, b):
        loss = fused_linear_cross_entropy(h, w, op_labels, bias=b, backend=backend, chunk_size=8, **op_options)
        return loss

    compiled = torch.compile(step, fullgraph=True)
    results = {}
    for name, fn in (("eager", step), ("compiled", compiled)):
        leaves = _leaves(hidden, weight, bias, device=device)
        loss = fn(*leaves)
        loss.backward(upstream.to(device))
        results[name] = (loss.detach(), [None if t is None else t.grad for t in leaves])
    ref_options = {k: v for k, v in options.items() if k not in ("skip_ignored", "num_valid_tokens")}
    ref_leaves = [None if t is None else t.detach().requires_grad_() for t in (hidden, weight, bias)]
    ref = naive_linear_cross_entropy(*ref_leaves[:2], labels, bias=ref_leaves[2], **ref_options)
    ref.backward(upstream.double())

    (eager_loss, eager_grads), (loss, grads) = results["eager"], results["compiled"]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
    assert rel_err(loss, ref) < 1e-5
    for got, eager, ref_leaf in zip(grads, eager_grads, ref_leaves):
        if ref_leaf is None:
            continue
        torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-7)
        assert rel_err(got, ref_leaf.grad) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("precompute_grad", [False, True])
def test_compiled_log_probs_and_entropy(backend, precompute_grad):
    hidden, weight, labels, _ = make_inputs(batch=2, n=11)
    labels[:, :3] = -100
    weights = torch.rand(labels.shape)
    labels, weights = on(backend, labels, weights)

    def step(h, w, uniform: bool):
        out = fused_linear_log_probs(
            h,
            w,
            labels,
            temperature=0.8,
            return_entropy=not uniform,
            return_is_top1=True,
            return_mean_logits=True,
            return_log_sum_sq_probs=uniform,
            backend=backend,
            chunk_size=6,
            skip_ignored=True,
            precompute_grad=precompute_grad,
        )
        statistics = (out.is_top1, out.mean_logits, out.log_sum_sq_probs)
        if uniform:  # an NLL mean: the precomputed gradient applies
            return -out.log_probs.sum() / out.label_mask.sum(), statistics
        return -(out.log_probs * weights).sum() + 0.1 * out.entropy.sum(), statistics

    for uniform in (True, False):
        compiled = torch.compile(step, fullgraph=True)
        runs = []
        for fn in (step, compiled):
            h, w = _leaves(hidden, weight, device=device_of(backend))
            loss, statistics = fn(h, w, uniform)
            loss.backward()
            assert (statistics[2] is not None) == uniform
            runs.append((loss.detach(), *statistics, h.grad, w.grad))
        for eager, compiled_value in zip(*runs):
            torch.testing.assert_close(compiled_value, eager, rtol=1e-6, atol=1e-7)


def test_compiled_op_is_one_custom_operator_node():
    """dynamo sees the op, not the chunk loop: the captured graph calls the custom operator once."""
    hidden, weight, labels, _ = make_inputs()
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def step(h, w):
        return fused_linear_cross_entropy(h, w, labels, backend="torch", chunk_size=4, skip_ignored=True)

    h, w = _leaves(hidden, weight)
    torch.compile(step, backend=capture, fullgraph=True)(h, w).backward()
    assert len(graphs) == 1
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count("lce_patch.linear_cross_entropy.default") == 1, targets
    assert not any("mm" in target for target in targets), targets  # no chunk GEMM traced


def test_compiled_bad_labels_still_raise():
    hidden, weight, labels, _ = make_inputs()
    labels[3] = weight.shape[0]  # out of range

    @torch.compile(fullgraph=True)
    def step(h, w):
        return fused_linear_cross_entropy(h, w, labels, backend="torch")

    with pytest.raises(ValueError, match="outside"):
        step(*_leaves(hidden, weight))


def test_compiled_float64_keeps_float64():
    hidden, weight, labels, _ = make_inputs()

    def step(h, w):
        return fused_linear_cross_entropy(h, w, labels, reduction="sum", chunk_size=8)

    runs = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        h, w = _leaves(hidden, weight, dtype=torch.float64)
        loss = fn(h, w)
        loss.backward(torch.tensor(1.0 / 3.0, dtype=torch.float64))
        runs.append((loss, h.grad, w.grad))
    for eager, compiled in zip(*runs):
        assert compiled.dtype == torch.float64
        torch.testing.assert_close(compiled, eager, rtol=1e-13, atol=1e-15)
