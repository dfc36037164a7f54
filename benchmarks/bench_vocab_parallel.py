"""The vocabulary-parallel op's scaling: per-rank time of the sharded loss against the one-GPU op on the whole head.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 4 benchmarks/bench_vocab_parallel.py
    torchrun --nproc_per_node 2 benchmarks/bench_vocab_parallel.py --cpu   # a smoke test on CPU processes (gloo)

Every rank holds ``V / R`` rows of a real head's weight (Llama-3.2-1B: D 2048, V 128256; Llama-3.1-8B: D 4096;
Gemma-2-2B: D 2304, V 256000, softcap 30) and the same bf16 hidden states [N, D] and labels (every 4th
ignored), and times ``fused_linear_cross_entropy(..., vocab_shard=...)`` forward + backward: the median, min
and max over ``--steps`` calls after ``--warmup`` (each call synchronized, so the time includes the collectives
and the wait for the slowest rank). Rank 0 also times the same op on the whole weight alone; the scaling
efficiency is that time / (R x the per-rank time). Rank 0 prints a table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))

from bench_common import add_out_arg, add_sharded_head_args, env_info, init_distributed, write_json  # noqa: E402

from lce_patch import VocabShard, fused_linear_cross_entropy  # noqa: E402

SHAPES = {
    "llama3.2-1b": (2048, 128256, None),
    "llama3.1-8b": (4096, 128256, None),
    "gemma2-2b": (2304, 256000, 30.0),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sharded_head_args(parser, SHAPES, "4096,8192,16384", "comma-separated token counts N", 5, 20)
    parser.add_argument("--no-whole", action="store_true", help="skip rank 0's one-GPU run on the whole head")
    add_out_arg(parser, "bench_vocab_parallel")
    return parser.parse_args(argv)


def timed_op(hidden, weight, labels, softcap, shard, warmup: int, steps: int, cuda: bool) -> dict:
    """Median, min and max ms of forward + backward of the op on fresh leaves of ``hidden`` and ``weight``."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def fn():
        h.grad = w.grad = None
        fused_linear_cross_entropy(h, w, labels, softcap=softcap, vocab_shard=shard).backward()

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = not args.cpu
    device = init_distributed(args.cpu)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for name in args.shapes.split(","):
        d, v, softcap = SHAPES[name]
        if args.cpu:
            d, v = 32, 501
        for n in (int(t) for t in args.tokens.split(",")):
            n = min(n, 64) if args.cpu else n
            gen = torch.Generator(device=device).manual_seed(0)
            hidden = torch.randn(n, d, device=device, generator=gen).to(dtype)
            weight = (torch.randn(v, d, device=device, generator=gen) * d**-0.5).to(dtype)
            labels = torch.randint(0, v, (n,), device=device, generator=gen)
            labels[::4] = -100
            size = -(-v // world)
            start, stop = min(rank * size, v), min((rank + 1) * size, v)
            row = {"shape": name, "tokens": n, "world_size": world, "shard_rows": stop - start}
            row["sharded"] = timed_op(
                hidden, weight[start:stop], labels, softcap, VocabShard(start, v), args.warmup, args.steps, cuda
            )
            if rank == 0 and not args.no_whole:
                row["whole_one_gpu"] = timed_op(hidden, weight, labels, softcap, None, args.warmup, args.steps, cuda)
                row["efficiency"] = row["whole_one_gpu"]["median_ms"] / (world * row["sharded"]["median_ms"])
            dist.barrier()
            rows.append(row)
            del hidden, weight
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        print(
            "| shape | N | ranks | per-rank ms: median (min-max); slowest rank's median | one GPU, whole head | efficiency |"
        )
        print("|---|---|---|---|---|---|")
        for i, row in enumerate(rows):
            slowest = max(ranks[i]["sharded"]["median_ms"] for ranks in gathered)
            t = row["sharded"]
            whole = (
                f"{row['whole_one_gpu']['median_ms']:.2f} | {row['efficiency']:.0%}" if "efficiency" in row else " | "
            )
            print(
                f"| {row['shape']} | {row['tokens']} | {world} | {t['median_ms']:.2f} ({t['min_ms']:.2f}-{t['max_ms']:.2f}); "
                f"{slowest:.2f} | {whole} |"
            )
        report = {"env": env_info(), "world_size": world, "ranks": gathered}
        write_json(Path(args.out) / f"bench_vocab_parallel_w{world}.json", report)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
