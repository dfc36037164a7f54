"""Where each backend's tests run: the torch backend on the CPU (its float64 references there too), the
Triton kernels on the GPU under ``LCE_TEST_GPU=1`` and under the CPU interpreter otherwise
(``TRITON_INTERPRET=1``, set in tests/conftest.py).

A test parametrized over ``BACKENDS`` builds its inputs on the CPU and places them with
``on(backend, ...)`` (or ``.to(device_of(backend))``); its results go back to the CPU to be compared
with the CPU references (``rel_err`` does that itself).
"""

from __future__ import annotations

import os

import torch

from lce_patch.ops.core.backend import triton_usable

GPU = os.environ.get("LCE_TEST_GPU") == "1"
if GPU and not torch.cuda.is_available():
    raise RuntimeError("LCE_TEST_GPU=1 asks for the Triton kernels on a CUDA GPU, but torch sees none")
CPU = torch.device("cpu")
TRITON_DEVICE = torch.device("cuda") if GPU else CPU
BACKENDS = ["torch"] + (["triton"] if triton_usable(TRITON_DEVICE) else [])
# bf16 operands on the Triton backend: compiled kernels run them, the CPU interpreter does not
# (tl.dot in bf16 is broken there).
TRITON_BF16 = GPU


def device_of(backend: str) -> torch.device:
    """The device a backend's inputs live on: the Triton device for "triton", the CPU otherwise."""
    return TRITON_DEVICE if backend == "triton" else CPU


def on(backend: str, *tensors):
    """``tensors`` moved to ``device_of(backend)`` (None stays None): the tensor for one, a tuple for several.

    A copy to another device keeps the dtype but not every layout (``Tensor.to`` keeps only dense strides:
    a sliced or expanded view arrives contiguous), so layout tests place their bases and take the views
    there; and a copy of a leaf is no leaf, so tests make their leaves after placing them.
    """
    device = device_of(backend)
    moved = tuple(None if t is None else t.to(device) for t in tensors)
    return moved[0] if len(moved) == 1 else moved


def placed(options: dict, device: torch.device) -> dict:
    """``options`` with their tensors (``num_items_in_batch``) moved to ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
