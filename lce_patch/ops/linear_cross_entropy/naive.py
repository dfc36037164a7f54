"""The unfused reference: materialize the logits, then ``torch.nn.functional.cross_entropy``.

This is what the fused op must equal. Tests run it in float64; benchmarks run it in the input
dtype as the "unfused Hugging Face path".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.naive import naive_logits


def naive_linear_cross_entropy(
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
) -> torch.Tensor:
    """Same contract as ``fused_linear_cross_entropy``, computed the obvious way (N x V logits)."""
    logits = naive_logits(hidden, weight, bias, softcap=softcap, logit_scale=logit_scale)
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    losses = F.cross_entropy(
        logits, labels, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = labels != ignore_index
    if z_loss:
        lse = torch.logsumexp(logits, dim=-1)
        losses = losses + torch.where(valid, z_loss * lse * lse, 0.0)
    if num_items_in_batch is not None:
        return losses.sum() / num_items_in_batch
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / valid.sum().clamp(min=1)
    return losses.view(hidden.shape[:-1])


def _distribution(hidden, weight, bias, labels, ignore_index, softcap, logit_scale, temperature):
    """(final logits, their log-softmax, valid-label mask) of the per-token references."""
    logits = naive_logits(hidden, weight, bias, softcap=softcap, logit_scale=logit_scale, temperature=temperature)
    return logits, torch.log_softmax(logits, dim=-1), labels != ignore_index


def naive_token_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference (log_probs, entropy, is_top1), each shaped like labels, zero/False where ignored."""
    logits, log_p, valid = _distribution(hidden, weight, bias, labels, ignore_index, softcap, logit_scale, temperature)
    safe = torch.where(valid, labels, 0)
    log_probs = torch.where(valid, log_p.gather(-1, safe.unsqueeze(-1)).squeeze(-1), 0.0)
    entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    is_top1 = (logits.argmax(-1) == labels) & valid
    return log_probs, entropy, is_top1


def naive_distribution_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (mean_logits, log_sum_sq_probs): the mean final logit and log(sum_v p_v**2), 0 where ignored."""
    logits, log_p, valid = _distribution(hidden, weight, bias, labels, ignore_index, softcap, logit_scale, temperature)
    mean_logits = torch.where(valid, logits.mean(-1), 0.0)
    log_sum_sq_probs = torch.where(valid, torch.logsumexp(2.0 * log_p, dim=-1), 0.0)
    return mean_logits, log_sum_sq_probs
