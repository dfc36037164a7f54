"""How ``multi_gpu_train.py`` trains one method: the Trainer it makes per method (lce_patch, Liger, TRL's head,
torch.compile, the interleaved A/B), and the instruments around the steps: a clock of optimizer steps, the switch of
the loss between steps, the profiler of chosen steps, the paired summary of the interleaved steps, the teardown that
gives an 8B model's memory back between methods."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from train_models import collate

REPO = Path(__file__).resolve().parents[1]

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


def deepspeed_stage() -> str | None:
    """The ZeRO stage accelerate launched this process under ("?" if it names none), or None without DeepSpeed."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    return os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "?")


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


def simulated_oom_callback(surfaced_as: str = "allocator"):
    """A callback raising an out of memory at the first step (--simulate-oom-above): the caching allocator's
    torch.OutOfMemoryError, or (``surfaced_as="nccl"``) the NCCL error one surfaced as inside ring attention."""
    import torch
    from transformers import TrainerCallback

    class Callback(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if surfaced_as == "nccl":
                raise RuntimeError("NCCL Error 1: unhandled cuda error (simulated by --simulate-oom-above)")
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
