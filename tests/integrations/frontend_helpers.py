"""Shared pieces of the tests that launch a real front end (LLaMA-Factory, ms-swift) under ``lce-patch run``.

Each front end pins its own transformers, TRL, PEFT, datasets and accelerate, so each lives in a virtual environment
of its own: ``.ci/run`` builds them in ``.ci-deps/<name>`` (``.ci/frontend_env.sh``); ``LCE_PATCH_<NAME>_ENV`` names
another. A test runs the front end's own command line in that environment, once as it is and once under
``python -m lce_patch run --report R --`` (the ``lce-patch`` command), on a tiny Llama written by
``frontend_model.py`` and local data; this checkout's lce_patch is found through ``PYTHONPATH``, as an installed one
would be. Nothing is downloaded: the hub libraries are switched offline.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHAT_DATA = REPO / "recipes" / "data" / "chat.jsonl"  # {"messages": [{"role", "content"}, ...]} per line

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "WANDB_DISABLED": "true",
    "CUDA_VISIBLE_DEVICES": "",  # the CPU, whatever the machine has
    "TOKENIZERS_PARALLELISM": "false",
}


def frontend_env(name: str) -> Path:
    """The virtual environment of front end ``name`` (``.ci-deps/<name>``, or ``LCE_PATCH_<NAME>_ENV``); the test is
    skipped without one, and fails in CI, which builds it."""
    variable = f"LCE_PATCH_{name.upper()}_ENV"
    env = Path(os.environ.get(variable) or REPO / ".ci-deps" / name)
    if (env / "bin" / "python").exists():
        return env
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the {name} tests: .ci/run builds .ci-deps/{name}")
    pytest.skip(
        f"no {name} environment: `bash .ci/frontend_env.sh {name}` builds .ci-deps/{name} ({variable} names another)"
    )


def run(
    env: Path,
    command: list[str],
    cwd: Path,
    report: Path | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """``command`` (a program of ``env``'s, found first on ``PATH``) in ``env``, offline, on the CPU; under
    ``lce-patch run --report report --`` when ``report`` is given. Fails the test where the command fails."""
    environ = {key: value for key, value in os.environ.items() if not key.startswith(("LCE_PATCH_", "VIRTUAL_ENV"))}
    environ.update(OFFLINE)
    environ["PATH"] = os.pathsep.join([str(env / "bin"), environ.get("PATH", "")])
    environ["PYTHONPATH"] = str(REPO)
    environ.update(extra_env or {})
    if report is not None:
        command = [str(env / "bin" / "python"), "-m", "lce_patch", "run", "--report", str(report), "--", *command]
    result = subprocess.run(command, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def tiny_llama(env: Path, path: Path) -> Path:
    """A tiny Llama and its tokenizer written to ``path`` by ``env``'s transformers (``frontend_model.py``)."""
    run(env, ["python", str(Path(__file__).with_name("frontend_model.py")), str(path)], cwd=path.parent)
    return path


def read_report(path: Path) -> list[dict]:
    """The launcher's report: one record per process that built a Trainer."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def training_steps(log_history: list[dict]) -> list[dict]:
    """The per-step training logs (loss, grad_norm) of a Trainer's ``state.log_history``, as a front end saved it."""
    return [entry for entry in log_history if "loss" in entry]


def assert_trained_fused(records: list[dict], processes: int = 1) -> None:
    """The report says that each of ``processes`` processes trained one model with the fused loss, and counted it."""
    assert len(records) == processes, records
    for record in records:
        [trainer] = record["trainers"]
        assert trainer["fused"] is True, trainer
        assert trainer["callback"] == "launcher", trainer
        assert "with the fused loss" in trainer["line"], trainer
        assert record["op_calls"].get("fused_linear_cross_entropy", 0) > 0, record


def assert_same_steps(fused: list[dict], plain: list[dict], steps: int) -> None:
    """Losses and gradient norms per step of a launched run equal to those of the plain run.

    Both runs are float32 on the CPU from the same weights and data order. The fused op sums the cross-entropy a
    chunk of the vocabulary at a time, in another order than the full logits' cross-entropy, so a step's loss and
    gradient may differ in the last bits of float32 (seen: 1.4e-7 relative); a few optimizer steps carry that on
    without growing it past 1e-6. rel=1e-5 is 100 times that, and far below what one step changes the loss by (a
    relative 5e-3 here): a token scored twice or left out, or a wrong gradient (seen in the next step's loss and in
    the gradient norm), fails it."""
    assert len(fused) == len(plain) == steps, (fused, plain)
    assert [step["loss"] for step in fused] == pytest.approx([step["loss"] for step in plain], rel=1e-5)
    assert [step["grad_norm"] for step in fused] == pytest.approx([step["grad_norm"] for step in plain], rel=1e-5)
    assert plain[0]["loss"] != plain[-1]["loss"]  # it trained
