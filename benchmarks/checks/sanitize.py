"""Memory-safety run of the Triton path for compute-sanitizer (goal: nothing silently wrong).

Runs the fused op forward and backward on the GPU at odd sizes (V not a multiple of any block,
N not a multiple of the chunk, D odd), every option, every output, and the three dtypes, so that
every kernel is launched with its masked tails. Run it under the memory checker:

    compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/checks/sanitize.py

It prints one line per case and exits 0; compute-sanitizer's exit code reports access errors.
"""

from __future__ import annotations

import argparse

import torch

from lce_patch import fused_linear_cross_entropy, fused_linear_log_probs

CASES = [
    # (N, D, V, chunk_size, options)
    (37, 19, 50257, 16, {}),
    (130, 67, 4099, 64, {"softcap": 30.0, "bias": True}),
    (129, 64, 2053, 128, {"label_smoothing": 0.1, "z_loss": 1e-4}),
    (64, 33, 32769, None, {"logit_scale": 0.25, "shift": True}),
    (5, 8, 3, None, {}),
    (131, 40, 5003, 32, {"skip_ignored": True, "softcap": 20.0}),  # gathered rows, scattered dh
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for num_rows, hidden_size, vocab_size, chunk_size, options in CASES:
            options = dict(options)
            hidden = torch.randn(num_rows, hidden_size, device=device, generator=generator).to(dtype).requires_grad_()
            weight = (torch.randn(vocab_size, hidden_size, device=device, generator=generator) / hidden_size**0.5).to(
                dtype
            )
            weight.requires_grad_()
            bias = None
            if options.pop("bias", False):
                bias = torch.randn(vocab_size, device=device, generator=generator).to(dtype).requires_grad_()
            labels = torch.randint(0, vocab_size, (num_rows,), device=device, generator=generator)
            labels[::3] = -100
            loss = fused_linear_cross_entropy(
                hidden, weight, labels, bias=bias, backend="triton", chunk_size=chunk_size, **options
            )
            loss.backward()
            per_token = fused_linear_log_probs(
                hidden,
                weight,
                labels,
                bias=bias,
                softcap=options.get("softcap"),
                skip_ignored=options.get("skip_ignored", False),
                return_entropy=True,
                return_is_top1=True,
                backend="triton",
                chunk_size=chunk_size,
            )
            (per_token.log_probs.sum() + 0.1 * per_token.entropy.sum()).backward()
            torch.cuda.synchronize()
            finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(hidden.grad).all())
            print(f"{str(dtype):15} N={num_rows:4} D={hidden_size:3} V={vocab_size:6} {options}: finite={finite}")
    print("done")


if __name__ == "__main__":
    main()
