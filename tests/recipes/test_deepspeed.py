"""The shipped DeepSpeed configs take gradient accumulation and the micro-batch size from the Trainer.

``accelerate launch --config_file recipes/accelerate/zero{2,3}.yaml --num_processes 1 recipes/train.py
--grad-accum 2`` on the CPU (gloo, DeepSpeed's CPU accelerator): DeepSpeed's engine accumulates the two
micro-batches the Trainer asks for, and the losses equal a run without DeepSpeed. DeepSpeed is installed
apart from the test environment (.ci/run puts it in .ci-deps/deepspeed): importing it changes what
transformers and accelerate do elsewhere, so only the launched process gets it on its path.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import RECIPES_DIR

pytestmark = pytest.mark.slow  # DeepSpeed launches

REPO = RECIPES_DIR.parent
DEEPSPEED_SITE = Path(os.environ.get("LCE_TEST_DEEPSPEED_SITE", REPO / ".ci-deps" / "deepspeed"))
# test_recipes.TINY with two micro-batches of 4 per optimizer step.
ARGS = ["--max-steps", "2", "--max-examples", "24", "--batch-size", "4", "--seq-len", "128", "--grad-accum", "2"]
LOSSES = re.compile(r"^loss (\S+) -> (\S+) in 2 steps", re.MULTILINE)


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory: pytest.TempPathFactory) -> tuple[float, float]:
    """First and last loss of the same run without DeepSpeed (in this process: no second start-up)."""
    import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert train.main([*ARGS, "--output-dir", str(tmp_path_factory.mktemp("plain"))]) == 0
    first, last = LOSSES.search(out.getvalue()).groups()
    return float(first), float(last)


@pytest.mark.skipif(
    not (DEEPSPEED_SITE / "deepspeed").is_dir(),
    reason=f"DeepSpeed not installed in {DEEPSPEED_SITE} (.ci/run installs it there)",
)
@pytest.mark.parametrize("stage", [2, 3])
def test_train_grad_accum_under_zero_config_on_cpu(
    stage: int, tmp_path: Path, reference_losses: tuple[float, float]
) -> None:
    from tests.multiprocess import accelerate_launch_args

    config = RECIPES_DIR / "accelerate" / f"zero{stage}.yaml"
    launch = [*accelerate_launch_args(config), "--num_processes", "1"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(DEEPSPEED_SITE)]),
        "DS_ACCELERATOR": "cpu",  # DeepSpeed's CPU accelerator and gloo; the configs themselves are the GPU users'
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, *launch, str(RECIPES_DIR / "train.py"), *ARGS, "--output-dir", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "mismatch TrainingArguments values" not in output
    expected = f"DeepSpeed ZeRO-{stage}: micro-batch 4 x gradient accumulation 2 x 1 processes = 8 sequences"
    assert expected in done.stdout, output[-4000:]
    first, last = (float(x) for x in LOSSES.search(done.stdout).groups())
    assert (first, last) == pytest.approx(reference_losses, abs=2e-4)
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()
