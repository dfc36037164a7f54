"""The public functions of the cross-entropy op: each builds its options once, then dispatches (the eager Function,
the compiled custom operator, or the vocabulary-parallel form) on inputs checked and prepared by ``inputs.py``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..core.backend import BACKENDS, resolve_backend
from ..core.calls import count_call, count_run
from ..core.checks import num_items_tensor
from ..core.reduction import check_reduction
from .autograd import LinearCrossEntropyFunction
from .custom_op import compiled_linear_cross_entropy
from .inputs import check_inputs, compute_dtype, loss_weights, low_rank_inputs, shift_labels
from .options import OP_NAME, SCHEMA, CrossEntropyOptions, build_options, fail, given_options
from .vocab_parallel import VocabShard, check_shard, is_dtensor, unwrap_dtensors


def warn_deterministic() -> None:
    """The ``deterministic`` argument is deprecated: every path is deterministic without it."""
    warnings.warn(
        f"{OP_NAME}: deterministic does nothing and will be removed: both backends are deterministic always "
        "(no atomics, a fixed reduction order); leave it out",
        FutureWarning,
        stacklevel=3,
    )


class CrossEntropyOutputs(NamedTuple):
    """:func:`fused_linear_cross_entropy`'s outputs with ``return_lse``, ``return_token_accuracy`` or
    ``return_predicted_tokens``.

    loss: as without them (fp32, 0-d or per token). lse: fp32 per-token log-sum-exp of the final logits, shaped
    like ``labels``, 0 where ignored, no gradient; or None. token_accuracy: fp32 0-d, the fraction of valid tokens
    whose label is the argmax (first index on ties), no gradient; or None. predicted_tokens: int64, shaped like
    ``labels``, each position's argmax of the final logits (first index on ties), ignored positions included,
    except with ``skip_ignored`` / ``num_valid_tokens``, where they are not computed and hold ``ignore_index``;
    or None.
    """

    loss: torch.Tensor
    lse: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


class TokenOutputs(NamedTuple):
    """Per-token outputs of :func:`fused_linear_log_probs`, each shaped like ``labels``.

    log_probs: fp32 log-probability of the target (differentiable), 0 where ignored.
    entropy: fp32 entropy of the token's distribution (differentiable), 0 where ignored; or None.
    is_top1: bool, whether the target is the argmax (first index on ties); False where ignored; or None.
    label_mask: bool, True where the label is not ``ignore_index``.
    mean_logits: fp32 mean over the vocabulary of the final logits (no gradient), 0 where ignored; or None.
    log_sum_sq_probs: fp32 ``log(sum_v p_v**2)`` (no gradient), 0 where ignored; or None.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None
    label_mask: torch.Tensor
    mean_logits: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None


def start_valid_token_count(labels: torch.Tensor, ignore_index: int = -100, shift: bool = False) -> Callable[[], int]:
    """Start counting the labels that are not ``ignore_index``; the returned function gives the count.

    For ``num_valid_tokens`` without a pipeline stall: call this before the model's decoder runs,
    and the returned function after. On CUDA the count travels to pinned host memory behind an
    event recorded right after it, so reading it waits for the GPU to reach the start of the
    forward (long done by then), not for the forward to finish. ``shift``: count labels[..., 1:].
    """
    valid = (labels[..., 1:] if shift else labels) != ignore_index
    count = valid.sum()
    if count.device.type != "cuda":
        value = int(count)
        return lambda: value
    host = torch.empty((), dtype=count.dtype, pin_memory=True)
    host.copy_(count, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(count.device))

    def read() -> int:
        ready.synchronize()
        return int(host)

    return read


def _run(
    hidden,
    weight,
    bias,
    labels,
    num_items_in_batch,
    low_rank_hidden,
    low_rank_weight,
    options,
    vocab_shard,
    token_weights=None,
    class_weights=None,
    op_name=OP_NAME,
):
    """The op on local tensors (:func:`_run_chunked`), or its vocabulary-parallel form for a weight
    sharded along the vocabulary: a DTensor (tensor parallelism) or a local shard with ``vocab_shard``.
    ``op_name``: the public function called, for the count of its calls (:mod:`..core.calls`)."""
    if vocab_shard is not None or any(is_dtensor(t) for t in (hidden, weight, bias, labels)):
        if low_rank_hidden is not None or low_rank_weight is not None:
            fail("a low-rank term (LoRA on the head) is not supported with a vocabulary-sharded weight")
        if token_weights is not None or class_weights is not None:
            fail("token_weights and class_weights are not supported with a vocabulary-sharded weight")
        traced = torch.compiler.is_compiling()  # a constant of the graph: its eager remainder counts the call
        return _run_vocab_parallel(
            hidden, weight, bias, labels, num_items_in_batch, options, vocab_shard, op_name, traced
        )
    return _run_chunked(
        hidden, weight, bias, labels, num_items_in_batch, low_rank_hidden, low_rank_weight, options,
        token_weights, class_weights, op_name,
    )  # fmt: skip


@torch.compiler.disable
def _run_vocab_parallel(hidden, weight, bias, labels, num_items_in_batch, options, vocab_shard, op_name, traced):
    """DTensors unwrapped into local tensors and their :class:`VocabShard` (see vocab_parallel.py). Runs
    eagerly, a graph break under ``torch.compile``: each chunk exchanges statistics across the group. A call
    from a compiled graph (``traced``) is counted here, where it runs."""
    if traced:
        count_run(op_name)
    if any(options.want):
        fail(
            "entropy, is_top1, mean_logits, log_sum_sq_probs, return_lse and return_token_accuracy are not "
            "supported with a vocabulary-sharded weight (tensor parallelism), nor is return_predicted_tokens; the "
            "loss and log-probabilities are"
        )
    hidden, weight, bias, labels, shard = unwrap_dtensors(hidden, weight, bias, labels)
    if vocab_shard is not None:
        if shard is not None:
            fail("vocab_shard was given for a DTensor weight, which carries its own sharding; pass one or the other")
        shard = vocab_shard
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        check_shard(shard, weight.shape[0], options.ignore_index)
    options = SCHEMA.replace(options, shard=shard, vocab_size=shard.total)
    return _run_chunked(hidden, weight, bias, labels, num_items_in_batch, None, None, options, op_name=op_name)


def _run_chunked(
    hidden,
    weight,
    bias,
    labels,
    num_items_in_batch,
    low_rank_hidden,
    low_rank_weight,
    options,
    token_weights=None,
    class_weights=None,
    op_name=OP_NAME,
):
    """Checks, casts, shifts and flattens the inputs, completes ``options`` with what the tensors decide (the
    backend, which inputs need gradients), then runs the chunked op: the autograd Function in eager mode, the
    custom operator under ``torch.compile`` (see custom_op.py). Returns (loss, entropy, is_top1, mean_logits,
    log_sum_sq, lse, predicted, label_mask), each shaped like ``labels`` (the loss 0-d when scalar), None where not
    wanted (the label mask only per-token outputs and the token accuracy want)."""
    check_inputs(hidden, weight, bias, labels)
    hidden, weight, bias = compute_dtype(hidden, weight, bias)
    low_rank = low_rank_inputs(low_rank_hidden, low_rank_weight, hidden, weight)
    use_triton = resolve_backend(options.backend, hidden.device, hidden.dtype, OP_NAME)
    out_shape = labels.shape
    labels = labels.long()
    label_mask_wanted = not options.scalar or options.want.is_top1
    shift_rows = 0
    if options.shift and (label_mask_wanted or labels.shape[-1] == 0 or torch.compiler.is_compiling()):
        # the mask below needs the shifted labels; a graph fuses the shift (and its row length may be symbolic)
        labels = shift_labels(labels, options.ignore_index)
    elif options.shift:
        shift_rows = labels.shape[-1]  # the chunked op's label launch shifts them: no launches here
    labels = labels.reshape(-1)
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    if options.num_valid_tokens is not None and options.num_valid_tokens > labels.shape[0]:
        fail(f"num_valid_tokens={options.num_valid_tokens} exceeds the number of tokens ({labels.shape[0]})")
    num_items = None
    if num_items_in_batch is not None:
        num_items = num_items_tensor(num_items_in_batch, hidden.device, OP_NAME)

    grad_on = torch.is_grad_enabled()
    options = SCHEMA.replace(
        options,
        use_triton=use_triton,
        shift_rows=shift_rows,
        needs_grad=(
            grad_on and hidden.requires_grad,
            grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad,
        ),
        needs_low_rank_grad=(
            (grad_on and low_rank[0].requires_grad, grad_on and low_rank[1].requires_grad)
            if low_rank is not None
            else (False, False)
        ),
    )
    weights = loss_weights(token_weights, class_weights, out_shape, weight.shape[0], hidden.device, options)
    inputs = (hidden_2d, weight, bias, labels, num_items, *(low_rank or (None, None)), *weights)
    if torch.compiler.is_compiling():
        outputs = compiled_linear_cross_entropy(*inputs, options, op_name)
    else:
        outputs = LinearCrossEntropyFunction.apply(*inputs, options)
    loss, *per_token = outputs
    if not options.scalar:
        loss = loss.view(out_shape)
    per_token = [value.view(out_shape) if asked else None for value, asked in zip(per_token, options.want, strict=True)]
    label_mask = None
    if label_mask_wanted:  # a scalar loss alone needs no mask: no launch for it
        label_mask = (labels != options.ignore_index).view(out_shape)
    return loss, *per_token, label_mask


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    shift: bool = False,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    backend: str = "auto",
    chunk_size: int | None = None,
    deterministic: bool | None = None,
    skip_ignored: bool = False,
    num_valid_tokens: int | None = None,
    vocab_shard: VocabShard | None = None,
    low_rank_hidden: torch.Tensor | None = None,
    low_rank_weight: torch.Tensor | None = None,
    class_weights: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    return_lse: bool = False,
    return_token_accuracy: bool = False,
    fp32_weight_grad: bool = False,
    return_predicted_tokens: bool = False,
    options: CrossEntropyOptions | None = None,
) -> torch.Tensor | CrossEntropyOutputs:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``labels`` without materializing the logits.

    Args:
        hidden: [N, D] or [B, T, D], float32 / float16 / bfloat16.
        weight: [V, D], same dtype as ``hidden`` (or any float dtype under ``torch.autocast``).
        labels: [N] or [B, T] integer, each in [0, V) or equal to ``ignore_index``.
        bias: optional [V].
        softcap: final-logit softcap: logits = softcap * tanh(z / softcap), z = logit_scale * (h W^T + b).
        logit_scale: multiplies the logits before the softcap (Cohere's logit_scale, 1/Granite's logits_scaling).
        shift: score position t against label t + 1 within each row (Hugging Face causal-LM convention).
        reduction: "mean" over non-ignored tokens, "sum", or "none" (fp32 loss per token shaped like
            ``labels``, 0 where ignored).
        num_items_in_batch: when given, the loss is sum / num_items_in_batch (Trainer's gradient
            accumulation contract); not allowed with reduction="none".
        label_smoothing: as in ``torch.nn.functional.cross_entropy`` (also with ``class_weights``).
        z_loss: adds ``z_loss * logsumexp**2`` to each non-ignored token's loss.
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch".
        chunk_size: tokens per chunk, the memory/speed knob: the op holds ``chunk_size x V`` logits
            in the compute dtype. Default: 256 MiB of logits, at least 1024 tokens on the Triton
            path (GEMM efficiency; more for a thin D, so the dh GEMM fills the GPU), and at least
            N/16 tokens in bf16 (bounds dW's roundings); without gradients, a trainable weight's
            chunk also takes the bytes of the dW it does not hold (never above a training step); a
            vocabulary shard's budget is once per rank of its group (fewer chunks under tensor parallelism).
        deterministic: deprecated, does nothing (a FutureWarning when given): both backends are deterministic
            always (no atomics, a fixed reduction order).
        skip_ignored: run the matmuls on the non-ignored tokens only (gathered chunk by chunk), so
            ignored tokens cost nothing: a prompt-masked SFT batch that ignores 40% of its tokens
            does 40% less work. Costs one host sync to count them; give ``num_valid_tokens`` instead
            to avoid it. Same result up to the order of floating-point sums.
        num_valid_tokens: the number of labels that are not ``ignore_index`` (after ``shift``), when
            the caller knows it; implies ``skip_ignored`` without the sync. Checked on the device.
        vocab_shard: ``weight`` (and ``bias``) hold rows ``[start, start + V_local)`` of a vocabulary of
            ``total`` ids split across ``group`` (tensor parallelism, Megatron-style); see
            :class:`VocabShard`. Every rank of the group calls the op with the same hidden states and
            labels (global ids) and gets the whole vocabulary's loss; the gradient of ``hidden`` is the
            full one (summed over the group), ``weight``'s that of its shard. A ``torch.distributed``
            DTensor weight sharded along the vocabulary (``Shard(0)``, as transformers' ``tp_plan``
            makes the LM head) takes this path by itself, and a DTensor ``hidden`` (sequence
            parallelism) is gathered first. Runs eagerly (a graph break under ``torch.compile``).
        low_rank_hidden: [N, r] or [B, T, r], the left factor of a low-rank term added to the logits,
            ``low_rank_hidden @ low_rank_weight.T``; any float dtype (cast to hidden's). A LoRA adapter
            on the head is ``low_rank_hidden = scale * lora_A(dropout(hidden))``, ``low_rank_weight =
            lora_B.weight``, so the op never forms ``W + scale * B @ A``. Each chunk adds the term in its
            logits GEMM; both factors get gradients (``d low_rank_hidden = G @ B``, ``d low_rank_weight``
            accumulated in fp32), and W none when frozen. Not with ``vocab_shard``; under
            ``torch.compile`` part of the custom operator, as without the term.
        low_rank_weight: [V, r], the right factor of the low-rank term; given with ``low_rank_hidden``.
        class_weights: [V], any float dtype, finite and >= 0: each valid token's loss times its label's weight,
            as ``torch.nn.functional.cross_entropy(weight=...)``; "mean" is then the weighted mean (divided by
            the sum of the valid labels' weights, 0 when that is 0), "sum" the weighted sum,
            ``num_items_in_batch`` divides the weighted sum by that count. With ``label_smoothing`` the smoothing
            term is weighted too, as torch's: ``(1 - eps) * w_y * (lse - z_y) + eps / V * sum_v w_v * (lse - z_v)``
            (plus ``w_y * z_loss * lse**2``), "mean" still dividing by the valid labels' weights; all weights 0
            give a 0 loss with zero gradients. No gradient.
        token_weights: [N] or the shape of ``labels``, any float dtype, finite and >= 0: each position's loss
            times its weight (with ``shift``, position t's, whose target is label t + 1). "mean" still divides
            by the number of valid tokens (and ``num_items_in_batch`` by itself), so weights of 1 give the
            unweighted loss. With ``class_weights`` both multiply. Costs nothing per logit: the weight scales
            each row's gradient in the same kernel. No gradient.
        return_lse: also return the per-token log-sum-exp of the final logits (fp32, 0 where ignored, no
            gradient), from the same pass: the z-loss's term, for logging apart.
        return_token_accuracy: also return the fraction of valid tokens whose label is the argmax of the
            logits (the first index on ties; 0 when none is valid; unweighted; no gradient), from the same
            pass; computed from the same argmax as ``return_predicted_tokens``, so the two always agree.
        fp32_weight_grad: accumulate a bf16 weight's gradient in fp32 over the chunks and round it once
            (fp16 always is; fp32 and fp64 need nothing). Off by default: see the benchmark results for what
            it costs and gains.
        return_predicted_tokens: also return each position's predicted token id, the argmax of its final
            logits (after the softcap; the first index on ties, as ``torch.argmax``, a NaN logit winning), int64
            shaped like ``labels``, no gradient, from the same pass (a compare and a select per logit, only when
            asked; the loss and gradients are unchanged, bit for bit). Ignored positions get their argmax too
            (with ``shift``, the last position's is the next token after the row), except with ``skip_ignored``
            or ``num_valid_tokens``, which never compute those rows: they hold ``ignore_index`` there. The
            softcap is monotonic, so this is the argmax of the raw logits except where it rounds distinct raw
            logits near the cap to the same value (a tie there goes to the first index). As Liger's
            ``return_predicted_tokens``.
        options: the options above as one :class:`CrossEntropyOptions` (``ignore_index`` to ``fp32_weight_grad``,
            ``return_*`` as its ``want``: :class:`ExtraOutputs`' ``lse``, ``is_top1``, ``predicted``), instead of
            their keywords: one form or the other (a TypeError when an option keyword off its default is given
            beside it, or when it is not a CrossEntropyOptions; a ValueError when it sets a field these keywords
            do not, such as ``temperature``). The same call either way; a caller that holds its options (the
            patched models' forward) builds the object once and hands it over.

    Returns:
        fp32 0-d loss (or per-token losses for reduction="none"). A batch whose labels are all ignored
        gives 0 with zero gradients. With ``return_lse``, ``return_token_accuracy`` or
        ``return_predicted_tokens``, a :class:`CrossEntropyOutputs` (loss, lse, token_accuracy,
        predicted_tokens), None for what was not asked.
    """
    if deterministic is not None:
        warn_deterministic()
    count_call(OP_NAME)
    keywords = dict(
        ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale, shift=shift, reduction=reduction,
        label_smoothing=label_smoothing, z_loss=z_loss, backend=backend, chunk_size=chunk_size,
        skip_ignored=skip_ignored, num_valid_tokens=num_valid_tokens, return_lse=return_lse,
        return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens,
        fp32_weight_grad=fp32_weight_grad,
    )  # fmt: skip
    if options is None:
        check_reduction(reduction, num_items_in_batch, OP_NAME)
        options = build_options(keywords)
    else:
        options = given_options(options, keywords, OP_NAME)
        check_reduction(options.reduction, num_items_in_batch, OP_NAME)
    loss, _entropy, is_top1, _mean, _log_sum_sq, lse, predicted, label_mask = _run(
        hidden, weight, bias, labels, num_items_in_batch, low_rank_hidden, low_rank_weight, options, vocab_shard,
        token_weights, class_weights,
    )  # fmt: skip
    want = options.want
    if not (want.lse or want.is_top1 or want.predicted):
        return loss
    accuracy = None
    if want.is_top1:
        accuracy = (is_top1.sum() / label_mask.sum().clamp(min=1)).to(loss.dtype)
    return CrossEntropyOutputs(loss=loss, lse=lse, token_accuracy=accuracy, predicted_tokens=predicted)


def fused_linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
    shift: bool = False,
    return_entropy: bool = False,
    return_is_top1: bool = False,
    return_mean_logits: bool = False,
    return_log_sum_sq_probs: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
    skip_ignored: bool = False,
    num_valid_tokens: int | None = None,
    precompute_grad: bool = False,
    vocab_shard: VocabShard | None = None,
    low_rank_hidden: torch.Tensor | None = None,
    low_rank_weight: torch.Tensor | None = None,
    options: CrossEntropyOptions | None = None,
) -> TokenOutputs:
    """Per-token target log-probabilities (and optionally entropy, argmax match, the mean logit and
    ``log(sum p**2)``) without the logits, all from the same pass over each chunk's logits.

    Logits are ``softcap * tanh(logit_scale * (h W^T + b) / softcap) / temperature``. ``log_probs`` and
    ``entropy`` carry gradients for any upstream gradient (the backward recomputes each chunk's
    logits: 8*N*V*D FLOPs in all); use :func:`fused_linear_cross_entropy` for a scalar loss, which
    computes its gradient during the forward (6*N*V*D).

    ``mean_logits`` (the mean over the vocabulary of the final logits) and ``log_sum_sq_probs`` (TRL's WPO
    weights) carry no gradient. Each extra output adds a few operations per logit to the one pass, not a pass.

    ``skip_ignored`` / ``num_valid_tokens``: as in :func:`fused_linear_cross_entropy`.

    ``precompute_grad=True`` is for callers that will almost always reduce ``log_probs`` with the same
    weight on every non-ignored token (an NLL mean or sum, as TRL's SFT loss does) and use ``entropy``
    without gradient: the forward then also computes the gradients of that reduction (6*N*V*D FLOPs in
    all, like the scalar loss), and the backward checks the upstream gradient (one host sync) and only
    rescales them. Any other upstream gradient falls back to the recompute, correct but at 14*N*V*D.

    ``vocab_shard``, or a DTensor ``weight`` sharded along the vocabulary (tensor parallelism): as in
    :func:`fused_linear_cross_entropy`, for ``log_probs``; the other outputs are refused there.

    ``low_rank_hidden`` / ``low_rank_weight`` (a LoRA adapter on the head): as in
    :func:`fused_linear_cross_entropy`; the logits above then include ``low_rank_hidden @ low_rank_weight.T``
    inside the softcap.

    ``options``: the options above as one :class:`CrossEntropyOptions` with ``reduction="none"`` (the
    ``return_*`` flags as its ``want``: ``entropy``, ``is_top1``, ``mean_logit``, ``log_sum_sq``), instead of their
    keywords; one form or the other, checked as in :func:`fused_linear_cross_entropy`.

    Shapes: hidden [N, D] or [B, T, D]; labels [N] or [B, T]; every output is shaped like labels.
    """
    count_call("fused_linear_log_probs")
    keywords = dict(
        ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale, temperature=temperature, shift=shift,
        return_entropy=return_entropy, return_is_top1=return_is_top1, return_mean_logits=return_mean_logits,
        return_log_sum_sq_probs=return_log_sum_sq_probs, backend=backend, chunk_size=chunk_size,
        skip_ignored=skip_ignored, num_valid_tokens=num_valid_tokens, precompute_grad=precompute_grad,
    )  # fmt: skip
    if options is None:
        options = build_options(keywords, log_probs=True)
    else:
        options = given_options(options, keywords, "fused_linear_log_probs", log_probs=True)
    loss, entropy, is_top1, mean_logits, log_sum_sq_probs, _lse, _predicted, label_mask = _run(
        hidden, weight, bias, labels, None, low_rank_hidden, low_rank_weight, options, vocab_shard,
        op_name="fused_linear_log_probs",
    )  # fmt: skip
    return TokenOutputs(
        log_probs=-loss,
        entropy=entropy,
        is_top1=is_top1,
        label_mask=label_mask,
        mean_logits=mean_logits,
        log_sum_sq_probs=log_sum_sq_probs,
    )


class FusedLinearCrossEntropy(torch.nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`: ``forward(hidden, weight, labels, bias=None)``.

    Holds the options only (no parameters), so it can sit beside any head.
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        softcap: float | None = None,
        logit_scale: float = 1.0,
        shift: bool = False,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        backend: str = "auto",
        chunk_size: int | None = None,
        deterministic: bool | None = None,
        skip_ignored: bool = False,
    ) -> None:
        super().__init__()
        check_reduction(reduction, None, OP_NAME)
        if backend not in BACKENDS:
            fail(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        self.options = dict(
            ignore_index=ignore_index,
            softcap=softcap,
            logit_scale=logit_scale,
            shift=shift,
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            backend=backend,
            chunk_size=chunk_size,
            skip_ignored=skip_ignored,
        )
        if deterministic is not None:
            warn_deterministic()

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        bias: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        return fused_linear_cross_entropy(
            hidden, weight, labels, bias=bias, num_items_in_batch=num_items_in_batch, **self.options
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
