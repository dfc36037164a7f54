"""The chunked forward and backward of ``fused_linear_sparse_divergence``, shared by both backends.

Tokens are processed a chunk at a time (``core.chunking``'s policy, or ``chunk_size`` rows). Per chunk one GEMM
writes the student's raw logits into a reused ``[C, V]`` buffer; the row statistics (log-sum-exp, entropy) come
from the Triton row kernel or from torch (``kernels.py`` describes the algorithm); the ``[C, K]`` loss math is
``sparse.py``'s. With a gradient, the buffer is overwritten by the gradient ``G`` with respect to the raw logits,
``(scatter(g) - p * sum(g)) * dz/draw``, and ``GradAccumulator`` adds ``G @ W`` into dh and ``G.T @ h_c`` into dW.

Two schedules: a scalar loss gets its gradients during the forward, already scaled by the reduction (the
backward multiplies by the upstream gradient); ``reduction="none"`` recomputes each chunk in the backward with
every token's upstream gradient.

The torch rows (any device, float64 too) upcast each chunk's logits to at least fp32 and keep about four such
temporaries; the Triton rows keep only the buffer, in the compute dtype. With ``fp32_logits`` the buffer holds the
GEMM's fp32 accumulator unrounded (the torch rows upcast that instead of bf16 logits) and the Triton rows add a
second buffer, in the compute dtype, for the gradient.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.backend import HAS_TRITON, ROW_NUM_WARPS, row_block, stats_dtype
from ..core.chunking import buffer_rows, resolve_chunks
from ..core.grads import GradAccumulator, matmul_into
from ..core.reduction import loss_scale
from .options import OP_NAME, SparseDivergenceOptions, fail
from .sparse import sparse_divergence

if HAS_TRITON:
    from .kernels import launch_dense_grad, launch_row_stats


def check_candidates(ids: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> None:
    """Every candidate the mask keeps has an id in [0, V) and a finite teacher log-probability. A ValueError on
    the CPU; on CUDA an asynchronous device assert (no host sync)."""
    bad_id = mask & ((ids < 0) | (ids >= vocab_size))
    bad_log_prob = mask & ~torch.isfinite(teacher)
    id_message = f"a candidate id that candidate_mask keeps is outside [0, {vocab_size})"
    log_prob_message = (
        "teacher_logprobs must be finite (not NaN or +-inf) wherever candidate_mask keeps a candidate; "
        "mask such a slot out instead"
    )
    if ids.device.type != "cuda":
        if bool(bad_id.any()):
            first = int(ids[bad_id][0])
            fail(f"candidate id {first} is outside [0, {vocab_size}) where candidate_mask keeps it")
        if bool(bad_log_prob.any()):
            fail(f"{log_prob_message} (got {float(teacher[bad_log_prob][0])})")
    else:
        torch._assert_async(~bad_id.any(), f"{OP_NAME}: {id_message}")
        torch._assert_async(~bad_log_prob.any(), f"{OP_NAME}: {log_prob_message}")


def _transform(raw: torch.Tensor, options: SparseDivergenceOptions):
    """(final logits, tanh of the softcap or None) from upcast raw logits. Not ``core.transform``'s
    ``softcap * tanh / temperature``: one multiply by ``softcap / temperature``, close to the Triton rows'
    ``tanh * (softcap * inv_temperature)``; kept as it is, since reordering the products changes the op's last bits."""
    scaled = raw * options.logit_scale if options.logit_scale != 1.0 else raw
    if options.softcap is None:
        return scaled / options.temperature, None
    tanh = torch.tanh(scaled / options.softcap)
    return tanh * (options.softcap / options.temperature), tanh


def _derivative(tanh: torch.Tensor | None, options: SparseDivergenceOptions):
    """d(final logit) / d(raw logit): a number without a softcap, else a tensor like ``tanh``."""
    if tanh is None:
        return options.derivative_scale
    return (1 - tanh * tanh) * options.derivative_scale


def _grad_at_candidates(student, g, ids, coeff, factor, derivative) -> torch.Tensor:
    """G at the candidate ids [C, K], in the stats dtype: the dense part ``p * factor`` plus the ``g * coeff`` of
    every candidate with that id (repeated ids add up), times dz/draw; 0 in rows whose coefficient is 0.

    Written over the dense kernel's values at the ids (a scatter, each rounded once; repeated ids write the same
    value), rather than added to them: a scatter_add_ into the rounded dense part would round these logits twice,
    and at the candidates the two terms are the largest of the row and nearly cancel."""
    same_id = ids[:, :, None] == ids[:, None, :]
    first = same_id.to(torch.uint8).argmax(dim=-1)  # each slot's first slot with its id
    g_of_id = torch.zeros_like(g).scatter_add_(1, first, g).gather(1, first)
    total = (student.exp() * factor[:, None] + g_of_id * coeff[:, None]) * derivative
    return torch.where((coeff != 0)[:, None], total, torch.zeros((), dtype=total.dtype, device=total.device))


class _Rows:
    """The inputs of the chunk loop: 2-D hidden, the head, and the candidates (ids 0 where masked)."""

    def __init__(self, hidden, weight, bias, ids, teacher, mask):
        self.hidden, self.weight, self.mask = hidden, weight, mask
        # addmm's bias must have the product's dtype (a bias in another dtype: a copy of V elements)
        self.bias = None if bias is None else bias.to(weight.dtype)
        self.ids = torch.where(mask, ids, torch.zeros((), dtype=ids.dtype, device=ids.device)).long()
        self.stats = stats_dtype(weight.dtype)
        self.teacher = teacher.to(self.stats)


def run_chunks(rows: _Rows, options: SparseDivergenceOptions, row_coeff: torch.Tensor | None, needs):
    """(divergence [N], entropy [N] or None, GradAccumulator or None) in the stats dtype (fp32, fp64 for
    fp64); the gradients only when ``row_coeff`` [N] (each row's upstream coefficient) is given."""
    hidden, weight = rows.hidden, rows.weight
    num_rows, vocab = hidden.shape[0], weight.shape[0]
    stats = rows.stats
    device = hidden.device
    divergence = torch.empty(num_rows, dtype=stats, device=device)
    entropy = torch.empty(num_rows, dtype=stats, device=device) if options.entropy else None
    grads = None
    if row_coeff is not None:
        grads = GradAccumulator(hidden, weight, rows.bias, *needs, fp32_weight_grad=options.fp32_weight_grad)
        row_coeff = row_coeff.to(stats)
    spans = resolve_chunks(options.chunk_size, num_rows, hidden, weight, options.use_triton, row_coeff is not None)
    # fp32_logits: the GEMM writes fp32 logits and the gradient goes to a second buffer in the weight's dtype
    # (the dh and dW GEMMs' operand); otherwise it overwrites the logits in place.
    buffer_dtype = torch.promote_types(weight.dtype, torch.float32) if options.fp32_logits else weight.dtype
    buffer = torch.empty(buffer_rows(spans), vocab, dtype=buffer_dtype, device=device)
    grad_buffer = buffer
    if grads is not None and options.use_triton and buffer_dtype != weight.dtype:
        grad_buffer = torch.empty(buffer.shape, dtype=weight.dtype, device=device)
    kernel_args = dict(
        softcap=options.softcap,
        logit_scale=options.logit_scale,
        temperature=options.temperature,
        block_v=row_block(vocab),
        num_warps=ROW_NUM_WARPS,
    )
    for start, end in spans:
        span = slice(start, end)
        logits = buffer[: end - start]
        hidden_c = hidden[span]
        matmul_into(logits, hidden_c, weight, rows.bias)
        ids = rows.ids[span]
        if options.use_triton:
            lse = torch.empty(end - start, dtype=torch.float32, device=device)
            launch_row_stats(logits, lse, None if entropy is None else entropy[span], **kernel_args)
            student_at_ids, tanh_at_ids = _transform(logits.gather(1, ids).to(stats), options)
        else:
            final, tanh = _transform(logits.to(stats), options)
            lse = torch.logsumexp(final, dim=-1)
            probs = torch.exp(final - lse[:, None])
            if entropy is not None:
                entropy[span] = lse - (probs * final).sum(-1)
            student_at_ids = final.gather(1, ids)
            tanh_at_ids = None if tanh is None else tanh.gather(1, ids)
        student = student_at_ids - lse[:, None].to(stats)
        div_c, g = sparse_divergence(student, rows.teacher[span], rows.mask[span], options, row_coeff is not None)
        divergence[span] = div_c
        if grads is None:
            continue
        coeff = row_coeff[span]
        selected = coeff != 0
        factor = -g.sum(-1) * coeff
        if options.use_triton:
            grad_chunk = grad_buffer[: end - start]
            launch_dense_grad(logits, lse, factor.float(), grad=grad_chunk, **kernel_args)
            at_ids = _grad_at_candidates(student, g, ids, coeff, factor, _derivative(tanh_at_ids, options))
            grad_chunk.scatter_(1, ids, at_ids.to(grad_chunk.dtype))
        else:
            grad = probs * factor[:, None]
            grad.scatter_add_(1, ids, g * coeff[:, None])
            grad = grad * _derivative(tanh, options)
            # a row with coefficient 0 contributes an exact 0, even where its softmax is not finite
            grad = torch.where(selected[:, None], grad, torch.zeros((), dtype=stats, device=device))
            grad_chunk = grad.to(weight.dtype)
        grads.add(grad_chunk, hidden_c, span)
    return divergence, entropy, grads


def _empty(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return like.new_empty(0, dtype=dtype)


def sparse_forward(hidden, weight, bias, ids, teacher, mask, num_items, options: SparseDivergenceOptions):
    """(loss, entropy, (dh, dW, db) or None): the loss 0-d for a scalar reduction (with its gradients, scaled by
    the reduction, when ``options.needs_grad`` asks for any) or [N] per token; entropy [N], or empty when not
    asked for; in the stats dtype."""
    check_candidates(ids, teacher, mask, weight.shape[0])
    rows = _Rows(hidden, weight, bias, ids, teacher, mask)
    has_candidate = mask.any(dim=-1)
    scale = loss_scale(
        has_candidate.sum().to(rows.stats),
        num_items,
        options.reduction,
        op_name=OP_NAME,
        none_counted="no position has a candidate",
        counted="positions with a candidate",
    )
    grads = None
    if scale is not None and any(options.needs_grad):
        coeff = torch.where(has_candidate, scale, torch.zeros((), dtype=rows.stats, device=hidden.device))
        divergence, entropy, accumulator = run_chunks(rows, options, coeff, options.needs_grad)
        grads = accumulator.results(weight.dtype, None if bias is None else bias.dtype)
    else:
        with torch.no_grad():
            divergence, entropy, _ = run_chunks(rows, options, None, options.needs_grad)
    out = divergence.sum() * scale if scale is not None else divergence
    return out, entropy if entropy is not None else _empty(hidden, rows.stats), grads


def sparse_backward(hidden, weight, bias, ids, teacher, mask, grad_out, options: SparseDivergenceOptions):
    """(dh, dW, db) of the per-token loss for the upstream gradients ``grad_out`` [N], recomputing each chunk."""
    rows = _Rows(hidden, weight, bias, ids, teacher, mask)
    zero = torch.zeros((), dtype=rows.stats, device=hidden.device)
    coeff = torch.where(mask.any(dim=-1), grad_out.to(rows.stats), zero)
    _, _, grads = run_chunks(rows, dataclasses.replace(options, entropy=False), coeff, options.needs_grad)
    return grads.results(weight.dtype, None if bias is None else bias.dtype)
