"""Fused linear + cross-entropy: kernels, chunked autograd Function, public op, naive reference."""

from .functional import (
    CrossEntropyOutputs,
    FusedLinearCrossEntropy,
    TokenOutputs,
    fused_linear_cross_entropy,
    fused_linear_log_probs,
    start_valid_token_count,
)
from .inputs import loss_weights, shift_labels
from .naive import naive_distribution_statistics, naive_linear_cross_entropy, naive_logits, naive_token_outputs
from .options import (
    LOG_PROBS_KEYWORDS,
    LOSS_KEYWORDS,
    OP_NAME,
    CrossEntropyOptions,
    ExtraOutputs,
    VocabShard,
    build_options,
    check_flag,
)
from .vocab_parallel import is_dtensor

__all__ = [
    "LOG_PROBS_KEYWORDS",
    "LOSS_KEYWORDS",
    "OP_NAME",
    "CrossEntropyOptions",
    "CrossEntropyOutputs",
    "FusedLinearCrossEntropy",
    "TokenOutputs",
    "ExtraOutputs",
    "VocabShard",
    "build_options",
    "fused_linear_cross_entropy",
    "check_flag",
    "fused_linear_log_probs",
    "is_dtensor",
    "loss_weights",
    "naive_distribution_statistics",
    "naive_linear_cross_entropy",
    "naive_logits",
    "naive_token_outputs",
    "shift_labels",
    "start_valid_token_count",
]
