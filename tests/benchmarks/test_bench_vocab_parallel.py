"""Smoke test of benchmarks/bench_vocab_parallel.py: two CPU processes over gloo, tiny shapes, fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_runs_on_two_cpu_processes(tmp_path):
    from tests.multiprocess import torchrun_args

    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)}
    env.pop("TRITON_INTERPRET", None)  # CPU runs take the torch backend, as a user's would
    launch = torchrun_args(2)
    args = ["bench_vocab_parallel.py", "--cpu", "--shapes", "gemma2-2b", "--tokens", "48", "--warmup", "1"]
    result = subprocess.run(
        [sys.executable, *launch, *args, "--steps", "2", "--out", str(tmp_path)],
        cwd=BENCHMARKS, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "| gemma2-2b | 48 | 2 |" in result.stdout
    report = json.loads((tmp_path / "bench_vocab_parallel_w2.json").read_text())
    rows = report["ranks"][0]
    assert len(report["ranks"]) == 2 and rows[0]["shard_rows"] == 251 and rows[0]["efficiency"] > 0
