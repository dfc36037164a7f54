"""TRL's experimental ``GKDTrainer`` served by :func:`lce_patch.fused_linear_divergence`.

``GKDTrainer.compute_loss`` (TRL 1.16, ``trl.experimental.gkd``) runs the student and the teacher for their full
``[B, T, V]`` logits and calls ``generalized_jsd_loss(student_logits[:, :-1], teacher_logits[:, :-1],
labels=labels[:, 1:], beta=self.beta, num_items_in_batch=...)`` (temperature 1: the trainer's ``temperature`` is the
sampling one). :func:`serve_gkd_trainer` replaces ``compute_loss`` on one trainer instance with the same loss from
both models' last hidden states and heads, a chunk of tokens at a time: the backbones run as TRL's
``DistillationTrainer`` runs them (``base_model`` of the causal LM, PEFT unwrapped), each head's weight is read
inside its module's call (FSDP/ZeRO-3 gather it there), and the whole loss runs inside the student wrapper's
forward (TRL's forward redirection), so DDP prepares its gradient reduction as for a plain forward. Softcap and
logit scale come from lce_patch's registry for each model. Evaluation that needs the logits
(``return_outputs=True``) keeps TRL's method. :func:`unserve_gkd_trainer` restores it.

A subclass that overrides ``compute_loss`` or ``generalized_jsd_loss`` is left to TRL (with a warning): its loss
is not the one replicated here.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from ..models import get_head_config, unwrap_causal_lm
from ..models.head import head_call
from ..ops import fused_linear_divergence
from .trl_distillation import divergence_options

__all__ = ["serve_gkd_trainer", "unserve_gkd_trainer"]

_SERVED_ATTR = "__lce_patch_gkd__"


def _gkd_class() -> type | None:
    try:
        from trl.experimental.gkd import GKDTrainer
    except ImportError:
        return None
    return GKDTrainer


def _forward_redirection():
    try:
        from trl.models.utils import _ForwardRedirection
    except ImportError:  # pragma: no cover (TRL without it: call the loss directly)
        return None
    return _ForwardRedirection()


def _last_hidden_state(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T, D] output of the causal LM's backbone (after its final norm), without the head."""
    backbone = unwrap_causal_lm(model).base_model
    return backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def gkd_loss(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    beta: float,
    num_items_in_batch: torch.Tensor | int | None,
    options: dict[str, Any],
) -> torch.Tensor:
    """GKDTrainer's loss (``generalized_jsd_loss`` of the shifted logits, tokens whose label is not -100) through
    the fused op. ``student`` and ``teacher``: the unwrapped models."""
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    student_hidden = _last_hidden_state(student, input_ids, attention_mask)[:, :-1]
    teacher.eval()
    with torch.no_grad():
        teacher_hidden = _last_hidden_state(teacher, input_ids, attention_mask)[:, :-1]
    student_head = unwrap_causal_lm(student).get_output_embeddings()
    teacher_head = unwrap_causal_lm(teacher).get_output_embeddings()
    student_transform, teacher_transform = get_head_config(student), get_head_config(teacher)
    mask = inputs["labels"][:, 1:] != -100

    def with_teacher_head(teacher_weight, teacher_bias, teacher_states):
        def with_student_head(weight, bias, hidden):
            hidden = hidden.to(device=weight.device, dtype=weight.dtype)  # an upcast head keeps its precision
            return fused_linear_divergence(
                hidden,
                weight,
                teacher_states.to(device=weight.device, dtype=teacher_weight.dtype),
                teacher_weight,
                mask=mask.to(weight.device),
                beta=float(beta),
                num_items_in_batch=num_items_in_batch,
                bias=bias,
                teacher_bias=teacher_bias,
                softcap=student_transform.softcap,
                teacher_softcap=teacher_transform.softcap,
                logit_scale=student_transform.logit_scale,
                teacher_logit_scale=teacher_transform.logit_scale,
                **options,
            )

        return head_call(student_head, with_student_head, student_hidden)

    return head_call(teacher_head, with_teacher_head, teacher_hidden)


def serve_gkd_trainer(trainer: Any, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (a TRL ``GKDTrainer``) with the fused op; returns whether it is served.

    ``options``: ``chunk_size``, ``backend`` and ``fp32_weight_grad`` of :func:`lce_patch.fused_linear_divergence`
    (others ignored); the logits stay in the compute dtype, as in TRL's loss on the model's logits.
    """
    gkd = _gkd_class()
    if gkd is None or not isinstance(trainer, gkd):
        return False
    method = trainer.compute_loss
    if getattr(method, _SERVED_ATTR, False):
        return True
    cls = type(trainer)
    if cls.compute_loss is not gkd.compute_loss or cls.generalized_jsd_loss is not gkd.generalized_jsd_loss:
        warnings.warn(
            f"lce_patch: {cls.__name__} overrides GKDTrainer's compute_loss or generalized_jsd_loss; it keeps its "
            "own (unfused) loss.",
            stacklevel=2,
        )
        return False
    op_options = divergence_options(options)
    redirect = _forward_redirection()

    @functools.wraps(method)
    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:  # evaluation that keeps the student's outputs (logits): TRL's own loss
            return method(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        student = trainer.accelerator.unwrap_model(model)
        teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
        arguments = (student, teacher, inputs, trainer.beta, num_items_in_batch, op_options)
        if redirect is None or student is model:
            return gkd_loss(*arguments)
        return redirect(model, student, gkd_loss, *arguments)

    setattr(compute_loss, _SERVED_ATTR, True)
    trainer.compute_loss = compute_loss
    return True


def unserve_gkd_trainer(trainer: Any) -> bool:
    """Undo :func:`serve_gkd_trainer` on ``trainer``; returns whether it was served."""
    if not getattr(vars(trainer).get("compute_loss"), _SERVED_ATTR, False):
        return False
    del trainer.compute_loss
    return True
