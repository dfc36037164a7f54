"""Fixtures of the op tests (devices.py says where each backend's tests run)."""

from __future__ import annotations

import pytest
import torch

from .devices import GPU


@pytest.fixture(autouse=True)
def _no_tf32(monkeypatch):
    # The fp32 checks compare with float64 to ~1e-5: on the GPU every fp32 GEMM must run in fp32, not TF32
    # (10 bits of mantissa).
    if GPU:
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
