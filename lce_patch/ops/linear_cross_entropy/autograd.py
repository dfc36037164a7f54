"""The cross-entropy op's one backward, and its autograd Function for eager calls.

:func:`op_backward` is the backward of every call, eager or compiled: the autograd Function below calls it with
``in_place=True``, the custom operators of ``custom_op.py`` (``torch.compile``) with ``in_place=False``. A scalar
loss's gradients were computed in the forward and are only multiplied by the upstream gradient; per-token outputs
either rescale the gradients ``precompute_grad`` computed in the forward (when the upstream gradient is uniform)
or recompute them chunk by chunk (:func:`chunked.chunked_backward`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.grads import LowRank, claim_scalar_backward, scaled_by_upstream
from .chunked import chunked_backward, chunked_forward
from .options import OP_NAME, CrossEntropyOptions


class Saved(NamedTuple):
    """What the backward of per-token outputs reads, saved by the forward.

    The inputs (2-D, in the compute dtype; the low-rank term's or None); ``row_index`` (the processed rows, None
    for all) and, of those rows, ``row_labels``, ``lse`` and ``entropy`` (None unless the entropy may get a
    gradient); ``precomputed``: with ``precompute_grad``, the forward's (dh, dw, db, d_low_rank_hidden,
    d_low_rank_weight, grad_scale), else None.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    low_rank_hidden: torch.Tensor | None
    low_rank_weight: torch.Tensor | None
    row_labels: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor | None
    row_index: torch.Tensor | None
    precomputed: tuple | None


def uniform_factor(
    grad_loss: torch.Tensor, labels: torch.Tensor, ignore_index: int, precompute_scale: torch.Tensor
) -> torch.Tensor | None:
    """``g / precompute_scale`` (0-d) when every non-ignored row got the same upstream gradient ``g``, else None.

    ``grad_loss`` and ``labels`` are of the same rows. One host sync: whether the precomputed
    gradients apply decides which kernels to launch (none while a CUDA graph is captured: None).
    """
    grad_loss = grad_loss.reshape(-1)
    if grad_loss.numel() == 0:
        return torch.zeros((), dtype=precompute_scale.dtype, device=grad_loss.device)
    if grad_loss.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    valid = labels != ignore_index
    first = grad_loss.index_select(0, valid.int().argmax().view(1))  # the first valid row's (row 0 if none)
    if not bool(((grad_loss == first) | ~valid).all()):
        return None
    return torch.where(valid.any(), first[0].to(precompute_scale.dtype) / precompute_scale, 0.0)


def op_backward(
    options: CrossEntropyOptions,
    saved: Saved | tuple,
    grad_loss: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    chunks: tuple[tuple[int, int], ...] | None,
    *,
    in_place: bool,
) -> tuple[torch.Tensor | None, ...]:
    """(dh, dw, db, d_low_rank_hidden, d_low_rank_weight), None where not needed.

    A scalar loss: ``saved`` is the five gradients its forward computed, multiplied here by ``grad_loss``
    (0-d). Per-token outputs: ``saved`` is a :class:`Saved`; ``grad_loss`` and ``grad_entropy`` are of all N
    rows (None: no gradient); ``chunks`` the forward's row spans. ``in_place`` (eager calls): gradients the
    forward computed are scaled where they are; otherwise (a graph) into new tensors.
    """
    if options.scalar:
        return scaled_by_upstream(saved, grad_loss, in_place=in_place, use_triton=options.use_triton)
    if saved.entropy is None:
        grad_entropy = None
    if saved.precomputed is not None and grad_entropy is None and grad_loss is not None:
        *grads, grad_scale = saved.precomputed
        rows_grad = grad_loss.reshape(-1)
        if saved.row_index is not None:
            rows_grad = rows_grad.index_select(0, saved.row_index)
        factor = uniform_factor(rows_grad, saved.row_labels, options.ignore_index, grad_scale)
        if factor is not None:
            # in place only on Triton, whose kernel leaves autograd's version counter of the saved tensors alone
            return scaled_by_upstream(
                grads, factor, in_place=in_place and options.use_triton, use_triton=options.use_triton
            )
    low_rank = None if saved.low_rank_hidden is None else LowRank(saved.low_rank_hidden, saved.low_rank_weight)
    return chunked_backward(
        saved.hidden,
        saved.weight,
        saved.bias,
        saved.row_labels,
        saved.lse,
        saved.entropy,
        saved.row_index,
        grad_loss,
        grad_entropy,
        options,
        chunks,
        low_rank,
    )


def _refuse_double_backward() -> None:
    """Backward runs with grad mode on only under ``create_graph=True``: the gradients computed here
    carry no graph of their own, so a second-order use would silently get a wrong result."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{OP_NAME}: second-order gradients (backward with create_graph=True, e.g. a "
            "gradient penalty) are not supported: the op's gradients are computed without a graph. Use "
            "lce_patch.ops.linear_cross_entropy.naive_linear_cross_entropy for that term."
        )


class LinearCrossEntropyFunction(torch.autograd.Function):
    """The chunked op for eager calls; see the module docstring.

    Inputs: hidden [N, D], weight [V, D], bias [V] or None (all one float dtype, any strides), labels [N]
    integer, num_items (0-d tensor, ``num_items_in_batch``, or None), a low-rank term's hidden [N, r] and
    weight [V, r] or None (:class:`LowRank`, same dtype), token_weights [N] and class_weights [V] or None (a
    scalar loss's; no gradient), then the :class:`CrossEntropyOptions`.
    Outputs: loss (0-d, or [N]), entropy [N] (or empty), is_top1 [N] bool (or empty), mean_logit [N]
    (or empty), log_sum_sq [N] (or empty), lse [N] (or empty), fp32, or fp64 for fp64 inputs; predicted [N] int64
    (or empty). Only the loss and the entropy carry a gradient.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        labels,
        num_items,
        low_rank_hidden,
        low_rank_weight,
        token_weights,
        class_weights,
        options,
    ):
        low_rank = None if low_rank_hidden is None else LowRank(low_rank_hidden, low_rank_weight)
        result = chunked_forward(
            hidden, weight, bias, labels, num_items, options, low_rank, token_weights, class_weights
        )
        # Outputs that get no gradient (entropy logged as a metric, say) arrive as None, not as
        # zeros, so the backward can skip their terms.
        ctx.set_materialize_grads(False)
        ctx.options, ctx.chunks = options, result.chunks

        def given(value: torch.Tensor | None, dtype: torch.dtype = result.loss.dtype) -> torch.Tensor:
            return value if value is not None else result.loss.new_empty(0, dtype=dtype)  # one tensor per output

        entropy, is_top1 = given(result.entropy), given(result.is_top1, torch.bool)
        mean_logit, log_sum_sq = given(result.mean_logit), given(result.log_sum_sq)
        lse, predicted = given(result.lse_out), given(result.predicted, torch.int64)
        # one call: each call of mark_non_differentiable replaces the set the last one made
        ctx.mark_non_differentiable(
            is_top1, mean_logit, log_sum_sq, lse, predicted, *((entropy,) if options.scalar else ())
        )
        outputs = (result.loss, entropy, is_top1, mean_logit, log_sum_sq, lse, predicted)
        if options.scalar:
            ctx.save_for_backward(*(result.grads or (None,) * 5))
            return outputs
        if options.any_grad:
            ctx.precomputed = result.grad_scale is not None
            precomputed = (*result.grads, result.grad_scale) if ctx.precomputed else (None,) * 6
            ctx.save_for_backward(
                hidden,
                weight,
                bias,
                low_rank_hidden,
                low_rank_weight,
                result.row_labels,
                result.lse,
                result.processed_entropy,
                result.row_index,
                *precomputed,
            )
        return outputs

    @staticmethod
    def backward(
        ctx, grad_loss, grad_entropy, _grad_top1, _grad_mean_logit, _grad_log_sum_sq, _grad_lse, _grad_predicted
    ):
        _refuse_double_backward()
        if ctx.options.scalar:
            claim_scalar_backward(ctx, OP_NAME)
            saved = ctx.saved_tensors
        else:
            *tensors, row_index = ctx.saved_tensors[:9]
            # precomputed gradients are scaled in place once: a second backward recomputes instead
            precomputed = ctx.saved_tensors[9:] if ctx.precomputed else None
            ctx.precomputed = False
            saved = Saved(*tensors, row_index=row_index, precomputed=precomputed)
        grads = op_backward(ctx.options, saved, grad_loss, grad_entropy, ctx.chunks, in_place=True)
        dh, dw, db, d_low_rank_hidden, d_low_rank_weight = grads
        return dh, dw, db, None, None, d_low_rank_hidden, d_low_rank_weight, None, None, None
