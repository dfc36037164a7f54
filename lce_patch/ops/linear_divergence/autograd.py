"""The op's one backward and its autograd Function for eager calls (compiled calls run the custom operators of
``custom_op.py``, whose registered backward is the same :func:`divergence_backward`)."""

from __future__ import annotations

import torch

from ..core.grads import claim_scalar_backward, scaled_by_upstream
from .chunked import divergence_forward, run_chunks
from .options import OP_NAME, DivergenceOptions


def divergence_backward(saved: tuple, grad_out: torch.Tensor | None, options: DivergenceOptions, *, in_place: bool):
    """The op's one backward, for the autograd Function (eager calls, ``in_place``) and the custom operator
    (compiled calls) alike: (dh, dW, db).

    A scalar loss: ``saved`` holds the gradients its forward computed, scaled here by ``grad_out`` (0-d).
    Per-token losses: ``saved`` holds the forward's tensors (hidden, weight, bias, teacher_hidden,
    teacher_weight, teacher_bias, row_weight); each chunk is recomputed with its rows' upstream gradients
    ``grad_out`` [N].
    """
    if options.scalar:
        return scaled_by_upstream(saved, grad_out, in_place=in_place, use_triton=options.use_triton)
    if grad_out is None:
        return None, None, None
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight = saved
    coeff = grad_out.to(row_weight.dtype) * row_weight
    _, _, grads = run_chunks(hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias, options, coeff)
    return grads.results(weight.dtype, None if bias is None else bias.dtype)


class LinearDivergenceFunction(torch.autograd.Function):
    """The op for eager calls. Inputs are 2-D ([N, D], [N, D_t]); ``row_weight`` [N] is 1 for selected rows
    and 0 elsewhere; ``num_items`` a 0-d tensor or None; then the :class:`DivergenceOptions`."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, num_items, options
    ):
        ctx.options = options
        tensors = (hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight)
        out, entropy, grads = divergence_forward(*tensors, num_items, options)
        ctx.save_for_backward(*(grads or (None,) * 3) if options.scalar else tensors)
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_entropy):
        if ctx.options.scalar:
            claim_scalar_backward(ctx, OP_NAME)
        dh, dw, db = divergence_backward(ctx.saved_tensors, grad_out, ctx.options, in_place=True)
        return dh, dw, db, *(None,) * 6
