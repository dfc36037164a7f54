"""``torch.compile`` of code that calls the cross-entropy op: what the suite of every op does not check.

test_every_op.py compares one graph (``fullgraph=True``) with eager's numbers for each reduction,
``num_items_in_batch``, ``ignore_index``, ``shift``, ``skip_ignored``, ``num_valid_tokens`` and the
log-probabilities. Here: the captured graph calls the custom operator ``lce_patch::linear_cross_entropy``
(custom_op.py) once and traces no chunk GEMM; the log-probabilities' precomputed and recomputed gradients with
their statistics; a float64 call stays float64; a bad label still raises. Triton runs on the GPU under
LCE_TEST_GPU=1, else under the CPU interpreter (devices.py).
"""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_cross_entropy, fused_linear_log_probs

from .devices import BACKENDS, CPU, device_of, on
from .helpers import make_inputs


def _leaves(*tensors, dtype=torch.float32, device=CPU):
    return [None if t is None else t.to(device, dtype).detach().requires_grad_() for t in tensors]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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
