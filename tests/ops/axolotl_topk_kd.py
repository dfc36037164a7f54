"""Runs axolotl's top-K distillation losses on saved inputs, in axolotl's own environment (see
test_linear_sparse_divergence.py): ``python axolotl_topk_kd.py inputs.pt outputs.pt``.

Both functions upcast with ``Tensor.float()``; here that keeps float64 tensors as they are, so their formulas are
evaluated in float64 (other dtypes upcast as usual). Each case's loss and its gradients with respect to hidden and
weight are saved.
"""

from __future__ import annotations

import sys

import torch

_upcast = torch.Tensor.float


def _float_keeping_float64(self, *args, **kwargs):
    return self if self.dtype == torch.float64 else _upcast(self, *args, **kwargs)


torch.Tensor.float = _float_keeping_float64

from axolotl.integrations.kd.kernels.liger import LigerFusedLinearKLTopKLogprobFunction  # noqa: E402
from axolotl.integrations.kd.topk_logprob.forward_kl import loss as forward_kl_loss  # noqa: E402


def _leaves(inputs):
    return inputs["hidden"].clone().requires_grad_(True), inputs["weight"].clone().requires_grad_(True)


def main(source: str, target: str) -> None:
    inputs = torch.load(source)
    results = {}
    for case in inputs["cases"]:
        hidden, weight = _leaves(inputs)
        if case["function"] == "forward_kl":
            loss = forward_kl_loss(
                hidden @ weight.T,
                inputs["ids"],
                inputs["logprobs"],
                inputs["mask"],
                num_items_in_batch=case["num_items_in_batch"],
                kd_temperature=case["temperature"],
            )
        else:  # the KD trainer's Liger loss, distillation term only
            loss = LigerFusedLinearKLTopKLogprobFunction.apply(
                hidden,
                weight,
                inputs["ids"],
                inputs["logprobs"],
                inputs["mask"],
                torch.zeros(hidden.shape[:2], dtype=torch.long),  # labels, unused without the hard loss
                None,  # bias
                0.0,  # weight_hard_loss
                1.0,  # weight_soft_loss
                -100,  # ignore_index
                case["temperature"],
                case["beta"],
                False,  # compiled
                case["chunk_size"],
                False,  # compute_ce_loss
                case["normalize_topk"],
            )
        loss.backward()
        results[case["name"]] = dict(loss=loss.detach(), hidden=hidden.grad, weight=weight.grad)
    torch.save(results, target)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
