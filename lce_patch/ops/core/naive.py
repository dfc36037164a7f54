"""The final logits every op's plain-PyTorch reference starts from."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """[..., V] final logits, upcast to at least fp32 like Hugging Face's loss does."""
    logits = F.linear(hidden, weight, bias)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits / temperature
