"""The cross-entropy op's autograd Function, for eager calls.

Its forward runs :func:`chunked.chunked_forward`; its backward scales the gradients the forward computed (a
scalar loss) or recomputes them chunk by chunk (per-token outputs, :func:`chunked.chunked_backward`).
``custom_op.py`` gives ``torch.compile`` the same forward and backward as one operator.
"""

from __future__ import annotations

import torch

from ..core.backend import scale_inplace
from ..core.grads import LowRank
from .chunked import chunked_backward, chunked_forward
from .options import ChunkedOptions


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


def rescaled(grad: torch.Tensor | None, factor: torch.Tensor, in_place: bool) -> torch.Tensor | None:
    if grad is None:
        return None
    if in_place:  # free when the factor is exactly 1; the Triton kernel leaves autograd's version alone
        scale_inplace(grad, factor, True)
        return grad
    return grad * factor  # a saved tensor scaled in place would fail a second backward's version check


def _refuse_double_backward() -> None:
    """Backward runs with grad mode on only under ``create_graph=True``: the gradients computed here
    carry no graph of their own, so a second-order use would silently get a wrong result."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "fused_linear_cross_entropy: second-order gradients (backward with create_graph=True, e.g. a "
            "gradient penalty) are not supported: the op's gradients are computed without a graph. Use "
            "lce_patch.ops.linear_cross_entropy.naive_linear_cross_entropy for that term."
        )


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Chunked fused projection + cross-entropy (eager mode); see the module docstring.

    Inputs: hidden [N, D], weight [V, D], bias [V] or None (all one float dtype, any strides), labels
    [N] integer, num_items (0-d tensor for ``reduction="items"``, else None), ``ChunkedOptions``, and
    optionally a low-rank term's hidden [N, r] and weight [V, r] (:class:`LowRank`, same dtype).
    Outputs: loss (0-d, or [N]), entropy [N] (or empty), is_top1 [N] bool (or empty), mean_logit [N]
    (or empty), log_sum_sq [N] (or empty); fp32, or fp64 for fp64 inputs. mean_logit and log_sum_sq
    carry no gradient.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        labels,
        num_items,
        options: ChunkedOptions,
        low_rank_hidden=None,
        low_rank_weight=None,
    ):
        low_rank = None if low_rank_hidden is None else LowRank(low_rank_hidden, low_rank_weight)
        result = chunked_forward(hidden, weight, bias, labels, num_items, options, low_rank)
        # Outputs that get no gradient (entropy logged as a metric, say) arrive as None, not as
        # zeros, so the backward can skip their terms.
        ctx.set_materialize_grads(False)
        ctx.transform = options.transform
        ctx.chunks = result.chunks
        ctx.use_triton = options.use_triton
        ctx.shard = options.shard
        scalar_loss = ctx.scalar_loss = options.reduction is not None
        ctx.backward_done = False

        def given(value: torch.Tensor | None, dtype: torch.dtype = result.loss.dtype) -> torch.Tensor:
            return value if value is not None else result.loss.new_empty(0, dtype=dtype)  # one tensor per output

        entropy, is_top1 = given(result.entropy), given(result.is_top1, torch.bool)
        mean_logit, log_sum_sq = given(result.mean_logit), given(result.log_sum_sq)
        ctx.mark_non_differentiable(is_top1, mean_logit, log_sum_sq)
        outputs = (result.loss, entropy, is_top1, mean_logit, log_sum_sq)
        if scalar_loss:
            ctx.mark_non_differentiable(entropy)
            ctx.save_for_backward(*(result.grads or (None,) * 5))
            return outputs
        if any(options.needs_grad) or any(options.needs_low_rank_grad):
            precomputed = (None,) * 6
            if result.grad_scale is not None:
                precomputed = (*result.grads, result.grad_scale)
            saved_entropy = result.processed_entropy if result.processed_entropy is not None else result.lse
            ctx.save_for_backward(
                hidden,
                weight,
                bias,
                low_rank_hidden,
                low_rank_weight,
                result.row_labels,
                result.lse,
                saved_entropy,
                result.row_index,
                *precomputed,
            )
            ctx.has_entropy = result.processed_entropy is not None
            ctx.precomputed = result.grad_scale is not None
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, grad_entropy, _grad_top1, _grad_mean_logit, _grad_log_sum_sq):
        _refuse_double_backward()
        if ctx.scalar_loss:
            grads = LinearCrossEntropyFunction._scalar_backward(ctx, grad_loss)
        else:
            grads = LinearCrossEntropyFunction._recompute_backward(ctx, grad_loss, grad_entropy)
        dh, dw, db, d_low_rank_hidden, d_low_rank_weight = grads
        all_grads = (dh, dw, db, None, None, None, d_low_rank_hidden, d_low_rank_weight)
        return all_grads[: len(ctx.needs_input_grad)]  # the low-rank term's only when it was given

    @staticmethod
    def _scalar_backward(ctx, grad_loss):
        if ctx.backward_done:
            raise RuntimeError(
                "fused_linear_cross_entropy: backward through the same scalar loss twice is not supported "
                "(its gradients were computed in the forward and are scaled in place)."
            )
        ctx.backward_done = True
        if grad_loss is None:
            return (None,) * 5
        grads = ctx.saved_tensors
        for grad in grads:
            if grad is not None:
                scale_inplace(grad, grad_loss, ctx.use_triton)
        return grads

    @staticmethod
    def _recompute_backward(ctx, grad_loss, grad_entropy):
        hidden, weight, bias, low_rank_hidden, low_rank_weight, labels, lse, entropy, row_index, *precomputed = (
            ctx.saved_tensors
        )
        if not ctx.has_entropy:
            grad_entropy = None
        if ctx.precomputed and grad_entropy is None and grad_loss is not None:
            ctx.precomputed = False  # scaled in place below: a second backward recomputes instead
            rows_grad = grad_loss.reshape(-1) if row_index is None else grad_loss.reshape(-1).index_select(0, row_index)
            factor = uniform_factor(rows_grad, labels, ctx.transform.ignore_index, precomputed[-1])
            if factor is not None:
                return tuple(rescaled(grad, factor, ctx.use_triton) for grad in precomputed[:-1])
        low_rank = None if low_rank_hidden is None else LowRank(low_rank_hidden, low_rank_weight)
        grads = chunked_backward(
            hidden,
            weight,
            bias,
            labels,
            lse,
            entropy,
            row_index,
            grad_loss,
            grad_entropy,
            tuple(ctx.needs_input_grad[:3]),
            ctx.transform,
            ctx.chunks,
            ctx.use_triton,
            ctx.shard,
            low_rank,
            tuple(ctx.needs_input_grad[6:8]),
        )
        return grads
