"""TRL's experimental ``AsyncDistillationTrainer`` served by :func:`lce_patch.fused_linear_sparse_divergence`
(distillation from a teacher's top-K).

``AsyncDistillationTrainer._compute_loss`` (TRL 1.16) runs the student's backbone, keeps the completion positions
with teacher signal and calls the module function ``_chunked_jsd_loss(hidden_valid, lm_head_weight, lm_head_bias,
logit_scale, final_logit_softcapping, target_ids, teacher_target_logps, valid_candidate_mask, beta, temperature,
add_tail_bucket, teacher_id_idx, num_teachers, chunk_size)``, which projects chunks of positions through the head
(``torch.utils.checkpoint``: the logits are computed twice) and returns the summed divergence and the sums TRL logs
(the divergence, the student's and the teacher's entropy, per-teacher statistics). :func:`serve` wraps
``_compute_loss`` on one trainer instance; while that call runs (in that thread) the function answers through the op
with the same arguments and results. The module function is looked up as a global by TRL's method, so it is
replaced once by a dispatcher that runs TRL's own function for every other call (other trainers, other threads); the
dispatcher goes with the last served trainer (:func:`unserve`).

Detection is by feature: the trainer must derive from TRL's class, ``_compute_loss`` must call the function and the
function have the parameters of TRL 1.16, else :class:`~lce_patch.integrations.trl.protocol.TRLProtocolError`; a
subclass that overrides ``_compute_loss`` keeps TRL's path, with a warning.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch

from ...ops import fused_linear_sparse_divergence
from ..serving import Row
from ..shared import code_names, divergence_options, function, overridden
from .protocol import trainer_protocol_error
from .redirect import FunctionRedirect

__all__ = ["serve", "unserve"]

_ASYNC_FUNCTION = "_chunked_jsd_loss"  # the trainer's module's function its loss calls
_ASYNC_PARAMETERS = (
    "hidden_valid",
    "lm_head_weight",
    "lm_head_bias",
    "logit_scale",
    "final_logit_softcapping",
    "target_ids",
    "teacher_target_logps",
    "valid_candidate_mask",
    "beta",
    "temperature",
    "add_tail_bucket",
    "teacher_id_idx",
    "num_teachers",
    "chunk_size",
)


def _teacher_entropy(teacher_logps: torch.Tensor, mask: torch.Tensor, add_tail_bucket: bool) -> torch.Tensor:
    """Per position ([..., K] -> [...], float32 in, float32 out), the entropy of the teacher over the support TRL
    compares: its top-K log-probabilities where ``mask`` (bool, [..., K]), renormalized or with the tail bucket."""
    neg_inf = torch.full((), float("-inf"), dtype=teacher_logps.dtype, device=teacher_logps.device)
    support = torch.where(mask, teacher_logps, neg_inf)
    if add_tail_bucket:
        log_sum = torch.logsumexp(support, dim=-1, keepdim=True).clamp(max=-1e-7)
        support = torch.cat([support, torch.log(-torch.expm1(log_sum))], dim=-1)
        mask = torch.cat([mask, torch.ones_like(mask[..., :1])], dim=-1)
    else:
        support = support - torch.logsumexp(support, dim=-1, keepdim=True)
    safe = torch.where(mask, support, torch.zeros_like(support))
    probs = torch.where(mask, support.exp(), torch.zeros_like(support))
    return torch.nan_to_num(-(probs * safe).sum(dim=-1), nan=0.0)


def _fused_chunked_jsd_loss(
    hidden_valid,
    lm_head_weight,
    lm_head_bias,
    logit_scale,
    final_logit_softcapping,
    target_ids,
    teacher_target_logps,
    valid_candidate_mask,
    beta,
    temperature,
    add_tail_bucket,
    teacher_id_idx,
    num_teachers,
    chunk_size,
    *,
    options: dict[str, Any],
):
    """TRL's function's contract: (loss, divergence sum, student entropy sum, teacher entropy sum, per-teacher
    [count, divergence sum, teacher entropy sum] x teachers), the loss a sum over the positions given."""
    del chunk_size  # the op's own chunking
    weight = lm_head_weight
    hidden = hidden_valid.to(weight.dtype)  # an upcast head keeps its precision
    bias = None if lm_head_bias is None else lm_head_bias.to(weight.dtype)
    per_teacher = teacher_id_idx is not None
    loss, entropy = fused_linear_sparse_divergence(
        hidden,
        weight,
        target_ids,
        teacher_target_logps,
        candidate_mask=valid_candidate_mask,
        beta=float(beta),
        temperature=float(temperature),
        add_tail_bucket=bool(add_tail_bucket),
        reduction="none" if per_teacher else "sum",  # per position only where TRL breaks it down per teacher
        bias=bias,
        softcap=final_logit_softcapping,
        logit_scale=float(logit_scale),
        return_entropy=True,
        **options,
    )
    total = loss.sum() if per_teacher else loss
    with torch.no_grad():
        teacher_entropy = _teacher_entropy(teacher_target_logps.float(), valid_candidate_mask, add_tail_bucket)
        stats = total.new_zeros(3 * num_teachers)
        if per_teacher:
            per_token = loss.detach()
            rows = []
            for index in range(num_teachers):
                chosen = teacher_id_idx == index
                rows += [chosen.sum().float(), per_token[chosen].sum(), teacher_entropy[chosen].sum()]
            stats = torch.stack(rows)
        return_sums = (total.detach().clone(), entropy.sum(), teacher_entropy.sum().to(total.dtype), stats)
    return (total, *return_sums)


@functools.cache
def _redirect(module: str) -> FunctionRedirect:
    """The redirection of the trainer module ``module``'s function, one per module."""
    return FunctionRedirect(module, _ASYNC_FUNCTION, _fused_chunked_jsd_loss)


def serve(trainer: Any, row: Row, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (TRL's experimental ``AsyncDistillationTrainer``); returns whether it is served.

    Raises:
        TRLProtocolError: TRL's ``_compute_loss`` or ``_chunked_jsd_loss`` is not the one served here.
    """
    name = row.name
    base = row.base_of(trainer)
    if base is None:
        return False
    redirect = _redirect(row.module)
    if redirect.is_served(trainer._compute_loss):
        return True
    original = redirect.original()
    parameters = tuple(inspect.signature(original).parameters) if callable(original) else ()
    if parameters != _ASYNC_PARAMETERS:
        trainer_protocol_error(name, f"its module's {_ASYNC_FUNCTION} has the parameters {parameters}")
    if _ASYNC_FUNCTION not in code_names(inspect.unwrap(function(base, "_compute_loss"))):
        trainer_protocol_error(name, f"_compute_loss no longer calls {_ASYNC_FUNCTION}")
    if overridden(trainer, base, ("_compute_loss",)):
        warnings.warn(
            f"lce_patch: {type(trainer).__name__} overrides {name}'s _compute_loss; it keeps TRL's own chunked loss.",
            stacklevel=3,
        )
        return False
    # TRL's chunked loss: fp32 logits
    redirect.serve(trainer, "_compute_loss", divergence_options(options, fp32_logits=True))
    return True


def unserve(trainer: Any, row: Row) -> bool:
    """Undo :func:`serve` on ``trainer``; returns whether it was served."""
    return _redirect(row.module).unserve(trainer, "_compute_loss")
