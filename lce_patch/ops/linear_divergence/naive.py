"""The unfused reference: both models' logits in full, then the divergence as TRL's ``generalized_jsd_loss``.

This is what ``fused_linear_divergence`` must equal; tests run it in float64. Per token, over the vocabulary,
with ``s`` / ``t`` the student's / teacher's log-probabilities at ``temperature``:

* ``beta == 0``: forward KL, KL(teacher ‖ student) = sum exp(t) (t - s);
* ``beta == 1``: reverse KL, KL(student ‖ teacher) = sum exp(s) (s - t);
* otherwise the generalized Jensen-Shannon divergence through the mixture
  ``m = log((1 - beta) exp(s) + beta exp(t))``: ``beta * KL(teacher ‖ m) + (1 - beta) * KL(student ‖ m)``.
"""

from __future__ import annotations

import torch

from ..core.naive import naive_logits


def token_divergence(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """[...] per-token divergence from [..., V] log-probabilities (``beta`` as in the module note)."""
    s, t = student_log_probs, teacher_log_probs
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    mixture = torch.logaddexp(
        s + torch.log1p(torch.tensor(-beta, dtype=s.dtype)), t + torch.log(torch.tensor(beta, dtype=s.dtype))
    )
    return beta * (t.exp() * (t - mixture)).sum(-1) + (1 - beta) * (s.exp() * (s - mixture)).sum(-1)


def naive_linear_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "mean",
    num_items_in_batch: float | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-token student entropy [...]) with the full logits of both models.

    The teacher's rows beyond the student's vocabulary (a padded teacher vocabulary) are left out.
    """
    vocab = weight.shape[0]
    student = naive_logits(hidden, weight, bias, softcap=softcap, logit_scale=logit_scale, temperature=temperature)
    teacher = naive_logits(
        teacher_hidden.detach(),
        teacher_weight[:vocab].detach(),
        None if teacher_bias is None else teacher_bias[:vocab].detach(),
        softcap=teacher_softcap,
        logit_scale=teacher_logit_scale,
        temperature=temperature,
    ).to(student.dtype)
    s, t = student.log_softmax(-1), teacher.log_softmax(-1)
    per_token = token_divergence(s, t, beta)
    entropy = -(s.exp() * s).sum(-1)
    selected = torch.ones_like(per_token, dtype=torch.bool) if mask is None else mask.bool()
    per_token = torch.where(selected, per_token, torch.zeros_like(per_token))
    if reduction == "none":
        return per_token, entropy
    total = per_token.sum()
    if num_items_in_batch is not None:
        return total / num_items_in_batch, entropy
    if reduction == "sum":
        return total, entropy
    return total / selected.sum().clamp(min=1), entropy
