"""TRL's experimental ``OnlineDPOTrainer`` served by :func:`lce_patch.fused_linear_log_probs`.

``OnlineDPOTrainer._forward`` (TRL 1.16) runs a model (the policy, or the reference: a separate model, or the policy
with its adapters disabled) on prompt + completion for the full logits and returns the completion tokens'
log-probabilities. :func:`serve` replaces it, on one trainer instance, with the op on the backbone's hidden states,
inside the policy wrapper's forward (TRL's forward redirection) and the autocast accelerate gives the model's
forward; the generation, the judge and the reward models are untouched. Calls with vision inputs keep TRL's method.

Detection is by feature: TRL's method must use the names it uses in TRL 1.16, else
:class:`~lce_patch.integrations.trl.protocol.TRLProtocolError`; a subclass that overrides it is left on TRL's path
with a warning. :func:`unserve` restores TRL's method.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ...models import unwrap_causal_lm
from ..serving import Row
from ..shared import head_log_probs, is_served, log_prob_options, replace_method, restore_method, run_in_forward
from .protocol import served_base

__all__ = ["serve", "unserve"]

_METHOD = "_forward"  # the method replaced
_ONLINE_DPO_NAMES = frozenset(
    "cat log_softmax logits max max_length size squeeze take_along_dim torch unsqueeze".split()
)


def _online_dpo_log_probs(model, prompt_completion_ids, attention_mask, completion_ids, start, end, options):
    causal_lm = unwrap_causal_lm(model)
    outputs = causal_lm.base_model(prompt_completion_ids, attention_mask=attention_mask)
    return head_log_probs(causal_lm, outputs.last_hidden_state[:, start:end], completion_ids, options).log_probs


def serve(trainer: Any, row: Row, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (a TRL ``OnlineDPOTrainer``): the policy's and the reference's completion log-probabilities
    through the fused op. Returns whether it is served.

    Raises:
        TRLProtocolError: TRL's ``_forward`` is not the one replicated here.
    """
    if is_served(vars(trainer).get(_METHOD)):
        return True
    if served_base(trainer, row, _METHOD, _ONLINE_DPO_NAMES) is None:
        return False
    op_options = log_prob_options(options)
    method = getattr(trainer, _METHOD)

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
        return run_in_forward(
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

    replace_method(trainer, _METHOD, _forward)
    return True


def unserve(trainer: Any, row: Row) -> bool:
    """Undo :func:`serve` on ``trainer``; returns whether it was served."""
    del row
    return restore_method(trainer, _METHOD)
