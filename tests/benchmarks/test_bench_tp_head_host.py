"""Smoke test of benchmarks/bench_tp_head_host.py: CPU processes over gloo, tiny shapes, fp32 (its --help is in
tests/test_script_help.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_runs_on_cpu_processes(tmp_path, processes):
    from tests.multiprocess import torchrun_args

    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)}
    env.pop("TRITON_INTERPRET", None)  # CPU runs take the torch backend, as a user's would
    launch = torchrun_args(processes)
    args = ["bench_tp_head_host.py", "--cpu", "--shapes", "gemma2-2b", "--tokens", "48", "--warmup", "1"]
    result = subprocess.run(
        [sys.executable, *launch, *args, "--steps", "2", "--out", str(tmp_path)],
        cwd=BENCHMARKS, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads((tmp_path / f"bench_tp_head_host_w{processes}.json").read_text())
    variants = report["rows"][0]["variants"]
    expected = {"unpatched", "patched", "patched_all_rows", "patched_local"} | (
        {"one_gpu_op"} if processes == 1 else set()
    )
    assert set(variants) == expected
    assert all(v["host_fwd"] > 0 and v["wall"] >= v["host_fwd"] for v in variants.values())
    assert report["rows"][0]["shard_rows"] == (120 if processes == 1 else 240)
    assert "| gemma2-2b | 48 | patched |" in result.stdout
