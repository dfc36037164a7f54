"""lce_patch: train Hugging Face language models without materializing the logits."""

from .ops import FusedLinearCrossEntropy, TokenOutputs, fused_linear_cross_entropy, fused_linear_log_probs

__version__ = "0.1.0"

__all__ = [
    "FusedLinearCrossEntropy",
    "TokenOutputs",
    "__version__",
    "fused_linear_cross_entropy",
    "fused_linear_log_probs",
]
