"""Which architectures are patched, and how each one's head transforms its logits.

Every entry is *derived*: the patched forward runs the model's own ``forward`` and only replaces
what its LM head and its ``loss_function`` compute (``forward.py``), so an entry needs nothing but
the head's logit transform (final-logit softcap, logit scale or divisor). That transform is read
from the model: which of the known config fields its ``forward`` uses (``_TRANSFORM_FIELDS``), and
their values on the model, its config or its text config. A type is *registered* when it is named
in ``_REGISTERED`` below, i.e. when the test over every causal-LM type of the installed transformers
(``tests/models/test_every_architecture.py``) proved it equal to the unpatched model. Explicit
entries (``_OVERRIDES``) exist only where derivation is wrong; ``UNSUPPORTED`` says why each
remaining type is refused. A model of any other type is patched with ``allow_unregistered=True``
after a self-check of its loss and every gradient against its own forward (``patch.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadConfig:
    """How the LM head turns ``hidden @ W.T`` into the logits the loss sees.

    ``logits = softcap * tanh(logit_scale * (hidden @ W.T + b) / softcap)`` (no tanh when ``softcap`` is None).
    """

    softcap: float | None = None
    logit_scale: float = 1.0


@dataclass(frozen=True)
class ArchSpec:
    """One architecture: the names of the fields holding its head's logit transform.

    A field is looked up on the model instance, then its config, then its text config (the first one
    that is set wins), the places Hugging Face's forwards read it from.
    """

    model_type: str
    softcap_attr: str | None = None  # final-logit softcap: softcap * tanh(logits / softcap)
    logit_scale_attr: str | None = None  # multiplies the logits
    logit_divisor_attr: str | None = None  # divides the logits
    registered: bool = True

    def head_config(self, model: torch.nn.Module) -> HeadConfig:
        softcap = _field(model, self.softcap_attr)
        scale = 1.0
        multiplier = _field(model, self.logit_scale_attr)
        if multiplier is not None:
            scale *= float(multiplier)
        divisor = _field(model, self.logit_divisor_attr)
        if divisor is not None:
            scale /= float(divisor)
        return HeadConfig(softcap=None if softcap is None else float(softcap), logit_scale=scale)


# The logit transforms Hugging Face heads apply, by the field that drives them: (kind, field).
_TRANSFORM_FIELDS = (
    ("softcap", "final_logit_softcapping"),
    ("softcap", "logits_soft_cap"),
    ("softcap", "output_logit_soft_cap"),
    ("scale", "logit_scale"),
    ("scale", "output_multiplier"),
    ("divisor", "logits_scaling"),
)


def _field(model: torch.nn.Module, name: str | None) -> float | None:
    if name is None:
        return None
    config = model.config
    places = [model, config]
    if hasattr(config, "get_text_config"):
        places.append(config.get_text_config())
    for place in places:
        value = getattr(place, name, None) if place is not model else vars(model).get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
    return None


@functools.cache
def _fields_used_by(forward) -> tuple[tuple[str, str], ...]:
    """The transform fields a forward's source names (empty when the source cannot be read)."""
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return ()
    found = []
    for kind, name in _TRANSFORM_FIELDS:
        # `logit_scale` is a prefix of nothing else we look for; require a word boundary on both sides.
        index = source.find(name)
        while index >= 0:
            before = source[index - 1] if index else " "
            after = source[index + len(name)] if index + len(name) < len(source) else " "
            if not (before.isalnum() or before == "_") and not (after.isalnum() or after == "_"):
                found.append((kind, name))
                break
            index = source.find(name, index + 1)
    return tuple(found)


def derived_spec(forward, model_type: str, registered: bool = False) -> ArchSpec:
    """The entry of a class whose (unpatched) ``forward`` is given, read from its source (see the module docstring)."""
    fields: dict[str, str] = {}
    for kind, name in _fields_used_by(forward):
        fields.setdefault(kind, name)
    spec = ArchSpec(
        model_type=model_type,
        softcap_attr=fields.get("softcap"),
        logit_scale_attr=fields.get("scale"),
        logit_divisor_attr=fields.get("divisor"),
        registered=registered,
    )
    return dataclasses.replace(spec, **_OVERRIDES.get(model_type, {}))


# Where derivation is wrong, the fields to use instead (none needed so far).
_OVERRIDES: dict[str, dict] = {}

# Proven equal to the unpatched model (loss, every gradient, inference logits, generate, revert) by
# tests/models/test_every_architecture.py on transformers 5.23. Adding a type is adding its name.
_REGISTERED = """
llama mistral mixtral gemma gemma2 gemma3 gemma3_text qwen2 qwen2_moe qwen3 qwen3_moe cohere granite
""".split()

# Types of the installed transformers' causal-LM and image-text-to-text mappings that are refused, and why.
UNSUPPORTED: dict[str, str] = {}

REGISTRY: frozenset[str] = frozenset(_REGISTERED)


def supported_architectures() -> list[str]:
    """The ``config.model_type`` values :func:`lce_patch.apply_fused_lce` patches without a self-check."""
    return sorted(REGISTRY)
