"""benchmarks/checks/distill_multi_gpu_check.py: its options, and TRL's DistillationTrainer served by lce_patch under
DeepSpeed ZeRO-3 on two CPU processes (gloo, DeepSpeed's CPU accelerator) against one process, served and unserved.

FSDP2 under accelerate runs on accelerators only: that launch is the GPU's (docs/distributed.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess import accelerate_launch_args, rerun_on_native_abort

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "checks" / "distill_multi_gpu_check.py"
# DeepSpeed installed apart from the test environment (.ci/run puts it here): only the launched check imports it.
DEEPSPEED_SITE = Path(os.environ.get("LCE_TEST_DEEPSPEED_SITE", REPO / ".ci-deps" / "deepspeed"))


@pytest.mark.slow
@pytest.mark.skipif(
    not (DEEPSPEED_SITE / "deepspeed").is_dir(),
    reason=f"DeepSpeed not installed in {DEEPSPEED_SITE} (.ci/run installs it there)",
)
def test_zero3_on_cpu_equals_one_process(tmp_path):
    # Both heads whole inside every op call on both ranks (the trainer's ZeRO-3 engines partition them), the same
    # greedy completions, losses and student parameters as TRL's own trainer and the served one in one process.
    config = REPO / "recipes" / "accelerate" / "zero3.yaml"
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{DEEPSPEED_SITE}",
        "DS_ACCELERATOR": "cpu",
        "OUT": str(tmp_path),
    }
    env.pop("TRITON_INTERPRET", None)  # CPU runs take the torch backend, as a user's would
    command = [sys.executable, *accelerate_launch_args(config), str(SCRIPT)]
    command += ["--vocab", "256", "--hidden", "32"]
    result = rerun_on_native_abort(
        lambda: subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "PASS distill_multi_gpu_check ZeRO-3 world_size=2" in result.stdout
    assert "FAIL" not in result.stdout
    report = json.loads((tmp_path / "distill_multi_gpu_check_zero-3_2.json").read_text())
    for rank in report["ranks"]:
        assert [(c["student"]["local_shape"], c["teacher"]["local_shape"]) for c in rank["calls"]] == [
            ([256, 32], [256, 48])
        ] * 3
    # the ranks held different numbers of loss tokens at some step
    assert any(len({rank["valid_tokens"][s] for rank in report["ranks"]}) > 1 for s in range(3))
