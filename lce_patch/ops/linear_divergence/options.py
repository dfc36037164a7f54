"""The options of one call of ``fused_linear_divergence``: checked and built once by the public function, passed
whole to the chunked forward and backward; the custom operators take its fields as their arguments
(:mod:`..core.schema`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..core import checks

OP_NAME = "fused_linear_divergence"
REDUCTIONS = ("mean", "sum", "none")

fail = functools.partial(checks.fail, op_name=OP_NAME)
check_real = functools.partial(checks.check_real, op_name=OP_NAME)


@dataclass(frozen=True)
class DivergenceOptions:
    """Everything about one call that is not a tensor (checked by the public function; floats as Python floats).

    The student's final logits are ``softcap * tanh(logit_scale * raw / softcap) / temperature`` (no tanh when
    ``softcap`` is None), the teacher's the same with its own softcap and scale. ``beta``: the generalized JSD's
    mixture weight. ``reduction``: "mean" (over selected rows), "sum" or "none" ("mean" and "sum" become
    ``1 / num_items`` when a count is given). ``chunk_rows``: token rows per chunk. ``needs_grad``: whether
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
    chunk_rows: int = 1024
    use_triton: bool = False
    needs_grad: tuple[bool, bool, bool] = (False, False, False)
    fp32_logits: bool = False
    fp32_weight_grad: bool = False

    @property
    def scalar(self) -> bool:
        """Whether the loss is one number (its gradients are then computed in the forward)."""
        return self.reduction != "none"
