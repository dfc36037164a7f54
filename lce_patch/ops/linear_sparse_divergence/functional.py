"""``fused_linear_sparse_divergence``: distillation from a teacher's top-K log-probabilities without the student's
``[N, V]`` logits in memory."""

from __future__ import annotations

import torch

from ..core import checks
from ..core.backend import resolve_backend
from ..core.calls import count_call
from ..core.grads import fp32_output_gemm_available
from ..core.reduction import check_reduction
from .custom_op import linear_sparse_divergence
from .inputs import check_inputs
from .options import OP_NAME, SparseDivergenceOptions, fail


def fused_linear_sparse_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    candidate_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    candidate_mask: torch.Tensor | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    add_tail_bucket: bool = False,
    renormalize: bool = True,
    reduction: str = "mean",
    num_items_in_batch: float | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    backend: str = "auto",
    chunk_size: int | None = None,
    return_entropy: bool = False,
    fp32_logits: bool = False,
    fp32_weight_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Distillation loss against a teacher known only at K candidate tokens per position (its top-K), a chunk of
    tokens at a time.

    Final student logits: ``softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap) / temperature``
    (no tanh when ``softcap`` is None). Per position the student's log-softmax over the whole vocabulary is taken
    at the K ``candidate_ids``; the teacher's ``teacher_logprobs`` there are used as given (the temperature
    applies to the student only: a teacher sampled at a temperature ships log-probabilities at it). The two
    distributions compared over the candidates that ``candidate_mask`` keeps:

    * ``add_tail_bucket=True``: a (K+1)-th bucket holds the mass outside the candidates, ``log(1 - exp(min(lse,
      -1e-7)))`` of each side's candidate log-probabilities, exactly as TRL's ``_add_tail_bucket``;
    * ``renormalize=True`` (default, without the tail): both renormalized over the kept candidates, as TRL;
    * ``renormalize=False``: the student's full-vocabulary log-probabilities and the teacher's as given, as
      axolotl's top-K forward KL (``kd_normalize_topk: false``).

    The divergence is the generalized JSD of TRL's ``_jsd_divergence`` summed over that support: ``beta`` 0 is
    KL(teacher ‖ student), 1 is KL(student ‖ teacher), in between the JSD through the mixture
    ``(1 - beta) p_student + beta p_teacher``.

    Reproducing other libraries (float64 tests check each):

    * TRL 1.16 ``AsyncDistillationTrainer`` / ``ServerDistillationTrainer``: ``_chunked_jsd_loss(hidden, weight,
      bias, logit_scale, softcap, ids, logps, mask, beta, temperature, add_tail_bucket, ...)`` returns the *sum*:
      the same arguments with ``candidate_mask=mask, reduction="sum"``; the trainer's division by its token count
      is ``num_items_in_batch=tokens_per_rank`` (and by the accumulation steps, a factor of the user's).
    * axolotl 0.19 KD, ``topk_logprob.forward_kl.loss(logits, ids, logprobs, target_mask, num_items_in_batch,
      kd_temperature)``: ``candidate_mask=target_mask, temperature=kd_temperature, renormalize=False``, with
      ``num_items_in_batch`` when it is > 0, else ``num_items_in_batch=target_mask.sum()`` (axolotl averages over
      the kept (position, candidate) pairs, not positions). Its trainer's Liger loss
      (``kd_alpha * T**2 * sum / num_items_in_batch``): ``beta=kd_beta, renormalize=kd_normalize_topk,
      reduction="sum"`` times ``kd_alpha``, divided by its count: that is the gradient axolotl back-propagates;
      the value it reports is ``kd_temperature**2`` times larger (its forward scales the value, not the
      gradients). With ``kd_normalize_topk`` axolotl renormalizes the student over all K slots, padded ones
      included, and takes the teacher's log-probabilities as normalized; the op renormalizes both over the kept
      slots (the same for a teacher normalized over its K and a position kept or masked whole).

    Args:
        hidden: [N, D] or [B, T, D] student hidden states (float32, float16, bfloat16; float64 on torch).
        weight: [V, D] student head, the dtype of ``hidden``.
        candidate_ids: [N, K] or [B, T, K] integer token ids; in [0, V) wherever ``candidate_mask`` keeps the
            slot (checked inside the op: a ValueError on the CPU, a device assert on CUDA, no host sync), any value
            (-1, say) where it does not. Repeated ids in a row count as separate candidates, as in TRL.
        teacher_logprobs: the teacher's log-probabilities at ``candidate_ids``, the same shape; finite wherever
            the slot is kept (checked as the ids). No gradient reaches them.
        candidate_mask: bool or 0/1 integer tensor of ``candidate_ids``' shape, False at padded slots (None: all
            kept). A position with no kept candidate contributes 0 and is not counted by "mean".
        beta: the generalized JSD's mixture weight in [0, 1] (0 forward KL, 1 reverse KL).
        temperature: divides the student's final logits (> 0).
        add_tail_bucket: compare K + 1 buckets, the last the mass outside the candidates (TRL).
        renormalize: without the tail, renormalize both sides over the kept candidates (default, TRL) or
            take them as they are (False, axolotl's ``kd_normalize_topk: false``).
        reduction: "mean" over positions with a kept candidate, "sum", or "none" (per position, 0 where none
            is kept).
        num_items_in_batch: divide the sum by this count instead (a number or a one-element tensor; checked
            inside the op: finite and > 0, or 0 when no position counts).
        bias: [V] student head bias (its gradient is computed when it requires one).
        softcap: final-logit softcap (Gemma-2), applied after ``logit_scale``; None for none.
        logit_scale: multiplies the raw logits (Cohere's ``logit_scale``; 1 for most models).
        backend: "auto" (Triton on CUDA, torch elsewhere and for float64), "triton" or "torch".
        chunk_size: token rows per chunk (default: the package's chunk policy; one [chunk, V] buffer).
        return_entropy: also return the student's per-token entropy over the whole vocabulary at
            ``temperature`` (no gradient), computed in the same pass.
        fp32_logits: keep the student's logits as the GEMM's fp32 accumulator instead of rounding them to
            bf16/fp16 first (as the unfused path and the default do). The gradient is a small difference of
            probabilities, so that rounding sets most of dh's and dW's error at bf16 (measured: the op page); costs
            an fp32 buffer and a gradient buffer in place of the one bf16 buffer, and the time on that page. No
            effect on fp32 and fp64 inputs.
        fp32_weight_grad: accumulate a bf16 ``weight``'s gradient in fp32 over the chunks and round it once.

    Returns:
        The loss (0-d, or [...] per position for "none"; fp32, fp64 for float64 inputs); with ``return_entropy``,
        (loss, entropy [...]). With nothing counted the loss is 0 and every gradient 0.
    """
    check_inputs(hidden, weight, bias, candidate_ids, teacher_logprobs, candidate_mask)
    check_reduction(reduction, num_items_in_batch, OP_NAME)
    use_triton = resolve_backend(backend, hidden.device, hidden.dtype, OP_NAME)
    if fp32_logits is True and not fp32_output_gemm_available(hidden.device):
        fail("fp32_logits needs torch's fp32-output GEMM (torch.mm(..., out_dtype=), torch >= 2.8) on CUDA")
    grad_on = torch.is_grad_enabled()
    options = SparseDivergenceOptions(
        beta=beta,
        temperature=temperature,
        softcap=softcap,
        logit_scale=logit_scale,
        add_tail_bucket=add_tail_bucket,
        renormalize=renormalize,
        reduction=reduction,
        chunk_size=chunk_size,
        use_triton=use_triton,
        entropy=bool(return_entropy),
        needs_grad=(
            grad_on and hidden.requires_grad,
            grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad,
        ),
        fp32_logits=fp32_logits,
        fp32_weight_grad=fp32_weight_grad,
    )
    leading = hidden.shape[:-1]
    num_candidates = candidate_ids.shape[-1]
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    ids = candidate_ids.reshape(-1, num_candidates)
    teacher = teacher_logprobs.detach().reshape(-1, num_candidates)
    if candidate_mask is None:
        mask = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    else:
        mask = candidate_mask.reshape(-1, num_candidates) != 0
    num_items = None
    if num_items_in_batch is not None:
        num_items = checks.num_items_tensor(num_items_in_batch, hidden.device, OP_NAME)
    if hidden_2d.shape[0] == 0:  # counted here: no operator runs (the operator counts every other call)
        count_call(OP_NAME)
        zero = hidden_2d.sum() * 0 + weight.sum() * 0
        stats = zero.dtype if zero.dtype == torch.float64 else torch.float32
        loss = zero.to(stats) if reduction != "none" else hidden_2d.new_zeros(0, dtype=stats)
        entropy = hidden_2d.new_zeros(0, dtype=stats)
    else:
        loss, entropy = linear_sparse_divergence(hidden_2d, weight, bias, ids, teacher, mask, num_items, options)
    if reduction == "none":
        loss = loss.reshape(leading)
    if not return_entropy:
        return loss
    return loss, entropy.reshape(leading)
