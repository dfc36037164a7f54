"""The cross-entropy op's inputs checked and prepared for the chunked op: shapes, dtypes and devices (errors that
name the argument), the low-rank term and the loss weights, the autocast cast, the label shift."""

from __future__ import annotations

import math

import torch

from ..core import checks
from .options import OP_NAME, fail


def _shape(value) -> tuple | str:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def check_inputs(hidden, weight, bias, labels) -> None:
    tensors = checks.check_tensors(
        {"hidden": hidden, "weight": weight, "labels": labels, "bias": bias}, ("bias",), OP_NAME
    )
    checks.check_hidden(hidden, OP_NAME)
    checks.check_head(hidden, weight, bias, OP_NAME)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        fail(f"labels must have shape {tuple(hidden.shape[:-1])} (hidden without its last dim), got {_shape(labels)}")
    if not checks.is_integer(labels):
        fail(f"labels must be an integer tensor, got {labels.dtype}")
    checks.check_one_device(tensors, OP_NAME)
    checks.check_float_dtypes(tensors, ("hidden", "weight", "bias"), OP_NAME)


def low_rank_inputs(low_rank_hidden, low_rank_weight, hidden, weight) -> tuple | None:
    """The low-rank term (checked, cast to ``hidden``'s compute dtype), or None when not given."""
    if low_rank_hidden is None and low_rank_weight is None:
        return None
    if low_rank_hidden is None or low_rank_weight is None:
        fail("low_rank_hidden and low_rank_weight go together: pass both or neither")
    for name, value in (("low_rank_hidden", low_rank_hidden), ("low_rank_weight", low_rank_weight)):
        if not isinstance(value, torch.Tensor):
            fail(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in checks.FLOAT_DTYPES:
            fail(f"{name} has unsupported dtype {value.dtype}; expected a float dtype")
        if value.device != hidden.device:
            fail(f"{name} is on {value.device}, hidden on {hidden.device}: all inputs must be on one device")
    rank = low_rank_weight.shape[-1] if low_rank_weight.dim() == 2 else None
    if low_rank_weight.dim() != 2 or low_rank_weight.shape[0] != weight.shape[0] or rank == 0:
        fail(
            f"low_rank_weight must be a [V, r] tensor with V = {weight.shape[0]} and r >= 1, got {_shape(low_rank_weight)}"
        )
    if tuple(low_rank_hidden.shape) != (*hidden.shape[:-1], rank):
        fail(
            f"low_rank_hidden must have shape {(*hidden.shape[:-1], rank)} (hidden's with the rank r = {rank} of "
            f"low_rank_weight last), got {_shape(low_rank_hidden)}"
        )
    # Cast like PEFT's LoRA output, which is added to the base layer's and returned in its dtype.
    return low_rank_hidden.to(hidden.dtype).reshape(-1, rank), low_rank_weight.to(hidden.dtype)


def loss_weights(token_weights, class_weights, label_shape, vocab_size, device, options) -> tuple:
    """(token_weights [N], class_weights [V]) checked and flattened, None where not given. They weigh a scalar
    loss and get no gradient."""
    if token_weights is None and class_weights is None:
        return None, None
    if not options.scalar:
        fail("token_weights and class_weights weigh a scalar loss; with reduction='none' multiply the losses")
    checked = []
    for name, value, shape in (
        ("token_weights", token_weights, tuple(label_shape)),
        ("class_weights", class_weights, (vocab_size,)),
    ):
        if value is None:
            checked.append(None)
            continue
        if not isinstance(value, torch.Tensor):
            fail(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")
        flat = (math.prod(shape),)
        if tuple(value.shape) not in (shape, flat):
            what = f"labels' shape, or {flat}" if name == "token_weights" else "V"
            fail(f"{name} must have shape {shape} ({what}), got {tuple(value.shape)}")
        if not value.dtype.is_floating_point:
            fail(f"{name} must be a floating-point tensor, got {value.dtype}")
        if value.device != device:
            fail(f"{name} is on {value.device}, hidden on {device}: all inputs must be on one device")
        checked.append(value.detach().reshape(-1))  # values checked inside the op (no graph break)
    return tuple(checked)


def shift_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Target of position t is labels[..., t + 1]; the last position of each row is ignored."""
    shifted = torch.full_like(labels, ignore_index)
    shifted[..., :-1] = labels[..., 1:]
    return shifted


def compute_dtype(hidden, weight, bias) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Cast like F.linear would: to the autocast dtype when autocast is on, else require one dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return hidden.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        fail(
            f"hidden ({hidden.dtype}), weight ({weight.dtype})"
            + (f" and bias ({bias.dtype})" if bias is not None else "")
            + " must share one dtype (or run under torch.autocast)"
        )
    return hidden, weight, bias
