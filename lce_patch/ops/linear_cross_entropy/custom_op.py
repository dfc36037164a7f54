"""The chunked op as a ``torch.library`` custom operator, for ``torch.compile``.

Under ``torch.compile`` dynamo must not trace into the chunked loop: its chunk count and its row
selection depend on the host, it launches Triton kernels and cuBLAS GEMMs into reused buffers, and
it checks label values. So when compiling, the public op calls ``lce_patch::linear_cross_entropy``,
one opaque node with a fake (meta) implementation for shapes and a registered autograd formula;
eager calls keep the ``autograd.Function`` of ``autograd.py``. Both run the same
:func:`chunked_forward` / :func:`chunked_backward`, so they give the same numbers.

What differs under compile:

* Every output has a shape known from the input shapes: the per-row statistics the backward needs
  are returned for all N rows (zeros where ignored), and the rows a ``skip_ignored`` call processes
  are selected again in the backward (inside the opaque backward op, one more host sync there).
* A scalar loss's gradients, computed in the forward, are multiplied by the upstream gradient out of
  place in the backward (a graph cannot scale a saved tensor in place): for the moment of that
  product the op holds a second copy of dW. Eager mode scales in place.
* ``precompute_grad``'s rescale, when it applies, also returns new tensors.
"""

from __future__ import annotations

import torch

from ..core.backend import stats_dtype
from ..core.checks import selected_rows
from ..core.chunking import resolve_chunks
from .autograd import uniform_factor
from .chunked import chunked_backward, chunked_forward
from .options import OP_NAME, ChunkedOptions
from .rows import LogitTransform

_FORWARD = "lce_patch::linear_cross_entropy"
_BACKWARD = "lce_patch::linear_cross_entropy_backward"


# The operators' non-tensor arguments, in schema order: the fields of ChunkedOptions and its transform.
_OPTION_NAMES = (
    "ignore_index", "softcap", "logit_scale", "temperature", "label_smoothing", "z_loss", "reduction",
    "use_triton", "needs_grad", "want", "chunk_size", "skip_ignored", "num_valid_tokens", "precompute_grad",
)  # fmt: skip


_TRANSFORM_FIELDS = ("ignore_index", "softcap", "logit_scale", "temperature", "label_smoothing", "z_loss")


def _options(arguments: dict) -> ChunkedOptions:
    """ChunkedOptions from an operator's arguments (its ``locals()``)."""
    values = {name: arguments[name] for name in _OPTION_NAMES}
    transform = LogitTransform(**{name: values.pop(name) for name in _TRANSFORM_FIELDS})
    values.update(
        reduction=values["reduction"] or None, needs_grad=tuple(values["needs_grad"]), want=tuple(values["want"])
    )
    return ChunkedOptions(transform=transform, **values)


@torch.library.custom_op(_FORWARD, mutates_args=())
def _forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    num_items: torch.Tensor | None,
    ignore_index: int,
    softcap: float | None,
    logit_scale: float,
    temperature: float,
    label_smoothing: float,
    z_loss: float,
    reduction: str,
    use_triton: bool,
    needs_grad: list[bool],
    want: list[bool],
    chunk_size: int | None,
    skip_ignored: bool,
    num_valid_tokens: int | None,
    precompute_grad: bool,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
]:  # fmt: skip
    """Returns (loss, entropy, is_top1, mean_logit, log_sum_sq, lse, dh, dw, db, grad_scale); empty tensors for
    what is not computed.

    lse is [N] for per-token outputs with gradients (0 where not processed), else empty.
    """
    options = _options(locals())
    result = chunked_forward(hidden, weight, bias, labels, num_items, options)

    def empty(dtype=result.loss.dtype):  # a new one each time: a custom op's outputs may not alias
        return hidden.new_empty(0, dtype=dtype)

    lse = empty()
    if options.reduction is None and any(options.needs_grad):
        lse = result.lse
        if result.row_index is not None:
            lse = torch.zeros(hidden.shape[0], dtype=lse.dtype, device=lse.device).index_copy_(0, result.row_index, lse)
    dh, dw, db = result.grads[:3] if result.grads else (None, None, None)
    return (
        result.loss,
        result.entropy if result.entropy is not None else empty(),
        result.is_top1 if result.is_top1 is not None else empty(torch.bool),
        result.mean_logit if result.mean_logit is not None else empty(),
        result.log_sum_sq if result.log_sum_sq is not None else empty(),
        lse,
        dh if dh is not None else empty(hidden.dtype),
        dw if dw is not None else empty(weight.dtype),
        db if db is not None else empty(),
        result.grad_scale if result.grad_scale is not None else empty(),
    )


@_forward_op.register_fake
def _(
    hidden, weight, bias, labels, num_items, ignore_index, softcap, logit_scale, temperature, label_smoothing,
    z_loss, reduction, use_triton, needs_grad, want, chunk_size, skip_ignored, num_valid_tokens, precompute_grad,
):  # fmt: skip
    rows = hidden.shape[0]
    scalar = bool(reduction)
    grads_in_forward = any(needs_grad) and (scalar or precompute_grad)

    def stats(size, dtype=None):
        return hidden.new_empty(size, dtype=dtype or stats_dtype(hidden.dtype))

    return (
        stats(()) if scalar else stats(rows),
        stats(rows if want[0] else 0),
        stats(rows if want[1] else 0, torch.bool),
        stats(rows if want[2] else 0),
        stats(rows if want[3] else 0),
        stats(rows if not scalar and any(needs_grad) else 0),
        hidden.new_empty(hidden.shape if grads_in_forward and needs_grad[0] else 0),
        hidden.new_empty(weight.shape if grads_in_forward and needs_grad[1] else 0, dtype=weight.dtype),
        bias.new_empty(bias.shape) if grads_in_forward and needs_grad[2] and bias is not None else stats(0),
        stats(() if grads_in_forward and not scalar else 0),
    )


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, labels, _num_items, *option_values = inputs
    ctx.options = dict(zip(_OPTION_NAMES, option_values))
    loss, entropy, is_top1, mean_logit, log_sum_sq, lse, dh, dw, db, grad_scale = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(is_top1, mean_logit, log_sum_sq, lse, dh, dw, db, grad_scale)
    ctx.scalar = bool(ctx.options["reduction"])
    if ctx.scalar:
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(dh, dw, db)
    else:
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy, dh, dw, db, grad_scale)


def _backward(ctx, grad_loss, grad_entropy, *_unused):
    none_for_options = (None,) * (1 + len(_OPTION_NAMES))  # num_items and the options
    if ctx.scalar:
        grads = []
        for grad in ctx.saved_tensors:
            if grad_loss is None or grad.numel() == 0:
                grads.append(None)
                continue
            # in fp32 (fp64 for fp64), rounded once as the eager path's in-place scaling; one fused kernel
            compute = torch.promote_types(grad.dtype, torch.float32)
            grads.append((grad.to(compute) * grad_loss.to(compute)).to(grad.dtype))
        dh, dw, db = grads
        return dh, dw, db, None, *none_for_options
    hidden, weight, bias, labels, lse, entropy, *precomputed = ctx.saved_tensors
    options = ctx.options
    dh, dw, db = _backward_op(
        hidden,
        weight,
        bias,
        labels,
        lse,
        entropy,
        grad_loss,
        grad_entropy if entropy.numel() else None,
        *precomputed,
        *(options[name] for name in _OPTION_NAMES),
    )
    needs = ctx.needs_input_grad
    return (
        dh if needs[0] else None,
        dw if needs[1] else None,
        db if bias is not None and needs[2] else None,
        None,
        *none_for_options,
    )


_forward_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(_BACKWARD, mutates_args=())
def _backward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_loss: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    precomputed_dh: torch.Tensor,
    precomputed_dw: torch.Tensor,
    precomputed_db: torch.Tensor,
    grad_scale: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    logit_scale: float,
    temperature: float,
    label_smoothing: float,
    z_loss: float,
    reduction: str,
    use_triton: bool,
    needs_grad: list[bool],
    want: list[bool],
    chunk_size: int | None,
    skip_ignored: bool,
    num_valid_tokens: int | None,
    precompute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh, dw, db) of per-token outputs; empty tensors for gradients not needed."""
    options = _options(locals())
    labels = labels.contiguous()
    row_index = None
    if skip_ignored or num_valid_tokens is not None:
        row_index = selected_rows(labels != ignore_index, num_valid_tokens, OP_NAME)
    row_labels = labels if row_index is None else labels.index_select(0, row_index)
    grads = None
    if grad_scale.numel() and grad_entropy is None and grad_loss is not None:
        rows_grad = grad_loss.reshape(-1) if row_index is None else grad_loss.reshape(-1).index_select(0, row_index)
        factor = uniform_factor(rows_grad, row_labels, ignore_index, grad_scale)
        if factor is not None:
            precomputed = (precomputed_dh, precomputed_dw, precomputed_db)
            grads = tuple((g.to(factor.dtype) * factor).to(g.dtype) if g.numel() else None for g in precomputed)
    if grads is None:

        def rows_of(values: torch.Tensor) -> torch.Tensor:
            return values if row_index is None else values.index_select(0, row_index)

        chunks = resolve_chunks(chunk_size, row_labels.shape[0], hidden, weight, use_triton, True)
        grads = chunked_backward(
            hidden,
            weight,
            bias,
            row_labels,
            rows_of(lse),
            rows_of(entropy) if grad_entropy is not None else None,
            row_index,
            grad_loss,
            grad_entropy,
            options.needs_grad,
            options.transform,
            chunks,
            use_triton,
        )[:3]  # no low-rank term through the custom operator
    dh, dw, db = grads
    return (
        dh if dh is not None else hidden.new_empty(0),
        dw if dw is not None else weight.new_empty(0),
        db if db is not None else hidden.new_empty(0, dtype=torch.float32),
    )


@_backward_op.register_fake
def _(hidden, weight, bias, labels, lse, entropy, grad_loss, grad_entropy, *rest):
    needs_grad = rest[12]
    return (
        hidden.new_empty(hidden.shape if needs_grad[0] else (0,)),
        weight.new_empty(weight.shape if needs_grad[1] else (0,)),
        bias.new_empty(bias.shape) if bias is not None and needs_grad[2] else hidden.new_empty(0, dtype=torch.float32),
    )


def compiled_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    num_items: torch.Tensor | None,
    *,
    ignore_index: int,
    softcap: float | None,
    logit_scale: float,
    temperature: float,
    label_smoothing: float,
    z_loss: float,
    reduction: str | None,
    use_triton: bool,
    needs_grad: tuple[bool, bool, bool],
    want: tuple[bool, bool, bool, bool],
    chunk_size: int | None,
    skip_ignored: bool,
    num_valid_tokens: int | None,
    precompute_grad: bool,
) -> tuple[torch.Tensor, ...]:
    """(loss, entropy, is_top1, mean_logit, log_sum_sq), each None when not wanted, through the custom
    operator; the arguments are the
    fields of :class:`chunked.ChunkedOptions` and its transform, as plain values (nothing for
    dynamo to construct)."""
    loss, *wanted = _forward_op(
        hidden,
        weight,
        bias,
        labels,
        num_items,
        ignore_index,
        softcap,
        logit_scale,
        temperature,
        label_smoothing,
        z_loss,
        reduction or "",
        use_triton,
        list(needs_grad),
        list(want),
        chunk_size,
        skip_ignored,
        num_valid_tokens,
        precompute_grad,
    )
    return loss, *(value if asked else None for value, asked in zip(wanted[:4], want, strict=True))
