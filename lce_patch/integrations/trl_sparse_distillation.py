"""TRL's experimental ``AsyncDistillationTrainer`` and ``ServerDistillationTrainer`` served by
:func:`lce_patch.fused_linear_sparse_divergence` (distillation from a teacher's top-K).

``AsyncDistillationTrainer._compute_loss`` (TRL 1.16) runs the student's backbone, keeps the completion positions
with teacher signal and calls the module function ``_chunked_jsd_loss(hidden_valid, lm_head_weight, lm_head_bias,
logit_scale, final_logit_softcapping, target_ids, teacher_target_logps, valid_candidate_mask, beta, temperature,
add_tail_bucket, teacher_id_idx, num_teachers, chunk_size)``, which projects chunks of positions through the head
(``torch.utils.checkpoint``: the logits are computed twice) and returns the summed divergence and the sums TRL logs
(the divergence, the student's and the teacher's entropy, per-teacher statistics). :func:`serve_async_distillation_
trainer` wraps ``_compute_loss`` on one trainer instance; while that call runs (in that thread) the function answers
through the op with the same arguments and results. The module function is looked up as a global by TRL's method,
so it is replaced once by a dispatcher that runs TRL's own function for every other call (other trainers, other
threads); the dispatcher goes with the last served trainer.

``ServerDistillationTrainer.compute_loss`` (TRL 1.16) runs the student for its full ``[B, T, V]`` logits, fetches the
teacher's top-K (``beta == 0``) or top-1 and sampled-token log-probabilities (``beta > 0``) from its vLLM server
and computes a divergence over that sparse support. :func:`serve_server_distillation_trainer` replaces
``compute_loss`` on one trainer instance with the same loss from the backbone's last hidden states: the teacher
request is TRL's own method, the head's weight is read inside its module's call, softcap and logit scale come from
lce_patch's registry, and the loss runs inside the student wrapper's forward (TRL's forward redirection) and the
autocast accelerate gives the model's forward. Evaluation that asks for the outputs (``return_outputs=True``) keeps
TRL's method.

Detection is by feature: each trainer must derive from TRL's class, and the methods replaced or replicated must use
the names (and the function its parameters) they use in TRL 1.16, else
:class:`~lce_patch.integrations.trl.TRLProtocolError`; a subclass that overrides one of them keeps TRL's path, with a
warning. :func:`unserve_sparse_distillation_trainer` undoes either.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch

from ..models import get_head_config, unwrap_causal_lm
from ..models.head import head_call
from ..ops import fused_linear_sparse_divergence
from .redirect import FunctionRedirect
from .trl_distillation import divergence_options
from .trl_preference import _code_names, _fail, _forward_redirection, _function

__all__ = [
    "serve_async_distillation_trainer",
    "serve_server_distillation_trainer",
    "serve_sparse_distillation_trainer",
    "unserve_sparse_distillation_trainer",
]

_SERVED_ATTR = "__lce_patch_sparse_distillation__"

# --------------------------------------------------------------------------------------------------------------------
# AsyncDistillationTrainer: the module function _chunked_jsd_loss, per served call

_ASYNC = ("trl.experimental.async_distillation.async_distillation_trainer", "AsyncDistillationTrainer")
_ASYNC_FUNCTION = "_chunked_jsd_loss"
_ASYNC_PARAMETERS = (
    "hidden_valid",
    "lm_head_weight",
    "lm_head_bias",
    "logit_scale",
    "final_logit_softcapping",
    "target_ids",
    "teacher_target_logps",
    "valid_candidate_mask",
    "beta",
    "temperature",
    "add_tail_bucket",
    "teacher_id_idx",
    "num_teachers",
    "chunk_size",
)


def _teacher_entropy(teacher_logps, mask, add_tail_bucket):
    """Per position, the entropy of the teacher over the support TRL compares (renormalized, or with the tail)."""
    neg_inf = torch.full((), float("-inf"), dtype=teacher_logps.dtype, device=teacher_logps.device)
    support = torch.where(mask, teacher_logps, neg_inf)
    if add_tail_bucket:
        log_sum = torch.logsumexp(support, dim=-1, keepdim=True).clamp(max=-1e-7)
        support = torch.cat([support, torch.log(-torch.expm1(log_sum))], dim=-1)
        mask = torch.cat([mask, torch.ones_like(mask[..., :1])], dim=-1)
    else:
        support = support - torch.logsumexp(support, dim=-1, keepdim=True)
    safe = torch.where(mask, support, torch.zeros_like(support))
    probs = torch.where(mask, support.exp(), torch.zeros_like(support))
    return torch.nan_to_num(-(probs * safe).sum(dim=-1), nan=0.0)


def _fused_chunked_jsd_loss(
    hidden_valid,
    lm_head_weight,
    lm_head_bias,
    logit_scale,
    final_logit_softcapping,
    target_ids,
    teacher_target_logps,
    valid_candidate_mask,
    beta,
    temperature,
    add_tail_bucket,
    teacher_id_idx,
    num_teachers,
    chunk_size,
    *,
    options: dict[str, Any],
):
    """TRL's function's contract: (loss, divergence sum, student entropy sum, teacher entropy sum, per-teacher
    [count, divergence sum, teacher entropy sum] x teachers), the loss a sum over the positions given."""
    del chunk_size  # the op's own chunking
    weight = lm_head_weight
    hidden = hidden_valid.to(weight.dtype)  # an upcast head keeps its precision
    bias = None if lm_head_bias is None else lm_head_bias.to(weight.dtype)
    per_teacher = teacher_id_idx is not None
    loss, entropy = fused_linear_sparse_divergence(
        hidden,
        weight,
        target_ids,
        teacher_target_logps,
        candidate_mask=valid_candidate_mask,
        beta=float(beta),
        temperature=float(temperature),
        add_tail_bucket=bool(add_tail_bucket),
        reduction="none" if per_teacher else "sum",  # per position only where TRL breaks it down per teacher
        bias=bias,
        softcap=final_logit_softcapping,
        logit_scale=float(logit_scale),
        return_entropy=True,
        **options,
    )
    total = loss.sum() if per_teacher else loss
    with torch.no_grad():
        teacher_entropy = _teacher_entropy(teacher_target_logps.float(), valid_candidate_mask, add_tail_bucket)
        stats = total.new_zeros(3 * num_teachers)
        if per_teacher:
            per_token = loss.detach()
            rows = []
            for index in range(num_teachers):
                chosen = teacher_id_idx == index
                rows += [chosen.sum().float(), per_token[chosen].sum(), teacher_entropy[chosen].sum()]
            stats = torch.stack(rows)
        return_sums = (total.detach().clone(), entropy.sum(), teacher_entropy.sum().to(total.dtype), stats)
    return (total, *return_sums)


_ASYNC_REDIRECT = FunctionRedirect(_ASYNC[0], _ASYNC_FUNCTION, _fused_chunked_jsd_loss, _SERVED_ATTR)


def _base(trainer: Any, module: str, name: str) -> type | None:
    return next((cls for cls in type(trainer).__mro__ if cls.__module__ == module and cls.__name__ == name), None)


def _overridden(trainer: Any, base: type, methods: tuple[str, ...]) -> list[str]:
    cls = type(trainer)
    return [name for name in methods if _function(cls, name) is not _function(base, name) or name in vars(trainer)]


def serve_async_distillation_trainer(trainer: Any, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (TRL's experimental ``AsyncDistillationTrainer``); returns whether it is served.

    Raises:
        TRLProtocolError: TRL's ``_compute_loss`` or ``_chunked_jsd_loss`` is not the one served here.
    """
    module_name, name = _ASYNC
    base = _base(trainer, module_name, name)
    if base is None:
        return False
    if _ASYNC_REDIRECT.is_served(trainer._compute_loss):
        return True
    original = _ASYNC_REDIRECT.original()
    parameters = tuple(inspect.signature(original).parameters) if callable(original) else ()
    if parameters != _ASYNC_PARAMETERS:
        _fail(name, f"its module's {_ASYNC_FUNCTION} has the parameters {parameters}")
    if _ASYNC_FUNCTION not in _code_names(inspect.unwrap(_function(base, "_compute_loss"))):
        _fail(name, f"_compute_loss no longer calls {_ASYNC_FUNCTION}")
    if _overridden(trainer, base, ("_compute_loss",)):
        warnings.warn(
            f"lce_patch: {type(trainer).__name__} overrides {name}'s _compute_loss; it keeps TRL's own chunked loss.",
            stacklevel=3,
        )
        return False
    # TRL's chunked loss: fp32 logits
    _ASYNC_REDIRECT.serve(trainer, "_compute_loss", divergence_options(options, fp32_logits=True))
    return True


# --------------------------------------------------------------------------------------------------------------------
# ServerDistillationTrainer: compute_loss on the backbone's hidden states

_SERVER = ("trl.experimental.server_distillation.server_distillation_trainer", "ServerDistillationTrainer")
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


def _server_loss(trainer, model, inputs, options, redirect):
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

    student = trainer.accelerator.unwrap_model(model)
    with trainer.accelerator.autocast():
        if redirect is None or student is model:
            loss = student_loss(student)
        else:
            loss = redirect(model, student, student_loss, student)
    if trainer.model.training:
        loss = loss / trainer.current_gradient_accumulation_steps
    return loss


def serve_server_distillation_trainer(trainer: Any, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` (TRL's experimental ``ServerDistillationTrainer``); returns whether it is served.

    Raises:
        TRLProtocolError: TRL's methods are not the ones replicated here.
    """
    module_name, name = _SERVER
    base = _base(trainer, module_name, name)
    if base is None:
        return False
    method = trainer.compute_loss
    if getattr(method, _SERVED_ATTR, False):
        return True
    for method_name, known in _SERVER_NAMES.items():
        _check_unwrapped_names(name, base, method_name, known)
    overridden = _overridden(trainer, base, tuple(_SERVER_NAMES))
    if overridden or getattr(trainer, "reverse_kl_top_1_mode", "sampled") != "sampled":
        reason = f"overrides {name}'s {', '.join(overridden)}" if overridden else "asks for reverse_kl_top_1_mode"
        warnings.warn(
            f"lce_patch: {type(trainer).__name__} {reason}; it keeps TRL's own loss, which builds the full [tokens x "
            "vocabulary] logits.",
            stacklevel=3,
        )
        return False
    op_options = divergence_options(options)  # TRL's loss reads the model's logits, in the compute dtype
    redirect = _forward_redirection()

    @functools.wraps(method)
    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:  # evaluation that keeps the student's outputs (logits): TRL's own loss
            return method(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        return _server_loss(trainer, model, inputs, op_options, redirect)

    setattr(compute_loss, _SERVED_ATTR, True)
    trainer.compute_loss = compute_loss
    return True


def _check_unwrapped_names(trainer_name: str, base: type, method: str, known: frozenset[str]) -> None:
    """Raise TRLProtocolError unless TRL's ``base.method`` (under its profiling decorator) uses the ``known`` names."""
    function = _function(base, method)
    if not inspect.isfunction(function):
        _fail(trainer_name, f"it has no function {method}")
    used = _code_names(inspect.unwrap(function))
    if used != known:
        _fail(
            trainer_name,
            f"{method} uses names unknown to this lce_patch ({sorted(used - known)}) or no longer uses known "
            f"ones ({sorted(known - used)})",
        )


# --------------------------------------------------------------------------------------------------------------------


def serve_sparse_distillation_trainer(trainer: Any, options: dict[str, Any]) -> bool:
    """Serve ``trainer`` if it is TRL's experimental async or server distillation trainer; returns whether it is."""
    return serve_server_distillation_trainer(trainer, options) or serve_async_distillation_trainer(trainer, options)


def unserve_sparse_distillation_trainer(trainer: Any) -> bool:
    """Undo :func:`serve_sparse_distillation_trainer` on ``trainer``; returns whether it was served."""
    removed = False
    if getattr(vars(trainer).get("compute_loss"), _SERVED_ATTR, False):
        del trainer.compute_loss
        removed = True
    return _ASYNC_REDIRECT.unserve(trainer, "_compute_loss") or removed
