"""lce_patch: train Hugging Face language models without materializing the logits."""

from typing import Any

from .models import apply_fused_lce, is_patched, revert_fused_lce, supported_architectures
from .ops import (
    FusedLinearCrossEntropy,
    TokenOutputs,
    VocabShard,
    fused_linear_cross_entropy,
    fused_linear_divergence,
    fused_linear_log_probs,
    fused_linear_sparse_divergence,
)

__version__ = "0.2.0"

__all__ = [
    "FusedLCECallback",
    "FusedLinearCrossEntropy",
    "TokenOutputs",
    "VocabShard",
    "__version__",
    "apply_fused_lce",
    "fused_linear_cross_entropy",
    "fused_linear_divergence",
    "fused_linear_log_probs",
    "fused_linear_sparse_divergence",
    "is_patched",
    "revert_fused_lce",
    "supported_architectures",
]


def __getattr__(name: str) -> Any:
    # FusedLCECallback imports the transformers Trainer stack (seconds): load it on first use.
    if name == "FusedLCECallback":
        from .integrations.trainer import FusedLCECallback

        return FusedLCECallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
