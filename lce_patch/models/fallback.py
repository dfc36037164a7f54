"""When the fused loss cannot stand in for what the user set up on a patched model (:func:`unfused_reason`):
a custom ``loss_function``, a hook on the LM head or on the model's output, or a subclass that overrides a
class-patched ``forward``. Such a call runs the model's own, unfused forward, with one warning per model and
reason (:func:`warn_unfused`).

Hooks that distributed wrappers and the libraries around the model put there (FSDP, ZeRO-3, accelerate,
transformers, PEFT, TRL) only gather, place or record tensors: they keep the fused path.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from .adapters import head_leaves
from .head import JobSlot
from .options import OPTIONS_ATTR

# Packages whose forward hooks (on the head or the model) only gather, place or record tensors (FSDP,
# ZeRO-3, accelerate, transformers' output capture, PEFT): they never change the logits the loss sees.
_TRUSTED_HOOK_PACKAGES = frozenset({"torch", "deepspeed", "accelerate", "transformers", "peft", "trl", "lce_patch"})


def _hook_package(hook: Any) -> str:
    while isinstance(hook, functools.partial):
        hook = hook.func
    hook = getattr(hook, "__func__", hook)
    module = getattr(hook, "__module__", None) or type(hook).__module__ or ""
    return module.split(".")[0]


def _user_hooks(module: torch.nn.Module, backward: bool = False) -> list[Any]:
    """The forward (post-)hooks on ``module``, its own and the global ones, that no trusted package put there;
    with ``backward``, its (and the global) module backward hooks too."""
    from torch.nn.modules import module as module_module

    hooks = [*module._forward_hooks.values(), *module_module._global_forward_hooks.values()]
    if backward:
        hooks += [
            *module._backward_hooks.values(),
            *module._backward_pre_hooks.values(),
            *module_module._global_backward_hooks.values(),
            *module_module._global_backward_pre_hooks.values(),
        ]
    return [hook for hook in hooks if _hook_package(hook) not in _TRUSTED_HOOK_PACKAGES]


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


def unfused_reason(model: torch.nn.Module, patched_forward: Any, want_logits: bool, user_loss: Any) -> str | None:
    """Why this call must run the model's own forward instead of the fused loss (None: it need not).

    ``patched_forward`` is the function the call entered (a class patch's, reached from ``type(model)``; it
    carries the name of the forward it replaced); ``user_loss`` the ``loss_function`` the user gave the model,
    or None for Hugging Face's default.
    """
    if OPTIONS_ATTR not in model.__dict__ and type(model).forward is not patched_forward:
        return (
            f"{type(model).__name__} overrides forward, and lce_patch patched its parent class "
            f"{patched_forward.__qualname__.split('.')[0]} by model_type: it cannot tell whether that "
            "forward reads the logits. Patch the instance (apply_fused_lce(model, allow_unregistered=True) checks "
            "its loss and gradients first) or revert_fused_lce(model_type)"
        )
    if user_loss is not None:
        from transformers.loss.loss_utils import LOSS_MAPPING

        if user_loss is not LOSS_MAPPING["ForCausalLM"]:
            return (
                f"{type(model).__name__} has a custom loss_function ({_hook_name(user_loss)}), which the fused "
                "cross-entropy cannot compute. Remove it (the fused loss is Hugging Face's causal-LM loss), or "
                "revert_fused_lce(model)"
            )
    for leaf in head_leaves(model.get_output_embeddings()):
        hooks = _user_hooks(leaf, backward=True)
        if hooks:
            return (
                f"a hook ({_hook_name(hooks[0])}) on {type(model).__name__}'s LM head could read or change the "
                "logits or their gradient, which the fused loss never builds. Remove the hook, or "
                "revert_fused_lce(model)"
            )
    if not want_logits:
        hooks = _user_hooks(model)
        if hooks:
            return (
                f"a forward hook ({_hook_name(hooks[0])}) on {type(model).__name__} could read its output's "
                "logits, which the fused loss does not return. Remove the hook, or revert_fused_lce(model)"
            )
    return None


def warn_unfused(model: torch.nn.Module, slot: JobSlot, reason: str) -> None:
    """Warn once per model (``slot``: its job slot) and reason that its calls run unfused."""
    if reason in slot.warned:
        return
    slot.warned.add(reason)
    warnings.warn(
        f"lce_patch: {reason}. Until then, {type(model).__name__}'s calls with labels run its own forward, which "
        "builds the full [tokens x vocabulary] logits and their gradient (the memory the fused loss saves).",
        stacklevel=4,
    )
