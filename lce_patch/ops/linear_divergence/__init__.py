"""Fused linear divergence (distillation): chunked autograd Function, public op, naive reference."""

from .functional import fused_linear_divergence
from .naive import naive_linear_divergence, token_divergence

__all__ = ["fused_linear_divergence", "naive_linear_divergence", "token_divergence"]
