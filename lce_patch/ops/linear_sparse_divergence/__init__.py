"""Fused linear sparse divergence (distillation from a teacher's top-K): custom operator, public op, reference."""

from .functional import fused_linear_sparse_divergence
from .naive import naive_linear_sparse_divergence

__all__ = ["fused_linear_sparse_divergence", "naive_linear_sparse_divergence"]
