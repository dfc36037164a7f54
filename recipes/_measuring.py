"""Measuring: what one training run takes, step by step.

:class:`StepRecorder` records each optimizer step's logged metrics, wall time and tokens;
:func:`peak_memory` measures a run's peak memory (``torch.cuda.max_memory_allocated`` on a GPU, the
live tensor bytes of :class:`LiveTensorBytes` on a CPU); :class:`RunResult` holds what one run
measured and gives its time per step and tokens/s as a :class:`Spread` (median, quartiles, extremes)
over the steps after the warm-up (:func:`warmup_steps`); :func:`speed_verdict` says whether two runs'
step times differ by more than their noise.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

MIB = 1024 * 1024


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
    load_average: float | None = None  # the machine's 1-minute load average when the run ended (Unix)

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


# A run whose median step in one half of its timed steps is this many times the other half's has not settled.
DRIFT_RATIO = 1.5


@dataclasses.dataclass(frozen=True)
class SpeedVerdict:
    """Whether two runs' step times differ beyond their noise.

    ``change``: the fused run's median step time relative to the baseline's, minus 1 (-0.25: 25% faster; NaN
    where a run has no timed step); ``call``: "faster", "slower" or "too noisy to call"; ``reasons``: why it is too
    noisy, in words (empty when called)."""

    change: float
    call: str
    reasons: tuple[str, ...]


def speed_verdict(
    baseline: Sequence[float], fused: Sequence[float], baseline_name: str = "baseline", fused_name: str = "lce_patch"
) -> SpeedVerdict:
    """Compares two runs' seconds per step (every step, warm-up included: it is left out here, see
    :func:`warmup_steps`).

    The medians are called different only when the difference between them is larger than each run's own
    spread (the middle half of its steps, p25-p75), the middle halves do not overlap, and neither run was still
    settling: the medians of the first and second halves of its timed steps within a factor of ``DRIFT_RATIO``
    (a slow stretch of steps that the two-step warm-up does not cover: a first-run compilation, another process
    taking the CPU for a while). Fewer than three timed steps per run give no spread to judge by.
    """
    spreads, reasons = [], []
    for name, seconds in ((baseline_name, list(baseline)), (fused_name, list(fused))):
        timed = seconds[warmup_steps(len(seconds)) :]
        spreads.append(Spread.of(timed))
        if len(timed) < 3:
            reasons.append(f"{name} has {len(timed)} timed step{'s' * (len(timed) != 1)}, too few to judge its noise")
            continue
        half = len(timed) // 2
        early, late = statistics.median(timed[:half]), statistics.median(timed[half:])
        if max(early, late) > DRIFT_RATIO * min(early, late):
            reasons.append(
                f"{name} had not settled: its first {half} timed steps ran at a median {early:.3g} s, the other "
                f"{len(timed) - half} at {late:.3g} s (a long warm-up, or another process taking the CPU for a while)"
            )
    a, b = spreads
    if not (a.count and b.count) or not (a.median > 0 and b.median > 0):
        return SpeedVerdict(math.nan, "too noisy to call", tuple(reasons) or ("a run has no timed step",))
    change = b.median / a.median - 1
    difference = abs(b.median - a.median)
    if a.count >= 3 and b.count >= 3:
        for name, spread in ((baseline_name, a), (fused_name, b)):
            if spread.p75 - spread.p25 > difference:
                reasons.append(
                    f"{name}'s middle half ({spread.p25:.3g}-{spread.p75:.3g} s) is wider than the difference "
                    f"between the medians ({difference:.3g} s)"
                )
        if a.overlaps(b):
            reasons.append("the two runs' middle halves overlap")
    if reasons:
        return SpeedVerdict(change, "too noisy to call", tuple(reasons))
    return SpeedVerdict(change, "faster" if change < 0 else "slower", ())
