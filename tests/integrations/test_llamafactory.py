"""LLaMA-Factory 0.9.5 under ``lce-patch run``: ``llamafactory-cli train cfg.yaml`` (SFT, full and LoRA, one process
and two torchrun processes on the CPU) trains with the fused loss, with the losses of the same run without it.

LLaMA-Factory runs from its own environment (``.ci-deps/llamafactory``: see frontend_helpers.py), on a tiny Llama
written there and the recipes' conversations in its ShareGPT format, float32 on the CPU.
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

pytestmark = pytest.mark.slow  # the real LLaMA-Factory, in its own environment

STEPS, BATCH, GRAD_ACCUM = 3, 2, 2
# how the recipes' conversations read as a LLaMA-Factory dataset (dataset_info.json)
DATASET_INFO = {
    "chat": {
        "file_name": "chat.jsonl",
        "formatting": "sharegpt",
        "columns": {"messages": "messages"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
    }
}
LORA = {"finetuning_type": "lora", "lora_target": "all", "lora_rank": 4}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> tuple[Path, Path]:
    """LLaMA-Factory's environment and a folder with the tiny model and the dataset."""
    env = frontend_env("llamafactory")
    workdir = tmp_path_factory.mktemp("llamafactory")
    tiny_llama(env, workdir / "model")
    data = workdir / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps(DATASET_INFO))
    (data / "chat.jsonl").write_text("".join(CHAT_DATA.read_text(encoding="utf-8").splitlines(keepends=True)[:64]))
    return env, workdir


def train(env: Path, workdir: Path, name: str, overrides: dict, launched: bool, extra_env=None):
    """``llamafactory-cli train NAME.yaml``, plain or under the launcher: its logged steps, its output's lines that
    name lce_patch, and the launcher's report (empty for a plain run)."""
    config = {
        "model_name_or_path": str(workdir / "model"),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": "chat",
        "dataset_dir": str(workdir / "data"),
        "template": "default",
        "cutoff_len": 128,
        "preprocessing_num_workers": 1,
        "dataloader_num_workers": 0,
        "output_dir": str(workdir / "out" / name),
        "overwrite_output_dir": True,
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "max_steps": STEPS,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 0,
        "bf16": False,
        **overrides,
    }
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    report = workdir / f"{name}.report.jsonl" if launched else None
    result = run(env, ["llamafactory-cli", "train", str(path)], cwd=workdir, report=report, extra_env=extra_env)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "lce_patch" in line]
    state = json.loads((workdir / "out" / name / "trainer_state.json").read_text())  # LLaMA-Factory saves it
    return training_steps(state["log_history"]), lines, read_report(report) if launched else []


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_sft_trains_fused_with_the_losses_of_the_plain_run(workdir, mode):
    env, workdir = workdir
    overrides = LORA if mode == "lora" else {}
    plain, plain_lines, _ = train(env, workdir, f"{mode}_plain", overrides, launched=False)
    fused, lines, records = train(env, workdir, f"{mode}_fused", overrides, launched=True)
    assert not plain_lines  # no lce_patch without the launcher
    assert_trained_fused(records)
    [trainer] = records[0]["trainers"]
    assert [line for line in lines if trainer["line"] in line] == lines and len(lines) == 1, lines  # said once
    assert trainer["trainer"] == "CustomSeq2SeqTrainer" and trainer["model"] == "LlamaForCausalLM"
    assert ("in PeftModelForCausalLM" in trainer["line"]) == (mode == "lora")
    # every micro-batch of every step went through the fused op
    assert records[0]["op_calls"]["fused_linear_cross_entropy"] >= STEPS * GRAD_ACCUM
    assert_same_steps(fused, plain, STEPS)


def test_torchrun_processes_each_train_fused(workdir):
    # llamafactory-cli starts torchrun itself (FORCE_TORCHRUN), which starts two processes over gloo
    env, workdir = workdir
    torchrun = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}
    plain, _, _ = train(env, workdir, "ddp_plain", {}, launched=False, extra_env=torchrun)
    fused, lines, records = train(env, workdir, "ddp_fused", {}, launched=True, extra_env=torchrun)
    assert len(lines) == 1, lines  # said by the main process only
    assert_trained_fused(records, processes=2)
    assert len({record["pid"] for record in records}) == 2
    for record in records:
        assert record["op_calls"]["fused_linear_cross_entropy"] >= STEPS * GRAD_ACCUM
    assert_same_steps(fused, plain, STEPS)
