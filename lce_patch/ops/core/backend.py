"""Which backend runs an op, and the small device-side helpers both backends use.

Triton is optional: without it (or on a device it cannot serve) every op runs its PyTorch backend. On the
CPU the Triton kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``, the tests), and only on
explicit request (``backend="triton"``).
"""

from __future__ import annotations

import os

import torch

from .checks import fail

try:  # Triton is optional: the torch backend needs none of it.
    from . import triton_helpers as _triton_helpers

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the platform
    _triton_helpers = None
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch")


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``."""
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, op_name: str) -> bool:
    """True for the Triton backend, False for torch; raises (naming ``op_name``) for an unusable request."""
    if backend not in BACKENDS:
        fail(f"unknown backend {backend!r}; expected one of {BACKENDS}", op_name)
    if backend == "torch":
        return False
    if backend == "triton" and dtype == torch.float64:
        fail("the triton backend supports float32, float16 and bfloat16; use backend='torch' for float64", op_name)
    usable = triton_usable(device)
    if backend == "triton" and not usable:
        fail(
            f"backend='triton' needs a CUDA tensor and the triton package (or TRITON_INTERPRET=1 on CPU); "
            f"got a tensor on {device}",
            op_name,
        )
    if backend == "auto":  # the CPU interpreter only on explicit request (tests); float64 on torch
        return usable and device.type == "cuda" and dtype != torch.float64
    return True


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of per-row statistics and accumulations: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def next_power_of_2(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The divergence ops' row kernels (one program per row, looping over the vocabulary): the vocabulary block per
# loop iteration, and the program's warps.
ROW_BLOCK_V = 2048
ROW_NUM_WARPS = 8


def row_block(vocab: int) -> int:
    """The vocabulary block of a one-program-per-row kernel over ``vocab`` logits (``ROW_BLOCK_V`` at most)."""
    return min(ROW_BLOCK_V, next_power_of_2(vocab))


_SCALE_BLOCK = 4096


def scale_inplace(grad: torch.Tensor, scale: torch.Tensor, use_triton: bool) -> None:
    """``grad *= scale`` (0-d tensor) without a host sync; free when ``scale`` is exactly 1 on Triton."""
    if use_triton and grad.is_contiguous() and grad.numel() > 0:
        _triton_helpers.scale_inplace_kernel[(cdiv(grad.numel(), _SCALE_BLOCK),)](
            grad, grad.numel(), scale.float().reshape(1), BLOCK=_SCALE_BLOCK
        )
    else:
        grad.mul_(scale)


def scale_all_inplace(grads: list[torch.Tensor], scale: torch.Tensor, use_triton: bool) -> None:
    """:func:`scale_inplace` for each of ``grads``; on Triton two contiguous ones share a launch (a scalar loss's dh
    and dW: the backward is then one launch, the host's only work for it)."""
    pending = []
    for grad in grads:
        if use_triton and grad.is_contiguous() and grad.numel() > 0:
            pending.append(grad)
        else:
            scale_inplace(grad, scale, use_triton)
    scale = scale.float().reshape(1) if pending else scale
    for first, second in zip(pending[::2], pending[1::2], strict=False):
        first_programs = cdiv(first.numel(), _SCALE_BLOCK)
        _triton_helpers.scale_pair_inplace_kernel[(first_programs + cdiv(second.numel(), _SCALE_BLOCK),)](
            first, first.numel(), second, second.numel(), first_programs, scale, BLOCK=_SCALE_BLOCK
        )
    if len(pending) % 2:
        scale_inplace(pending[-1], scale, use_triton)
