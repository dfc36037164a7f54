"""The options of one call of ``fused_linear_sparse_divergence``: built and checked once by the public function,
passed whole to the chunked forward and backward; the custom operators take its fields as their arguments
(:mod:`..core.schema`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..core import checks, reduction

OP_NAME = "fused_linear_sparse_divergence"
REDUCTIONS = reduction.REDUCTIONS
# The tail bucket's clamp (TRL's ``_add_tail_bucket``): the candidates' log-mass is at most this, so the tail's
# mass is at least 1 - exp(-1e-7) and its log finite.
TAIL_LOG_MASS_MAX = -1e-7

fail = functools.partial(checks.fail, op_name=OP_NAME)
check_real = functools.partial(checks.check_real, op_name=OP_NAME)


@dataclass(frozen=True)
class SparseDivergenceOptions:
    """Everything about one call that is not a tensor.

    The student's final logits are ``softcap * tanh(logit_scale * raw / softcap) / temperature`` (no tanh when
    ``softcap`` is None). ``beta``: the generalized JSD's mixture weight (0 forward KL, 1 reverse KL).
    ``add_tail_bucket``: a (K+1)-th bucket holds the mass outside the candidates; else ``renormalize`` says whether
    both distributions are renormalized over the candidates (or taken as they are). ``reduction``: "mean" (over
    positions with a candidate), "sum" or "none"; a scalar reduction becomes ``1 / num_items`` when a count is
    given. ``chunk_size``: token rows per chunk (None: the shared chunk policy). ``entropy``: also compute the
    student's per-token entropy. ``needs_grad``: whether (hidden, weight, bias) get gradients. ``fp32_logits``:
    the logits kept as the GEMM's fp32 accumulator (bf16/fp16 inputs). ``fp32_weight_grad``: a bf16 dW
    accumulated in fp32 over the chunks and rounded once.
    """

    beta: float = 0.0
    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0
    add_tail_bucket: bool = False
    renormalize: bool = True
    reduction: str = "mean"
    chunk_size: int | None = None
    use_triton: bool = False
    entropy: bool = False
    needs_grad: tuple[bool, bool, bool] = (False, False, False)
    fp32_logits: bool = False
    fp32_weight_grad: bool = False

    def __post_init__(self) -> None:
        check_real("beta", self.beta)
        if not 0 <= self.beta <= 1:
            fail(f"beta must be in [0, 1], got {self.beta}")
        check_real("temperature", self.temperature, positive=True)
        check_real("softcap", self.softcap, positive=True, allow_none=True)
        check_real("logit_scale", self.logit_scale)
        for name in ("add_tail_bucket", "renormalize", "use_triton", "entropy", "fp32_logits", "fp32_weight_grad"):
            checks.check_flag(name, getattr(self, name), OP_NAME)
        if self.add_tail_bucket and not self.renormalize:
            fail("renormalize=False applies without the tail bucket; add_tail_bucket=True never renormalizes")
        if self.reduction not in REDUCTIONS:
            fail(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        checks.check_int("chunk_size", self.chunk_size, minimum=1, allow_none=True, op_name=OP_NAME)
        for name in ("beta", "temperature", "softcap", "logit_scale"):
            value = getattr(self, name)
            if value is not None:  # a Python float from any real number (an int, a numpy scalar)
                object.__setattr__(self, name, float(value))
        object.__setattr__(self, "needs_grad", tuple(bool(need) for need in self.needs_grad))

    @property
    def scalar(self) -> bool:
        """Whether the loss is one number (its gradients are then computed in the forward)."""
        return self.reduction != "none"

    @property
    def derivative_scale(self) -> float:
        """d(final logit) / d(raw logit) without the softcap's ``1 - tanh**2``."""
        return self.logit_scale / self.temperature
