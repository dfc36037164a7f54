"""The chunked autograd Function of ``fused_linear_divergence``, shared by both backends.

Tokens are processed a chunk of rows at a time (``chunk_size`` rows, or the two-head chunk policy of ``core.chunking``). For each chunk the student's logits ``hidden_c @ W.T`` and the
teacher's ``teacher_hidden_c @ W_t.T`` are two GEMMs into ``[chunk, V]`` buffers, upcast to at least fp32;
the final logits (logit scale, softcap, temperature) give both log-softmaxes, the per-token divergence and the
student's entropy, and, when gradients are needed, the divergence's gradient with respect to the student's
raw logits ``G`` (below); two more GEMMs give ``dh_c = G @ W`` and ``dW += G.T @ hidden_c`` (fp32 accumulator).

The gradient of the per-token divergence ``D`` with respect to the student's final logits ``z`` (``s``, ``t``:
log-probabilities, ``p = exp(s)``, ``q = exp(t)``):

* beta 0, KL(teacher ‖ student): ``p - q``;
* beta 1, KL(student ‖ teacher): ``p * (s - t - D)``;
* otherwise, with the mixture ``m``: ``dD/dp = (1 - beta) (s - m)`` (the teacher's term contributes
  ``-beta q (1 - beta) / exp(m)``, which cancels against the student's), so ``p * (a - sum(p * a))`` with
  ``a = (1 - beta) (s - m)``.

Then through the temperature (``/ T``), the softcap (``1 - tanh^2``) and the logit scale. No gradient reaches
the teacher. Two schedules, as for the cross-entropy op: a scalar loss gets its gradient during the forward,
already scaled by the reduction (the backward multiplies by the upstream gradient); ``reduction="none"``
recomputes each chunk in the backward with the per-token upstream gradients.

Rows outside ``mask`` are computed and weighted by 0 (no host sync to count them). FLOPs: 2·N·V·D_t
(teacher) + 6·N·V·D (student logits, dh, dW).

Two row implementations. The torch one (any device, float64 too) upcasts both ``[chunk, V]`` products to
at least fp32 and keeps about six such temporaries (the dW policy is ``GradAccumulator``'s, as below). The
Triton one (``kernels.py``) keeps the two GEMM outputs in the compute dtype in two buffers reused by every
chunk, turns the student's into G in place, and adds each chunk's ``G.T @ hidden_c`` into dW as the
cross-entropy op does (``GradAccumulator``: bf16/fp32 dW in place, fp16 through fp32, the dW GEMM on a second
stream). ``fp32_logits``: both products are the GEMMs' fp32 accumulators (both implementations), and the
Triton one writes G to a third buffer in the compute dtype; ``fp32_weight_grad``: a bf16 dW in fp32.
"""

from __future__ import annotations

import math

import torch

from ..core.backend import HAS_TRITON, ROW_NUM_WARPS, row_block, stats_dtype
from ..core.chunking import chunk_spans, sm_count, two_head_chunk_rows
from ..core.grads import GradAccumulator, matmul_into
from ..core.reduction import loss_scale
from ..core.transform import transform_logits
from .options import OP_NAME, DivergenceOptions

if HAS_TRITON:
    from .kernels import launch_divergence

# Running the next chunk's teacher GEMM on a second CUDA stream beside this chunk's memory-bound row kernel
# gained nothing on the H100 (Qwen2.5-1.5B <- 7B, N 4096: 19.14 ms serial vs 19.65 overlapped at the
# default chunking, and slower or equal at 1024-2048 rows) and costs a second teacher buffer: not done.


def chunk_rows(hidden: torch.Tensor, weight: torch.Tensor, options: DivergenceOptions) -> int:
    """Token rows per chunk: ``options.chunk_size``, else :func:`..core.chunking.two_head_chunk_rows`'s."""
    if options.chunk_size is not None:
        return options.chunk_size
    return two_head_chunk_rows(
        hidden.shape[0],
        weight.shape[0],
        hidden.dtype,
        options.use_triton,
        hidden_size=hidden.shape[-1],
        num_sms=sm_count(hidden) if options.use_triton else None,
    )


def _project(hidden, weight, bias, dtype: torch.dtype, fp32_logits: bool) -> torch.Tensor:
    """``hidden @ weight.T (+ bias)`` in ``dtype`` (at least fp32); with ``fp32_logits`` the GEMM's fp32
    accumulator is kept, otherwise the product is rounded to the inputs' dtype first (as the unfused path)."""
    if fp32_logits and weight.dtype != dtype:
        raw = torch.empty(hidden.shape[0], weight.shape[0], dtype=dtype, device=hidden.device)
        matmul_into(raw, hidden, weight, None if bias is None else bias.to(dtype))
        return raw
    raw = hidden @ weight.T
    if bias is not None:
        raw = raw + bias
    return raw.to(dtype)


def chunk_pass(
    hidden_c: torch.Tensor,
    teacher_hidden_c: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    options: DivergenceOptions,
    row_coeff: torch.Tensor | None,
):
    """(per-token divergence, per-token student entropy, G or None) for one chunk of rows.

    ``row_coeff`` [C]: the upstream gradient of each row's divergence (None: no gradient). G is the
    gradient with respect to the student's raw logits ``hidden @ W.T + bias``, in the compute dtype.
    """
    dtype = torch.promote_types(weight.dtype, torch.float32)
    raw = _project(hidden_c, weight, bias, dtype, options.fp32_logits)
    z, tanh = transform_logits(raw, options.logit_scale, options.softcap, options.temperature)
    with torch.no_grad():
        zt, _ = transform_logits(
            _project(teacher_hidden_c, teacher_weight, teacher_bias, dtype, options.fp32_logits),
            options.teacher_logit_scale,
            options.teacher_softcap,
            options.temperature,
        )
    s = torch.log_softmax(z, dim=-1)
    t = torch.log_softmax(zt, dim=-1)
    del z, zt
    p = s.exp()
    entropy = -(p * s).sum(-1)
    beta = options.beta
    if beta == 0:
        q = t.exp()
        divergence = (q * (t - s)).sum(-1)
        grad = (p - q) if row_coeff is not None else None
    elif beta == 1:
        diff = s - t
        divergence = (p * diff).sum(-1)
        grad = p * (diff - divergence[:, None]) if row_coeff is not None else None
    else:
        mixture = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        divergence = beta * (t.exp() * (t - mixture)).sum(-1) + (1 - beta) * (p * (s - mixture)).sum(-1)
        if row_coeff is not None:
            a = (1 - beta) * (s - mixture)
            grad = p * (a - (p * a).sum(-1, keepdim=True))
        else:
            grad = None
    if grad is not None:
        factor = row_coeff.to(dtype) * (options.logit_scale / options.temperature)
        if tanh is not None:
            grad = grad * (1 - tanh * tanh)
        # a row outside the mask (factor 0) contributes an exact 0 to G, even where its softmax is not finite
        grad = torch.where(
            factor[:, None] != 0, grad * factor[:, None], torch.zeros((), dtype=dtype, device=grad.device)
        )
    return divergence, entropy, grad


def _mode(beta: float) -> int:
    return 0 if beta == 0 else 1 if beta == 1 else 2


def _run_triton_chunks(hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias, options, row_coeff):
    num_rows, vocab = hidden.shape[0], weight.shape[0]
    divergence = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
    grads = None
    if row_coeff is not None:
        grads = GradAccumulator(hidden, weight, bias, *options.needs_grad, fp32_weight_grad=options.fp32_weight_grad)
        row_coeff = row_coeff.float()
    # addmm's bias must have the product's dtype (a bias in another dtype: a copy of V elements)
    bias = None if bias is None else bias.to(weight.dtype)
    teacher_bias = None if teacher_bias is None else teacher_bias.to(teacher_weight.dtype)
    spans = chunk_spans(num_rows, chunk_rows(hidden, weight, options), fold_tail=True)
    buffer_rows = max(end - start for start, end in spans)
    # fp32_logits: both GEMMs write fp32, and the gradient goes to a third buffer in the student's dtype
    # (the dh and dW GEMMs' operand); otherwise it overwrites the student's logits in place.
    student_dtype = torch.float32 if options.fp32_logits else weight.dtype
    teacher_dtype = torch.float32 if options.fp32_logits else teacher_weight.dtype
    student_buffer = torch.empty(buffer_rows, vocab, dtype=student_dtype, device=hidden.device)
    teacher_buffer = torch.empty(buffer_rows, vocab, dtype=teacher_dtype, device=hidden.device)
    grad_buffer = student_buffer
    if grads is not None and student_dtype != weight.dtype:
        grad_buffer = torch.empty(buffer_rows, vocab, dtype=weight.dtype, device=hidden.device)
    beta = options.beta
    scalars = dict(
        mode=_mode(beta),
        beta=beta,
        logit_scale=options.logit_scale,
        softcap=options.softcap,
        teacher_logit_scale=options.teacher_logit_scale,
        teacher_softcap=options.teacher_softcap,
        inv_temperature=1.0 / options.temperature,
        block_v=row_block(vocab),
        num_warps=ROW_NUM_WARPS,
    )
    for start, end in spans:
        rows = slice(start, end)
        student = student_buffer[: end - start]
        teacher = teacher_buffer[: end - start]
        grad = grad_buffer[: end - start]
        matmul_into(student, hidden[rows], weight, bias)
        matmul_into(teacher, teacher_hidden[rows], teacher_weight, teacher_bias)
        coeff = None if row_coeff is None else row_coeff[rows]
        launch_divergence(student, teacher, coeff, divergence[rows], entropy[rows], grad=grad, **scalars)
        if grads is not None:
            grads.add(grad, hidden[rows], rows)
    return divergence, entropy, grads


def run_chunks(hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias, options, row_coeff):
    """Per-token divergence and entropy [N] (fp32 or wider), and the gradients when ``row_coeff`` is given."""
    if options.use_triton:
        return _run_triton_chunks(
            hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias, options, row_coeff
        )
    num_rows = hidden.shape[0]
    dtype = torch.promote_types(weight.dtype, torch.float32)
    divergence = torch.empty(num_rows, dtype=dtype, device=hidden.device)
    entropy = torch.empty(num_rows, dtype=dtype, device=hidden.device)
    grads = None
    if row_coeff is not None:
        grads = GradAccumulator(hidden, weight, bias, *options.needs_grad, fp32_weight_grad=options.fp32_weight_grad)
    for start, end in chunk_spans(num_rows, chunk_rows(hidden, weight, options)):
        hidden_c = hidden[start:end]
        coeff = None if row_coeff is None else row_coeff[start:end]
        div_c, ent_c, grad = chunk_pass(
            hidden_c, teacher_hidden[start:end], weight, bias, teacher_weight, teacher_bias, options, coeff
        )
        divergence[start:end] = div_c
        entropy[start:end] = ent_c
        if grads is not None:
            grads.add(grad.to(weight.dtype), hidden_c, slice(start, end))
    return divergence, entropy, grads


def divergence_forward(
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, row_weight, num_items, options
):
    """(loss, entropy, (dh, dW, db) or None): the loss 0-d for a scalar reduction (with its gradients, scaled by
    the reduction, when ``options.needs_grad`` asks for any) or [N] per token; fp32 (fp64 for fp64 inputs)."""
    scale = loss_scale(
        row_weight.sum(),
        num_items,
        options.reduction,
        op_name=OP_NAME,
        none_counted="no token is selected",
        counted="selected tokens",
    )
    grads = None
    if scale is not None and any(options.needs_grad):
        divergence, entropy, accumulator = run_chunks(
            hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias, options, row_weight * scale
        )
        grads = accumulator.results(weight.dtype, None if bias is None else bias.dtype)
    else:
        with torch.no_grad():
            divergence, entropy, _ = run_chunks(
                hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias, options, None
            )
    divergence = torch.where(
        row_weight != 0, divergence, torch.zeros((), dtype=divergence.dtype, device=divergence.device)
    )
    out = divergence.sum() * scale if scale is not None else divergence
    out_dtype = stats_dtype(weight.dtype)
    return out.to(out_dtype), entropy.to(out_dtype), grads
