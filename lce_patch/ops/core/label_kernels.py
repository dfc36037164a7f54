"""The Triton kernel that prepares an op's labels in one launch (labels.py).

Design note
-----------
Before its first GEMM an op reads its labels several times: the range check, the count of valid labels
(the "mean" reduction's divisor), the check of ``num_valid_tokens`` and ``num_items_in_batch``, the rows to
process when ignored ones are skipped, and, for a vocabulary shard, each label's id in the shard. Written as
torch operations that is some thirty launches of kernels of a few microseconds each, and the host's time to
launch them (20-40 us apiece on the H100 hosts measured, 2026-11-27) is what a small or tensor-parallel step
waits for: the GPU part of a Llama-3.2-1B head at 4096 tokens on one of four ranks is under 2 ms.

``prepare_labels_kernel`` does all of it in one program that walks the labels in blocks of ``BLOCK``:

* each block's valid labels (not ``ignore_index``) are counted, and any valid label outside ``[0, V)``
  raises a flag;
* with a shard, each label becomes its id in the shard (``label - start`` where the shard owns it, the
  out-of-range ``not_owned`` where another shard does, ``ignore_index`` kept);
* with a row selection (``COMPACT``), a prefix sum over the block places each valid row's index, and its
  label, at its rank among the valid rows so far: the rows come out ascending, as a stable sort would give
  them. Positions at or past ``expected`` (the caller's count, ``num_valid_tokens``) are not written, and
  positions the labels leave unfilled below it get row 0 and ``ignore_index``, so a wrong count is refused
  by its flag without any later kernel reading outside the tensors;
* at the end: the count, the reduction's factor (1 / count for "mean", 1 for "sum", 1 / num_items with
  ``num_items_in_batch``; 0 when that is 0), three flags (labels in range, count equal to ``expected``,
  ``num_items_in_batch`` finite and > 0, or 0 with no valid label) and a fourth that holds when every check
  the call asked for does (the count only with ``check_count``), which the caller turns into one
  asynchronous device assert: each assert is a launch of its own.

With ``SHIFT`` the labels are read shifted within rows of ``shift_rows`` labels, as a causal LM's loss wants
them: position t of a row takes the label of position t + 1, the last position of each row ``ignore_index``;
``ids`` then receives the shifted labels (shard ids with a shard). That saves the two launches of a shift
written in torch, and its copy of the labels.

One program: the only dependency between blocks is the running count, and the walk reads 8 bytes per token
(plus 16 per selected row written), a few microseconds at 4096 tokens and well under a millisecond at a
million, next to GEMMs of milliseconds to seconds. No atomics: the result is deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Reduction codes of the kernel (labels.py maps the op's reduction onto them).
NO_SCALE = tl.constexpr(0)
MEAN = tl.constexpr(1)
SUM = tl.constexpr(2)
NUM_ITEMS = tl.constexpr(3)


@triton.jit
def prepare_labels_kernel(
    labels_ptr,
    ids_ptr,
    row_index_ptr,
    row_labels_ptr,
    num_valid_ptr,
    scale_ptr,
    ok_ptr,
    num_items_ptr,
    n,
    vocab_size,
    shard_start,
    shard_rows,
    ignore_index,
    not_owned,
    expected,
    check_count,
    shift_rows,
    SHARD: tl.constexpr,
    SHIFT: tl.constexpr,
    COMPACT: tl.constexpr,
    REDUCTION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``labels`` [n] int64 -> ``ids`` [n] (with SHARD or SHIFT), ``row_index`` / ``row_labels`` [expected] (with
    COMPACT), ``num_valid`` [1] int64, ``scale`` [1] fp32, ``ok`` [4] int32 (see the module's note)."""
    count = tl.program_id(0).to(tl.int64) * 0
    bad = count
    for block_start in range(0, n, BLOCK):
        offsets = block_start + tl.arange(0, BLOCK).to(tl.int64)
        mask = offsets < n
        if SHIFT:
            at_row_end = (offsets + 1) % shift_rows == 0
            label = tl.load(labels_ptr + offsets + 1, mask=mask & ~at_row_end, other=ignore_index).to(tl.int64)
        else:
            label = tl.load(labels_ptr + offsets, mask=mask, other=ignore_index).to(tl.int64)
        valid = mask & (label != ignore_index)
        out_of_range = valid & ((label < 0) | (label >= vocab_size))
        bad = tl.maximum(bad, tl.max(out_of_range.to(tl.int64), 0))
        if SHARD:
            local = label - shard_start
            owned = (local >= 0) & (local < shard_rows)
            label = tl.where(valid, tl.where(owned, local, not_owned), ignore_index)
            tl.store(ids_ptr + offsets, label, mask=mask)
        elif SHIFT:
            tl.store(ids_ptr + offsets, label, mask=mask)
        valid_count = valid.to(tl.int32)
        if COMPACT:
            position = count + tl.cumsum(valid_count, 0).to(tl.int64) - 1
            keep = valid & (position < expected)
            tl.store(row_index_ptr + position, offsets, mask=keep)
            tl.store(row_labels_ptr + position, label, mask=keep)
        count += tl.sum(valid_count, 0).to(tl.int64)
    if COMPACT:
        for tail_start in range(0, expected, BLOCK):
            offsets = tail_start + tl.arange(0, BLOCK).to(tl.int64)
            unfilled = (offsets >= count) & (offsets < expected)
            tl.store(row_index_ptr + offsets, offsets * 0, mask=unfilled)
            tl.store(row_labels_ptr + offsets, offsets * 0 + ignore_index, mask=unfilled)
    tl.store(num_valid_ptr, count)
    tl.store(ok_ptr, (bad == 0).to(tl.int32))
    tl.store(ok_ptr + 1, (count == expected).to(tl.int32))
    items_ok = count == count
    if REDUCTION == MEAN:
        scale = tl.where(count > 0, tl.math.div_rn(1.0, tl.maximum(count, 1).to(tl.float32)), 0.0)
    elif REDUCTION == SUM:
        scale = (count * 0 + 1).to(tl.float32)
    elif REDUCTION == NUM_ITEMS:
        items = tl.load(num_items_ptr).to(tl.float64)
        finite = (items == items) & (tl.abs(items) < float("inf"))
        items_ok = finite & ((items > 0) | ((items == 0) & (count == 0)))
        items = items.to(tl.float32)
        scale = tl.where(items > 0, tl.math.div_rn(1.0, tl.maximum(items, 1.1754943508222875e-38)), 0.0)
    else:  # NO_SCALE: an unused 0
        scale = count.to(tl.float32) * 0.0
    tl.store(scale_ptr, scale)
    tl.store(ok_ptr + 2, items_ok.to(tl.int32))
    count_ok = (count == expected) | (check_count == 0)
    tl.store(ok_ptr + 3, ((bad == 0) & count_ok & items_ok).to(tl.int32))
