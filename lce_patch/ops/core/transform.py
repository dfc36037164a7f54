"""The logit transform every op applies to its GEMM output, and its torch form.

A head's final logits are ``softcap * tanh(logit_scale * raw / softcap) / temperature`` (no tanh when
``softcap`` is None), with ``raw = hidden @ W.T (+ bias)``: Gemma-2's softcap, Cohere's logit scale, a
distillation or sampling temperature. :class:`LogitTransform` carries those numbers and how a token's
cross-entropy is built from the final logits; the Triton kernels apply the same transform with
``triton_helpers.transform_logits``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    """How raw GEMM outputs become final logits and how a token's loss is built from them.

    ``z = softcap * tanh(logit_scale * raw / softcap) / temperature`` (no tanh when softcap is
    None); loss = CE with label smoothing, plus ``z_loss * lse**2``.
    """

    ignore_index: int = -100
    softcap: float | None = None
    logit_scale: float = 1.0
    temperature: float = 1.0
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    # The whole vocabulary's size when the buffer holds one shard of it (vocab-parallel, see
    # linear_cross_entropy/vocab_parallel.py): label smoothing spreads eps over all of it. None: the buffer's width.
    vocab_size: int | None = None


def transform_logits(
    raw: torch.Tensor, logit_scale: float, softcap: float | None, temperature: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(final logits, ``tanh`` of the softcap or None) of ``raw`` [C, V], in ``raw``'s dtype (upcast it first).

    Multiplying by a scale of 1 and dividing by a temperature of 1 are skipped (both exact); the result is a new
    tensor."""
    z = raw * logit_scale if logit_scale != 1.0 else raw
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(z / softcap)
        z = softcap * tanh
    if temperature != 1.0:
        z = z / temperature
    elif z is raw:  # never a view of ``raw``: callers overwrite their logits buffer with the gradient
        z = raw.clone()
    return z, tanh
