"""An op's labels prepared for its chunks: checked, counted, the reduction's factor, the rows to process and, for
a vocabulary shard, the shard's ids. One Triton launch on the Triton backend (label_kernels.py, whose note says
why); the torch form here serves the torch backend and is the kernel's reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .backend import HAS_TRITON
from .checks import check_labels, check_num_items, fail, selected_rows
from .reduction import loss_scale

_kernels = None
if HAS_TRITON:
    from . import label_kernels as _kernels

# Labels per block of the kernel's walk (one program; see label_kernels.py).
_BLOCK = 2048
_REDUCTION_CODES = {None: 0, "mean": 1, "sum": 2}
_NUM_ITEMS_CODE = 3


class LabelShard(NamedTuple):
    """The weight holds rows ``[start, start + rows)`` of the vocabulary: labels become ids of the shard."""

    start: int
    rows: int


class LabelRows(NamedTuple):
    """What :func:`prepare_labels` gives.

    labels: [N] int64, the labels as given (shifted with ``shift_rows``), or with a shard each one's id in it
    (``ignore_index`` kept; a label another shard owns becomes :func:`not_owned_id`). row_index: [M] int64
    ascending, the rows whose label is valid, or None when every row is processed. row_labels: [M] int64,
    ``labels`` of those rows (``labels`` itself without a selection). num_valid: 0-d int64, the count of valid
    labels. scale: 0-d, the factor a scalar loss applies to its sum (see :func:`..reduction.loss_scale`), or None
    when not asked.
    """

    labels: torch.Tensor
    row_index: torch.Tensor | None
    row_labels: torch.Tensor
    num_valid: torch.Tensor
    scale: torch.Tensor | None


def not_owned_id(ignore_index: int) -> int:
    """The id a shard gives a valid label another shard owns: out of every shard's range, and not ``ignore_index``."""
    return -1 if ignore_index != -1 else -2


def shard_ids(labels: torch.Tensor, shard: LabelShard, ignore_index: int) -> torch.Tensor:
    """Labels as ids of ``shard`` (torch form): ``label - start`` where the shard owns it, ``ignore_index`` where
    ignored, :func:`not_owned_id` elsewhere."""
    local = labels - shard.start
    owned = (local >= 0) & (local < shard.rows)
    not_owned = not_owned_id(ignore_index)
    return torch.where(labels == ignore_index, ignore_index, torch.where(owned, local, not_owned))


def shift_rows_of(labels: torch.Tensor, row_length: int, ignore_index: int) -> torch.Tensor:
    """``labels`` [N] (rows of ``row_length``, flattened) shifted within each row: position t takes the label of
    t + 1, each row's last position ``ignore_index`` (torch form of the label kernel's ``SHIFT``)."""
    rows = labels.view(-1, row_length)
    shifted = torch.full_like(rows, ignore_index)
    shifted[:, :-1] = rows[:, 1:]
    return shifted.view(-1)


def prepare_labels(
    labels: torch.Tensor,
    *,
    vocab_size: int,
    ignore_index: int,
    select: bool,
    num_valid_tokens: int | None,
    reduction: str | None,
    num_items: torch.Tensor | None,
    scale_dtype: torch.dtype,
    shard: LabelShard | None,
    use_triton: bool,
    op_name: str,
    shift_rows: int = 0,
    none_counted: str = "every label is ignored",
    counted: str = "valid labels",
) -> LabelRows:
    """Check and prepare ``labels`` [N] (int64, contiguous) for an op over a vocabulary of ``vocab_size`` ids.

    Every valid label (not ``ignore_index``) must lie in ``[0, vocab_size)``. ``select``: process only the rows
    with a valid label (``skip_ignored``), counted on the host (one sync) unless ``num_valid_tokens`` gives the
    count, which is then checked. ``reduction`` ("mean", "sum", or None for no factor) and ``num_items``
    (``num_items_in_batch`` as a 0-d tensor, checked: finite and > 0, or 0 with no valid label) give the scale,
    in ``scale_dtype``. ``shift_rows`` > 0: ``labels`` are rows of that length, flattened, still to be shifted
    (:func:`shift_rows_of`); every output then speaks of the shifted labels. Value checks are one asynchronous
    device assert on CUDA (no sync), ``ValueError`` elsewhere; ``none_counted`` and ``counted`` word the
    num_items message.
    """
    if num_items is not None and reduction is None:
        raise ValueError("prepare_labels: num_items needs a reduction")
    if use_triton and _kernels is not None and scale_dtype == torch.float32:
        return _prepare_triton(
            labels, vocab_size, ignore_index, select, num_valid_tokens, reduction, num_items, shard, op_name,
            shift_rows, none_counted, counted,
        )  # fmt: skip
    if shift_rows:
        labels = shift_rows_of(labels, shift_rows, ignore_index)
    check_labels(labels, vocab_size, ignore_index, op_name)
    valid = labels != ignore_index
    row_index = selected_rows(valid, num_valid_tokens, op_name) if select else None
    num_valid = valid.sum()
    scale = None
    if reduction is not None:
        scale = loss_scale(
            num_valid.to(scale_dtype), num_items, reduction, op_name=op_name, none_counted=none_counted,
            counted=counted,
        )  # fmt: skip
    if shard is not None:
        labels = shard_ids(labels, shard, ignore_index)
    row_labels = labels if row_index is None else labels.index_select(0, row_index)
    return LabelRows(labels, row_index, row_labels, num_valid, scale)


def _prepare_triton(
    labels, vocab_size, ignore_index, select, num_valid_tokens, reduction, num_items, shard, op_name, shift_rows,
    none_counted, counted,
) -> LabelRows:  # fmt: skip
    n = labels.shape[0]
    device = labels.device
    expected = num_valid_tokens
    if select and expected is None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        select = False  # no host sync while a CUDA graph is captured: every row is processed, the same result
    if select and expected is None:  # count first (the one host sync of skip_ignored without a count)
        counted_valid = _launch(labels, vocab_size, ignore_index, None, None, None, None, 0, False, shift_rows)
        expected = int(counted_valid.num_valid)
    compact = select and expected != n
    result = _launch(
        labels, vocab_size, ignore_index, expected if compact else None, reduction, num_items, shard,
        expected if expected is not None else -1, num_valid_tokens is not None, shift_rows,
    )  # fmt: skip
    if device.type == "cuda":
        # One assert for every check (each is a launch): its message names each one the call asked for.
        problems = [f"a label is outside [0, {vocab_size}) and is not ignore_index ({ignore_index})"]
        if num_valid_tokens is not None:
            problems.append("num_valid_tokens differs from the number of labels that are not ignore_index")
        if num_items is not None:
            problems.append(f"num_items_in_batch must be finite and > 0 (0 only when {none_counted})")
        torch._assert_async(result.ok[3], f"{op_name}: " + "; or ".join(problems))
    elif not bool(result.ok[3]):
        # The interpreter (tests): the torch checks name the offending value.
        if shift_rows:
            labels = shift_rows_of(labels, shift_rows, ignore_index)
        check_labels(labels, vocab_size, ignore_index, op_name)
        selected_rows(labels != ignore_index, num_valid_tokens, op_name)
        if num_items is not None:
            check_num_items(num_items, result.num_valid, op_name=op_name, none_counted=none_counted, counted=counted)
        fail("the label checks disagree between backends", op_name)  # pragma: no cover - a kernel bug
    ids = result.ids
    row_labels = result.row_labels if compact else ids
    scale = result.scale if reduction is not None else None
    return LabelRows(ids, result.row_index if compact else None, row_labels, result.num_valid, scale)


class _Launched(NamedTuple):
    ids: torch.Tensor
    row_index: torch.Tensor | None
    row_labels: torch.Tensor | None
    num_valid: torch.Tensor
    scale: torch.Tensor
    ok: torch.Tensor


def _launch(
    labels, vocab_size, ignore_index, compact_rows, reduction, num_items, shard, expected, check_count, shift_rows
) -> _Launched:
    """One launch of the kernel; ``compact_rows``: the M rows to select, or None for no selection."""
    device = labels.device
    ids = torch.empty_like(labels) if shard is not None or shift_rows else labels
    row_index = row_labels = None
    if compact_rows is not None:
        row_index = torch.empty(compact_rows, dtype=torch.int64, device=device)
        row_labels = torch.empty(compact_rows, dtype=torch.int64, device=device)
    num_valid = torch.empty((), dtype=torch.int64, device=device)
    scale = torch.empty((), dtype=torch.float32, device=device)
    ok = torch.empty(4, dtype=torch.int32, device=device)
    code = _NUM_ITEMS_CODE if num_items is not None else _REDUCTION_CODES[reduction]
    _kernels.prepare_labels_kernel[(1,)](
        labels, ids, row_index if row_index is not None else labels, row_labels if row_labels is not None else labels,
        num_valid, scale, ok, num_items if num_items is not None else scale, labels.shape[0], vocab_size,
        shard.start if shard is not None else 0, shard.rows if shard is not None else vocab_size, ignore_index,
        not_owned_id(ignore_index), expected, int(check_count), shift_rows, SHARD=shard is not None,
        SHIFT=shift_rows > 0, COMPACT=compact_rows is not None, REDUCTION=code, BLOCK=_BLOCK, num_warps=8,
    )  # fmt: skip
    return _Launched(ids, row_index, row_labels, num_valid, scale, ok)
