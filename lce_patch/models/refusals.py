"""The errors refusing a model or a model_type string: each says why and what to do instead."""

from __future__ import annotations

import difflib
import re
from typing import Any

import torch

from .adapters import resolve_head_module
from .lookups import (
    inline_loss_of,
    is_lm_class,
    mapped_classes,
    mapping_names,
    output_embeddings,
    plain_linear_head,
    registered_classes,
)
from .registry import REGISTRY, UNSUPPORTED

_EXAMPLES = ("llama", "gemma2", "gemma3", "mistral", "qwen3")
_ALLOW_UNREGISTERED_HINT = (
    "To patch it anyway, apply_fused_lce(model, allow_unregistered=True) checks the fused loss and every gradient "
    "against the model's own forward on a test batch and patches the model if they agree (as they do when its LM "
    "head is a Linear layer applied once to the last hidden state and its loss is computed by self.loss_function)."
)


def _supported() -> str:
    """Where the supported types are listed: the registered ones are counted (on an older transformers,
    supported_architectures() leaves out those computing their loss inline there, which reading every class's
    forward would take too long to count here); the examples are those supported on the installed version."""
    examples = ", ".join(t for t in _EXAMPLES if t in REGISTRY and inline_loss_of_type(t) is None)
    return f"Supported: the {len(REGISTRY)} model types of lce_patch.supported_architectures(), e.g. {examples}."


def inline_loss_of_type(model_type: str) -> str | None:
    """Why a registered ``model_type``'s classes cannot be patched on the installed transformers (one computes its
    loss inline there), or None."""
    return next(filter(None, map(inline_loss_of, mapped_classes(model_type))), None)


def _normalized(model_type: str) -> str:
    """A model_type without case and separators: 'Qwen-3', 'qwen_3' and 'qwen3' are one key."""
    return re.sub(r"[-_. ]", "", model_type.lower())


def _closest_types(model_type: str) -> list[str]:
    """The registered types ``model_type`` may mean: the one equal up to case and separators, else the closest."""
    by_key = {_normalized(t): t for t in sorted(REGISTRY)}
    key = _normalized(model_type)
    if key in by_key:
        return [by_key[key]]
    return [by_key[k] for k in difflib.get_close_matches(key, by_key, n=3)]


def _type_string_hint(model_type: str) -> str:
    """Why a model_type string is refused, and the registered types it may mean.

    allow_unregistered is never suggested: a class patch has no instance to check.
    """
    if model_type in UNSUPPORTED:
        return f": {UNSUPPORTED[model_type]}. {_supported()}"
    inline = inline_loss_of_type(model_type) if model_type in REGISTRY else None
    if inline is not None:
        return f": {inline}, which the fused loss cannot stand in for. {_supported()}"
    if model_type in mapping_names():
        return f": lce_patch has not verified this model type of the installed transformers. {_supported()}"
    refused = {_normalized(t): t for t in UNSUPPORTED}.get(_normalized(model_type))
    if refused is not None:
        return f". Did you mean {refused!r}? That type is refused too: {UNSUPPORTED[refused]}. {_supported()}"
    closest = [repr(t) for t in _closest_types(model_type)]
    if not closest:
        return f". {_supported()}"
    options = closest[0] if len(closest) == 1 else f"{', '.join(closest[:-1])} or {closest[-1]}"
    return (
        f". Did you mean {options}? (model_type strings are config.model_type values; "
        f"lce_patch.supported_architectures() lists all {len(REGISTRY)})"
    )


def _lm_class_hint(model_type: str | None) -> str:
    """How to load a model of ``model_type`` with its language-model head."""
    import transformers
    from transformers.models.auto import modeling_auto

    for mapping, auto_class in (
        (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "AutoModelForCausalLM"),
        (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "AutoModelForImageTextToText"),
    ):
        names = mapping.get(model_type, ())
        for name in (names,) if isinstance(names, str) else names:
            if hasattr(transformers, name):
                return f"load it with {name} (or {auto_class})"
    return f"transformers has no causal-LM class for model_type {model_type!r}"


def _unregistered_reason(model: torch.nn.Module) -> str | None:
    """Why an instance is not registered, where more can be said than its model_type."""
    model_type = getattr(model.config, "model_type", None)
    if model_type in UNSUPPORTED:
        return UNSUPPORTED[model_type]
    inline = inline_loss_of(type(model))
    if inline is not None:
        return f"{inline}, which the fused loss cannot stand in for"
    head = output_embeddings(model)
    if head is None:
        return "its LM head is not exposed by get_output_embeddings()"
    if not plain_linear_head(model):
        return f"its LM head ({type(head).__name__}) is not a plain torch.nn.Linear and may transform the logits"
    bases = registered_classes(model)
    if bases:
        return f"it overrides the forward of {bases[0].__name__}, which may change the loss"
    return None


def _self_check_applies(model: torch.nn.Module) -> bool:
    """Whether allow_unregistered can patch the model: a type not refused outright, a floating-point head weight."""
    head = output_embeddings(model)
    if getattr(model.config, "model_type", None) in UNSUPPORTED or head is None or inline_loss_of(type(model)):
        return False
    try:
        weight = getattr(resolve_head_module(head), "weight", None)
    except NotImplementedError:
        return False
    return isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 2


def refusal(target: Any, reason: str | None = None, self_checked: bool = False) -> ValueError:
    """The error refusing a model_type string or a model instance, with the hint that applies to it.

    ``reason`` replaces the one derived from the model; ``self_checked``: allow_unregistered's check already ran.
    """
    if isinstance(target, str):
        return ValueError(f"lce_patch: {target!r} is not a supported architecture{_type_string_hint(target)}")
    name = type(target).__name__
    model_type = getattr(target.config, "model_type", None)
    if output_embeddings(target) is None and not is_lm_class(target):
        return ValueError(
            f"lce_patch: {name} has no language-model head (get_output_embeddings() gives none), so there is no "
            f"language-model loss to fuse: {_lm_class_hint(model_type)}."
        )
    reason = reason or _unregistered_reason(target)
    message = f"lce_patch: {name} (model_type={model_type!r}) is not a supported architecture"
    message += f": {reason}." if reason else "."
    if model_type not in REGISTRY:
        message += f" {_supported()}"
    elif not is_lm_class(target):  # e.g. BertForMaskedLM: the registered 'bert' is its causal LM
        message += f" The {model_type!r} entry is its causal language model: {_lm_class_hint(model_type)}."
    if not self_checked and _self_check_applies(target):
        message += f" {_ALLOW_UNREGISTERED_HINT}"
    return ValueError(message)
