"""The Triton launchers of the cross-entropy op's kernels (``kernels.py``) and their block constants: the row
pass's statistics and gradient kernels over a ``[C, V]`` chunk of logits, and the target-logit kernel. ``rows.py``
dispatches to them, or to its torch forms, which compute the same thing; the kernels are imported only where Triton
is installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core.backend import HAS_TRITON, cdiv, next_power_of_2
from ..core.transform import LogitTransform

if TYPE_CHECKING:
    from .rows import ClassSmoothing, RowOutputs

_kernels = None
if HAS_TRITON:
    from . import kernels as _kernels

# Vocabulary block per program iteration of the stats kernel (8 warps, one program per row): it keeps
# up to five fp32 per-lane accumulators, 16 registers per thread each at 4096 lanes. On the H100 the
# pass with the gradient ran 3-10% faster at 4096 than at 2048 lanes (2.7 vs 2.5 TB/s on 1008-row
# chunks of the Llama-3, Qwen2.5 and Gemma-2 vocabularies), and fewer, row-looping programs were
# slower (benchmarks/NOTES.md, v10).
_BLOCK_V_STATS = 4096
_STATS_NUM_WARPS = 8
_BLOCK_V_GRAD = 4096
# Consecutive logits per lane of the stats kernel (one running max per lane). 8 took the forward-only
# pass 124 -> 101 us per 1008-row chunk of the Llama-3 vocabulary (Qwen2.5 144 -> 118, Gemma-2 253 ->
# 238) and the pass with the gradient 282 -> 274 (Qwen2.5 334 -> 324), but Gemma-2's bounded-exponent
# pass with the gradient 571 -> 588: that case keeps one logit per lane (NOTES v11), and so does its
# one-pass form (675 us per 1792-row chunk vs 686-791 with lanes of 2, 4 or 8; NOTES v15).
_LANE_GROUP = 8
# With one logit per lane (the bounded-exponent pass with the gradient) the argmax is kept per this many lanes:
# one max and one column per lane took that pass from 251 to 407 us per 1024-row chunk of the Llama-3
# vocabulary (softcap 30, bf16) on the H200, per 8 lanes to 291 (order-preserving reshape).
_MAX_REGROUP = 8
# Softcapped logits satisfy |z| <= softcap / temperature; up to this bound the stats kernel takes its
# exponentials against the bound instead of a running max (exp(-2 * 40) is still a normal fp32).
_FIXED_MAX_LIMIT = 40.0


def _kernel_scalars(transform: LogitTransform) -> dict:
    return {
        "ignore_index": transform.ignore_index,
        "logit_scale": float(transform.logit_scale),
        "softcap": float(transform.softcap or 1.0),
        "inv_temperature": 1.0 / float(transform.temperature),
        "label_smoothing": float(transform.label_smoothing),
        "z_loss": float(transform.z_loss),
        "HAS_SOFTCAP": transform.softcap is not None,
        "HAS_SMOOTHING": transform.label_smoothing != 0.0,
        "HAS_Z_LOSS": transform.z_loss != 0.0,
    }


def _fixed_max(transform: LogitTransform) -> float | None:
    """The bound softcap / temperature on |z| when the kernel takes exponentials against it, else None."""
    if transform.softcap is None:
        return None
    bound = transform.softcap / transform.temperature
    return bound if bound <= _FIXED_MAX_LIMIT else None


def unnormalized_grad_applies(transform: LogitTransform, dtype: torch.dtype, use_triton: bool) -> bool:
    """Whether ``chunk_stats`` can write the gradient in one pass as rows to be scaled (``row_factor``).

    Only the Triton kernel's bounded-exponent path (a softcap) does: there the exponentials need no
    running max, so the buffer can be overwritten while the row's sum is still being taken. Label
    smoothing and z-loss put the row's sum or lse inside every element, and fp16 lacks the range for
    values up to e^40: those keep the two-pass gradient."""
    return (
        use_triton
        and _fixed_max(transform) is not None
        and transform.label_smoothing == 0.0
        and transform.z_loss == 0.0
        and dtype in (torch.bfloat16, torch.float32)
    )


def launch_chunk_stats(
    raw,
    labels,
    transform,
    out: RowOutputs,
    grad_scale: torch.Tensor | None,
    target_raw: torch.Tensor | None,
    row_factor: torch.Tensor | None,
    class_smoothing: ClassSmoothing | None = None,
    shard_target: torch.Tensor | None = None,
) -> None:
    """The statistics kernel over ``raw`` [C, V] (row-contiguous, the GEMM's dtype): fills ``out`` and, with
    ``grad_scale``, writes the logits' gradient over ``raw``; the arguments as :func:`.rows.chunk_stats`'s."""
    rows, vocab_size = raw.shape
    placeholder = out.loss
    want_log_sum_sq = out.log_sum_sq is not None
    fixed_max = _fixed_max(transform)
    # The sum of squared exponentials against the bound could underflow (e^(2 (z - bound)) for logits far below
    # it), and the entropy's sums are taken below the row's max: with either the kernel keeps its running max,
    # which the one-pass gradient cannot do without.
    use_fixed_max = fixed_max is not None and not want_log_sum_sq and out.entropy is None
    unnormalized = row_factor is not None
    if unnormalized and not (grad_scale is not None and unnormalized_grad_applies(transform, raw.dtype, True)):
        raise ValueError("chunk_stats: row_factor needs grad_scale and a case unnormalized_grad_applies to")
    if unnormalized and (want_log_sum_sq or out.entropy is not None):
        # both need the running max; the one-pass gradient is written on the bounded-exponent path only
        raise ValueError("chunk_stats: row_factor cannot be combined with log_sum_sq or the entropy")
    block_v = min(_BLOCK_V_STATS, next_power_of_2(vocab_size))
    lane_group = 1 if use_fixed_max and grad_scale is not None else min(_LANE_GROUP, block_v)
    argmax = out.predicted is not None or out.is_top1 is not None  # is_top1 reads the argmax
    _kernels.stats_kernel[(rows,)](
        raw,
        raw.stride(0),
        labels,
        out.loss,
        out.lse,
        out.entropy if out.entropy is not None else placeholder,
        out.is_top1 if out.is_top1 is not None else placeholder,
        out.mean_logit if out.mean_logit is not None else placeholder,
        out.log_sum_sq if want_log_sum_sq else placeholder,
        out.predicted if out.predicted is not None else placeholder,
        grad_scale if grad_scale is not None else placeholder,
        target_raw if target_raw is not None else placeholder,
        row_factor if unnormalized else placeholder,
        class_smoothing.q if class_smoothing is not None else placeholder,
        class_smoothing.smoothing if class_smoothing is not None else placeholder,
        class_smoothing.z_loss if class_smoothing is not None else placeholder,
        shard_target if shard_target is not None else placeholder,
        vocab_size,
        fixed_max=fixed_max if use_fixed_max else 0.0,
        HAS_EXACT_TARGET=target_raw is not None,
        FIXED_MAX=use_fixed_max,
        WANT_ENTROPY=out.entropy is not None,
        WANT_TOP1=out.is_top1 is not None,
        WANT_MEAN_LOGIT=out.mean_logit is not None,
        WANT_LOG_SUM_SQ=want_log_sum_sq,
        WANT_ARGMAX=out.predicted is not None,
        WRITE_GRAD=grad_scale is not None,
        UNNORMALIZED_GRAD=unnormalized,
        PER_ROW_SCALE=grad_scale is not None and grad_scale.dim() == 1,
        WEIGHTED_SMOOTHING=class_smoothing is not None,
        SHARD_PACK=shard_target is not None,
        BLOCK_V=block_v,
        LANE_GROUP=lane_group,
        MAX_REGROUP=_MAX_REGROUP if argmax and lane_group == 1 and block_v >= _MAX_REGROUP else 1,
        num_warps=_STATS_NUM_WARPS,
        **_kernel_scalars(transform),
    )


def launch_chunk_grad(raw, labels, transform, lse, entropy, grad_loss, grad_entropy) -> None:
    """The gradient kernel: overwrites ``raw`` [C, V] with the gradient of the rows' outputs (``lse``, ``entropy``,
    ``grad_loss``, ``grad_entropy``: fp32 [C]); the arguments as :func:`.rows.chunk_grad`'s."""
    rows, vocab_size = raw.shape
    block_v = min(_BLOCK_V_GRAD, next_power_of_2(vocab_size))
    grid = (rows, cdiv(vocab_size, block_v))
    _kernels.grad_kernel[grid](
        raw,
        raw.stride(0),
        labels,
        lse,
        entropy if entropy is not None else lse,
        grad_loss if grad_loss is not None else lse,
        grad_loss.stride(0) if grad_loss is not None else 0,
        grad_entropy if grad_entropy is not None else lse,
        vocab_size,
        transform.vocab_size or vocab_size,
        HAS_LOSS_GRAD=grad_loss is not None,
        HAS_ENTROPY_GRAD=grad_entropy is not None,
        BLOCK_V=block_v,
        num_warps=8,
        **_kernel_scalars(transform),
    )


def launch_target_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    row_index: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Fill ``out`` (fp32 [M], M > 0 rows) with ``hidden[i] . weight[labels[i]] (+ bias)`` for every row i of
    ``hidden`` [N, D], or for the rows of ``row_index`` [M]; 0 where the label is outside [0, V)."""
    hidden_size = hidden.shape[1]
    num_rows = out.shape[0]
    vocab_size = weight.shape[0]
    _kernels.target_logit_kernel[(num_rows,)](
        hidden,
        hidden.stride(0),
        hidden.stride(1),
        weight,
        weight.stride(0),
        weight.stride(1),
        bias if bias is not None else out,
        bias.stride(0) if bias is not None else 0,
        labels,
        labels.stride(0),
        row_index if row_index is not None else labels,
        out,
        hidden_size,
        vocab_size,
        HAS_BIAS=bias is not None,
        GATHER_ROWS=row_index is not None,
        BLOCK_D=min(1024, next_power_of_2(hidden_size)),
    )
