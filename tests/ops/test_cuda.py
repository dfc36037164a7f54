"""GPU-only checks of the compiled Triton kernels (skipped without LCE_TEST_GPU=1).

Run on a GPU machine with ``LCE_TEST_GPU=1 python -m pytest tests/ops``: the other files' Triton cases
then run on the GPU too (devices.py), at their small sizes. Here: the reference checks at GPU-sized odd
shapes (several vocabulary blocks, 128-row chunks) in fp32, fp16 and bf16 (the CPU interpreter cannot
run bf16 dots), no host syncs, device asserts, the side stream of the weight gradients and CUDA graphs.
TF32 is off for every test under the flag (conftest.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from lce_patch import fused_linear_cross_entropy

from .devices import GPU
from .helpers import LOW_RANK_OPTION_SETS, OPTION_SETS, check_against_reference, check_low_rank

pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and LCE_TEST_GPU=1")
CUDA = torch.device("cuda")
SIZE = {"n": 300, "d": 72, "v": 5003}  # odd sizes: V and D are not multiples of any block size


@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_triton_fp32_matches_float64_reference(options):
    check_against_reference(options, backend="triton", device=CUDA, size=SIZE, chunk_size=128)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("options", [{}, {"softcap": 30.0}, {"reduction": "none", "z_loss": 1e-4}])
def test_triton_half_precision(dtype, tol, options):
    # bf16 operands round to 2^-8: logits of D=72 terms carry ~3e-3 relative error, gradients ~1e-2.
    check_against_reference(options, backend="triton", dtype=dtype, tol=tol, device=CUDA, size=SIZE, chunk_size=128)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "options", [{"skip_ignored": True}, {"num_valid_tokens": 240, "softcap": 30.0, "reduction": "none"}]
)
def test_triton_skipping_ignored_rows(dtype, tol, options):
    # make_inputs ignores every 5th of the 300 rows: 240 remain.
    check_against_reference(options, backend="triton", dtype=dtype, tol=tol, device=CUDA, size=SIZE, chunk_size=128)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("weight_trainable", [False, True], ids=["frozen_weight", "trainable_weight"])
@pytest.mark.parametrize(
    "options", LOW_RANK_OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default"
)
def test_triton_low_rank_term(dtype, tol, weight_trainable, options):
    # LoRA on the head: fp32 adapters beside an fp32 or bf16 head; a trainable W puts dW (and the
    # low-rank gradients) on the side stream
    size = {"n": 300, "d": 72, "v": 5003, "rank": 8}
    check_low_rank(
        options, backend="triton", weight_trainable=weight_trainable, device=CUDA, dtype=dtype, tol=tol, size=size
    )


def test_no_host_sync_on_the_cuda_path():
    hidden = torch.randn(512, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(1000, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 1000, (512,), device=CUDA)
    labels[::3] = -100
    num_items = torch.tensor(300, device=CUDA)
    fused_linear_cross_entropy(hidden, weight, labels).backward()  # compile kernels first
    count = int((labels != -100).sum())  # the caller's count of valid labels, known before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = fused_linear_cross_entropy(hidden, weight, labels, softcap=30.0, num_items_in_batch=num_items)
        loss.backward()
        per_token = fused_linear_cross_entropy(hidden, weight, labels, reduction="none")
        per_token.sum().backward()
        fused_linear_cross_entropy(hidden, weight, labels, num_valid_tokens=count).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize(
    "bad_input, message",
    [
        ("labels[5] = 100", "outside [0, 100)"),
        # a count above the labels' (the rows it would select past them are filled in range, never read past)
        ("kwargs['num_valid_tokens'] = int((labels != -100).sum()) + 7", "num_valid_tokens differs"),
        ("kwargs['num_valid_tokens'] = int((labels != -100).sum()) - 1", "num_valid_tokens differs"),
        ("kwargs['num_items_in_batch'] = torch.tensor(-4.0, device='cuda')", "num_items_in_batch must be finite"),
    ],
    ids=["label", "count_above", "count_below", "num_items"],
)
def test_bad_values_stop_with_a_readable_device_assert(bad_input, message):
    script = textwrap.dedent(
        f"""
        import torch
        from lce_patch import fused_linear_cross_entropy
        h = torch.randn(64, 32, device="cuda", requires_grad=True)
        w = torch.randn(100, 32, device="cuda", requires_grad=True)
        labels = torch.randint(0, 100, (64,), device="cuda")
        labels[::3] = -100
        kwargs = {{}}
        {bad_input}
        fused_linear_cross_entropy(h, w, labels, **kwargs).backward()
        torch.cuda.synchronize()
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert message in result.stderr or "device-side assert" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("options", [{}, {"softcap": 30.0, "temperature": 0.9}], ids=["plain", "softcap"])
def test_triton_mean_logits_and_log_sum_sq_probs(dtype, atol, options):
    # bf16 logits carry ~2^-9 relative error each (~4e-3 at |z| ~ 8 here); the mean and the log-sum of squares
    # average or soft-max over them, so their error stays within a few of those.
    from lce_patch import fused_linear_log_probs
    from lce_patch.ops.linear_cross_entropy import naive_distribution_statistics

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 72, generator=gen, dtype=torch.float64)
    weight = torch.randn(5003, 72, generator=gen, dtype=torch.float64) / 72**0.5 * 3
    labels = torch.randint(0, 5003, (300,), generator=gen)
    labels[::7] = -100
    hidden, weight = hidden.to(dtype).double(), weight.to(dtype).double()  # the reference sees the rounded inputs
    ref = naive_distribution_statistics(hidden, weight, labels, **options)
    out = fused_linear_log_probs(
        hidden.to(CUDA, dtype), weight.to(CUDA, dtype), labels.to(CUDA), backend="triton", chunk_size=128,
        return_mean_logits=True, return_log_sum_sq_probs=True, **options,
    )  # fmt: skip
    for got, want in zip((out.mean_logits, out.log_sum_sq_probs), ref, strict=True):
        error = (got.double().cpu() - want).abs().max()
        assert error < atol, error


@pytest.mark.parametrize("layout", ["contiguous", "views"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_weight_grads_on_a_side_stream_equal_the_serial_order(monkeypatch, dtype, reduction, layout):
    # Each chunk's dW GEMM runs on a second stream beside its dh GEMM (core.grads.OVERLAP_WEIGHT_GRADS):
    # the same GEMMs on the same inputs, so loss and gradients must be bitwise those of the serial
    # order, also when the caller works on a stream of its own, for the recomputing backward, and for
    # views (column-major hidden and weight, a strided bias, labels sliced from a wider tensor).
    from lce_patch.ops.core import grads

    gen = torch.Generator(device=CUDA).manual_seed(0)
    hidden = torch.randn(700, 96, device=CUDA, generator=gen).to(dtype)
    weight = (torch.randn(3001, 96, device=CUDA, generator=gen) / 96**0.5).to(dtype)
    bias = torch.randn(3001, 2, device=CUDA, generator=gen).to(dtype)  # the views take column 1 (stride 2)
    labels = torch.randint(0, 3001, (700, 2), device=CUDA, generator=gen)[:, 1]  # stride 2
    if layout == "views":
        hidden, weight = hidden.t().contiguous().t(), weight.t().contiguous().t()  # column-major
    else:
        bias, labels = bias[:, 1:].contiguous(), labels.contiguous()
    results = {}
    for overlap in (False, True):
        monkeypatch.setattr(grads, "OVERLAP_WEIGHT_GRADS", overlap)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))  # clone keeps strides
            b_view = b[:, 1] if layout == "views" else b[:, 0]
            loss = fused_linear_cross_entropy(h, w, labels, bias=b_view, chunk_size=128, reduction=reduction)
            loss.backward(torch.ones_like(loss))
        torch.cuda.current_stream().wait_stream(stream)
        results[overlap] = (loss, h.grad, w.grad, b.grad)
    assert layout == "contiguous" or (h.stride() == (1, 700) and w.stride() == (1, 3001) and b_view.stride() == (2,))
    for serial, overlapped in zip(results[False], results[True], strict=True):
        assert torch.equal(serial, overlapped)
    assert torch.isfinite(results[True][2]).all() and results[True][2].abs().sum() > 0


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_captured_cuda_graph_replays_the_eager_step(monkeypatch, reduction, overlap):
    # A training step captured in a CUDA graph must replay to the eager step's loss and gradients, also
    # when each chunk's dW GEMM forks onto a second stream and joins back (``overlap``, recorded in the graph).
    from lce_patch.ops.core import grads

    monkeypatch.setattr(grads, "OVERLAP_WEIGHT_GRADS", overlap)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    hidden = torch.randn(700, 96, device=CUDA, generator=gen).requires_grad_()
    weight = (torch.randn(3001, 96, device=CUDA, generator=gen) / 96**0.5).requires_grad_()
    labels = torch.randint(0, 3001, (700,), device=CUDA, generator=gen)
    labels[::5] = -100

    def step():
        loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=128, reduction=reduction)
        return (loss, *torch.autograd.grad(loss, (hidden, weight), torch.ones_like(loss)))

    # Detached: a live autograd graph keeps the leaves' AccumulateGrad nodes, made on the default stream,
    # which capture on another stream must not depend on (torch warns "AccumulateGrad node's stream does
    # not match ... break CUDA graph capture").
    eager = [t.detach() for t in step()]
    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):  # the warm-up that capture needs, off the default stream
        step()
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        hidden.mul_(0.5)  # new values in the same memory: the replay must see them
    graph.replay()
    expected = step()
    for got, want in zip(captured, expected, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(captured[0], eager[0])
