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

An out of memory does not always surface as ``torch.OutOfMemoryError``: inside ring attention's exchange it came as
``NCCL Error 1: unhandled cuda error``, after which the process group (and often the CUDA context) is unusable.
``--isolate`` runs each search and each timed run in a process of its own (``--nproc N``: a torchrun of N processes,
launched here: ``python benchmarks/long_context.py --parallel cp --nproc 4 --isolate``); when one dies on a CUDA or
NCCL error in a trial, that trial is recorded as out of memory (with the error it surfaced as) and the search goes
on in a fresh process from the trials already made. Without ``--isolate`` such an error is recorded the same way,
and the run ends there (its JSON kept).

Lengths under CP / Ulysses are the whole sequence's (all ranks together). ``PYTORCH_CUDA_ALLOC_CONF`` is set to
``expandable_segments:True`` unless the caller sets it: on the fragmented default allocator a length that fitted one
step ran out of memory over the timed steps. Progress is printed as trials finish and
the JSON (``$OUT`` or runs/long_context) is rewritten after each one, so a run cut short keeps what it found.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
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

from bench_common import (  # noqa: E402
    DEVICE_OOM_MARKERS,
    MULTICAST_OFF,
    argv_without,
    env_info,
    out_of_memory,
    out_path,
    write_json,
)
from model_configs import RELEASED_CONFIGS, tiny  # noqa: E402

IGNORE = -100
SHAPES = {
    "llama3.1-8b": RELEASED_CONFIGS["llama-3.1-8b"],
    "qwen2.5-7b": RELEASED_CONFIGS["qwen2.5-7b"],
    "tiny": tiny(model_type="llama", vocab_size=512, tie_word_embeddings=False),
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
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="each search and timed run in a process of its own (see the module doc); a CUDA / NCCL error there is "
        "recorded as out of memory and the run goes on",
    )
    parser.add_argument("--nproc", type=int, default=1, help="with --isolate: processes per launch (torchrun)")
    parser.add_argument(
        "--fake-device-error-above",
        type=int,
        default=None,
        help="testing: raise an NCCL-style error (the process then ends) for lengths above this",
    )
    parser.add_argument("--known", default=None, help=argparse.SUPPRESS)  # a child's trials made so far
    parser.add_argument("--time-at", type=int, default=None, help=argparse.SUPPRESS)  # a child's timed run
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
FAKE_DEVICE_ERROR: list[int | None] = [None]
DEVICE_ERROR_EXIT = 75  # a process that ends on such an error (its state is not to be trusted) exits with this


class DeviceError(Exception):
    """A CUDA or NCCL error taken for an out of memory: the process group and CUDA context are not to be reused."""


def train_step(model, optimizer, dist: Dist, length: int, vocab: int) -> None:
    """One step on one sequence of ``length`` tokens (the whole sequence's length under CP / Ulysses)."""
    if FAKE_LIMIT[0] is not None and length > FAKE_LIMIT[0]:
        raise torch.OutOfMemoryError(f"--fake-memory-limit {FAKE_LIMIT[0]}")
    if FAKE_DEVICE_ERROR[0] is not None and length > FAKE_DEVICE_ERROR[0]:
        raise RuntimeError("NCCL Error 1: unhandled cuda error (simulated by --fake-device-error-above)")
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
    """(fits, peak GiB over the ranks, error): one step at ``length``, out of memory caught on every rank. An out of
    memory that surfaced as a CUDA / NCCL error raises :class:`DeviceError` (the process cannot go on)."""
    if dist.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    error = None
    try:
        train_step(model, optimizer, dist, length, vocab)
        ok = True
    except (torch.OutOfMemoryError, RuntimeError) as err:
        error = out_of_memory(err)
        if error is None:
            raise
        if error != "out of memory" and "CUBLAS_STATUS_ALLOC_FAILED" not in str(err):
            raise DeviceError(error) from None
        ok = False
    optimizer.zero_grad(set_to_none=True)
    _free()
    ok = dist.all_ok(ok)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dist.device.type == "cuda" else None
    return ok, (dist.max_peak(peak) if peak is not None else None), error


def search(
    model, optimizer, dist: Dist, args: argparse.Namespace, vocab: int, log, known=None, progress=None
) -> dict[str, Any]:
    """The longest length that fits, from ``known`` trials on (an earlier process's); ``progress(trials, length)``
    is told each length before its trial and the trials after it (length None)."""
    step = 2 * dist.world  # divisible by the ring's 2N chunks and Ulysses' N slices
    tried: dict[int, dict[str, Any]] = {int(n): t for n, t in (known or {}).items()}

    def attempt(length: int) -> bool:
        length = max(step, length // step * step)
        if length not in tried:
            t0 = time.time()
            if progress is not None:
                progress(tried, length)
            ok, peak, error = trial(model, optimizer, dist, length, vocab)
            tried[length] = {"ok": ok, "peak_gib": peak, "error": error, "seconds": time.time() - t0}
            if progress is not None:
                progress(tried, None)
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
        ok, error = True, None
    except (torch.OutOfMemoryError, RuntimeError) as err:
        error = out_of_memory(err)
        if error is None:
            raise
        if error != "out of memory":
            raise DeviceError(error) from None
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
        **({"error": error} if error else {}),
    }


def time_common(shape: str, results: dict, args: argparse.Namespace, measure, log, save, rows: dict[str, Any]) -> None:
    """Tokens/s of every setup at the shortest of their longest lengths (each fits it, or a longer one); when one of
    them runs out of memory over the timed steps there (a search trial is one step, the timed run several), every
    setup is timed again, once, at the next shorter length all of them fitted in the search. ``measure(setup,
    length)`` gives one setup's row."""
    first = min(results[setup]["longest"] for setup in args.setups)
    fitted = [{int(n) for n, t in results[setup]["trials"].items() if t["ok"]} for setup in args.setups]
    shorter = sorted((n for n in set.intersection(*fitted) if n < first), reverse=True)
    for length in [first, *shorter][:2]:
        rows.clear()
        for setup in args.setups:
            rows[setup] = measure(setup, length)
            log(
                f"  {setup} at {length} tokens: {rows[setup]['tokens_per_s']} tokens/s, peak {rows[setup]['peak_gib']} GiB"
            )
            save()
            if not rows[setup]["ok"]:
                log(f"  {setup} ran out of memory over the timed steps at {length} tokens")
                break
        if len(rows) == len(args.setups) and all(row["ok"] for row in rows.values()):
            break


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    # Long single sequences fragment the caching allocator: without expandable segments a length that fits one
    # step can run out of memory on the next. Read at the first CUDA allocation, so set here; a caller's setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for name, value in MULTICAST_OFF.items():  # also for the processes --isolate starts
        os.environ.setdefault(name, value)
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("long_context: no CUDA device; --cpu runs the tiny smoke case")
    if "liger" in args.setups and importlib.util.find_spec("liger_kernel") is None:
        args.setups = [s for s in args.setups if s != "liger"]
        print("long_context: liger_kernel not importable, its setup skipped", flush=True)
    if args.isolate:
        return run_isolated(args, argv)
    FAKE_LIMIT[0] = args.fake_memory_limit
    FAKE_TIMED_LIMIT[0] = args.fake_timed_memory_limit
    FAKE_DEVICE_ERROR[0] = args.fake_device_error_above
    dist = Dist(args)
    t_start = time.time()

    def log(message: str) -> None:
        if dist.rank == 0:
            print(f"[{time.time() - t_start:6.0f}s] {message}", flush=True)

    path = out_path(args.out, f"long_context_{args.parallel}_w{dist.world}")
    report = new_report(args, dist.world)
    if dist.rank == 0:
        report["env"] = env_info()

    def save() -> None:
        if dist.rank == 0:
            write_json(path, report)

    def measure(shape: str, setup: str, length: int) -> dict[str, Any]:
        model, optimizer, vocab = build(shape, setup, args, dist)
        row = timed(model, optimizer, dist, length, vocab, args.timed_steps)
        del model, optimizer
        _free()
        return row

    try:
        for shape in args.shapes:
            results = report["results"].setdefault(shape, {})
            if args.time_at:  # a child of --isolate: one timed run
                rows = report.setdefault("throughput", {}).setdefault(shape, {})
                for setup in args.setups:
                    rows[setup] = measure(shape, setup, args.time_at)
                continue
            for setup in args.setups:
                if time.time() - t_start > args.time_budget:
                    log(f"{shape} {setup}: skipped (past the {args.time_budget:.0f} s budget)")
                    results[setup] = {"skipped": "time budget"}
                    continue
                log(f"{shape} {setup} ({args.parallel}, {dist.world} GPU(s))")
                known = json.loads(Path(args.known).read_text()) if args.known else {}

                def progress(tried, length, results=results, setup=setup):
                    results[setup] = {"trials": {str(k): v for k, v in sorted(tried.items())}, "in_flight": length}
                    save()

                model, optimizer, vocab = build(shape, setup, args, dist)
                results[setup] = search(model, optimizer, dist, args, vocab, log, known, progress)
                log(f"  longest: {results[setup]['longest']} tokens")
                del model, optimizer
                _free()
                save()
            fits = [r["longest"] for r in results.values() if "longest" in r and r["longest"]]
            if not args.known and len(fits) == len(args.setups) and time.time() - t_start < args.time_budget + 60:
                rows = report.setdefault("throughput", {}).setdefault(shape, {})
                time_common(shape, results, args, functools.partial(measure, shape), log, save, rows)
    except DeviceError as error:
        # The process group and the CUDA context are not to be trusted after it: record, keep the JSON, end.
        report["ended_by"] = str(error)
        save()
        log(f"ended by a CUDA / NCCL error taken for an out of memory: {error}")
        os._exit(DEVICE_ERROR_EXIT)
    save()
    if dist.rank == 0:
        print(f"wrote {path}", flush=True)
    if dist.mode != "none":
        torch.distributed.destroy_process_group()
    return 0


def new_report(args: argparse.Namespace, world: int) -> dict[str, Any]:
    return {
        "args": vars(args),
        "world_size": world,
        "parallel": args.parallel,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "results": {},
    }


def run_isolated(args: argparse.Namespace, argv: list[str]) -> int:
    """Each search, and each timed run, in a launch of its own (``--nproc`` processes). A launch that dies in a
    trial on a CUDA / NCCL error gets that trial recorded as out of memory, and the search goes on in a fresh launch
    from the trials made so far."""
    passed = argv_without(argv, ("--nproc", "--shapes", "--setups", "--out", "--known", "--time-at"), ("--isolate",))
    path = out_path(args.out, f"long_context_{args.parallel}_w{args.nproc}")
    report = {**new_report(args, args.nproc), "isolated": True, "env": env_info(), "launches": []}
    work = Path(tempfile.mkdtemp(prefix="long_context_"))
    t_start = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - t_start:6.0f}s] {message}", flush=True)

    def launch(name: str, *extra: str) -> tuple[dict[str, Any], str | None]:
        """One child; its report, and why it died (None when it finished)."""
        child = work / f"{name}.json"
        command = [sys.executable, str(Path(__file__).resolve())]
        if args.parallel != "none":
            command[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
            command[4:4] = ["--master_port", str(29500 + len(report["launches"]) % 500)]
        begun = time.time()
        done = subprocess.run([*command, *passed, *extra, "--out", str(child)], capture_output=True, text=True)
        text = done.stdout + done.stderr
        report["launches"].append({"name": name, "rc": done.returncode, "seconds": round(time.time() - begun, 1)})
        found = json.loads(child.read_text()) if child.is_file() else {}
        if done.returncode == 0:
            return found, None
        if found.get("ended_by"):  # the child's own words, when it lived to write them
            return found, found["ended_by"]
        lines = [line.strip() for line in text.splitlines() if any(m in line for m in DEVICE_OOM_MARKERS)]
        why = f"out of memory (surfaced as: {lines[0][:200]})" if lines else f"failed: {text.strip()[-300:]}"
        return found, why

    for shape in args.shapes:
        results = report["results"].setdefault(shape, {})
        for setup in args.setups:
            if time.time() - t_start > args.time_budget:
                results[setup] = {"skipped": "time budget"}
                continue
            log(f"{shape} {setup} ({args.parallel}, {args.nproc} process(es), one launch per search)")
            trials: dict[str, Any] = {}
            for attempt in range(8):
                known = work / "known.json"
                known.write_text(json.dumps(trials))
                found, why = launch(
                    f"{shape}_{setup}_{attempt}", "--shapes", shape, "--setups", setup, "--known", str(known)
                )
                mine = found.get("results", {}).get(shape, {}).get(setup, {})
                trials.update(mine.get("trials", {}))
                if why is None:
                    results[setup] = mine
                    break
                in_flight = mine.get("in_flight")
                if in_flight is None or not why.startswith("out of memory"):
                    results[setup] = {"trials": trials, "error": why}
                    break
                trials[str(in_flight)] = {"ok": False, "peak_gib": None, "error": why, "seconds": None}
                log(f"    {in_flight:>9} tokens: OOM  ({why[:120]}); the search goes on in a fresh launch")
            fits = [int(n) for n, t in trials.items() if t["ok"]]
            results[setup].setdefault("longest", max(fits, default=0))
            log(f"  longest: {results[setup]['longest']} tokens")
            write_json(path, report)
        if all(results.get(s, {}).get("longest") for s in args.setups):

            def measure(setup: str, length: int, shape: str = shape) -> dict[str, Any]:
                found, why = launch(
                    f"{shape}_{setup}_timed_{length}", "--shapes", shape, "--setups", setup, "--time-at", str(length)
                )
                row = found.get("throughput", {}).get(shape, {}).get(setup)
                return (
                    row
                    if why is None and row
                    else {"length": length, "ok": False, "tokens_per_s": None, "peak_gib": None, "error": why}
                )

            rows = report.setdefault("throughput", {}).setdefault(shape, {})
            time_common(shape, results, args, measure, log, lambda: write_json(path, report), rows)
    write_json(path, report)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
