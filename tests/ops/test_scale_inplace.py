"""A scalar loss's backward scales its precomputed gradients in place (core/backend.py): one launch per pair of
contiguous tensors on Triton, skipped when the upstream gradient is exactly 1. Against ``mul_`` on fresh values,
fp32 products rounded once, so equal bit for bit (within one bf16 rounding under the CPU interpreter, whose
fp32 -> bf16 conversion truncates)."""

from __future__ import annotations

import pytest
import torch

from lce_patch.ops.core.backend import scale_all_inplace

from .devices import BACKENDS, TRITON_BF16, on


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("scale", [1.0, 0.37, -2.5])
def test_scaled_in_place_like_mul(backend, count, scale):
    gen = torch.Generator().manual_seed(count)
    shapes = [(5000,), (33, 17), (7,)][:count]
    dtypes = [torch.float32, torch.bfloat16, torch.float32][:count]
    grads = [torch.randn(shape, generator=gen).to(dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
    expected = [(g.float() * scale).to(g.dtype) for g in grads]
    placed = [on(backend, g.clone()) for g in grads]
    if count == 3:  # a non-contiguous one is scaled on its own
        placed[2] = on(backend, torch.zeros(2 * grads[2].numel()))[::2].copy_(placed[2])
    pointers = [g.data_ptr() for g in placed]
    scale_all_inplace(placed, on(backend, torch.tensor(scale)), use_triton=backend == "triton")
    for got, want, pointer in zip(placed, expected, pointers, strict=True):
        assert got.data_ptr() == pointer
        if backend == "triton" and want.dtype == torch.bfloat16 and not TRITON_BF16:
            assert torch.allclose(got.cpu().float(), want.float(), rtol=2**-7, atol=0)
        else:
            assert torch.equal(got.cpu(), want)
