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
then searches, per method, the largest micro-batch that trains one step without running out of memory.

Safety: after every method (and every attempt of the search) the ranks agree over a gloo group, with a timeout, on
whether any of them failed. An out-of-memory error on some ranks only can leave the others waiting inside a
collective: then the agreement times out, the JSON written so far is kept, and the run ends (exit status 3) rather
than hang; so the search runs last. A method that starts with GPU memory an earlier method of the launch left
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
import contextlib
import datetime
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # lce_patch from this checkout, not an installed copy
sys.path.insert(0, str(REPO / "benchmarks"))  # bench_common, model_configs

from model_configs import RELEASED_CONFIGS  # noqa: E402

IGNORE = -100
LEFT_BEHIND_GIB = 0.5  # memory allocated at a method's start past which an earlier method is said to have left it
METHODS = (
    "unpatched",
    "lce_patch",
    "liger_fused_loss",
    "liger_kernels+lce_patch",
    "liger_all",
    "trl_fused_head",
    "compile",
    "lce_patch_interleaved",
)
INTERLEAVED = "lce_patch_interleaved"
VARIANTS = ("unpatched", "lce_patch")  # the interleaved method's A and B
# Liger's patch arguments per method: its instance patch passes each model type only the ones it takes.
LIGER_CONFIGS: dict[str, dict[str, bool]] = {
    "liger_fused_loss": {
        "fused_linear_cross_entropy": True,
        "cross_entropy": False,
        "rope": False,
        "rms_norm": False,
        "swiglu": False,
        "geglu": False,
    },
    "liger_kernels+lce_patch": {"fused_linear_cross_entropy": False, "cross_entropy": False},
    "liger_all": {},
}

MODELS: dict[str, dict[str, Any]] = {name: dict(spec) for name, spec in RELEASED_CONFIGS.items()}
MODELS["llama-3.1-8b-lora"] = dict(MODELS["llama-3.1-8b"])
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# --cpu: the same architectures, tiny.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=4096,
)


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
        help="after the timed runs, search the largest micro-batch up to LIMIT that trains one step per method "
        "(doubling, then bisection); 0: no search",
    )
    parser.add_argument(
        "--max-batch-methods", default=None, help="methods to search (default: those of --methods that ran)"
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


# ------------------------------------------------------------------------------------------------- environment
def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _has(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def environment() -> dict[str, Any]:
    import torch
    from bench_common import git_revision

    import lce_patch

    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "git": os.environ.get("LCE_BENCH_COMMIT") or git_revision(),
        "lce_patch": lce_patch.__version__,
        "versions": {
            name: _version(name)
            for name in (
                "torch",
                "triton",
                "transformers",
                "accelerate",
                "trl",
                "liger-kernel",
                "deepspeed",
                "peft",
                "datasets",
            )
        },
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
    }


def deepspeed_stage() -> str | None:
    """The ZeRO stage accelerate launched this process under ("?" if it names none), or None without DeepSpeed."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    return os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "?")


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


# ------------------------------------------------------------------------------------------------------ models
def model_config(args: argparse.Namespace):
    """The transformers config of ``--model`` (tiny under --cpu), depth cut to ``--layers``."""
    from transformers import AutoConfig

    spec = dict(MODELS[args.model])
    model_type = spec.pop("model_type")
    if args.cpu:
        spec.update(TINY)
        if model_type == "gemma2":
            spec.update(query_pre_attn_scalar=16, sliding_window=32)
        if "rope_parameters" in spec and spec["rope_parameters"].get("rope_type") == "llama3":
            spec["rope_parameters"] = {**spec["rope_parameters"], "original_max_position_embeddings": 1024}
    else:
        spec.setdefault("head_dim", spec["hidden_size"] // spec["num_attention_heads"])
    if args.layers is not None:
        spec["num_hidden_layers"] = args.layers
    spec["max_position_embeddings"] = max(spec["max_position_embeddings"], args.seq_len)
    config = AutoConfig.for_model(model_type, use_cache=False, **spec)
    # transformers 5.24 refuses SDPA for Gemma-2 (its softcapped attention scores): eager there.
    config._attn_implementation = "eager" if args.cpu or model_type == "gemma2" else "sdpa"
    return config


class Distribution:
    """transformers' DistributedConfig mesh for --tp (None otherwise), made once per launch."""

    def __init__(self, args: argparse.Namespace, world: int) -> None:
        self.config = self.mesh = None
        if args.tp == 1:
            return
        if world % args.tp:
            raise SystemExit(f"--tp {args.tp} must divide the number of processes {world}")
        try:
            from transformers import DistributedConfig
        except ImportError as error:
            raise SystemExit(
                "--tp needs transformers' DistributedConfig (transformers >= 5.24; this is "
                f"{_version('transformers')}): {error}"
            ) from error
        from transformers import PreTrainedModel

        self.config = DistributedConfig(tp_size=args.tp, fsdp_size=world // args.tp)
        self.config, _, self.mesh = PreTrainedModel.prepare_distribute_model(self.config)
        if args.cpu:
            _allow_parallelism_config_on_cpu()


def _allow_parallelism_config_on_cpu() -> None:
    """CPU smoke mode only: accelerate refuses a ParallelismConfig (which the Trainer makes for a tensor-parallel
    model) on CPU processes, though its tensor-parallel path needs nothing of the GPU; let it through there."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    original = ParallelismConfig._validate_accelerator

    def validate(self, accelerator):
        if accelerator.distributed_type == DistributedType.MULTI_CPU:
            return None
        return original(self, accelerator)

    ParallelismConfig._validate_accelerator = validate


def build_model(args: argparse.Namespace, device, distribution: Distribution):
    """Random bf16 weights from the config: built on the meta device, laid out (TP / FSDP2 by transformers under
    --tp), then materialised on ``device`` and initialised there (seconds, where a CPU init of 8B takes minutes)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(args)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    try:  # an earlier method's Trainer left DeepSpeed's config registered: no ZeRO-3 init at construction
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    except ImportError:
        pass
    untied = contextlib.nullcontext()
    if distribution.config is not None:
        # As from_pretrained does: tied weights stay apart until the plan has laid each out, then are tied.
        from transformers.initialization import no_tie_weights

        untied = no_tie_weights()
    with torch.device("meta"), untied:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if distribution.config is not None:
        model = type(model).maybe_distribute_model(model, distribution.config, distribution.mesh)
    model.to_empty(device=device)
    for item in (*model.modules(), *model.parameters(), *model.buffers()):
        if "_is_hf_initialized" in vars(item):
            del item._is_hf_initialized
    torch.manual_seed(args.seed)  # every rank the same weights
    with torch.no_grad():
        if hasattr(model, "initialize_weights"):
            model.initialize_weights()
        else:  # older transformers
            model.apply(model._init_weights)
    model.tie_weights()
    if args.model.endswith("-lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS))
    model.train()
    return model


def parameter_counts(model) -> dict[str, int]:
    """Whole-model parameter counts (DTensors and FSDP shards counted at their full size)."""
    total = trainable = 0
    for param in model.parameters():
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return {"params": total, "trainable": trainable}


class ModuleGuard:
    """Undo what a peer's patch writes into a modeling module (Liger replaces ``LlamaRMSNorm``,
    ``apply_rotary_pos_emb``, ... there), so the next method builds and runs the original model."""

    def __init__(self, config) -> None:
        import importlib

        kind = config.model_type
        self.modules = [importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")]
        self.saved = [dict(vars(m)) for m in self.modules]

    def restore(self) -> list[str]:
        restored = []
        for module, saved in zip(self.modules, self.saved):
            current = vars(module)
            for key in [k for k in current if k not in saved]:
                delattr(module, key)
                restored.append(f"{module.__name__}.{key}")
            for key, value in saved.items():
                if current.get(key) is not value:
                    setattr(module, key, value)
                    restored.append(f"{module.__name__}.{key}")
        return restored


# -------------------------------------------------------------------------------------------------------- data
def make_rows(args: argparse.Namespace, count: int, vocab: int) -> list[dict[str, list[int]]]:
    """``count`` sequences of random ids, each with a masked prompt of 45-55% of its length (times
    --prompt-fraction / 0.5), the same on every rank (the Trainer's sampler gives each rank its share)."""
    import torch

    generator = torch.Generator().manual_seed(args.seed + 1)
    rows = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (args.seq_len,), generator=generator)
        jitter = 0.9 + 0.2 * torch.rand((), generator=generator).item()
        prompt = min(int(args.seq_len * args.prompt_fraction * jitter), args.seq_len - 2)
        labels = ids.clone()
        labels[:prompt] = IGNORE
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def collate(batch: list[dict[str, list[int]]]) -> dict[str, Any]:
    import torch

    ids = torch.tensor([row["input_ids"] for row in batch])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.tensor([row["labels"] for row in batch]),
    }


# ---------------------------------------------------------------------------------------------------- training
class StepClock:
    """Times optimizer steps: the interval between consecutive ends of steps (after a device sync), so the data,
    the loss exchange, forward, backward, clipping and the optimizer are all counted. Peak memory from the
    first step on (after accelerate prepared the model and freed the unsharded weights)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        clock = self
        self.ends: list[float] = []
        self.begin: float | None = None

        def sync() -> None:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if clock.begin is None:
                    import torch

                    sync()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    clock.begin = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                sync()
                clock.ends.append(time.perf_counter())

        self.callback = Callback()

    def step_times(self) -> list[float]:
        if self.begin is None:
            return []
        marks = [self.begin, *self.ends]
        return [b - a for a, b in zip(marks, marks[1:])]


class VariantSwitch:
    """The interleaved method's switch: before each step, the model's loss is set to the unpatched head's or to
    lce_patch's (``revert_fused_lce`` / ``apply_fused_lce``) in the order A B B A A B ..., so that each pair of
    steps holds one of each and drift over the launch reaches both alike. The switch's own time is recorded per
    step, to be taken out of the step it precedes."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        switch = self
        self.variants: list[str] = []
        self.switch_s: list[float] = []
        self.patched: list[bool] = []  # whether the model was patched when the step began: each variant's own

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, model=None, **kwargs):
                import lce_patch
                from lce_patch.models import is_patched, unwrap_causal_lm

                start = time.perf_counter()
                step = len(switch.variants)
                variant = VARIANTS[(step % 2) ^ (step // 2 % 2)]
                patched = is_patched(unwrap_causal_lm(model))
                quiet = logging.getLogger("lce_patch")
                level = quiet.level
                quiet.setLevel(logging.ERROR)  # the patch's announcement, once per switch
                try:
                    if variant == "lce_patch" and not patched:
                        lce_patch.apply_fused_lce(model)
                    elif variant == "unpatched" and patched:
                        lce_patch.revert_fused_lce(model)
                finally:
                    quiet.setLevel(level)
                switch.variants.append(variant)
                switch.switch_s.append(time.perf_counter() - start)
                switch.patched.append(is_patched(unwrap_causal_lm(model)))

        self.callback = Callback()


class StepProfiler:
    """``--profile``: torch.profiler over chosen steps on rank 0 (the other ranks step alongside). Each step's
    Chrome trace (gzipped) and op table go to ``directory``; :func:`bench_common.step_work`'s summary of each, with
    the loss that ran (``lce_patch`` or ``unpatched``), is kept in ``steps``. Only warm-up steps are profiled, so
    the profiler's overhead stays out of the timed ones."""

    def __init__(self, directory: str, stem: str, targets: set[int], rank: int) -> None:
        from transformers import TrainerCallback

        profiler = self
        self.steps: list[dict[str, Any]] = []
        self.active = None
        active_here = rank == 0

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if active_here and state.global_step in targets:
                    import torch
                    from torch.profiler import ProfilerActivity, profile

                    activities = [ProfilerActivity.CPU]
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                        activities.append(ProfilerActivity.CUDA)
                    profiler.active = profile(activities=activities)
                    profiler.active.__enter__()

            def on_step_end(self, args, state, control, model=None, **kwargs):
                if profiler.active is None:
                    return
                import torch
                from bench_common import save_profile

                from lce_patch.models import is_patched, unwrap_causal_lm

                cuda = torch.cuda.is_available()
                if cuda:
                    torch.cuda.synchronize()
                prof, profiler.active = profiler.active, None
                prof.__exit__(None, None, None)
                loss = "lce_patch" if is_patched(unwrap_causal_lm(model)) else "unpatched"
                name = f"{stem}_step{state.global_step - 1}_{loss}_rank0"
                summary = save_profile(prof, Path(directory), name, cuda, compress=True)
                work = {key: round(value, 3) for key, value in summary.items()}
                profiler.steps.append({"step": state.global_step - 1, "loss": loss, **work})

        self.callback = Callback()


def interleaved_summary(step_s: list[float], variants: list[str], switch_s: list[float], warmup: int,
                        tokens_step: int, world: int) -> dict[str, Any]:  # fmt: skip
    """The interleaved method's numbers: per variant, its steps after its first ``warmup`` (the switch's time taken
    out) as tokens/s per GPU; the ratio of lce_patch's median step time to the unpatched one's with a 95% interval
    from a paired bootstrap (the k-th steps of the two variants ran in the same pair)."""
    from bench_common import ratio_interval

    times = {variant: [] for variant in VARIANTS}
    for step, variant, switch in zip(step_s, variants, switch_s, strict=False):
        times[variant].append(step - switch)
    timed = {variant: steps[warmup:] for variant, steps in times.items()}
    count = min(len(steps) for steps in timed.values())
    if count == 0:
        return {"variants": {variant: {"timed_steps": 0} for variant in VARIANTS}}
    timed = {variant: steps[:count] for variant, steps in timed.items()}
    out: dict[str, Any] = {"variants": {}}
    for variant, steps in timed.items():
        per_gpu = [tokens_step / t / world for t in steps]
        median = statistics.median(per_gpu)
        out["variants"][variant] = {
            "timed_steps": count,
            "tokens_per_s_per_gpu": round(median, 1),
            "spread": round((max(per_gpu) - min(per_gpu)) / median, 4),
            "median_step_s": round(statistics.median(steps), 4),
            "step_s": [round(t, 4) for t in steps],
        }
    reference, candidate = timed["unpatched"], timed["lce_patch"]
    out["time_ratio"] = round(statistics.median(candidate) / statistics.median(reference), 4)
    out["time_ratio_interval95"] = [round(bound, 4) for bound in ratio_interval(reference, candidate)]
    out["switch_s_median"] = round(statistics.median(switch_s), 4)
    return out


def simulated_oom_callback():
    """A callback raising torch.OutOfMemoryError at the first step (--simulate-oom-above)."""
    import torch
    from transformers import TrainerCallback

    class Callback(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated by --simulate-oom-above)")

    return Callback()


def checkpointing_arguments() -> dict[str, Any]:
    """Gradient checkpointing (non-reentrant) in TrainingArguments, under the name this transformers uses
    (``activation_checkpointing`` from 5.24 on, ``gradient_checkpointing`` before)."""
    import dataclasses

    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": {"use_reentrant": False}}


def make_trainer(
    method: str,
    model,
    args: argparse.Namespace,
    rows,
    batch: int,
    max_steps: int,
    clock: StepClock,
    switch: VariantSwitch | None = None,
    profiler: StepProfiler | None = None,
):
    from lce_patch import FusedLCECallback

    # The profiler first: its stop and trace export (seconds for an 8B step) then end before the clock reads the
    # step's end, so they land in the profiled warm-up step, not in the next one, which may be timed.
    callbacks = ([profiler.callback] if profiler is not None else []) + [clock.callback]
    if "lce_patch" in method:
        callbacks.append(FusedLCECallback())
    if switch is not None:
        callbacks.append(switch.callback)
    deepspeed = deepspeed_stage() is not None
    common: dict[str, Any] = dict(
        output_dir=os.path.join(tempfile.gettempdir(), "multi_gpu_train"),
        max_steps=max_steps,
        per_device_train_batch_size=batch,
        learning_rate=args.lr,
        optim="adamw_torch" if args.cpu else "adamw_torch_fused",
        lr_scheduler_type="constant",
        # DeepSpeed's bf16 mode (fp32 master weights); elsewhere the bf16 weights train as they are.
        bf16=deepspeed and not args.cpu,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        seed=args.seed,
        use_cpu=args.cpu,
        torch_compile=method == "compile",
    )
    common.update(checkpointing_arguments())
    if method in LIGER_CONFIGS:
        common["use_liger_kernel"] = True
        if LIGER_CONFIGS[method]:
            common["liger_kernel_config"] = dict(LIGER_CONFIGS[method])
    if method == "trl_fused_head":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        sys.path.insert(0, str(REPO / "recipes"))
        from _loading import build_embedded_tokenizer

        return SFTTrainer(
            model=model,
            # SFTTrainer wants a tokenizer; the data is tokenized already, so the recipes' offline one does.
            processing_class=build_embedded_tokenizer(),
            args=SFTConfig(**common, max_length=args.seq_len, dataset_kwargs={"skip_prepare_dataset": True}),
            train_dataset=Dataset.from_list(rows),
            data_collator=collate,
            callbacks=callbacks,
        )
    from transformers import Trainer, TrainingArguments

    return Trainer(
        model=model,
        args=TrainingArguments(**common),
        train_dataset=rows,  # a list: the plain Trainer needs no datasets package
        data_collator=collate,
        callbacks=callbacks,
    )


def fresh_accelerator_state() -> None:
    """Forget the previous method's accelerate state (the process group stays): accelerate keeps the first
    Accelerator's settings for the whole process, so a later Trainer's torch_compile and DeepSpeed micro-batch
    would be ignored (the Trainer resets it the same way between hyperparameter-search trials)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def drop_gradient_hooks(model) -> int:
    """Remove the post-accumulate-grad hooks on ``model``'s parameters; how many there were.

    Under a model loaded through ``DistributedConfig``, transformers' Trainer (5.24,
    ``_sync_replicated_trainable_parameters``) registers on each trainable parameter that is not a DTensor (the
    norm weights under tensor parallelism alone) a hook whose closure holds the Trainer, and through it the model
    and the optimizer. The tensor keeps its hooks on the C++ side of autograd, where the garbage collector does
    not see the cycle, so without this the whole model and its optimizer states outlive the method (found on CPU
    processes, seen on GPUs as 11 GiB a rank per 8B method at TP 4)."""
    dropped = 0
    for param in model.parameters() if model is not None else ():
        hooks = getattr(param, "_post_accumulate_grad_hooks", None)
        if hooks:
            dropped += len(hooks)
            hooks.clear()
    return dropped


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


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
                trainer.add_callback(simulated_oom_callback())
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
            oom = isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
            mine["error"] = f"{type(error).__name__}: {str(error)[:400]}"
            mine["oom"] = oom
            if not oom:
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
            return {
                "status": "oom" if all(r.get("oom") for r in ranks if "error" in r) else "error",
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
            skip = missing_requirement(method, args)
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
            record: dict[str, Any] = {"attempts": [], "limit": args.max_batch}
            self.report["max_batch"][method] = record
            skip = missing_requirement(method, args)
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
                if self.over_budget():
                    record["stopped"] = f"past --budget-s {args.budget_s:.0f}"
                    break
                ranks = self.agree(self.train(method, batch, 1))
                failed = [r for r in ranks if "error" in r]
                attempt: dict[str, Any] = {"batch": batch, "ok": not failed}
                if failed:
                    attempt["error"] = failed[0]["error"][:200]
                    attempt["oom"] = all(r.get("oom") for r in failed)
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
