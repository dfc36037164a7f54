"""Per-chunk row operations, in two interchangeable implementations.

``chunk_stats`` turns a ``[C, V]`` buffer of raw logits (the GEMM output) into per-row loss,
log-sum-exp and optional side outputs, and can overwrite the buffer with the logits gradient.
``chunk_grad`` overwrites a recomputed buffer with the gradient of per-row outputs given their
upstream gradients. The Triton launchers run the kernels of ``kernels.py``; the torch versions
compute the same thing with fp32 tensor ops and serve every device without Triton, and act as
the readable reference for the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.backend import HAS_TRITON, cdiv, next_power_of_2, stats_dtype
from ..core.transform import LogitTransform

_kernels = None
if HAS_TRITON:
    from . import kernels as _kernels

# Vocabulary block per program iteration of the stats kernel (8 warps, one program per row): it keeps
# up to five fp32 per-lane accumulators, 16 registers per thread each at 4096 lanes. On the H100 the
# pass with the gradient ran 3-10% faster at 4096 than at 2048 lanes (2.7 vs 2.5 TB/s on 1008-row
# chunks of the Llama-3, Qwen2.5 and Gemma-2 vocabularies), and fewer, row-looping programs were
# slower (benchmarks/NOTES.md, v10).
_BLOCK_V_STATS = 4096
_STATS_NUM_WARPS = 8
_BLOCK_V_GRAD = 4096
# Consecutive logits per lane of the stats kernel (one running max per lane). 8 took the forward-only
# pass 124 -> 101 us per 1008-row chunk of the Llama-3 vocabulary (Qwen2.5 144 -> 118, Gemma-2 253 ->
# 238) and the pass with the gradient 282 -> 274 (Qwen2.5 334 -> 324), but Gemma-2's bounded-exponent
# pass with the gradient 571 -> 588: that case keeps one logit per lane (NOTES v11), and so does its
# one-pass form (675 us per 1792-row chunk vs 686-791 with lanes of 2, 4 or 8; NOTES v15).
_LANE_GROUP = 8
# With one logit per lane (the bounded-exponent pass with the gradient) the argmax is kept per this many lanes:
# one max and one column per lane took that pass from 251 to 407 us per 1024-row chunk of the Llama-3
# vocabulary (softcap 30, bf16) on the H200, per 8 lanes to 291 (order-preserving reshape).
_MAX_REGROUP = 8
# Softcapped logits satisfy |z| <= softcap / temperature; up to this bound the stats kernel takes its
# exponentials against the bound instead of a running max (exp(-2 * 40) is still a normal fp32).
_FIXED_MAX_LIMIT = 40.0


@dataclass(frozen=True)
class ClassSmoothing:
    """Label smoothing with class weights (``F.cross_entropy(weight=w, label_smoothing=eps)``), for the rows of
    one chunk. A row's weighted loss is ``f * (lse - (1 - eps_y) * z_y - eps_y * sum_v q_v z_v + zl_y * lse**2)``:
    ``q`` [V] is the class weights normalized to sum to 1 (0 when they sum to 0), ``smoothing`` [C] each row's
    ``eps_y`` and ``z_loss`` [C] its ``zl_y`` (both 0 where the row's factor ``f`` is 0); ``f`` is applied outside
    the row pass, as a row weight (see chunked.py's ``_class_smoothing``). fp32 (fp64 for fp64), contiguous."""

    q: torch.Tensor
    smoothing: torch.Tensor
    z_loss: torch.Tensor

    def rows(self, start: int, stop: int) -> ClassSmoothing:
        return ClassSmoothing(self.q, self.smoothing[start:stop], self.z_loss[start:stop])

    def select(self, row_index: torch.Tensor) -> ClassSmoothing:
        return ClassSmoothing(self.q, self.smoothing.index_select(0, row_index), self.z_loss.index_select(0, row_index))


@dataclass
class RowOutputs:
    """fp32 per-row outputs of ``chunk_stats`` (views into full-length buffers)."""

    loss: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None  # int8
    mean_logit: torch.Tensor | None = None
    log_sum_sq: torch.Tensor | None = None  # log(sum_v p_v**2)
    predicted: torch.Tensor | None = None  # int64: the argmax of the final logits (first index on ties)


# --------------------------------------------------------------------------- torch versions


def final_logits(raw: torch.Tensor, transform: LogitTransform) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Final logits ``z`` of raw GEMM outputs in fp32 (fp64 for fp64), and ``tanh`` (None without softcap)."""
    u = raw.to(stats_dtype(raw.dtype)) * transform.logit_scale
    tanh = None
    if transform.softcap is not None:
        tanh = torch.tanh(u / transform.softcap)
        u = transform.softcap * tanh
    if transform.temperature != 1.0:
        u = u / transform.temperature
    return u, tanh


def _raw_grad_factor(transform: LogitTransform, tanh: torch.Tensor | None, grad_z: torch.Tensor) -> torch.Tensor:
    grad_z = grad_z * (transform.logit_scale / transform.temperature)
    if tanh is not None:
        grad_z = grad_z * (1.0 - tanh * tanh)
    return grad_z


def _label_in_row(labels: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """Rows whose valid label has a column in the buffer. A valid label outside [0, V) (a vocabulary
    shard that does not own it) has none: its target logit counts as 0 and it gets no one-hot gradient
    term, as in the kernels."""
    return valid & (labels >= 0) & (labels < width)


def _entropy(z: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) per row [C], as a sum of non-negative terms (see kernels.py's design note):
    ``log1p(rest) + sum_j e_j (m - z_j) / (1 + rest)``, with ``m`` the row's max, ``e_j = exp(z_j - m)`` and
    ``rest = sum_j e_j - 1`` summed without the max's own 1 (ties counted exactly), so a confident row keeps
    fp32's relative precision instead of cancelling ``lse - sum p z``."""
    row_max = z.max(dim=1, keepdim=True).values
    below = z < row_max
    e = torch.exp(z - row_max)
    ties = (~below).sum(dim=1).to(z.dtype)  # the max and its ties (NaN rows: propagate through row_max)
    rest = torch.where(below, e, 0.0).sum(dim=1) + (ties - 1.0)
    gap = torch.where(below & (e > 0), e * (row_max - z), 0.0).sum(dim=1)
    # ``0 * row_max``: a row with a NaN (or infinite) logit gives NaN, as its log-sum-exp does
    return torch.log1p(rest) + gap / (1.0 + rest) + 0.0 * row_max.squeeze(1)


def _torch_chunk_stats(
    raw,
    labels,
    transform,
    out: RowOutputs,
    grad_scale: torch.Tensor | None,
    target_raw: torch.Tensor | None,
    class_smoothing: ClassSmoothing | None = None,
) -> None:
    z, tanh = final_logits(raw, transform)
    vocab_size = z.shape[1]
    valid = labels != transform.ignore_index
    in_row = _label_in_row(labels, valid, vocab_size)
    safe_labels = torch.where(in_row, labels, 0).unsqueeze(1)
    lse = torch.logsumexp(z, dim=1)
    target_z = torch.where(in_row, z.gather(1, safe_labels).squeeze(1), 0.0)
    loss_lse, loss_target_z = lse, target_z
    if target_raw is not None:  # swap the rounded target logit for the fp32 one (see kernels.py)
        exact_z, _ = final_logits(target_raw, transform)
        row_max = z.max(dim=1).values
        exact_sum = (torch.exp(lse - row_max) - torch.exp(target_z - row_max)).clamp(min=0) + torch.exp(
            exact_z - row_max
        )
        loss_lse = torch.where(in_row, row_max + torch.log(exact_sum), lse)
        loss_target_z = torch.where(in_row, exact_z, target_z)
    loss = loss_lse - loss_target_z
    if out.mean_logit is not None or (transform.label_smoothing and class_smoothing is None):
        mean_z = z.mean(dim=1)
    # eps and the z-loss factor: the options' for every row, or each row's with class weights (ClassSmoothing)
    eps, z_loss = transform.label_smoothing, transform.z_loss
    if class_smoothing is not None:
        eps = class_smoothing.smoothing.to(z.dtype)
        z_loss = class_smoothing.z_loss.to(z.dtype) if transform.z_loss else 0.0
        weighted_z = torch.mv(z, class_smoothing.q.to(z.dtype))  # sum_v q_v z_v
        loss = loss_lse - (1.0 - eps) * loss_target_z - eps * weighted_z
    elif transform.label_smoothing:
        loss = loss_lse - (1.0 - eps) * loss_target_z - eps * mean_z
    if transform.z_loss:
        loss = loss + z_loss * loss_lse * loss_lse
    # >= 0 in exact arithmetic: clamp the rounding of the exact-target swap (a log-probability above 0); NaN stays
    out.loss.copy_(torch.where(valid, torch.where(loss < 0, 0.0, loss), 0.0))
    out.lse.copy_(lse)
    if out.entropy is not None:
        out.entropy.copy_(torch.where(valid, _entropy(z), 0.0))
    if out.is_top1 is not None or out.predicted is not None:
        predicted = z.argmax(dim=1)  # NaN is the max; the first index on ties
        if out.predicted is not None:
            out.predicted.copy_(predicted)
        if out.is_top1 is not None:
            out.is_top1.copy_((predicted == labels) & valid)
    if out.mean_logit is not None:
        out.mean_logit.copy_(torch.where(valid, mean_z, 0.0))
    if out.log_sum_sq is not None:  # log(sum p**2) = logsumexp(2z) - 2 lse, both of the buffer's logits; <= 0
        log_sum_sq = (torch.logsumexp(2.0 * z, dim=1) - 2.0 * lse).clamp(max=0.0)
        out.log_sum_sq.copy_(torch.where(valid, log_sum_sq, 0.0))
    if grad_scale is not None:
        grad = torch.exp(z - lse.unsqueeze(1))
        if transform.z_loss:
            grad.mul_((1.0 + 2.0 * z_loss * lse).unsqueeze(1))
        one_hot = in_row.to(grad.dtype) * -(1.0 - eps)
        grad.scatter_add_(1, safe_labels, one_hot.unsqueeze(1))
        if class_smoothing is not None:  # - eps_y * q_j
            grad.sub_(eps.unsqueeze(1) * class_smoothing.q.to(grad.dtype))
        elif transform.label_smoothing:
            grad.sub_(transform.label_smoothing / (transform.vocab_size or vocab_size))
        grad.mul_(torch.where(valid, grad_scale, 0.0).unsqueeze(1))
        raw.copy_(_raw_grad_factor(transform, tanh, grad))


def _torch_chunk_grad(raw, labels, transform, lse, entropy, grad_loss, grad_entropy) -> None:
    z, tanh = final_logits(raw, transform)
    valid = labels != transform.ignore_index
    p = torch.exp(z - lse.unsqueeze(1))
    grad = torch.zeros_like(z)
    if grad_loss is not None:
        row_grad = grad_loss.to(z.dtype).unsqueeze(1)
        p_scale = 1.0 + 2.0 * transform.z_loss * lse.unsqueeze(1) if transform.z_loss else 1.0
        grad += p * p_scale * row_grad
        in_row = _label_in_row(labels, valid, z.shape[1])
        safe_labels = torch.where(in_row, labels, 0).unsqueeze(1)
        grad.scatter_add_(1, safe_labels, -(1.0 - transform.label_smoothing) * row_grad * in_row.unsqueeze(1))
        if transform.label_smoothing:
            grad -= (transform.label_smoothing / (transform.vocab_size or z.shape[1])) * row_grad
    if grad_entropy is not None:
        grad -= p * (z - lse.unsqueeze(1) + entropy.unsqueeze(1)) * grad_entropy.to(z.dtype).unsqueeze(1)
    grad.mul_(valid.unsqueeze(1))
    raw.copy_(_raw_grad_factor(transform, tanh, grad))


# --------------------------------------------------------------------------- Triton launchers


def _kernel_scalars(transform: LogitTransform) -> dict:
    return {
        "ignore_index": transform.ignore_index,
        "logit_scale": float(transform.logit_scale),
        "softcap": float(transform.softcap or 1.0),
        "inv_temperature": 1.0 / float(transform.temperature),
        "label_smoothing": float(transform.label_smoothing),
        "z_loss": float(transform.z_loss),
        "HAS_SOFTCAP": transform.softcap is not None,
        "HAS_SMOOTHING": transform.label_smoothing != 0.0,
        "HAS_Z_LOSS": transform.z_loss != 0.0,
    }


def _fixed_max(transform: LogitTransform) -> float | None:
    """The bound softcap / temperature on |z| when the kernel takes exponentials against it, else None."""
    if transform.softcap is None:
        return None
    bound = transform.softcap / transform.temperature
    return bound if bound <= _FIXED_MAX_LIMIT else None


def unnormalized_grad_applies(transform: LogitTransform, dtype: torch.dtype, use_triton: bool) -> bool:
    """Whether ``chunk_stats`` can write the gradient in one pass as rows to be scaled (``row_factor``).

    Only the Triton kernel's bounded-exponent path (a softcap) does: there the exponentials need no
    running max, so the buffer can be overwritten while the row's sum is still being taken. Label
    smoothing and z-loss put the row's sum or lse inside every element, and fp16 lacks the range for
    values up to e^40: those keep the two-pass gradient."""
    return (
        use_triton
        and _fixed_max(transform) is not None
        and transform.label_smoothing == 0.0
        and transform.z_loss == 0.0
        and dtype in (torch.bfloat16, torch.float32)
    )


def _triton_chunk_stats(
    raw,
    labels,
    transform,
    out: RowOutputs,
    grad_scale: torch.Tensor | None,
    target_raw: torch.Tensor | None,
    row_factor: torch.Tensor | None,
    class_smoothing: ClassSmoothing | None = None,
    shard_target: torch.Tensor | None = None,
) -> None:
    rows, vocab_size = raw.shape
    placeholder = out.loss
    want_log_sum_sq = out.log_sum_sq is not None
    fixed_max = _fixed_max(transform)
    # The sum of squared exponentials against the bound could underflow (e^(2 (z - bound)) for logits far below
    # it), and the entropy's sums are taken below the row's max: with either the kernel keeps its running max,
    # which the one-pass gradient cannot do without.
    use_fixed_max = fixed_max is not None and not want_log_sum_sq and out.entropy is None
    unnormalized = row_factor is not None
    if unnormalized and not (grad_scale is not None and unnormalized_grad_applies(transform, raw.dtype, True)):
        raise ValueError("chunk_stats: row_factor needs grad_scale and a case unnormalized_grad_applies to")
    if unnormalized and (want_log_sum_sq or out.entropy is not None):
        # both need the running max; the one-pass gradient is written on the bounded-exponent path only
        raise ValueError("chunk_stats: row_factor cannot be combined with log_sum_sq or the entropy")
    block_v = min(_BLOCK_V_STATS, next_power_of_2(vocab_size))
    lane_group = 1 if use_fixed_max and grad_scale is not None else min(_LANE_GROUP, block_v)
    argmax = out.predicted is not None or out.is_top1 is not None  # is_top1 reads the argmax
    _kernels.stats_kernel[(rows,)](
        raw,
        raw.stride(0),
        labels,
        out.loss,
        out.lse,
        out.entropy if out.entropy is not None else placeholder,
        out.is_top1 if out.is_top1 is not None else placeholder,
        out.mean_logit if out.mean_logit is not None else placeholder,
        out.log_sum_sq if want_log_sum_sq else placeholder,
        out.predicted if out.predicted is not None else placeholder,
        grad_scale if grad_scale is not None else placeholder,
        target_raw if target_raw is not None else placeholder,
        row_factor if unnormalized else placeholder,
        class_smoothing.q if class_smoothing is not None else placeholder,
        class_smoothing.smoothing if class_smoothing is not None else placeholder,
        class_smoothing.z_loss if class_smoothing is not None else placeholder,
        shard_target if shard_target is not None else placeholder,
        vocab_size,
        fixed_max=fixed_max if use_fixed_max else 0.0,
        HAS_EXACT_TARGET=target_raw is not None,
        FIXED_MAX=use_fixed_max,
        WANT_ENTROPY=out.entropy is not None,
        WANT_TOP1=out.is_top1 is not None,
        WANT_MEAN_LOGIT=out.mean_logit is not None,
        WANT_LOG_SUM_SQ=want_log_sum_sq,
        WANT_ARGMAX=out.predicted is not None,
        WRITE_GRAD=grad_scale is not None,
        UNNORMALIZED_GRAD=unnormalized,
        PER_ROW_SCALE=grad_scale is not None and grad_scale.dim() == 1,
        WEIGHTED_SMOOTHING=class_smoothing is not None,
        SHARD_PACK=shard_target is not None,
        BLOCK_V=block_v,
        LANE_GROUP=lane_group,
        MAX_REGROUP=_MAX_REGROUP if argmax and lane_group == 1 and block_v >= _MAX_REGROUP else 1,
        num_warps=_STATS_NUM_WARPS,
        **_kernel_scalars(transform),
    )


def _triton_chunk_grad(raw, labels, transform, lse, entropy, grad_loss, grad_entropy) -> None:
    rows, vocab_size = raw.shape
    block_v = min(_BLOCK_V_GRAD, next_power_of_2(vocab_size))
    grid = (rows, cdiv(vocab_size, block_v))
    _kernels.grad_kernel[grid](
        raw,
        raw.stride(0),
        labels,
        lse,
        entropy if entropy is not None else lse,
        grad_loss if grad_loss is not None else lse,
        grad_loss.stride(0) if grad_loss is not None else 0,
        grad_entropy if grad_entropy is not None else lse,
        vocab_size,
        transform.vocab_size or vocab_size,
        HAS_LOSS_GRAD=grad_loss is not None,
        HAS_ENTROPY_GRAD=grad_entropy is not None,
        BLOCK_V=block_v,
        num_warps=8,
        **_kernel_scalars(transform),
    )


# --------------------------------------------------------------------------- dispatch


def chunk_stats(
    raw: torch.Tensor,
    labels: torch.Tensor,
    transform: LogitTransform,
    out: RowOutputs,
    grad_scale: torch.Tensor | None,
    use_triton: bool,
    target_raw: torch.Tensor | None = None,
    row_factor: torch.Tensor | None = None,
    class_smoothing: ClassSmoothing | None = None,
    shard_target: torch.Tensor | None = None,
) -> None:
    """Fill ``out`` for the rows of ``raw`` [C, V]. With ``grad_scale`` (fp32, 0-d: the reduction factor; or
    [C]: each row's, token or class weights times it), overwrite ``raw`` in place with grad_scale * d(loss_row)/d(raw), zero for
    ignored rows; with ``row_factor`` too (fp32 [C], Triton only, where
    :func:`unnormalized_grad_applies`), in one pass instead of two: ``raw`` then holds that gradient
    divided row by row by ``row_factor``, which the kernel fills. ``target_raw`` (fp32 [C], from
    :func:`target_logits`) replaces the buffer's rounded target logit in the loss (not in the gradient).
    A row whose valid label lies outside [0, V) (a vocabulary shard's row) gets a target logit of 0.
    ``class_smoothing`` (with ``transform.label_smoothing``): the class-weighted smoothing of the chunk's rows
    (:class:`ClassSmoothing`), whose per-row ``eps_y`` and ``zl_y`` replace the transform's ``label_smoothing``
    and ``z_loss``; the row's factor ``f`` is then in ``grad_scale`` (and applied to the loss by the caller).
    ``shard_target`` (fp32 [C], Triton only, with ``target_raw`` and without ``grad_scale``): the rows a vocabulary
    shard exchanges (vocab_parallel.py) in the same launch: ``out.loss`` then receives the local lse with the exact
    target logit swapped in, ``shard_target`` the target's final logit where the shard owns the label (0
    elsewhere), and ``out.mean_logit`` the sum of the shard's final logits instead of their mean."""
    if shard_target is not None and (not use_triton or target_raw is None or grad_scale is not None):
        raise ValueError("chunk_stats: shard_target is a Triton-only option that needs target_raw, not grad_scale")
    if transform.vocab_size is not None and transform.label_smoothing:
        raise ValueError(
            "chunk_stats: a vocabulary shard's smoothed loss is assembled across shards (vocab_parallel.py)"
        )
    if class_smoothing is not None and not transform.label_smoothing:
        raise ValueError("chunk_stats: class_smoothing needs label_smoothing")
    if use_triton:
        _triton_chunk_stats(
            raw, labels, transform, out, grad_scale, target_raw, row_factor, class_smoothing, shard_target
        )
    else:
        if row_factor is not None:
            raise ValueError("chunk_stats: row_factor is a Triton-only option")
        _torch_chunk_stats(raw, labels, transform, out, grad_scale, target_raw, class_smoothing)


def target_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    use_triton: bool,
    row_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 (fp64 for fp64) ``hidden[i] . weight[labels[i]] (+ bias)`` for every row i [N], or for the rows of
    ``row_index`` [M]; 0 where the label is outside [0, V) (ignored rows). 2*N*D FLOPs and N weight
    rows read: negligible next to the GEMMs."""
    hidden_size = hidden.shape[1]
    num_rows = hidden.shape[0] if row_index is None else row_index.shape[0]
    vocab_size = weight.shape[0]
    out = torch.empty(num_rows, dtype=stats_dtype(hidden.dtype), device=hidden.device)
    if num_rows == 0:
        return out
    if use_triton:
        _kernels.target_logit_kernel[(num_rows,)](
            hidden,
            hidden.stride(0),
            hidden.stride(1),
            weight,
            weight.stride(0),
            weight.stride(1),
            bias if bias is not None else out,
            bias.stride(0) if bias is not None else 0,
            labels,
            labels.stride(0),
            row_index if row_index is not None else labels,
            out,
            hidden_size,
            vocab_size,
            HAS_BIAS=bias is not None,
            GATHER_ROWS=row_index is not None,
            BLOCK_D=min(1024, next_power_of_2(hidden_size)),
        )
        return out
    if row_index is not None:
        hidden, labels = hidden.index_select(0, row_index), labels.index_select(0, row_index)
    in_range = (labels >= 0) & (labels < vocab_size)
    safe_labels = torch.where(in_range, labels, 0)
    # A row-wise dot product in fp32, a few thousand rows at a time to bound the fp32 copies.
    for start in range(0, num_rows, 4096):
        stop = min(start + 4096, num_rows)
        rows_weight = weight[safe_labels[start:stop]].to(out.dtype)
        value = (hidden[start:stop].to(out.dtype) * rows_weight).sum(dim=1)
        if bias is not None:
            value += bias[safe_labels[start:stop]].to(out.dtype)
        out[start:stop] = torch.where(in_range[start:stop], value, 0.0)
    return out


def chunk_grad(
    raw: torch.Tensor,
    labels: torch.Tensor,
    transform: LogitTransform,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_loss: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    use_triton: bool,
) -> None:
    """Overwrite ``raw`` [C, V] with grad_loss * dloss/draw + grad_entropy * dH/draw, row by row
    (``grad_loss``, ``grad_entropy``: fp32 [C] upstream gradients; ``grad_entropy`` contiguous, ``grad_loss`` any
    stride, so a 0-d factor expanded to [C] serves every row without a copy)."""
    if use_triton:
        _triton_chunk_grad(raw, labels, transform, lse, entropy, grad_loss, grad_entropy)
    else:
        _torch_chunk_grad(raw, labels, transform, lse, entropy, grad_loss, grad_entropy)
