"""Every script in benchmarks/ and recipes/ answers ``--help``: found by its ``__main__`` block, so a new script is
covered without a list to keep. Their real runs are tested beside them (tests/benchmarks/, tests/recipes/)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("benchmarks", "recipes")
_MAIN = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.MULTILINE)

# The options a recipe's help lists (the recipes' README promises them)
RECIPE_OPTIONS = (
    "--model",
    "--dataset",
    "--max-steps",
    "--seq-len",
    "--batch-size",
    "--grad-accum",
    "--lr",
    "--bf16",
    "--output-dir",
    "--compare",
    "--lora",
)
# What a script's help lists besides its usage line
PROMISED = {
    "benchmarks/multi_gpu_train.py": ("--max-batch",),
    "benchmarks/checks/distill_multi_gpu_check.py": ("--stop-every",),
}


def _scripts() -> list[str]:
    return sorted(
        path.relative_to(REPO).as_posix()
        for folder in FOLDERS
        for path in (REPO / folder).rglob("*.py")
        if _MAIN.search(path.read_text(encoding="utf-8"))
    )


def _promised(script: str) -> tuple[str, ...]:
    if script.startswith("recipes/") and script.count("/") == 1:
        return RECIPE_OPTIONS
    return PROMISED.get(script, ())


SCRIPTS = _scripts()


def test_the_scripts_are_found():
    assert len(SCRIPTS) > 30
    assert "benchmarks/bench_lce.py" in SCRIPTS and "recipes/sft.py" in SCRIPTS
    assert set(PROMISED) <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    folder = REPO / script.split("/")[0]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)  # CPU runs take the torch backend, as a user's would
    result = subprocess.run(
        [sys.executable, str(REPO / script), "--help"], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
    missing = [option for option in _promised(script) if option not in result.stdout]
    assert not missing, f"{script} --help does not list {missing}"
