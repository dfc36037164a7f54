"""The chunked autograd Function of ``fused_linear_divergence`` (the torch backend).

Tokens are processed ``chunk_rows`` at a time. For each chunk the student's logits ``hidden_c @ W.T`` and the
teacher's ``teacher_hidden_c @ W_t.T`` are two GEMMs into ``[chunk_rows, V]`` buffers, upcast to at least fp32;
the final logits (logit scale, softcap, temperature) give both log-softmaxes, the per-token divergence and the
student's entropy, and, when gradients are needed, the divergence's gradient with respect to the student's
raw logits ``G`` (below); two more GEMMs give ``dh_c = G @ W`` and ``dW += G.T @ hidden_c`` (fp32 accumulator).

The gradient of the per-token divergence ``D`` with respect to the student's final logits ``z`` (``s``, ``t``:
log-probabilities, ``p = exp(s)``, ``q = exp(t)``):

* beta 0, KL(teacher ‖ student): ``p - q``;
* beta 1, KL(student ‖ teacher): ``p * (s - t - D)``;
* otherwise, with the mixture ``m``: ``dD/dp = (1 - beta) (s - m)`` (the teacher's term contributes
  ``-beta q (1 - beta) / exp(m)``, which cancels against the student's), so ``p * (a - sum(p * a))`` with
  ``a = (1 - beta) (s - m)``.

Then through the temperature (``/ T``), the softcap (``1 - tanh^2``) and the logit scale. No gradient reaches
the teacher. Two schedules, as for the cross-entropy op: a scalar loss gets its gradient during the forward,
already scaled by the reduction (the backward multiplies by the upstream gradient); ``reduction="none"``
recomputes each chunk in the backward with the per-token upstream gradients.

Rows outside ``mask`` are computed and weighted by 0 (no host sync to count them). Memory above the inputs
and gradients: about six ``[chunk_rows, V]`` fp32 temporaries and the fp32 dW accumulator. FLOPs: 2·N·V·D_t
(teacher) + 6·N·V·D (student logits, dh, dW).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_LOGITS_BUDGET_BYTES = 256 * 1024 * 1024  # one [chunk_rows, V] fp32 buffer


@dataclass(frozen=True)
class DivergenceOptions:
    beta: float
    temperature: float
    softcap: float | None
    teacher_softcap: float | None
    logit_scale: float
    teacher_logit_scale: float
    chunk_rows: int


def default_chunk_rows(num_rows: int, vocab: int) -> int:
    return max(1, min(num_rows, DEFAULT_LOGITS_BUDGET_BYTES // (4 * vocab)))


def _final_logits(raw: torch.Tensor, scale: float, softcap: float | None, temperature: float):
    """(final logits, tanh of the softcap or None) from ``raw`` = hidden @ W.T (+ bias), upcast."""
    scaled = raw * scale if scale != 1.0 else raw
    if softcap is None:
        return scaled / temperature, None
    tanh = torch.tanh(scaled / softcap)
    return softcap * tanh / temperature, tanh


def _project(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    raw = hidden @ weight.T
    if bias is not None:
        raw = raw + bias
    return raw.to(dtype)


def chunk_pass(
    hidden_c: torch.Tensor,
    teacher_hidden_c: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    options: DivergenceOptions,
    row_coeff: torch.Tensor | None,
):
    """(per-token divergence, per-token student entropy, G or None) for one chunk of rows.

    ``row_coeff`` [C]: the upstream gradient of each row's divergence (None: no gradient). G is the
    gradient with respect to the student's raw logits ``hidden @ W.T + bias``, in the compute dtype.
    """
    dtype = torch.promote_types(weight.dtype, torch.float32)
    z, tanh = _final_logits(
        _project(hidden_c, weight, bias, dtype), options.logit_scale, options.softcap, options.temperature
    )
    with torch.no_grad():
        zt, _ = _final_logits(
            _project(teacher_hidden_c, teacher_weight, teacher_bias, dtype),
            options.teacher_logit_scale,
            options.teacher_softcap,
            options.temperature,
        )
    s = torch.log_softmax(z, dim=-1)
    t = torch.log_softmax(zt, dim=-1)
    del z, zt
    p = s.exp()
    entropy = -(p * s).sum(-1)
    beta = options.beta
    if beta == 0:
        q = t.exp()
        divergence = (q * (t - s)).sum(-1)
        grad = (p - q) if row_coeff is not None else None
    elif beta == 1:
        diff = s - t
        divergence = (p * diff).sum(-1)
        grad = p * (diff - divergence[:, None]) if row_coeff is not None else None
    else:
        mixture = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        divergence = beta * (t.exp() * (t - mixture)).sum(-1) + (1 - beta) * (p * (s - mixture)).sum(-1)
        if row_coeff is not None:
            a = (1 - beta) * (s - mixture)
            grad = p * (a - (p * a).sum(-1, keepdim=True))
        else:
            grad = None
    if grad is not None:
        factor = row_coeff.to(dtype) * (options.logit_scale / options.temperature)
        if tanh is not None:
            grad = grad * (1 - tanh * tanh)
        # a row outside the mask (factor 0) contributes an exact 0 to G, even where its softmax is not finite
        grad = torch.where(
            factor[:, None] != 0, grad * factor[:, None], torch.zeros((), dtype=dtype, device=grad.device)
        )
    return divergence, entropy, grad


class _Grads:
    """dh, dW (fp32 accumulator) and dbias of the student, filled chunk by chunk."""

    def __init__(self, hidden, weight, bias, needs):
        self.needs_hidden, self.needs_weight, self.needs_bias = needs
        self.dh = torch.empty_like(hidden) if self.needs_hidden else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        self.dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if self.needs_weight else None
        self.db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if self.needs_bias else None
        self.weight = weight

    def add(self, start: int, end: int, grad: torch.Tensor, hidden_c: torch.Tensor) -> None:
        low = grad.to(self.weight.dtype)
        if self.dh is not None:
            self.dh[start:end] = low @ self.weight
        if self.dw is not None:
            self.dw += (low.T @ hidden_c).to(self.dw.dtype)
        if self.db is not None:
            self.db += grad.sum(0).to(self.db.dtype)

    def results(self, weight_dtype, bias_dtype):
        dw = None if self.dw is None else self.dw.to(weight_dtype)
        db = None if self.db is None else self.db.to(bias_dtype)
        return self.dh, dw, db


def _spans(num_rows: int, chunk_rows: int):
    return [(start, min(start + chunk_rows, num_rows)) for start in range(0, num_rows, chunk_rows)]


def run_chunks(hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias, options, row_coeff, needs):
    """Per-token divergence and entropy [N] (fp32 or wider), and the gradients when ``row_coeff`` is given."""
    num_rows = hidden.shape[0]
    dtype = torch.promote_types(weight.dtype, torch.float32)
    divergence = torch.empty(num_rows, dtype=dtype, device=hidden.device)
    entropy = torch.empty(num_rows, dtype=dtype, device=hidden.device)
    grads = _Grads(hidden, weight, bias, needs) if row_coeff is not None else None
    for start, end in _spans(num_rows, options.chunk_rows):
        hidden_c = hidden[start:end]
        coeff = None if row_coeff is None else row_coeff[start:end]
        div_c, ent_c, grad = chunk_pass(
            hidden_c, teacher_hidden[start:end], weight, bias, teacher_weight, teacher_bias, options, coeff
        )
        divergence[start:end] = div_c
        entropy[start:end] = ent_c
        if grads is not None:
            grads.add(start, end, grad, hidden_c)
    return divergence, entropy, grads


class LinearDivergenceFunction(torch.autograd.Function):
    """Inputs are 2-D ([N, D], [N, D_t]); ``row_weight`` [N] is 1 for selected rows and 0 elsewhere;
    ``scale`` a 0-d tensor (scalar loss: sum of selected divergences times ``scale``) or None (per token)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, scale, options):
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        ctx.options, ctx.needs = options, needs
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        if scale is not None and any(needs):
            coeff = row_weight * scale
            divergence, entropy, grads = run_chunks(
                hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias, options, coeff, needs
            )
            ctx.save_for_backward(*[g for g in grads.results(*ctx.dtypes) if g is not None])
            ctx.schedule = "scalar"
        else:
            with torch.no_grad():
                divergence, entropy, _ = run_chunks(
                    hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias, options, None, needs
                )
            ctx.save_for_backward(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight)
            ctx.schedule = "recompute"
        divergence = torch.where(
            row_weight != 0, divergence, torch.zeros((), dtype=divergence.dtype, device=divergence.device)
        )
        out = divergence.sum() * scale if scale is not None else divergence
        ctx.mark_non_differentiable(entropy)
        return out.float() if out.dtype != torch.float64 else out, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_entropy):
        needs = ctx.needs
        if ctx.schedule == "scalar":
            saved = iter(ctx.saved_tensors)
            dh, dw, db = (next(saved) if need else None for need in needs)
            grads = [g * grad_out.to(g.dtype) if g is not None else None for g in (dh, dw, db)]
            return grads[0], grads[1], grads[2], None, None, None, None, None, None
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight = ctx.saved_tensors
        coeff = grad_out.to(row_weight.dtype) * row_weight
        _, _, grads = run_chunks(
            hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias, ctx.options, coeff, needs
        )
        dh, dw, db = grads.results(*ctx.dtypes)
        return dh, dw, db, None, None, None, None, None, None
