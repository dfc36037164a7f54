"""The benchmark and check scripts run (benchmarks/, benchmarks/checks/): those with a CPU mode run a tiny case (every
script's --help is in tests/test_script_help.py).

Their real runs need a GPU (see benchmarks/RESULTS.md); this keeps them from rotting between runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess import accelerate_launch_args, rerun_on_native_abort

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# DeepSpeed for the ZeRO checks on CPU, installed apart from the test environment (.ci/run puts it here):
# importing it changes what transformers and accelerate do elsewhere, so only the launched check sees it.
DEEPSPEED_SITE = Path(os.environ.get("LCE_TEST_DEEPSPEED_SITE", BENCHMARKS.parent / ".ci-deps" / "deepspeed"))


def _run(
    args: list[str], tmp_path: Path, timeout: int = 300, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS.parent), "OUT": str(tmp_path), **(env_extra or {})}
    env.pop("TRITON_INTERPRET", None)  # CPU runs take the torch backend, as a user's would
    return subprocess.run(
        [sys.executable, *args], cwd=BENCHMARKS, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_multi_gpu_check_single_process(tmp_path):
    # One process: patched vs unpatched on the whole batch, the same checks the 2-GPU run makes.
    result = _run(["checks/multi_gpu_check.py", "--steps", "2", "--out", str(tmp_path)], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "FAIL" not in result.stdout
    assert list(tmp_path.glob("multi_gpu_check_*.json"))


@pytest.mark.slow
def test_multi_gpu_check_fsdp2_compiled_on_cpu(tmp_path):
    # A compiled patched model under FSDP2 (accelerate's fully_shard, forced onto gloo): losses, parameters and
    # updates equal to one process, the whole head inside lm_head's call; aot_eager (no C++ compiler needed).
    config = BENCHMARKS.parent / "recipes" / "accelerate" / "fsdp2.yaml"
    args = [*accelerate_launch_args(config), "checks/multi_gpu_check.py"]
    args += ["--cpu-fsdp", "--compile", "aot_eager", "--steps", "2", "--seq-len", "32", "--hidden", "64"]
    result = _run([*args, "--vocab", "512"], tmp_path, env_extra={"ACCELERATE_USE_CPU": "true"})
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "PASS multi_gpu_check llama FSDP2 world_size=2 compile=aot_eager" in result.stdout
    assert "PASS rank1 compiled" in result.stdout and "FAIL" not in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    not (DEEPSPEED_SITE / "deepspeed").is_dir(),
    reason=f"DeepSpeed not installed in {DEEPSPEED_SITE} (.ci/run installs it there)",
)
@pytest.mark.parametrize("stage,arch", [(2, "gemma2"), (3, "llama"), (3, "gemma2")])
def test_multi_gpu_check_deepspeed_zero_on_cpu(stage, arch, tmp_path):
    # Two processes over gloo with DeepSpeed's CPU accelerator: losses, parameters and updates equal to one
    # process, the head weight whole inside lm_head's call, a rank with no valid label at step 2.
    config = BENCHMARKS.parent / "recipes" / "accelerate" / f"zero{stage}.yaml"
    args = [*accelerate_launch_args(config), "checks/multi_gpu_check.py"]
    args += ["--arch", arch, "--steps", "3", "--seq-len", "32", "--hidden", "64", "--vocab", "512"]
    env_extra = {"PYTHONPATH": f"{BENCHMARKS.parent}{os.pathsep}{DEEPSPEED_SITE}", "DS_ACCELERATOR": "cpu"}
    result = rerun_on_native_abort(lambda: _run(args, tmp_path, env_extra=env_extra))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert f"PASS multi_gpu_check {arch} ZeRO-{stage} world_size=2" in result.stdout
    assert "FAIL" not in result.stdout


# (part, arch, processes, extra arguments, the layout in the PASS line and the JSON's name)
TP_CHECK_CASES = [
    ("op", "gemma2", 2, [], ""),
    ("model", "llama", 2, ["--api", "tp_plan", "--profile"], "tp2_tpplan"),  # the older spelling, tp_plan="auto"
    ("model", "gemma2", 2, ["--tokens", "128", "256"], "tp2_fsdp1"),  # DistributedConfig(tp_size=2), two counts
    # torch.compile of the sharded model (aot_eager on CPU); without checkpointing, which torch 2.13's AOT
    # autograd refuses on DTensor weights under compile (it saves the DeviceMesh among the tensors)
    ("model", "llama", 2, ["--compile", "--no-checkpointing"], "tp2_fsdp1"),
    # HSDP, DistributedConfig(fsdp_size=2, dp_replicate_size=2): two replicas of a two-way FSDP2 group
    ("model", "llama", 4, ["--fsdp-size", "2", "--replicate-size", "2"], "tp1_fsdp2_replicate2"),
]
# DistributedConfig(fsdp_size=2) and (tp_size=2, fsdp_size=2) run the same loading and step; their values against
# one process are tests/models/test_distributed_config.py's, so the script is launched with them on the GPU only.


def _bench_common():
    """benchmarks/bench_common.py, loaded from its file (benchmarks/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_common", BENCHMARKS / "bench_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tp_check_ratio_interval_is_a_paired_bootstrap():
    # The interval of median(patched) / median(unpatched): it holds the ratio of the medians, tightens with the
    # steps, excludes 1 for a clear difference and holds it for a tie of noisy steps; deterministic.
    import random

    ratio_interval = _bench_common().ratio_interval  # what tp_check and multi_gpu_train report
    noise = random.Random(1)
    base = [100.0 * (1 + 0.2 * noise.random()) for _ in range(100)]
    slower = [t * 1.1 for t in base]
    low, high = ratio_interval(base, slower)
    assert abs(low - 1.1) < 1e-9 and abs(high - 1.1) < 1e-9  # paired: the same steps, 10% slower each
    tie = [100.0 * (1 + 0.2 * noise.random()) for _ in range(100)]
    low, high = ratio_interval(base, tie)
    assert low < 1.0 < high and high - low < 0.15
    assert ratio_interval(base, tie) == (low, high)
    few = ratio_interval(base[:10], tie[:10])
    assert few[1] - few[0] > high - low


def test_tp_check_step_work_reads_a_trace():
    # The profiled step's summary: the host's span over the operators, launches and synchronisations inside it
    # (not the profiler's own after it), the kernels' time summed.
    step_work = _bench_common().step_work  # what tp_check's --profile reports

    def event(cat: str, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {
        "traceEvents": [
            event("cpu_op", "aten::mm", 1000.0, 500.0),
            event("cpu_op", "aten::add", 3000.0, 1000.0),  # the host span: 1000 to 4000 us
            event("cuda_runtime", "cudaLaunchKernel", 1100.0, 5.0),
            event("cuda_driver", "cuLaunchKernelEx", 3100.0, 5.0),
            event("cuda_runtime", "cudaEventSynchronize", 2000.0, 10.0),
            event("cuda_runtime", "cudaDeviceSynchronize", 4500.0, 10.0),  # the profiler's, after the step
            event("kernel", "gemm", 1200.0, 700.0),
            event("kernel", "add", 3200.0, 300.0),
            event("kernel", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 3600.0, 250.0),
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0.0},
        ]
    }
    assert step_work(trace) == {
        "host_ms": 3.0,
        "cpu_ops": 2,
        "launches": 2,
        "gpu_busy_ms": 1.25,
        "collective_ms": 0.25,
        "syncs": 1,
    }
    assert step_work({"traceEvents": []})["host_ms"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("part,arch,processes,extra,layout", TP_CHECK_CASES)
def test_tp_check_on_cpu(part, arch, processes, extra, layout, tmp_path):
    # The tensor-parallel check's two parts on CPU processes (gloo, tiny shapes, fp32), so that the script is
    # known to run before its GPU runs: the op part, and the model part loaded each way (tp_plan="auto",
    # DistributedConfig with tensor parallelism, FSDP2, both), patched vs unpatched vs one process.
    from tests.multiprocess import torchrun_args

    def launch_check() -> subprocess.CompletedProcess:
        launch = torchrun_args(processes)
        args = ["checks/tp_check.py", "--cpu", "--part", part, "--arch", arch, "--warmup", "2", "--steps", "3"]
        options = []
        for option in extra:  # --profile writes into this test's folder
            options += [option, str(tmp_path / "profile")] if option == "--profile" else [option]
        return _run([*launch, *args, *options], tmp_path)

    result = rerun_on_native_abort(launch_check)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    label = f"{arch} world_size={processes}" + (f" {layout}" if layout else "")
    assert f"PASS tp_check {part} {label}" in result.stdout
    name = f"tp_check_model_{arch}_{layout}" if part == "model" else f"tp_check_op_{arch}_w{processes}"
    name += "_compiled" if "--compile" in extra else ""
    report = json.loads((tmp_path / f"{name}.json").read_text())
    assert report["ok"] and all(len(run["ranks"]) == processes for run in report["runs"])
    if part == "model":
        tokens = [int(t) for t in extra[1:]] if "--tokens" in extra else [256]
        assert [run["tokens"] for run in report["runs"]] == tokens
        for run in report["runs"]:
            assert run["reference"]["patched_rel"] < 1e-5 and run["unpatched"]["steps"] == 3
            low, high = run["ratio"]["interval95"]
            assert 0 < low <= high and len(run["ranks"][0]["patched"]["times_ms"]) == 3
            assert run["unpatched"]["ms_min"] <= run["unpatched"]["ms_median"] <= run["unpatched"]["ms_max"]
    if "--profile" in extra:  # a trace, a table and the host / GPU summary of one step per variant, on rank 0
        for variant in ("unpatched", "patched"):
            work = report["runs"][0][variant]["profiled_step_rank0"]
            assert work["host_ms"] > 0 and work["cpu_ops"] > 0 and work["launches"] == work["gpu_busy_ms"] == 0
            assert len(list((tmp_path / "profile").glob(f"tp_check_{arch}_{layout}_*_{variant}_rank0.*"))) == 2
        assert "kernel launches" in result.stdout
    if "--compile" in extra:  # the vocabulary-parallel op runs eagerly: the patched graph breaks there, only there
        assert report["compile_backend"] == "aot_eager" and not report["gradient_checkpointing"]
        unpatched, patched = (report["runs"][0][variant]["compiled_rank0"] for variant in ("unpatched", "patched"))
        assert unpatched["graph_breaks"] == 0 and patched["graph_breaks"] > 0
        assert all("torch.compiler.disable" in reason for reason in patched["reasons"]), patched["reasons"]
        assert unpatched["graphs_in_timed_steps"] == patched["graphs_in_timed_steps"] == 0


@pytest.mark.slow
def test_convergence_tiny_on_cpu(tmp_path):
    result = _run(
        ["checks/convergence.py", "--device", "cpu", "--tiny", "--steps", "3", "--out", str(tmp_path)], tmp_path
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    summary = json.loads((tmp_path / "convergence.json").read_text())
    assert summary  # per-run losses and the verdicts
    assert "patched within spread: yes" in result.stdout


@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_bench_trl_tiny_on_cpu(trainer, tmp_path):
    pytest.importorskip("trl")
    args = ["bench_trl.py", "--tiny", "--trainer", trainer, "--seq-len", "48", "--steps", "1", "--warmup", "0"]
    result = _run([*args, "--model", "gemma-2-2b", "--out", str(tmp_path)], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("bench_trl_*.json")]
    check = record["results"]["check"]
    assert check["loss_abs_diff"] < 1e-5 and check["worst_grad_rel_l2"] < 1e-4  # the two heads agree


def test_bench_divergence_tiny_on_cpu(tmp_path):
    out = tmp_path / "divergence.json"
    result = _run(["bench_divergence.py", "--tiny", "--reps", "2", "--rounds", "2", "--out", str(out)], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert len(row["lce_patch"]["ms_rounds"]) == 2 and row["lce_patch"]["pct_of_floor"] > 0, row
    losses = {method: row[method].get("loss") for method in ("lce_patch", "trl", "unfused")}
    assert losses["lce_patch"] == pytest.approx(losses["unfused"], rel=1e-5), row
    if losses["trl"] is not None:  # TRL's kernel on the CPU (its torch path), when trl imports
        assert losses["trl"] == pytest.approx(losses["unfused"], rel=1e-5), row


@pytest.mark.slow
def test_distill_e2e_tiny_on_cpu(tmp_path):
    # TRL's DistillationTrainer with tiny models, TRL's kernel then lce_patch: the same losses
    pytest.importorskip("trl")
    out = tmp_path / "distill_e2e.json"
    result = _run(["distill_e2e.py", "--tiny", "--out", str(out)], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    runs = json.loads(out.read_text())["results"]
    assert runs["lce_patch"]["losses"] == pytest.approx(runs["trl"]["losses"], rel=1e-4)
    assert runs["lce_patch"]["entropy"] == pytest.approx(runs["trl"]["entropy"], rel=1e-4)


@pytest.mark.slow
def test_preference_e2e_tiny_on_cpu(tmp_path):
    # TRL's experimental ORPO, SimPO (CPO) and Online DPO trainers with a tiny Llama, alone then served by the
    # callback: every setup runs, the callback serves its three, and the two setups of each log the same losses and
    # log-probabilities (float32). One thread: the tiny matmuls run ~50x slower when the two test workers' threads
    # oversubscribe the cores.
    pytest.importorskip("trl")
    out = tmp_path / "preference_e2e.json"
    result = _run(["preference_e2e.py", "--tiny", "--out", str(out)], tmp_path, env_extra={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(out.read_text())
    runs = {r["setup"]: r for r in report["results"]}
    assert not [r for r in runs.values() if "error" in r], runs
    assert set(runs) == {f"{t}{s}" for t in ("orpo", "simpo", "online-dpo") for s in ("", "+lce_patch")}
    for setup, run in runs.items():
        assert run["served"] == setup.endswith("+lce_patch"), setup
        assert run["gradient_checkpointing"] and run["sequence_tokens"] == [128], run
        assert len(run["losses"]) == 3 and run["peak_gib"] is None  # no CUDA memory calls on the CPU
    assert set(report["max_rel_diff"]) == {"orpo", "simpo", "online-dpo"}
    assert all(diff < 1e-5 for diff in report["max_rel_diff"].values()), report["max_rel_diff"]
    assert "| online-dpo+lce_patch | yes |" in result.stdout


def test_bench_lora_head_tiny_on_cpu(tmp_path):
    # the fused LoRA head against PEFT's unfused one and an fp32 reference, on a tiny fp32 shape
    out = tmp_path / "lora_head.json"
    result = _run(["bench_lora_head.py", "--tiny", "--rounds", "2", "--out", str(out)], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
    assert not any("error" in row for row in rows.values()), rows
    assert all(len(row["ms_rounds"]) == 2 for row in rows.values()), rows  # every method timed in each round
    assert "speedup" not in rows["peft_unfused"] and len(rows["lce_patch_lora"]["speedup_interval95"]) == 2
    for key in ("loss_rel_err", "dh_rel_l2", "dA_rel_l2", "dB_rel_l2"):
        assert rows["lce_patch_lora"][key] < 1e-5, (key, rows["lce_patch_lora"])


def test_qlora_check_tiny_on_cpu(tmp_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    out = tmp_path / "qlora.json"
    result = _run(["checks/qlora_check.py", "--tiny", "--out", str(out)], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(out.read_text())
    patched, unpatched = report["runs"]["patched"], report["runs"]["unpatched"]
    assert (
        patched["head_dtype"] == unpatched["head_dtype"] == "torch.float32"
    )  # upcast by prepare_model_for_kbit_training
    assert patched["losses"] == pytest.approx(unpatched["losses"], rel=1e-4)
    assert report["lora_grad_rel_err_max"] < 1e-2  # bf16 autocast on both sides
