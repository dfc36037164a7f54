"""The distillation loss side by side: lce_patch's fused_linear_divergence, TRL's chunked divergence kernel,
Liger-Kernel's LigerFusedLinearJSD, the unfused full-logits loss and its torch.compile, forward+backward
(dh and dW of the student), bf16, on one GPU.

Per shape (student <- teacher, N tokens, every token selected, beta as given): median time of forward+backward
over ``--reps`` runs after warm-up in each of ``--rounds`` rounds that time every method in turn, the median of
the rounds and, against TRL's kernel, the speedup with its 95% paired interval over the rounds
(``bench_common.interleaved_rounds``), peak memory allocated above the inputs during one, the loss, and the GEMM
floor of the same run (the teacher's logits GEMM plus the student's logits, dh and dW GEMMs at full size,
cuBLAS, bf16).

    python3 benchmarks/bench_divergence.py [--shapes qwen1.5b-7b,llama1b-8b] [--betas 0.5] [--methods ...]
    python3 benchmarks/bench_divergence.py --tiny     # tiny shapes on the CPU (smoke test of the script)

TRL's kernel comes from the trl wheel (``trl.kernels.chunked_divergence``); as in bench_lce.py a stand-in for
``trl.trainer.utils`` is used when that module cannot be imported (no ``datasets`` on the GPU machine).
JSON to --out (default $OUT/bench_divergence.json or runs/bench_divergence.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

# name -> (student D, teacher D, V, N)
SHAPES = {
    "qwen1.5b-7b": (1536, 3584, 151936, 4096),
    "qwen1.5b-7b-16k": (1536, 3584, 151936, 16384),
    "qwen7b-7b": (3584, 3584, 151936, 4096),
    "llama1b-8b": (2048, 4096, 128256, 8192),
    "tiny": (32, 48, 500, 64),
}
METHODS = ("lce_patch", "trl", "liger", "unfused", "compile")


def build(method: str, h, w, ht, wt, beta: float):
    """A zero-argument callable returning the scalar loss. ``lce_patch:<rows>`` sets the chunk size,
    ``lce_patch_torch`` runs the op's PyTorch backend, ``+fp32_logits`` / ``+fp32_weight_grad`` set those
    options (``lce_patch+fp32_logits+fp32_weight_grad:1024``)."""
    if method.startswith("lce_patch"):
        from lce_patch import fused_linear_divergence

        name, _, rows = method.partition(":")
        name, *flags = name.split("+")
        options = dict(backend="torch" if name == "lce_patch_torch" else "auto")
        for flag in flags:
            if flag not in ("fp32_logits", "fp32_weight_grad"):
                raise ValueError(f"unknown lce_patch option {flag!r} in {method!r}")
            options[flag] = True
        if rows:
            options["chunk_size"] = int(rows)
        return lambda: fused_linear_divergence(h, w, ht, wt, beta=beta, **options)
    if method in ("unfused", "compile"):
        import torch

        from lce_patch.ops.linear_divergence import naive_linear_divergence

        def unfused():
            return naive_linear_divergence(h, w, ht, wt, beta=beta)[0]

        return torch.compile(unfused) if method == "compile" else unfused
    if method == "liger":
        from liger_kernel.transformers import LigerFusedLinearJSD

        liger = LigerFusedLinearJSD(jsd_beta=beta, temperature=1.0)
        return lambda: liger(h, w, ht, wt, None)
    if method == "trl":
        from bench_lce import _trl_backward_import

        _trl_backward_import()
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        def trl_loss():
            per_token, _ = ChunkedDivergenceFunction.apply(h, w, None, ht, wt, None, beta, 1.0, 1.0, None, 1.0, None)
            return per_token.sum() / per_token.shape[0]

        return trl_loss
    raise ValueError(method)


def prepare(fn, params, reps: int, device):
    """Warm-up (and Triton compilation), the loss and the peak memory of one forward+backward: the row, and a
    timer for the rounds (the median of ``reps`` timed calls, ms)."""
    import torch
    from bench_common import repeat_ms, synchronizer

    def step():
        for p in params:
            p.grad = None
        loss = fn()
        loss.backward()
        return loss

    loss = step()  # warm-up (and Triton compilation)
    step()
    sync = synchronizer(device)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    for p in params:
        p.grad = None
    step()
    sync()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else None

    def timed() -> float:
        ms = statistics.median(repeat_ms(step, reps, sync))
        for p in params:
            p.grad = None
        return ms

    return dict(peak_mib_above_inputs=peak, loss=loss.item()), timed


def errors(method: str, h, w, ht, wt, beta: float) -> dict:
    """Loss, dh and dW of ``method`` against an fp32 full-logits reference of the same bf16 inputs:
    relative error of the loss; of the gradients max |error| / max |reference| and the relative L2 error
    ||error|| / ||reference||."""

    from lce_patch.ops.linear_divergence import naive_linear_divergence

    def run(fn, hidden, weight):
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight)
        loss.backward()
        return loss.detach().double(), hidden.grad.double(), weight.grad.double()

    h32 = h.detach().float().requires_grad_(True)
    w32 = w.detach().float().requires_grad_(True)
    ref = run(lambda a, b: naive_linear_divergence(a, b, ht.float(), wt.float(), beta=beta)[0], h32, w32)
    del h32, w32
    got = run(lambda a, b: build(method, a, b, ht, wt, beta)(), h, w)
    out = dict(loss_rel=float((got[0] - ref[0]).abs() / ref[0].abs()))
    for name, g, r in (("dh", got[1], ref[1]), ("dW", got[2], ref[2])):
        out[f"{name}_rel_max"] = float((g - r).abs().max() / r.abs().max())
        out[f"{name}_rel_l2"] = float((g - r).norm() / r.norm())
    return out


def gemm_floor(h, w, ht, wt, reps: int, device) -> float:
    import torch
    from bench_common import repeat_ms, synchronizer

    logits_grad = torch.empty(h.shape[0], w.shape[0], dtype=h.dtype, device=device)

    def gemms():
        ht @ wt.T
        h @ w.T
        logits_grad @ w
        logits_grad.T @ h

    gemms()
    return statistics.median(repeat_ms(gemms, reps, synchronizer(device)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen1.5b-7b,llama1b-8b", help=f"of {sorted(SHAPES)}")
    parser.add_argument("--betas", default="0.5")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--reps", type=int, default=10, help="timed calls per method in each round")
    parser.add_argument(
        "--rounds", type=int, default=5, help="timing rounds over every method, in turn (median of the rounds)"
    )
    parser.add_argument(
        "--logit-std",
        type=float,
        default=0.5,
        help="spread of both models' random logits (default %(default)s; a pretrained head's is a few units)",
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU, float32")
    parser.add_argument(
        "--errors",
        default="",
        help="comma-separated methods whose loss/dh/dW error against an fp32 reference is measured per shape and beta",
    )
    default_out = os.path.join(os.environ.get("OUT", str(REPO / "runs")), "bench_divergence.json")
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()

    import torch
    from bench_common import device_and_dtype, env_info, free, interleaved_rounds

    device, dtype = device_and_dtype(args.tiny)
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    results = []
    for name in shapes:
        dim, teacher_dim, vocab, tokens = SHAPES[name]
        gen = torch.Generator(device=device).manual_seed(0)
        # W's rows have norm ~1, so a logit's standard deviation is hidden's
        spread = args.logit_std
        h = (torch.randn(tokens, dim, device=device, generator=gen) * spread).to(dtype).requires_grad_(True)
        w = (torch.randn(vocab, dim, device=device, generator=gen) / dim**0.5).to(dtype).requires_grad_(True)
        ht = (torch.randn(tokens, teacher_dim, device=device, generator=gen) * spread).to(dtype)
        wt = (torch.randn(vocab, teacher_dim, device=device, generator=gen) / teacher_dim**0.5).to(dtype)
        floor = gemm_floor(h.detach(), w.detach(), ht, wt, args.reps, device)
        for beta in (float(b) for b in args.betas.split(",")):
            row = dict(shape=name, D=dim, D_teacher=teacher_dim, V=vocab, N=tokens, beta=beta, logit_std=spread)
            row["gemm_floor_ms"] = floor
            timers = {}
            for method in args.methods.split(","):
                try:
                    row[method], timers[method] = prepare(build(method, h, w, ht, wt, beta), [h, w], args.reps, device)
                except Exception as exc:  # out of memory, a peer missing: recorded, the run goes on
                    row[method] = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
                free()
            baseline = "trl" if "trl" in timers else None
            for method, timing in interleaved_rounds(timers, args.rounds, baseline).items():
                row[method].update(timing)
                if "ms" in timing:
                    row[method]["pct_of_floor"] = 100 * floor / timing["ms"]
            for method in args.methods.split(","):
                print(name, beta, method, row[method], flush=True)
            for method in filter(None, args.errors.split(",")):
                row.setdefault(method, {})
                try:
                    row[method]["errors_vs_fp32"] = errors(method, h, w, ht, wt, beta)
                except Exception as exc:
                    row[method]["errors_vs_fp32"] = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
                free()
                print(name, beta, method, "errors", row[method]["errors_vs_fp32"], flush=True)
            results.append(row)
        del h, w, ht, wt
        free()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(env=env_info(), results=results), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
