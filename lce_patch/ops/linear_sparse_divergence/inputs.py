"""The sparse divergence op's input checks, in one place: the student's head and hidden states, the teacher's
candidates and their log-probabilities, the candidate mask; shapes, dtypes and devices, each error naming the
argument."""

from __future__ import annotations

import torch

from ..core import checks
from .options import OP_NAME, fail


def check_inputs(hidden, weight, bias, candidate_ids, teacher_logprobs, candidate_mask) -> None:
    """Raise a ValueError naming the argument unless hidden [..., D], weight [V, D], the optional bias [V],
    candidate_ids [..., K] (integer), teacher_logprobs [..., K] (float) and candidate_mask [..., K] (bool or 0/1
    integer) are tensors of consistent shapes on one device."""
    tensors = checks.check_tensors(
        {
            "hidden": hidden,
            "weight": weight,
            "candidate_ids": candidate_ids,
            "teacher_logprobs": teacher_logprobs,
            "candidate_mask": candidate_mask,
            "bias": bias,
        },
        ("bias", "candidate_mask"),
        OP_NAME,
    )
    checks.check_hidden(hidden, OP_NAME)
    checks.check_head(hidden, weight, bias, OP_NAME)
    leading = tuple(hidden.shape[:-1])
    if candidate_ids.dim() != hidden.dim() or tuple(candidate_ids.shape[:-1]) != leading:
        fail(
            f"candidate_ids must have shape {(*leading, 'K')} (hidden's leading shape, K last), got {tuple(candidate_ids.shape)}"
        )
    if candidate_ids.shape[-1] == 0:
        fail("candidate_ids has no candidate slot (K = 0)")
    if not checks.is_integer(candidate_ids):
        fail(f"candidate_ids must be an integer tensor, got {candidate_ids.dtype}")
    if tuple(teacher_logprobs.shape) != tuple(candidate_ids.shape):
        fail(
            f"teacher_logprobs must have candidate_ids' shape {tuple(candidate_ids.shape)}, got "
            f"{tuple(teacher_logprobs.shape)} (one teacher log-probability per candidate)"
        )
    if candidate_mask is not None:
        if tuple(candidate_mask.shape) != tuple(candidate_ids.shape):
            fail(
                f"candidate_mask must have candidate_ids' shape {tuple(candidate_ids.shape)}, got "
                f"{tuple(candidate_mask.shape)}"
            )
        if candidate_mask.dtype != torch.bool and not checks.is_integer(candidate_mask):
            fail(f"candidate_mask must be a bool or integer (0/1) tensor, got {candidate_mask.dtype}")
    checks.check_one_device(tensors, OP_NAME)
    checks.check_float_dtypes(tensors, ("hidden", "weight", "bias", "teacher_logprobs"), OP_NAME)
    if hidden.dtype != weight.dtype:
        fail(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have one dtype")
