"""The chunked divergence as ``torch.library`` custom operators, for ``torch.compile``.

As for the cross-entropy op (``linear_cross_entropy/custom_op.py``): under ``torch.compile`` the public op calls
``lce_patch::linear_divergence``, one opaque node with a fake implementation for shapes and a registered
autograd formula, instead of tracing the chunk loop (host-sized chunks, Triton kernels and cuBLAS GEMMs into
reused buffers, a value check of ``num_items_in_batch``). Eager calls keep ``LinearDivergenceFunction``; both
run :func:`chunked.divergence_forward` / :func:`chunked.divergence_backward`, so they give the same numbers.

One difference: a scalar loss's gradients, computed in the forward, are multiplied by the upstream gradient out
of place in the backward (a graph cannot scale a saved tensor in place), so for the moment of that product the
op holds a second copy of dW. Eager mode scales in place.
"""

from __future__ import annotations

import torch

from ..core.backend import stats_dtype
from .chunked import DivergenceOptions, divergence_backward, divergence_forward

_FORWARD = "lce_patch::linear_divergence"
_BACKWARD = "lce_patch::linear_divergence_backward"
# The operators' non-tensor arguments after the tensors, in schema order: the fields of DivergenceOptions.
_OPTION_NAMES = (
    "beta", "temperature", "softcap", "teacher_softcap", "logit_scale", "teacher_logit_scale", "chunk_rows",
    "use_triton",
)  # fmt: skip


def _options(arguments: dict) -> DivergenceOptions:
    return DivergenceOptions(**{name: arguments[name] for name in _OPTION_NAMES})


def _empty_grad(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return like.new_empty(0, dtype=dtype)


@torch.library.custom_op(_FORWARD, mutates_args=())
def _forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    row_weight: torch.Tensor,
    num_items: torch.Tensor | None,
    reduction: str,
    needs_grad: list[bool],
    beta: float,
    temperature: float,
    softcap: float | None,
    teacher_softcap: float | None,
    logit_scale: float,
    teacher_logit_scale: float,
    chunk_rows: int,
    use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, entropy, dh, dW, db); the gradients are empty unless a scalar loss computes them in the forward."""
    options = _options(locals())
    out, entropy, grads = divergence_forward(
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, num_items, reduction,
        options, tuple(needs_grad),
    )  # fmt: skip
    dh, dw, db = grads or (None, None, None)
    stats = stats_dtype(weight.dtype)
    return (
        out,
        entropy,
        dh if dh is not None else _empty_grad(hidden, hidden.dtype),
        dw if dw is not None else _empty_grad(weight, weight.dtype),
        db if db is not None else _empty_grad(hidden, stats),
    )


@_forward_op.register_fake
def _(
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, num_items, reduction, needs_grad, *_
):
    rows = hidden.shape[0]
    stats = stats_dtype(weight.dtype)
    in_forward = reduction != "none" and any(needs_grad)
    return (
        hidden.new_empty(() if reduction != "none" else (rows,), dtype=stats),
        hidden.new_empty((rows,), dtype=stats),
        hidden.new_empty(hidden.shape if in_forward and needs_grad[0] else (0,)),
        weight.new_empty(weight.shape if in_forward and needs_grad[1] else (0,)),
        bias.new_empty(bias.shape)
        if in_forward and needs_grad[2] and bias is not None
        else hidden.new_empty(0, dtype=stats),
    )


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, _num_items, reduction, *rest = (
        inputs
    )
    ctx.needs_grad, ctx.option_values = tuple(rest[0]), rest[1:]
    _loss, entropy, dh, dw, db = output
    ctx.mark_non_differentiable(entropy, dh, dw, db)
    ctx.scalar = reduction != "none"
    if ctx.scalar:
        ctx.save_for_backward(dh, dw, db)
    else:
        ctx.save_for_backward(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight)


def _backward(ctx, grad_out, *_unused):
    # the teacher's three tensors, row_weight, num_items, reduction, needs_grad and the options get none
    nones = (None,) * (7 + len(_OPTION_NAMES))
    if grad_out is None:
        return (None, None, None, *nones)
    if ctx.scalar:
        grads = []
        for grad in ctx.saved_tensors:
            if grad.numel() == 0:
                grads.append(None)
                continue
            # in fp32 (fp64 for fp64), rounded once as the eager path's in-place scaling; one fused kernel
            compute = torch.promote_types(grad.dtype, torch.float32)
            grads.append((grad.to(compute) * grad_out.to(compute)).to(grad.dtype))
        dh, dw, db = grads
    else:
        dh, dw, db = _backward_op(*ctx.saved_tensors, grad_out, list(ctx.needs_grad), *ctx.option_values)
        dh, dw, db = (g if g.numel() else None for g in (dh, dw, db))
    needs = ctx.needs_input_grad
    return (
        dh if needs[0] else None,
        dw if needs[1] else None,
        db if needs[2] else None,
        *nones,
    )


_forward_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(_BACKWARD, mutates_args=())
def _backward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    row_weight: torch.Tensor,
    grad_out: torch.Tensor,
    needs_grad: list[bool],
    beta: float,
    temperature: float,
    softcap: float | None,
    teacher_softcap: float | None,
    logit_scale: float,
    teacher_logit_scale: float,
    chunk_rows: int,
    use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh, dW, db) of the per-token loss; empty tensors for gradients not needed."""
    options = _options(locals())
    dh, dw, db = divergence_backward(
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, grad_out, options,
        tuple(needs_grad),
    )  # fmt: skip
    stats = stats_dtype(weight.dtype)
    return (
        dh if dh is not None else _empty_grad(hidden, hidden.dtype),
        dw if dw is not None else _empty_grad(weight, weight.dtype),
        db if db is not None else _empty_grad(hidden, stats),
    )


@_backward_op.register_fake
def _(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, grad_out, needs_grad, *_):
    stats = stats_dtype(weight.dtype)
    return (
        hidden.new_empty(hidden.shape if needs_grad[0] else (0,)),
        weight.new_empty(weight.shape if needs_grad[1] else (0,)),
        bias.new_empty(bias.shape) if bias is not None and needs_grad[2] else hidden.new_empty(0, dtype=stats),
    )


def compiled_linear_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    row_weight: torch.Tensor,
    num_items: torch.Tensor | None,
    reduction: str,
    options: DivergenceOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, entropy) through the custom operator; the arguments are those of ``LinearDivergenceFunction``."""
    grad_on = torch.is_grad_enabled()
    needs_grad = [
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    ]
    loss, entropy, *_grads = _forward_op(
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, num_items, reduction,
        needs_grad, *(getattr(options, name) for name in _OPTION_NAMES),
    )  # fmt: skip
    return loss, entropy
