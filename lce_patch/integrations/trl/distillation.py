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

TRL reads ``lm_head.weight`` of both models outside the heads' calls. Under DeepSpeed ZeRO-3 that is a partitioned
parameter (an empty tensor on every rank: only the hooks of the head module's call gather it), so when the weights
passed are the trainer's heads' own, the op runs inside the student head's call and, nested, the teacher head's
(:func:`~lce_patch.models.head_call`), reading each weight there. The teacher's call hands its result out boxed, so
the wrappers arm no backward hooks on the frozen teacher's head (its weight gets no gradient: no gathering it again
in the backward). An FSDP2 shard (a DTensor read outside its unit's forward) is gathered once with ``full_tensor``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ...models import head_call
from ...ops import fused_linear_divergence
from ..serving import Row
from ..shared import divergence_options
from .redirect import FunctionRedirect

__all__ = ["serve", "unserve"]

_FUNCTION = "_chunked_divergence_loss"  # the trainer's module's function its loss calls
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


class _Boxed:
    """A call's result that distributed wrappers do not look into (no backward hooks armed on its tensors). It keeps
    a ``__dict__``: DeepSpeed's post-forward hook reads ``vars()`` of an output it does not know (only its top-level
    tensors, none here)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _head_for(head: torch.nn.Module | None, weight: torch.Tensor) -> torch.nn.Module | None:
    """``head`` when ``weight`` is its own weight (what TRL read from it), else None (the tensors as given)."""
    return head if head is not None and getattr(head, "weight", None) is weight else None


def _divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    completion_mask: torch.Tensor,
    arguments: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op on whole head weights: (loss, sum of the valid tokens' student entropy, number of valid tokens)."""
    weight, bias = _full(weight), _full(bias)
    teacher_weight, teacher_bias = _full(teacher_weight), _full(teacher_bias)
    hidden = hidden.to(weight.dtype)  # an upcast head (mixed precision) keeps its precision
    teacher_weight = teacher_weight.to(teacher_hidden.dtype)  # the fp32 master copy under mixed precision
    if teacher_bias is not None:
        teacher_bias = teacher_bias.to(teacher_hidden.dtype)
    loss, entropy = fused_linear_divergence(
        hidden,
        weight,
        teacher_hidden,
        teacher_weight,
        mask=completion_mask,
        bias=bias,
        teacher_bias=teacher_bias,
        return_entropy=True,
        **arguments,
    )
    valid = completion_mask != 0
    entropy_sum = torch.where(valid, entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device)).sum()
    return loss, entropy_sum, valid.sum()


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
    """TRL's function's contract: (loss, sum of the valid tokens' student entropy, number of valid tokens).

    ``options``: ``op``, the op's options; ``heads``, a function giving the served trainer's (student, teacher) head
    modules (either None when unknown)."""
    arguments = dict(
        beta=float(beta),
        temperature=float(temperature),
        num_items_in_batch=num_items_in_batch,
        softcap=student_final_logit_softcapping,
        teacher_softcap=teacher_final_logit_softcapping,
        logit_scale=float(student_logit_scale),
        teacher_logit_scale=float(teacher_logit_scale),
        **options["op"],
    )
    student_head, teacher_head = options["heads"]()
    student_head = _head_for(student_head, student_lm_head_weight)
    teacher_head = _head_for(teacher_head, teacher_lm_head_weight)

    def with_student_head(weight, bias, hidden):
        def with_teacher_head(teacher_weight, teacher_bias, teacher_hidden):
            result = _divergence(
                hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, completion_mask, arguments
            )
            return _Boxed(result)

        if teacher_head is None:
            return with_teacher_head(teacher_lm_head_weight, teacher_lm_head_bias, teacher_hidden_states).value
        return head_call(teacher_head, with_teacher_head, teacher_hidden_states).value

    if student_head is None:
        return with_student_head(student_lm_head_weight, student_lm_head_bias, student_hidden_states)
    return head_call(student_head, with_student_head, student_hidden_states)


def _heads(trainer: Any) -> Callable[[], tuple[torch.nn.Module | None, torch.nn.Module | None]]:
    """A function giving the (student, teacher) head modules of ``trainer`` (held weakly), as TRL reads them."""
    ref = weakref.ref(trainer)

    def heads() -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
        trainer = ref()
        if trainer is None:
            return None, None
        found = []
        for model in (trainer.model, getattr(trainer, "teacher_model", None)):
            unwrapped = None if model is None else trainer.accelerator.unwrap_model(model)
            get = getattr(unwrapped, "get_output_embeddings", None)
            found.append(get() if callable(get) else None)
        return found[0], found[1]

    return heads


@functools.cache
def _redirect(module: str) -> FunctionRedirect:
    """The redirection of the trainer module ``module``'s function, one per module."""
    return FunctionRedirect(module, _FUNCTION, _fused_divergence_loss)


def serve(trainer: Any, row: Row, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (a TRL ``DistillationTrainer``) with the fused op; returns whether it is served.

    ``options``: ``chunk_size`` and ``backend`` of :func:`lce_patch.fused_linear_divergence` (others ignored); the op
    runs with fp32 logits and an fp32-accumulated dW, the precision of the TRL kernel it replaces.
    """
    if row.base_of(trainer) is None:
        return False
    redirect = _redirect(row.module)
    if redirect.is_served(trainer._compute_loss):
        return True
    original = redirect.original()
    names = tuple(inspect.signature(original).parameters) if callable(original) else ()
    if names != _KNOWN_PARAMETERS:
        warnings.warn(
            f"lce_patch: this TRL's {row.module}.{_FUNCTION} has the parameters {names}, not the known ones; "
            f"the {row.name} keeps TRL's own divergence kernel.",
            stacklevel=2,
        )
        return False
    # TRL's chunked kernel: fp32 logits and dW
    op_options = divergence_options(options, fp32_logits=True)
    redirect.serve(trainer, "_compute_loss", {"op": op_options, "heads": _heads(trainer)})
    return True


def unserve(trainer: Any, row: Row) -> bool:
    """Undo :func:`serve` on ``trainer``; returns whether it was served."""
    return _redirect(row.module).unserve(trainer, "_compute_loss")
