"""TRL's experimental ``A2POTrainer`` (A*-PO) served by :func:`lce_patch.fused_linear_log_probs`.

``A2POTrainer._get_sequence_logps`` (TRL 1.16) runs a model (the policy with gradient in ``compute_loss``, or the
frozen reference copy in ``_prepare_inputs``) on prompt + sampled completion for the logits of the completion
positions and returns each sequence's summed completion log-probability, which is all that the loss (a regression
of ``beta2 * (log pi - log pi_ref)`` onto ``r - V*``) and its metrics read. :func:`serve` replaces that
method, on one trainer instance, with the backbone's hidden states and one call of the op on the model's own head
(softcap and logit scale from lce_patch's registry, a LoRA adapter on the head computed by the op), inside the
wrapper's forward (TRL's forward redirection) and accelerate's autocast. Stage 1 (sampling from the reference
model to estimate ``V*``) and the generation in Stage 2 are untouched.

Detection is by feature, as for the other experimental trainers: TRL's method must use the names it uses in TRL
1.16, else :class:`~lce_patch.integrations.trl.protocol.TRLProtocolError`; a subclass that overrides it is left on
TRL's path with a warning. :func:`unserve` restores TRL's method.
"""

from __future__ import annotations

import functools
from typing import Any

from ...models import unwrap_causal_lm
from ..serving import Row
from ..shared import head_log_probs, is_served, log_prob_options, replace_method, restore_method, run_in_forward
from .protocol import served_base

__all__ = ["serve", "unserve"]

_METHOD = "_get_sequence_logps"  # the method replaced
_A2PO_NAMES = frozenset("logits model_kwarg_keys selective_log_softmax sum".split())


def _sequence_log_probs(model, input_ids, attention_mask, logits_to_keep, options):
    causal_lm = unwrap_causal_lm(model)
    outputs = causal_lm.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = outputs.last_hidden_state[:, -(logits_to_keep + 1) : -1]  # the positions that predict the completion
    per_token = head_log_probs(causal_lm, hidden, input_ids[:, -logits_to_keep:], options).log_probs
    return (per_token * attention_mask[:, -logits_to_keep:].to(per_token.device)).sum(dim=1)


def serve(trainer: Any, row: Row, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (a TRL ``A2POTrainer``): the policy's and the reference's sequence log-probabilities of the
    sampled completions through the fused op. Returns whether it is served.

    Raises:
        TRLProtocolError: TRL's ``_get_sequence_logps`` is not the one replicated here.
    """
    if is_served(vars(trainer).get(_METHOD)):
        return True
    if served_base(trainer, row, _METHOD, _A2PO_NAMES) is None:
        return False
    op_options = log_prob_options(options)
    method = getattr(trainer, _METHOD)

    @functools.wraps(method)
    def _get_sequence_logps(model, input_ids, attention_mask, logits_to_keep):
        return run_in_forward(
            trainer, model, _sequence_log_probs, input_ids, attention_mask, logits_to_keep, op_options
        )

    replace_method(trainer, _METHOD, _get_sequence_logps)
    return True


def unserve(trainer: Any, row: Row) -> bool:
    """Undo :func:`serve` on ``trainer``; returns whether it was served."""
    del row
    return restore_method(trainer, _METHOD)
