"""Fused linear + cross-entropy: kernels, chunked autograd Function, public op, naive reference."""

from .functional import (
    CrossEntropyOutputs,
    FusedLinearCrossEntropy,
    TokenOutputs,
    fused_linear_cross_entropy,
    fused_linear_log_probs,
    start_valid_token_count,
)
from .naive import naive_distribution_statistics, naive_linear_cross_entropy, naive_logits, naive_token_outputs
from .vocab_parallel import VocabShard

__all__ = [
    "CrossEntropyOutputs",
    "FusedLinearCrossEntropy",
    "TokenOutputs",
    "VocabShard",
    "fused_linear_cross_entropy",
    "fused_linear_log_probs",
    "naive_distribution_statistics",
    "naive_linear_cross_entropy",
    "naive_logits",
    "naive_token_outputs",
    "start_valid_token_count",
]
