"""benchmarks/multi_gpu_train.py: its options, and its CPU smoke mode under torchrun (two gloo processes, a tiny
model of the real architecture): every method that can run here trains, the fused losses equal the unpatched one,
the largest-micro-batch search agrees across ranks on an out-of-memory error, tensor parallelism runs through
transformers' DistributedConfig.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "multi_gpu_train.py"


def _load():
    spec = importlib.util.spec_from_file_location("multi_gpu_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(tmp_path: Path, *args: str, timeout: int = 600, status: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # CPU runs take the torch backend, as a user's would
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
    result = subprocess.run(
        [*command, "--cpu", "--warmup", "1", "--steps", "2", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert (result.returncode == 0) == (status == 0), (result.stdout[-3000:], result.stderr[-5000:])
    if status == 0:
        assert "| method |" in result.stdout  # rank 0's table
    (path,) = tmp_path.glob("multi_gpu_train_*.json")
    return json.loads(path.read_text())


def _close(a: list[float], b: list[float], rtol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))


def test_options():
    module = _load()
    args = module.parse_args(["--methods", "all", "--cpu"])
    assert args.methods == list(module.METHODS)
    assert args.seq_len == 64  # the GPU default is replaced in the smoke mode
    with pytest.raises(SystemExit):
        module.parse_args(["--methods", "unpatched,liger"])
    with pytest.raises(SystemExit):
        module.parse_args(["--layers", "0"])
    with pytest.raises(SystemExit):  # one step of it would be one variant's
        module.parse_args(["--max-batch", "4", "--max-batch-methods", "lce_patch_interleaved"])
    with pytest.raises(SystemExit):  # the profiled step is the last warm-up one, never a timed one
        module.parse_args(["--profile", "profiles", "--warmup", "1"])
    # Every model's config builds, cut to --layers, with the real vocabulary and softcap.
    config = module.model_config(module.parse_args(["--model", "gemma-2-9b", "--layers", "2"]))
    assert (config.num_hidden_layers, config.vocab_size, config.final_logit_softcapping) == (2, 256000, 30.0)
    config = module.model_config(module.parse_args(["--model", "qwen2.5-7b", "--seq-len", "32768"]))
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (3584, 28, 152064)


def test_rows_mask_about_half():
    module = _load()
    args = module.parse_args(["--seq-len", "1000"])
    rows = module.make_rows(args, 8, 100)
    ignore = sys.modules["train_models"].IGNORE  # the models and data of the benchmark, imported by it
    masked = [sum(label == ignore for label in row["labels"]) / 1000 for row in rows]
    assert all(0.44 <= m <= 0.56 for m in masked), masked
    assert len({tuple(row["input_ids"]) for row in rows}) == 8


@pytest.mark.slow
def test_cpu_smoke_methods_and_search(tmp_path):
    report = _launch(
        tmp_path,
        "--methods",
        "unpatched,lce_patch,liger_all,trl_fused_head,compile",
        "--max-batch",
        "4",
        "--max-batch-methods",
        "lce_patch",
        "--simulate-oom-above",
        "2",
    )
    assert (report["engine"], report["world_size"], report["layers"]) == ("ddp", 2, 2)
    assert report["versions"]["torch"] and "date" in report and "git" in report
    methods = report["methods"]
    assert methods["unpatched"]["status"] == "ok"
    assert methods["lce_patch"]["status"] == "ok" and methods["lce_patch"]["lce_patch_active"]
    assert methods["liger_all"]["status"] == "skipped"  # Triton kernels: not on CPU processes
    assert methods["compile"]["status"] == "skipped"
    reference = methods["unpatched"]["losses"]
    assert len(reference) == 3
    assert _close(methods["lce_patch"]["losses"], reference)
    if methods["trl_fused_head"]["status"] != "skipped":  # TRL and datasets installed
        assert methods["trl_fused_head"]["status"] == "ok", methods["trl_fused_head"]
        assert _close(methods["trl_fused_head"]["losses"], reference)
    for method in ("unpatched", "lce_patch"):
        assert methods[method]["tokens_per_s_per_gpu"] > 0 and len(methods[method]["step_s"]) == 3
    # Batch 1 from the timed run, 2 trains, 4 runs out of memory on both ranks, 3 as well: 2 is the largest.
    search = report["max_batch"]["lce_patch"]
    assert search["max_micro_batch"] == 2
    assert [(a["batch"], a["ok"]) for a in search["attempts"]] == [(1, True), (2, True), (4, False), (3, False)]
    assert all(a["oom"] for a in search["attempts"] if not a["ok"])


@pytest.mark.slow
def test_cpu_smoke_tensor_parallel(tmp_path):
    methods = "unpatched,lce_patch,lce_patch_interleaved"
    profiles = tmp_path / "profiles"
    options = ["--tp", "2", "--model", "gemma-2-9b", "--methods", methods, "--warmup", "2", "--profile", str(profiles)]
    report = _launch(tmp_path, *options)
    assert (report["engine"], report["tp_size"], report["dp_size"]) == ("tp2", 2, 1)
    methods = report["methods"]
    assert methods["unpatched"]["status"] == "ok", methods["unpatched"]
    assert methods["lce_patch"]["status"] == "ok", methods["lce_patch"]
    assert methods["lce_patch"]["lce_patch_active"]
    assert _close(methods["lce_patch"]["losses"], methods["unpatched"]["losses"])
    # The interleaved method: one model and Trainer, 2 x (2 + 2) steps, the loss switched before each step
    interleaved = methods["lce_patch_interleaved"]
    assert interleaved["status"] == "ok", interleaved
    assert interleaved["switched_right"] and len(interleaved["step_s"]) == 8
    for variant in ("unpatched", "lce_patch"):
        numbers = interleaved["variants"][variant]
        assert numbers["timed_steps"] == 2 and numbers["tokens_per_s_per_gpu"] > 0
    low, high = interleaved["time_ratio_interval95"]
    assert low <= interleaved["time_ratio"] <= high
    # --profile: rank 0's last warm-up step per method (the interleaved method's last two, one per loss), each a
    # trace and an op table on disk and its summary in the JSON
    assert [(p["step"], p["loss"]) for p in methods["lce_patch"]["profile_rank0"]] == [(1, "lce_patch")]
    assert [(p["step"], p["loss"]) for p in methods["unpatched"]["profile_rank0"]] == [(1, "unpatched")]
    profiled = [(p["step"], p["loss"]) for p in interleaved["profile_rank0"]]
    assert profiled == [(2, "lce_patch"), (3, "unpatched")]  # steps A B B A: the third and fourth
    for summary in interleaved["profile_rank0"]:
        assert summary["host_ms"] > 0 and summary["cpu_ops"] > 0 and summary["syncs"] == 0
    assert len(list(profiles.glob("*.json.gz"))) == 4 and len(list(profiles.glob("*.txt"))) == 4


def test_interleaved_summary_splits_the_steps_by_variant():
    module = _load()
    variants = ["unpatched", "lce_patch", "lce_patch", "unpatched", "unpatched", "lce_patch", "lce_patch", "unpatched"]
    steps = [9.0, 9.0, 2.1, 1.0, 1.2, 2.5, 2.2, 1.1]
    switch = [0.0, 0.5, 0.0, 0.5, 0.0, 0.5, 0.0, 0.5]  # taken out of the step it preceded
    out = module.interleaved_summary(steps, variants, switch, warmup=1, tokens_step=400, world=2)
    assert out["variants"]["unpatched"]["step_s"] == [0.5, 1.2, 0.6]
    assert out["variants"]["lce_patch"]["step_s"] == [2.1, 2.0, 2.2]
    assert out["variants"]["unpatched"]["tokens_per_s_per_gpu"] == round(200 / 0.6, 1)
    assert out["time_ratio"] == round(2.1 / 0.6, 4)
    low, high = out["time_ratio_interval95"]
    assert low <= out["time_ratio"] <= high and low > 1
    # too few steps after the warm-up: no numbers, no error
    assert module.interleaved_summary(steps[:2], variants[:2], switch[:2], 1, 400, 2)["variants"]["lce_patch"] == {
        "timed_steps": 0
    }


@pytest.mark.slow
def test_cpu_smoke_failure_on_one_rank_ends_the_run(tmp_path):
    # Rank 0 fails alone before its first step while rank 1 goes on into the gradient all-reduce: the
    # agreement times out, rank 0 records why, and the launch ends (no hang).
    report = _launch(
        tmp_path,
        "--methods",
        "unpatched,lce_patch",
        "--batch",
        "2",
        "--simulate-oom-above",
        "1",
        "--simulate-oom-rank",
        "0",
        "--sync-timeout-s",
        "10",
        timeout=300,
        status=1,
    )
    assert "did not agree" in report["aborted"]
    assert report["aborted_rank0_state"]["oom"]
    assert report["methods"] == {}  # nothing measured, nothing invented


@pytest.mark.slow
def test_cpu_smoke_out_of_memory_surfacing_as_an_nccl_error(tmp_path):
    # An out of memory that surfaces as an NCCL error on every rank is recorded as out of memory, with the error it
    # came as; the process group is not trusted after it, so the later methods are recorded as not started.
    report = _launch(
        tmp_path,
        "--methods",
        "unpatched,lce_patch",
        "--batch",
        "2",
        "--simulate-oom-above",
        "1",
        "--simulate-oom-as",
        "nccl",
        timeout=300,
        status=1,
    )
    first, second = report["methods"]["unpatched"], report["methods"]["lce_patch"]
    assert first["status"] == "oom" and first["oom_surfaced_as"].startswith("out of memory (surfaced as: NCCL Error 1")
    assert second["status"] == "skipped" and "run it in a launch of its own" in second["reason"]


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b", "gemma-2-9b", "llama-3.1-8b-lora"])
def test_build_initialises_every_buffer(name):
    # Built on the meta device and materialised with to_empty: every buffer (RoPE frequencies, Gemma's embedding
    # scale) must be computed again, the head tied where the config ties it, LoRA on the projections only.
    import torch
    from transformers import AutoModelForCausalLM

    module = _load()
    args = module.parse_args(["--cpu", "--model", name])
    model = module.build_model(args, torch.device("cpu"), module.Distribution(args, 1))
    reference = AutoModelForCausalLM.from_config(module.model_config(args), dtype=torch.float32)
    expected = dict(reference.named_buffers())
    buffers = {k.removeprefix("base_model.model."): b for k, b in model.named_buffers()}
    assert buffers.keys() == expected.keys()
    for key, buffer in buffers.items():
        torch.testing.assert_close(buffer, expected[key], msg=key)
    base = model.get_base_model() if name.endswith("-lora") else model
    tied = base.get_output_embeddings().weight is base.get_input_embeddings().weight
    assert tied == base.config.tie_word_embeddings
    assert all(torch.isfinite(p).all() for p in model.parameters())
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    if name.endswith("-lora"):
        assert trainable and all("lora_" in k for k in trainable)
        targets = set(sys.modules["train_models"].LORA_TARGETS)
        assert {k.split(".")[-4] for k in trainable} == targets  # <proj>.lora_A.default.weight
    else:
        assert len(trainable) == len(list(model.parameters()))


def test_memory_an_earlier_method_left_is_reported():
    # A method that starts with memory an earlier one left allocated (DeepSpeed's engine, seen under ZeRO-3) says so
    # in its record and its table row, whether it trained or ran out of memory
    module = _load()
    run = object.__new__(module.Run)
    run.args = module.parse_args(["--cpu", "--warmup", "1", "--steps", "2"])
    run.dp_size, run.world = 2, 2
    failed = [
        {"rank": 0, "error": "OutOfMemoryError: CUDA out of memory", "oom": True, "start_allocated_gib": 30.2},
        {"rank": 1, "error": "OutOfMemoryError: CUDA out of memory", "oom": True, "start_allocated_gib": 29.9},
    ]
    clean = {"trainer": "Trainer", "distributed_type": "DEEPSPEED", "compiled": False, "params": 1, "trainable": 1}
    clean |= {"build_s": 0.1, "train_s": 1.0, "step_s": [0.5, 0.5, 0.5], "losses": [1.0, 1.0]}
    trained = [{**clean, "rank": r, "start_allocated_gib": 0.01} for r in (0, 1)]
    assert run.summarize("unpatched", failed, 1)["left_by_earlier_gib"] == 30.2
    assert "left_by_earlier_gib" not in run.summarize("lce_patch", trained, 1)
    run.report = {
        "engine": "zero3",
        "world_size": 2,
        "device": "cpu",
        "model": "llama-3.1-8b",
        "layers": 2,
        "full_layers": 32,
        "seq_len": 64,
        "micro_batch": 1,
        "warmup_steps": 1,
        "timed_steps": 2,
        "git": "x",
        "date": "d",
        "max_batch": {},
        "versions": {"torch": "t", "transformers": "t", "trl": "t", "liger-kernel": "t", "deepspeed": "d"},
        "methods": {
            "lce_patch": run.summarize("lce_patch", trained, 1),
            "unpatched": run.summarize("unpatched", failed, 1),
        },
    }
    rows = [line for line in run.table().splitlines() if line.startswith("| unpatched") or line.startswith("| lce_")]
    assert "30.2 GiB an earlier method left" in rows[1] and "earlier method" not in rows[0]


def test_zero3_takes_one_method_per_launch(monkeypatch):
    module = _load()
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(SystemExit):
        module.parse_args(["--methods", "unpatched,lce_patch"])
    with pytest.raises(SystemExit):
        module.parse_args(["--methods", "lce_patch", "--max-batch", "8"])
    assert module.parse_args(["--methods", "lce_patch"]).methods == ["lce_patch"]
    assert module.parse_args(["--cpu", "--methods", "unpatched,lce_patch"]).methods == ["unpatched", "lce_patch"]
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert len(module.parse_args(["--methods", "unpatched,lce_patch"]).methods) == 2


def test_dropping_gradient_hooks_frees_the_model():
    # transformers' Trainer (5.24, a model loaded through DistributedConfig) hooks the replicated parameters with a
    # closure that holds the Trainer, and so the model: a cycle through autograd's C++ side that gc cannot free
    module = _load()

    class Holder:
        pass

    def build():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        holder = Holder()
        holder.model = model

        def average_gradient(param):
            holder.calls = getattr(holder, "calls", 0) + 1

        for param in model.parameters():
            param.register_post_accumulate_grad_hook(average_gradient)
        model(torch.randn(2, 4)).sum().backward()
        return weakref.ref(model)

    kept = build()
    gc.collect()
    assert kept() is not None  # the leak this guards against
    assert module.drop_gradient_hooks(kept()) == 4
    gc.collect()
    assert kept() is None
    assert module.drop_gradient_hooks(None) == 0
