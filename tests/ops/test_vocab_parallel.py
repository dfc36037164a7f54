"""The vocabulary-parallel op (vocab_parallel.py) on 2 and 3 CPU processes (gloo) against one process.

The Triton backend's ranks share the GPU under LCE_TEST_GPU=1 (gloo's all-reduce and all-gather take CUDA
tensors), else run the CPU interpreter; the torch backend's run on the CPU (devices.py).

Every rank builds the same inputs from one seed, holds rows [start, stop) of the weight, and calls the op
with ``vocab_shard`` (or a DTensor weight); its loss, its hidden gradient and its weight shard's gradient
must equal the float64 unfused reference on the whole vocabulary (fp32: 1e-5 relative, as the
single-process op's tests; fp64: 1e-10), and the single-process op's own result.
"""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_cross_entropy, fused_linear_log_probs
from lce_patch.ops.linear_cross_entropy import VocabShard, naive_linear_cross_entropy
from tests.multiprocess import run_ranks
from tests.ops.devices import BACKENDS, on

from .helpers import make_inputs, rel_err

# (options, input layout): each one a case run on every rank.
CASES = [
    ({}, {}),
    ({"softcap": 3.0, "logit_scale": 0.7, "shift": True}, {"batch": 3, "bias": True}),
    ({"label_smoothing": 0.1, "z_loss": 1e-3, "reduction": "sum"}, {}),
    ({"num_items_in_batch": 29, "skip_ignored": True, "softcap": 2.0}, {"bias": True}),
    ({"reduction": "none", "label_smoothing": 0.2}, {"batch": 2}),
    ({"ignore_index": -1, "z_loss": 1e-2}, {}),
    ({"ignore_index": 53, "label_smoothing": 0.05}, {}),  # ignore_index = V: never a target id
    ({"reduction": "none", "softcap": 2.5, "skip_ignored": True}, {}),
]


def _split(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Uneven shards on purpose: rank r gets (r + 1) parts of 1 + 2 + ... + world_size."""
    parts = world_size * (world_size + 1) // 2
    bounds = [vocab_size * (r * (r + 1) // 2) // parts for r in range(world_size + 1)]
    return bounds[rank], bounds[rank + 1]


def _run_case(options, layout, backend, dtype, rank, world_size, seed):
    hidden, weight, labels, bias = make_inputs(seed=seed, n=23, d=11, v=53, **layout)
    ignore_index = options.get("ignore_index", -100)
    labels[labels == -100] = ignore_index
    start, stop = _split(weight.shape[0], world_size, rank)
    reduction = options.get("reduction", "mean")
    upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)

    def backward(loss):
        (loss * upstream.to(loss.device, loss.dtype)).sum().backward() if reduction == "none" else loss.backward()

    ref_options = {k: v for k, v in options.items() if k != "skip_ignored"}
    ref_inputs = [t.clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    ref = naive_linear_cross_entropy(ref_inputs[0], ref_inputs[1], labels, bias=ref_inputs[2], **ref_options)
    backward(ref)

    h = on(backend, hidden.to(dtype)).requires_grad_()
    w = on(backend, weight[start:stop].to(dtype)).requires_grad_()
    b = on(backend, bias[start:stop].to(dtype)).requires_grad_() if bias is not None else None
    shard = VocabShard(start=start, total=weight.shape[0])
    loss = fused_linear_cross_entropy(
        h, w, on(backend, labels), bias=b, backend=backend, chunk_size=8, vocab_shard=shard, **options
    )
    backward(loss)

    tol = 1e-5 if dtype == torch.float32 else 1e-10
    what = f"rank {rank}/{world_size} {backend} {dtype} {options} {layout}"
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), what
    assert rel_err(loss, ref) <= tol, f"loss {what}: {rel_err(loss, ref)}"
    assert rel_err(h.grad, ref_inputs[0].grad) <= tol, f"dh {what}: {rel_err(h.grad, ref_inputs[0].grad)}"
    assert rel_err(w.grad, ref_inputs[1].grad[start:stop]) <= tol, f"dW {what}"
    if bias is not None:
        assert rel_err(b.grad, ref_inputs[2].grad[start:stop]) <= tol, f"dbias {what}"


def _op_cases(rank, world_size, backend):
    for seed, (options, layout) in enumerate(CASES):
        _run_case(options, layout, backend, torch.float32, rank, world_size, 100 * seed)
    if backend == "torch":
        _run_case(*CASES[1], backend, torch.float64, rank, world_size, 7)
        _run_case(*CASES[2], backend, torch.float64, rank, world_size, 8)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_shards_equal_one_process(world_size, backend):
    run_ranks(_op_cases, world_size, backend)


def _edge_cases(rank, world_size):
    hidden, weight, labels, _ = make_inputs(seed=3, n=17, d=8, v=29)
    start, stop = _split(weight.shape[0], world_size, rank)
    shard = VocabShard(start=start, total=weight.shape[0])

    # Every label ignored: a zero loss with zero gradients, on every rank.
    h, w = hidden.float().requires_grad_(), weight[start:stop].float().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, torch.full_like(labels, -100), vocab_shard=shard, backend="torch")
    loss.backward()
    assert float(loss) == 0.0 and not h.grad.any() and not w.grad.any()

    # Every label owned by rank 0's shard: the other ranks still get their columns' gradient.
    owned = labels.clamp(max=_split(weight.shape[0], world_size, 0)[1] - 1)
    h, w = hidden.float().requires_grad_(), weight[start:stop].float().requires_grad_()
    ref_w = weight.clone().requires_grad_()
    ref = naive_linear_cross_entropy(hidden, ref_w, owned)
    ref.backward()
    loss = fused_linear_cross_entropy(h, w, owned, vocab_shard=shard, backend="torch")
    loss.backward()
    assert rel_err(loss, ref) <= 1e-5 and rel_err(w.grad, ref_w.grad[start:stop]) <= 1e-5

    # Per-token log-probabilities (TRL's SFT path: precomputed gradient for a mean upstream).
    h, w = hidden.float().requires_grad_(), weight[start:stop].float().requires_grad_()
    out = fused_linear_log_probs(h, w, labels, vocab_shard=shard, precompute_grad=True, backend="torch")
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = -naive_linear_cross_entropy(ref_h, ref_w, labels, reduction="none")
    assert rel_err(out.log_probs, ref) <= 1e-5
    mask = labels != -100
    (-(out.log_probs * mask).sum() / mask.sum()).backward()
    (-(ref * mask).sum() / mask.sum()).backward()
    assert rel_err(h.grad, ref_h.grad) <= 1e-5 and rel_err(w.grad, ref_w.grad[start:stop]) <= 1e-5

    # Bad input: clear errors, before any collective (so no rank hangs).
    w = weight[start:stop].float()
    with pytest.raises(ValueError, match="do not lie inside the vocabulary"):
        fused_linear_cross_entropy(hidden.float(), w, labels, vocab_shard=VocabShard(start=stop, total=stop))
    with pytest.raises(ValueError, match="label 29 is outside \\[0, 29\\)"):
        fused_linear_cross_entropy(hidden.float(), w, labels.clamp(min=0) * 0 + 29, vocab_shard=shard)
    with pytest.raises(ValueError, match="ignore_index must be negative or at least the vocabulary size"):
        fused_linear_cross_entropy(hidden.float(), w, labels.clamp(min=0), vocab_shard=shard, ignore_index=3)
    with pytest.raises(
        ValueError,
        match="entropy, is_top1, mean_logits, log_sum_sq_probs, return_lse and return_token_accuracy are not supported",
    ):
        fused_linear_log_probs(hidden.float(), w, labels, vocab_shard=shard, return_entropy=True)


def test_vocab_shard_edge_cases_and_errors():
    run_ranks(_edge_cases, 2)


def _layout_cases(rank, world_size, backend):
    """Views as users pass them (transposed hidden, a column-strided weight shard, a strided bias, labels
    sliced from a wider tensor and expanded) give what the same call on contiguous copies gives; and
    fp16 / bf16 give the float64 reference to their rounding."""
    hidden, weight, labels, bias = make_inputs(seed=21, n=24, d=10, v=47, bias=True)
    start, stop = _split(weight.shape[0], world_size, rank)
    shard = VocabShard(start=start, total=weight.shape[0])
    dtypes = (torch.float32, torch.float16) if backend == "triton" else (torch.float32, torch.float16, torch.bfloat16)
    # the views are taken on the backend's device (a copy to another device would not keep them)
    hidden_on, weight_on, bias_on, labels_on = on(backend, hidden, weight, bias, labels)
    for dtype in dtypes:
        h_view = hidden_on.to(dtype).t().contiguous().t()  # column-major [N, D]
        w_view = weight_on[start:stop].to(dtype).t().contiguous().t()  # the shard, column-major
        b_view = torch.stack([bias_on, bias_on], 1)[start:stop, 0].to(dtype)  # stride 2
        y_view = torch.stack([labels_on, labels_on], 1)[:, 1]  # stride 2
        views = [t.detach().requires_grad_() for t in (h_view, w_view, b_view)]
        copies = [t.detach().contiguous().requires_grad_() for t in (h_view, w_view, b_view)]
        options = dict(vocab_shard=shard, backend=backend, chunk_size=8, softcap=3.0, label_smoothing=0.1)
        loss = fused_linear_cross_entropy(views[0], views[1], y_view, bias=views[2], **options)
        loss.backward()
        same = fused_linear_cross_entropy(copies[0], copies[1], y_view.contiguous(), bias=copies[2], **options)
        same.backward()
        what = f"rank {rank} {backend} {dtype}"
        assert rel_err(loss, same) <= 1e-6, what
        for view, copy in zip(views, copies, strict=True):
            assert rel_err(view.grad, copy.grad) <= 1e-6, what
        ref_inputs = [t.detach().cpu().double().requires_grad_() for t in (h_view, weight.to(dtype), bias.to(dtype))]
        ref = naive_linear_cross_entropy(
            *ref_inputs[:2], y_view.cpu(), bias=ref_inputs[2], softcap=3.0, label_smoothing=0.1
        )
        ref.backward()
        # The loss reads the target in fp32; gradients carry the dtype's rounding of the logits (bf16: 2^-9).
        grad_tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
        assert rel_err(loss, ref) <= {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 5e-3}[dtype], what
        assert rel_err(views[0].grad, ref_inputs[0].grad) <= grad_tol, what
        assert rel_err(views[1].grad, ref_inputs[1].grad[start:stop]) <= grad_tol, what
    # An expanded labels view (one row's labels broadcast over the batch) with 3-D hidden.
    h3 = on(backend, hidden[:8].float()).expand(3, 8, 10).requires_grad_()
    y3 = labels[:8].expand(3, 8)
    w = on(backend, weight[start:stop].float()).requires_grad_()
    loss = fused_linear_cross_entropy(
        h3, w, on(backend, labels[:8]).expand(3, 8), vocab_shard=shard, backend=backend, shift=True
    )
    ref_w = weight.clone().requires_grad_()
    ref = naive_linear_cross_entropy(hidden[:8].expand(3, 8, 10), ref_w, y3, shift=True)
    loss.backward()
    ref.backward()
    assert rel_err(loss, ref) <= 1e-5 and rel_err(w.grad, ref_w.grad[start:stop]) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_shards_take_views_and_every_dtype(backend):
    run_ranks(_layout_cases, 2, backend)


def _dtensor_cases(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    hidden, weight, labels, bias = make_inputs(seed=11, n=19, d=9, v=41, bias=True)
    ref_inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref = naive_linear_cross_entropy(*ref_inputs[:2], labels, bias=ref_inputs[2], softcap=4.0, label_smoothing=0.05)
    ref.backward()

    # The weight (and bias) as transformers' tensor-parallel head holds them: DTensors sharded on the
    # vocabulary (torch.chunk's split: uneven here, 21 + 20 rows); the hidden states a plain tensor.
    w = distribute_tensor(weight.float(), mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(bias.float(), mesh, [Shard(0)]).requires_grad_()
    h = hidden.float().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, labels, bias=b, softcap=4.0, label_smoothing=0.05, backend="torch")
    loss.backward()
    assert rel_err(loss, ref) <= 1e-5
    assert rel_err(h.grad, ref_inputs[0].grad) <= 1e-5
    assert rel_err(w.grad.full_tensor(), ref_inputs[1].grad) <= 1e-5
    assert rel_err(b.grad.full_tensor(), ref_inputs[2].grad) <= 1e-5

    # Sequence parallelism: hidden states sharded on the tokens are gathered into the replicated layout.
    w = distribute_tensor(weight.float(), mesh, [Shard(0)]).requires_grad_()
    h = distribute_tensor(hidden.float(), mesh, [Shard(0)]).requires_grad_()
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = naive_linear_cross_entropy(ref_h, ref_w, labels)
    ref.backward()
    loss = fused_linear_cross_entropy(h, w, labels, backend="torch")
    loss.backward()
    assert rel_err(loss, ref) <= 1e-5
    assert rel_err(h.grad.full_tensor(), ref_h.grad) <= 1e-5
    assert rel_err(w.grad.full_tensor(), ref_w.grad) <= 1e-5

    # Under torch.compile: a graph break around the vocabulary-parallel op, same result.
    w = distribute_tensor(weight.float(), mesh, [Shard(0)]).requires_grad_()
    compiled = torch.compile(lambda h, w: fused_linear_cross_entropy(h, w, labels, backend="torch"), backend="eager")
    assert rel_err(compiled(hidden.float(), w), ref) <= 1e-5

    # A weight sharded along D (row-wise) is refused with the placement named.
    with pytest.raises(ValueError, match="sharded along the vocabulary"):
        fused_linear_cross_entropy(hidden.float(), distribute_tensor(weight.float(), mesh, [Shard(1)]), labels)


def test_dtensor_weight_and_sequence_parallel_hidden():
    run_ranks(_dtensor_cases, 2)


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton is not usable here")
@pytest.mark.parametrize(
    "transform",
    [
        {},
        {"softcap": 2.5, "logit_scale": 0.7, "temperature": 1.3},
        {"label_smoothing": 0.1, "z_loss": 1e-3, "ignore_index": -1},
    ],
)
@pytest.mark.parametrize("world_size", [1, 3])
def test_fused_shard_steps_equal_torch(transform, world_size):
    """The exchanged block as the statistics kernel writes it (``shard_target``, kernels.py) and the one-launch merge
    (vocab_parallel_kernels.py) against their torch forms on fresh random logits and statistics: labels owned,
    owned by another shard, and ignored (their shard ids as the op's label launch makes them, tested in
    test_labels.py); a row whose every part is -inf; fp32 throughout (the merge's only dtype), so the two agree to
    fp32 rounding."""
    from lce_patch.ops.core.labels import LabelShard, shard_ids
    from lce_patch.ops.core.schema import replace_checked_fields
    from lce_patch.ops.linear_cross_entropy.rows import LogitTransform, RowOutputs, chunk_stats
    from lce_patch.ops.linear_cross_entropy.vocab_parallel import merge_blocks, pack_block

    gen = torch.Generator().manual_seed(world_size)
    rows, local_vocab, total = 37, 11, 40
    options = LogitTransform(vocab_size=total, **transform)
    local = replace_checked_fields(options, label_smoothing=0.0, z_loss=0.0, vocab_size=None)  # as ShardRowPass
    ignore = options.ignore_index
    labels = torch.randint(0, total, (rows,), generator=gen)
    labels[::5] = ignore
    torch_ids = shard_ids(labels, LabelShard(start=13, rows=local_vocab), ignore)
    assert ((torch_ids >= 0) & (torch_ids < local_vocab)).any() and (torch_ids == ignore).any()

    raw = torch.randn(rows, local_vocab, generator=gen) * 3
    target_raw = (raw.gather(1, torch_ids.clamp(0, local_vocab - 1)[:, None])[:, 0] + 1e-3).contiguous()
    smoothing = options.label_smoothing != 0.0
    packed = {}
    for fused in (True, False):
        where = "triton" if fused else "torch"
        block = on(where, torch.full((4, rows), float("nan")))
        out = RowOutputs(loss=block[1], lse=block[0], mean_logit=block[3] if smoothing else None)
        ids, target = on(where, torch_ids), on(where, target_raw)
        if fused:
            chunk_stats(on(where, raw), ids, local, out, None, True, target, shard_target=block[2])
        else:
            chunk_stats(on(where, raw), ids, local, out, None, False, target)
            pack_block(block, ids, target, local_vocab, options)
        packed[fused] = block.cpu()
    compared = 4 if smoothing else 3  # without smoothing the last row is not read
    valid = torch_ids != ignore  # an ignored row's exchanged values are never read but its lse's
    assert rel_err(packed[True][:compared][:, valid], packed[False][:compared][:, valid]) <= 1e-6
    assert rel_err(packed[True][0], packed[False][0]) <= 1e-6

    merged = torch.randn(world_size, 4, rows, generator=gen) * 5
    merged[:, 0, 3] = float("-inf")  # every part -inf: lse -inf
    results = {}
    for fused in (True, False):
        where = "triton" if fused else "torch"
        loss, lse = on(where, torch.empty(rows), torch.empty(rows))
        merge_blocks(on(where, merged), on(where, torch_ids), loss, lse, options, fused)
        results[fused] = (loss.cpu(), lse.cpu())
    assert results[True][1][3] == float("-inf") and results[False][1][3] == float("-inf")
    finite = torch.isfinite(results[False][1])
    assert rel_err(results[True][1][finite], results[False][1][finite]) <= 1e-6
    assert rel_err(results[True][0], results[False][0]) <= 1e-6
    assert torch.all(results[True][0][torch_ids == ignore] == 0)
