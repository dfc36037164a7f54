"""Triton helpers every op's kernels share: the logit transform, a NaN-keeping max, a per-lane argmax, log1p, an
in-place scale.

Imported only where Triton is installed (:data:`lce_patch.ops.core.backend.HAS_TRITON`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def transform_logits(raw, logit_scale, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """Final logit from the GEMM output; also returns tanh (for the softcap derivative)."""
    if HAS_SOFTCAP:
        # tanh(x) = 1 - 2 / (1 + exp(2x)), with x = logit_scale * raw / softcap: one exponential and
        # one division per logit (Triton's fp32 division is the 2-ulp div.full), one op fewer than a
        # sigmoid of a quotient; ~1 ms less per Gemma-2 step (NOTES v10). exp(2x) = inf gives t = 1
        # exactly, exp(2x) = 0 gives t = -1, NaN stays NaN.
        t = 1.0 - 2.0 / (1.0 + tl.exp(raw * (2.0 * logit_scale / softcap)))
        z = t * (softcap * inv_temperature)
    else:
        t = raw * 0.0
        z = raw * (logit_scale * inv_temperature)
    return z, t


@triton.jit
def lane_argmax(z, cols, block_max, lane_max, lane_arg):
    """Each lane's argmax after folding in a block: the first column of the block's max in the lane (a NaN's
    when the max is NaN) where that max beats the lane's so far, strictly (its earlier columns win ties) or as
    the lane's first NaN; else the lane's column so far. A lane whose logits are all -inf (or padding) keeps its
    initial 0: it can hold the row's max only when every logit is -inf, where the argmax is 0."""
    hit = (z == block_max[:, None]) | (z != z)
    block_arg = tl.min(tl.where(hit, cols, 2147483647), 1)
    take = (block_max > lane_max) | ((block_max != block_max) & (lane_max == lane_max))
    return tl.where(take, block_arg, lane_arg)


@triton.jit
def log1p(x):
    """log(1 + x) to a few ulps for small x (Goldberg's correction; Triton has no portable log1p)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _scale_block(x_ptr, numel, block, scale, BLOCK: tl.constexpr):
    """``x[block * BLOCK : (block + 1) * BLOCK] *= scale``, the product in fp32 and rounded once to x's dtype."""
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(x_ptr + offsets, (x.to(tl.float32) * scale).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def scale_inplace_kernel(x_ptr, numel, scale_ptr, BLOCK: tl.constexpr):
    """``x *= scale`` for a scale held in device memory, skipped when it is exactly 1.

    The backward of the scalar loss multiplies the precomputed dW (up to GBs) by grad_output,
    which is almost always 1.0; testing it on the device avoids both a host sync and a full pass
    over dW. Multiplying by 1 is exact, so skipping it changes no bit.
    """
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        _scale_block(x_ptr, numel, tl.program_id(0), scale, BLOCK)


@triton.jit
def scale_pair_inplace_kernel(x_ptr, x_numel, y_ptr, y_numel, x_programs, scale_ptr, BLOCK: tl.constexpr):
    """``x *= scale`` and ``y *= scale`` in one launch (the first ``x_programs`` programs take x), skipped when
    the scale is exactly 1, as :func:`scale_inplace_kernel`: a scalar loss's dh and dW scaled by one launch."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        pid = tl.program_id(0)
        if pid < x_programs:
            _scale_block(x_ptr, x_numel, pid, scale, BLOCK)
        else:
            _scale_block(y_ptr, y_numel, pid - x_programs, scale, BLOCK)
