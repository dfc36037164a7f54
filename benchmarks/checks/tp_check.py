"""Tensor-parallel check: the vocabulary-parallel loss against one process, on GPUs.

Two parts, run under torchrun (keep NVLink multicast off on shared hosts):

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/checks/tp_check.py --part model --arch llama
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/checks/tp_check.py --part op

``--part op``: every rank holds a vocabulary shard of a real head (Llama-3.2-1B: D=2048, V=128256;
Gemma-2-2B: D=2304, V=256000, softcap 30) and calls ``fused_linear_cross_entropy(..., vocab_shard=...)``
in bf16 on the Triton kernels; its loss, dh and dW shard are compared with the same op on the whole
weight in one process (and the loss with an fp32 unfused reference).

``--part model``: a model of the chosen shape (random weights, bf16, ``--layers`` decoder layers) saved
once and loaded by every rank through transformers' distributed API, then training steps (forward +
backward) unpatched and patched on the same batch: losses and every gradient compared (bf16 noise), the
loss also against one process on the whole model and batch, per-rank peak memory above the model and the
step time. The loading (``--api``):

  * ``distributed_config`` (the default where transformers has it, 5.24 and later):
    ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=T, fsdp_size=F))`` with
    ``T = world / F`` (``--fsdp-size F``, default 1): tensor parallelism (F=1), TP x FSDP2 (both > 1), or
    FSDP2 alone (``--fsdp-size`` = the world size); ``--replicate-size R`` adds HSDP replicas
    (``dp_replicate_size=R``, ``T = world / (F x R)``). Each data-parallel rank takes its own rows of the global
    batch (``--tokens`` per data-parallel rank, the same on the ranks of one TP group).
  * ``tp_plan``: ``from_pretrained(..., tp_plan="auto")``, the older spelling (tensor parallelism only).

Timing: ``--warmup`` steps per variant (default 3; compilation and autotuning stay out of the timed steps), then
``--steps`` timed steps of each variant (default 20), interleaved (unpatched, patched, patched, unpatched, ...) so
that drift over the run reaches both alike, each started on every rank together (a barrier: otherwise a rank
that finished the untimed setup sooner times its wait for the others in the step's first collective) and
bracketed by device synchronisations, Python's garbage collector run before each and held off during it (as
``timeit`` does: a collection's pause then lands in no timed step; what was alive before the timed steps is frozen
out of the collector, so that each collection stays short); the median, min, p10, p90 and max per variant and
rank, each step's time (the slowest rank's) and the ratio of the variants' medians with a 95% interval from a
paired bootstrap over the steps: a host-bound step varies by 10-30% from step to step, so a ratio whose interval
holds 1 is a tie at that many steps (100 steps give an interval of about +-5% on the H100 hosts measured).
``--tokens`` takes several counts (``--sweep``: 4096 8192 16384 32768), run one after the other on the same loaded
model. ``--profile DIR`` writes a torch.profiler trace (Chrome
JSON) and a ``key_averages`` table of one unpatched and one patched step at the first token count, on rank 0,
and reports each profiled step's host span, GPU busy time, kernel launches and synchronisations (``step_work``):
a step whose host span is well above its GPU busy time is bound by the host, and there the launches decide.

``--compile [BACKEND]`` runs the model under ``torch.compile`` (inductor; aot_eager on CPU) and reports per variant
the graphs and graph breaks its warm-up compiled, with their reasons (the vocabulary-parallel op runs eagerly, a
graph break on each side of it), and that no graph was compiled inside the timed steps (one extra untimed step
of each variant first: switching the patch recompiles once). ``--no-checkpointing`` leaves gradient
checkpointing off (torch 2.13's AOT autograd fails on a compiled, checkpointed model with DTensor weights).

``--same-device`` puts every rank on cuda:0 with the gloo backend: a check of the values on one GPU
(its times and memory mean nothing). ``--cpu`` runs both parts on a tiny shape in fp32 on CPU processes over
gloo (``torchrun --nproc_per_node 2 benchmarks/checks/tp_check.py --cpu --part model``): a smoke test, run in CI.

Rank 0 prints a table and writes JSON to ``--out`` (default ``$OUT`` or runs/tp_check); exit 1 on FAIL.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import inspect
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import (  # the checks' shared harness: first
    OpSpy,
    Report,
    add_out_arg,
    ranks,
    rel_err,
    rel_l2,
    start,
)

# isort: split
from bench_common import compile_counters, compile_delta, ratio_interval, save_profile, timing_summary

import lce_patch
from lce_patch import VocabShard, fused_linear_cross_entropy

SHAPES = {
    "llama": dict(
        model_type="llama", tied=True, hidden=2048, vocab=128256, softcap=None, heads=32, kv_heads=8, intermediate=8192
    ),
    "gemma2": dict(
        model_type="gemma2", tied=True, hidden=2304, vocab=256000, softcap=30.0, heads=8, kv_heads=4, intermediate=9216
    ),
}
# Llama-3.1-8B's layers and head (the multi-GPU benchmark's model): Llama-3.2-1B's layout, wider, the head untied
SHAPES["llama8b"] = dict(SHAPES["llama"], tied=False, hidden=4096, intermediate=14336)
# --cpu: the same checks on a tiny shape over gloo, in fp32 (a smoke test of the script; CI runs it).
TINY = dict(hidden=64, vocab=509, heads=4, kv_heads=2, intermediate=128)
SWEEP = (4096, 8192, 16384, 32768)


def distributed_config_class() -> type | None:
    """transformers' ``DistributedConfig`` when it takes ``tp_size`` and ``fsdp_size`` (5.24 has it), else None."""
    try:
        from transformers import DistributedConfig
    except ImportError:
        return None
    fields = (
        {f.name for f in dataclasses.fields(DistributedConfig)}
        if dataclasses.is_dataclass(DistributedConfig)
        else set(inspect.signature(DistributedConfig).parameters)
    )
    return DistributedConfig if {"tp_size", "fsdp_size"} <= fields else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--part", choices=("op", "model"), default="op")
    parser.add_argument("--arch", choices=sorted(SHAPES), default="llama")
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[4096],
        help="tokens per step (op) / batch x seq per FSDP rank (model); several run one after the other",
    )
    parser.add_argument("--sweep", action="store_true", help=f"--tokens {' '.join(map(str, SWEEP))}")
    parser.add_argument("--seq-len", type=int, default=2048, help="model part: tokens per sequence")
    parser.add_argument("--layers", type=int, default=4, help="model part: decoder layers")
    parser.add_argument("--warmup", type=int, default=3, help="model part: untimed steps per variant")
    parser.add_argument("--steps", type=int, default=20, help="model part: timed steps per variant")
    parser.add_argument(
        "--api",
        choices=("distributed_config", "tp_plan"),
        default=None,
        help="model part: how the model is distributed (default: distributed_config where transformers has "
        "DistributedConfig(tp_size=, fsdp_size=), else tp_plan='auto')",
    )
    parser.add_argument(
        "--fsdp-size",
        type=int,
        default=1,
        help="model part, --api distributed_config: FSDP2 ranks; tp_size = world size / fsdp_size "
        "(the world size: FSDP2 alone)",
    )
    parser.add_argument(
        "--replicate-size",
        type=int,
        default=1,
        help="model part, --api distributed_config: HSDP replicas (DistributedConfig(dp_replicate_size=)) of the "
        "FSDP2 group; tp_size = world size / (fsdp_size x replicate_size)",
    )
    parser.add_argument("--no-reference", action="store_true", help="model part: skip the one-process loss")
    parser.add_argument(
        "--no-checkpointing",
        action="store_true",
        help="model part: without gradient checkpointing (on by default; with --compile on DTensor weights some "
        "torch versions fail in AOT autograd with it: torch 2.13 saves the DeviceMesh among the tensors)",
    )
    parser.add_argument(
        "--rtol-reference",
        type=float,
        default=None,
        help="model part: loss vs one process, relative (default 1e-2 in bf16, 1e-5 with --cpu)",
    )
    parser.add_argument("--profile", default=None, help="model part: write a profile of one step per variant here")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="model part: run the model under torch.compile (default backend inductor; aot_eager on CPU) and "
        "report each variant's graphs and graph breaks",
    )
    parser.add_argument(
        "--same-device", action="store_true", help="all ranks on cuda:0 over gloo (checks values; no timing)"
    )
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on CPU processes over gloo, fp32 (smoke test)")
    add_out_arg(parser, "tp_check")
    args = parser.parse_args(argv)
    if args.sweep:
        args.tokens = list(SWEEP)
    if args.cpu:
        args.tokens = [min(t, 256) for t in args.tokens]
        args.seq_len, args.layers = min(args.seq_len, 64), min(args.layers, 2)
    if args.api is None:
        args.api = "distributed_config" if distributed_config_class() is not None else "tp_plan"
    if args.api == "distributed_config" and distributed_config_class() is None:
        parser.error(
            f"--api distributed_config: transformers {__import__('transformers').__version__} has no "
            "DistributedConfig(tp_size=, fsdp_size=) (5.24 has it); use --api tp_plan"
        )
    if args.fsdp_size < 1 or (args.fsdp_size > 1 and args.api != "distributed_config"):
        parser.error("--fsdp-size > 1 needs --api distributed_config (tp_plan= gives tensor parallelism only)")
    if args.replicate_size < 1 or (args.replicate_size > 1 and args.api != "distributed_config"):
        parser.error("--replicate-size > 1 needs --api distributed_config")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    if args.compile is not None and args.part != "model":
        parser.error("--compile compiles the model: --part model")
    if args.compile == "inductor" and args.cpu:
        args.compile = "aot_eager"  # the smoke test checks the graphs, not the generated code
    return args


def shape_of(args) -> dict:
    shape = dict(SHAPES[args.arch])
    if args.cpu:
        shape.update(TINY, softcap=shape["softcap"] and 2.0)
    return shape


def compute_dtype(args) -> torch.dtype:
    return torch.float32 if args.cpu else torch.bfloat16


def shard_bounds(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """torch.chunk's split, as DTensor's Shard(0) makes it."""
    size = -(-vocab // world)
    return min(rank * size, vocab), min((rank + 1) * size, vocab)


def check_op(args, tokens: int, rank: int, world: int, device: torch.device) -> dict:
    shape = shape_of(args)
    dtype = compute_dtype(args)
    gen = torch.Generator(device=device).manual_seed(0)
    n, d, v = tokens, shape["hidden"], shape["vocab"]
    hidden = torch.randn(n, d, device=device, generator=gen).to(dtype)
    weight = (torch.randn(v, d, device=device, generator=gen) * (2.0 / d**0.5)).to(dtype)
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    labels[::7] = -100
    start, stop = shard_bounds(v, world, rank)
    options = dict(softcap=shape["softcap"], backend="torch" if args.cpu else "triton")

    h = hidden.clone().requires_grad_()
    w = weight[start:stop].clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, labels, vocab_shard=VocabShard(start, v), **options)
    loss.backward()

    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = fused_linear_cross_entropy(h_ref, w_ref, labels, **options)
    ref.backward()
    with torch.no_grad():  # fp32 unfused loss, chunked over tokens to bound its memory
        total, count = 0.0, 0
        for i in range(0, n, 512):
            logits = hidden[i : i + 512].double() @ weight.double().t()
            if shape["softcap"]:
                logits = shape["softcap"] * torch.tanh(logits / shape["softcap"])
            total += float(torch.nn.functional.cross_entropy(logits, labels[i : i + 512], reduction="sum"))
            count += int((labels[i : i + 512] != -100).sum())
        fp32_loss = total / count
    return {
        "rank": rank,
        "shard": [start, stop],
        "loss": float(loss),
        "loss_one_process": float(ref),
        "loss_fp32_unfused": fp32_loss,
        "loss_rel_vs_one_process": rel_err(float(loss), float(ref)),
        "loss_rel_vs_fp32": rel_err(float(loss), fp32_loss),
        "dh_rel_vs_one_process": rel_l2(h.grad, h_ref.grad),
        "dw_rel_vs_one_process": rel_l2(w.grad, w_ref.grad[start:stop]),
    }


# ------------------------------------------------------------------------------------------------ model part
def save_model(args, rank: int, device: torch.device) -> Path:
    """The model of ``--arch``'s shape, saved once by rank 0 (random weights, initialised on ``device``: an 8B
    layer's initialisation on the CPU takes tens of seconds)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = shape_of(args)
    path = Path(tempfile.gettempdir()) / f"tp_check_{args.arch}_{args.layers}{'_cpu' if args.cpu else ''}"
    if rank == 0 and not (path / "config.json").exists():
        extra = {}
        if shape["model_type"] == "gemma2":
            extra = dict(final_logit_softcapping=shape["softcap"], head_dim=16 if args.cpu else 256)
        config = AutoConfig.for_model(
            shape["model_type"],
            vocab_size=shape["vocab"],
            hidden_size=shape["hidden"],
            intermediate_size=shape["intermediate"],
            num_hidden_layers=args.layers,
            num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv_heads"],
            tie_word_embeddings=shape["tied"],
            **extra,
        )
        torch.manual_seed(0)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype(args))
        model.save_pretrained(path)
    dist.barrier()
    return path


def load_distributed(args, path: Path, world: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    dtype = compute_dtype(args)
    if args.api == "tp_plan":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated in recent transformers, current in older ones
            return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
    config_class = distributed_config_class()
    sizes = dict(tp_size=world // data_parallel_size(args), fsdp_size=args.fsdp_size)
    if args.replicate_size > 1:
        sizes["dp_replicate_size"] = args.replicate_size
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=config_class(**sizes), dtype=dtype)


def profile_step(args, step, variant: str, tokens: int, rank: int, cuda: bool) -> dict | None:
    """One step under torch.profiler on rank 0 (the other ranks step alongside): Chrome trace, op table, and
    :func:`bench_common.step_work`'s summary (returned; None on the other ranks)."""
    from torch.profiler import ProfilerActivity, profile

    if rank != 0:
        step()
        return None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    stem = f"tp_check_{args.arch}_{layout_name(args)}_{tokens}_{variant}_rank0"
    return save_profile(prof, Path(args.profile), stem, cuda)


def data_parallel_size(args) -> int:
    """Data-parallel ranks (each its own rows of the batch): FSDP2's times HSDP's replicas; 1 under tp_plan."""
    return args.fsdp_size * args.replicate_size if args.api == "distributed_config" else 1


def layout_name(args) -> str:
    world = dist.get_world_size()
    if args.api == "tp_plan":
        return f"tp{world}_tpplan"
    replicas = f"_replicate{args.replicate_size}" if args.replicate_size > 1 else ""
    return f"tp{world // data_parallel_size(args)}_fsdp{args.fsdp_size}{replicas}"


def global_batch(args, tokens: int, dp_size: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``dp_size`` x (tokens // seq_len) sequences; the first quarter of each sequence ignored (-100)."""
    gen = torch.Generator().manual_seed(1)
    rows = max(1, tokens // args.seq_len) * dp_size
    ids = torch.randint(0, vocab, (rows, args.seq_len), generator=gen)
    labels = ids.clone()
    labels[:, : args.seq_len // 4] = -100
    labels[-1, -3:] = -100  # uneven counts over the FSDP ranks
    return ids, labels


def measure(args, model, step, variant: str, tokens: int, rank: int, device: torch.device) -> dict:
    """One variant at one token count: the compared step (loss, gradients on the host, the op's head weight),
    the rest of the warm-up, and a profiled step if asked. The timed steps come after, interleaved
    (:func:`time_interleaved`)."""
    cuda = device.type == "cuda"
    graphs_before = compile_counters() if args.compile else None
    with OpSpy(labels_at=None, host_reads=False) as op_calls:  # which head weight the op got (no host read: compile)
        loss = step()  # the values compared (and the first warm-up step)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grads[name] = grad.detach().to("cpu", copy=True)
    model.zero_grad(set_to_none=True)
    for _ in range(args.warmup - 1):
        step()
    compiled = compile_delta(graphs_before, compile_counters()) if graphs_before is not None else None
    work = None
    if args.profile and tokens == args.tokens[0]:
        work = profile_step(args, step, variant, tokens, rank, cuda)
    model.zero_grad(set_to_none=True)
    return {
        **({"compiled": compiled} if compiled is not None else {}),
        "loss": float(loss),
        "grads": grads,
        "op_calls": len(op_calls.calls),
        "op_weight": op_calls.calls[0]["weight"] if op_calls.calls else None,
        **({"profiled_step": work} if work is not None else {}),
    }


def set_variant(model, variant: str) -> None:
    patched = lce_patch.models.is_patched(model)
    if variant == "patched" and not patched:
        lce_patch.apply_fused_lce(model)
    elif variant == "unpatched" and patched:
        lce_patch.revert_fused_lce(model)


def time_interleaved(args, model, step, variants: list[str], device: torch.device, model_bytes: int) -> dict:
    """``--steps`` timed steps of each variant, alternating (A B, B A, A B, ...) so that drift of the host or the
    GPU clocks over the run reaches both alike; each step started on every rank together (a barrier) and
    bracketed by device synchronisations, with the garbage collector run before it and paused during it. Per
    variant: the timing summary and the peak memory above the model over its timed steps."""
    cuda = device.type == "cuda"
    times = {variant: [] for variant in variants}
    peaks = dict.fromkeys(variants, 0)
    collecting = gc.isenabled()
    # The objects alive now (the model, the libraries) are moved out of the collector's reach, so that the
    # collection before each step walks only what the steps made (a full walk of a loaded process is slow).
    gc.collect()
    gc.freeze()
    try:
        for i in range(args.steps):
            for variant in variants if i % 2 == 0 else variants[::-1]:
                set_variant(model, variant)
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                gc.collect()
                # Every rank starts the step together: a rank that set up sooner would otherwise wait for the
                # others inside the step's first collective, timing their setup (the variant switch, the
                # collection) as its own step.
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize(device)
                gc.disable()
                try:
                    start = time.perf_counter()
                    step()
                    if cuda:
                        torch.cuda.synchronize(device)
                    times[variant].append(1e3 * (time.perf_counter() - start))
                finally:
                    if collecting:
                        gc.enable()
                if cuda:
                    peaks[variant] = max(peaks[variant], torch.cuda.max_memory_allocated(device) - model_bytes)
    finally:
        gc.unfreeze()
    model.zero_grad(set_to_none=True)
    return {
        variant: {**timing_summary(times[variant]), "peak_mib": peaks[variant] / 2**20, "times_ms": times[variant]}
        for variant in variants
    }


def train_step(
    model: torch.nn.Module,
    ids: torch.Tensor,
    labels: torch.Tensor,
    num_items: torch.Tensor,
    dp_size: int,
    runner: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """Forward (through ``runner``, the compiled model, if given) and backward of one rank's rows; the rank's
    loss (detached)."""
    model.zero_grad(set_to_none=True)
    out = (model if runner is None else runner)(input_ids=ids, labels=labels, num_items_in_batch=num_items)
    (out.loss * dp_size).backward()
    return out.loss.detach()


def check_model(args, rank: int, world: int, device: torch.device) -> list[dict]:
    shape = shape_of(args)
    path = save_model(args, rank, device)
    model = load_distributed(args, path, world)
    model.train()
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable()
    runner = torch.compile(model, backend=args.compile) if args.compile else None
    dp_size = data_parallel_size(args)
    tp_size = world // dp_size
    dp_index = rank // tp_size  # transformers' mesh (pp, dp_replicate, fsdp, tp) in row-major rank order
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None and "fsdp" in (mesh.mesh_dim_names or ()) and args.replicate_size == 1:
        dp_index = mesh.get_local_rank("fsdp")
    cuda = device.type == "cuda"
    model_bytes = torch.cuda.memory_allocated(device) if cuda else 0
    head_weight = model.lm_head.weight
    head = {
        "weight": type(head_weight).__name__,
        "placements": [str(p) for p in head_weight.placements] if hasattr(head_weight, "placements") else None,
        "local_rows": int(head_weight.to_local().shape[0]) if hasattr(head_weight, "to_local") else None,
    }

    runs = []
    batches = {}
    for tokens in args.tokens:
        global_ids, global_labels = global_batch(args, tokens, dp_size, shape["vocab"])
        batches[tokens] = (global_ids, global_labels)
        rows = global_ids.shape[0] // dp_size
        ids = global_ids[dp_index * rows : (dp_index + 1) * rows].to(device)
        labels = global_labels[dp_index * rows : (dp_index + 1) * rows].to(device)
        # Every FSDP rank scales its loss by the global count and by dp_size (FSDP averages the gradients):
        # the gradients are then those of the whole batch's mean loss, as the Trainer makes them.
        num_items = torch.tensor(int((global_labels[:, 1:] != -100).sum()), device=device)

        step = functools.partial(train_step, model, ids, labels, num_items, dp_size, runner)

        results = {}
        for variant in ("unpatched", "patched"):
            set_variant(model, variant)
            try:
                results[variant] = measure(args, model, step, variant, tokens, rank, device)
            except torch.OutOfMemoryError as err:  # the unpatched head's logits at long inputs: the same on every rank
                results[variant] = {"oom": str(err).splitlines()[0][:300], "grads": {}, "op_calls": 0}
            if "oom" in results[variant]:  # (the error and its frames' tensors are gone here)
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.empty_cache()
        timed = [variant for variant in ("unpatched", "patched") if "oom" not in results[variant]]
        if args.compile:  # one more step of each after the other: the graphs of a variant switch compiled too
            for variant in timed:
                set_variant(model, variant)
                step()
        before = compile_counters() if args.compile else None
        for variant, summary in time_interleaved(args, model, step, timed, device, model_bytes).items():
            results[variant].update(summary)
        if before is not None:  # graphs compiled inside the timed steps would make their times meaningless
            for variant in timed:
                results[variant]["graphs_in_timed_steps"] = compile_counters()["graphs"] - before["graphs"]
        set_variant(model, "unpatched")
        grads_u, grads_p = results["unpatched"].pop("grads"), results["patched"].pop("grads")
        errors = {name: rel_l2(grads_p[name], grads_u[name]) for name in grads_u if name in grads_p}
        worst = max(errors, key=errors.get) if errors else None
        runs.append(
            {
                "tokens": tokens,
                "rank": rank,
                "dp_index": dp_index,
                "rows": rows,
                "head": head,
                "unpatched": results["unpatched"],
                "patched": results["patched"],
                "loss_rel": rel_err(results["patched"]["loss"], results["unpatched"]["loss"]) if errors else None,
                "missing_grads": sorted(set(grads_u) ^ set(grads_p)) if grads_u and grads_p else [],
                "worst_grad": worst,
                "worst_grad_rel": errors[worst] if worst else None,
                "head_grad_rel": errors.get("lm_head.weight", errors.get("model.embed_tokens.weight")),
            }
        )
    del model, step
    if not args.no_reference and rank == 0:
        references = reference_losses(args, path, batches, device)
        for run in runs:
            run["reference"] = references[run["tokens"]]
    return runs


def reference_losses(args, path: Path, batches: dict, device: torch.device) -> dict[int, dict]:
    """The loss of one process on the whole model and global batch: plain Hugging Face with --cpu; on GPUs the
    patched model (the fused loss, no [N, V] logits), whose op ``--part op`` and gpu_check test on their own."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype(args)).to(device)
    reference.train()
    kind = "unpatched" if args.cpu else "patched"
    if kind == "patched":
        lce_patch.apply_fused_lce(reference)
    losses = {}
    with torch.no_grad():
        for tokens, (ids, labels) in batches.items():
            total, count = 0.0, int((labels[:, 1:] != -100).sum())
            for i in range(ids.shape[0]):  # one sequence at a time: bounded memory
                out = reference(
                    input_ids=ids[i : i + 1].to(device),
                    labels=labels[i : i + 1].to(device),
                    num_items_in_batch=torch.tensor(count, device=device),
                )
                total += float(out.loss)
            losses[tokens] = {"loss": total, "model": kind}
    del reference
    return losses


# ------------------------------------------------------------------------------------------------ report
def summarize_model(args, tokens: int, ranks: list[dict], loss_tol: float, grad_tol: float) -> dict:
    """One token count: the global losses (summed over the FSDP ranks), the slowest rank's timings, verdicts."""
    tp_size = len(ranks) // max(1, len({r["dp_index"] for r in ranks}))
    leaders = [r for r in ranks if r["rank"] % tp_size == 0]  # one rank per FSDP index
    row = {"tokens": tokens, "ranks": ranks}
    for variant in ("unpatched", "patched"):
        if any("oom" in r[variant] for r in ranks):  # out of memory (on every rank: the same shapes)
            row[variant] = {"oom": next(r[variant]["oom"] for r in ranks if "oom" in r[variant])}
            continue
        slowest = max(ranks, key=lambda r: r[variant]["ms_median"])
        row[variant] = {
            "loss": sum(r[variant]["loss"] for r in leaders),
            **{k: slowest[variant][k] for k in ("ms_median", "ms_min", "ms_p10", "ms_p90", "ms_max", "steps")},
            "slowest_rank": slowest["rank"],
            "peak_mib": max(r[variant]["peak_mib"] for r in ranks),
        }
        if "profiled_step" in ranks[0][variant]:
            row[variant]["profiled_step_rank0"] = ranks[0][variant]["profiled_step"]
        if "compiled" in ranks[0][variant]:
            row[variant]["compiled_rank0"] = {
                **ranks[0][variant]["compiled"],
                "graphs_in_timed_steps": max(r[variant]["graphs_in_timed_steps"] for r in ranks),
            }
    if "oom" not in row["unpatched"] and "oom" not in row["patched"]:
        # A step's time is its slowest rank's (every step ends with a synchronisation on every rank).
        steps = {
            variant: [max(times) for times in zip(*(r[variant]["times_ms"] for r in ranks), strict=True)]
            for variant in ("unpatched", "patched")
        }
        row["ratio"] = {
            "median": statistics.median(steps["patched"]) / statistics.median(steps["unpatched"]),
            "interval95": ratio_interval(steps["unpatched"], steps["patched"]),
        }
    # The unpatched head may run out of memory at long inputs (its [N, V] logits on every rank): then only the
    # patched run is checked, against one process. The patched one must run.
    ok = "oom" not in row["patched"]
    if ok and "oom" not in row["unpatched"]:
        ok = all(r["loss_rel"] < 10 * loss_tol and r["worst_grad_rel"] < 2.5 * grad_tol for r in ranks)
        ok = ok and not any(r["missing_grads"] for r in ranks)
    # The fused op ran once per step on every rank: on a vocab-sharded DTensor head under tensor parallelism,
    # on the whole head (gathered by FSDP) without it.
    vocab = shape_of(args)["vocab"]
    for r in ranks:
        weight = r["patched"].get("op_weight") or {"shape": [0], "local_shape": [0]}
        rows, local_rows = weight["shape"][0], weight["local_shape"][0]
        ok = ok and r["patched"]["op_calls"] == 1 and r["unpatched"]["op_calls"] == 0
        ok = ok and weight.get("is_dtensor") == (tp_size > 1) and rows == vocab
        ok = ok and (local_rows < vocab if tp_size > 1 else local_rows == vocab)
    reference = ranks[0].get("reference")
    if reference is not None:
        tol = args.rtol_reference if args.rtol_reference is not None else (1e-5 if args.cpu else 1e-2)
        row["reference"] = {**reference, "rtol": tol}
        for variant in ("unpatched", "patched"):
            if "oom" not in row[variant]:
                row["reference"][f"{variant}_rel"] = rel_err(row[variant]["loss"], reference["loss"])
                ok = ok and row["reference"][f"{variant}_rel"] < tol
    row["ok"] = ok
    return row


def model_table(report: dict) -> list[str]:
    lines: list[str] = []
    lines.append(
        f"\n{report['arch']}, world size {report['world_size']}, {report['layout']} ({report['api']}), "
        + (f"torch.compile ({report['compile_backend']}), " if report.get("compile_backend") else "")
        + f"{report['warmup']} warm-up + {report['steps']} timed steps; ms per step on the slowest rank "
        "(median, p10-p90, min-max), peak MiB above the model (max over ranks)"
    )
    header = f"{'tokens':>7} {'variant':>9} {'median':>9} {'p10-p90':>17} {'min-max':>17} {'MiB':>8} {'loss':>10}"
    lines.append(header + "  vs one process")
    for row in report["runs"]:
        for variant in ("unpatched", "patched"):
            v = row[variant]
            if "oom" in v:
                lines.append(f"{row['tokens']:>7} {variant:>9} out of memory: {v['oom'][:80]}")
                continue
            ref = row.get("reference", {}).get(f"{variant}_rel")
            lines.append(
                f"{row['tokens']:>7} {variant:>9} {v['ms_median']:>9.2f} "
                f"{v['ms_p10']:>8.2f}-{v['ms_p90']:<8.2f} {v['ms_min']:>8.2f}-{v['ms_max']:<8.2f} "
                f"{v['peak_mib']:>8.0f} {v['loss']:>10.5f}  " + ("-" if ref is None else f"{ref:.2e}")
            )
        for variant in ("unpatched", "patched"):
            compiled = row[variant].get("compiled_rank0")
            if compiled:
                reasons = "; ".join(f"{count} x {reason}" for reason, count in compiled["reasons"].items())
                lines.append(
                    f"{'':>7} {variant:>9} compiled (rank 0, warm-up): {compiled['graphs']} graphs, "
                    f"{compiled['graph_breaks']} graph breaks"
                    + (f" ({reasons})" if reasons else "")
                    + f"; {compiled['graphs_in_timed_steps']} graphs compiled in the timed steps"
                )
            work = row[variant].get("profiled_step_rank0")
            if work:
                lines.append(
                    f"{'':>7} {variant:>9} profiled step (rank 0): host {work['host_ms']:.1f} ms, GPU busy "
                    f"{work['gpu_busy_ms']:.1f} ms, {work['launches']} kernel launches, {work['cpu_ops']} operators, "
                    f"{work['syncs']} synchronisations"
                )
        if "oom" in row["unpatched"] or "oom" in row["patched"]:
            lines.append(f"{'':>7} {'ok' if row['ok'] else 'FAIL'}")
            continue
        worst = max(row["ranks"], key=lambda r: r["worst_grad_rel"])
        low, high = row["ratio"]["interval95"]
        lines.append(
            f"{'':>7} patched / unpatched: x{row['ratio']['median']:.3f} time (95% interval {low:.3f}-{high:.3f}, "
            f"paired bootstrap over the steps), loss rel {max(r['loss_rel'] for r in row['ranks']):.2e}, "
            f"worst gradient {worst['worst_grad']} {worst['worst_grad_rel']:.2e}; {'ok' if row['ok'] else 'FAIL'}"
        )
    return lines


def main(argv=None) -> int:
    start()
    args = parse_args(argv)
    place = ranks(cpu=args.cpu, same_device=args.same_device)
    device = place.device
    if args.same_device:
        os.environ["LOCAL_RANK"] = "0"  # transformers' TP loading binds cuda:LOCAL_RANK
    # A rank that fails alone (out of memory in a step) leaves the others in a collective: end them in minutes.
    dist.init_process_group("gloo" if args.same_device or args.cpu else "nccl", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.part == "model" and world % (args.fsdp_size * args.replicate_size):
        raise SystemExit(
            f"--fsdp-size {args.fsdp_size} x --replicate-size {args.replicate_size} does not divide the world "
            f"size {world}"
        )
    if args.part == "op":
        name = f"tp_check_op_{args.arch}_w{world}"
    else:
        name = f"tp_check_model_{args.arch}_{layout_name(args)}" + ("_compiled" if args.compile else "")
    report = Report("tp_check", args, name, args.out, rank=rank)
    report.data.update(part=args.part, arch=args.arch, world_size=world, same_device=args.same_device)
    if args.part == "model":
        report.data.update(
            api=args.api,
            layout=layout_name(args),
            tp_size=world // data_parallel_size(args),
            fsdp_size=args.fsdp_size,
            replicate_size=args.replicate_size,
            layers=args.layers,
            seq_len=args.seq_len,
            warmup=args.warmup,
            steps=args.steps,
            compile_backend=args.compile,
            gradient_checkpointing=not args.no_checkpointing,
        )
    with report.phase(args.part):
        if args.part == "op":
            result = [check_op(args, tokens, rank, world, device) for tokens in args.tokens]
        else:
            result = check_model(args, rank, world, device)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
    table: list[str] = []
    if rank == 0:
        # bf16 on GPUs: bf16 noise; fp32 on CPU: fp32 noise.
        grad_tol, loss_tol = (1e-4, 1e-5) if args.cpu else (2e-2, 1e-4)
        runs = []
        for i, tokens in enumerate(args.tokens):
            ranks_i = [r[i] for r in gathered]
            if args.part == "model":
                runs.append(summarize_model(args, tokens, ranks_i, loss_tol, grad_tol))
                continue
            run_ok = all(
                r["loss_rel_vs_one_process"] < 1e-5
                and r["dh_rel_vs_one_process"] < grad_tol
                and r["dw_rel_vs_one_process"] < grad_tol
                and r["loss_rel_vs_fp32"] < loss_tol
                for r in ranks_i
            )
            worst = {key: max(r[key] for r in ranks_i) for key in ranks_i[0] if key.endswith(("_one_process", "_fp32"))}
            runs.append({"tokens": tokens, "ranks": ranks_i, "ok": run_ok, "worst": worst})
        report.data["runs"] = runs
        for run in runs:
            if "worst" in run:
                detail = ", ".join(f"{key} {value:.2e}" for key, value in run["worst"].items())
            else:
                ratio, reference = run.get("ratio"), run.get("reference", {})
                detail = "patched / unpatched time " + (
                    f"x{ratio['median']:.3f} (95% {ratio['interval95'][0]:.3f}-{ratio['interval95'][1]:.3f})"
                    if ratio
                    else "- (a variant ran out of memory)"
                )
                detail += f"; loss vs one process {reference.get('patched_rel', float('nan')):.1e}"
            report.check(f"{run['tokens']} tokens", run["ok"], detail)
        if args.part == "model":
            table = model_table(report.data)
    label = f"{args.arch} world_size={world}" + (f" {layout_name(args)}" if args.part == "model" else "")
    ok = report.finish([f"tp_check {args.part} {label}"], table, f"{args.part} {label}")
    flag = torch.tensor([int(ok)], device=device)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return 0 if int(flag) else 1


if __name__ == "__main__":
    sys.exit(main())
