"""ms-swift 4.6 under ``lce-patch run``: ``swift sft`` with its defaults (LoRA, and full) trains with the fused loss,
with the losses of the same run without it.

swift's defaults include ``use_logits_to_keep``: its trainer passes ``logits_to_keep`` (the span that holds every
label) with the labels cut to it, and the patched forward fuses that call too. swift runs from its own environment
(``.ci-deps/swift``: see frontend_helpers.py), on a tiny Llama written there and the recipes' conversations (swift's
own ``messages`` format), float32 on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integrations.frontend_helpers import (
    CHAT_DATA,
    assert_same_steps,
    assert_trained_fused,
    frontend_env,
    read_report,
    run,
    tiny_llama,
    training_steps,
)

pytestmark = pytest.mark.slow  # the real ms-swift, in its own environment

STEPS, BATCH, GRAD_ACCUM = 3, 2, 2


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> tuple[Path, Path]:
    """swift's environment and a folder with the tiny model and the dataset."""
    env = frontend_env("swift")
    workdir = tmp_path_factory.mktemp("swift")
    tiny_llama(env, workdir / "model")
    lines = CHAT_DATA.read_text(encoding="utf-8").splitlines(keepends=True)[:64]
    (workdir / "chat.jsonl").write_text("".join(lines))
    return env, workdir


def sft(env: Path, workdir: Path, name: str, options: list[str], launched: bool):
    """``swift sft``, plain or under the launcher: its logged steps, its output's lines that name lce_patch, and the
    launcher's report (empty for a plain run)."""
    output_dir = workdir / "out" / name
    command = [
        "swift",
        "sft",
        "--model",
        str(workdir / "model"),
        "--model_type",  # a Llama config matches several of swift's model types: say which
        "llama",
        "--template",  # swift's plain template (no chat template of a model family)
        "default",
        "--dataset",
        str(workdir / "chat.jsonl"),
        "--max_length",
        "256",  # every conversation whole (swift drops longer ones)
        "--check_model",  # no look-up of the model on ModelScope's hub (offline)
        "false",
        "--torch_dtype",
        "float32",
        "--max_steps",
        str(STEPS),
        "--per_device_train_batch_size",
        str(BATCH),
        "--gradient_accumulation_steps",
        str(GRAD_ACCUM),
        "--learning_rate",
        "1e-3",
        "--lr_scheduler_type",
        "constant",
        "--warmup_ratio",
        "0",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--seed",
        "0",
        "--dataset_num_proc",
        "1",
        "--output_dir",
        str(output_dir),
        "--add_version",  # the output where it is asked for, not in a dated folder under it
        "false",
        *options,
    ]
    report = workdir / f"{name}.report.jsonl" if launched else None
    result = run(env, command, cwd=workdir, report=report)
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if "lce_patch" in line]
    # swift writes its training summary, the log history with it, as the last line of logging.jsonl
    summary = json.loads((output_dir / "logging.jsonl").read_text().splitlines()[-1])
    return training_steps(summary["log_history"]), lines, read_report(report) if launched else [], output


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_sft_trains_fused_with_the_losses_of_the_plain_run(workdir, mode):
    env, workdir = workdir
    options = ["--tuner_type", "full"] if mode == "full" else []  # LoRA is swift's default
    plain, plain_lines, _, plain_output = sft(env, workdir, f"{mode}_plain", options, launched=False)
    fused, lines, records, _ = sft(env, workdir, f"{mode}_fused", options, launched=True)
    assert not plain_lines  # no lce_patch without the launcher
    assert "use_logits_to_keep: True" in plain_output  # swift's default, the case the patched forward must fuse
    assert_trained_fused(records)
    [trainer] = records[0]["trainers"]
    assert trainer["trainer"] == "Seq2SeqTrainer" and trainer["model"] == "LlamaForCausalLM"
    assert [line for line in lines if trainer["line"] in line] == lines and len(lines) == 1, lines  # said once
    # every micro-batch of every step went through the fused op
    assert records[0]["op_calls"]["fused_linear_cross_entropy"] >= STEPS * GRAD_ACCUM
    assert_same_steps(fused, plain, STEPS)
