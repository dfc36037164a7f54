"""The small ``[C, K]`` part of a chunk: the per-token divergence over the candidates and its gradient with
respect to the student's full-vocabulary log-probabilities at the candidates, in explicit formulas (no autograd).

Inputs per row: ``s_k`` the student's log-softmax over the whole vocabulary at candidate ``k``, ``t_k`` the
teacher's log-probability there, ``M`` the candidates that count (the mask). The two distributions compared
(``a`` the student's, ``b`` the teacher's, over the support) are, as in TRL's ``_jsd_loss_chunk``:

* tail bucket: the K log-probabilities over ``M`` and a (K+1)-th ``log(1 - exp(min(lse_M, -1e-7)))`` each;
* renormalized: ``a = s - lse_M(s)``, ``b = t - lse_M(t)``;
* as given (``renormalize=False``): ``a = s``, ``b = t``.

The divergence is TRL's ``_jsd_divergence`` summed over the support (``P = exp(a)``, ``Q = exp(b)``): beta 0
``sum Q (b - a)``, beta 1 ``sum P (a - b)``, otherwise ``beta sum Q (b - m) + (1 - beta) sum P (a - m)`` with
``m = log(max((1 - beta) P + beta Q, tiny))``. Its derivatives with respect to ``a`` (each ``a_k`` free):
``-Q``; ``P (a - b + 1)``; ``(1 - beta) P (a - m + [mixture clamped])``. Then through the support's map:
renormalized ``g = dD/da - pi * sum(dD/da)`` (``pi = exp(a)`` over ``M``); tail ``g_k = dD/da_k - dD/da_tail *
exp(s_k - tail)`` while the clamp is not active (its derivative is 0 where it is, as ``torch.clamp``'s).
"""

from __future__ import annotations

import torch

from .options import TAIL_LOG_MASS_MAX, SparseDivergenceOptions


def _zero_outside(mask: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, value, torch.zeros((), dtype=value.dtype, device=value.device))


def _tail(log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tail log-probability [C, 1], the candidates' log-mass before the clamp [C, 1], whether the clamp lets
    the gradient through [C, 1]) from masked log-probabilities (-inf outside the mask)."""
    log_mass = torch.logsumexp(log_probs, dim=-1, keepdim=True)
    tail = torch.log(-torch.expm1(log_mass.clamp(max=TAIL_LOG_MASS_MAX)))
    return tail, log_mass, log_mass <= TAIL_LOG_MASS_MAX


def sparse_divergence(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    options: SparseDivergenceOptions,
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(divergence [C], g [C, K] or None): ``student`` [C, K] the student's full-vocabulary log-probabilities at
    the candidates, ``teacher`` [C, K] the teacher's, ``mask`` [C, K] bool; all in one float dtype. ``g`` is the
    gradient of each row's divergence with respect to ``student``, 0 outside the mask; a row without a candidate
    has divergence 0 and gradient 0."""
    neg_inf = torch.full((), float("-inf"), dtype=student.dtype, device=student.device)
    s = torch.where(mask, student, neg_inf)
    t = torch.where(mask, teacher, neg_inf)
    if options.add_tail_bucket:
        tail_s, _mass_s, passes = _tail(s)
        tail_t, _mass_t, _ = _tail(t)
        a, b = torch.cat([s, tail_s], dim=-1), torch.cat([t, tail_t], dim=-1)
        support = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    elif options.renormalize:
        a = s - torch.logsumexp(s, dim=-1, keepdim=True)
        b = t - torch.logsumexp(t, dim=-1, keepdim=True)
        support = mask
    else:
        a, b, support = s, t, mask
    # 0 outside the support (TRL's safe_* tensors): no -inf - -inf there
    a, b = _zero_outside(support, a), _zero_outside(support, b)
    p, q = _zero_outside(support, a.exp()), _zero_outside(support, b.exp())
    beta = options.beta
    if beta == 0:
        terms = q * (b - a)
        grad_a = -q if want_grad else None
    elif beta == 1:
        terms = p * (a - b)
        grad_a = p * (a - b + 1) if want_grad else None
    else:
        tiny = torch.finfo(p.dtype).tiny
        mixture = (1 - beta) * p + beta * q
        log_mixture = torch.log(mixture.clamp_min(tiny))
        terms = beta * q * (b - log_mixture) + (1 - beta) * p * (a - log_mixture)
        grad_a = (1 - beta) * p * (a - log_mixture + (mixture < tiny).to(p.dtype)) if want_grad else None
    has_candidate = mask.any(dim=-1)
    divergence = _zero_outside(has_candidate, _zero_outside(support, terms).sum(-1))
    if not want_grad:
        return divergence, None
    grad_a = _zero_outside(support, grad_a)
    if options.add_tail_bucket:
        k = student.shape[-1]
        through_tail = _zero_outside(passes, grad_a[:, k:]) * (s - tail_s).exp()
        grad = grad_a[:, :k] - through_tail
    elif options.renormalize:
        grad = grad_a - p * grad_a.sum(-1, keepdim=True)
    else:
        grad = grad_a
    return divergence, _zero_outside(mask & has_candidate[:, None], grad)
