"""The math: fused ops with their kernels, autograd Functions and references. No transformers here."""

from .core.calls import calls_since, op_calls
from .linear_cross_entropy import (
    FusedLinearCrossEntropy,
    TokenOutputs,
    VocabShard,
    fused_linear_cross_entropy,
    fused_linear_log_probs,
    start_valid_token_count,
)
from .linear_divergence import fused_linear_divergence
from .linear_sparse_divergence import fused_linear_sparse_divergence

__all__ = [
    "FusedLinearCrossEntropy",
    "TokenOutputs",
    "VocabShard",
    "calls_since",
    "fused_linear_cross_entropy",
    "fused_linear_divergence",
    "fused_linear_log_probs",
    "fused_linear_sparse_divergence",
    "op_calls",
    "start_valid_token_count",
]
