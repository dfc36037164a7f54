"""Multi-GPU training benchmark: 8B-class models on one node, lce_patch beside the peers, launched as users launch
training.

Several loss setups ("methods") run side by side in ONE launch; the model is rebuilt for each, and memory freed
between them. Every method trains through a ``transformers.Trainer`` (TRL's ``SFTTrainer`` for TRL's head), so the
engine (FSDP2, DeepSpeed ZeRO-3, tensor parallelism) is set up exactly as in a user's job:

    unpatched                 the model's own loss (full [tokens, vocabulary] logits)
    lce_patch                 FusedLCECallback (lce_patch's fused loss inside the model's forward)
    liger_fused_loss          Liger's Hugging Face patch with only fused_linear_cross_entropy on
    liger_kernels+lce_patch   Liger's other kernels (RMSNorm, RoPE, SwiGLU/GeGLU; its losses off) + FusedLCECallback
    liger_all                 Liger's patch, every kernel (its fused loss included)
    trl_fused_head            TRL's SFTTrainer with its own fused LM head (its default since TRL 1.15)
    compile                   the unpatched model under TrainingArguments(torch_compile=True): opt-in (name it, or
                              --methods all; compiling an 8B model takes minutes), not on --cpu
    lce_patch_interleaved     unpatched and lce_patch on ONE model and Trainer, the loss switched step by step (A B
                              B A ...; the switch timed apart): their step-time ratio with a 95% interval from a
                              paired bootstrap, free of the drift between methods run one after the other; opt-in,
                              2 x (--warmup + --steps) steps

A method whose package is missing (liger-kernel, trl, datasets) is reported as skipped; one that fails on every
rank is reported with its error, and the run goes on.

Engines (four GPUs; keep NVLink multicast off on shared hosts: NCCL_NVLS_ENABLE=0):

    accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 4 benchmarks/multi_gpu_train.py
    accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 4 benchmarks/multi_gpu_train.py
    torchrun --nproc_per_node 4 benchmarks/multi_gpu_train.py --tp 4      # tensor parallel 4 (DistributedConfig)
    torchrun --nproc_per_node 4 benchmarks/multi_gpu_train.py --tp 2      # TP 2 x FSDP2 2 (DistributedConfig)

Models (built from the real configs, random weights, no download): llama-3.1-8b, qwen2.5-7b, gemma-2-9b
(vocabulary 256000, final-logit softcap 30), llama-3.1-8b-lora (LoRA rank 16 on the attention and MLP projections,
the head and everything else frozen). bf16 weights, gradient checkpointing, fused AdamW; the optimizer step is in
the timing. Under DeepSpeed the Trainer runs DeepSpeed's bf16 mode (fp32 master weights in the optimizer), under
FSDP2 and tensor parallelism the weights and AdamW states are bf16 (the JSON records it).

Data: fine-tuning-like, ``--batch`` sequences of ``--seq-len`` tokens per data-parallel rank and step, random ids,
the leading 45-55% of each sequence a masked prompt (labels -100).

Measured per method: tokens/s per GPU (tokens of the global batch / step time / world size; the median over the
steps after ``--warmup``, step time = between consecutive ends of optimizer steps, so data, loss, backward,
gradient clipping and the optimizer are all in), its spread (min-max over those steps), peak allocated GPU memory
(the maximum over ranks, from the first step on: the optimizer states included), the logged losses. ``--max-batch``
then searches, per method, the largest micro-batch that trains ``--max-batch-steps`` optimizer steps (default 2:
AdamW's states, made in the first step, then sit beside the second step's activations) without running out of memory.

Safety: after every method (and every attempt of the search) the ranks agree over a gloo group, with a timeout, on
whether any of them failed. An out-of-memory error on some ranks only can leave the others waiting inside a
collective: then the agreement times out, the JSON written so far is kept, and the run ends (exit status 3) rather
than hang; so the search runs last. An out of memory that surfaces as a CUDA or NCCL error (as one did inside ring
attention's exchange) is recorded as out of memory, with the error it came as; the process group is not trusted after
it, so the launch's later methods and search attempts are recorded as not started (run them in a launch of their own). A method that starts with GPU memory an earlier method of the launch left
allocated says so in its row. Under DeepSpeed ZeRO-3 on GPUs the script takes one method per launch: DeepSpeed
0.19.8 keeps a destroyed engine's model and optimizer alive for the process (~30 GiB a rank for an 8B model). Under
``--tp`` the script removes the gradient hooks transformers' Trainer leaves on the model's replicated parameters after
each method (see ``drop_gradient_hooks``), which otherwise keep every method's model and optimizer alive.

Output: JSON to ``--out`` (a directory, default ``$OUT``; one file per launch, rewritten after every method) with
device, versions, date, commit, engine, world size, model, layers, sequence length and every method's numbers;
rank 0 prints a markdown table. ``--cpu`` runs a tiny model of the same architecture on CPU processes (gloo):

    torchrun --nproc_per_node 2 benchmarks/multi_gpu_train.py --cpu --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # lce_patch from this checkout, not an installed copy
sys.path.insert(0, str(REPO / "benchmarks"))  # bench_common, model_configs

from train_loop import (  # noqa: E402
    INTERLEAVED,
    METHODS,
    StepClock,
    StepProfiler,
    VariantSwitch,
    deepspeed_stage,
    drop_gradient_hooks,
    free_memory,
    fresh_accelerator_state,
    interleaved_summary,
    make_trainer,
    simulated_oom_callback,
)
from train_models import (  # noqa: E402
    MODELS,
    TINY,
    Distribution,
    ModuleGuard,
    build_model,
    make_rows,
    model_config,
    parameter_counts,
)

LEFT_BEHIND_GIB = 0.5  # memory allocated at a method's start past which an earlier method is said to have left it


# --------------------------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b", help="model config")
    parser.add_argument(
        "--methods",
        default="unpatched,lce_patch,liger_fused_loss,liger_kernels+lce_patch,liger_all,trl_fused_head",
        help=f"comma-separated, run in this order; 'all' = {','.join(METHODS)}",
    )
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (8192, 32768)")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch: sequences per data-parallel rank and step")
    parser.add_argument("--warmup", type=int, default=3, help="steps not timed")
    parser.add_argument("--steps", type=int, default=6, help="timed steps after the warm-up")
    parser.add_argument("--layers", type=int, default=None, help="truncate the model to N decoder layers")
    parser.add_argument("--prompt-fraction", type=float, default=0.5, help="mean masked (-100) leading fraction")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallel size through transformers' DistributedConfig (launch with torchrun, not an accelerate "
        "config); the remaining world_size / tp ranks shard the model with transformers' FSDP2",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=0,
        metavar="LIMIT",
        help="after the timed runs, search the largest micro-batch up to LIMIT that trains --max-batch-steps steps per method "
        "(doubling, then bisection); 0: no search",
    )
    parser.add_argument(
        "--max-batch-methods", default=None, help="methods to search (default: those of --methods that ran)"
    )
    parser.add_argument(
        "--max-batch-steps",
        type=int,
        default=2,
        help="optimizer steps each micro-batch of the search must train (2: the optimizer's states, made in the "
        "first, sit beside the second's activations; 1 measures the first step alone)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget of the launch: a method (or search attempt) is not started past it and is "
        "recorded as skipped",
    )
    parser.add_argument(
        "--sync-timeout-s",
        type=float,
        default=120.0,
        help="how long ranks wait for each other to agree after a method; past it the run ends (exit status 3)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write a torch.profiler trace and op table of rank 0's last warm-up step per method (the interleaved "
        "method: its last two warm-up steps, one per variant) here, and each step's host span, GPU busy and NCCL "
        "time into the JSON; needs --warmup >= 2",
    )
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    parser.add_argument("--cpu", action="store_true", help="smoke mode: tiny model, CPU processes (gloo)")
    parser.add_argument(
        "--simulate-oom-above",
        type=int,
        default=0,
        metavar="B",
        help="testing the search: raise torch.OutOfMemoryError in the first step of a micro-batch above B",
    )
    parser.add_argument(
        "--simulate-oom-as",
        choices=("allocator", "nccl"),
        default="allocator",
        help="testing: the simulated out of memory as torch.OutOfMemoryError, or as the NCCL error it surfaced as in "
        "ring attention (then no later method of the launch starts)",
    )
    parser.add_argument(
        "--simulate-oom-rank",
        type=int,
        default=None,
        metavar="R",
        help="testing: --simulate-oom-above on rank R only (default: every rank), which the others then wait for",
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(REPO / "runs" / "multi_gpu_train"),
        help="directory for the JSON (or a .json path)",
    )
    args = parser.parse_args(argv)
    args.methods = list(METHODS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    if args.max_batch_methods is not None:
        args.max_batch_methods = [m.strip() for m in args.max_batch_methods.split(",") if m]
        unknown = [m for m in args.max_batch_methods if m not in METHODS]
        if unknown:
            parser.error(f"unknown --max-batch-methods {unknown}")
        if INTERLEAVED in args.max_batch_methods:
            parser.error(f"--max-batch-methods: {INTERLEAVED} switches its loss step by step; search its two "
                         "methods, unpatched and lce_patch")  # fmt: skip
    if args.max_batch_steps < 1:
        parser.error("--max-batch-steps must be >= 1")
    if args.seq_len < 16 or args.batch < 1 or args.steps < 1 or args.warmup < 0 or args.tp < 1:
        parser.error("--seq-len >= 16, --batch >= 1, --steps >= 1, --warmup >= 0 and --tp >= 1 are needed")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if args.profile is not None and args.warmup < 2:
        parser.error("--profile profiles warm-up steps (the timed ones stay unprofiled): --warmup >= 2 is needed")
    if not 0.0 <= args.prompt_fraction < 0.95:
        parser.error("--prompt-fraction must be in [0, 0.95)")
    if deepspeed_stage() == "3" and not args.cpu and (len(args.methods) > 1 or args.max_batch):
        parser.error(
            "under DeepSpeed ZeRO-3 run one method per launch (--methods unpatched, then --methods lce_patch, ...) "
            "and no --max-batch: DeepSpeed 0.19 keeps an engine's model and optimizer alive for the process after "
            "it is destroyed (its module-level forward stack, a class-level cache and per-module autograd classes "
            "hold them), so the next method would start with ~30 GiB a rank taken (8B model)"
        )
    if args.cpu and args.seq_len == 8192:
        args.seq_len = 64  # the default length is a GPU length
    return args


def _has(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def environment() -> dict[str, Any]:
    """bench_common's record (device, versions, the commit and whether the tree was clean), with the versions this
    benchmark's table names under ``versions``."""
    from bench_common import env_info

    env = env_info()
    names = ("torch", "triton", "transformers", "accelerate", "trl", "deepspeed", "peft", "datasets")
    return {**env, "versions": {**{name: env.get(name) for name in names}, "liger-kernel": env.get("liger_kernel")}}


def engine_name(args: argparse.Namespace, world: int) -> str:
    """What the launch asks for: an accelerate config's engine, or --tp's mesh."""
    if args.tp > 1:
        fsdp = world // args.tp
        return f"tp{args.tp}" + (f"xfsdp{fsdp}" if fsdp > 1 else "")
    stage = deepspeed_stage()
    if stage is not None:
        return f"zero{stage}"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return f"fsdp{os.environ.get('FSDP_VERSION', '1')}"
    return "ddp" if world > 1 else "single"


def missing_requirement(method: str, args: argparse.Namespace) -> str | None:
    """Why ``method`` cannot run here (None when it can)."""
    if method.startswith("liger"):
        if not _has("liger_kernel"):
            return "liger-kernel is not installed"
        if args.cpu:
            return "Liger's kernels are Triton kernels for GPUs"
    if method == "trl_fused_head":
        for module in ("trl", "datasets"):
            if not _has(module):
                return f"{module} is not installed"
    if method == "compile" and args.cpu:
        return "torch.compile is left out of the CPU smoke mode"
    if args.model.endswith("-lora") and not _has("peft"):
        return "peft is not installed"
    return None


class Run:
    """One launch: the process group, the agreement group, the results and their JSON."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from accelerate import PartialState

        self.args = args
        self.t0 = time.time()
        deepspeed = deepspeed_stage() is not None
        if args.cpu and deepspeed:  # DeepSpeed on CPU processes (DS_ACCELERATOR=cpu): accelerate picks no backend
            self.state = PartialState(backend="gloo")
        else:
            self.state = PartialState(cpu=args.cpu)
        self.world = self.state.num_processes
        self.rank = self.state.process_index
        self.device = self.state.device
        if not args.cpu and not torch.cuda.is_available():
            raise SystemExit("no GPU: pass --cpu for the CPU smoke mode")
        self.group = None
        self.poisoned: str | None = None  # an out of memory that surfaced as a CUDA / NCCL error, once seen
        if self.world > 1:
            # CPU-side agreement: NCCL collectives cannot time out cleanly in the middle of a stuck step.
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.sync_timeout_s))
        self.engine = engine_name(args, self.world)
        self.distribution = Distribution(args, self.world)
        self.dp_size = self.world // args.tp
        self.report: dict[str, Any] = {
            **environment(),
            "engine": self.engine,
            "world_size": self.world,
            "tp_size": args.tp,
            "dp_size": self.dp_size,
            "model": args.model,
            "layers": model_config(args).num_hidden_layers,
            "full_layers": MODELS[args.model]["num_hidden_layers"] if not args.cpu else TINY["num_hidden_layers"],
            "cpu_smoke": args.cpu,
            "seq_len": args.seq_len,
            "micro_batch": args.batch,
            "tokens_per_gpu_step": args.batch * args.seq_len * self.dp_size // self.world,
            "prompt_fraction": args.prompt_fraction,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "precision": "fp32 (CPU smoke mode)"
            if args.cpu
            else "bf16 weights, DeepSpeed bf16 mode (fp32 master weights)"
            if self.engine.startswith("zero")
            else "bf16 weights and AdamW states",
            "optimizer": "AdamW (torch, fused)" if not args.cpu else "AdamW (torch)",
            "gradient_checkpointing": True,
            "argv": sys.argv,
            "methods": {},
            "max_batch": {},
        }
        out = Path(args.out)
        layers = model_config(args).num_hidden_layers
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(self.t0))
        name = f"multi_gpu_train_{self.engine}_{args.model}_{args.seq_len}_{layers}layers_{stamp}.json"
        self.path = out if out.suffix == ".json" else out / name

    # -- agreement -----------------------------------------------------------------------------------
    def agree(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``mine``, over the gloo group with a timeout. A rank that does not answer in time is
        stuck inside a collective (an error on some ranks only): keep what was written and end the run."""
        if self.group is None:
            return [mine]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(gathered, mine, group=self.group)
        except Exception as error:  # a timeout (gloo raises RuntimeError)
            message = (
                f"rank {self.rank}: the ranks did not agree within {self.args.sync_timeout_s:.0f} s after "
                f"{mine.get('what')}: a rank failed alone and another waits inside a collective ({error!r:.200}); "
                "the run ends here"
            )
            print(message, file=sys.stderr, flush=True)
            if self.rank == 0:
                self.report.setdefault("aborted", message)
                self.report.setdefault("aborted_rank0_state", {k: v for k, v in mine.items() if k != "traceback"})
                self.write()
            os._exit(3)
        return gathered

    def not_trusted(self) -> str | None:
        """Why no method may start in this launch any more: an earlier one's out of memory surfaced as a CUDA or NCCL
        error, after which the process group and the CUDA context are not to be trusted."""
        if self.poisoned is None:
            return None
        return f"not started: an earlier method's {self.poisoned[:160]}; run it in a launch of its own"

    def over_budget(self) -> bool:
        return self.args.budget_s is not None and time.time() - self.t0 > self.args.budget_s

    # -- one training run ----------------------------------------------------------------------------
    def train(self, method: str, batch: int, steps: int) -> dict[str, Any]:
        """Build, train ``steps`` optimizer steps of micro-batch ``batch`` with ``method``, tear down. Runs on
        every rank; returns this rank's numbers or its error."""
        import torch

        args = self.args
        guard = None
        mine: dict[str, Any] = {"what": f"{method} (batch {batch})", "rank": self.rank}
        model = trainer = None
        if torch.cuda.is_available():  # what an earlier method left behind (should be ~0)
            mine["start_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        try:
            config = model_config(args)
            guard = ModuleGuard(config)
            self.report["layers"] = config.num_hidden_layers
            t_build = time.time()
            model = build_model(args, self.device, self.distribution)
            mine["build_s"] = time.time() - t_build
            mine.update(parameter_counts(model))
            rows = make_rows(args, steps * batch * self.dp_size, config.vocab_size)
            clock = StepClock()
            switch = VariantSwitch() if method == INTERLEAVED else None
            profiler = None
            if args.profile is not None:
                # the last warm-up step; the interleaved method's last two, one of each variant (A B B A order)
                last = 2 * args.warmup - 1 if switch is not None else args.warmup - 1
                targets = {last - 1, last} if switch is not None else {last}
                stem = f"multi_gpu_train_{self.engine}_{args.model}_{args.seq_len}_{method}_b{batch}"
                profiler = StepProfiler(args.profile, stem, targets, self.rank)
            fresh_accelerator_state()
            trainer = make_trainer(method, model, args, rows, batch, steps, clock, switch, profiler)
            simulated = args.simulate_oom_rank is None or args.simulate_oom_rank == self.rank
            if args.simulate_oom_above and batch > args.simulate_oom_above and simulated:
                trainer.add_callback(simulated_oom_callback(args.simulate_oom_as))
            mine["trainer"] = type(trainer).__name__
            t_train = time.time()
            trainer.train()
            mine["train_s"] = time.time() - t_train
            mine["distributed_type"] = str(trainer.accelerator.distributed_type)
            mine["compiled"] = any(
                type(m).__name__ == "OptimizedModule" or hasattr(m, "_orig_mod")
                for m in trainer.model_wrapped.modules()
            )
            mine["step_s"] = clock.step_times()
            if switch is not None:
                mine["variants"], mine["switch_s"] = switch.variants, switch.switch_s
                mine["switched_right"] = switch.patched == [v == "lce_patch" for v in switch.variants]
            mine["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
            if profiler is not None and profiler.steps:
                mine["profile"] = profiler.steps
            if torch.cuda.is_available():
                mine["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                mine["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            if "lce_patch" in method and switch is None:
                from lce_patch.models import is_patched, unwrap_causal_lm

                mine["lce_patch_active"] = bool(is_patched(unwrap_causal_lm(trainer.model)))
        except BaseException as error:  # report and go on; the agreement below keeps the ranks in step
            if isinstance(error, KeyboardInterrupt):
                raise
            from bench_common import out_of_memory

            why = out_of_memory(error)
            mine["error"] = f"{type(error).__name__}: {str(error)[:400]}"
            mine["oom"] = why is not None
            if why is not None and why != "out of memory":  # a CUDA / NCCL error: the process group is suspect
                mine["oom_surfaced_as"] = why
            if why is None:
                mine["traceback"] = traceback.format_exc()[-3000:]
            error.__traceback__ = None
        finally:
            if trainer is not None:
                trainer.accelerator.free_memory()
            dropped = drop_gradient_hooks(model)
            if dropped:
                mine["gradient_hooks_dropped"] = dropped
            del trainer, model
            restored = guard.restore() if guard is not None else []
            if restored:
                mine["modeling_globals_restored"] = len(restored)
            free_memory()
        return mine

    def summarize(self, method: str, ranks: list[dict[str, Any]], batch: int) -> dict[str, Any]:
        """Rank 0's step times (the steps are collective), memory as the maximum over ranks."""
        errors = {r["rank"]: r["error"] for r in ranks if "error" in r}
        # GPU memory an earlier method of this launch still held when this one started: its numbers (an
        # out-of-memory error above all) are then not this method's alone
        left = max((r.get("start_allocated_gib", 0.0) for r in ranks), default=0.0)
        held = {"left_by_earlier_gib": round(left, 2)} if left > LEFT_BEHIND_GIB else {}
        if errors:
            first = ranks[min(errors)]
            surfaced = [r["oom_surfaced_as"] for r in ranks if "oom_surfaced_as" in r]
            if surfaced:  # the ranks' NCCL communicator (and CUDA context) may be broken: no method starts after it
                self.poisoned = surfaced[0]
            return {
                "status": "oom" if all(r.get("oom") for r in ranks if "error" in r) else "error",
                **({"oom_surfaced_as": surfaced[0]} if surfaced else {}),
                "error": first["error"],
                "failed_ranks": sorted(errors),
                "traceback": first.get("traceback"),
                **held,
            }
        lead = ranks[0]
        times = lead["step_s"][self.args.warmup :] if len(lead["step_s"]) > self.args.warmup else []
        tokens_step = batch * self.args.seq_len * self.dp_size
        interleaved = None
        if "variants" in lead:  # each step's variant: numbers per variant, not over the steps together
            switch_s = [max(r["switch_s"][i] for r in ranks) for i in range(len(lead["switch_s"]))]
            interleaved = interleaved_summary(
                lead["step_s"], lead["variants"], switch_s, self.args.warmup, tokens_step, self.world
            )
            times = []
        result: dict[str, Any] = {
            "status": "ok",
            "micro_batch": batch,
            "trainer": lead["trainer"],
            "distributed_type": lead["distributed_type"],
            "compiled": lead["compiled"],
            "params": lead["params"],
            "trainable_params": lead["trainable"],
            "build_s": round(max(r["build_s"] for r in ranks), 2),
            "train_s": round(lead["train_s"], 2),
            "step_s": [round(t, 4) for t in lead["step_s"]],
            "losses": lead["losses"],
            **held,
        }
        if times:
            per_gpu = [tokens_step / t / self.world for t in times]
            median = statistics.median(per_gpu)
            result.update(
                tokens_per_s_per_gpu=round(median, 1),
                tokens_per_s_min=round(min(per_gpu), 1),
                tokens_per_s_max=round(max(per_gpu), 1),
                spread=round((max(per_gpu) - min(per_gpu)) / median, 4),
                median_step_s=round(statistics.median(times), 4),
            )
        if "peak_gib" in lead:
            result["peak_gib"] = round(max(r["peak_gib"] for r in ranks), 3)
            result["peak_gib_per_rank"] = [round(r["peak_gib"], 3) for r in ranks]
            result["peak_reserved_gib"] = round(max(r["peak_reserved_gib"] for r in ranks), 3)
            result["start_allocated_gib"] = round(max(r.get("start_allocated_gib", 0.0) for r in ranks), 3)
        if "lce_patch_active" in lead:
            result["lce_patch_active"] = all(r.get("lce_patch_active") for r in ranks)
        if interleaved is not None:
            result.update(interleaved, switched_right=all(r.get("switched_right") for r in ranks))
        if "profile" in lead:
            result["profile_rank0"] = lead["profile"]
        return result

    def write(self) -> None:
        self.report["elapsed_s"] = round(time.time() - self.t0, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.report, indent=1, default=str))

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(f"[multi_gpu_train {time.time() - self.t0:7.1f}s] {text}", flush=True)

    # -- the phases ----------------------------------------------------------------------------------
    def run_methods(self) -> None:
        args = self.args
        for method in args.methods:
            skip = missing_requirement(method, args) or self.not_trusted()
            if skip is None and self.over_budget():
                skip = f"not started: past --budget-s {args.budget_s:.0f}"
            if skip is not None:
                self.report["methods"][method] = {"status": "skipped", "reason": skip}
                self.log(f"{method}: skipped ({skip})")
                continue
            self.log(f"{method}: start")
            steps = args.warmup + args.steps
            ranks = self.agree(self.train(method, args.batch, 2 * steps if method == INTERLEAVED else steps))
            result = self.summarize(method, ranks, args.batch)
            self.report["methods"][method] = result
            self.log(f"{method}: {one_line(result)}")
            if self.rank == 0:
                self.write()

    def search_max_batch(self) -> None:
        """Doubling from --batch, then bisection between the last batch that trained and the first that did not."""
        args = self.args
        methods = args.max_batch_methods or [
            m for m in args.methods if m != INTERLEAVED and self.report["methods"].get(m, {}).get("status") == "ok"
        ]
        for method in methods:
            record: dict[str, Any] = {"attempts": [], "limit": args.max_batch, "steps": args.max_batch_steps}
            self.report["max_batch"][method] = record
            skip = missing_requirement(method, args) or self.not_trusted()
            if skip is not None:
                record.update(status="skipped", reason=skip)
                continue
            good, bad = 0, None
            batch = args.batch
            if self.report["methods"].get(method, {}).get("status") == "ok":
                good = args.batch  # the timed run trained it
                record["attempts"].append({"batch": args.batch, "ok": True, "from": "the timed run"})
                batch = 2 * args.batch if 2 * args.batch <= args.max_batch else None
            while batch is not None:
                if self.over_budget() or self.poisoned:
                    record["stopped"] = self.not_trusted() or f"past --budget-s {args.budget_s:.0f}"
                    break
                ranks = self.agree(self.train(method, batch, args.max_batch_steps))
                failed = [r for r in ranks if "error" in r]
                attempt: dict[str, Any] = {"batch": batch, "ok": not failed}
                if failed:
                    attempt["error"] = failed[0]["error"][:200]
                    attempt["oom"] = all(r.get("oom") for r in failed)
                    surfaced = [r["oom_surfaced_as"] for r in failed if "oom_surfaced_as" in r]
                    if surfaced:
                        attempt["oom_surfaced_as"] = self.poisoned = surfaced[0]
                else:
                    peaks = [r["peak_gib"] for r in ranks if "peak_gib" in r]
                    attempt["peak_gib"] = round(max(peaks), 3) if peaks else None
                record["attempts"].append(attempt)
                self.log(f"max batch {method}: batch {batch} {'ok' if not failed else failed[0]['error'][:80]}")
                if failed and not attempt["oom"]:
                    record["stopped"] = "an error other than out of memory"
                    break
                if failed:
                    bad = batch
                else:
                    good = batch
                if bad is None:
                    batch = (
                        batch * 2
                        if batch * 2 <= args.max_batch
                        else (None if batch == args.max_batch else args.max_batch)
                    )
                else:
                    batch = (good + bad) // 2 if bad - good > 1 else None
                if self.rank == 0:
                    record["max_micro_batch"] = good
                    self.write()
            record["max_micro_batch"] = good
            record["max_tokens_per_gpu"] = good * args.seq_len * self.dp_size // self.world
            record["status"] = "ok" if good else "none fits"
            if bad is None and good == args.max_batch:
                record["note"] = "the limit trained: the largest may be higher"
            if self.rank == 0:
                self.write()

    def table(self) -> str:
        r = self.report
        lines = [
            f"\n{r['engine']}, world size {r['world_size']}, {r['device']}, {r['model']} ({r['layers']} of "
            f"{r['full_layers']} layers), seq {r['seq_len']} x micro-batch {r['micro_batch']}, "
            f"{r['warmup_steps']} warm-up + {r['timed_steps']} timed steps; torch {r['versions']['torch']}, "
            f"transformers {r['versions']['transformers']}, trl {r['versions']['trl']}, liger-kernel "
            f"{r['versions']['liger-kernel']}, deepspeed {r['versions']['deepspeed']}; commit {r['git']}; {r['date']}",
            "",
            "| method | tokens/s per GPU (median) | spread | peak GiB (max over ranks) | max micro-batch | first / last loss |",
            "|---|---|---|---|---|---|",
        ]
        for method, m in r["methods"].items():
            mb = r["max_batch"].get(method, {}).get("max_micro_batch", "")
            left = (
                f" (started with {m['left_by_earlier_gib']:.1f} GiB an earlier method left allocated: run it in a "
                "launch of its own)"
                if "left_by_earlier_gib" in m
                else ""
            )
            if m["status"] != "ok":
                reason = m.get("reason") or m.get("error", "")
                lines.append(f"| {method} | {m['status']}: {reason[:90]}{left} | | | {mb} | |")
                continue
            losses = m.get("losses") or [None]
            if "time_ratio" in m:
                for variant, v in m["variants"].items():
                    lines.append(
                        f"| {method}: {variant}{left} | {fmt(v.get('tokens_per_s_per_gpu'), '.0f')} | "
                        f"{fmt(v.get('spread'), '.1%')} | {fmt(m.get('peak_gib'), '.2f')} (both) | {mb} | |"
                    )
                low, high = m["time_ratio_interval95"]
                lines.append(
                    f"| {method}: lce_patch / unpatched step time | {m['time_ratio']:.3f} ({low:.3f}-{high:.3f}, 95%) "
                    f"| | | | {fmt(losses[0], '.3f')} / {fmt(losses[-1], '.3f')} |"
                )
                continue
            lines.append(
                f"| {method}{left} | {fmt(m.get('tokens_per_s_per_gpu'), '.0f')} | {fmt(m.get('spread'), '.1%')} "
                f"| {fmt(m.get('peak_gib'), '.2f')} | {mb} | {fmt(losses[0], '.3f')} / {fmt(losses[-1], '.3f')} |"
            )
        return "\n".join(lines)


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def one_line(result: dict[str, Any]) -> str:
    if result["status"] != "ok":
        return f"{result['status']}: {result.get('error', result.get('reason', ''))[:200]}"
    if "time_ratio" in result:
        tokens = ", ".join(
            f"{variant} {fmt(v.get('tokens_per_s_per_gpu'), '.0f')}" for variant, v in result["variants"].items()
        )
        low, high = result["time_ratio_interval95"]
        return (
            f"tokens/s per GPU {tokens}; lce_patch / unpatched step time {result['time_ratio']:.3f} "
            f"({low:.3f}-{high:.3f}, 95%), peak {fmt(result.get('peak_gib'), '.2f')} GiB"
        )
    if "variants" in result:
        return "interleaved: no timed steps (more --steps)"
    return (
        f"{fmt(result.get('tokens_per_s_per_gpu'), '.0f')} tokens/s per GPU "
        f"(spread {fmt(result.get('spread'), '.1%')}), peak {fmt(result.get('peak_gib'), '.2f')} GiB, "
        f"build {result['build_s']:.1f}s, train {result['train_s']:.1f}s"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args)
    run.log(
        f"engine {run.engine}, world size {run.world}, model {args.model}, seq {args.seq_len}, methods "
        f"{','.join(args.methods)} -> {run.path}"
    )
    run.run_methods()
    if args.max_batch:
        run.search_max_batch()
    if run.rank == 0:
        run.write()
        print(run.table(), flush=True)
        print(f"wrote {run.path}", flush=True)
    run.agree({"what": "the end"})
    ok = any(m["status"] == "ok" for m in run.report["methods"].values())
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
