"""Triton kernel of the distillation divergence and its gradient for one chunk of rows.

Design note
-----------
The op works on C tokens at a time. Two cuBLAS GEMMs write the student's raw logits
``hidden_c @ W.T (+ bias)`` and the teacher's ``teacher_hidden_c @ W_t.T (+ teacher_bias)`` into two
``[C, V]`` buffers in their compute dtypes; ``_divergence_kernel`` (one program per row) reads both and,
when the gradient is wanted, overwrites the student's buffer with the gradient with respect to the raw
logits, which the dh and dW GEMMs then consume. Neither model's logits ever exist for more than C rows.

Per row, with final logits ``z = softcap * tanh(logit_scale * raw / softcap) / temperature`` (no tanh
without a softcap) for each model, ``s = z - lse(z)`` and ``t = z_t - lse(z_t)`` the log-probabilities,
``p = exp(s)``, ``q = exp(t)``:

* ``MODE 0`` (beta 0), KL(teacher ‖ student): ``D = sum q (t - s)``, ``dD/dz = p - q``;
* ``MODE 1`` (beta 1), KL(student ‖ teacher): ``D = sum p (s - t)``, ``dD/dz = p (s - t - D)``;
* ``MODE 2`` (0 < beta < 1), through the mixture ``m = log((1 - beta) p + beta q)``:
  ``D = beta sum q (t - m) + (1 - beta) sum p (s - m)``, ``dD/dz = p (a - sum(p a))`` with
  ``a = (1 - beta)(s - m)`` (the teacher's side of ``dm`` cancels against the student's).

The student's entropy ``H = sum p (lse - z)`` is summed in the same pass as ``D`` (non-negative terms).

Passes over the row: (1) both log-sum-exps, online, with one running max per row and model (a block's
max is reduced once per block, so one exponential per logit); (2) ``D``, ``H`` and, for ``MODE 2``,
``sum(p a)``; for ``MODE 0`` this pass also writes the gradient; (3) for ``MODE 1`` and ``MODE 2`` with a
gradient, the gradient, which needs (2)'s row sums. The gradient is written times the row's coefficient
(the upstream gradient of the row's divergence: the reduction's factor, or 0 for an unselected row,
which writes exact zeros) and ``logit_scale / temperature * (1 - tanh**2)``, in the buffer's dtype.

With ``fp32_logits`` the two buffers hold the GEMMs' fp32 accumulators (not rounded to the compute dtype) and
the gradient is written to a third buffer in the compute dtype, the dh and dW GEMMs' operand (``grad_ptr``;
otherwise it is the student's buffer itself).

Memory: the two ``[C, V]`` buffers (three with ``fp32_logits``) and two fp32 vectors of C; nothing
proportional to N x V. FLOPs:
~15-25 per logit pair per pass (up to three exponentials and a logarithm in ``MODE 2``), negligible next to
the GEMMs' 2 (D_t + 3 D) per logit; the kernel is bound by memory: per logit pair, two reads of both buffers
(``MODE 0``, or no gradient) or three (``MODE 1`` and ``MODE 2`` with the gradient), plus one write of the
student's when the gradient is written, in the compute dtype. On the H100 the three-pass form streamed
2.4 TB/s. No atomics: results are deterministic run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.triton_helpers import max_keep_nan, transform_logits


@triton.jit
def _load_logits(row_ptr, cols, in_row, scale, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """fp32 final logits and tanh at ``cols`` (columns past the row's end read as a raw 0)."""
    raw = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    return transform_logits(raw, scale, softcap, inv_temperature, HAS_SOFTCAP)


@triton.jit
def _log_probs(
    s_row, t_row, cols, in_row, lse_s, lse_t, logit_scale, softcap, teacher_logit_scale, teacher_softcap,
    inv_temperature, HAS_SOFTCAP: tl.constexpr, TEACHER_HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """The student's and the teacher's log-probabilities at ``cols``, the student's probabilities, and the
    student's tanh (softcap derivative)."""
    z, tanh = _load_logits(s_row, cols, in_row, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
    zt, _ = _load_logits(
        t_row, cols, in_row, teacher_logit_scale, teacher_softcap, inv_temperature, TEACHER_HAS_SOFTCAP
    )
    s = z - lse_s
    return s, zt - lse_t, tl.exp(s), tanh


@triton.jit
def _store_grad(row_ptr, cols, in_row, grad_z, raw_factor, coeff, tanh, HAS_SOFTCAP: tl.constexpr):
    """Write the gradient with respect to the raw logits at ``cols`` of a gradient row (the student's logits'
    own row when written in place), from the gradient with respect to the final logits; a row whose
    coefficient is 0 (unselected) gets exact zeros, even from a non-finite row."""
    grad = grad_z * raw_factor
    if HAS_SOFTCAP:
        grad = grad * (1.0 - tanh * tanh)
    grad = tl.where(coeff != 0.0, grad, 0.0)
    tl.store(row_ptr + cols, grad.to(row_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _log_mixture(p, q, beta):
    """log((1 - beta) p + beta q), from the probabilities the pass has already exponentiated (one log per
    pair instead of logaddexp's exponential and log). Where both underflow the mixture is clamped to the
    smallest normal fp32: its terms are then weighted by p, q < 1e-38 and add nothing."""
    return tl.log(tl.maximum((1.0 - beta) * p + beta * q, 1.1754943508222875e-38))


@triton.jit
def _divergence_kernel(
    student_ptr,
    student_row_stride,
    teacher_ptr,
    teacher_row_stride,
    grad_ptr,
    grad_row_stride,
    coeff_ptr,
    divergence_ptr,
    entropy_ptr,
    vocab_size,
    logit_scale,
    softcap,
    teacher_logit_scale,
    teacher_softcap,
    inv_temperature,
    beta,
    HAS_SOFTCAP: tl.constexpr,
    TEACHER_HAS_SOFTCAP: tl.constexpr,
    MODE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = student_ptr + row * student_row_stride
    t_row = teacher_ptr + row * teacher_row_stride
    g_row = grad_ptr + row * grad_row_stride
    offsets = tl.arange(0, BLOCK_V)

    # Pass 1: log-sum-exp of both rows. One running max per row and model; the per-lane sums are
    # rescaled by a scalar exponential when it grows.
    max_s = tl.full([], -float("inf"), tl.float32)
    max_t = tl.full([], -float("inf"), tl.float32)
    sum_s = tl.zeros([BLOCK_V], dtype=tl.float32)
    sum_t = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + offsets
        in_row = cols < vocab_size
        z, _ = _load_logits(s_row, cols, in_row, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
        zt, _ = _load_logits(
            t_row, cols, in_row, teacher_logit_scale, teacher_softcap, inv_temperature, TEACHER_HAS_SOFTCAP
        )
        z = tl.where(in_row, z, -float("inf"))
        zt = tl.where(in_row, zt, -float("inf"))
        # the first block holds column 0, so the maxima are finite (or NaN) from then on: no inf - inf
        new_max_s = max_keep_nan(max_s, tl.reduce(z, 0, max_keep_nan))
        new_max_t = max_keep_nan(max_t, tl.reduce(zt, 0, max_keep_nan))
        sum_s = sum_s * tl.exp(max_s - new_max_s) + tl.exp(z - new_max_s)
        sum_t = sum_t * tl.exp(max_t - new_max_t) + tl.exp(zt - new_max_t)
        max_s = new_max_s
        max_t = new_max_t
    lse_s = max_s + tl.log(tl.sum(sum_s, 0))
    lse_t = max_t + tl.log(tl.sum(sum_t, 0))

    if WRITE_GRAD:
        coeff = tl.load(coeff_ptr + row).to(tl.float32)
        raw_factor = coeff * logit_scale * inv_temperature

    # Pass 2: the divergence, the entropy, and the sum(p a) of the mixture's gradient.
    divergence = tl.zeros([BLOCK_V], dtype=tl.float32)
    entropy = tl.zeros([BLOCK_V], dtype=tl.float32)
    p_a = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + offsets
        in_row = cols < vocab_size
        s, t, p, tanh = _log_probs(
            s_row, t_row, cols, in_row, lse_s, lse_t, logit_scale, softcap, teacher_logit_scale, teacher_softcap,
            inv_temperature, HAS_SOFTCAP, TEACHER_HAS_SOFTCAP,
        )  # fmt: skip
        entropy += tl.where(in_row, -p * s, 0.0)
        if MODE == 0:
            q = tl.exp(t)
            divergence += tl.where(in_row, q * (t - s), 0.0)
            if WRITE_GRAD:
                _store_grad(g_row, cols, in_row, p - q, raw_factor, coeff, tanh, HAS_SOFTCAP)
        elif MODE == 1:
            divergence += tl.where(in_row, p * (s - t), 0.0)
        else:
            q = tl.exp(t)
            mixture = _log_mixture(p, q, beta)
            term = beta * q * (t - mixture) + (1.0 - beta) * p * (s - mixture)
            divergence += tl.where(in_row, term, 0.0)
            p_a += tl.where(in_row, p * (s - mixture), 0.0)
    row_divergence = tl.sum(divergence, 0)
    tl.store(divergence_ptr + row, row_divergence)
    tl.store(entropy_ptr + row, tl.sum(entropy, 0))

    # Pass 3: the gradient that needs pass 2's row sums.
    if WRITE_GRAD and MODE != 0:
        row_p_a = (1.0 - beta) * tl.sum(p_a, 0)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + offsets
            in_row = cols < vocab_size
            s, t, p, tanh = _log_probs(
                s_row, t_row, cols, in_row, lse_s, lse_t, logit_scale, softcap, teacher_logit_scale,
                teacher_softcap, inv_temperature, HAS_SOFTCAP, TEACHER_HAS_SOFTCAP,
            )  # fmt: skip
            if MODE == 1:
                grad = p * (s - t - row_divergence)
            else:
                mixture = _log_mixture(p, tl.exp(t), beta)
                grad = p * ((1.0 - beta) * (s - mixture) - row_p_a)
            _store_grad(g_row, cols, in_row, grad, raw_factor, coeff, tanh, HAS_SOFTCAP)


def launch_divergence(
    student: torch.Tensor,
    teacher: torch.Tensor,
    coeff: torch.Tensor | None,
    divergence: torch.Tensor,
    entropy: torch.Tensor,
    *,
    grad: torch.Tensor | None = None,
    mode: int,
    beta: float,
    logit_scale: float,
    softcap: float | None,
    teacher_logit_scale: float,
    teacher_softcap: float | None,
    inv_temperature: float,
    block_v: int,
    num_warps: int,
) -> None:
    """Run the kernel over the rows of ``student`` and ``teacher`` ([C, V] raw logits, row-contiguous, in any
    float dtype); ``coeff`` [C] fp32 (None: no gradient), ``divergence`` and ``entropy`` [C] fp32 outputs;
    ``grad`` [C, V] (row-contiguous) takes the gradient, ``student`` itself when None (in place)."""
    rows, vocab_size = student.shape
    grad = student if grad is None else grad
    _divergence_kernel[(rows,)](
        student,
        student.stride(0),
        teacher,
        teacher.stride(0),
        grad,
        grad.stride(0),
        coeff if coeff is not None else divergence,
        divergence,
        entropy,
        vocab_size,
        logit_scale,
        softcap if softcap is not None else 1.0,
        teacher_logit_scale,
        teacher_softcap if teacher_softcap is not None else 1.0,
        inv_temperature,
        beta,
        HAS_SOFTCAP=softcap is not None,
        TEACHER_HAS_SOFTCAP=teacher_softcap is not None,
        MODE=mode,
        WRITE_GRAD=coeff is not None,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )
