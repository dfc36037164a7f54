"""TRL's experimental ``ORPOTrainer`` and ``CPOTrainer`` served by :func:`lce_patch.fused_linear_log_probs`.

Both trainers (TRL 1.16, ``trl.experimental.orpo`` and ``trl.experimental.cpo``) get everything their losses and
metrics read from one method, ``concatenated_forward(model, batch)``: it runs the model on the chosen and the
rejected sequences stacked in one batch for the full ``[2B, T, V]`` logits and returns the chosen and rejected
sequence log-probabilities, the chosen and rejected logits (which ``get_batch_loss_metrics`` only averages, for the
``logits/chosen`` and ``logits/rejected`` metrics), the NLL term of the chosen sequences and, for MoE models, the
router's auxiliary loss. :func:`serve` replaces that method, on one trainer instance, with one
that returns the same values from the backbone's last hidden states and one call of the op, made inside the
``lm_head`` module's call (FSDP and ZeRO-3 gather the weight there; a LoRA adapter on the head is computed by the
op; the softcap and logit scale are the model's own, from lce_patch's registry):

- the per-token log-probabilities of the completion tokens, summed per sequence or averaged (ORPO always; CPO for
  ``loss_type`` ``"ipo"`` and ``"simpo"``, as TRL's method reads it);
- the NLL term from the same per-token log-probabilities: ORPO's over every attended token of the chosen sequences,
  CPO's over their completion tokens (0, as in TRL, when ``cpo_alpha == 0``);
- the mean logit of each position (``return_mean_logits``), averaged over the chosen and over the rejected rows
  (ORPO's positions but the last, CPO's all of them), returned as 0-d tensors in place of the logits.

The losses built on them (``odds_ratio_loss``, ``cpo_loss`` with every ``loss_type``, AlphaPO included) stay TRL's.
The whole method runs inside the policy wrapper's forward (TRL's forward redirection), so DDP prepares its gradient
reduction as for a plain forward. :func:`unserve` restores TRL's method.

Detection is by feature: the trainer must derive from TRL's class, and the methods whose work is replicated here
(``concatenated_forward``, ``get_batch_logps``, and ``get_batch_loss_metrics``, which reads the logits) must use the
names and constants they use in TRL 1.16; TRL code that differs raises :class:`~lce_patch.integrations.trl.
protocol.TRLProtocolError`. A subclass that overrides one of those methods, or an encoder-decoder model, is left on TRL's
path with a warning.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ...models import unwrap_causal_lm
from ..serving import Row
from ..shared import (
    IGNORE_INDEX,
    function,
    head_log_probs,
    is_served,
    load_balancing_loss,
    log_prob_options,
    replace_method,
    restore_method,
    run_in_forward,
)
from .protocol import check_names, trainer_protocol_error

__all__ = ["preference_forward", "serve", "unserve"]

_REPLACED = ("concatenated_forward", "get_batch_logps", "get_batch_loss_metrics")  # methods a subclass must keep


@dataclass(frozen=True)
class _Spec:
    """One trainer's ``concatenated_forward`` as TRL 1.16 writes it (the trainer: the row of that variant)."""

    padding_attr: str  # the trainer attribute it pads the input ids with
    nll_over_attended: bool  # NLL labels: every attended token (ORPO), or the completion labels (CPO)
    last_position_logits: bool  # whether the logits it returns include the last position (CPO) or not (ORPO)
    averaged_attr: str | None  # None: log-probs always averaged; else averaged when this attribute is in the tuple
    nll_weight_attr: str | None  # the attribute whose zero turns the NLL term off (CPO's `cpo_alpha`)
    names: dict[str, frozenset[str]]  # method -> the global and attribute names its code (nested code too) uses
    constants: tuple[Any, ...]  # constants of `concatenated_forward` that pin what is replicated here


_COMMON_FORWARD = frozenset(
    "CrossEntropyLoss _shift_right accelerator aux_loss aux_loss_enabled clone concatenated_inputs contiguous device "
    "get_batch_logps is_encoder_decoder logits nn shape to torch view".split()
)
_COMMON_METRICS = frozenset(
    "accelerator aux_loss_coef aux_loss_enabled concatenated_forward detach float gather_for_metrics item mean".split()
)
_LOGPS = frozenset("ValueError clone selective_log_softmax shape sum".split())

_SPECS = {  # by the rows' variant
    "orpo": _Spec(
        padding_attr="padding_value",
        nll_over_attended=True,
        last_position_logits=False,
        averaged_attr=None,
        nll_weight_attr=None,
        names={
            "concatenated_forward": _COMMON_FORWARD | {"padding_value", "where"},
            "get_batch_loss_metrics": _COMMON_METRICS
            | {"odds_ratio_loss", "is_torch_xla_available", "mark_step", "items", "xm"},
            "get_batch_logps": _LOGPS | {"torch", "where"},
        },
        constants=("concatenated_labels", "concatenated_input_ids", "concatenated_attention_mask", -100, -1),
    ),
    "cpo": _Spec(
        padding_attr="pad_token_id",
        nll_over_attended=False,
        last_position_logits=True,
        averaged_attr="loss_type",
        nll_weight_attr="cpo_alpha",
        names={
            "concatenated_forward": _COMMON_FORWARD | {"pad_token_id", "cpo_alpha", "loss_type", "tensor"},
            "get_batch_loss_metrics": _COMMON_METRICS | {"cpo_alpha", "cpo_loss"},
            "get_batch_logps": _LOGPS,
        },
        constants=("concatenated_labels", "concatenated_input_ids", "concatenated_attention_mask", ("ipo", "simpo")),
    ),
}
_AVERAGED_LOSS_TYPES = ("ipo", "simpo")  # CPO's, also checked among the method's constants


def _check_protocol(spec: _Spec, name: str, base: type) -> None:
    """Raise TRLProtocolError unless TRL's methods (of its class ``name``) are the ones replicated here."""
    for method, known in spec.names.items():
        check_names(name, base, method, known)
    forward = function(base, "concatenated_forward")
    if tuple(inspect.signature(forward).parameters) != ("self", "model", "batch"):
        trainer_protocol_error(
            name, f"concatenated_forward has the parameters {tuple(inspect.signature(forward).parameters)}"
        )
    constants = forward.__code__.co_consts
    missing = [c for c in spec.constants if not any(type(c) is type(k) and c == k for k in constants)]
    if missing:
        trainer_protocol_error(name, f"concatenated_forward no longer uses the constants {missing}")


def _servable(trainer: Any, trainer_name: str, base: type) -> bool:
    """Whether ``trainer`` runs TRL's methods; warns and returns False where it does not."""
    cls = type(trainer)
    overridden = [name for name in _REPLACED if function(cls, name) is not function(base, name)]
    overridden += [name for name in _REPLACED if name in vars(trainer)]
    reason = None
    if overridden:
        reason = f"{cls.__name__} overrides {trainer_name}'s {', '.join(sorted(set(overridden)))}"
    elif getattr(trainer, "is_encoder_decoder", False):
        reason = "the model is an encoder-decoder"
    if reason is None:
        return True
    warnings.warn(
        f"lce_patch: {reason}; this trainer keeps TRL's own forward, which builds the full [tokens x vocabulary] "
        "logits.",
        stacklevel=3,
    )
    return False


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum()  # 0/0 -> nan, as nn.CrossEntropyLoss gives with no valid token


def preference_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    len_chosen: int,
    *,
    spec: _Spec,
    average: bool,
    with_nll: bool,
    with_aux: bool,
    options: dict[str, Any],
    labels_checked: dict[str, bool],
) -> tuple[torch.Tensor, ...]:
    """What ``concatenated_forward`` returns, with the logits replaced by their means (0-d tensors).

    ``model``: the unwrapped policy; ``input_ids``, ``attention_mask``, ``labels``: the concatenated batch
    (``[2B, T]``, chosen rows first). ``labels_checked``: the trainer's record of whether its collator's labels
    differ from the input ids on attended tokens (filled on the first batch)."""
    causal_lm = unwrap_causal_lm(model)
    kwargs: dict[str, Any] = {"attention_mask": attention_mask, "use_cache": False}
    if with_aux:
        kwargs["output_router_logits"] = True
    backbone_outputs = causal_lm.base_model(input_ids, **kwargs)
    positions = input_ids.shape[1] - (0 if spec.last_position_logits else 1)
    hidden = backbone_outputs.last_hidden_state[:, :positions]

    # One target per position, so that the op computes the mean logit of every position the logits metric
    # averages; positions that neither the log-probs nor the NLL read get token 0 and are masked out below.
    completion = labels[:, 1:]
    completion_mask = completion != IGNORE_INDEX
    nll_targets = torch.where(attention_mask == 1, input_ids, IGNORE_INDEX)[:, 1:] if spec.nll_over_attended else None
    targets = torch.where(completion_mask, completion, 0)
    nll_mask = completion_mask
    if nll_targets is not None:
        nll_mask = nll_targets != IGNORE_INDEX
        targets = torch.where(completion_mask | ~nll_mask, targets, nll_targets)
    if positions > targets.shape[1]:  # the last position predicts no token
        targets = torch.cat((targets, targets.new_zeros(targets.shape[0], 1)), dim=1)

    # The head is looked up per call (FSDP and PEFT replace it after patching); the op runs inside its call.
    per_token = head_log_probs(causal_lm, hidden, targets, options, return_mean_logits=True)
    device = per_token.log_probs.device
    log_probs = per_token.log_probs[:, : completion.shape[1]]
    completion_mask, nll_mask = completion_mask.to(device), nll_mask.to(device)

    logps = (log_probs * completion_mask).sum(-1)
    if average:
        logps = logps / completion_mask.sum(-1)
    if not with_nll:
        nll = torch.tensor(0.0, device=device)
    else:
        nll_log_probs = log_probs
        if nll_targets is not None:
            # ORPO reads the same tokens for both terms (its labels are the input ids with the prompt masked); a
            # collator whose labels differ on an attended token gets a second call for the NLL's tokens. Checked on
            # the trainer's first batch only (a host sync; a collator is one function of its rows)
            nll_targets = nll_targets.to(device)
            if "labels_differ" not in labels_checked:
                both = completion_mask[:len_chosen] & nll_mask[:len_chosen]
                differ = (completion[:len_chosen].to(device) != nll_targets[:len_chosen]) & both
                labels_checked["labels_differ"] = bool(differ.any())
            if labels_checked["labels_differ"]:
                nll_log_probs = head_log_probs(
                    causal_lm,
                    hidden[:len_chosen, : completion.shape[1]],
                    torch.where(nll_mask[:len_chosen], nll_targets[:len_chosen], 0),
                    options,
                ).log_probs
        nll = -_masked_mean(nll_log_probs[:len_chosen], nll_mask[:len_chosen])
    mean_logits = per_token.mean_logits
    outputs = (
        logps[:len_chosen],
        logps[len_chosen:],
        mean_logits[:len_chosen].mean(),
        mean_logits[len_chosen:].mean(),
        nll,
    )
    if with_aux:
        text_config = causal_lm.config.get_text_config()
        outputs += (load_balancing_loss(causal_lm, text_config, backbone_outputs, attention_mask),)
    return outputs


def serve(trainer: Any, row: Row, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (a TRL ``ORPOTrainer`` or ``CPOTrainer``: ``row.variant``) with the fused op; returns whether
    it is served.

    ``options``: the callback's; ``backend`` and ``chunk_size`` reach the op, ``label_smoothing``, ``z_loss`` and
    ``ignore_index`` must be neutral (TRL's terms are plain log-probabilities).

    Raises:
        TRLProtocolError: the trainer derives from TRL's class but TRL's methods are not the ones replicated here.
    """
    base = row.base_of(trainer)
    if base is None:
        return False
    spec = _SPECS[row.variant]
    if is_served(vars(trainer).get("concatenated_forward")):
        return True
    _check_protocol(spec, row.name, base)
    if not _servable(trainer, row.name, base):
        return False
    op_options = log_prob_options(options)
    method = trainer.concatenated_forward
    labels_checked: dict[str, bool] = {}

    @functools.wraps(method)
    def concatenated_forward(model, batch):
        concatenated = trainer.concatenated_inputs(
            batch,
            is_encoder_decoder=False,
            padding_value=getattr(trainer, spec.padding_attr),
            device=trainer.accelerator.device,
        )
        average = spec.averaged_attr is None or getattr(trainer, spec.averaged_attr) in _AVERAGED_LOSS_TYPES
        with_nll = spec.nll_weight_attr is None or getattr(trainer, spec.nll_weight_attr) != 0
        arguments = (
            concatenated["concatenated_input_ids"],
            concatenated["concatenated_attention_mask"],
            concatenated["concatenated_labels"],
            batch["chosen_labels"].shape[0],
        )
        options = dict(
            spec=spec,
            average=average,
            with_nll=with_nll,
            with_aux=bool(trainer.aux_loss_enabled),
            options=op_options,
            labels_checked=labels_checked,
        )
        # float32 outputs, as accelerate's autocast forward returns
        outputs = run_in_forward(trainer, model, preference_forward, *arguments, **options)
        return tuple(output.float() for output in outputs)

    replace_method(trainer, "concatenated_forward", concatenated_forward)
    return True


def unserve(trainer: Any, row: Row) -> bool:
    """Undo :func:`serve` on ``trainer``; returns whether it was served."""
    del row
    return restore_method(trainer, "concatenated_forward")
