"""The longest sequence that trains one step, at micro-batch 1: unpatched, lce_patch, Liger's fused loss.

Llama-3.1-8B's and Qwen2.5-7B's shapes (random weights from a config built here; bf16 weights, SGD, gradient
checkpointing, SDPA attention). For each setup the search doubles the length from ``--start`` until a step runs
out of memory, then bisects to ``--resolution`` tokens (or tries the lengths of ``--lengths``); every trial catches
``torch.OutOfMemoryError``, frees and goes on. Then tokens/s at the longest length every setup fits (``--timed-steps``
steps after one warm-up).

One GPU:                ``python benchmarks/long_context.py``
Context parallelism:    ``torchrun --nproc_per_node 4 benchmarks/long_context.py --parallel cp``
    (FSDP2 ``fully_shard`` over the ranks, torch's ``context_parallel`` ring attention on SDPA: each rank holds
    ``length / N`` positions of the sequence in the load-balanced order; ``shift_labels`` built before sharding and
    ``num_items_in_batch`` the whole sequence's count, the loss times N, as the Trainer does)
Ulysses:                ``torchrun --nproc_per_node 4 benchmarks/long_context.py --parallel ulysses``
    (DeepSpeed's ``UlyssesSPAttentionHF`` all-to-all attention on SDPA, each rank a contiguous slice, the ranks'
    mean losses combined by valid tokens as ``deepspeed_sp_compute_loss`` does; FSDP2 shards the weights over the same
    ranks instead of ZeRO-3, so that one code path times both)
Keep NVLink multicast off on shared hosts (NCCL_NVLS_ENABLE=0). CPU smoke run (tiny shapes): ``--cpu``.

Lengths under CP / Ulysses are the whole sequence's (all ranks together). ``PYTORCH_CUDA_ALLOC_CONF`` is set to
``expandable_segments:True`` unless the caller sets it: on the fragmented default allocator a length that fitted one
step ran out of memory over the timed steps. Progress is printed as trials finish and
the JSON (``$OUT`` or runs/long_context) is rewritten after each one, so a run cut short keeps what it found.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_common import env_info  # noqa: E402
from model_configs import RELEASED_CONFIGS  # noqa: E402

IGNORE = -100
SHAPES = {
    "llama3.1-8b": RELEASED_CONFIGS["llama-3.1-8b"],
    "qwen2.5-7b": RELEASED_CONFIGS["qwen2.5-7b"],
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
}
SETUPS = ("unpatched", "lce_patch", "liger")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Longest sequence that trains one step at micro-batch 1 (unpatched / lce_patch / Liger's fused "
        "loss) on one GPU or under context parallelism / Ulysses, and tokens/s at a length all setups fit.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES) + " (default: both 7-8B)")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma list of " + ", ".join(SETUPS))
    parser.add_argument("--parallel", choices=("none", "cp", "ulysses"), default="none")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--start", type=int, default=None, help="first length tried (default 16384; 64 on --cpu)")
    parser.add_argument("--max-length", type=int, default=None, help="stop doubling here (default 4M; 512 on --cpu)")
    parser.add_argument(
        "--resolution",
        type=float,
        default=0.25,
        help="bisect until the bracket is this fraction of the longest length found (coarse: each trial is a step)",
    )
    parser.add_argument(
        "--fake-memory-limit",
        type=int,
        default=None,
        help="testing: raise torch.OutOfMemoryError for lengths above this (exercises the search on CPU)",
    )
    parser.add_argument(
        "--fake-timed-memory-limit",
        type=int,
        default=None,
        help="testing: the same, in the timed steps only (exercises the shorter common length on CPU)",
    )
    parser.add_argument(
        "--lengths",
        default=None,
        help="comma list of lengths to try instead of the search (up to the first that runs out of memory)",
    )
    parser.add_argument("--timed-steps", type=int, default=2, help="steps timed at the common length")
    parser.add_argument("--time-budget", type=float, default=420.0, help="seconds; later searches are skipped past it")
    parser.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    parser.add_argument("--cpu", action="store_true", help="CPU smoke run: tiny shape, fp32")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / "long_context"))
    args = parser.parse_args(argv)
    args.shapes = (args.shapes or ("tiny" if args.cpu else "llama3.1-8b,qwen2.5-7b")).split(",")
    args.setups = args.setups.split(",")
    for name in args.shapes:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}")
    for name in args.setups:
        if name not in SETUPS:
            parser.error(f"unknown setup {name!r}")
    args.start = args.start or (64 if args.cpu else 16384)
    args.max_length = args.max_length or (512 if args.cpu else 4 * 1024 * 1024)
    args.lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
    if args.cpu and args.parallel != "none":
        parser.error("--parallel cp / ulysses need GPUs (ring attention and the all-to-all run on NCCL)")
    return args


# --------------------------------------------------------------------------------------------- the distributed part
class Dist:
    """The process group (one process: world 1) and what each parallel mode does to a sequence."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.mode = args.parallel
        self.world, self.rank = 1, 0
        self.device = torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        self.mesh = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.mode != "none":
            torch.distributed.init_process_group("nccl", timeout=timedelta(seconds=180), device_id=self.device)
            self.world, self.rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh("cuda", (self.world,), mesh_dim_names=("cp",))
        self.ulysses_ready = False

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.mode == "none":
            return model.to(self.device)
        from torch.distributed.fsdp import fully_shard

        if self.mode == "cp":
            from accelerate.big_modeling import _attach_context_parallel_hooks
            from torch.distributed.tensor.experimental._attention import set_rotate_method

            set_rotate_method("allgather")  # accelerate's default cp_comm_strategy
            _attach_context_parallel_hooks(model)  # attention masks dropped for is_causal, as accelerate does
        for layer in model.model.layers:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        if self.mode == "ulysses" and not self.ulysses_ready:
            import deepspeed
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            deepspeed.init_distributed(dist_backend="nccl")  # its groups, on the process group already set up

            UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path=model,
                sequence_parallel_size=self.world,
                seq_length=None,
                seq_length_is_variable=True,
                core_attn_implementation="sdpa",
                micro_batch_size=1,
            )
            self.ulysses_ready = True
        return model

    def all_ok(self, ok: bool) -> bool:
        if self.mode == "none":
            return ok
        flag = torch.tensor([1.0 if ok else 0.0], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item() > 0)

    def max_peak(self, peak: float) -> float:
        if self.mode == "none":
            return peak
        value = torch.tensor([peak], device=self.device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return float(value.item())


def _batch(length: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(0, vocab, (1, length), generator=gen)
    labels = ids.clone()
    labels[:, : length // 8] = IGNORE  # a prompt
    shift = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[:, 1:].contiguous()
    return {
        "input_ids": ids.to(device),
        "shift_labels": shift.to(device),
        "position_ids": torch.arange(length)[None].to(device),
    }


FAKE_LIMIT: list[int | None] = [None]
FAKE_TIMED_LIMIT: list[int | None] = [None]


def train_step(model, optimizer, dist: Dist, length: int, vocab: int) -> None:
    """One step on one sequence of ``length`` tokens (the whole sequence's length under CP / Ulysses)."""
    if FAKE_LIMIT[0] is not None and length > FAKE_LIMIT[0]:
        raise torch.OutOfMemoryError(f"--fake-memory-limit {FAKE_LIMIT[0]}")
    batch = _batch(length, vocab, dist.device)
    n_items = (batch["shift_labels"] != IGNORE).sum()
    if dist.mode == "none":
        loss = model(**batch, labels=batch["shift_labels"], num_items_in_batch=n_items, use_cache=False).loss
        loss.backward()
    elif dist.mode == "cp":
        from torch.distributed.tensor.experimental import context_parallel

        buffers = [batch["input_ids"], batch["shift_labels"], batch["position_ids"]]
        with context_parallel(dist.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            out = model(
                input_ids=batch["input_ids"],
                labels=batch["shift_labels"],
                shift_labels=batch["shift_labels"],
                position_ids=batch["position_ids"],
                num_items_in_batch=n_items,
                use_cache=False,
            )
            (out.loss * dist.world).backward()  # FSDP averages over the ranks
    else:  # ulysses: a contiguous slice per rank, the ranks' mean losses weighted by their valid labels
        chunk = length // dist.world
        part = {k: v[:, dist.rank * chunk : (dist.rank + 1) * chunk] for k, v in batch.items()}
        loss = model(**part, labels=part["shift_labels"], use_cache=False).loss
        good = (part["shift_labels"] != IGNORE).sum()
        losses = torch.stack(torch.distributed.nn.functional.all_gather(loss))
        goods = torch.stack(torch.distributed.nn.functional.all_gather(good))
        safe = torch.where(goods > 0, losses, torch.zeros_like(losses))
        ((safe * goods).sum() / goods.sum().clamp(min=1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build(shape: str, setup: str, args: argparse.Namespace, dist: Dist):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    spec.pop("max_position_embeddings", None)  # set below, to the longest length tried
    if args.layers:
        spec["num_hidden_layers"] = args.layers
    config = AutoConfig.for_model(
        model_type, max_position_embeddings=max(args.max_length, 131072), use_cache=False, **spec
    )
    dtype = torch.float32 if args.cpu else torch.bfloat16
    with torch.device(dist.device):  # random weights made on the GPU (fast); FSDP2 then keeps each rank's shard
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    if setup == "lce_patch":
        import lce_patch

        lce_patch.apply_fused_lce(model)
    elif setup == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        # Liger's fused linear cross-entropy only: the comparison is of the loss
        _apply_liger_kernel_to_instance(
            model=model, fused_linear_cross_entropy=True, cross_entropy=False, rope=False, rms_norm=False, swiglu=False
        )
    if not args.no_checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_enable in 5.x
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model = dist.prepare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)  # no optimizer state: the memory is the step's
    return model, optimizer, config.vocab_size


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def trial(model, optimizer, dist: Dist, length: int, vocab: int) -> tuple[bool, float | None, str | None]:
    """(fits, peak GiB over the ranks, error): one step at ``length``, out of memory caught on every rank."""
    if dist.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    error = None
    try:
        train_step(model, optimizer, dist, length, vocab)
        ok = True
    except torch.OutOfMemoryError:
        ok, error = False, "out of memory"
    except RuntimeError as err:  # e.g. cuBLAS / NCCL allocations that fail outside the caching allocator
        if "out of memory" not in str(err).lower() and "CUBLAS_STATUS_ALLOC_FAILED" not in str(err):
            raise
        ok, error = False, str(err).splitlines()[0][:200]
    optimizer.zero_grad(set_to_none=True)
    _free()
    ok = dist.all_ok(ok)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dist.device.type == "cuda" else None
    return ok, (dist.max_peak(peak) if peak is not None else None), error


def search(model, optimizer, dist: Dist, args: argparse.Namespace, vocab: int, log) -> dict[str, Any]:
    step = 2 * dist.world  # divisible by the ring's 2N chunks and Ulysses' N slices
    tried: dict[int, dict[str, Any]] = {}

    def attempt(length: int) -> bool:
        length = max(step, length // step * step)
        if length not in tried:
            t0 = time.time()
            ok, peak, error = trial(model, optimizer, dist, length, vocab)
            tried[length] = {"ok": ok, "peak_gib": peak, "error": error, "seconds": time.time() - t0}
            log(
                f"    {length:>9} tokens: {'fits' if ok else 'OOM '}  peak {peak if peak is None else round(peak, 1)} GiB"
            )
        return tried[length]["ok"]

    if args.lengths:  # ascending; longer ones are not tried once one runs out of memory
        for length in sorted(args.lengths):
            if not attempt(length):
                break
    else:
        low, high = 0, None
        length = args.start
        while length <= args.max_length:
            if attempt(length):
                low, length = length, length * 2
            else:
                high = length
                break
        while high is not None and high - low > max(args.resolution * low, step):
            mid = (low + high) // 2
            if attempt(mid):
                low = mid
            else:
                high = mid
    fits = [n for n, t in tried.items() if t["ok"]]
    return {"longest": max(fits, default=0), "trials": {str(k): v for k, v in sorted(tried.items())}}


def timed(model, optimizer, dist: Dist, length: int, vocab: int, steps: int) -> dict[str, Any]:
    try:
        train_step(model, optimizer, dist, length, vocab)  # warm-up
        if dist.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if FAKE_TIMED_LIMIT[0] is not None and length > FAKE_TIMED_LIMIT[0]:
            raise torch.OutOfMemoryError(f"--fake-timed-memory-limit {FAKE_TIMED_LIMIT[0]}")
        for _ in range(steps):
            train_step(model, optimizer, dist, length, vocab)
        if dist.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / steps
        ok = True
    except torch.OutOfMemoryError:
        ok, seconds = False, None
    optimizer.zero_grad(set_to_none=True)
    _free()
    ok = dist.all_ok(ok)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dist.device.type == "cuda" else None
    return {
        "length": length,
        "ok": ok,
        "step_s": seconds,
        "tokens_per_s": length / seconds if ok and seconds else None,
        "peak_gib": dist.max_peak(peak) if peak is not None else None,
    }


def time_common(
    shape: str, results: dict, args: argparse.Namespace, dist: Dist, log, save, rows: dict[str, Any]
) -> None:
    """Tokens/s of every setup at the shortest of their longest lengths (each fits it, or a longer one); when one of
    them runs out of memory over the timed steps there (a search trial is one step, the timed run several), every
    setup is timed again, once, at the next shorter length all of them fitted in the search."""
    first = min(results[setup]["longest"] for setup in args.setups)
    fitted = [{int(n) for n, t in results[setup]["trials"].items() if t["ok"]} for setup in args.setups]
    shorter = sorted((n for n in set.intersection(*fitted) if n < first), reverse=True)
    common = [first, *shorter]
    for length in common[:2]:
        rows.clear()
        for setup in args.setups:
            model, optimizer, vocab = build(shape, setup, args, dist)
            rows[setup] = timed(model, optimizer, dist, length, vocab, args.timed_steps)
            log(
                f"  {setup} at {length} tokens: {rows[setup]['tokens_per_s']} tokens/s, peak {rows[setup]['peak_gib']} GiB"
            )
            del model, optimizer
            _free()
            save()
            if not rows[setup]["ok"]:
                log(f"  {setup} ran out of memory over the timed steps at {length} tokens")
                break
        if len(rows) == len(args.setups) and all(row["ok"] for row in rows.values()):
            break


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Long single sequences fragment the caching allocator: without expandable segments a length that fits one
    # step can run out of memory on the next. Read at the first CUDA allocation, so set here; a caller's setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("long_context: no CUDA device; --cpu runs the tiny smoke case")
    if "liger" in args.setups:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            args.setups = [s for s in args.setups if s != "liger"]
            print("long_context: liger_kernel not importable, its setup skipped", flush=True)
    FAKE_LIMIT[0] = args.fake_memory_limit
    FAKE_TIMED_LIMIT[0] = args.fake_timed_memory_limit
    dist = Dist(args)
    t_start = time.time()

    def log(message: str) -> None:
        if dist.rank == 0:
            print(f"[{time.time() - t_start:6.0f}s] {message}", flush=True)

    out = Path(args.out)
    path = out if out.suffix == ".json" else out / f"long_context_{args.parallel}_w{dist.world}.json"
    report: dict[str, Any] = {
        "args": vars(args),
        "world_size": dist.world,
        "parallel": args.parallel,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "results": {},
    }
    if dist.rank == 0:
        report["env"] = env_info()

    def save() -> None:
        if dist.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1, default=str))

    for shape in args.shapes:
        results = report["results"].setdefault(shape, {})
        for setup in args.setups:
            if time.time() - t_start > args.time_budget:
                log(f"{shape} {setup}: skipped (past the {args.time_budget:.0f} s budget)")
                results[setup] = {"skipped": "time budget"}
                continue
            log(f"{shape} {setup} ({args.parallel}, {dist.world} GPU(s))")
            model, optimizer, vocab = build(shape, setup, args, dist)
            results[setup] = search(model, optimizer, dist, args, vocab, log)
            log(f"  longest: {results[setup]['longest']} tokens")
            del model, optimizer
            _free()
            save()
        fits = [r["longest"] for r in results.values() if "longest" in r and r["longest"]]
        if len(fits) == len(args.setups) and time.time() - t_start < args.time_budget + 60:
            rows = report.setdefault("throughput", {}).setdefault(shape, {})
            time_common(shape, results, args, dist, log, save, rows)
    save()
    if dist.rank == 0:
        print(f"wrote {path}", flush=True)
    if dist.mode != "none":
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
