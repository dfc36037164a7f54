"""Patching Hugging Face causal LMs so that training computes the loss without materializing the logits.

``apply_fused_lce(model)`` (``patch.py``; the class lookups in ``lookups.py``, the refusals in ``refusals.py``,
the self-check of unregistered models in ``self_check.py``) checks its options (``options.py``) and wraps the model's own
``forward`` (per instance, or per class for a ``model_type`` string) so that, in training, its LM head computes
the fused loss and its ``loss_function`` returns it (``forward.py``, ``head.py``, with PEFT adapters on the head
resolved by ``adapters.py``), or runs unfused where it cannot stand in (``fallback.py``); the loss options
Hugging Face's loss lacks (class and token weights, the ``lse`` / ``token_accuracy`` outputs) are in
``loss_options.py``; the registry (``registry.py``) derives each architecture's logit transform;
``revert_fused_lce`` undoes it.
"""

from .adapters import fsdp1_inner, resolve_head_module, unwrap_causal_lm
from .forward import loss_only
from .head import head_call
from .loss_options import EXTRA_OUTPUTS
from .options import OPTION_DEFAULTS, OPTIONS, OPTIONS_ATTR, LCEOptions, Option, option_names
from .patch import (
    apply_fused_lce,
    get_head_config,
    is_patched,
    options_text,
    patch_summary,
    revert_fused_lce,
    unannounced,
)
from .registry import (
    REGISTRY,
    UNSUPPORTED,
    ArchSpec,
    HeadConfig,
    inline_loss_types,
    supported_architectures,
    unsupported_architectures,
)

__all__ = [
    "EXTRA_OUTPUTS",
    "OPTIONS",
    "OPTIONS_ATTR",
    "OPTION_DEFAULTS",
    "REGISTRY",
    "ArchSpec",
    "HeadConfig",
    "LCEOptions",
    "Option",
    "UNSUPPORTED",
    "apply_fused_lce",
    "fsdp1_inner",
    "get_head_config",
    "head_call",
    "inline_loss_types",
    "is_patched",
    "loss_only",
    "option_names",
    "options_text",
    "patch_summary",
    "resolve_head_module",
    "revert_fused_lce",
    "supported_architectures",
    "unsupported_architectures",
    "unannounced",
    "unwrap_causal_lm",
]
