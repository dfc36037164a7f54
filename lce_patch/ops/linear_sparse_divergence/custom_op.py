"""The chunked sparse divergence as ``torch.library`` custom operators, for eager and compiled calls alike.

``lce_patch::linear_sparse_divergence`` is one opaque node under ``torch.compile`` (host-sized chunks, Triton
kernels and cuBLAS GEMMs into reused buffers, value checks of the candidates and of ``num_items_in_batch``),
with a fake implementation for shapes and one registered backward, which eager calls use too: there is no
separate autograd Function. The operators' non-tensor arguments are the fields of
:class:`SparseDivergenceOptions` (:mod:`..core.schema`).

A scalar loss computes its gradients in the forward; the backward multiplies them by the upstream gradient, in
place in eager mode (no second copy of dW; free on Triton when the upstream gradient is exactly 1) and out of
place in a graph (which cannot scale a saved tensor in place), the product taken in fp32 (fp64 for fp64) and
rounded once either way. ``reduction="none"`` recomputes each chunk in ``lce_patch::linear_sparse_divergence_backward``.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ..core.backend import stats_dtype
from ..core.calls import count_run
from ..core.grads import absent_to_none, none_to_absent, scaled_by_upstream
from ..core.schema import OptionsSchema
from .chunked import sparse_backward, sparse_forward
from .options import OP_NAME, SparseDivergenceOptions

_OPTIONS = OptionsSchema(SparseDivergenceOptions)
_TENSORS = (
    "Tensor hidden, Tensor weight, Tensor? bias, Tensor candidate_ids, Tensor teacher_logprobs, Tensor candidate_mask"
)


def _grads_or_empty(grads, hidden, weight, stats):
    """(dh, dW, db) with the "not computed" marker for each None."""
    return none_to_absent(grads, ((hidden, None), (weight, None), (hidden, stats)))


@torch.library.custom_op(
    "lce_patch::linear_sparse_divergence",
    mutates_args=(),
    schema=f"({_TENSORS}, Tensor? num_items, {_OPTIONS.text}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _forward_op(hidden, weight, bias, candidate_ids, teacher_logprobs, candidate_mask, num_items, *values):
    """(loss, entropy, dh, dW, db); the gradients are empty unless a scalar loss computes them in the forward,
    the entropy unless asked for."""
    count_run(OP_NAME)  # eager and compiled calls alike run this operator: the one place they are counted
    options = _OPTIONS.build(values)
    loss, entropy, grads = sparse_forward(
        hidden, weight, bias, candidate_ids, teacher_logprobs, candidate_mask, num_items, options
    )
    return loss, entropy, *_grads_or_empty(grads, hidden, weight, stats_dtype(weight.dtype))


@_forward_op.register_fake
def _(hidden, weight, bias, candidate_ids, teacher_logprobs, candidate_mask, num_items, *values):
    options = _OPTIONS.build(values)
    rows = hidden.shape[0]
    stats = stats_dtype(weight.dtype)
    in_forward = options.scalar and any(options.needs_grad)
    need_h, need_w, need_b = (in_forward and need for need in options.needs_grad)
    return (
        hidden.new_empty(() if options.scalar else (rows,), dtype=stats),
        hidden.new_empty((rows,) if options.entropy else (0,), dtype=stats),
        hidden.new_empty(hidden.shape if need_h else (0,)),
        weight.new_empty(weight.shape if need_w else (0,)),
        bias.new_empty(bias.shape) if need_b and bias is not None else hidden.new_empty(0, dtype=stats),
    )


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, candidate_ids, teacher_logprobs, candidate_mask, _num_items, *values = inputs
    ctx.option_values = tuple(values)
    ctx.options = _OPTIONS.build(values)
    _loss, entropy, dh, dw, db = output
    ctx.mark_non_differentiable(entropy, dh, dw, db)
    ctx.backward_done = False
    if ctx.options.scalar:
        ctx.save_for_backward(dh, dw, db)
    else:
        ctx.save_for_backward(hidden, weight, bias, candidate_ids, teacher_logprobs, candidate_mask)


def _traced(tensors) -> bool:
    """Whether the backward is being traced into a graph (its tensors are fake), not run on real tensors."""
    return torch.compiler.is_compiling() or any(is_fake(t) for t in tensors)


def _backward(ctx, grad_out, *_unused):
    nones = (None,) * (4 + len(_OPTIONS.names))  # the candidates, num_items and the options get none
    if grad_out is None:
        return (None, None, None, *nones)
    options = ctx.options
    if options.scalar:
        if ctx.backward_done and not _traced((grad_out,)):  # checked before the in-place scaled tensors are read
            raise RuntimeError(
                f"{OP_NAME}: backward through the same scalar loss twice is not supported "
                "(its gradients were computed in the forward and are scaled in place)."
            )
        saved = ctx.saved_tensors
        in_place = not _traced((*saved, grad_out))
        ctx.backward_done = in_place
        dh, dw, db = scaled_by_upstream(
            absent_to_none(saved), grad_out, in_place=in_place, use_triton=options.use_triton
        )
    else:
        dh, dw, db = _backward_op(*ctx.saved_tensors, grad_out, *ctx.option_values)
        dh, dw, db = absent_to_none((dh, dw, db))
    needs = ctx.needs_input_grad
    return (dh if needs[0] else None, dw if needs[1] else None, db if needs[2] else None, *nones)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(
    "lce_patch::linear_sparse_divergence_backward",
    mutates_args=(),
    schema=f"({_TENSORS}, Tensor grad_out, {_OPTIONS.text}) -> (Tensor, Tensor, Tensor)",
)
def _backward_op(hidden, weight, bias, candidate_ids, teacher_logprobs, candidate_mask, grad_out, *values):
    """(dh, dW, db) of the per-token loss; empty tensors for gradients not needed."""
    options = _OPTIONS.build(values)
    grads = sparse_backward(hidden, weight, bias, candidate_ids, teacher_logprobs, candidate_mask, grad_out, options)
    return _grads_or_empty(grads, hidden, weight, stats_dtype(weight.dtype))


@_backward_op.register_fake
def _(hidden, weight, bias, candidate_ids, teacher_logprobs, candidate_mask, grad_out, *values):
    options = _OPTIONS.build(values)
    stats = stats_dtype(weight.dtype)
    need_h, need_w, need_b = options.needs_grad
    return (
        hidden.new_empty(hidden.shape if need_h else (0,)),
        weight.new_empty(weight.shape if need_w else (0,)),
        bias.new_empty(bias.shape) if need_b and bias is not None else hidden.new_empty(0, dtype=stats),
    )


def linear_sparse_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    candidate_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    candidate_mask: torch.Tensor,
    num_items: torch.Tensor | None,
    options: SparseDivergenceOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, entropy) through the custom operator: 2-D inputs ([N, D], [N, K]), a bool mask, ``num_items`` a
    0-d tensor or None."""
    loss, entropy, *_grads = _forward_op(
        hidden, weight, bias, candidate_ids, teacher_logprobs, candidate_mask, num_items, *_OPTIONS.values(options)
    )
    return loss, entropy
