"""The unfused reference: the student's full logits, its log-softmax gathered at the candidates, then the loss
in plain differentiable torch (autograd gives the gradients). Tests run it in float64.

Its semantics were checked against the libraries the op reproduces, in float64 on the same inputs: TRL 1.16's
``_chunked_jsd_loss`` (async distillation; imported in the tests) for every beta, tail setting, softcap, scale,
bias and padded slots; axolotl 0.19's top-K ``forward_kl.loss`` (``renormalize=False``; its mean over the kept
(position, candidate) pairs is ``num_items_in_batch=mask.sum()``) and its Liger loss's distillation term
(``kd_normalize_topk``, ``kd_beta``), run in axolotl's own environment (the tests do it where one is found).
"""

from __future__ import annotations

import torch

from ..core.naive import naive_logits

# TRL's _add_tail_bucket: the candidates' log-mass is clamped to at most this before log(1 - mass)
_TAIL_LOG_MASS_MAX = -1e-7


def with_tail_bucket(log_probs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] log-probabilities and their mask with a (K+1)-th bucket: the log of the mass outside the kept
    candidates (TRL's ``_add_tail_bucket``, its clamp included), always kept."""
    log_mass = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=_TAIL_LOG_MASS_MAX)
    tail = torch.log(-torch.expm1(log_mass))
    return torch.cat([log_probs, tail], dim=-1), torch.cat([mask, torch.ones_like(mask[..., :1])], dim=-1)


def sparse_token_divergence(a: torch.Tensor, b: torch.Tensor, support: torch.Tensor, beta: float) -> torch.Tensor:
    """[...] divergence over the support of log-probabilities ``a`` (student) and ``b`` (teacher), [..., S]:
    beta 0 KL(b ‖ a), 1 KL(a ‖ b), else the generalized JSD through ``(1 - beta) e^a + beta e^b`` (its log
    clamped at the dtype's tiny, as TRL)."""
    zero = torch.zeros((), dtype=a.dtype)
    a, b = torch.where(support, a, zero), torch.where(support, b, zero)
    p, q = torch.where(support, a.exp(), zero), torch.where(support, b.exp(), zero)
    if beta == 0:
        terms = q * (b - a)
    elif beta == 1:
        terms = p * (a - b)
    else:
        log_mixture = torch.log(((1 - beta) * p + beta * q).clamp_min(torch.finfo(a.dtype).tiny))
        terms = beta * q * (b - log_mixture) + (1 - beta) * p * (a - log_mixture)
    return torch.where(support, terms, zero).sum(-1)


def naive_linear_sparse_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    candidate_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    candidate_mask: torch.Tensor | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    add_tail_bucket: bool = False,
    renormalize: bool = True,
    reduction: str = "mean",
    num_items_in_batch: float | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-token student entropy [...]) with the student's full logits; the arguments as the fused op's."""
    logits = naive_logits(hidden, weight, bias, softcap=softcap, logit_scale=logit_scale, temperature=temperature)
    log_probs = logits.log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    mask = torch.ones_like(candidate_ids, dtype=torch.bool) if candidate_mask is None else candidate_mask != 0
    ids = torch.where(mask, candidate_ids, torch.zeros_like(candidate_ids)).long()
    neg_inf = torch.tensor(float("-inf"), dtype=log_probs.dtype)
    student = torch.where(mask, log_probs.gather(-1, ids), neg_inf)
    teacher = torch.where(mask, teacher_logprobs.detach().to(log_probs.dtype), neg_inf)
    has_candidate = mask.any(-1)
    if add_tail_bucket:
        a, support = with_tail_bucket(student, mask)
        b, _ = with_tail_bucket(teacher, mask)
    elif renormalize:
        # rows without a candidate: -inf - -inf; replaced below, and their gradient is kept out of the graph
        safe = has_candidate[..., None]
        a = torch.where(safe, student, 0.0) - torch.where(safe, student, 0.0).logsumexp(-1, keepdim=True)
        b = torch.where(safe, teacher, 0.0) - torch.where(safe, teacher, 0.0).logsumexp(-1, keepdim=True)
        a, b, support = torch.where(mask, a, neg_inf), torch.where(mask, b, neg_inf), mask
    else:
        a, b, support = student, teacher, mask
    per_token = sparse_token_divergence(a, b, support, beta)
    per_token = torch.where(has_candidate, per_token, torch.zeros((), dtype=per_token.dtype))
    if reduction == "none":
        return per_token, entropy
    total = per_token.sum()
    if num_items_in_batch is not None:
        return total / num_items_in_batch, entropy
    if reduction == "sum":
        return total, entropy
    return total / has_candidate.sum().clamp(min=1), entropy
