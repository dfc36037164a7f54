"""The chunked divergence as ``torch.library`` custom operators, for ``torch.compile``.

As for the cross-entropy op (``linear_cross_entropy/custom_op.py``): under ``torch.compile`` the public op calls
``lce_patch::linear_divergence``, one opaque node with a fake implementation for shapes and a registered
autograd formula, instead of tracing the chunk loop (host-sized chunks, Triton kernels and cuBLAS GEMMs into
reused buffers, a value check of ``num_items_in_batch``). Eager calls keep ``LinearDivergenceFunction``; both
run :func:`chunked.divergence_forward` and the one :func:`autograd.divergence_backward`, so they give the same
numbers. The operators' arguments after the tensors are the fields of :class:`DivergenceOptions`
(:mod:`..core.schema`).

One difference: a scalar loss's gradients, computed in the forward, are multiplied by the upstream gradient out
of place in the backward (a graph cannot scale a saved tensor in place), so for the moment of that product the
op holds a second copy of dW. Eager mode scales in place.
"""

from __future__ import annotations

import torch

from ..core.backend import stats_dtype
from ..core.calls import count_run
from ..core.grads import absent_to_none, none_to_absent
from ..core.schema import OptionsSchema
from .autograd import divergence_backward
from .chunked import divergence_forward
from .options import OP_NAME, DivergenceOptions

_TENSORS = (
    "Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_hidden, Tensor teacher_weight, Tensor? teacher_bias, "
    "Tensor row_weight"
)
_OPTIONS = OptionsSchema(DivergenceOptions)


def _grads_or_empty(grads, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(dh, dW, db) with the "not computed" marker for each None."""
    return none_to_absent(grads, ((hidden, None), (weight, None), (hidden, stats_dtype(weight.dtype))))


def _forward(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, num_items, *values):
    """(loss, entropy, dh, dW, db); the gradients are empty unless a scalar loss computes them in the forward."""
    count_run(OP_NAME)  # this operator runs only inside a compiled graph: eager calls are counted by the function
    options = _OPTIONS.build(values)
    tensors = (hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight)
    out, entropy, grads = divergence_forward(*tensors, num_items, options)
    return out, entropy, *_grads_or_empty(grads, hidden, weight)


_forward_op = torch.library.custom_op(
    "lce_patch::linear_divergence",
    _forward,
    mutates_args=(),
    schema=f"({_TENSORS}, Tensor? num_items, {_OPTIONS.text}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)


def _grad_shapes(hidden, weight, bias, options: DivergenceOptions, computed: bool) -> tuple[torch.Tensor, ...]:
    """Fake (dh, dW, db): full-sized where ``computed`` and needed, else empty."""
    stats = stats_dtype(weight.dtype)
    needs = options.needs_grad if computed else (False, False, False)
    return (
        hidden.new_empty(hidden.shape if needs[0] else (0,)),
        weight.new_empty(weight.shape if needs[1] else (0,)),
        bias.new_empty(bias.shape) if needs[2] and bias is not None else hidden.new_empty(0, dtype=stats),
    )


@_forward_op.register_fake
def _(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, num_items, *values):
    options = _OPTIONS.build(values)
    rows = hidden.shape[0]
    stats = stats_dtype(weight.dtype)
    return (
        hidden.new_empty(() if options.scalar else (rows,), dtype=stats),
        hidden.new_empty((rows,), dtype=stats),
        *_grad_shapes(hidden, weight, bias, options, options.scalar),
    )


def _setup_context(ctx, inputs, output) -> None:
    tensors, values = inputs[:7], inputs[8:]
    ctx.options = _OPTIONS.build(values)
    _loss, entropy, dh, dw, db = output
    ctx.mark_non_differentiable(entropy, dh, dw, db)
    ctx.save_for_backward(*((dh, dw, db) if ctx.options.scalar else tensors))


def _backward(ctx, grad_out, *_unused):
    options = ctx.options
    if options.scalar:
        dh, dw, db = divergence_backward(absent_to_none(ctx.saved_tensors), grad_out, options, in_place=False)
    elif grad_out is None:
        dh = dw = db = None
    else:
        grads = _backward_op(*ctx.saved_tensors, grad_out, *_OPTIONS.values(options))
        dh, dw, db = absent_to_none(grads)
    needs = ctx.needs_input_grad
    # the teacher's three tensors, row_weight, num_items and the options get none
    return (
        dh if needs[0] else None,
        dw if needs[1] else None,
        db if needs[2] else None,
        *(None,) * (len(ctx.needs_input_grad) - 3),
    )


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _backward_impl(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, grad_out, *values):
    """(dh, dW, db) of the per-token loss; empty tensors for gradients not needed."""
    options = _OPTIONS.build(values)
    saved = (hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight)
    return _grads_or_empty(divergence_backward(saved, grad_out, options, in_place=False), hidden, weight)


_backward_op = torch.library.custom_op(
    "lce_patch::linear_divergence_backward",
    _backward_impl,
    mutates_args=(),
    schema=f"({_TENSORS}, Tensor grad_out, {_OPTIONS.text}) -> (Tensor, Tensor, Tensor)",
)


@_backward_op.register_fake
def _(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, grad_out, *values):
    return _grad_shapes(hidden, weight, bias, _OPTIONS.build(values), True)


def compiled_linear_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    row_weight: torch.Tensor,
    num_items: torch.Tensor | None,
    options: DivergenceOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, entropy) through the custom operator; the arguments are those of ``LinearDivergenceFunction``."""
    loss, entropy, *_grads = _forward_op(
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, num_items,
        *_OPTIONS.values(options),
    )  # fmt: skip
    return loss, entropy
