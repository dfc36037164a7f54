"""Running: a recipe's training run, or the two runs of ``--compare``, and what they log.

A recipe supplies a :class:`Recipe`: how to turn the loaded dataset into its training set, and how to
build its Trainer from a model, a tokenizer, that set and a list of callbacks. :func:`run_recipe` does
the rest: a single training run with the fused loss, or, with ``--compare``, two runs of the same
steps (same initial weights, same data order), one without and one with
``lce_patch.FusedLCECallback``, measured and reported side by side. While it runs, each library
warning shows once (:func:`warnings_once`) and the progress bar shows the loss (:class:`LossProgressBar`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import datasets
import torch
from _cli import RECIPES_DIR
from _loading import load_model, load_tokenizer, load_train_dataset
from _measuring import MIB, RunResult, StepRecorder, peak_memory, speed_verdict
from _reporting import BASELINE, FUSED, describe, format_table, pct_change, plot_comparison
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PrinterCallback,
    ProgressCallback,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

if importlib.util.find_spec("lce_patch") is None and (RECIPES_DIR.parent / "lce_patch").is_dir():
    # Run from a clone without `pip install -e .`: use the checkout's package.
    sys.path.insert(0, str(RECIPES_DIR.parent))

import lce_patch  # noqa: E402  (after the path fix-up)

TrainerFactory = Callable[
    [argparse.Namespace, PreTrainedModel, PreTrainedTokenizerBase, datasets.Dataset, list[TrainerCallback], Path],
    Trainer,
]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One recipe: its name, what its baseline is, and how it builds its data and Trainer.

    ``prepare_dataset(args, dataset, tokenizer)`` runs once; ``make_trainer(args, model, tokenizer,
    dataset, callbacks, output_dir)`` runs once per training run and must pass ``callbacks`` on.
    ``metrics``: logged metrics the comparison reports beside the loss (their largest difference over
    the steps, and their final values).
    """

    name: str
    baseline: str
    prepare_dataset: Callable[[argparse.Namespace, datasets.Dataset, PreTrainedTokenizerBase], datasets.Dataset]
    make_trainer: TrainerFactory
    metrics: tuple[str, ...] = ("mean_token_accuracy", "entropy")


class LossProgressBar(ProgressCallback):
    """Trainer's tqdm bar, labelled with the run's name, showing the loss instead of printing each log.

    Where the bar's stream (stderr) is not a terminal (a log file, a pipe), a bar would pile its redraws into one
    long line: the progress comes as a printed line every tenth of the run instead (``lines``)."""

    def __init__(self, label: str, lines: bool | None = None) -> None:
        super().__init__()
        self.label = label
        self.lines = not sys.stderr.isatty() if lines is None else lines
        self._every = 1

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if self.lines:
            self._every = max(1, math.ceil(state.max_steps / 10))
            return
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.set_description(self.label)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if not self.lines:
            super().on_step_end(args, state, control, **kwargs)

    def on_prediction_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not self.lines:
            super().on_prediction_step(args, state, control, **kwargs)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        if not logs or "loss" not in logs:
            return
        if self.training_bar is not None:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.3f}", refresh=False)
        elif self.lines and state.is_world_process_zero:
            step = state.global_step
            if step % self._every == 0 or step == state.max_steps or step == 1:
                print(f"{self.label.strip()} step {step}/{state.max_steps}, loss {logs['loss']:.3f}", flush=True)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if self.training_bar is not None:
            super().on_train_end(args, state, control, **kwargs)


def fused_callback(args: argparse.Namespace) -> TrainerCallback:
    """``lce_patch.FusedLCECallback`` with the options given on the command line."""
    options = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    return lce_patch.FusedLCECallback(**options)


def report_deepspeed(trainer: Trainer) -> None:
    """Under DeepSpeed (``accelerate launch --config_file recipes/accelerate/zero*.yaml``), prints the batch
    settings its engine trained with, which come from the Trainer (``--batch-size``, ``--grad-accum``)."""
    engine = trainer.model_wrapped
    if not getattr(trainer, "is_deepspeed_enabled", False) or not hasattr(engine, "gradient_accumulation_steps"):
        return
    if trainer.is_world_process_zero():
        print(
            f"DeepSpeed ZeRO-{engine.zero_optimization_stage()}: micro-batch {engine.train_micro_batch_size_per_gpu()}"
            f" x gradient accumulation {engine.gradient_accumulation_steps()} x {engine.world_size} processes"
            f" = {engine.train_batch_size()} sequences per optimizer step",
            flush=True,
        )


def train_once(
    recipe: Recipe,
    args: argparse.Namespace,
    tokenizer: PreTrainedTokenizerBase,
    dataset: datasets.Dataset,
    *,
    fused: bool,
    output_dir: Path,
    save: bool = False,
) -> RunResult:
    """One training run from fresh weights, with or without the fused loss, measured."""
    name = FUSED if fused else BASELINE
    model = load_model(args, tokenizer)
    recorder = StepRecorder()
    callbacks = [recorder, *([fused_callback(args)] if fused else [])]
    trainer = recipe.make_trainer(args, model, tokenizer, dataset, callbacks, output_dir)
    if _repeat_filter is not None:
        _repeat_filter.attach()  # loggers set up while the Trainer was built (DeepSpeed's)
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)  # the Trainer's own where disable_tqdm is set: each log as a dict
    # the run's name as the comparison table prints it, in brackets: not the library's own "lce_patch:" line
    trainer.add_callback(LossProgressBar(f"[{FUSED if fused else recipe.baseline}]"))
    with peak_memory(trainer.model) as memory:
        trainer.train()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    report_deepspeed(trainer)
    if save:
        trainer.save_model(str(output_dir))
    last = recorder.logs.get(max(recorder.logs, default=0), {})
    steps = range(1, len(recorder.step_seconds) + 1)
    result = RunResult(
        name=name,
        losses=[recorder.logs.get(step, {}).get("loss", math.nan) for step in steps],
        step_seconds=recorder.step_seconds,
        step_tokens=recorder.step_tokens,
        peak_bytes=memory["bytes"],
        memory_method=memory["method"],
        last_metrics={k: v for k, v in last.items() if k in recipe.metrics},
        step_logs=[recorder.logs.get(step, {}) for step in steps],
        load_average=load,
    )
    del trainer, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


class RepeatFilter(logging.Filter):
    """Lets a logged warning through the first time its text comes, and drops its repeats.

    Attached to the handlers that exist (library loggers such as transformers' own, the root logger's,
    ``logging.lastResort``); :meth:`attach` again covers handlers created since (DeepSpeed's, on import)."""

    def __init__(self) -> None:
        super().__init__()
        # text -> the record that first carried it: that record passes every handler it reaches (a record
        # propagates through several), later records with the same text pass none
        self.first: dict[tuple[str, int, str], logging.LogRecord] = {}
        self.dropped = 0  # records dropped, each counted once however many handlers it reached
        self._last_dropped: logging.LogRecord | None = None
        self._handlers: list[logging.Handler] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, record.getMessage())
        first = self.first.setdefault(key, record)
        if first is record:
            return True
        if record is not self._last_dropped:
            self._last_dropped = record
            self.dropped += 1
        return False

    def attach(self) -> None:
        known = list(logging.Logger.manager.loggerDict.values())  # a copy: other threads may add loggers
        loggers = [
            logging.getLogger(),
            *(x for x in known if isinstance(x, logging.Logger)),
        ]
        handlers = [h for logger in loggers for h in logger.handlers]
        if logging.lastResort is not None:
            handlers.append(logging.lastResort)
        for handler in handlers:
            if self not in handler.filters:
                handler.addFilter(self)
                self._handlers.append(handler)

    def detach(self) -> None:
        for handler in self._handlers:
            handler.removeFilter(self)
        self._handlers.clear()


_repeat_filter: RepeatFilter | None = None  # the one of the running recipe, see warnings_once


@contextmanager
def warnings_once() -> Iterator[RepeatFilter]:
    """Within the block, each library warning shows once, however often it comes.

    Python warnings get the action "once" (one per text and category, from whichever line), appended after the
    filters already set, so ``-W`` / ``PYTHONWARNINGS`` and the libraries' own "ignore" filters still win;
    logged warnings (transformers' ``logger.warning``, once per training step in some trainers) pass a
    :class:`RepeatFilter`. Both are undone on exit: importing lce_patch or the recipes changes nothing."""
    global _repeat_filter
    previous, _repeat_filter = _repeat_filter, RepeatFilter()
    with warnings.catch_warnings():
        warnings.filterwarnings("once", append=True)
        _repeat_filter.attach()
        try:
            yield _repeat_filter
        finally:
            _repeat_filter.detach()
            _repeat_filter = previous


def default_output_dir(recipe: Recipe, args: argparse.Namespace) -> Path:
    """``--output-dir``, or ``runs/<recipe>`` for a training run and ``runs/<recipe>-compare`` for ``--compare``,
    so that a comparison never writes into the folder holding a trained model."""
    if args.output_dir is not None:
        return args.output_dir
    return Path("runs") / (f"{recipe.name}-compare" if args.compare else recipe.name)


@contextmanager
def bars_only_on_a_terminal() -> Iterator[None]:
    """Within the block, transformers' own progress bars (saving a model's shards, ...) are off where stderr is
    not a terminal: in a log file each redraw would join one long line. Restored on exit."""
    from transformers.utils import logging as hf_logging

    turn_off = not sys.stderr.isatty() and hf_logging.is_progress_bar_enabled()
    if turn_off:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if turn_off:
            hf_logging.enable_progress_bar()


def run_recipe(recipe: Recipe, args: argparse.Namespace) -> int:
    """Train with the fused loss, or with ``--compare`` train twice and report the comparison."""
    with warnings_once() as repeats, bars_only_on_a_terminal():
        status = _run_recipe(recipe, args)
    if repeats.dropped:
        print(f"({repeats.dropped} repeats of logged library warnings not shown)", file=sys.stderr)
    return status


def _run_recipe(recipe: Recipe, args: argparse.Namespace) -> int:
    datasets.disable_progress_bars()
    args.output_dir = default_output_dir(recipe, args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args)
    dataset = recipe.prepare_dataset(args, load_train_dataset(args), tokenizer)
    print(describe(args, tokenizer, dataset), flush=True)

    if not args.compare:
        result = train_once(recipe, args, tokenizer, dataset, fused=True, output_dir=args.output_dir, save=True)
        memory = "n/a" if result.peak_bytes is None else f"{result.peak_bytes / MIB:.1f} MiB"
        step, rate = result.step_time, result.tokens_per_second
        first, last = result.speed_summary()["timed_steps"]
        spread = f" (p25-p75 {step.p25:.3f}-{step.p75:.3f})" if step.count > 1 else ""
        covered = f"step {first}" if first == last else f"steps {first}-{last}"
        print(
            f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} in {len(result.losses)} steps, "
            f"peak memory {memory}, median {step.median:.3f} s/step{spread} and {rate.median:,.0f} tokens/s "
            f"over {covered}; model saved to {args.output_dir}"
        )
        return 0

    results = [
        train_once(recipe, args, tokenizer, dataset, fused=fused, output_dir=args.output_dir / name)
        for fused, name in ((False, BASELINE), (True, FUSED))
    ]
    baseline, fused = results
    print()
    print(format_table(baseline, fused, recipe.baseline, metrics=recipe.metrics))
    title = f"recipes/{recipe.name}.py --compare: {args.model or 'a small Llama built from a config'}, {args.max_steps} steps"
    png, record = args.output_dir / "compare.png", args.output_dir / "compare.json"
    plot_comparison(baseline, fused, recipe.baseline, title, png)
    verdict = speed_verdict(baseline.step_seconds, fused.step_seconds, recipe.baseline, FUSED)
    summary = {
        "recipe": recipe.name,
        "baseline": recipe.baseline,
        "setup": describe(args, tokenizer, dataset),
        "speed_change": {
            "step_time_median": pct_change(fused.step_time.median, baseline.step_time.median),
            "tokens_per_second_median": pct_change(fused.tokens_per_second.median, baseline.tokens_per_second.median),
        },
        "speed_verdict": {"call": verdict.call, "noise": list(verdict.reasons)},
        "runs": [{**dataclasses.asdict(r), **r.speed_summary()} for r in results],
    }
    record.write_text(json.dumps(summary, indent=1, allow_nan=True) + "\n", encoding="utf-8")
    print(f"\nwrote {png} and {record}")
    return 0
