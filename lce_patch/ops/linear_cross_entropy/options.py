"""The cross-entropy op's name (every message starts with it), its checks bound to that name, and the
options of one call of its chunked forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core import checks

if TYPE_CHECKING:
    from .rows import LogitTransform
    from .vocab_parallel import VocabShard

OP_NAME = "fused_linear_cross_entropy"


def fail(message: str) -> None:
    checks.fail(message, OP_NAME)


def check_int(name: str, value, **bounds) -> None:
    checks.check_int(name, value, op_name=OP_NAME, **bounds)


def check_real(name: str, value, **bounds) -> None:
    checks.check_real(name, value, op_name=OP_NAME, **bounds)


@dataclass(frozen=True)
class ChunkedOptions:
    """Everything about one call of the chunked op that is not a tensor.

    reduction: "mean" (over valid labels), "sum", "items" (sum / num_items_in_batch) for a scalar loss,
    or None for per-token outputs. needs_grad: whether (hidden, weight, bias) get gradients. want:
    whether to compute (entropy, is_top1, mean_logit, log_sum_sq). chunk_size: rows per chunk, None for the default.
    skip_ignored / num_valid_tokens: process the valid rows only (see :func:`..core.checks.selected_rows`).
    shard: the weight is this rank's shard of a vocabulary split across a process group (vocab_parallel.py;
    ``transform.vocab_size`` is then the whole vocabulary's size, and ``want`` all False).
    needs_low_rank_grad: whether the low-rank term's (hidden, weight) get gradients (:class:`LowRank`).
    """

    transform: LogitTransform
    reduction: str | None
    use_triton: bool
    needs_grad: tuple[bool, bool, bool]
    want: tuple[bool, bool, bool, bool] = (False, False, False, False)
    chunk_size: int | None = None
    skip_ignored: bool = False
    num_valid_tokens: int | None = None
    precompute_grad: bool = False
    shard: VocabShard | None = None
    needs_low_rank_grad: tuple[bool, bool] = (False, False)
