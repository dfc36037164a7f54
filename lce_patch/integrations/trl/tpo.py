"""TRL's experimental ``TPOTrainer`` served by :func:`lce_patch.fused_linear_log_probs`.

``TPOTrainer._compute_loss`` (TRL 1.16) runs the model for the full ``[B, T, V]`` logits of the chosen, rejected and
(with ``tpo_alpha != 0``) gold sequences and reads from them the per-token log-probabilities and entropy of the
completion tokens, the NLL of the gold completions, the mean logit of the chosen and rejected completion tokens and
whether each chosen token is the argmax. :func:`serve` replaces that method, on one trainer instance, with the same
computation from the backbone's last hidden states and one call of the op (``return_entropy``,
``return_mean_logits``, ``return_is_top1``), with the same loss, metrics and bookkeeping, inside the policy
wrapper's forward (TRL's forward redirection) and the autocast accelerate gives the model's forward. Evaluation
that needs the logits (``return_outputs=True``) keeps TRL's method.

Detection is by feature: TRL's method must use the names it uses in TRL 1.16, else
:class:`~lce_patch.integrations.trl.protocol.TRLProtocolError`; a subclass that overrides it is left on TRL's path
with a warning. :func:`unserve` restores TRL's method.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from ...models import unwrap_causal_lm
from ..serving import Row
from ..shared import head_log_probs, is_served, log_prob_options, replace_method, restore_method, run_in_forward
from .protocol import served_base

__all__ = ["serve", "unserve"]

_METHOD = "_compute_loss"  # the method replaced
_TPO_NAMES = frozenset(
    "F ValueError _metrics _total_train_tokens _tp_size accelerator append argmax beta bool chunk clamp cross_entropy "
    "detach float gather gather_for_metrics item items label_smoothing logits logsigmoid loss_type mean model relu "
    "selective_log_softmax_and_entropy sum torch tpo_alpha tpo_l_gamma training".split()
)


def _tpo_outputs(model, inputs, options):
    causal_lm = unwrap_causal_lm(model)
    model_kwargs = {k: v for k, v in inputs.items() if k != "completion_mask"}
    model_kwargs["use_cache"] = False
    hidden = causal_lm.base_model(**model_kwargs).last_hidden_state[:, :-1]
    outputs = head_log_probs(
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
    per_token_logps, per_token_entropy, per_token_mean_logits, per_token_top1 = run_in_forward(
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


def serve(trainer: Any, row: Row, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (a TRL ``TPOTrainer``) with the fused op; returns whether it is served.

    Raises:
        TRLProtocolError: TRL's ``_compute_loss`` is not the one replicated here.
    """
    if is_served(vars(trainer).get(_METHOD)):
        return True
    if served_base(trainer, row, _METHOD, _TPO_NAMES) is None:
        return False
    op_options = log_prob_options(options)
    method = getattr(trainer, _METHOD)

    @functools.wraps(method)
    def _compute_loss(model, inputs, return_outputs):
        if return_outputs:  # evaluation that keeps the logits: TRL's own method
            return method(model, inputs, return_outputs)
        return _tpo_loss(trainer, model, inputs, op_options)

    replace_method(trainer, _METHOD, _compute_loss)
    return True


def unserve(trainer: Any, row: Row) -> bool:
    """Undo :func:`serve` on ``trainer``; returns whether it was served."""
    del row
    return restore_method(trainer, _METHOD)
