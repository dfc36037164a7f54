"""Patching Hugging Face causal LMs so that training computes the loss without materializing the logits.

``apply_fused_lce(model)`` replaces the model's ``forward`` (per instance, or per class for a
``model_type`` string) with one shared forward driven by a small declarative registry
(``registry.py``); ``revert_fused_lce`` undoes it.
"""

from .forward import LCEOptions, fused_causal_lm_loss
from .head import head_call, resolve_head_module, unwrap_causal_lm
from .patch import apply_fused_lce, get_head_config, is_patched, revert_fused_lce
from .registry import REGISTRY, ArchSpec, HeadConfig, MoeSpec, supported_architectures

__all__ = [
    "REGISTRY",
    "ArchSpec",
    "HeadConfig",
    "LCEOptions",
    "MoeSpec",
    "apply_fused_lce",
    "fused_causal_lm_loss",
    "get_head_config",
    "head_call",
    "is_patched",
    "resolve_head_module",
    "revert_fused_lce",
    "supported_architectures",
    "unwrap_causal_lm",
]
