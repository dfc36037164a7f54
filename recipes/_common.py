"""What both recipes share: the embedded model, tokenizer and data, and the ``--compare`` harness.

A recipe supplies a :class:`Recipe`: how to turn the loaded dataset into its training set, and how to
build its Trainer from a model, a tokenizer, that set and a list of callbacks. :func:`run_recipe` does
the rest: a single training run with the fused loss, or, with ``--compare``, two runs of the same
steps (same initial weights, same data order), one without and one with
``lce_patch.FusedLCECallback``, measured and reported side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import logging
import math
import statistics
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import datasets
import torch
from _cli import EMBEDDED_DATA, RECIPES_DIR
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    ProgressCallback,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    set_seed,
)

if importlib.util.find_spec("lce_patch") is None and (RECIPES_DIR.parent / "lce_patch").is_dir():
    # Run from a clone without `pip install -e .`: use the checkout's package.
    sys.path.insert(0, str(RECIPES_DIR.parent))

import lce_patch  # noqa: E402  (after the path fix-up)

# The embedded model: a Llama small enough to train on two CPU cores in about a minute. The
# tokenizer learns about 1,300 tokens from the shipped data; the model's vocabulary is padded to
# EMBEDDED_VOCAB rows (real models pad theirs too), so that, with V >> hidden as in every real LLM,
# the LM head and its logits take the share of memory they take at scale.
EMBEDDED_VOCAB = 4096
EMBEDDED_CONFIG: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
EMBEDDED_LR, LORA_LR, FULL_LR = 1e-3, 2e-4, 2e-5

# The embedded tokenizer: byte-level BPE trained on the shipped data at startup (deterministic, ~0.1 s).
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# One role token per message, content, <|end|>. The assistant's part is marked for
# return_assistant_tokens_mask (TRL's assistant_only_loss).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

FUSED, BASELINE = "lce_patch", "baseline"
# transformers 5.19 renamed gradient_checkpointing (now a deprecated alias) to activation_checkpointing.
CHECKPOINTING_FIELD = next(
    (f.name for f in dataclasses.fields(TrainingArguments) if f.name == "activation_checkpointing"),
    "gradient_checkpointing",
)
MIB = 1024 * 1024


# ----------------------------------------------------------------------------------------------
# Model, tokenizer, data
# ----------------------------------------------------------------------------------------------


def learning_rate(args: argparse.Namespace) -> float:
    """``--lr``, or a default that suits the model: from scratch, LoRA, or full fine-tuning."""
    if args.lr is not None:
        return args.lr
    if args.model is None:
        return EMBEDDED_LR
    return LORA_LR if args.lora else FULL_LR


def build_embedded_tokenizer(
    data_path: Path = EMBEDDED_DATA, vocab_size: int = EMBEDDED_VOCAB
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the messages of ``data_path``, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [
        message["content"]
        for line in data_path.read_text(encoding="utf-8").splitlines()
        if line.strip()
        for message in json.loads(line).get("messages", [])
    ]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=EMBEDDED_CONFIG["max_position_embeddings"],
    )


def load_tokenizer(args: argparse.Namespace) -> PreTrainedTokenizerBase:
    """The model's tokenizer (``--model``) or the embedded one; a pad token is always set."""
    tokenizer = AutoTokenizer.from_pretrained(args.model) if args.model else build_embedded_tokenizer()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def embedded_vocab(tokenizer: PreTrainedTokenizerBase) -> int:
    """Rows of the embedded model's vocabulary: the tokenizer's, padded to EMBEDDED_VOCAB."""
    return max(EMBEDDED_VOCAB, len(tokenizer))


def load_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """``--model`` from the hub or disk, or the embedded Llama with fresh weights from ``--seed``.

    Called once per run, so both runs of ``--compare`` start from the same weights.
    """
    set_seed(args.seed)
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = LlamaConfig(
        vocab_size=embedded_vocab(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **EMBEDDED_CONFIG,
    )
    return AutoModelForCausalLM.from_config(config)


def load_train_dataset(args: argparse.Namespace) -> datasets.Dataset:
    """``--dataset`` (local JSON/JSONL file or hub id), or the shipped conversations."""
    source = args.dataset
    if source is None or Path(source).is_file():
        path = Path(source) if source else EMBEDDED_DATA
        if path.suffix not in (".json", ".jsonl"):
            raise SystemExit(f"--dataset {path}: a local dataset must be a .json or .jsonl file")
        dataset = datasets.load_dataset("json", data_files=str(path), split="train")
    else:
        dataset = datasets.load_dataset(source, args.dataset_config, split=args.dataset_split)
    return first_examples(dataset, args.max_examples)


def first_examples(dataset: datasets.Dataset, count: int | None) -> datasets.Dataset:
    """The first ``count`` rows of ``dataset`` (``--max-examples``), or all of them for None."""
    return dataset if count is None else dataset.select(range(min(count, len(dataset))))


def lora_config(args: argparse.Namespace) -> Any:
    """The peft LoraConfig of ``--lora``: every linear layer of the decoder, the LM head excluded."""
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


def make_loadable(model: PreTrainedModel, output_dir: Path) -> None:
    """Give a model built from a config (the embedded one) a path TRL can load it from.

    TRL's DPO, GRPO and RLOO trainers build their reference model with ``from_pretrained`` from the
    policy's ``config._name_or_path``; a model built from a config has none, so its initial weights are
    saved under ``output_dir/initial`` and that becomes its path."""
    if model.config._name_or_path:
        return
    path = output_dir / "initial"
    model.save_pretrained(path)
    model.config._name_or_path = str(path)


def accelerator_available() -> bool:
    """Whether torch sees a GPU (CUDA, or another accelerator through ``torch.accelerator``)."""
    accelerator = getattr(torch, "accelerator", None)
    return torch.cuda.is_available() or bool(accelerator is not None and accelerator.is_available())


def training_kwargs(args: argparse.Namespace, output_dir: Path) -> dict[str, Any]:
    """TrainingArguments fields both recipes use (also valid for TRL's SFTConfig)."""
    return dict(
        output_dir=str(output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=learning_rate(args),
        lr_scheduler_type="cosine",
        warmup_steps=math.ceil(0.1 * args.max_steps),
        weight_decay=0.0,
        bf16=args.bf16,
        **{CHECKPOINTING_FIELD: args.gradient_checkpointing},
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        include_num_input_tokens_seen="non_padding",
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=not accelerator_available(),  # also lets --bf16 autocast on a CPU
    )


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------


class StepRecorder(TrainerCallback):
    """Records, per optimizer step: the logged metrics, the wall time and the non-padding tokens.

    A step's time runs from the end of the previous step (or the start of training) to the end of
    this one, so it includes data loading and logging: what a user waits for.
    """

    def __init__(self) -> None:
        self.logs: dict[int, dict[str, float]] = {}
        self.step_seconds: list[float] = []
        self.step_tokens: list[int] = []
        self._last_time = 0.0
        self._last_tokens = 0
        self._last_trl_tokens = 0.0

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        self._last_time, self._last_tokens = self._now(), state.num_input_tokens_seen
        self._last_trl_tokens = 0.0

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        now = self._now()
        self.step_seconds.append(now - self._last_time)
        self.step_tokens.append(int(state.num_input_tokens_seen - self._last_tokens))
        self._last_time, self._last_tokens = now, state.num_input_tokens_seen

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        numbers = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        self.logs.setdefault(state.global_step, {}).update(numbers)
        # TRL's trainers count the tokens they train on (``num_tokens``, cumulative); the Trainer's own count
        # sees only ``input_ids`` batches, which GRPO's prompt batches are not.
        if "num_tokens" in numbers and self.step_tokens and len(self.step_tokens) == state.global_step:
            if self.step_tokens[-1] == 0:
                self.step_tokens[-1] = int(numbers["num_tokens"] - self._last_trl_tokens)
            self._last_trl_tokens = numbers["num_tokens"]


class LossProgressBar(ProgressCallback):
    """Trainer's tqdm bar, labelled with the run's name, showing the loss instead of printing each log."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.set_description(self.label)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        if self.training_bar is not None and logs and "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.3f}", refresh=False)


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live CPU tensor storages created while the mode is active.

    The CPU counterpart of ``torch.cuda.max_memory_allocated``: the fresh outputs of every op (ops
    whose schema says they return a new tensor, not a view or an input written in place) are
    counted until they are freed (a weakref callback). Storages that existed before the mode was
    entered are not seen; add them through ``baseline``.
    """

    def __init__(self, baseline: int = 0) -> None:
        super().__init__()
        self.current = self.peak = baseline
        self._live: dict[weakref.ref, int] = {}
        self._allocates: dict[Any, bool] = {}  # op -> whether it returns fresh tensors

    def _free(self, ref: weakref.ref) -> None:
        self.current -= self._live.pop(ref, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        allocates = self._allocates.get(func)
        if allocates is None:
            allocates = self._allocates[func] = any(r.alias_info is None for r in func._schema.returns)
        if allocates:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                    storage = tensor.untyped_storage()
                    ref = weakref.ref(storage, self._free)
                    if ref not in self._live:
                        self._live[ref] = storage.nbytes()
                        self.current += self._live[ref]
                        self.peak = max(self.peak, self.current)
        return out


def storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (shared storages counted once)."""
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


@contextmanager
def peak_memory(model: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """Measures the peak memory of the block: fills ``{"bytes": int | None, "method": str}``."""
    result: dict[str, Any] = {"bytes": None, "method": "n/a"}
    device = next(model.parameters()).device
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        yield result
        result.update(bytes=torch.cuda.max_memory_allocated(), method="torch.cuda.max_memory_allocated")
    elif device.type == "cpu":
        tracker = LiveTensorBytes(baseline=storage_bytes(model))
        with tracker:
            yield result
        result.update(bytes=tracker.peak, method="live CPU tensor bytes (TorchDispatchMode)")
    else:
        yield result


def warmup_steps(steps: int) -> int:
    """Steps left out of the speed figures: the first (CUDA/cuBLAS start-up, first-call compilation), and the
    second too from 10 steps on (kernels first used in backward, a dynamic-shape recompilation)."""
    return 0 if steps < 2 else 1 if steps < 10 else 2


@dataclasses.dataclass(frozen=True)
class Spread:
    """The median and spread of some per-step values: quartiles (the middle half of the steps) and extremes."""

    median: float
    p25: float
    p75: float
    min: float
    max: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan, math.nan, 0)
        if len(values) == 1:
            return cls(values[0], values[0], values[0], values[0], values[0], 1)
        p25, median, p75 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(median, p25, p75, min(values), max(values), len(values))

    def overlaps(self, other: Spread) -> bool:
        """Whether the middle halves (p25-p75) of two spreads overlap."""
        return self.p25 <= other.p75 and other.p25 <= self.p75


@dataclasses.dataclass
class RunResult:
    """What one training run measured."""

    name: str
    losses: list[float]
    step_seconds: list[float]
    step_tokens: list[int]
    peak_bytes: int | None
    memory_method: str
    last_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    step_logs: list[dict[str, float]] = dataclasses.field(default_factory=list)

    @property
    def timed(self) -> slice:
        """The steps the speed figures cover: all but the warm-up (see :func:`warmup_steps`)."""
        return slice(warmup_steps(len(self.step_seconds)), None)

    @property
    def step_tokens_per_second(self) -> list[float]:
        """Non-padding tokens per second of each step."""
        return [tokens / max(seconds, 1e-9) for tokens, seconds in zip(self.step_tokens, self.step_seconds)]

    @property
    def step_time(self) -> Spread:
        """Seconds per optimizer step after the warm-up: median, quartiles, extremes.

        Medians, not means: a few slow steps (a busy machine, a compilation) would dominate a mean."""
        return Spread.of(self.step_seconds[self.timed])

    @property
    def tokens_per_second(self) -> Spread:
        """Tokens per second of each step after the warm-up: median, quartiles, extremes."""
        return Spread.of(self.step_tokens_per_second[self.timed])

    def speed_summary(self) -> dict[str, Any]:
        """The speed figures as compare.json records them."""
        steps = len(self.step_seconds)
        return {
            "timed_steps": [warmup_steps(steps) + 1, steps],
            "step_time_s": dataclasses.asdict(self.step_time),
            "tokens_per_second": dataclasses.asdict(self.tokens_per_second),
        }


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------

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
    trainer.add_callback(LossProgressBar(f"{name:>9}"))
    with peak_memory(trainer.model) as memory:
        trainer.train()
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
    )
    del trainer, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _pct(new: float | None, old: float | None) -> str:
    if new is None or old is None or not old or math.isnan(new) or math.isnan(old):
        return ""
    return f"{100 * (new - old) / old:+.1f}%"


def format_table(
    baseline: RunResult,
    fused: RunResult,
    baseline_label: str,
    max_rows: int = 60,
    metrics: tuple[str, ...] = ("mean_token_accuracy", "entropy"),
) -> str:
    """The comparison as text: loss per step (every step, or evenly spaced ones), then a summary."""
    steps = len(baseline.losses)
    every = 1 if steps <= max_rows else math.ceil(steps / (max_rows // 2))
    shown = sorted({*range(0, steps, every), steps - 1}) if steps else []
    width = max(len(baseline_label), len(FUSED), 12)
    lines = [f"{'step':>6}  {baseline_label:>{width}}  {FUSED:>{width}}  {'difference':>10}"]
    for i in shown:
        a, b = baseline.losses[i], fused.losses[i] if i < len(fused.losses) else math.nan
        lines.append(f"{i + 1:>6}  {a:>{width}.4f}  {b:>{width}.4f}  {b - a:>+10.2e}")
    if every > 1:
        lines.append(f"(one step in {every} shown; every step is in compare.json)")
    differences = [abs(b - a) for a, b in zip(baseline.losses, fused.losses)]
    if differences:
        lines.append(f"largest loss difference: {max(differences):.2e}")
    for key in metrics:
        pairs = [(a[key], b[key]) for a, b in zip(baseline.step_logs, fused.step_logs) if key in a and key in b]
        if pairs:
            lines.append(f"largest {key} difference: {max(abs(b - a) for a, b in pairs):.2e}")

    def mib(result: RunResult) -> float | None:
        return None if result.peak_bytes is None else result.peak_bytes / MIB

    def cell(value: float | None, fmt: str) -> str:
        return "n/a" if value is None or math.isnan(value) else format(value, fmt)

    def middle_half(spread: Spread, fmt: str) -> str:
        return "n/a" if not spread.count else f"{spread.p25:{fmt}}-{spread.p75:{fmt}}"

    # (label, baseline cell, fused cell, change)
    rows: list[tuple[str, str, str, str]] = [
        ("peak memory (MiB)", cell(mib(baseline), ".1f"), cell(mib(fused), ".1f"), _pct(mib(fused), mib(baseline)))
    ]
    for label, (a, b), fmt in (
        ("time per step (s)", (baseline.step_time, fused.step_time), ".3f"),
        ("tokens/s", (baseline.tokens_per_second, fused.tokens_per_second), ",.0f"),
    ):
        rows.append((f"{label}, median", cell(a.median, fmt), cell(b.median, fmt), _pct(b.median, a.median)))
        rows.append(("  middle half (p25-p75)", middle_half(a, fmt), middle_half(b, fmt), ""))
    final_losses = (baseline.losses[-1] if steps else None, fused.losses[-1] if fused.losses else None)
    final_change = _pct(final_losses[1], final_losses[0])
    rows.append(("final loss", cell(final_losses[0], ".4f"), cell(final_losses[1], ".4f"), final_change))
    for key in metrics:
        if key in baseline.last_metrics and key in fused.last_metrics:
            a, b = baseline.last_metrics[key], fused.last_metrics[key]
            rows.append((f"final {key}", cell(a, ".4f"), cell(b, ".4f"), _pct(b, a)))
    label = max(len(r[0]) for r in rows)
    width = max(width, *(len(r[i]) for r in rows for i in (1, 2)))
    lines += ["", f"{'':<{label}}  {baseline_label:>{width}}  {FUSED:>{width}}  {'change':>10}"]
    for name, a_cell, b_cell, change in rows:
        lines.append(f"{name:<{label}}  {a_cell:>{width}}  {b_cell:>{width}}  {change:>10}".rstrip())
    lines.append(f"peak memory: {fused.memory_method}")
    lines.append(speed_note(baseline, fused, baseline_label))
    return "\n".join(lines)


def speed_note(baseline: RunResult, fused: RunResult, baseline_label: str) -> str:
    """What the speed rows cover, and the speed-up between the median steps in words."""
    steps = len(fused.step_seconds)
    first = warmup_steps(steps) + 1
    covered = f"step {first}" if first == steps else f"steps {first}-{steps}"
    skipped = "" if first == 1 else " (warm-up left out)"
    note = f"time per step and tokens/s: medians over {covered}{skipped}; change: between the medians"
    a, b = baseline.step_time, fused.step_time
    if not (a.count and b.count) or not a.median > 0 or not b.median > 0:
        return note
    ratio = b.median / a.median
    if ratio <= 1:
        verdict = f"{FUSED}'s median step is {100 * (1 - ratio):.1f}% faster than {baseline_label}'s"
    else:
        verdict = f"{FUSED}'s median step is {100 * (ratio - 1):.1f}% slower than {baseline_label}'s"
    if a.count > 1 and b.count > 1 and a.overlaps(b):
        verdict += " (their middle halves overlap: within this machine's step-to-step noise)"
    return f"{note}\nspeed: {verdict}"


def plot_comparison(baseline: RunResult, fused: RunResult, baseline_label: str, title: str, path: Path) -> None:
    """Writes a PNG: both loss curves (left), both runs' time per step (middle), both peak memories (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_time, ax_mem) = plt.subplots(1, 3, figsize=(16, 4.4), gridspec_kw={"width_ratios": [2.2, 2.2, 1]})
    runs = ((baseline, baseline_label, "-", "tab:gray"), (fused, FUSED, "--", "tab:blue"))
    for result, label, style, color in runs:
        steps = range(1, len(result.losses) + 1)
        ax_loss.plot(steps, result.losses, style, label=label, linewidth=1.8, color=color)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title="loss per step")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()

    # Time per step, each run's median (over the steps after the warm-up) as a horizontal line.
    warmup = warmup_steps(len(fused.step_seconds))
    timed_max = 0.0
    for result, label, style, color in runs:
        steps = range(1, len(result.step_seconds) + 1)
        ax_time.plot(steps, result.step_seconds, style, color=color, linewidth=1.2, marker=".", markersize=4)
        spread = result.step_time
        if spread.count:
            ax_time.axhline(
                spread.median, color=color, linewidth=1.5, alpha=0.8, label=f"{label}: median {spread.median:.3g} s"
            )
            timed_max = max(timed_max, spread.max)
    if warmup:
        ax_time.axvspan(0.5, warmup + 0.5, color="0.85", alpha=0.6, label="warm-up (left out)")
    if timed_max > 0:
        ax_time.set_ylim(0, timed_max * 1.15)  # a slow warm-up step may run off the top
    change = _pct(fused.step_time.median, baseline.step_time.median)
    ax_time.set(
        xlabel="optimizer step",
        ylabel="seconds",
        title=f"time per step (median change {change})" if change else "time per step",
    )
    ax_time.grid(alpha=0.3)
    for ax in (ax_loss, ax_time):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_time.legend(fontsize="small")

    if baseline.peak_bytes is not None and fused.peak_bytes is not None:
        values = [baseline.peak_bytes / MIB, fused.peak_bytes / MIB]
        bars = ax_mem.bar([baseline_label, FUSED], values, color=["tab:gray", "tab:blue"])
        ax_mem.bar_label(bars, fmt="%.0f MiB")
        saved = values[0] - values[1]
        verb = "saved" if saved >= 0 else "more"
        ax_mem.set_title(f"peak memory\n{abs(saved):.0f} MiB {verb} ({100 * abs(saved) / values[0]:.0f}%)")
        ax_mem.set_ylabel("MiB")
        ax_mem.set_ylim(0, max(values) * 1.18)
    else:
        ax_mem.text(0.5, 0.5, "peak memory not measured", ha="center", va="center")
        ax_mem.set_axis_off()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def describe(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, dataset: datasets.Dataset) -> str:
    """One line naming the model, data and batch shape of the run."""
    layers, hidden, vocab = (
        EMBEDDED_CONFIG["num_hidden_layers"],
        EMBEDDED_CONFIG["hidden_size"],
        embedded_vocab(tokenizer),
    )
    model = args.model or f"embedded Llama ({layers} layers, hidden {hidden}, vocab {vocab})"
    data = args.dataset or EMBEDDED_DATA.name
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    return (
        f"{model}{' + LoRA' if args.lora else ''} on {data} ({len(dataset)} training sequences), {args.max_steps} steps of "
        f"{args.batch_size}x{args.grad_accum} sequences <= {args.seq_len} tokens, "
        f"{'bf16' if args.bf16 else 'fp32'}, {device}"
    )


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


def run_recipe(recipe: Recipe, args: argparse.Namespace) -> int:
    """Train with the fused loss, or with ``--compare`` train twice and report the comparison."""
    with warnings_once() as repeats:
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
    title = f"recipes/{recipe.name}.py --compare: {args.model or 'embedded Llama'}, {args.max_steps} steps"
    png, record = args.output_dir / "compare.png", args.output_dir / "compare.json"
    plot_comparison(baseline, fused, recipe.baseline, title, png)
    summary = {
        "recipe": recipe.name,
        "baseline": recipe.baseline,
        "setup": describe(args, tokenizer, dataset),
        "speed_change": {
            "step_time_median": _pct(fused.step_time.median, baseline.step_time.median),
            "tokens_per_second_median": _pct(fused.tokens_per_second.median, baseline.tokens_per_second.median),
        },
        "runs": [{**dataclasses.asdict(r), **r.speed_summary()} for r in results],
    }
    record.write_text(json.dumps(summary, indent=1, allow_nan=True) + "\n", encoding="utf-8")
    print(f"\nwrote {png} and {record}")
    return 0
