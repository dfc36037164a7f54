"""The long-sequence scripts run: benchmarks/checks/cp_check.py (Ulysses through the Trainer on two CPU processes)
and benchmarks/long_context.py (its CPU smoke mode). Their real runs need GPUs (docs/long-context.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess import accelerate_launch_args, rerun_on_native_abort

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
REPO = BENCHMARKS.parent
# DeepSpeed apart from the test environment (.ci/run installs it there), as for the ZeRO checks
DEEPSPEED_SITE = Path(os.environ.get("LCE_TEST_DEEPSPEED_SITE", REPO / ".ci-deps" / "deepspeed"))


def _run(args: list[str], tmp_path: Path, timeout: int = 600, env_extra: dict[str, str] | None = None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(tmp_path), **(env_extra or {})}
    env.pop("TRITON_INTERPRET", None)  # CPU runs take the torch backend, as a user's would
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.skipif(
    not (DEEPSPEED_SITE / "deepspeed").is_dir(),
    reason=f"DeepSpeed not installed in {DEEPSPEED_SITE} (.ci/run installs it there)",
)
# gemma3 with one micro-batch per step: 3 rows for 2 ranks, the case where the loader would start over early
@pytest.mark.parametrize("arch,extra", [("llama", []), ("gemma3", ["--grad-accum", "1"]), ("llama", ["--unpatched"])])
def test_cp_check_ulysses_on_cpu(arch, extra, tmp_path):
    # Two processes over gloo with DeepSpeed's CPU accelerator, through the Trainer (+ FusedLCECallback): per-step
    # losses and updates equal one process on the whole sequences, every shifted label scored once across the two
    # slices, rank 0 holding no valid label at the second step.
    config = REPO / "recipes" / "accelerate" / "ulysses.yaml"
    args = [*accelerate_launch_args(config), "benchmarks/checks/cp_check.py"]
    args += ["--cpu", "--arch", arch, *extra]
    env_extra = {"PYTHONPATH": f"{REPO}{os.pathsep}{DEEPSPEED_SITE}", "DS_ACCELERATOR": "cpu"}
    result = rerun_on_native_abort(lambda: _run(args, tmp_path, env_extra=env_extra))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    label = "unpatched" if "--unpatched" in extra else "patched"
    assert f"PASS cp_check sp {arch} {label} world_size=2" in result.stdout
    assert "FAIL" not in result.stdout
    report = json.loads((tmp_path / f"cp_check_sp_{arch}_{label}_w2.json").read_text())
    assert report["ok"]


def test_long_context_cpu_smoke(tmp_path):
    # The search on a tiny model: doubling, then bisecting below a simulated memory limit, each trial's out of
    # memory caught; then tokens/s at the common length.
    args = ["benchmarks/long_context.py", "--cpu", "--setups", "unpatched,lce_patch", "--fake-memory-limit", "300"]
    result = _run([*args, "--out", str(tmp_path / "lc.json")], tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads((tmp_path / "lc.json").read_text())
    for setup in ("unpatched", "lce_patch"):
        found = report["results"]["tiny"][setup]
        assert found["longest"] == 256
        assert not found["trials"]["384"]["ok"] and found["trials"]["384"]["error"] == "out of memory"
        assert report["throughput"]["tiny"][setup]["tokens_per_s"] > 0


def test_long_context_lengths_and_a_shorter_common_length(tmp_path):
    # --lengths are tried in ascending order up to the first out of memory; when a setup fails the timed steps at
    # the longest common length (several steps, where the search's trial was one), all are timed one length shorter.
    args = ["benchmarks/long_context.py", "--cpu", "--setups", "unpatched,lce_patch", "--fake-memory-limit", "300"]
    args += ["--lengths", "512,128,384,256", "--fake-timed-memory-limit", "200", "--timed-steps", "1"]
    result = _run([*args, "--out", str(tmp_path / "lc.json")], tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads((tmp_path / "lc.json").read_text())
    for setup in ("unpatched", "lce_patch"):
        found = report["results"]["tiny"][setup]
        assert sorted(found["trials"], key=int) == ["128", "256", "384"]
        assert found["longest"] == 256 and not found["trials"]["384"]["ok"]
        row = report["throughput"]["tiny"][setup]
        assert row["length"] == 128 and row["ok"] and row["tokens_per_s"] > 0


@pytest.mark.slow
def test_long_context_isolated_records_a_device_error_as_out_of_memory(tmp_path):
    # An out of memory that surfaces as an NCCL error (simulated) ends its process; --isolate records that trial as
    # out of memory, goes on in a fresh process from the trials made, and times the longest length that fitted.
    args = ["benchmarks/long_context.py", "--cpu", "--isolate", "--setups", "lce_patch", "--lengths", "64,256"]
    args += ["--fake-device-error-above", "128", "--timed-steps", "1"]
    result = _run([*args, "--out", str(tmp_path / "lc.json")], tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads((tmp_path / "lc.json").read_text())
    found = report["results"]["tiny"]["lce_patch"]
    assert found["longest"] == 64 and found["trials"]["64"]["ok"]
    failed = found["trials"]["256"]
    assert not failed["ok"] and failed["error"].startswith("out of memory (surfaced as: NCCL Error 1")
    assert [launch["rc"] for launch in report["launches"]] == [75, 0, 0]  # died, resumed, timed
    assert report["throughput"]["tiny"]["lce_patch"]["length"] == 64
