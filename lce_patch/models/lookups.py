"""Which classes and model types an instance belongs to, as transformers' auto mappings and the registry name them."""

from __future__ import annotations

import functools

import torch

from .adapters import head_leaves, lora_linear_class, peft_classes
from .forward import unpatched
from .registry import REGISTRY, inline_loss_reason


@functools.cache
def mapping_names() -> dict[str, tuple[str, ...]]:
    """model_type -> the causal-LM and image-text-to-text class names of transformers' auto mappings."""
    from transformers.models.auto import modeling_auto

    names: dict[str, tuple[str, ...]] = {}
    for mapping in (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    ):
        for model_type, class_names in mapping.items():
            class_names = (class_names,) if isinstance(class_names, str) else tuple(class_names)
            names[model_type] = tuple(dict.fromkeys(names.get(model_type, ()) + class_names))
    return names


def mapped_classes(model_type: str) -> list[type]:
    """The classes transformers' auto mappings name for ``model_type``."""
    import transformers

    classes = [getattr(transformers, name, None) for name in mapping_names().get(model_type, ())]
    return [cls for cls in dict.fromkeys(classes) if cls is not None]


def registered_classes(model: torch.nn.Module) -> list[type]:
    """The classes of registered types that ``model`` is an instance of.

    The registry is keyed by the auto mappings' model_type, which may differ from the config's
    (Emu3ForCausalLM is mapped under ``emu3`` but its config says ``emu3_text_model``).
    """
    class_names = {cls.__name__ for cls in type(model).__mro__}
    return [
        cls
        for model_type, names in mapping_names().items()
        if model_type in REGISTRY and class_names.intersection(names)
        for cls in mapped_classes(model_type)
        if isinstance(model, cls)
    ]


def inline_loss_of(cls: type) -> str | None:
    """Why ``cls``'s forward in the installed transformers computes its loss inline (not through
    ``self.loss_function``, where the fused loss stands in), naming the class and the version; None where it does
    not (see :func:`lce_patch.models.registry.inline_loss_reason`)."""
    reason = inline_loss_reason(unpatched(cls.forward), cls)
    if reason is None:
        return None
    import transformers

    return f"{cls.__name__}'s forward in the installed transformers {transformers.__version__} {reason}"


def is_registered(model: torch.nn.Module) -> bool:
    """Whether this instance is of a class a registered type maps to, with that class's own forward, and that
    forward computes its loss through ``self.loss_function``."""
    if not plain_linear_head(model) or inline_loss_of(type(model)) is not None:
        return False  # a custom head module may transform the logits; an inline loss cannot be replaced
    forward = unpatched(type(model).forward)
    return any(forward is unpatched(cls.forward) for cls in registered_classes(model))


def plain_linear_head(model: torch.nn.Module) -> bool:
    """Whether every module computing the head runs ``torch.nn.Linear.forward`` (or is PEFT's trainable tokens,
    or PEFT's LoRA layer over a Linear)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        return False
    _, trainable_tokens, _ = peft_classes()
    if trainable_tokens and isinstance(head, trainable_tokens):
        return True
    lora_linear = lora_linear_class()

    def plain(leaf: torch.nn.Module) -> bool:
        if lora_linear is not None and isinstance(leaf, lora_linear):
            leaf = leaf.get_base_layer()
        return type(leaf).forward is torch.nn.Linear.forward

    return all(plain(leaf) for leaf in head_leaves(head))


def output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's LM head module (get_output_embeddings()), or None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, torch.nn.Module) else None


def is_lm_class(model: torch.nn.Module) -> bool:
    """Whether the model is (a subclass of) a class transformers' causal-LM or image-text-to-text mappings name."""
    class_names = {cls.__name__ for cls in type(model).__mro__}
    return any(class_names.intersection(names) for names in mapping_names().values())
