"""Triton kernels of the vocabulary-parallel row pass (vocab_parallel.py): one launch per step where the
torch form takes five to fifteen.

Design note
-----------
Under tensor parallelism each rank's share of the GEMMs shrinks with the group (V / R columns), while the
bookkeeping around them does not: packing the per-row statistics for the exchange, and merging every
rank's statistics into the loss and the log-sum-exp (the labels' mapping into the shard is part of the
op's label launch, core/label_kernels.py). Written as torch operations these were some 25 launches of
kernels of a few microseconds each per chunk; the host spends 20-50 us on each, so on a Llama-3.2-1B head
at 4096 tokens over four H100s the op ran at 4.5-5.0 ms where its GEMMs need 2.7 (2026-11-27, profiled),
and a model step under tensor parallelism is host-bound: the host's time is the step's. These kernels do each step in one pass over a few [C] rows:

* ``shard_pack_kernel``: from the statistics kernel's local loss and log-sum-exp, the block that is
  exchanged: the local log-sum-exp with the exact target logit swapped in (loss + z_y), the target's
  final logit z_y (0 where not owned), and the sum of the final logits (label smoothing).
* ``shard_merge_kernel``: every rank's block [R, 4, C] -> the whole vocabulary's lse and loss per row,
  merged in rank order on every rank (so every rank computes the same bits).

Memory: nothing beyond the [4, C] block and its gathered [R, 4, C] copy. FLOPs: O(R * C), negligible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.triton_helpers import max_keep_nan, transform_logits

# Rows of the exchanged block (see vocab_parallel.ShardRowPass).
LSE = tl.constexpr(0)
LOSS_LSE = tl.constexpr(1)
TARGET = tl.constexpr(2)
SUM_Z = tl.constexpr(3)


@triton.jit
def shard_pack_kernel(
    block_ptr,
    labels_ptr,
    target_raw_ptr,
    rows,
    local_vocab,
    logit_scale,
    softcap,
    inv_temperature,
    HAS_SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``block`` [4, rows] fp32, contiguous: on entry LSE and LOSS_LSE hold the statistics kernel's local lse
    and loss (SUM_Z its mean final logit with smoothing); on exit the exchanged rows."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < rows
    label = tl.load(labels_ptr + offsets, mask=mask, other=-1)
    owned = (label >= 0) & (label < local_vocab)
    raw = tl.load(target_raw_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    z, _ = transform_logits(raw, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
    z = tl.where(owned, z, 0.0)
    # Without smoothing or z-loss the local loss is (lse with the exact target swapped in) - z_y, and
    # z_y = 0 where the shard does not own the label: adding z_y back gives that lse.
    loss_lse = tl.load(block_ptr + LOSS_LSE * rows + offsets, mask=mask, other=0.0)
    tl.store(block_ptr + LOSS_LSE * rows + offsets, loss_lse + z, mask=mask)
    tl.store(block_ptr + TARGET * rows + offsets, z, mask=mask)
    if SMOOTHING:  # the kernel's mean over the shard -> its sum
        mean_z = tl.load(block_ptr + SUM_Z * rows + offsets, mask=mask, other=0.0)
        tl.store(block_ptr + SUM_Z * rows + offsets, mean_z * local_vocab, mask=mask)


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
