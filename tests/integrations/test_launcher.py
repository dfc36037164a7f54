"""``lce-patch run``: a program that never mentions lce_patch trains with the fused loss, in its own process and in
the processes torchrun starts; the report and the line say what ran, counted; nothing is doubled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lce_patch.integrations.launch import SITE_DIR, launch_environment
from tests.multiprocess import torchrun_args

REPO = Path(__file__).resolve().parents[2]

# A user's Trainer script: a tiny Llama from a config, a few steps of SGD; prints its losses as JSON.
PROGRAM = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    own_callback = "--own-callback" in sys.argv
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(8):
        ids = torch.randint(0, 96, (16,), generator=generator)
        labels = ids.clone()
        labels[: i % 5] = -100
        rows.append(dict(input_ids=ids, attention_mask=torch.ones(16, dtype=torch.long), labels=labels))
    args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=2, max_steps=3, optim="sgd",
                             learning_rate=0.1, logging_steps=1, use_cpu=True, report_to=[], save_strategy="no",
                             seed=0, disable_tqdm=True)
    callbacks = []
    if own_callback:
        from lce_patch import FusedLCECallback
        callbacks.append(FusedLCECallback(chunk_size=8))
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks)
    trainer.train()
    if trainer.is_world_process_zero():
        print("LOSSES " + json.dumps([log["loss"] for log in trainer.state.log_history if "loss" in log]))
    """
)


def _run(tmp_path: Path, *command: str, launcher: list[str] | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LCE_PATCH_")}
    env["PYTHONPATH"] = str(REPO)  # this checkout's lce_patch, as an installed one would be found
    prefix = [sys.executable, "-m", "lce_patch", "run", *launcher, "--"] if launcher is not None else []
    result = subprocess.run([*prefix, *command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _losses(result: subprocess.CompletedProcess) -> list[float]:
    [line] = [line for line in result.stdout.splitlines() if line.startswith("LOSSES ")]
    return json.loads(line.removeprefix("LOSSES "))


def _report(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def program(tmp_path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(PROGRAM)
    return path


@pytest.mark.slow
def test_a_program_that_never_names_lce_patch_trains_fused(tmp_path, program):
    plain = _run(tmp_path, sys.executable, str(program), str(tmp_path / "plain"), launcher=None)
    report = tmp_path / "report.jsonl"
    fused = _run(
        tmp_path,
        sys.executable,
        str(program),
        str(tmp_path / "fused"),
        launcher=["--option", "chunk_size=8", "--report", str(report)],
    )
    assert _losses(fused) == pytest.approx(_losses(plain), rel=1e-5)  # fp32: the fused loss is exact to rounding
    [record] = _report(report)
    [trainer] = record["trainers"]
    assert trainer["fused"] is True and trainer["callback"] == "launcher"
    assert trainer["op_calls"] == {"fused_linear_cross_entropy": 1}  # the first step: one micro-batch
    assert record["op_calls"] == {"fused_linear_cross_entropy": 3}  # three steps
    assert "lce_patch: Trainer trains LlamaForCausalLM" in trainer["line"] and "chunk_size=8" in trainer["line"]
    assert fused.stderr.count("with the fused loss") == 1  # the one line, once
    assert "with the fused loss" not in plain.stderr

    # the program's own callback: kept, with its options, and not doubled
    report.unlink()
    own = _run(
        tmp_path,
        sys.executable,
        str(program),
        str(tmp_path / "own"),
        "--own-callback",
        launcher=["--report", str(report)],
    )
    [record] = _report(report)
    [trainer] = record["trainers"]
    assert trainer["callback"] == "program" and trainer["fused"] is True
    assert record["op_calls"] == {"fused_linear_cross_entropy": 3}  # once per step, not twice
    assert own.stderr.count("with the fused loss") == 1
    assert _losses(own) == pytest.approx(_losses(plain), rel=1e-5)


@pytest.mark.slow
def test_every_process_torchrun_starts_trains_fused(tmp_path, program):
    report = tmp_path / "report.jsonl"
    command = [sys.executable, *torchrun_args(2), str(program), str(tmp_path / "out")]
    plain = _run(tmp_path, *command, launcher=None)
    fused = _run(tmp_path, *command, launcher=["--report", str(report)])
    assert _losses(fused) == pytest.approx(_losses(plain), rel=1e-5)
    records = _report(report)
    assert len(records) == 2  # one per worker; torchrun's own process builds no Trainer
    for record in records:
        [trainer] = record["trainers"]
        assert trainer["fused"] is True and record["op_calls"] == {"fused_linear_cross_entropy": 3}
    assert fused.stderr.count("with the fused loss") == 1  # the main process says it


def test_the_launcher_environment_and_its_errors(tmp_path):
    env = launch_environment({"chunk_size": 8}, "r.jsonl", {"PYTHONPATH": "/elsewhere", "PATH": "/bin"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), "/elsewhere"]
    assert json.loads(env["LCE_PATCH_RUN_OPTIONS"]) == {"chunk_size": 8}
    assert Path(env["LCE_PATCH_REPORT"]).is_absolute()
    # nothing at import: a plain interpreter has no hook; only site/ on the path switches it on
    check = "import sys, lce_patch; print(any(type(f).__name__ == '_TrainerWatch' for f in sys.meta_path))"
    plain = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env={**os.environ,
                           "PYTHONPATH": str(REPO)}, check=True)  # fmt: skip
    assert plain.stdout.strip() == "False"
    launched = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True,
                              env={**env, "PATH": os.environ["PATH"], "PYTHONPATH": env["PYTHONPATH"] + os.pathsep + str(REPO)})  # fmt: skip
    assert launched.stdout.strip() == "True"
    # bad options and commands are refused before anything runs
    for argv, message in [
        (["run", "--option", "chunk_size=-3", "--", "true"], "chunk_size"),
        (["run", "--option", "no_such_option=1", "--", "true"], "no_such_option"),
        (["run", "--option", "chunk_size", "--", "true"], "NAME=VALUE"),
        (["run"], "needs a command"),
    ]:
        result = subprocess.run([sys.executable, "-m", "lce_patch", *argv], capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        assert result.returncode == 2 and message in result.stderr, (argv, result.stderr)
    result = subprocess.run([sys.executable, "-m", "lce_patch", "run", "--", "no-such-command-here"],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert result.returncode == 127 and "command not found" in result.stderr


def test_the_launchers_callback_is_added_once_and_gives_way_to_the_programs(tmp_path, monkeypatch):
    # In-process, on a Trainer subclass (the launcher wraps transformers.Trainer itself only in a launched process)
    from transformers import Trainer, TrainingArguments

    from lce_patch import FusedLCECallback
    from lce_patch.integrations.launch import OPTIONS_ENV, install
    from tests.models.tiny import VOCAB, tiny_model

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    rows = [dict(input_ids=ids, labels=ids) for ids in torch.randint(0, VOCAB, (4, 12), generator=generator)]

    monkeypatch.setenv(OPTIONS_ENV, '{"chunk_size": 8}')

    class Launched(Trainer):
        pass

    install(Launched, Trainer.__init__)

    def fused_callbacks(trainer):
        return [c for c in trainer.callback_handler.callbacks if isinstance(c, FusedLCECallback)]

    trainer = Launched(model=tiny_model("llama"), args=args, train_dataset=rows)
    [ours] = fused_callbacks(trainer)
    assert ours.options == {"chunk_size": 8}
    # one the program adds after construction takes its place, its options on the model
    theirs = FusedLCECallback(chunk_size=16)
    trainer.add_callback(theirs)
    assert fused_callbacks(trainer) == [theirs]
    assert trainer.model._lce_patch_options.chunk_size == 16
    trainer.train()
    [outcome] = theirs.outcomes
    assert outcome["fused"] and "chunk_size=16" in outcome["line"]
    # one given at construction is kept, not doubled
    given = FusedLCECallback()
    trainer = Launched(model=tiny_model("llama"), args=args, train_dataset=rows, callbacks=[given])
    assert fused_callbacks(trainer) == [given]
