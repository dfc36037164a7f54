"""TRL's ``DistillationTrainer`` served by :func:`lce_patch.fused_linear_divergence`.

TRL 1.16's ``DistillationTrainer._compute_loss`` runs both backbones, then calls the module function
``trl.trainer.distillation_trainer._chunked_divergence_loss(student_hidden_states, teacher_hidden_states,
student_lm_head_weight, teacher_lm_head_weight, completion_mask, beta, ...)``, which returns the loss, the sum
of the student's per-token entropy and the number of valid tokens. :func:`serve` wraps
``_compute_loss`` on one trainer instance; while that call runs (in that thread), the function answers through
lce_patch's op with the same arguments and results.

The module function is looked up as a global by TRL's method, so it is replaced, once, by a dispatcher that
calls TRL's own function in every other call (other trainers, other threads; :class:`~lce_patch.integrations.trl.
redirect.FunctionRedirect`): nothing changes for a trainer that is not served.
:func:`unserve` unwraps the instance; the dispatcher is removed with the last served trainer. Detection is by
feature: the function's parameter names must be the known ones, else the trainer is left to TRL's kernel with a
warning.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from ...ops import fused_linear_divergence
from ..serving import base_class
from ..shared import divergence_options
from .redirect import FunctionRedirect

__all__ = ["serve", "unserve"]

_MODULE = "trl.trainer.distillation_trainer"
_FUNCTION = "_chunked_divergence_loss"
_KNOWN_PARAMETERS = (
    "student_hidden_states",
    "teacher_hidden_states",
    "student_lm_head_weight",
    "teacher_lm_head_weight",
    "completion_mask",
    "beta",
    "num_items_in_batch",
    "student_lm_head_bias",
    "teacher_lm_head_bias",
    "student_logit_scale",
    "teacher_logit_scale",
    "student_final_logit_softcapping",
    "teacher_final_logit_softcapping",
    "temperature",
)


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover (torch built without distributed)
        return tensor
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # an FSDP2 shard, gathered once


def _fused_divergence_loss(
    student_hidden_states: torch.Tensor,
    teacher_hidden_states: torch.Tensor,
    student_lm_head_weight: torch.Tensor,
    teacher_lm_head_weight: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    num_items_in_batch: torch.Tensor | int | None = None,
    student_lm_head_bias: torch.Tensor | None = None,
    teacher_lm_head_bias: torch.Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_final_logit_softcapping: float | None = None,
    temperature: float = 1.0,
    *,
    options: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's function's contract: (loss, sum of the valid tokens' student entropy, number of valid tokens)."""
    weight, bias = _full(student_lm_head_weight), _full(student_lm_head_bias)
    teacher_weight, teacher_bias = _full(teacher_lm_head_weight), _full(teacher_lm_head_bias)
    hidden = student_hidden_states.to(weight.dtype)  # an upcast head (mixed precision) keeps its precision
    teacher_weight = teacher_weight.to(teacher_hidden_states.dtype)  # the fp32 master copy under mixed precision
    if teacher_bias is not None:
        teacher_bias = teacher_bias.to(teacher_hidden_states.dtype)
    loss, entropy = fused_linear_divergence(
        hidden,
        weight,
        teacher_hidden_states,
        teacher_weight,
        mask=completion_mask,
        beta=float(beta),
        temperature=float(temperature),
        num_items_in_batch=num_items_in_batch,
        bias=bias,
        teacher_bias=teacher_bias,
        softcap=student_final_logit_softcapping,
        teacher_softcap=teacher_final_logit_softcapping,
        logit_scale=float(student_logit_scale),
        teacher_logit_scale=float(teacher_logit_scale),
        return_entropy=True,
        **options,
    )
    valid = completion_mask != 0
    entropy_sum = torch.where(valid, entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device)).sum()
    return loss, entropy_sum, valid.sum()


_REDIRECT = FunctionRedirect(_MODULE, _FUNCTION, _fused_divergence_loss)


def serve(trainer: Any, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (a TRL ``DistillationTrainer``) with the fused op; returns whether it is served.

    ``options``: ``chunk_size`` and ``backend`` of :func:`lce_patch.fused_linear_divergence` (others ignored); the op
    runs with fp32 logits and an fp32-accumulated dW, the precision of the TRL kernel it replaces.
    """
    if base_class(trainer, _MODULE, "DistillationTrainer") is None:
        return False
    if _REDIRECT.is_served(trainer._compute_loss):
        return True
    original = _REDIRECT.original()
    names = tuple(inspect.signature(original).parameters) if callable(original) else ()
    if names != _KNOWN_PARAMETERS:
        warnings.warn(
            f"lce_patch: this TRL's {_MODULE}.{_FUNCTION} has the parameters {names}, not the known ones; "
            "the DistillationTrainer keeps TRL's own divergence kernel.",
            stacklevel=2,
        )
        return False
    # TRL's chunked kernel: fp32 logits and dW
    _REDIRECT.serve(trainer, "_compute_loss", divergence_options(options, fp32_logits=True))
    return True


def unserve(trainer: Any) -> bool:
    """Undo :func:`serve` on ``trainer``; returns whether it was served."""
    return _REDIRECT.unserve(trainer, "_compute_loss")
