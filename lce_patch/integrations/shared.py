"""What the serving modules share: replacing a trainer's method on one instance (and putting it back), running
served code inside the model wrapper's forward and autocast, the ops' options among a callback's, reading the
code of the methods replicated, and the MoE router's auxiliary loss as TRL adds it to the fused loss.

A served method is set on the trainer instance (the class is never changed) and carries the marker
:data:`~lce_patch.integrations.serving.SERVED`; unserving deletes the instance attribute, so the class's method
shows through again.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from .. import ops as _ops
from ..models import OPTION_DEFAULTS, get_head_config, head_call, option_names
from ..ops.core import fp32_output_gemm_available
from .serving import SERVED

__all__ = [
    "IGNORE_INDEX",
    "code_names",
    "divergence_options",
    "function",
    "head_log_probs",
    "is_served",
    "load_balancing_loss",
    "log_prob_options",
    "overridden",
    "replace_method",
    "restore_method",
    "run_in_forward",
]

IGNORE_INDEX = -100  # what TRL's trainers hard-code


# --------------------------------------------------------------------------------------------------------------------
# Methods replaced on one instance


def is_served(obj: Any) -> bool:
    """Whether ``obj`` is something lce_patch put in place (it carries the marker)."""
    return getattr(obj, SERVED, None) is not None


def replace_method(trainer: Any, name: str, served: Callable[..., Any]) -> None:
    """Set ``served`` as ``trainer``'s ``name`` (on the instance), marked as standing in for the current method."""
    setattr(served, SERVED, getattr(trainer, name))
    setattr(trainer, name, served)


def restore_method(trainer: Any, name: str) -> bool:
    """Remove the served ``name`` from ``trainer``'s instance attributes; whether there was one."""
    if not is_served(vars(trainer).get(name)):
        return False
    delattr(trainer, name)
    return True


def function(cls: type, name: str) -> Any:
    """The function ``cls.name`` as defined (a staticmethod or classmethod unwrapped), without binding it."""
    attribute = inspect.getattr_static(cls, name, None)
    return getattr(attribute, "__func__", attribute)


def overridden(trainer: Any, base: type, methods: tuple[str, ...]) -> list[str]:
    """The ``methods`` of ``base`` that ``trainer``'s class or the instance itself replaces."""
    cls = type(trainer)
    return [name for name in methods if function(cls, name) is not function(base, name) or name in vars(trainer)]


def code_names(fn: Any) -> frozenset[str]:
    """The global and attribute names ``fn``'s code uses, nested functions and comprehensions included."""
    names: set[str] = set()
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    return frozenset(names)


# --------------------------------------------------------------------------------------------------------------------
# Running inside the wrapper's forward


def _forward_redirection() -> Callable[..., Any] | None:
    try:
        from trl.models.utils import _ForwardRedirection
    except ImportError:  # pragma: no cover (TRL without it: call the function directly)
        return None
    return _ForwardRedirection()


def run_in_forward(
    trainer: Any, model: torch.nn.Module, fn: Callable[..., Any], *args: Any, autocast: bool = True, **kwargs: Any
) -> Any:
    """``fn(unwrapped model, *args, **kwargs)`` inside the forward of the wrapper around the model (DDP, FSDP: TRL's forward
    redirection, so the wrapper prepares its gradient reduction as for a plain forward) and, with ``autocast``,
    in the autocast accelerate gives the model's forward under mixed precision (the served code runs the backbone
    and the head in that forward's place)."""
    unwrapped = trainer.accelerator.unwrap_model(model)
    redirect = _forward_redirection()
    with trainer.accelerator.autocast() if autocast else nullcontext():
        if redirect is None or unwrapped is model:
            return fn(unwrapped, *args, **kwargs)
        return redirect(model, unwrapped, fn, unwrapped, *args, **kwargs)


def head_log_probs(
    model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, options: dict[str, Any], **wanted: bool
) -> Any:
    """:func:`lce_patch.fused_linear_log_probs` on ``model``'s head (a causal LM) for ``hidden`` [B, T, D] and
    ``targets`` [B, T] (int64, no ignored token), run inside the ``lm_head`` module's call (FSDP and ZeRO-3 gather
    the weight there; a LoRA adapter on the head is computed by the op); softcap and logit scale from the
    registry. ``options``: the op's (:func:`log_prob_options`); ``wanted``: its ``return_*`` flags. Without
    autocast the head runs in the hidden states' dtype, as the model's forward would."""
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


# --------------------------------------------------------------------------------------------------------------------
# The ops' options among a callback's


def log_prob_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options of :func:`lce_patch.fused_linear_log_probs` among a callback's (``backend``, ``chunk_size``).

    Raises:
        ValueError: an option that changes the model's own loss (``class_weights``, the extra outputs, a
            ``label_smoothing``, ``z_loss`` or ``ignore_index`` off its neutral value): a trainer's loss built on
            per-token log-probabilities never calls that loss.
    """
    for name in option_names(changes_loss=True) + option_names(adds_output=True):
        neutral = OPTION_DEFAULTS[name]
        if neutral is None or neutral is False:  # a loss weight or an extra output: not to be set at all
            if options.get(name) is not None and options.get(name) is not False:
                raise ValueError(
                    f"lce_patch: option {name} cannot apply under TRL's fused LM head, whose loss the trainer "
                    "computes from per-token log-probabilities (the patched model's forward, which honours it, is "
                    "not called); leave it unset"
                )
        elif name in options and options[name] != neutral:
            raise ValueError(
                f"lce_patch: option {name}={options[name]!r} cannot apply under TRL's fused LM head, whose loss is "
                f"the plain negative log-likelihood with ignore index {IGNORE_INDEX}; leave it at {neutral!r}"
            )
    return {k: options[k] for k in option_names(log_probs=True) if options.get(k) is not None}


def divergence_options(options: dict[str, Any], *, fp32_logits: bool = False) -> dict[str, Any]:
    """The options of the divergence ops among a callback's: ``chunk_size``, ``backend`` when it asks for the
    PyTorch one, ``fp32_weight_grad`` (the cross-entropy op's other options do not apply).

    ``fp32_logits``: the TRL code replaced takes the logits in fp32 (its chunked kernels: the GEMMs' fp32 output,
    dW accumulated in fp32), so the op runs with ``fp32_logits`` and ``fp32_weight_grad`` to keep TRL's gradient
    precision (docs: the op page, "Precision of the distillation ops at bf16"); without it, TRL's loss reads bf16
    logits, as the op's default."""
    op_options = {
        name: options[name]
        for name in option_names(divergence=True)
        if options.get(name) is not None and options[name] != OPTION_DEFAULTS[name]
    }
    if op_options.get("backend") != "torch":  # the ops choose their own backend unless asked for PyTorch's
        op_options.pop("backend", None)
    if fp32_logits:
        op_options["fp32_weight_grad"] = True
        # torch before 2.8 has no fp32-output GEMM on CUDA: bf16 logits there (TRL's kernel upcasts its operands)
        if fp32_output_gemm_available(torch.device("cuda")):
            op_options["fp32_logits"] = True
    return op_options


# --------------------------------------------------------------------------------------------------------------------
# The MoE router's auxiliary loss, beside a fused loss


def load_balancing_loss(
    model: torch.nn.Module, text_config: Any, backbone_outputs: Any, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """The MoE router's auxiliary loss (a 0-d tensor) exactly as TRL 1.16's `_fused_forward` computes it from the
    backbone's ``router_logits``."""
    import transformers
    from packaging.version import Version
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    tf_version = Version(transformers.__version__)
    if tf_version < Version("5.0.0"):
        num_experts, top_k = model.num_experts, model.num_experts_per_tok
    else:
        if text_config.model_type == "gpt_oss" and tf_version < Version("5.6.0"):
            num_experts = model.num_experts
        else:
            num_experts = text_config.num_experts
        top_k = text_config.num_experts_per_tok
    return load_balancing_loss_func(backbone_outputs.router_logits, num_experts, top_k, attention_mask)
