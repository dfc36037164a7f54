"""The op's name (every message starts with it) and :class:`DivergenceOptions`, everything about one call of
``fused_linear_divergence`` that is not a tensor: built once by the public function (its checks run there, on
construction), passed whole to the chunked forward and backward; the custom operators take its fields as their
arguments (:mod:`..core.schema`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..core import checks, reduction

OP_NAME = "fused_linear_divergence"
REDUCTIONS = reduction.REDUCTIONS

fail = functools.partial(checks.fail, op_name=OP_NAME)
check_real = functools.partial(checks.check_real, op_name=OP_NAME)


@dataclass(frozen=True)
class DivergenceOptions:
    """Everything about one call that is not a tensor, checked on construction (floats become Python floats).

    The student's final logits are ``softcap * tanh(logit_scale * raw / softcap) / temperature`` (no tanh when
    ``softcap`` is None), the teacher's the same with its own softcap and scale. ``beta``: the generalized JSD's
    mixture weight. ``reduction``: "mean" (over selected rows), "sum" or "none" ("mean" and "sum" become
    ``1 / num_items`` when a count is given). ``chunk_size``: token rows per chunk (None: :func:`..core.chunking.two_head_chunk_rows`). ``needs_grad``: whether
    (hidden, weight, bias) get gradients. ``fp32_logits``: both models' logits kept in fp32 from the GEMMs'
    accumulators (bf16/fp16 inputs; no effect on fp32/fp64). ``fp32_weight_grad``: a bf16 dW accumulated in fp32
    over the chunks and rounded once.
    """

    beta: float = 0.5
    temperature: float = 1.0
    softcap: float | None = None
    teacher_softcap: float | None = None
    logit_scale: float = 1.0
    teacher_logit_scale: float = 1.0
    reduction: str = "mean"
    chunk_size: int | None = None
    use_triton: bool = False
    needs_grad: tuple[bool, bool, bool] = (False, False, False)
    fp32_logits: bool = False
    fp32_weight_grad: bool = False

    def __post_init__(self) -> None:
        check_real("beta", self.beta)
        if not 0 <= self.beta <= 1:
            fail(f"beta must be in [0, 1], got {self.beta}")
        check_real("temperature", self.temperature, positive=True)
        check_real("softcap", self.softcap, positive=True, allow_none=True)
        check_real("teacher_softcap", self.teacher_softcap, positive=True, allow_none=True)
        check_real("logit_scale", self.logit_scale)
        check_real("teacher_logit_scale", self.teacher_logit_scale)
        if self.reduction not in REDUCTIONS:
            fail(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        chunk = self.chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            fail(f"chunk_size must be a positive int, got {chunk!r}")
        for name in ("use_triton", "fp32_logits", "fp32_weight_grad"):
            checks.check_flag(name, getattr(self, name), OP_NAME)
        for name in ("beta", "temperature", "softcap", "teacher_softcap", "logit_scale", "teacher_logit_scale"):
            value = getattr(self, name)
            if value is not None:  # a Python float from any real number (an int, a numpy scalar)
                object.__setattr__(self, name, float(value))

    @property
    def scalar(self) -> bool:
        """Whether the loss is one number (its gradients are then computed in the forward)."""
        return self.reduction != "none"
