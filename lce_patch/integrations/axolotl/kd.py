"""axolotl's knowledge-distillation trainer (``kd_trainer: true``) served by lce_patch's ops.

axolotl 0.19's ``AxolotlKDTrainer.compute_loss`` runs the student for its hidden states (``logits_to_keep=1``: one
position's logits), reads ``lm_head.weight`` and calls ``self._kd_loss_fn(lm_head.weight, hidden_states,
target_token_ids, target_logprobs, target_mask, true_labels=labels)``, a ``LigerFusedLinearKLTopKLogprobLoss`` that
returns, over a chunk of tokens at a time (``torch.func`` and ``torch.compile``),

    kd_ce_alpha * CE_sum + kd_alpha * kd_temperature**2 * KD_sum

where CE_sum is the shifted cross-entropy of ``hidden @ W.T`` summed over the labelled tokens and KD_sum the
top-K divergence of the student at ``kd_temperature`` from the teacher's log-probabilities, summed over the kept
(position, candidate) slots (``kd_beta``: 0 forward KL, 1 reverse KL, else the generalized JSD;
``kd_normalize_topk``: the student renormalized over the K candidates). The trainer divides it by
``num_items_in_batch``. Its backward returns the gradients of ``kd_ce_alpha * CE_sum + kd_alpha * KD_sum``: the
``kd_temperature**2`` factor scales the reported value, not the gradient.

:func:`serve` replaces ``_kd_loss_fn`` on one trainer instance by :class:`FusedKDLoss`, which computes the same two sums with :func:`lce_patch.fused_linear_cross_entropy` (``shift=True``, ``reduction="sum"``) and
:func:`lce_patch.fused_linear_sparse_divergence` (``candidate_mask=target_mask``, ``renormalize=kd_normalize_topk``,
``reduction="sum"``), with the same value and the same gradients: the ``kd_temperature**2 - 1`` part of the KD term
is added detached. axolotl's ``compute_loss`` (the model call, the division, evaluation) is unchanged.

Like axolotl's loss, the student's logits are ``hidden @ lm_head.weight.T``: no head bias, final-logit softcap or
logit scale (the plugin warns when the model has one), and a LoRA adapter on the head is not applied (axolotl reads
the base weight). Detection is by feature: the trainer must derive from axolotl's ``AxolotlKDTrainer``, its loss
object must be axolotl's class with the attributes and ``forward`` parameters used here, and ``compute_loss`` must
call it; otherwise :class:`AxolotlKDProtocolError`. A subclass that overrides ``compute_loss`` keeps axolotl's
loss, with a warning. :func:`unserve` restores axolotl's loss object. The plugin serves the trainer through its row
of the serving table once axolotl has built it (``post_trainer_create``: the loss object is set after
``Trainer.__init__``), with the warnings on axolotl's log.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from ...models import option_names
from ...ops import fused_linear_cross_entropy, fused_linear_sparse_divergence
from ..serving import Row, base_class

__all__ = ["AxolotlKDProtocolError", "FusedKDLoss", "serve", "unserve"]

_LOSS = ("axolotl.integrations.kd.kernels.liger", "LigerFusedLinearKLTopKLogprobLoss")
_LOSS_ATTRS = (
    "weight_hard_loss",
    "weight_soft_loss",
    "temperature",
    "beta",
    "ignore_index",
    "compute_ce_loss",
    "normalize_topk",
)
_FORWARD_PARAMETERS = (
    "self",
    "lm_head_weight",
    "student_hidden_states",
    "target_token_ids",
    "target_logprobs",
    "target_mask",
    "true_labels",
    "student_bias",
)


class AxolotlKDProtocolError(RuntimeError):
    """axolotl's KD trainer differs from the one lce_patch replicates."""


def _axolotl_version() -> str:
    try:
        from importlib.metadata import version

        return version("axolotl")
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown"


def _fail(trainer_name: str, what: str) -> None:
    raise AxolotlKDProtocolError(
        f"lce_patch does not recognise the KD trainer of axolotl {_axolotl_version()}: {what}. lce_patch replaces "
        f"the loss object of axolotl 0.19's {trainer_name} with its fused ops. Upgrade lce_patch, pin an axolotl it "
        "supports, or drop the lce_patch plugin for this distillation run."
    )


class FusedKDLoss(torch.nn.Module):
    """axolotl's ``LigerFusedLinearKLTopKLogprobLoss`` (same call, value and gradients) through lce_patch's ops.

    ``original``: axolotl's loss object, whose settings are read once; ``options``: ``chunk_size`` and
    ``backend`` of the ops.
    """

    def __init__(self, original: torch.nn.Module, options: dict[str, Any]) -> None:
        super().__init__()
        self.original = [original]  # kept out of the module tree (no state of its own)
        self.weight_hard_loss = float(original.weight_hard_loss or 0.0)
        self.weight_soft_loss = float(original.weight_soft_loss or 0.0)
        self.temperature = float(original.temperature)
        self.beta = float(original.beta or 0.0)
        self.ignore_index = int(original.ignore_index)
        self.compute_ce_loss = bool(original.compute_ce_loss)
        self.normalize_topk = bool(original.normalize_topk)
        # the ops' options among those the plugin sets (the registry's axolotl keys)
        self.options = {
            key: options[key] for key in option_names(axolotl=True, op=True) if options.get(key) is not None
        }

    def forward(
        self,
        lm_head_weight: torch.Tensor,
        student_hidden_states: torch.Tensor,
        target_token_ids: torch.Tensor,
        target_logprobs: torch.Tensor,
        target_mask: torch.Tensor,
        true_labels: torch.Tensor,
        student_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden, weight = student_hidden_states, lm_head_weight
        # as axolotl's: 0 with every gradient 0 when no term is on
        total = hidden.sum() * 0.0 + weight.sum() * 0.0
        if self.compute_ce_loss and self.weight_hard_loss > 0.0:
            ce_sum = fused_linear_cross_entropy(
                hidden,
                weight,
                true_labels,
                bias=student_bias,
                ignore_index=self.ignore_index,
                shift=True,
                reduction="sum",
                **self.options,
            )
            total = total + self.weight_hard_loss * ce_sum
        if self.weight_soft_loss > 0.0:
            kd_sum = fused_linear_sparse_divergence(
                hidden,
                weight,
                target_token_ids,
                target_logprobs,
                candidate_mask=target_mask,
                beta=self.beta,
                temperature=self.temperature,
                renormalize=self.normalize_topk,
                reduction="sum",
                bias=student_bias,
                **self.options,
            )
            trained = self.weight_soft_loss * kd_sum
            # axolotl reports kd_temperature**2 times the KD term and back-propagates the term alone
            total = total + trained + (trained * (self.temperature**2 - 1.0)).detach()
        return total


def _check_protocol(trainer: Any, row: Row, base: type) -> None:
    """Raise AxolotlKDProtocolError unless the trainer's loss object and compute_loss are the ones replicated."""
    loss = vars(trainer).get("_kd_loss_fn")
    if loss is None:
        _fail(row.name, "the trainer has no _kd_loss_fn")
    if base_class(loss, *_LOSS) is None:
        _fail(row.name, f"its _kd_loss_fn is {type(loss).__name__}, not {_LOSS[1]}")
    missing = [name for name in _LOSS_ATTRS if not hasattr(loss, name)]
    if missing:
        _fail(row.name, f"its {_LOSS[1]} has no {', '.join(missing)}")
    parameters = tuple(inspect.signature(type(loss).forward).parameters)
    if parameters != _FORWARD_PARAMETERS:
        _fail(row.name, f"{_LOSS[1]}.forward has the parameters {parameters}")
    compute_loss = inspect.getattr_static(base, "compute_loss", None)
    names = getattr(getattr(compute_loss, "__code__", None), "co_names", ())
    if "_kd_loss_fn" not in names:
        _fail(row.name, f"{row.name}.compute_loss no longer calls _kd_loss_fn")


def serve(trainer: Any, row: Row, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (axolotl's ``AxolotlKDTrainer``, ``row``'s class) with lce_patch's ops; returns whether it is
    served.

    ``options``: ``chunk_size`` and ``backend`` of the ops (others ignored).

    Raises:
        AxolotlKDProtocolError: axolotl's trainer or loss object is not the one replicated here.
    """
    base = row.base_of(trainer)
    if base is None:
        return False
    if isinstance(vars(trainer).get("_kd_loss_fn"), FusedKDLoss):
        return True
    _check_protocol(trainer, row, base)
    if inspect.getattr_static(type(trainer), "compute_loss") is not inspect.getattr_static(base, "compute_loss"):
        warnings.warn(
            f"lce_patch: {type(trainer).__name__} overrides {row.name}'s compute_loss; it keeps axolotl's own KD loss.",
            stacklevel=3,
        )
        return False
    unapplied = _unapplied_head_transform(getattr(trainer, "model", None))
    if unapplied:
        warnings.warn(
            "lce_patch: axolotl's KD loss computes the student's logits as hidden @ lm_head.weight.T, without the "
            f"model's {' and '.join(unapplied)}; lce_patch computes the same loss as axolotl.",
            stacklevel=3,
        )
    trainer._kd_loss_fn = FusedKDLoss(trainer._kd_loss_fn, dict(options))
    return True


def unserve(trainer: Any, row: Row) -> bool:
    """Undo :func:`serve` on ``trainer``; returns whether it was served."""
    del row
    loss = vars(trainer).get("_kd_loss_fn")
    if not isinstance(loss, FusedKDLoss):
        return False
    trainer._kd_loss_fn = loss.original[0]
    return True


def _unapplied_head_transform(model: Any) -> list[str]:
    """What the model's head applies that axolotl's KD loss leaves out."""
    if model is None:
        return []
    from ...models import get_head_config, unwrap_causal_lm

    try:
        transform = get_head_config(model)
    except Exception:  # noqa: BLE001 - an architecture without an entry: nothing to say
        return []
    head = unwrap_causal_lm(model).get_output_embeddings()
    unapplied = []
    if transform.softcap is not None:
        unapplied.append(f"final-logit softcap {transform.softcap}")
    if transform.logit_scale != 1.0:
        unapplied.append(f"logit scale {transform.logit_scale}")
    if getattr(head, "bias", None) is not None:
        unapplied.append("LM head bias")
    return unapplied
