"""TRL's experimental ``TPOTrainer`` and ``OnlineDPOTrainer`` served by :func:`lce_patch.fused_linear_log_probs`;
a warning for the experimental trainers that stay on TRL's path.

``TPOTrainer._compute_loss`` (TRL 1.16) runs the model for the full ``[B, T, V]`` logits of the chosen, rejected and
(with ``tpo_alpha != 0``) gold sequences and reads from them the per-token log-probabilities and entropy of the
completion tokens, the NLL of the gold completions, the mean logit of the chosen and rejected completion tokens and
whether each chosen token is the argmax. :func:`serve_tpo_trainer` replaces that method, on one trainer instance,
with the same computation from the backbone's last hidden states and one call of the op (``return_entropy``,
``return_mean_logits``, ``return_is_top1``), with the same loss, metrics and bookkeeping. Evaluation that needs the
logits (``return_outputs=True``) keeps TRL's method.

``OnlineDPOTrainer._forward`` (TRL 1.16) runs a model (the policy, or the reference: a separate model, or the policy
with its adapters disabled) on prompt + completion for the full logits and returns the completion tokens'
log-probabilities. :func:`serve_online_dpo_trainer` replaces it with the op on the backbone's hidden states; the
generation, the judge and the reward models are untouched. Calls with vision inputs keep TRL's method.

Both replacements run inside the policy wrapper's forward (TRL's forward redirection) and in the autocast that
accelerate gives the model's forward. Detection is by feature, as for ORPO and CPO (``trl_preference.py``): TRL's
method must use the names it uses in TRL 1.16, else :class:`~lce_patch.integrations.trl.TRLProtocolError`; a
subclass that overrides it is left on TRL's path with a warning. :func:`unserve_experimental_trainer` restores TRL's
methods.

:func:`warn_unserved_trainer` warns, once per trainer class, for the experimental trainers whose training step still
builds the full logits (GOLD, SDFT, SDPO, IW-OPD): the callback only patches their model. The async and server
distillation trainers are served in ``trl_sparse_distillation.py``, A2PO in ``trl_a2po.py``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from .. import ops as _ops
from ..models import get_head_config, head_call, unwrap_causal_lm
from .trl import _op_kwargs
from .trl_preference import _forward_redirection, _served_class, serve_preference_trainer, unserve_preference_trainer

__all__ = [
    "serve_experimental_trainer",
    "serve_online_dpo_trainer",
    "serve_tpo_trainer",
    "unserve_experimental_trainer",
    "warn_unserved_trainer",
]

_SERVED_ATTR = "__lce_patch_experimental__"
_TPO = ("trl.experimental.tpo.tpo_trainer", "TPOTrainer", "_compute_loss")
_TPO_NAMES = frozenset(
    "F ValueError _metrics _total_train_tokens _tp_size accelerator append argmax beta bool chunk clamp cross_entropy "
    "detach float gather gather_for_metrics item items label_smoothing logits logsigmoid loss_type mean model relu "
    "selective_log_softmax_and_entropy sum torch tpo_alpha tpo_l_gamma training".split()
)
_ONLINE_DPO = ("trl.experimental.online_dpo.online_dpo_trainer", "OnlineDPOTrainer", "_forward")
_ONLINE_DPO_NAMES = frozenset(
    "cat log_softmax logits max max_length size squeeze take_along_dim torch unsqueeze".split()
)
# Experimental trainers whose training step builds the full logits and which this version does not serve
_UNSERVED = {
    "trl.experimental.gold.gold_trainer": "GOLDTrainer",
    "trl.experimental.sdft.sdft_trainer": "SDFTTrainer",
    "trl.experimental.sdpo.sdpo_trainer": "SDPOTrainer",
    "trl.experimental.iw_opd.iw_opd_trainer": "IWOPDTrainer",
}
_warned: set[str] = set()


def _token_outputs(model, hidden, targets, options, **wanted):
    """The op on ``model``'s head for ``hidden`` [B, T, D] and ``targets`` [B, T] (no ignored token)."""
    lm_head = model.get_output_embeddings()
    transform = get_head_config(model)

    def score(weight, bias, hidden, targets, low_rank=None):
        if not torch.is_autocast_enabled(hidden.device.type) and weight.dtype != hidden.dtype:
            weight = weight.to(hidden.dtype)
            bias = None if bias is None else bias.to(hidden.dtype)
        return _ops.fused_linear_log_probs(
            hidden,
            weight,
            targets,
            bias=bias,
            softcap=transform.softcap,
            logit_scale=transform.logit_scale,
            low_rank_hidden=None if low_rank is None else low_rank[0],
            low_rank_weight=None if low_rank is None else low_rank[1],
            **wanted,
            **options,
        )

    device = lm_head.weight.device
    return head_call(lm_head, score, hidden.to(device), targets.to(device), low_rank=True)


def _run_served(trainer, model, function, *args):
    """``function(unwrapped model, *args)`` inside the wrapper's forward and accelerate's autocast."""
    unwrapped = trainer.accelerator.unwrap_model(model)
    redirect = _forward_redirection()
    with trainer.accelerator.autocast():
        if redirect is None or unwrapped is model:
            return function(unwrapped, *args)
        return redirect(model, unwrapped, function, unwrapped, *args)


# --------------------------------------------------------------------------------------------------------------------
# TPO


def _tpo_outputs(model, inputs, options):
    causal_lm = unwrap_causal_lm(model)
    model_kwargs = {k: v for k, v in inputs.items() if k != "completion_mask"}
    model_kwargs["use_cache"] = False
    hidden = causal_lm.base_model(**model_kwargs).last_hidden_state[:, :-1]
    outputs = _token_outputs(
        causal_lm,
        hidden,
        inputs["input_ids"][:, 1:],
        options,
        return_entropy=True,
        return_mean_logits=True,
        return_is_top1=True,
    )
    return outputs.log_probs, outputs.entropy.detach(), outputs.mean_logits, outputs.is_top1


def _tpo_loss(trainer, model, inputs, options):
    """``TPOTrainer._compute_loss`` of TRL 1.16 (without ``return_outputs``) on the op's per-token outputs."""
    self = trainer
    mode = "train" if self.model.training else "eval"
    n_branches = 3 if self.tpo_alpha != 0.0 else 2
    per_token_logps, per_token_entropy, per_token_mean_logits, per_token_top1 = _run_served(
        trainer, model, _tpo_outputs, inputs, options
    )
    shift_completion_mask = inputs["completion_mask"][..., 1:]
    valid = shift_completion_mask.bool()
    per_token_logps = per_token_logps.masked_fill(~valid, 0.0)
    per_token_entropy = per_token_entropy.masked_fill(~valid, 0.0)

    if self.loss_type in ("ipo", "tpo-l"):
        completion_lengths = shift_completion_mask.sum(dim=1).clamp(min=1)
        logps = per_token_logps.sum(dim=1) / completion_lengths
    else:
        logps = per_token_logps.sum(dim=1)
    logps_chunks = logps.chunk(n_branches, dim=0)
    chosen_logps, rejected_logps = logps_chunks[0], logps_chunks[1]
    delta_score = chosen_logps - rejected_logps
    if self.loss_type == "sigmoid":
        per_sequence_loss = (
            -F.logsigmoid(self.beta * delta_score) * (1 - self.label_smoothing)
            - F.logsigmoid(-self.beta * delta_score) * self.label_smoothing
        )
    elif self.loss_type == "hinge":
        per_sequence_loss = torch.relu(1 - self.beta * delta_score)
    elif self.loss_type == "ipo":
        per_sequence_loss = (delta_score - 1 / (2 * self.beta)) ** 2
    elif self.loss_type == "tpo-l":
        shifted_delta = delta_score - self.tpo_l_gamma / self.beta
        per_sequence_loss = (
            -F.logsigmoid(self.beta * shifted_delta) * (1 - self.label_smoothing)
            - F.logsigmoid(-self.beta * shifted_delta) * self.label_smoothing
        )
    else:
        raise ValueError(f"Unknown loss type: {self.loss_type}. Should be one of ['sigmoid', 'hinge', 'ipo', 'tpo-l']")
    loss = per_sequence_loss.mean()
    if n_branches == 3:  # the gold completions' NLL, averaged over their tokens
        ref_mask = valid.chunk(3, dim=0)[2]
        loss = loss + self.tpo_alpha * -per_token_logps.chunk(3, dim=0)[2][ref_mask].mean()

    metrics = self._metrics[mode]
    entropy = per_token_entropy[valid].mean()
    metrics["entropy"].append(self.accelerator.gather_for_metrics(entropy).mean().item())
    if mode == "train":
        num_tokens_in_batch = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
        self._total_train_tokens += num_tokens_in_batch // self._tp_size
    metrics["num_tokens"] = [self._total_train_tokens]

    mean_chunks = per_token_mean_logits.detach().chunk(n_branches, dim=0)
    mask_chunks = shift_completion_mask.chunk(n_branches, dim=0)
    chosen_mask, rejected_mask = mask_chunks[0], mask_chunks[1]
    total_chosen_logits = mean_chunks[0][chosen_mask.bool()].sum()
    total_rejected_logits = mean_chunks[1][rejected_mask.bool()].sum()
    total_chosen_logits = self.accelerator.gather_for_metrics(total_chosen_logits).sum().item()
    total_chosen_tokens = self.accelerator.gather_for_metrics(chosen_mask.sum()).sum().item()
    total_rejected_logits = self.accelerator.gather_for_metrics(total_rejected_logits).sum().item()
    total_rejected_tokens = self.accelerator.gather_for_metrics(rejected_mask.sum()).sum().item()
    metrics["logits/chosen"].append(total_chosen_logits / total_chosen_tokens if total_chosen_tokens > 0 else 0.0)
    metrics["logits/rejected"].append(
        total_rejected_logits / total_rejected_tokens if total_rejected_tokens > 0 else 0.0
    )

    chosen_bool_mask = chosen_mask.bool()
    correct_tokens = self.accelerator.gather_for_metrics(
        (per_token_top1.chunk(n_branches, dim=0)[0] & chosen_bool_mask).sum()
    )
    total_sum = self.accelerator.gather_for_metrics(chosen_bool_mask.sum()).sum()
    metrics["mean_token_accuracy"].append((correct_tokens.sum() / total_sum).item() if total_sum > 0 else 0.0)

    chosen_rewards = self.beta * chosen_logps.detach()
    rejected_rewards = self.beta * rejected_logps.detach()
    metrics["rewards/chosen"].append(self.accelerator.gather(chosen_rewards).mean().item())
    metrics["rewards/rejected"].append(self.accelerator.gather(rejected_rewards).mean().item())
    metrics["rewards/accuracies"].append(
        self.accelerator.gather((chosen_rewards > rejected_rewards).float()).mean().item()
    )
    metrics["rewards/margins"].append(self.accelerator.gather(chosen_rewards - rejected_rewards).mean().item())
    metrics["logps/chosen"].append(self.accelerator.gather(chosen_logps).mean().item())
    metrics["logps/rejected"].append(self.accelerator.gather(rejected_logps).mean().item())
    return loss


def serve_tpo_trainer(trainer: Any, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (a TRL ``TPOTrainer``) with the fused op; returns whether it is served.

    Raises:
        TRLProtocolError: TRL's ``_compute_loss`` is not the one replicated here.
    """
    module, name, method_name = _TPO
    if getattr(vars(trainer).get(method_name), _SERVED_ATTR, False):
        return True
    if _served_class(trainer, module, name, method_name, _TPO_NAMES) is None:
        return False
    op_options = _op_kwargs(options)
    method = getattr(trainer, method_name)

    @functools.wraps(method)
    def _compute_loss(model, inputs, return_outputs):
        if return_outputs:  # evaluation that keeps the logits: TRL's own method
            return method(model, inputs, return_outputs)
        return _tpo_loss(trainer, model, inputs, op_options)

    setattr(_compute_loss, _SERVED_ATTR, True)
    trainer._compute_loss = _compute_loss
    return True


# --------------------------------------------------------------------------------------------------------------------
# Online DPO


def _online_dpo_log_probs(model, prompt_completion_ids, attention_mask, completion_ids, start, end, options):
    causal_lm = unwrap_causal_lm(model)
    outputs = causal_lm.base_model(prompt_completion_ids, attention_mask=attention_mask)
    return _token_outputs(causal_lm, outputs.last_hidden_state[:, start:end], completion_ids, options).log_probs


def serve_online_dpo_trainer(trainer: Any, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (a TRL ``OnlineDPOTrainer``): the policy's and the reference's completion log-probabilities
    through the fused op. Returns whether it is served.

    Raises:
        TRLProtocolError: TRL's ``_forward`` is not the one replicated here.
    """
    module, name, method_name = _ONLINE_DPO
    if getattr(vars(trainer).get(method_name), _SERVED_ATTR, False):
        return True
    if _served_class(trainer, module, name, method_name, _ONLINE_DPO_NAMES) is None:
        return False
    op_options = _op_kwargs(options)
    method = getattr(trainer, method_name)

    @functools.wraps(method)
    def _forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None):
        if vision_inputs is not None:
            return method(model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs)
        num_tokens_to_truncate = max(prompt_ids.size(1) + completion_ids.size(1) - trainer.max_length, 0)
        prompt_ids = prompt_ids[:, num_tokens_to_truncate:]
        prompt_mask = prompt_mask[:, num_tokens_to_truncate:]
        prompt_completion_ids = torch.cat((prompt_ids, completion_ids), dim=1)
        prompt_completion_mask = torch.cat((prompt_mask, completion_mask), dim=1)
        prompt_len = prompt_ids.size(1)
        start = prompt_len - 1 if prompt_len > 0 else 0
        end = -1 if prompt_len > 0 else None
        return _run_served(
            trainer,
            model,
            _online_dpo_log_probs,
            prompt_completion_ids,
            prompt_completion_mask,
            completion_ids,
            start,
            end,
            op_options,
        )

    setattr(_forward, _SERVED_ATTR, True)
    trainer._forward = _forward
    return True


# --------------------------------------------------------------------------------------------------------------------


def serve_experimental_trainer(trainer: Any, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` if it is TRL's experimental ORPO, CPO, TPO, Online DPO, async or server distillation
    trainer; warn (once per class) if it is one whose training step stays on TRL's path. Returns whether it is
    served."""
    from .trl_a2po import serve_a2po_trainer
    from .trl_sparse_distillation import serve_sparse_distillation_trainer

    for serve in (
        serve_preference_trainer,
        serve_tpo_trainer,
        serve_online_dpo_trainer,
        serve_sparse_distillation_trainer,
        serve_a2po_trainer,
    ):
        if serve(trainer, options):
            return True
    warn_unserved_trainer(trainer)
    return False


def unserve_experimental_trainer(trainer: Any) -> bool:
    """Undo :func:`serve_experimental_trainer` on ``trainer``; returns whether it was served."""
    from .trl_a2po import unserve_a2po_trainer
    from .trl_sparse_distillation import unserve_sparse_distillation_trainer

    removed = unserve_preference_trainer(trainer)
    removed = unserve_sparse_distillation_trainer(trainer) or removed
    removed = unserve_a2po_trainer(trainer) or removed
    for name in (_TPO[2], _ONLINE_DPO[2]):
        if getattr(vars(trainer).get(name), _SERVED_ATTR, False):
            delattr(trainer, name)
            removed = True
    return removed


def warn_unserved_trainer(trainer: Any) -> bool:
    """Warn, once per trainer class, when ``trainer`` is one of TRL's experimental trainers whose training step
    builds the full logits and that lce_patch does not serve. Returns whether it is one."""
    for cls in type(trainer).__mro__:
        if _UNSERVED.get(cls.__module__) != cls.__name__:
            continue
        if cls.__name__ not in _warned:
            _warned.add(cls.__name__)
            warnings.warn(
                f"lce_patch: TRL's {cls.__name__} computes its loss from the full [tokens x vocabulary] logits, which "
                "this lce_patch does not replace; FusedLCECallback only patches the model's own loss, and this "
                "trainer trains as without it. See the TRL trainer table in lce_patch's docs.",
                stacklevel=3,
            )
        return True
    return False
