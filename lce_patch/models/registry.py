"""Declarative registry: what differs between the supported causal-LM heads.

Each entry says where the decoder and the LM head live, how the head transforms its logits
(final-logit softcap, logit scale) and whether the model adds a MoE load-balancing loss. The one
shared forward in ``forward.py`` does the work for all of them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class HeadConfig:
    """How the LM head turns ``hidden @ W.T`` into the logits the loss sees.

    ``logits = softcap * tanh(logit_scale * (hidden @ W.T + b) / softcap)`` (no tanh when ``softcap`` is None).
    """

    softcap: float | None = None
    logit_scale: float = 1.0


@dataclass(frozen=True)
class MoeSpec:
    """Attributes of the CausalLM instance that drive the load-balancing aux loss (as HF's forward reads them)."""

    num_experts: str = "num_experts"
    top_k: str = "num_experts_per_tok"
    coef: str = "router_aux_loss_coef"
    loss_func: str = "load_balancing_loss_func"  # looked up in the model class's own module


@dataclass(frozen=True)
class ArchSpec:
    """One registry entry, keyed by ``config.model_type``."""

    model_type: str
    class_name: str  # the CausalLM class, in transformers.models.<package>.modeling_<package>
    package: str = ""  # transformers.models.<package>; defaults to model_type
    module: str = ""  # full module name of the class, overrides ``package`` (unregistered models)
    decoder: str = "model"  # attribute holding the decoder (returns last_hidden_state)
    head: str = "lm_head"  # attribute holding the output projection
    softcap_attr: str | None = None  # config field of the final-logit softcap (None: no softcap)
    logit_scale_attr: str | None = None  # config field multiplying the logits
    logit_divisor_attr: str | None = None  # config field dividing the logits
    moe: MoeSpec | None = None
    decoder_gets_labels: bool = False  # HF's forward passes labels= to the decoder
    decoder_extra_kwargs: tuple[tuple[str, Any], ...] = ()  # constant kwargs HF's forward adds to the decoder call
    registered: bool = field(default=True, compare=False)

    @property
    def module_name(self) -> str:
        if self.module:
            return self.module
        package = self.package or self.model_type
        return f"transformers.models.{package}.modeling_{package}"

    def load_class(self) -> type:
        return getattr(importlib.import_module(self.module_name), self.class_name)

    def head_config(self, config) -> HeadConfig:
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        softcap = getattr(config, self.softcap_attr, None) if self.softcap_attr else None
        scale = 1.0
        if self.logit_scale_attr and getattr(config, self.logit_scale_attr, None) is not None:
            scale = float(getattr(config, self.logit_scale_attr))
        if self.logit_divisor_attr and getattr(config, self.logit_divisor_attr, None) is not None:
            scale = scale / float(getattr(config, self.logit_divisor_attr))
        return HeadConfig(softcap=None if softcap is None else float(softcap), logit_scale=scale)

    def transform_logits(self, logits: torch.Tensor, config) -> torch.Tensor:
        """Apply the head's logit transform in the same operation order as Hugging Face's forwards."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        if self.logit_scale_attr and getattr(config, self.logit_scale_attr, None) is not None:
            logits = logits * getattr(config, self.logit_scale_attr)
        if self.logit_divisor_attr and getattr(config, self.logit_divisor_attr, None) is not None:
            logits = logits / getattr(config, self.logit_divisor_attr)
        cap = getattr(config, self.softcap_attr, None) if self.softcap_attr else None
        if cap is not None:
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        return logits


_MOE = MoeSpec()

_ENTRIES = (
    ArchSpec("llama", "LlamaForCausalLM"),
    ArchSpec("mistral", "MistralForCausalLM"),
    ArchSpec("mixtral", "MixtralForCausalLM", moe=_MOE),
    ArchSpec("gemma", "GemmaForCausalLM"),
    ArchSpec("gemma2", "Gemma2ForCausalLM", softcap_attr="final_logit_softcapping"),
    ArchSpec("gemma3_text", "Gemma3ForCausalLM", package="gemma3", softcap_attr="final_logit_softcapping"),
    # Gemma3ForConditionalGeneration: text loss only; HF applies no softcap in this class.
    ArchSpec(
        "gemma3",
        "Gemma3ForConditionalGeneration",
        decoder_gets_labels=True,
        decoder_extra_kwargs=(("return_dict", True),),
    ),
    ArchSpec("qwen2", "Qwen2ForCausalLM"),
    ArchSpec("qwen2_moe", "Qwen2MoeForCausalLM", moe=_MOE),
    ArchSpec("qwen3", "Qwen3ForCausalLM"),
    ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", moe=_MOE),
    ArchSpec("cohere", "CohereForCausalLM", logit_scale_attr="logit_scale"),
    ArchSpec("granite", "GraniteForCausalLM", logit_divisor_attr="logits_scaling"),
)

REGISTRY: dict[str, ArchSpec] = {entry.model_type: entry for entry in _ENTRIES}


def supported_architectures() -> list[str]:
    """The ``config.model_type`` values :func:`lce_patch.apply_fused_lce` patches."""
    return sorted(REGISTRY)


def inferred_spec(model: torch.nn.Module) -> ArchSpec:
    """A best-guess entry for an unregistered model (checked against its own loss before use)."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = model.get_output_embeddings()
    head_name = next((name for name, child in model.named_children() if child is head), None)
    decoder_name = getattr(model, "base_model_prefix", "model")
    if head_name is None or not hasattr(model, decoder_name):
        raise ValueError(
            f"{type(model).__name__}: cannot locate the decoder ({decoder_name!r}) and the output embedding "
            "as direct children of the model"
        )
    moe = None
    if all(hasattr(model, name) for name in (_MOE.num_experts, _MOE.top_k, _MOE.coef)):
        moe = _MOE
    # The same config fields TRL's fused head reads.
    scale_attr = next(
        (a for a in ("logit_scale", "output_multiplier", "lm_head_multiplier") if getattr(text_config, a, None)),
        None,
    )
    divisor_attr = None
    if scale_attr is None and getattr(text_config, "logits_scaling", None) is not None:
        divisor_attr = "logits_scaling"
    return ArchSpec(
        model_type=getattr(config, "model_type", type(model).__name__),
        class_name=type(model).__name__,
        module=type(model).__module__,
        decoder=decoder_name,
        head=head_name,
        softcap_attr="final_logit_softcapping" if getattr(text_config, "final_logit_softcapping", None) else None,
        logit_scale_attr=scale_attr,
        logit_divisor_attr=divisor_attr,
        moe=moe,
        registered=False,
    )
