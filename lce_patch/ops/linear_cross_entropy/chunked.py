"""The chunked forward and backward of the cross-entropy op, shared by both backends and both autograd paths.

Tokens are processed ``chunk_rows`` at a time. For each chunk the projection
``raw = hidden_c @ W.T (+ bias)`` is one GEMM into a reused ``[chunk_rows, V]`` buffer; a row
operation (Triton kernel or torch, see ``rows.py``) turns it into per-token statistics and, when
gradients are needed, into the logits gradient in place; two more GEMMs give ``dh_c = G @ W`` and
``dW += G.T @ h_c``. Each GEMM reduces over D or V in full, with fp32 accumulation inside the GEMM.
With a softcap and a frozen W the Triton kernel writes G in one pass as ``U`` and a per-row factor
(G = U * factor, see kernels.py), which goes onto the fp32 output of ``U @ W`` (a ``[C, D]`` fp32
temporary) before dh's one rounding.

Two gradient schedules:

* scalar loss (reduction "mean"/"sum"/num_items_in_batch): the gradient is computed during the
  forward (6*N*V*D FLOPs instead of 8 for a recompute), already scaled by the reduction factor,
  and the backward only multiplies dh, dW and dbias by ``grad_output`` (exact, so no second
  rounding, when it is 1 or a power of two as under loss scaling).
* per-token outputs (reduction "none", log-probabilities, differentiable entropy): the forward
  keeps the log-sum-exp and entropy per token; the backward recomputes each chunk's logits and
  applies the per-token upstream gradients. With ``precompute_grad`` the forward also computes the
  gradient of the mean over valid tokens, and the backward only rescales it when the upstream
  gradient is the same for every valid token (checked with one host sync), else it recomputes.

Rows whose label is ignored can be left out (``row_index``: the rows to process): each chunk then
gathers its rows of hidden (into a stretch of dh that holds no finished row yet, when dh is
computed), dh is scattered back, and per-row outputs are placed among zeros.

With ``CrossEntropyOptions.shard`` the weight is one rank's shard of a vocabulary split across a process
group: the row pass becomes vocab_parallel.py's (statistics exchanged per chunk, the gradient formed
with the whole vocabulary's log-sum-exp), labels become shard ids, and dh is summed over the group.

A low-rank term (:class:`LowRank`, a LoRA adapter on the head) adds ``L_c @ B.T`` to each chunk's
logits (one more GEMM into the buffer, K = r) and takes its gradients from the same G:
``dL_c = G @ B`` and ``dB += G.T @ L_c`` (fp32). The adapter's own input projection
(``L = scale * dropout(h) @ A.T``) stays outside the op, in autograd, so W is never copied or summed
with ``B @ A``.

Memory above inputs and gradients: the one logits buffer plus O(N) fp32 vectors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.backend import cdiv, stats_dtype
from ..core.checks import check_weights
from ..core.chunking import buffer_rows, resolve_chunks
from ..core.grads import GradAccumulator, LowRank, fp32_output_gemm_available, logits_into
from ..core.labels import LabelShard, prepare_labels
from ..core.reduction import loss_scale
from .launchers import unnormalized_grad_applies
from .options import OP_NAME, CrossEntropyOptions
from .rows import ClassSmoothing, RowOutputs, chunk_grad, chunk_stats, target_logits
from .vocab_parallel import ShardRowPass, all_reduce_sum, group_size


def _gather_buffer(
    hidden: torch.Tensor, row_index: torch.Tensor | None, rows: int, grads: GradAccumulator | None
) -> torch.Tensor | None:
    """One ``[rows, D]`` buffer that every chunk's selected rows of hidden are gathered into (None:
    no selection, or dh is kept and the rows are gathered into it)."""
    if row_index is None or (grads is not None and grads.gathers_into_dh):
        return None
    return torch.empty(rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)


def _chunk_rows_of(
    hidden: torch.Tensor,
    rows: slice | torch.Tensor,
    start: int,
    grads: GradAccumulator | None,
    gathered: torch.Tensor | None,
) -> torch.Tensor:
    """The chunk's rows of hidden: a view for a slice, else gathered into dh or (the front of) ``gathered``."""
    if isinstance(rows, slice):
        return hidden[rows]
    if grads is not None and grads.gathers_into_dh:
        return grads.gather_rows(hidden, rows, start)
    return torch.index_select(hidden, 0, rows, out=gathered[: rows.shape[0]])


def _scatter_rows(out: RowOutputs, row_index: torch.Tensor, total_rows: int, ignore_index: int) -> RowOutputs:
    """Per-row outputs of the selected rows placed among ``total_rows`` zeros (the ignored rows' values), the
    predicted ids among ``ignore_index`` (an ignored row's argmax is not computed)."""

    def place(name, values):
        if values is None:
            return None
        fill = ignore_index if name == "predicted" else 0
        full = torch.full((total_rows,), fill, dtype=values.dtype, device=values.device)
        return full.index_copy_(0, row_index, values)

    return RowOutputs(*(place(name, t) for name, t in vars(out).items()))


def _accumulator(hidden, weight, bias, row_index, low_rank, options: CrossEntropyOptions) -> GradAccumulator:
    return GradAccumulator(
        hidden,
        weight,
        bias,
        *options.needs_grad,
        row_index,
        low_rank,
        options.needs_low_rank_grad,
        options.fp32_weight_grad,
    )


class ForwardOutputs(NamedTuple):
    """What :func:`chunked_forward` computes.

    loss: 0-d for a scalar loss, else [N] (0 where ignored); entropy, is_top1 (bool), mean_logit,
    log_sum_sq, lse_out (the log-sum-exp of the final logits): [N] (0 / False where ignored) or None when not
    wanted; predicted: [N] int64, the argmax of each processed row's final logits (ignored rows' too when every
    row is processed; ``ignore_index`` where a row was not), or None. For the backward: ``row_index`` (the
    processed rows, None for all), their ``row_labels`` [M], ``lse`` [M] and ``processed_entropy`` [M] (None
    without entropy); ``grads`` (dh, dw, db, d_low_rank_hidden, d_low_rank_weight, each None when not needed)
    when the gradient was computed in the forward, and
    ``grad_scale`` (the factor precomputed gradients carry, per-token outputs only); ``chunks``, the (start, stop) row spans used.
    """

    loss: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None
    mean_logit: torch.Tensor | None
    log_sum_sq: torch.Tensor | None
    lse_out: torch.Tensor | None
    predicted: torch.Tensor | None
    lse: torch.Tensor
    processed_entropy: torch.Tensor | None
    row_index: torch.Tensor | None
    row_labels: torch.Tensor
    grads: tuple | None
    grad_scale: torch.Tensor | None
    chunks: tuple[tuple[int, int], ...]


def _reduce_scale(
    reduction: str,
    num_valid: torch.Tensor,
    num_items: torch.Tensor | None,
    dtype: torch.dtype,
    weight_sum: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The factor a scalar loss applies to the sum of token losses (0-d, ``dtype``), None for per-token outputs
    (:func:`..core.reduction.loss_scale`). "mean" divides by ``weight_sum`` with class weights (the valid labels'
    weights, as torch's), else by the count of valid labels; ``num_items`` may be 0 only when that count is."""
    count = weight_sum if weight_sum is not None and num_items is None else num_valid
    return loss_scale(
        count.to(dtype),
        num_items,
        reduction,
        op_name=OP_NAME,
        none_counted="every label is ignored",
        counted="valid labels",
    )


def _row_weights(
    labels: torch.Tensor,
    valid: torch.Tensor,
    token_weights: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    dtype: torch.dtype,
    options: CrossEntropyOptions,
) -> tuple[torch.Tensor | None, torch.Tensor | None, ClassSmoothing | None]:
    """(each row's weight in a scalar loss, 0 where ignored: its token weight times its label's class weight, or
    with label smoothing times its class factor, see :func:`_class_smoothing`; the sum of the valid labels' class
    weights, or None without class weights; the rows' :class:`ClassSmoothing` with class weights and label
    smoothing, else None). (None, None, None) without weights."""
    if token_weights is None and class_weights is None:
        return None, None, None
    for name, weights in (("token_weights", token_weights), ("class_weights", class_weights)):
        if weights is not None:
            check_weights(weights, name, OP_NAME)
    row_weight = None if token_weights is None else token_weights.to(dtype)
    weight_sum = smoothing = None
    if class_weights is not None:  # labels are checked in range: the ignored rows' gather from 0
        class_weights = class_weights.to(dtype)
        label_weight = class_weights.index_select(0, torch.where(valid, labels, 0))
        label_weight = torch.where(valid, label_weight, 0.0)
        weight_sum = label_weight.sum()
        row_class = label_weight
        if options.label_smoothing:
            row_class, smoothing = _class_smoothing(class_weights, label_weight, valid, options)
        row_weight = row_class if row_weight is None else row_weight * row_class
    return torch.where(valid, row_weight, 0.0), weight_sum, smoothing


def _class_smoothing(
    class_weights: torch.Tensor, label_weight: torch.Tensor, valid: torch.Tensor, options: CrossEntropyOptions
) -> tuple[torch.Tensor, ClassSmoothing]:
    """Class weights w with label smoothing eps, as ``F.cross_entropy(weight=w, label_smoothing=eps)``: a valid
    row with target y has the loss (before its token weight and the reduction)

        (1 - eps) w_y (lse - z_y) + (eps / V) sum_v w_v (lse - z_v) + w_y z_loss lse**2
          = f (lse - (1 - eps_y) z_y - eps_y sum_v q_v z_v + zl_y lse**2),

    with W = sum_v w_v, q = w / W, f = (1 - eps) w_y + eps W / V, eps_y = (eps W / V) / f and zl_y = w_y z_loss / f:
    the unweighted row's loss with the row's own smoothing eps_y, spread as q instead of 1 / V, and z-loss factor
    zl_y, times f. Returns (f [N], 0 where ignored; the rows' :class:`ClassSmoothing`, whose eps_y and zl_y are 0
    where f is 0). All weights 0 (W = 0): q = 0 and f = 0, a 0 loss with zero gradients."""
    eps = options.label_smoothing
    total = class_weights.sum()
    q = torch.where(total > 0, class_weights / total, 0.0).contiguous()
    spread = eps * total / class_weights.shape[0]  # eps W / V
    row_class = torch.where(valid, (1.0 - eps) * label_weight + spread, 0.0)
    positive = row_class > 0
    denominator = torch.where(positive, row_class, 1.0)
    smoothing = torch.where(positive, spread / denominator, 0.0)
    z_loss = torch.where(positive, options.z_loss * label_weight / denominator, 0.0)
    return row_class, ClassSmoothing(q, smoothing, z_loss)


def chunked_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    num_items: torch.Tensor | None,
    options: CrossEntropyOptions,
    low_rank: LowRank | None = None,
    token_weights: torch.Tensor | None = None,
    class_weights: torch.Tensor | None = None,
) -> ForwardOutputs:
    """The chunked forward (see the module docstring), with the checks that read tensor values.

    hidden [N, D], weight [V, D], bias [V] or None, ``low_rank``'s tensors: one float dtype, any strides.
    labels [N] integer. num_items: 0-d tensor (``num_items_in_batch``) or None. token_weights [N] and
    class_weights [V] (any float dtype, a scalar loss only): each valid token's loss times its weight and its
    label's class weight; the class weights also make "mean" the weighted mean, and with label smoothing weigh its
    term as torch does (:func:`_class_smoothing`). Runs with autocast off (the caller casts).
    """
    with torch.autocast(hidden.device.type, enabled=False):
        return _chunked_forward(
            hidden, weight, bias, labels, num_items, options, low_rank, token_weights, class_weights
        )


def _chunked_forward(
    hidden, weight, bias, labels, num_items, options: CrossEntropyOptions, low_rank, token_weights, class_weights
) -> ForwardOutputs:
    use_triton, shard = options.use_triton, options.shard
    labels = labels.contiguous()  # the row kernels index labels by row
    vocab_size = weight.shape[0]
    acc_dtype = stats_dtype(hidden.dtype)
    # Checked, counted, selected and (for a shard) renumbered in one pass (one launch on Triton). With class
    # weights "mean" divides by their sum, taken below.
    prepared = prepare_labels(
        labels,
        vocab_size=vocab_size if shard is None else shard.total,
        ignore_index=options.ignore_index,
        select=options.selects_rows,
        num_valid_tokens=options.num_valid_tokens,
        reduction=options.reduction if options.scalar and class_weights is None else None,
        num_items=num_items if class_weights is None else None,
        scale_dtype=acc_dtype,
        shard=LabelShard(shard.start, vocab_size) if shard is not None else None,
        use_triton=use_triton,
        op_name=OP_NAME,
        shift_rows=options.shift_rows,
    )
    row_index = prepared.row_index
    labels = prepared.labels  # shifted if asked; with a shard, ids of the local shard (vocab_parallel.py)
    valid = None
    if token_weights is not None or class_weights is not None or options.want.lse:
        valid = labels != options.ignore_index  # a shard's not-owned id is not ignore_index either
    row_weight, weight_sum, class_smoothing = _row_weights(
        labels, valid, token_weights, class_weights, acc_dtype, options
    )
    reduce_scale = prepared.scale
    if class_weights is not None:
        reduce_scale = _reduce_scale(options.reduction, prepared.num_valid, num_items, acc_dtype, weight_sum)

    total_rows = hidden.shape[0]
    num_rows = total_rows if row_index is None else row_index.shape[0]
    row_labels = prepared.row_labels
    device = hidden.device
    want_entropy, want_top1, want_mean_logit, want_log_sum_sq, want_lse, want_predicted = options.want
    any_grad = options.any_grad
    # Every rank of a shard's group plans the same chunks, with the budget once per rank (core/chunking.py).
    shard_plan = None
    if shard is not None:
        ranks = group_size(shard)
        shard_plan = (cdiv(shard.total, ranks), ranks)
    chunks = resolve_chunks(options.chunk_size, num_rows, hidden, weight, use_triton, any_grad, shard_plan)
    scalar_loss = reduce_scale is not None
    # Per-token outputs with precompute_grad: the gradient of sum(loss) / n_valid is computed now
    # (6*N*V*D FLOPs), and the backward uses it when the upstream gradient turns out uniform.
    precompute = options.precompute_grad and any_grad and not scalar_loss
    grad_scale = reduce_scale
    if precompute:
        grad_scale = 1.0 / (row_labels != options.ignore_index).sum().clamp(min=1).to(acc_dtype)
    grad_in_forward = (scalar_loss and any_grad) or precompute
    if row_weight is not None and row_index is not None:
        row_weight = row_weight.index_select(0, row_index)  # the processed rows'
        if class_smoothing is not None:
            class_smoothing = class_smoothing.select(row_index)
    row_scale = row_weight * grad_scale if row_weight is not None and grad_in_forward else None

    def stat_rows():
        return torch.empty(num_rows, dtype=acc_dtype, device=device)

    out = RowOutputs(
        loss=stat_rows(),
        lse=stat_rows(),
        entropy=stat_rows() if want_entropy else None,
        is_top1=torch.empty(num_rows, dtype=torch.int8, device=device) if want_top1 else None,
        mean_logit=stat_rows() if want_mean_logit else None,
        log_sum_sq=stat_rows() if want_log_sum_sq else None,
        predicted=torch.empty(num_rows, dtype=torch.int64, device=device) if want_predicted else None,
    )
    grads = _accumulator(hidden, weight, bias, row_index, low_rank, options) if grad_in_forward else None
    # The buffer holds logits rounded to the compute dtype; the loss reads the target logit once
    # more in fp32 so that rounding does not reach it (fp32 and fp64 buffers need no second look).
    # A vocabulary shard needs the target logit of the labels it owns in every dtype (vocab_parallel.py).
    target_raw = None
    if hidden.dtype in (torch.float16, torch.bfloat16) or shard is not None:
        target_raw = target_logits(hidden, weight, bias, labels, use_triton, row_index)
        if low_rank is not None:
            target_raw += target_logits(low_rank.hidden, low_rank.weight, None, labels, use_triton, row_index)
    buffer = torch.empty(buffer_rows(chunks), vocab_size, dtype=hidden.dtype, device=device)
    shard_pass = None
    if shard is not None:
        shard_pass = ShardRowPass(shard, options, buffer.shape[0], use_triton, hidden.dtype, device)
    gathered = _gather_buffer(hidden, row_index, buffer.shape[0], grads)
    # The one-pass gradient (rows to be scaled by row_factor) where the kernel has it (softcap)
    # and only dh is computed (a frozen W, as under LoRA); log_sum_sq and the entropy need the running
    # max, which the one-pass kernel does not keep (rows.py refuses the combination).
    row_factor = None
    if (
        shard is None
        and not want_log_sum_sq
        and not want_entropy
        and grads is not None
        and grads.takes_row_factor
        and unnormalized_grad_applies(options, hidden.dtype, use_triton)
        and fp32_output_gemm_available(device)
    ):
        row_factor = torch.empty(buffer.shape[0], dtype=torch.float32, device=device)
    for start, stop in chunks:
        raw = buffer[: stop - start]
        rows = slice(start, stop) if row_index is None else row_index[start:stop]
        hidden_chunk = _chunk_rows_of(hidden, rows, start, grads, gathered)
        logits_into(raw, hidden_chunk, weight, bias, low_rank, rows)
        chunk_out = RowOutputs(*(None if t is None else t[start:stop] for t in vars(out).values()))
        chunk_target = target_raw[start:stop] if target_raw is not None else None
        chunk_factor = row_factor[: stop - start] if row_factor is not None else None
        chunk_smoothing = class_smoothing.rows(start, stop) if class_smoothing is not None else None
        chunk_scale = None
        if grad_in_forward:
            chunk_scale = row_scale[start:stop] if row_scale is not None else grad_scale
        if shard_pass is not None:
            shard_pass.run(raw, row_labels[start:stop], chunk_out, chunk_target, chunk_scale)
        else:
            chunk_stats(
                raw, row_labels[start:stop], options, chunk_out, chunk_scale, use_triton, chunk_target, chunk_factor,
                class_smoothing=chunk_smoothing,
            )  # fmt: skip
        if grads is not None:
            grads.add(raw, hidden_chunk, rows, chunk_factor)
    del buffer, gathered, row_factor
    processed = out  # the processed rows' outputs, which a recompute in backward needs
    loss_sum = None
    if scalar_loss:
        loss_sum = (out.loss * row_weight).sum() if row_weight is not None else out.loss.sum()
    if row_index is not None and (not scalar_loss or any(options.want)):
        out = _scatter_rows(out, row_index, total_rows, options.ignore_index)
    computed = None
    if grads is not None:
        computed = (
            *grads.results(weight.dtype, bias.dtype if bias is not None else None),
            *grads.low_rank_results(),
        )
        if shard is not None and computed[0] is not None:
            all_reduce_sum(computed[0], shard)  # dh: the sum of every shard's G_r @ W_r
    return ForwardOutputs(
        loss=loss_sum * reduce_scale if scalar_loss else out.loss,
        entropy=out.entropy,
        is_top1=out.is_top1.bool() if want_top1 else None,
        mean_logit=out.mean_logit,
        log_sum_sq=out.log_sum_sq,
        lse_out=torch.where(valid, out.lse, 0.0) if want_lse else None,
        predicted=out.predicted,
        lse=processed.lse,
        processed_entropy=processed.entropy,
        row_index=row_index,
        row_labels=row_labels,
        grads=computed,
        grad_scale=grad_scale if precompute else None,
        chunks=chunks,
    )


def chunked_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    row_labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    row_index: torch.Tensor | None,
    grad_loss: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    options: CrossEntropyOptions,
    chunks: tuple[tuple[int, int], ...],
    low_rank: LowRank | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of per-token outputs by recomputing each chunk's logits (8*N*V*D FLOPs in all), over
    the (start, stop) row spans ``chunks`` (:func:`resolve_chunks`).

    ``row_labels``, ``lse`` and ``entropy`` are of the processed rows (``row_index``, or all);
    ``grad_loss`` and ``grad_entropy`` (None: no gradient) are of all N rows. Returns (dh, dw, db,
    d of the low-rank term's hidden, d of its weight), None where not needed (``options.needs_grad``,
    ``options.needs_low_rank_grad``). With ``options.shard``, ``row_labels`` are shard ids, ``lse`` the whole
    vocabulary's, and dh is summed over the shard's group.
    """
    use_triton, shard = options.use_triton, options.shard
    with torch.autocast(hidden.device.type, enabled=False):
        if row_index is not None:  # only the processed rows have gradients
            if grad_loss is not None:
                grad_loss = grad_loss.reshape(-1).index_select(0, row_index)
            if grad_entropy is not None:
                grad_entropy = grad_entropy.reshape(-1).index_select(0, row_index)
        vocab_size = weight.shape[0]
        grads = _accumulator(hidden, weight, bias, row_index, low_rank, options)
        acc_dtype = stats_dtype(hidden.dtype)
        grad_loss = grad_loss.reshape(-1).to(acc_dtype).contiguous() if grad_loss is not None else None
        grad_entropy = grad_entropy.reshape(-1).to(acc_dtype).contiguous() if grad_entropy is not None else None
        num_rows = row_labels.shape[0]
        if (grad_loss is not None or grad_entropy is not None) and num_rows > 0:
            buffer = torch.empty(buffer_rows(chunks), vocab_size, dtype=hidden.dtype, device=hidden.device)
            gathered = _gather_buffer(hidden, row_index, buffer.shape[0], grads)
            for start, stop in chunks:
                raw = buffer[: stop - start]
                rows = slice(start, stop) if row_index is None else row_index[start:stop]
                hidden_chunk = _chunk_rows_of(hidden, rows, start, grads, gathered)
                logits_into(raw, hidden_chunk, weight, bias, low_rank, rows)
                chunk_grad(
                    raw,
                    row_labels[start:stop],
                    options,
                    lse[start:stop],
                    entropy[start:stop] if grad_entropy is not None else None,
                    grad_loss[start:stop] if grad_loss is not None else None,
                    grad_entropy[start:stop] if grad_entropy is not None else None,
                    use_triton,
                )
                grads.add(raw, hidden_chunk, rows)
        elif grads.dh is not None:
            grads.dh.zero_()
        dh, dw, db = grads.results(weight.dtype, bias.dtype if bias is not None else None)
        if shard is not None and dh is not None:
            all_reduce_sum(dh, shard)
        return dh, dw, db, *grads.low_rank_results()
