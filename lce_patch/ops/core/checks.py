"""Input checks every op shares; each message starts with the name of the op that raised it (``op_name``).

Checks of shapes, dtypes and option values run in an op's public function, where ``torch.compile`` traces
them. Checks that read tensor *values* (labels in range, the count of valid labels, ``num_items_in_batch``)
run inside the chunked forward, which is one opaque operator under ``torch.compile``: on the CPU they raise a
``ValueError``; on CUDA they are asynchronous device asserts, so they cost no host sync.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch


def fail(message: str, op_name: str) -> None:
    raise ValueError(f"{op_name}: {message}")


def check_int(name: str, value, *, op_name: str, minimum: int | None = None, allow_none: bool = False) -> None:
    """A Python integer (not a bool, not a tensor), at least ``minimum``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(f"{name} must be a Python int{' or None' if allow_none else ''}, got {value!r}", op_name)
    if minimum is not None and value < minimum:
        fail(f"{name} must be >= {minimum}, got {value}", op_name)


def check_real(
    name: str,
    value,
    *,
    op_name: str,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
    allow_none: bool = False,
) -> None:
    """A finite real number (not a bool, not a tensor) within the given bounds."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        fail(f"{name} must be a finite number{' or None' if allow_none else ''}, got {value!r}", op_name)
    if positive and not value > 0:
        fail(f"{name} must be > 0, got {value}", op_name)
    if minimum is not None and value < minimum:
        fail(f"{name} must be >= {minimum}, got {value}", op_name)
    if maximum is not None and value > maximum:
        fail(f"{name} must be <= {maximum}, got {value}", op_name)


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_flag(name: str, value, op_name: str) -> None:
    """A Python bool."""
    if not isinstance(value, bool):
        fail(f"{name} must be a bool, got {value!r}", op_name)


def is_integer(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds integers (not bool, float or complex)."""
    return tensor.dtype != torch.bool and not tensor.dtype.is_floating_point and not tensor.dtype.is_complex


def check_tensors(tensors: dict[str, Any], optional: tuple[str, ...], op_name: str) -> dict[str, torch.Tensor]:
    """Each value a tensor (or None for a name in ``optional``); returns the tensors given, by name."""
    for name, value in tensors.items():
        allow_none = name in optional
        if not isinstance(value, torch.Tensor) and not (allow_none and value is None):
            fail(
                f"{name} must be a torch.Tensor{' or None' if allow_none else ''}, got {type(value).__name__}", op_name
            )
    return {name: value for name, value in tensors.items() if value is not None}


def check_hidden(hidden: torch.Tensor, op_name: str) -> None:
    """Hidden states [N, D] or [B, T, D]."""
    if hidden.dim() not in (2, 3):
        fail(f"hidden must be a [N, D] or [B, T, D] tensor, got shape {tuple(hidden.shape)}", op_name)


def check_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    op_name: str,
    prefix: str = "",
    nonempty: bool = True,
) -> None:
    """A head ``weight`` [V, D] over ``hidden``'s last dim D, with ``bias`` [V] or None; V >= 1 when
    ``nonempty``. ``prefix`` names the head's arguments (``"teacher_"``)."""
    if weight.dim() != 2:
        fail(f"{prefix}weight must be a [V, D] tensor, got shape {tuple(weight.shape)}", op_name)
    if weight.shape[1] != hidden.shape[-1]:
        fail(
            f"{prefix}hidden's last dim ({hidden.shape[-1]}) does not match {prefix}weight's D ({weight.shape[1]})",
            op_name,
        )
    if nonempty and weight.shape[0] == 0:
        fail(f"{prefix}weight has an empty vocabulary (V = 0)", op_name)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        fail(f"{prefix}bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}", op_name)


def check_one_device(tensors: dict[str, torch.Tensor], op_name: str) -> None:
    """Every tensor on one device."""
    if len({t.device for t in tensors.values()}) > 1:
        fail(f"all inputs must be on one device, got { ({n: str(t.device) for n, t in tensors.items()}) }", op_name)


def check_float_dtypes(tensors: dict[str, torch.Tensor], names: tuple[str, ...], op_name: str) -> None:
    """The tensors of ``names`` (those present) in a dtype of ``FLOAT_DTYPES``."""
    for name in names:
        t = tensors.get(name)
        if t is not None and t.dtype not in FLOAT_DTYPES:
            fail(
                f"{name} has unsupported dtype {t.dtype}; expected float32, float16, bfloat16 or float64 "
                "(float64 on the torch backend)",
                op_name,
            )


def check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int, op_name: str) -> None:
    """Labels must be ``ignore_index`` or in [0, V). On CUDA an asynchronous device assert, no sync."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if labels.device.type != "cuda":
        if bad.any():
            first = labels[bad][0].item()
            fail(f"label {first} is outside [0, {vocab_size}) and is not ignore_index ({ignore_index})", op_name)
    else:
        torch._assert_async(
            ~bad.any(),
            f"{op_name}: a label is outside [0, {vocab_size}) and is not ignore_index ({ignore_index})",
        )


def check_weights(weights: torch.Tensor, name: str, op_name: str) -> None:
    """Loss weights must be finite and >= 0. On CUDA an asynchronous device assert, no sync."""
    ok = (torch.isfinite(weights) & (weights >= 0)).all()
    if weights.device.type != "cuda":
        if not bool(ok):
            bad = weights[~(torch.isfinite(weights) & (weights >= 0))][0].item()
            fail(f"{name} must be finite and >= 0, got {bad}", op_name)
    else:
        torch._assert_async(ok, f"{op_name}: {name} must be finite and >= 0")


def num_items_tensor(num_items_in_batch, device: torch.device, op_name: str) -> torch.Tensor:
    """``num_items_in_batch`` (a number or a one-element real tensor) as a 0-d tensor on ``device``; its
    value is checked inside the op (:func:`check_num_items`)."""
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            fail(
                "num_items_in_batch must be a number or a one-element tensor, got shape "
                f"{tuple(num_items_in_batch.shape)}",
                op_name,
            )
        if num_items_in_batch.dtype == torch.bool or num_items_in_batch.dtype.is_complex:
            fail(f"num_items_in_batch must be a real number, got a {num_items_in_batch.dtype} tensor", op_name)
        return num_items_in_batch.to(device).reshape(())
    check_real("num_items_in_batch", num_items_in_batch, minimum=0, op_name=op_name)
    # a fill kernel, not a copy from host memory (which would sync with the GPU)
    return torch.full((), float(num_items_in_batch), dtype=torch.float64, device=device)


def check_num_items(
    num_items: torch.Tensor,
    num_valid: torch.Tensor,
    *,
    op_name: str,
    none_counted: str = "every label is ignored",
    counted: str = "valid labels",
) -> None:
    """``num_items_in_batch`` (a 0-d tensor) must be finite and > 0, or 0 when nothing counts (no valid
    label; the loss is then 0, as for a batch whose labels are all ignored). ``num_valid``: 0-d count;
    ``none_counted`` and ``counted`` word the message for the op."""
    ok = torch.isfinite(num_items) & ((num_items > 0) | ((num_items == 0) & (num_valid == 0)))
    if num_items.device.type != "cuda":
        if not bool(ok):
            fail(
                f"num_items_in_batch must be finite and > 0 (0 only when {none_counted}), got "
                f"{num_items.item()} with {int(num_valid)} {counted}",
                op_name,
            )
    else:
        torch._assert_async(ok, f"{op_name}: num_items_in_batch must be finite and > 0 (0 only when {none_counted})")


def selected_rows(valid: torch.Tensor, num_valid_tokens: int | None, op_name: str) -> torch.Tensor | None:
    """Indices (int64, ascending) of the rows whose label is not ignored (``valid``: bool [N]), or None
    when every row counts.

    The GEMMs are sized on the host, so the count must be known there: ``num_valid_tokens`` when the
    caller has it (checked on the device, no sync), else one host sync here, except while a CUDA graph
    is being captured (no sync allowed): then every row is processed, with the same result.
    """
    if num_valid_tokens is None:
        if valid.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        num_valid = int(valid.sum())  # the one host sync of skip_ignored=True
    else:
        num_valid = num_valid_tokens
        if valid.device.type != "cuda":
            counted = int(valid.sum())
            if counted != num_valid:
                fail(f"num_valid_tokens={num_valid} but {counted} labels are not ignore_index", op_name)
        else:
            torch._assert_async(
                valid.sum() == num_valid,
                f"{op_name}: num_valid_tokens differs from the number of labels that are not ignore_index",
            )
    if num_valid == valid.shape[0]:
        return None
    # A stable sort puts the valid rows first, in order; no nonzero() (it would sync).
    return torch.argsort((~valid).to(torch.uint8), stable=True)[:num_valid]
