"""The recipes' embedded defaults run end to end on the CPU, offline, in a few seconds each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import RECIPES_DIR

# Small enough for CI: a handful of short sequences, two optimizer steps.
TINY = ["--max-steps", "2", "--max-examples", "24", "--batch-size", "4", "--seq-len", "128"]
RECIPES = ["sft", "train", "dpo", "grpo", "distill", "distill_top_k"]
# The distillation recipes' embedded teacher first trains on the shipped data: a few steps are enough here.
EXTRA = {"distill": ["--teacher-steps", "4"], "distill_top_k": ["--teacher-steps", "4"]}


def tiny(recipe: str) -> list[str]:
    return [*TINY, *EXTRA.get(recipe, [])]


def _main(recipe: str):
    module = __import__(recipe)
    return module.main


def _repeated_warnings(err: str) -> list[str]:
    """Warning lines (Python warnings, transformers' logged ones) that stderr shows more than once."""
    lines = [line.split("\r")[-1].strip() for line in err.splitlines()]
    warned = [line for line in lines if "Warning:" in line or line.startswith("[transformers]")]
    return sorted({line for line in warned if warned.count(line) > 1})


@pytest.mark.parametrize("recipe", RECIPES)
def test_embedded_default_trains_and_saves(
    recipe: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """No --model, no --dataset: the embedded model trains a couple of steps with the fused loss and is saved
    to runs/<recipe> (no --output-dir either), a folder of its own."""
    monkeypatch.chdir(tmp_path)
    assert _main(recipe)(tiny(recipe)) == 0
    out, err = capfd.readouterr()
    assert "a small Llama built from a config" in out and "loss" in out and "median" in out
    # stderr is not a terminal here: the progress comes as lines, not as a bar's redraws
    assert "[lce_patch] step 2/2, loss " in out and "\r" not in err
    saved = tmp_path / "runs" / recipe
    assert (saved / "config.json").is_file()
    assert (saved / "tokenizer.json").is_file()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [recipe]
    assert not _repeated_warnings(err)


@pytest.mark.parametrize("recipe", RECIPES)
def test_compare_prints_the_table_and_writes_the_plot(
    recipe: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """--compare: two runs of the same steps; the table, the PNG and the JSON; equal losses. With no
    --output-dir it writes to runs/<recipe>-compare, never into runs/<recipe> where training saves its model;
    repeated library warnings (GRPO's, once per step) show once."""
    monkeypatch.chdir(tmp_path)
    assert _main(recipe)([*tiny(recipe), "--compare"]) == 0
    out, err = capfd.readouterr()
    for row in (
        "step",
        "peak memory (MiB)",
        "time per step (s), median",
        "tokens/s, median",
        "middle half (p25-p75)",
        "final loss",
        "lce_patch",
    ):
        assert row in out
    assert "time per step and tokens/s: medians over step 2 (warm-up left out)" in out
    # one timed step per run: no spread to judge a difference by
    assert "speed: too noisy to call" in out and "1 timed step, too few to judge its noise" in out
    # each run named in its progress lines as in the table, in brackets (not like the library's "lce_patch:" line)
    baseline = {"train": "unpatched", "distill": "TRL kernel", "distill_top_k": "unfused top-K"}.get(recipe, "TRL head")
    assert f"[{baseline}] step 2/2, loss " in out and "[lce_patch] step 2/2, loss " in out and "\r" not in err
    assert "lce_patch: step" not in out
    assert not _repeated_warnings(err), _repeated_warnings(err)
    assert "Tried to track the number of tokens seen" not in err  # GRPO counts TRL's num_tokens instead

    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [f"{recipe}-compare"]
    out_dir = tmp_path / "runs" / f"{recipe}-compare"
    assert not (out_dir / "config.json").exists()
    png = out_dir / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out_dir / "compare.json").read_text())
    assert set(record["speed_change"]) == {"step_time_median", "tokens_per_second_median"}
    assert record["speed_verdict"]["call"] == "too noisy to call" and record["speed_verdict"]["noise"]
    baseline, fused = record["runs"]
    for run in (baseline, fused):
        assert run["timed_steps"] == [2, 2]
        assert run["step_time_s"]["median"] == pytest.approx(run["step_seconds"][1])
        assert run["step_time_s"]["count"] == 1
        assert run["tokens_per_second"]["median"] > 0
    assert [baseline["name"], fused["name"]] == ["baseline", "lce_patch"]
    assert len(baseline["losses"]) == len(fused["losses"]) == 2
    assert fused["losses"] == pytest.approx(baseline["losses"], abs=1e-3)
    # every logged metric (DPO's rewards/logps/logits, GRPO's reward/kl/entropy, ...) agrees, not only the loss
    for theirs, ours in zip(baseline["step_logs"], fused["step_logs"], strict=True):
        assert theirs.keys() == ours.keys() and "loss" in ours
        for key in (k for k in theirs if not k.endswith(("_per_second", "runtime", "step_time"))):  # wall clock
            assert ours[key] == pytest.approx(theirs[key], rel=1e-3, abs=1e-4), key
    assert baseline["peak_bytes"] > 0 and fused["peak_bytes"] > 0
    assert all(t > 0 for t in baseline["step_tokens"] + fused["step_tokens"])


def test_shipped_data_matches_its_generator() -> None:
    """recipes/data/chat.jsonl is exactly what recipes/data/make_data.py writes."""
    done = subprocess.run(
        [sys.executable, str(RECIPES_DIR / "data" / "make_data.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_cpu_peak_memory_counts_live_tensors_only() -> None:
    """The CPU tracker sees fresh tensors until they are freed, and ignores views and in-place writes."""
    import torch
    from _measuring import MIB, LiveTensorBytes

    with LiveTensorBytes(baseline=MIB) as tracker:
        a = torch.ones(MIB // 4)  # 1 MiB of fp32
        a.view(2, -1).t().add_(1)  # views and in-place: nothing new
        assert tracker.current == 2 * MIB
        del a
        assert tracker.current == MIB
        b = torch.zeros(MIB // 2)  # 2 MiB
        c = b * 2  # 2 MiB more
    assert tracker.peak == 5 * MIB
    del b, c
    assert tracker.current == MIB


def _run_result(name: str, step_seconds: list[float], tokens: int = 1000):
    from _measuring import RunResult

    steps = len(step_seconds)
    return RunResult(name, [1.0] * steps, step_seconds, [tokens] * steps, None, "n/a")


def test_speed_is_reported_from_medians_not_means() -> None:
    """A few slow steps (a busy machine) make the fused run's mean step slower; the medians, which the
    table's change and the speed line report, say it is 30% faster. The first two steps (warm-up) are left out."""
    from _measuring import Spread, warmup_steps
    from _reporting import format_table

    assert [warmup_steps(n) for n in (1, 2, 9, 10, 60)] == [0, 1, 1, 2, 2]
    baseline = _run_result("baseline", [9.0, 9.0] + [1.0] * 18)
    fused = _run_result("lce_patch", [9.0, 9.0] + [0.7] * 15 + [6.0] * 3)
    assert sum(fused.step_seconds[2:]) > sum(baseline.step_seconds[2:])  # the mean says slower
    assert fused.step_time == Spread(median=0.7, p25=0.7, p75=0.7, min=0.7, max=6.0, count=18)
    assert baseline.tokens_per_second.median == pytest.approx(1000.0)
    assert fused.tokens_per_second.median == pytest.approx(1000 / 0.7)

    table = format_table(baseline, fused, "TRL head", metrics=())
    rows = {line.split("  ")[0]: line.split() for line in table.splitlines() if "median" in line.split("  ")[0]}
    assert rows["time per step (s), median"][-3:] == ["1.000", "0.700", "-30.0%"]
    assert rows["tokens/s, median"][-3:] == ["1,000", "1,429", "+42.9%"]
    assert "medians over steps 3-20 (warm-up left out)" in table
    assert "speed: lce_patch's median step is 30.0% faster than TRL head's, beyond both runs' step-to-step" in table
    assert "too noisy" not in table

    noisy = _run_result("lce_patch", [9.0, 9.0] + [0.9, 1.2] * 9)
    table = format_table(baseline, noisy, "TRL head", metrics=())
    assert "faster than TRL head's" not in table
    assert "speed: too noisy to call (the medians differ by +5.0%):" in table
    assert "  - the two runs' middle halves overlap" in table
    assert "Rerun on an idle machine" in table


def test_speed_verdict_calls_a_difference_only_beyond_the_runs_noise() -> None:
    """The verdict on two runs' step times: called when the medians differ by more than each run's middle half
    and neither run drifted; too noisy to call otherwise, with the reasons."""
    from _measuring import speed_verdict

    warmup = [3.0, 2.0]  # left out
    trl = warmup + [0.20, 0.21, 0.22] * 10
    ours = warmup + [0.15, 0.16, 0.155] * 10
    verdict = speed_verdict(trl, ours, "TRL head")
    assert verdict.call == "faster" and verdict.reasons == ()
    assert verdict.change == pytest.approx(0.155 / 0.21 - 1)
    assert speed_verdict(ours, trl).call == "slower"

    # A first run on a fresh machine: the baseline's first 22 steps at 3.3-5.2 s, then 0.2 s. Its median is
    # still about 0.2 s, 30% slower than the fused run's, but the spread says nothing can be told.
    first_run = [3.3 + 1.9 * (i % 5) / 4 for i in range(22)] + [0.20, 0.21, 0.22] * 12 + [0.20, 0.21]
    verdict = speed_verdict(first_run, ours, "TRL head")
    assert verdict.call == "too noisy to call"
    assert -0.35 < verdict.change < -0.2
    assert any(
        r.startswith("TRL head had not settled: its first 29 timed steps ran at a median") for r in verdict.reasons
    )
    assert any(
        r.startswith("TRL head's middle half (0.21-") and "wider than the difference" in r for r in verdict.reasons
    )
    assert not any(r.startswith("lce_patch") for r in verdict.reasons)

    # A spread wider than the difference, the middle halves overlapping
    verdict = speed_verdict(warmup + [1.0, 1.3] * 9, warmup + [0.9, 1.2] * 9)
    assert verdict.call == "too noisy to call"
    assert "the two runs' middle halves overlap" in verdict.reasons
    assert "lce_patch's middle half (0.9-1.2 s) is wider than the difference between the medians (0.1 s)" in (
        verdict.reasons
    )

    # A drift within the middle half's reach: slow second half (another process took the CPU)
    drifting = warmup + [0.15] * 10 + [0.5] * 10
    assert any("lce_patch had not settled" in r for r in speed_verdict(trl, drifting).reasons)

    # Too few steps to judge
    verdict = speed_verdict([1.0, 0.2], [1.0, 0.1])
    assert verdict.call == "too noisy to call" and verdict.change == pytest.approx(-0.5)
    assert verdict.reasons == (
        "baseline has 1 timed step, too few to judge its noise",
        "lce_patch has 1 timed step, too few to judge its noise",
    )
    assert speed_verdict([], []).call == "too noisy to call"


def test_compare_plot_shows_loss_speed_and_memory(tmp_path: Path) -> None:
    """The PNG has three panels: loss per step, time per step (with the medians), peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _reporting import plot_comparison

    baseline = _run_result("baseline", [5.0, 1.0, 1.1, 0.9, 1.0])
    fused = _run_result("lce_patch", [5.0, 0.8, 0.7, 0.9, 0.8])
    baseline.peak_bytes, fused.peak_bytes = 300 * 2**20, 150 * 2**20
    figures = []
    real_close = plt.close
    plt.close = figures.append  # keep the figure to look at it
    try:
        plot_comparison(baseline, fused, "TRL head", "title", tmp_path / "compare.png")
    finally:
        plt.close = real_close
    (figure,) = figures
    titles = [ax.get_title() for ax in figure.axes]
    assert titles[0] == "loss per step"
    assert titles[1] == "time per step (median change -20.0%)"
    assert titles[2].startswith("peak memory")
    labels = figure.axes[1].get_legend_handles_labels()[1]
    assert labels == ["TRL head: median 1 s", "lce_patch: median 0.8 s", "warm-up (left out)"]
    real_close(figure)
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeated_warnings_show_once_and_only_inside_the_recipe() -> None:
    """warnings_once: a logged warning (transformers' logger) and a Python warning repeated from several places
    show once inside the block; outside it, nothing has changed."""
    import io
    import logging
    import warnings

    from _running import warnings_once
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("transformers.trainer")
    library_logger = logging.getLogger("transformers")  # its handler, as transformers sets it up, to a string
    stream, second_stream = io.StringIO(), io.StringIO()
    root_handler = logging.StreamHandler(stream)
    # a second handler (a log file, pytest's capture): a record passes through both, and the first of each
    # text must reach both, its repeats neither, each repeat counted once
    second_handler = logging.StreamHandler(second_stream)
    handlers_before, library_logger.handlers = library_logger.handlers, [root_handler, second_handler]
    filters_before = list(warnings.filters)
    try:
        with warnings_once() as repeats, warnings.catch_warnings(record=True) as caught:
            warnings.filters[:] = [f for f in warnings.filters if f[0] == "once"]  # pytest's own "always" aside
            for _ in range(3):
                logger.warning("a warning at every step")
                warnings.warn("a deprecated thing", FutureWarning, stacklevel=1)
                warnings.warn("a deprecated thing", FutureWarning, stacklevel=1)  # another line
            logger.warning("another warning")
        for text in (stream.getvalue(), second_stream.getvalue()):
            assert text.count("a warning at every step") == 1
            assert text.count("another warning") == 1
        assert repeats.dropped == 2  # run_recipe reports the number at the end
        assert [str(w.message) for w in caught] == ["a deprecated thing"]
        assert warnings.filters == filters_before
        assert not any(type(f).__name__ == "RepeatFilter" for f in root_handler.filters)
        logger.warning("a warning at every step")  # outside the block: shown again
        assert stream.getvalue().count("a warning at every step") == 2
    finally:
        library_logger.handlers = handlers_before
