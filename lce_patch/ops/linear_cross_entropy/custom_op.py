"""The chunked op as ``torch.library`` custom operators, for ``torch.compile``.

Under ``torch.compile`` dynamo must not trace into the chunked loop: its chunk count and its row
selection depend on the host, it launches Triton kernels and cuBLAS GEMMs into reused buffers, and
it checks label values. So when compiling, the public op calls ``lce_patch::linear_cross_entropy``,
one opaque node with a fake (meta) implementation for shapes and a registered autograd formula;
eager calls keep the ``autograd.Function`` of ``autograd.py``. Both run :func:`chunked.chunked_forward`
and the one backward, :func:`autograd.op_backward`, so they give the same numbers. The operators'
arguments after the tensors are the fields of :class:`CrossEntropyOptions` (:mod:`..core.schema`); the
low-rank term's two tensors are among the tensors.

What differs under compile:

* Every output has a shape known from the input shapes: the per-row statistics the backward needs
  are returned for all N rows (zeros where ignored), and the rows a ``skip_ignored`` call processes
  are selected again in the backward (inside the opaque backward op, one more host sync there).
* Gradients computed in the forward (a scalar loss's, or ``precompute_grad``'s) are multiplied by the
  upstream gradient out of place (a graph cannot scale a saved tensor in place): for the moment of that
  product the op holds a second copy of dW. Eager mode scales in place.
"""

from __future__ import annotations

import torch

from ..core.backend import stats_dtype
from ..core.calls import count_run
from ..core.checks import selected_rows
from ..core.chunking import resolve_chunks
from ..core.grads import LowRank, absent_to_none, none_to_absent
from .autograd import Saved, op_backward
from .chunked import chunked_forward
from .options import OP_NAME, SCHEMA, CrossEntropyOptions

_INPUTS = "Tensor hidden, Tensor weight, Tensor? bias, Tensor labels"
_LOW_RANK = "Tensor? low_rank_hidden, Tensor? low_rank_weight"
_WEIGHTS = "Tensor? token_weights, Tensor? class_weights"
_GRADS = "Tensor dh, Tensor dw, Tensor db, Tensor d_low_rank_hidden, Tensor d_low_rank_weight"


def _empty(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return like.new_empty(0, dtype=dtype or like.dtype)  # a new one each time: a custom op's outputs may not alias


def _grads_or_empty(grads, hidden, weight, low_rank_hidden, low_rank_weight) -> tuple[torch.Tensor, ...]:
    """(dh, dw, db, d_low_rank_hidden, d_low_rank_weight) with the "not computed" marker for each None."""
    return none_to_absent(
        grads,
        (
            (hidden, None),
            (weight, None),
            (hidden, stats_dtype(hidden.dtype)),
            (hidden if low_rank_hidden is None else low_rank_hidden, None),
            (weight if low_rank_weight is None else low_rank_weight, None),
        ),
    )


def _fake_grads(options, hidden, weight, bias, low_rank_hidden, low_rank_weight, computed: bool):
    """Fake (dh, dw, db, d_low_rank_hidden, d_low_rank_weight): full-sized where ``computed`` and needed."""
    needs = (*options.needs_grad, *options.needs_low_rank_grad) if computed else (False,) * 5
    stats = stats_dtype(hidden.dtype)
    return (
        hidden.new_empty(hidden.shape if needs[0] else (0,)),
        weight.new_empty(weight.shape if needs[1] else (0,)),
        bias.new_empty(bias.shape) if needs[2] and bias is not None else hidden.new_empty(0, dtype=stats),
        low_rank_hidden.new_empty(low_rank_hidden.shape)
        if needs[3]
        else _empty(hidden if low_rank_hidden is None else low_rank_hidden),
        low_rank_weight.new_empty(low_rank_weight.shape)
        if needs[4]
        else _empty(weight if low_rank_weight is None else low_rank_weight),
    )


def _forward(
    hidden, weight, bias, labels, num_items, low_rank_hidden, low_rank_weight, token_weights, class_weights, op_name,
    *values,
):  # fmt: skip
    """(loss, entropy, is_top1, mean_logit, log_sum_sq, lse, predicted, the five gradients, grad_scale); empty
    tensors for what is not computed. lse is [N] when asked for (0 where ignored) or for per-token outputs with
    gradients (0 where not processed), else empty. ``op_name``: the public function whose call this is, counted
    here (this operator runs only inside a compiled graph; eager calls are counted by the function)."""
    count_run(op_name)
    options = SCHEMA.build(values)
    low_rank = None if low_rank_hidden is None else LowRank(low_rank_hidden, low_rank_weight)
    result = chunked_forward(hidden, weight, bias, labels, num_items, options, low_rank, token_weights, class_weights)
    stats = result.loss.dtype
    lse = _empty(hidden, stats)
    if result.lse_out is not None:
        lse = result.lse_out
    elif not options.scalar and options.any_grad:
        lse = result.lse
        if result.row_index is not None:
            lse = torch.zeros(hidden.shape[0], dtype=lse.dtype, device=lse.device).index_copy_(0, result.row_index, lse)
    return (
        result.loss,
        result.entropy if result.entropy is not None else _empty(hidden, stats),
        result.is_top1 if result.is_top1 is not None else _empty(hidden, torch.bool),
        result.mean_logit if result.mean_logit is not None else _empty(hidden, stats),
        result.log_sum_sq if result.log_sum_sq is not None else _empty(hidden, stats),
        lse,
        result.predicted if result.predicted is not None else _empty(hidden, torch.int64),
        *_grads_or_empty(result.grads, hidden, weight, low_rank_hidden, low_rank_weight),
        result.grad_scale if result.grad_scale is not None else _empty(hidden, stats),
    )


_forward_op = torch.library.custom_op(
    "lce_patch::linear_cross_entropy",
    _forward,
    mutates_args=(),
    schema=(
        f"({_INPUTS}, Tensor? num_items, {_LOW_RANK}, {_WEIGHTS}, str op_name, {SCHEMA.text}) -> (Tensor loss, "
        "Tensor entropy, "
        f"Tensor is_top1, Tensor mean_logit, Tensor log_sum_sq, Tensor lse, Tensor predicted, {_GRADS}, "
        "Tensor grad_scale)"
    ),
)


@_forward_op.register_fake
def _(
    hidden, weight, bias, labels, num_items, low_rank_hidden, low_rank_weight, token_weights, class_weights, op_name,
    *values,
):  # fmt: skip
    options = SCHEMA.build(values)
    rows = hidden.shape[0]
    grads_in_forward = options.any_grad and (options.scalar or options.precompute_grad)

    def stats(size, dtype=None):
        return hidden.new_empty(size, dtype=dtype or stats_dtype(hidden.dtype))

    want = options.want
    return (
        stats(()) if options.scalar else stats(rows),
        stats(rows if want.entropy else 0),
        stats(rows if want.is_top1 else 0, torch.bool),
        stats(rows if want.mean_logit else 0),
        stats(rows if want.log_sum_sq else 0),
        stats(rows if want.lse or (not options.scalar and options.any_grad) else 0),
        stats(rows if want.predicted else 0, torch.int64),
        *_fake_grads(options, hidden, weight, bias, low_rank_hidden, low_rank_weight, grads_in_forward),
        stats(() if grads_in_forward and not options.scalar else 0),
    )


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, labels, _num_items, low_rank_hidden, low_rank_weight, _token, _class, _op, *values = inputs
    ctx.options = options = SCHEMA.build(values)
    _loss, entropy, is_top1, mean_logit, log_sum_sq, lse, predicted, *grads, grad_scale = output
    ctx.set_materialize_grads(False)
    # one call: each call of mark_non_differentiable replaces the set the last one made
    non_differentiable = (is_top1, mean_logit, log_sum_sq, lse, predicted, *grads, grad_scale)
    ctx.mark_non_differentiable(*non_differentiable, *((entropy,) if options.scalar else ()))
    if options.scalar:
        ctx.save_for_backward(*grads)
    else:
        ctx.save_for_backward(
            hidden, weight, bias, labels, low_rank_hidden, low_rank_weight, lse, entropy, *grads, grad_scale
        )


def _backward(ctx, grad_loss, grad_entropy, *_unused):
    options = ctx.options
    if options.scalar:
        grads = op_backward(options, absent_to_none(ctx.saved_tensors), grad_loss, None, None, in_place=False)
    else:
        hidden, weight, bias, labels, low_rank_hidden, low_rank_weight, lse, entropy, *precomputed = ctx.saved_tensors
        grads = _backward_op(
            hidden, weight, bias, labels, low_rank_hidden, low_rank_weight, lse,
            entropy if entropy.numel() else None, grad_loss, grad_entropy if entropy.numel() else None,
            *precomputed, *SCHEMA.values(options),
        )  # fmt: skip
        grads = absent_to_none(grads)
    dh, dw, db, d_low_rank_hidden, d_low_rank_weight = grads
    needs = ctx.needs_input_grad
    return (
        dh if needs[0] else None,
        dw if needs[1] else None,
        db if needs[2] else None,
        None,
        None,
        d_low_rank_hidden if needs[5] else None,
        d_low_rank_weight if needs[6] else None,
        None,
        None,
        None,
        *(None,) * len(SCHEMA.names),
    )


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _backward_impl(
    hidden, weight, bias, labels, low_rank_hidden, low_rank_weight, lse, entropy, grad_loss, grad_entropy,
    precomputed_dh, precomputed_dw, precomputed_db, precomputed_d_low_rank_hidden, precomputed_d_low_rank_weight,
    grad_scale, *values,
):  # fmt: skip
    """The five gradients of per-token outputs; empty tensors for those not needed. ``lse`` and ``entropy`` are
    of all N rows; the processed rows are selected again here."""
    options = SCHEMA.build(values)
    labels = labels.contiguous()
    row_index = None
    if options.selects_rows:
        row_index = selected_rows(labels != options.ignore_index, options.num_valid_tokens, OP_NAME)

    def rows_of(values: torch.Tensor | None) -> torch.Tensor | None:
        return values if values is None or row_index is None else values.index_select(0, row_index)

    precomputed = None
    if grad_scale.numel():
        precomputed = (
            *absent_to_none(
                (
                    precomputed_dh,
                    precomputed_dw,
                    precomputed_db,
                    precomputed_d_low_rank_hidden,
                    precomputed_d_low_rank_weight,
                )
            ),
            grad_scale,
        )
    saved = Saved(
        hidden, weight, bias, low_rank_hidden, low_rank_weight, rows_of(labels), rows_of(lse), rows_of(entropy),
        row_index, precomputed,
    )  # fmt: skip
    chunks = resolve_chunks(options.chunk_size, saved.row_labels.shape[0], hidden, weight, options.use_triton, True)
    grads = op_backward(options, saved, grad_loss, grad_entropy, chunks, in_place=False)
    return _grads_or_empty(grads, hidden, weight, low_rank_hidden, low_rank_weight)


_backward_op = torch.library.custom_op(
    "lce_patch::linear_cross_entropy_backward",
    _backward_impl,
    mutates_args=(),
    schema=(
        f"({_INPUTS}, {_LOW_RANK}, Tensor lse, Tensor? entropy, Tensor? grad_loss, Tensor? grad_entropy, "
        f"{_GRADS}, Tensor grad_scale, {SCHEMA.text}) -> ({_GRADS})"
    ),
)


@_backward_op.register_fake
def _(hidden, weight, bias, labels, low_rank_hidden, low_rank_weight, *rest):
    options = SCHEMA.build(rest[-len(SCHEMA.names) :])
    return _fake_grads(options, hidden, weight, bias, low_rank_hidden, low_rank_weight, True)


def compiled_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    num_items: torch.Tensor | None,
    low_rank_hidden: torch.Tensor | None,
    low_rank_weight: torch.Tensor | None,
    token_weights: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    options: CrossEntropyOptions,
    op_name: str = OP_NAME,
) -> tuple[torch.Tensor, ...]:
    """(loss, entropy, is_top1, mean_logit, log_sum_sq, lse, predicted), each None when not wanted, through the
    custom operator; the arguments are those of :class:`autograd.LinearCrossEntropyFunction`, and the name of the
    public function called (what the operator counts as a call when it runs)."""
    loss, *wanted = _forward_op(
        hidden, weight, bias, labels, num_items, low_rank_hidden, low_rank_weight, token_weights, class_weights,
        op_name, *SCHEMA.values(options),
    )  # fmt: skip
    return loss, *(value if asked else None for value, asked in zip(wanted[:6], options.want, strict=True))
