"""Per-chunk row operations, in two interchangeable implementations.

``chunk_stats`` turns a ``[C, V]`` buffer of raw logits (the GEMM output) into per-row loss,
log-sum-exp and optional side outputs, and can overwrite the buffer with the logits gradient.
``chunk_grad`` overwrites a recomputed buffer with the gradient of per-row outputs given their
upstream gradients. The Triton launchers (``launchers.py``) run the kernels of ``kernels.py``; the torch versions
compute the same thing with fp32 tensor ops and serve every device without Triton, and act as
the readable reference for the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.backend import stats_dtype
from ..core.transform import LogitTransform
from .launchers import launch_chunk_grad, launch_chunk_stats, launch_target_logits


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
    :func:`.launchers.unnormalized_grad_applies`), in one pass instead of two: ``raw`` then holds that gradient
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
        launch_chunk_stats(
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
    num_rows = hidden.shape[0] if row_index is None else row_index.shape[0]
    vocab_size = weight.shape[0]
    out = torch.empty(num_rows, dtype=stats_dtype(hidden.dtype), device=hidden.device)
    if num_rows == 0:
        return out
    if use_triton:
        launch_target_logits(hidden, weight, bias, labels, row_index, out)
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
        launch_chunk_grad(raw, labels, transform, lse, entropy, grad_loss, grad_entropy)
    else:
        _torch_chunk_grad(raw, labels, transform, lse, entropy, grad_loss, grad_entropy)
