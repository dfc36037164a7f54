"""TRL's experimental ``ServerDistillationTrainer`` served by :func:`lce_patch.fused_linear_sparse_divergence`
(distillation from a teacher's top-K).

``ServerDistillationTrainer.compute_loss`` (TRL 1.16) runs the student for its full ``[B, T, V]`` logits, fetches the
teacher's top-K (``beta == 0``) or top-1 and sampled-token log-probabilities (``beta > 0``) from its vLLM server
and computes a divergence over that sparse support. :func:`serve` replaces ``compute_loss`` on one trainer instance
with the same loss from the backbone's last hidden states: the teacher request is TRL's own method, the head's weight
is read inside its module's call, softcap and logit scale come from lce_patch's registry, and the loss runs inside
the student wrapper's forward (TRL's forward redirection) and the autocast accelerate gives the model's forward.
Evaluation that asks for the outputs (``return_outputs=True``) keeps TRL's method.

Detection is by feature: the trainer must derive from TRL's class, and the methods replaced or replicated must use
the names they use in TRL 1.16, else :class:`~lce_patch.integrations.trl.protocol.TRLProtocolError`; a subclass that
overrides one of them keeps TRL's path, with a warning. :func:`unserve` restores TRL's method.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from ...models import get_head_config, head_call, unwrap_causal_lm
from ...ops import fused_linear_sparse_divergence
from ..serving import Row
from ..shared import divergence_options, is_served, overridden, replace_method, restore_method, run_in_forward
from .protocol import check_names

__all__ = ["serve", "unserve"]

# TRL 1.16's methods whose work is replicated here, with the names their code uses
_SERVER_NAMES = {
    "compute_loss": frozenset(
        "F _compute_prompt_length _compute_server_forward_kl_loss _compute_server_sparse_top_1_divergence_loss "
        "_get_teacher_token_logprobs_from_server beta bool cat current_gradient_accumulation_steps full_like "
        "log_softmax logits model shape temperature torch training where".split()
    ),
    "_compute_server_forward_kl_loss": frozenset(
        "_add_tail_bucket _jsd_divergence _reduce_divergence_loss device dtype float full gather logsumexp "
        "loss_add_tail torch where".split()
    ),
    "_compute_server_sparse_top_1_divergence_loss": frozenset(
        "ValueError _compute_sparse_top_1_divergence_loss _get_reverse_kl_top_1_tokens any beta int isfinite item "
        "squeeze sum torch unsqueeze where".split()
    ),
    "_compute_sparse_top_1_divergence_loss": frozenset(
        "_add_tail_bucket _jsd_divergence _reduce_divergence_loss beta bool cat device dtype float full gather "
        "logsumexp loss_add_tail ones_like stack torch unsqueeze where zeros_like".split()
    ),
    "_reduce_divergence_loss": frozenset("Tensor bool clamp_min device isinstance max mean size sum to torch".split()),
    "_get_reverse_kl_top_1_tokens": frozenset("argmax reverse_kl_top_1_mode".split()),
}


def _server_divergence(trainer, student, hidden, teacher_result, completion_tokens, labels, options):
    """The loss of TRL's ``_compute_server_forward_kl_loss`` (``beta == 0``) or
    ``_compute_server_sparse_top_1_divergence_loss`` (``beta > 0``) on the student's hidden states [B, T, D]."""
    required = labels != -100
    topk_ids, topk_logps = teacher_result["topk_token_ids"], teacher_result["topk_logprobs"]
    beta = float(trainer.beta)
    if beta > 0:
        actual = teacher_result["actual_logprobs"]
        checks = [("actual-token logprobs for required reverse-KL", actual)]
        if beta < 1:
            checks.append(("top-1 logprobs for required forward-KL", topk_logps.squeeze(-1)))
        for what, values in checks:  # TRL's own checks and messages
            missing = required & ~torch.isfinite(values)
            if missing.any():
                raise ValueError(
                    f"Teacher server is missing {what} positions: {int(missing.sum().item())}/"
                    f"{int(required.sum().item())}."
                )
        actual = torch.where(required, actual, torch.zeros_like(actual))
        reverse_ids = completion_tokens  # "sampled", the only mode the server path allows
        if beta == 1:
            ids, teacher_logps = reverse_ids.unsqueeze(-1), actual.unsqueeze(-1)
            mask = torch.ones_like(ids, dtype=torch.bool)
        else:
            top1 = topk_ids.squeeze(-1)
            top1_logps = torch.where(required, topk_logps.squeeze(-1), torch.zeros_like(actual))
            ids = torch.stack([top1, reverse_ids], dim=-1)
            teacher_logps = torch.stack([top1_logps, actual], dim=-1)
            mask = torch.stack([torch.ones_like(required), reverse_ids != top1], dim=-1)
    else:
        ids, teacher_logps, mask = topk_ids, topk_logps, topk_logps > float("-inf")
    mask = mask & required.unsqueeze(-1)
    count = required.sum().clamp_min(1)  # TRL's "batchmean" over the labelled positions
    lm_head = unwrap_causal_lm(student).get_output_embeddings()
    transform = get_head_config(student)

    def score(weight, bias, hidden):
        device = weight.device.type
        if torch.is_autocast_enabled(device):  # the head in the dtype TRL's model call computes it in
            dtype = torch.get_autocast_dtype(device)
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        hidden = hidden.to(device=weight.device, dtype=weight.dtype)
        return fused_linear_sparse_divergence(
            hidden,
            weight,
            ids.to(weight.device),
            teacher_logps.to(weight.device),
            candidate_mask=mask.to(weight.device),
            beta=beta,
            temperature=float(trainer.temperature),
            add_tail_bucket=bool(trainer.loss_add_tail),
            reduction="sum",
            num_items_in_batch=count.to(weight.device),
            bias=bias,
            softcap=transform.softcap,
            logit_scale=transform.logit_scale,
            **options,
        )

    return head_call(lm_head, score, hidden)


def _server_loss(trainer, model, inputs, options):
    """``ServerDistillationTrainer.compute_loss`` of TRL 1.16 (without ``return_outputs``) through the op. The student
    part (backbone and loss) runs inside the wrapper's forward and accelerate's autocast, as TRL's model call does;
    the teacher request outside both, as in TRL."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    completion_labels = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, -100))
    labels = torch.cat([torch.full_like(prompt_ids, -100), completion_labels], dim=1)
    inputs = {
        **inputs,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "prompt_attention_mask": prompt_mask,
    }
    prompt_length = trainer._compute_prompt_length(inputs)
    labels = inputs["labels"][:, prompt_length:]
    completion_tokens = inputs["input_ids"][:, prompt_length:]
    teacher_result = trainer._get_teacher_token_logprobs_from_server(inputs, prompt_length)
    comp_len = teacher_result["actual_logprobs"].shape[1]

    def student_loss(student):
        backbone = unwrap_causal_lm(student).base_model
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        hidden = hidden[:, prompt_length - 1 : -1][:, :comp_len]
        return _server_divergence(
            trainer, student, hidden, teacher_result, completion_tokens[:, :comp_len], labels[:, :comp_len], options
        )

    loss = run_in_forward(trainer, model, student_loss)
    if trainer.model.training:
        loss = loss / trainer.current_gradient_accumulation_steps
    return loss


def serve(trainer: Any, row: Row, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (TRL's experimental ``ServerDistillationTrainer``); returns whether it is served.

    Raises:
        TRLProtocolError: TRL's methods are not the ones replicated here.
    """
    name = row.name
    base = row.base_of(trainer)
    if base is None:
        return False
    method = trainer.compute_loss
    if is_served(method):
        return True
    for method_name, known in _SERVER_NAMES.items():
        check_names(name, base, method_name, known, unwrap=True)
    replaced = overridden(trainer, base, tuple(_SERVER_NAMES))
    if replaced or getattr(trainer, "reverse_kl_top_1_mode", "sampled") != "sampled":
        reason = f"overrides {name}'s {', '.join(replaced)}" if replaced else "asks for reverse_kl_top_1_mode"
        warnings.warn(
            f"lce_patch: {type(trainer).__name__} {reason}; it keeps TRL's own loss, which builds the full [tokens x "
            "vocabulary] logits.",
            stacklevel=3,
        )
        return False
    op_options = divergence_options(options)  # TRL's loss reads the model's logits, in the compute dtype

    @functools.wraps(method)
    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:  # evaluation that keeps the student's outputs (logits): TRL's own loss
            return method(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        return _server_loss(trainer, model, inputs, op_options)

    replace_method(trainer, "compute_loss", compute_loss)
    return True


def unserve(trainer: Any, row: Row) -> bool:
    """Undo :func:`serve` on ``trainer``; returns whether it was served."""
    del row
    return restore_method(trainer, "compute_loss")
