"""TRL's experimental ``GKDTrainer`` served by :func:`lce_patch.fused_linear_divergence`.

``GKDTrainer.compute_loss`` (TRL 1.16, ``trl.experimental.gkd``) runs the student and the teacher for their full
``[B, T, V]`` logits and calls ``generalized_jsd_loss(student_logits[:, :-1], teacher_logits[:, :-1],
labels=labels[:, 1:], beta=self.beta, num_items_in_batch=...)`` (temperature 1: the trainer's ``temperature`` is the
sampling one). :func:`serve` replaces ``compute_loss`` on one trainer instance with the same loss from
both models' last hidden states and heads, a chunk of tokens at a time: the backbones run as TRL's
``DistillationTrainer`` runs them (``base_model`` of the causal LM, PEFT unwrapped), each head's weight is read
inside its module's call (FSDP/ZeRO-3 gather it there), and the whole loss runs inside the student wrapper's
forward (TRL's forward redirection), so DDP prepares its gradient reduction as for a plain forward. Softcap and
logit scale come from lce_patch's registry for each model. Evaluation that needs the logits
(``return_outputs=True``) keeps TRL's method. :func:`unserve` restores it.

A subclass that overrides ``compute_loss`` or ``generalized_jsd_loss`` is left to TRL (with a warning): its loss
is not the one replicated here. The loss runs without accelerate's autocast, in the models' own dtype (as it always
has here; TRL's own ``compute_loss`` calls the models, whose forward accelerate runs in autocast under mixed
precision).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from ...models import get_head_config, head_call, unwrap_causal_lm
from ...ops import fused_linear_divergence
from ..serving import Row
from ..shared import divergence_options, function, is_served, replace_method, restore_method, run_in_forward

__all__ = ["gkd_loss", "serve", "unserve"]


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


def serve(trainer: Any, row: Row, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (a TRL ``GKDTrainer``) with the fused op; returns whether it is served.

    ``options``: ``chunk_size``, ``backend`` and ``fp32_weight_grad`` of :func:`lce_patch.fused_linear_divergence`
    (others ignored); the logits stay in the compute dtype, as in TRL's loss on the model's logits.
    """
    gkd = row.base_of(trainer)
    if gkd is None:
        return False
    method = trainer.compute_loss
    if is_served(method):
        return True
    cls = type(trainer)
    if any(function(cls, name) is not function(gkd, name) for name in ("compute_loss", "generalized_jsd_loss")):
        warnings.warn(
            f"lce_patch: {cls.__name__} overrides {row.name}'s compute_loss or generalized_jsd_loss; it keeps its "
            "own (unfused) loss.",
            stacklevel=2,
        )
        return False
    op_options = divergence_options(options)

    @functools.wraps(method)
    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:  # evaluation that keeps the student's outputs (logits): TRL's own loss
            return method(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
        arguments = (teacher, inputs, trainer.beta, num_items_in_batch, op_options)
        return run_in_forward(trainer, model, gkd_loss, *arguments, autocast=False)

    replace_method(trainer, "compute_loss", compute_loss)
    return True


def unserve(trainer: Any, row: Row) -> bool:
    """Undo :func:`serve` on ``trainer``; returns whether it was served."""
    del row
    return restore_method(trainer, "compute_loss")
