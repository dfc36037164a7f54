"""The reductions every op accepts and the factor a scalar loss applies to its sum of token losses.

Every public op takes ``reduction`` in ``REDUCTIONS``: "mean" (over the tokens the op counts), "sum", or
"none" (one loss per token); with ``num_items_in_batch`` a scalar reduction divides the sum by that count
instead (gradient accumulation). The options objects keep these words; the count travels as a 0-d tensor.
"""

from __future__ import annotations

import torch

from .checks import check_num_items, fail

REDUCTIONS = ("mean", "sum", "none")


def check_reduction(reduction: str, num_items_in_batch, op_name: str) -> None:
    """``reduction`` is one of ``REDUCTIONS``, and a count is given only with a scalar one."""
    if reduction not in REDUCTIONS:
        fail(f"reduction must be one of {REDUCTIONS}, got {reduction!r}", op_name)
    if num_items_in_batch is not None and reduction == "none":
        fail("num_items_in_batch needs a scalar reduction ('mean' or 'sum'), not 'none'", op_name)


def loss_scale(
    count: torch.Tensor,
    num_items: torch.Tensor | None,
    reduction: str,
    *,
    op_name: str,
    none_counted: str,
    counted: str,
) -> torch.Tensor | None:
    """The factor of the sum of the counted tokens' losses (0-d, ``count``'s dtype), or None for "none":
    1 / ``count`` (0-d, the tokens "mean" averages over) for "mean", 1 for "sum", 1 / ``num_items`` when given
    (checked here, inside the op, where a value check costs no graph break under ``torch.compile``;
    ``none_counted`` and ``counted`` word its message). Nothing counted (or num_items 0 with nothing counted):
    0, so the loss is a finite 0 with zero gradients."""
    if reduction == "none":
        return None
    dtype = count.dtype
    if num_items is not None:
        check_num_items(num_items, count, op_name=op_name, none_counted=none_counted, counted=counted)
        count = num_items.to(dtype)
    elif reduction == "sum":
        count = torch.ones((), dtype=dtype, device=count.device)
    return torch.where(count > 0, 1 / count.clamp(min=torch.finfo(dtype).tiny), torch.zeros_like(count))
