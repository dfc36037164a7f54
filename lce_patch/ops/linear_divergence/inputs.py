"""The divergence op's input checks, in one place: the student's and the teacher's heads and hidden states, the
mask; shapes, dtypes and devices, each error naming the argument."""

from __future__ import annotations

import torch

from ..core import checks
from .options import OP_NAME
from .options import fail as _fail


def check_inputs(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, mask) -> None:
    """Raise a ValueError naming the argument unless hidden [..., D] / teacher_hidden [..., D_t] (same leading
    shape), weight [V, D] / teacher_weight [V_t >= V, D_t], the optional biases and mask (leading shape, bool or
    0/1 integer) are float tensors on one device, each head in one dtype."""
    tensors = checks.check_tensors(
        {
            "hidden": hidden,
            "weight": weight,
            "teacher_hidden": teacher_hidden,
            "teacher_weight": teacher_weight,
            "bias": bias,
            "teacher_bias": teacher_bias,
            "mask": mask,
        },
        ("bias", "teacher_bias", "mask"),
        OP_NAME,
    )
    checks.check_hidden(hidden, OP_NAME)
    if tuple(teacher_hidden.shape[:-1]) != tuple(hidden.shape[:-1]) or teacher_hidden.dim() != hidden.dim():
        _fail(
            f"teacher_hidden must have hidden's leading shape {tuple(hidden.shape[:-1])} (its own hidden size "
            f"last), got {tuple(teacher_hidden.shape)}"
        )
    checks.check_head(hidden, weight, bias, OP_NAME)
    checks.check_head(teacher_hidden, teacher_weight, teacher_bias, OP_NAME, prefix="teacher_", nonempty=False)
    if teacher_weight.shape[0] < weight.shape[0]:
        _fail(
            f"the teacher's vocabulary ({teacher_weight.shape[0]} rows) is smaller than the student's "
            f"({weight.shape[0]}): the two distributions must be over the same tokens"
        )
    if mask is not None:
        if tuple(mask.shape) != tuple(hidden.shape[:-1]):
            _fail(
                f"mask must have shape {tuple(hidden.shape[:-1])} (hidden without its last dim), got {tuple(mask.shape)}"
            )
        if mask.dtype != torch.bool and not checks.is_integer(mask):
            _fail(f"mask must be a bool or integer (0/1) tensor, got {mask.dtype}")
    checks.check_one_device(tensors, OP_NAME)
    checks.check_float_dtypes(
        tensors, ("hidden", "weight", "teacher_hidden", "teacher_weight", "bias", "teacher_bias"), OP_NAME
    )
    if len({weight.dtype, hidden.dtype}) > 1:
        _fail(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have one dtype")
    if len({teacher_weight.dtype, teacher_hidden.dtype}) > 1:
        _fail(
            f"teacher_hidden ({teacher_hidden.dtype}) and teacher_weight ({teacher_weight.dtype}) must have one dtype"
        )
