"""Triton kernels of the sparse divergence: per-row statistics of a chunk's logits, and its dense gradient pass.

Design note
-----------
The op distils from a teacher that ships only its top-K: per token position, K candidate ids and the teacher's
log-probabilities there. The student's side needs its log-softmax over the whole vocabulary at those K ids, so
the normalizer (a log-sum-exp over V) is the only part that touches every logit; everything else is ``[C, K]``.

Per chunk of C tokens:

1. one cuBLAS GEMM writes the raw logits ``hidden_c @ W.T (+ bias)`` into a ``[C, V]`` buffer in the compute
   dtype (reused by every chunk), or with ``fp32_logits`` its fp32 accumulator unrounded into an fp32 buffer;
2. ``_row_stats_kernel`` (one program per row) reads the row once: the online log-sum-exp of the final logits
   ``z = softcap * tanh(logit_scale * raw / softcap) / temperature`` and, when asked, the entropy
   ``H = lse - sum p z``, accumulated in the same pass (shifted by the running max and rescaled with it);
3. in torch, the buffer is gathered at the K ids (``[C, K]``), ``s_k = z_k - lse``, and the small loss math
   (``sparse.py``) gives the per-token divergence and ``g_k = dLoss / ds_k``;
4. with a gradient, ``_dense_grad_kernel`` overwrites the row (with ``fp32_logits``: writes a second buffer in
   the compute dtype, the GEMMs' operand) with ``-p * S * dz/draw`` (``S = sum_k g_k``,
   times the row's upstream coefficient); at the K ids ``G = (g_k - p S) * dz/draw`` (repeated ids' ``g`` summed),
   computed in fp32 in torch, is written over the kernel's values (a scatter: each entry rounded once, where
   ``scatter_add_`` into the rounded dense part would round these large, nearly cancelling terms twice);
   ``G = (scatter(g) - p S) * dz/draw`` is the gradient with respect to the raw logits; then ``dh_c = G @ W`` and
   ``dW += G.T @ hidden_c`` (``core.grads.GradAccumulator``).

Memory: the ``[C, V]`` buffer, fp32 vectors of C and ``[C, K]`` temporaries; nothing proportional to N x V.
FLOPs: 6·N·V·D for the three GEMMs (logits, dh, dW; 2·N·V·D without a gradient); the kernels do ~10 (statistics)
and ~8 (gradient) operations per logit with one exponential each (two with a softcap), and are bound by memory:
one read of the buffer for the statistics, one read and one write for the gradient, in the compute dtype (with
``fp32_logits`` the reads are of fp32 and the write goes to the second buffer). The candidates' ``[C, K, K]``
id comparison (to sum repeated ids) is small beside the row passes (K <= a few hundred).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.triton_helpers import max_keep_nan, transform_logits


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    row_stride,
    lse_ptr,
    entropy_ptr,
    vocab_size,
    logit_scale,
    softcap,
    inv_temperature,
    HAS_SOFTCAP: tl.constexpr,
    WANT_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    offsets = tl.arange(0, BLOCK_V)
    running_max = tl.full([], -float("inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK_V], dtype=tl.float32)
    # sum of exp(z - max) * (z - max) per lane, for the entropy: rescaled with the max as sum_exp is
    sum_exp_z = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + offsets
        in_row = cols < vocab_size
        raw = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        z, _ = transform_logits(raw, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
        z = tl.where(in_row, z, -float("inf"))
        new_max = max_keep_nan(running_max, tl.reduce(z, 0, max_keep_nan))
        # the first block holds column 0: the max is finite (or NaN) from then on; before it the sums are 0
        shift = tl.where(running_max == -float("inf"), 0.0, running_max - new_max)
        scale = tl.exp(shift)
        e = tl.exp(z - new_max)
        if WANT_ENTROPY:
            sum_exp_z = (sum_exp_z + sum_exp * shift) * scale + e * tl.where(in_row, z - new_max, 0.0)
        sum_exp = sum_exp * scale + e
        running_max = new_max
    total = tl.sum(sum_exp, 0)
    log_total = tl.log(total)
    tl.store(lse_ptr + row, running_max + log_total)
    if WANT_ENTROPY:
        tl.store(entropy_ptr + row, log_total - tl.sum(sum_exp_z, 0) / total)


@triton.jit
def _dense_grad_kernel(
    logits_ptr,
    row_stride,
    grad_ptr,
    grad_row_stride,
    lse_ptr,
    factor_ptr,
    vocab_size,
    logit_scale,
    softcap,
    inv_temperature,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Write ``p * factor * dz/draw`` to each gradient row (the logits' own row when in place); a row whose factor
    is 0 gets exact zeros (even a non-finite row)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    grad_row = grad_ptr + row * grad_row_stride
    offsets = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    factor = tl.load(factor_ptr + row)
    row_factor = factor * logit_scale * inv_temperature
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + offsets
        in_row = cols < vocab_size
        raw = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        z, tanh = transform_logits(raw, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
        grad = tl.exp(z - lse) * row_factor
        if HAS_SOFTCAP:
            grad = grad * (1.0 - tanh * tanh)
        grad = tl.where(factor != 0.0, grad, 0.0)
        tl.store(grad_row + cols, grad.to(grad_row.dtype.element_ty), mask=in_row)


def _scalars(softcap: float | None, logit_scale: float, temperature: float) -> dict:
    return dict(
        logit_scale=logit_scale,
        softcap=softcap if softcap is not None else 1.0,
        inv_temperature=1.0 / temperature,
        HAS_SOFTCAP=softcap is not None,
    )


def launch_row_stats(
    logits: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    softcap: float | None,
    logit_scale: float,
    temperature: float,
    block_v: int,
    num_warps: int,
) -> None:
    """``lse`` [C] (and ``entropy`` [C], fp32 outputs) of the final logits of ``logits`` [C, V] (raw,
    row-contiguous)."""
    rows, vocab_size = logits.shape
    _row_stats_kernel[(rows,)](
        logits,
        logits.stride(0),
        lse,
        entropy if entropy is not None else lse,
        vocab_size,
        **_scalars(softcap, logit_scale, temperature),
        WANT_ENTROPY=entropy is not None,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )


def launch_dense_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    factor: torch.Tensor,
    *,
    grad: torch.Tensor | None = None,
    softcap: float | None,
    logit_scale: float,
    temperature: float,
    block_v: int,
    num_warps: int,
) -> None:
    """Write ``p * factor[:, None] * dz/draw`` for ``logits`` [C, V] (raw, row-contiguous, any float dtype) into
    ``grad`` [C, V] (row-contiguous; None: over ``logits`` in place); ``lse`` and ``factor`` [C] fp32."""
    rows, vocab_size = logits.shape
    grad = logits if grad is None else grad
    _dense_grad_kernel[(rows,)](
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        lse,
        factor,
        vocab_size,
        **_scalars(softcap, logit_scale, temperature),
        BLOCK_V=block_v,
        num_warps=num_warps,
    )
