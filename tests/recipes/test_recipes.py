"""The recipes' embedded defaults run end to end on the CPU, offline, in a few seconds each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import RECIPES_DIR

# Small enough for CI: a handful of short sequences, two optimizer steps.
TINY = ["--max-steps", "2", "--max-examples", "24", "--batch-size", "4", "--seq-len", "128"]
RECIPES = ["sft", "train", "dpo", "grpo"]


def _main(recipe: str):
    module = __import__(recipe)
    return module.main


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_is_instant_and_complete(recipe: str) -> None:
    """``python recipes/<name>.py --help`` exits 0 and lists the options the README promises."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(RECIPES_DIR / f"{recipe}.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    for option in ("--model", "--dataset", "--max-steps", "--seq-len", "--batch-size", "--grad-accum", "--lr"):
        assert option in done.stdout
    for option in ("--bf16", "--output-dir", "--compare", "--lora"):
        assert option in done.stdout


@pytest.mark.parametrize("recipe", RECIPES)
def test_embedded_default_trains_and_saves(recipe: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """No --model, no --dataset: the embedded model trains a couple of steps with the fused loss and is saved."""
    assert _main(recipe)([*TINY, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "embedded Llama" in out and "loss" in out
    assert (tmp_path / "config.json").is_file()
    assert (tmp_path / "tokenizer.json").is_file()


@pytest.mark.parametrize("recipe", RECIPES)
def test_compare_prints_the_table_and_writes_the_plot(
    recipe: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--compare: two runs of the same steps; the table, the PNG and the JSON; equal losses."""
    assert _main(recipe)([*TINY, "--compare", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row in ("step", "peak memory (MiB)", "time per step (s)", "tokens/s", "final loss", "lce_patch"):
        assert row in out

    png = tmp_path / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "compare.json").read_text())
    baseline, fused = record["runs"]
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
    from _common import MIB, LiveTensorBytes

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
