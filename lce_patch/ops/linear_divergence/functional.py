"""``fused_linear_divergence``: the distillation loss between a student's and a teacher's LM heads, without
either model's ``[N, V]`` logits in memory."""

from __future__ import annotations

import torch

from ..core import checks
from ..core.backend import resolve_backend
from ..core.calls import count_call
from ..core.grads import fp32_output_gemm_available
from ..core.reduction import check_reduction
from .autograd import LinearDivergenceFunction
from .custom_op import compiled_linear_divergence
from .inputs import check_inputs
from .options import OP_NAME, DivergenceOptions
from .options import fail as _fail


def fused_linear_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "mean",
    num_items_in_batch: float | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    backend: str = "auto",
    chunk_size: int | None = None,
    return_entropy: bool = False,
    fp32_logits: bool = False,
    fp32_weight_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Distillation loss between a student's and a teacher's LM heads, a chunk of tokens at a time.

    Final logits: ``softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap) / temperature`` (no
    tanh when ``softcap`` is None), the teacher's the same with its own parameters. Per token, summed over
    the vocabulary, the divergence is exactly TRL's ``generalized_jsd_loss``: ``beta`` 0 is KL(teacher ‖
    student), 1 is KL(student ‖ teacher), in between the generalized Jensen-Shannon divergence through the
    mixture ``(1 - beta) p_student + beta p_teacher``.

    Args:
        hidden: [N, D] or [B, T, D] student hidden states (float32, float16, bfloat16; float64 too).
        weight: [V, D] student head, the dtype of ``hidden``.
        teacher_hidden: the same leading shape as ``hidden``, with the teacher's hidden size.
        teacher_weight: [V_t, D_t] teacher head, V_t >= V. A teacher vocabulary padded beyond the student's
            (V_t > V) is common; its rows beyond V are left out of the teacher's softmax (the distributions are
            over the student's V tokens). No gradient reaches the teacher, even if its tensors require one.
        mask: bool or 0/1 integer tensor of ``hidden``'s leading shape selecting the tokens (None: all).
        reduction: "mean" over selected tokens, "sum", or "none" (per token, fp32, 0 where unselected).
        num_items_in_batch: divide the sum by this count instead (gradient accumulation); a number or a
            one-element tensor.
        backend: "auto" (Triton on CUDA, torch elsewhere and for float64), "triton" or "torch".
        chunk_size: tokens per chunk. Default on Triton: the cross-entropy op's chunking of the student's
            GEMMs (at least 1024 rows; two [chunk, V] buffers in the compute dtype, the student's and the
            teacher's); on torch: a [chunk, V] fp32 temporary of about 256 MiB.
        return_entropy: also return the student's per-token entropy at ``temperature`` (fp32, no gradient),
            computed in the same pass.
        fp32_logits: keep both models' logits as the GEMMs' fp32 accumulators instead of rounding them to
            bf16/fp16 first (the unfused path's and the default's rounding). The loss's gradient is a small
            difference of probabilities, so this rounding sets most of dh's and dW's error at bf16; fp32 logits
            cut it about 4x (measured: docs, the op page) for twice the logits buffers' memory (plus one
            buffer for the gradient) and the time in the docs. No effect on fp32 and fp64 inputs.
        fp32_weight_grad: accumulate a bf16 ``weight``'s gradient in fp32 over the chunks and round it once
            (default: added into the bf16 dW chunk by chunk; fp16 always accumulates in fp32).

    Returns:
        The loss (0-d fp32, or [...] per token for "none"); with ``return_entropy``, (loss, entropy [...]).
        With no token selected the loss is 0 and every gradient is 0.
    """
    count_call(OP_NAME)
    check_inputs(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, mask)
    check_reduction(reduction, num_items_in_batch, OP_NAME)
    use_triton = resolve_backend(backend, hidden.device, hidden.dtype, OP_NAME)
    if use_triton and teacher_hidden.dtype == torch.float64:
        _fail("the triton backend supports float32, float16 and bfloat16; use backend='torch' for a float64 teacher")
    if fp32_logits is True and not fp32_output_gemm_available(hidden.device):
        _fail("fp32_logits needs torch's fp32-output GEMM (torch.mm(..., out_dtype=), torch >= 2.8) on CUDA")

    leading = hidden.shape[:-1]
    vocab = weight.shape[0]
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    teacher_2d = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    teacher_weight = teacher_weight.detach()[:vocab]
    teacher_bias = None if teacher_bias is None else teacher_bias.detach()[:vocab]
    num_rows = hidden_2d.shape[0]
    compute = torch.promote_types(weight.dtype, torch.float32)
    if mask is None:
        row_weight = torch.ones(num_rows, dtype=compute, device=hidden.device)
    else:
        row_weight = (mask.reshape(-1) != 0).to(compute)
    num_items = None
    if num_items_in_batch is not None:
        num_items = checks.num_items_tensor(num_items_in_batch, hidden.device, OP_NAME)
    grad_on = torch.is_grad_enabled()
    options = DivergenceOptions(
        beta=beta,
        temperature=temperature,
        softcap=softcap,
        teacher_softcap=teacher_softcap,
        logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale,
        chunk_size=chunk_size,
        use_triton=use_triton,
        reduction=reduction,
        needs_grad=(
            grad_on and hidden.requires_grad,
            grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad,
        ),
        fp32_logits=fp32_logits,
        fp32_weight_grad=fp32_weight_grad,
    )
    if num_rows == 0:
        loss = (hidden_2d.sum() * 0).float() if reduction != "none" else hidden_2d.new_zeros(0, dtype=torch.float32)
        entropy = hidden_2d.new_zeros(0, dtype=torch.float32)
    elif torch.compiler.is_compiling():
        loss, entropy = compiled_linear_divergence(
            hidden_2d, weight, bias, teacher_2d, teacher_weight, teacher_bias, row_weight, num_items, options
        )
    else:
        loss, entropy = LinearDivergenceFunction.apply(
            hidden_2d, weight, bias, teacher_2d, teacher_weight, teacher_bias, row_weight, num_items, options
        )
    if reduction == "none":
        loss = loss.reshape(leading)
    entropy = entropy.reshape(leading)
    entropy = entropy if entropy.dtype == torch.float64 else entropy.float()
    return (loss, entropy) if return_entropy else loss
