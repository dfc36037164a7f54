"""The Triton kernel of the vocabulary-parallel row pass (vocab_parallel.py): one launch where the torch form
takes five to fifteen.

Design note
-----------
Under tensor parallelism each rank's share of the GEMMs shrinks with the group (V / R columns), while the
bookkeeping around them does not: packing the per-row statistics for the exchange, and merging every
rank's statistics into the loss and the log-sum-exp (the labels' mapping into the shard is part of the
op's label launch, core/label_kernels.py, and the packing part of the statistics kernel, kernels.py).
Written as torch operations these were some 25 launches of kernels of a few microseconds each per chunk;
the host spends 20-50 us on each, so on a Llama-3.2-1B head at 4096 tokens over four H100s the op ran at
4.5-5.0 ms where its GEMMs need 2.7 (2026-11-27, profiled), and a model step under tensor parallelism is
host-bound: the host's time is the step's.

``shard_merge_kernel``: every rank's block [R, 4, C] (rows: the local lse, the local lse with the exact
target swapped in, the target's final logit where owned, the sum of the final logits) -> the whole
vocabulary's lse and loss per row, merged in rank order on every rank (so every rank computes the same bits),
in one pass over a few [C] rows.

Memory: nothing beyond the [4, C] block and its gathered [R, 4, C] copy. FLOPs: O(R * C), negligible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.triton_helpers import max_keep_nan

# Rows of the exchanged block (see vocab_parallel.ShardRowPass).
LSE = tl.constexpr(0)
LOSS_LSE = tl.constexpr(1)
TARGET = tl.constexpr(2)
SUM_Z = tl.constexpr(3)


@triton.jit
def _logsumexp_over_ranks(gathered_ptr, offsets, mask, row: tl.constexpr, rows, world, BLOCK: tl.constexpr):
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for r in range(world):
        m = max_keep_nan(m, tl.load(gathered_ptr + (r * 4 + row) * rows + offsets, mask=mask, other=0.0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # every part -inf: the sum is 0 and the lse -inf
    s = tl.zeros([BLOCK], tl.float32)
    for r in range(world):
        s += tl.exp(tl.load(gathered_ptr + (r * 4 + row) * rows + offsets, mask=mask, other=0.0) - m_safe)
    return m_safe + tl.log(s)


@triton.jit
def shard_merge_kernel(
    gathered_ptr,
    labels_ptr,
    loss_ptr,
    lse_ptr,
    rows,
    world,
    ignore_index,
    label_smoothing,
    inv_vocab,
    z_loss,
    SMOOTHING: tl.constexpr,
    Z_LOSS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``gathered`` [world, 4, rows] fp32 -> ``loss`` and ``lse`` [rows] of the whole vocabulary (loss 0
    where the label is ignored)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < rows
    lse = _logsumexp_over_ranks(gathered_ptr, offsets, mask, LSE, rows, world, BLOCK)
    loss_lse = _logsumexp_over_ranks(gathered_ptr, offsets, mask, LOSS_LSE, rows, world, BLOCK)
    target = tl.zeros([BLOCK], tl.float32)
    sum_z = tl.zeros([BLOCK], tl.float32)
    for r in range(world):
        target += tl.load(gathered_ptr + (r * 4 + TARGET) * rows + offsets, mask=mask, other=0.0)
        if SMOOTHING:
            sum_z += tl.load(gathered_ptr + (r * 4 + SUM_Z) * rows + offsets, mask=mask, other=0.0)
    loss = loss_lse - (1.0 - label_smoothing) * target
    if SMOOTHING:
        loss -= label_smoothing * sum_z * inv_vocab
    if Z_LOSS:
        loss += z_loss * loss_lse * loss_lse
    label = tl.load(labels_ptr + offsets, mask=mask, other=ignore_index)
    tl.store(loss_ptr + offsets, tl.where(label != ignore_index, loss, 0.0), mask=mask)
    tl.store(lse_ptr + offsets, lse, mask=mask)
