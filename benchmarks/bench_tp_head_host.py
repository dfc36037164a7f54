"""The host's work of one rank's LM head and loss under tensor parallelism: the fused loss against the unfused
DTensor head, per call.

    torchrun --nproc_per_node 1 benchmarks/bench_tp_head_host.py            # one GPU: one rank's shapes of TP 4
    torchrun --nproc_per_node 4 benchmarks/bench_tp_head_host.py            # four GPUs: the real group
    torchrun --nproc_per_node 1 benchmarks/bench_tp_head_host.py --cpu      # smoke test (gloo, tiny, fp32)

A tensor-parallel step of a small model is host-bound: the host launches kernels more slowly than the GPU runs
them, so the host's time per call decides the step, not the GPU's. Each rank holds ``V / R`` rows of a real head
(one process alone holds the rows one rank of ``--shards`` ranks would) as a vocab-sharded DTensor, and the same
bf16 hidden states [B, T, D] and labels (the first quarter of each row ignored), and calls:

* ``unpatched``: what transformers' tensor-parallel head does: the DTensor linear, its output gathered, then its
  causal-LM loss (``ForCausalLMLoss``, shifted labels, ``num_items_in_batch``); a softcap applied as Gemma-2 does;
* ``patched``: ``fused_linear_cross_entropy`` on the DTensor weight as lce_patch's model forward calls it
  (``shift``, ``num_items_in_batch`` as a tensor, ``num_valid_tokens``: the rows with a label only);
* ``patched_all_rows``: the same without the count (every row processed);
* ``patched_local``: the weight as a plain shard with ``vocab_shard`` instead of a DTensor;
* ``one_gpu_op``: the op on the plain shard without vocabulary parallelism (the single-GPU path's host work).

Per variant: ``host_fwd`` and ``host_bwd`` (ms until the forward call, then ``backward()``, returned: the host's
time to issue the work), ``wall`` (each call bracketed by device synchronisations), ``pipelined`` (20 calls
back to back, per call), ``launches`` / ``memcpy`` / ``syncs`` (CUDA runtime calls in one profiled call) and
``gpu_ms`` (kernel time in it); medians over ``--steps`` calls after ``--warmup``. ``--cprofile`` also writes
Python profiles of the unpatched and patched calls. Rank 0 prints a table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench_common import (  # noqa: E402
    CUDA_LAUNCH_CALLS,
    add_out_arg,
    add_sharded_head_args,
    env_info,
    init_distributed,
    write_json,
)

from lce_patch import VocabShard, fused_linear_cross_entropy  # noqa: E402

# name: (hidden size D, vocabulary V, final-logit softcap)
SHAPES = {"llama3.2-1b": (2048, 128256, None), "gemma2-2b": (2304, 256000, 30.0)}
VARIANTS = ("unpatched", "patched", "patched_all_rows", "patched_local", "one_gpu_op")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sharded_head_args(parser, SHAPES, "4096,8192", "comma-separated tokens per call (rows of 2048)", 8, 30)
    parser.add_argument("--shards", type=int, default=4, help="one process alone: hold one of this many shards")
    parser.add_argument("--cprofile", action="store_true", help="also write Python profiles (unpatched, patched)")
    add_out_arg(parser, "bench_tp_head_host")
    return parser.parse_args(argv)


def unfused_head(hidden, weight, labels, vocab_size, softcap, num_items, mesh):
    """The tensor-parallel head as transformers runs it: a DTensor linear, its output gathered, then the loss."""
    from torch.distributed.tensor import DTensor, Replicate
    from transformers.loss.loss_utils import ForCausalLMLoss

    replicated = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    logits = torch.nn.functional.linear(replicated, weight).redistribute(placements=[Replicate()]).to_local()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=num_items)


def profile_counts(step, cuda: bool) -> dict:
    """CUDA runtime launches, copies and synchronisations, and kernel time, of one call under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    return {
        "launches": sum(e.count for e in events if e.key in CUDA_LAUNCH_CALLS),
        "memcpy": sum(e.count for e in events if e.key.startswith("cuda") and "Memcpy" in e.key),
        "syncs": sum(e.count for e in events if "Synchronize" in e.key),
        "gpu_ms": sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e3 if cuda else 0.0,
    }


def measure(step, args, cuda: bool) -> dict:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        step()
    forward, backward, wall = [], [], []
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        fwd, bwd = step()
        sync()
        wall.append(time.perf_counter() - start)
        forward.append(fwd)
        backward.append(bwd)
    sync()
    start = time.perf_counter()
    for _ in range(20):
        step()
    sync()
    pipelined = (time.perf_counter() - start) / 20

    def median_ms(values):
        return 1e3 * statistics.median(values)

    return {
        "host_fwd": median_ms(forward),
        "host_bwd": median_ms(backward),
        "wall": median_ms(wall),
        "pipelined": 1e3 * pipelined,
        **profile_counts(step, cuda),
    }


def run_shape(name: str, tokens: int, args, mesh, rank: int, world: int, device, cuda: bool) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    d, v, softcap = SHAPES[name]
    if args.cpu:
        d, v = 32, 480
    seq = 2048 if not args.cpu else 16
    batch = max(1, tokens // seq)
    dtype = torch.bfloat16 if cuda else torch.float32
    total = v // args.shards if world == 1 else v  # one process alone: one shard's rows make its vocabulary
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(batch, seq, d, device=device, generator=gen).to(dtype).requires_grad_()
    whole = (torch.randn(total, d, device=device, generator=gen) * d**-0.5).to(dtype)
    labels = torch.randint(0, total, (batch, seq), device=device, generator=gen)
    labels[:, : seq // 4] = -100
    num_valid = int((labels[:, 1:] != -100).sum())
    num_items = torch.tensor(num_valid, device=device)
    weight = torch.nn.Parameter(distribute_tensor(whole, mesh, [Shard(0)]))
    local = torch.nn.Parameter(weight.to_local().detach().clone())
    start = weight.to_local().shape[0] * rank if total % world == 0 else None
    if start is None:
        raise SystemExit(f"{name}: a vocabulary of {total} does not split evenly over {world} ranks")
    shard = VocabShard(start, total, mesh.get_group(0))
    common = dict(shift=True, num_items_in_batch=num_items, softcap=softcap)
    calls = {
        "unpatched": lambda: unfused_head(hidden, weight, labels, total, softcap, num_items, mesh),
        "patched": lambda: fused_linear_cross_entropy(hidden, weight, labels, num_valid_tokens=num_valid, **common),
        "patched_all_rows": lambda: fused_linear_cross_entropy(hidden, weight, labels, **common),
        "patched_local": lambda: fused_linear_cross_entropy(
            hidden, local, labels, num_valid_tokens=num_valid, vocab_shard=shard, **common
        ),
        "one_gpu_op": lambda: fused_linear_cross_entropy(hidden, local, labels, num_valid_tokens=num_valid, **common),
    }
    if world > 1:
        del calls["one_gpu_op"]  # its loss would cover one shard: not comparable across a group
    results = {}
    for variant, call in calls.items():

        def step(call=call):
            hidden.grad = weight.grad = local.grad = None
            start = time.perf_counter()
            loss = call()
            middle = time.perf_counter()
            loss.backward()
            return middle - start, time.perf_counter() - middle

        results[variant] = measure(step, args, cuda)
        if args.cprofile and variant in ("unpatched", "patched") and rank == 0:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(10):
                step()
            profiler.disable()
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumtime").print_stats(60)
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"cprofile_{name}_{tokens}_{variant}.txt").write_text(text.getvalue())
    return {"shape": name, "tokens": tokens, "shard_rows": int(local.shape[0]), "variants": results}


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = not args.cpu
    device = init_distributed(args.cpu)
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    rows = [
        run_shape(name, int(tokens), args, mesh, rank, world, device, cuda)
        for name in args.shapes.split(",")
        for tokens in args.tokens.split(",")
    ]
    if rank == 0:
        print("| shape | tokens | variant | host fwd ms | host bwd ms | wall ms | pipelined ms | launches | GPU ms |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            for variant, r in row["variants"].items():
                print(
                    f"| {row['shape']} | {row['tokens']} | {variant} | {r['host_fwd']:.2f} | {r['host_bwd']:.2f} | "
                    f"{r['wall']:.2f} | {r['pipelined']:.2f} | {r['launches']} | {r['gpu_ms']:.2f} |"
                )
        report = {
            **env_info(),
            "world_size": world,
            "shards": args.shards if world == 1 else world,
            "rows": rows,
        }
        write_json(Path(args.out) / f"bench_tp_head_host_w{world}.json", report)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
