"""benchmarks/checks/harness.py and bench_common's commit record: what every multi-GPU check relies on, on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "checks"))

import harness  # noqa: E402  (puts benchmarks/ on the path)
from bench_common import TREE_MANIFEST, tree_state  # noqa: E402


def test_compare_params_finds_the_tensor_whose_update_is_off():
    init = {"a": torch.zeros(4, 3), "b": torch.ones(5), "step": torch.tensor(3)}
    ref = {"a": init["a"] + 0.1, "b": init["b"] + 0.01, "step": torch.tensor(3)}
    dist = {"a": ref["a"].clone(), "b": ref["b"] + 0.001}
    rows, missing = harness.compare_params(dist, ref, init, device="cpu")
    assert missing == [] and [row["name"] for row in rows] == ["a", "b"]  # integer tensors are not compared
    by_name = {row["name"]: row for row in rows}
    assert by_name["a"]["update_rel_l2"] == 0.0 and abs(by_name["b"]["update_rel_l2"] - 0.1) < 1e-4  # fp32 weights
    failing, detail = harness.update_failures(rows, 1e-3)
    assert [row["name"] for row in failing] == ["b"] and "worst rel L2 1.00e-01 (b" in detail
    assert harness.compare_params({}, ref, init, device="cpu")[1] == ["a", "b"]


def test_op_spy_records_what_each_call_got_and_restores_the_name():
    class Module:
        @staticmethod
        def op(hidden, weight, labels, **kwargs):
            return hidden.sum()

    original = Module.op
    labels = torch.tensor([[-100, 1, 2, -100]])
    with harness.OpSpy(Module, "op") as spy:
        Module.op(torch.ones(1, 4, 8), torch.ones(16, 8), labels, num_items_in_batch=torch.tensor(2), shift=True)
    assert Module.op is original
    (call,) = spy.calls
    assert call["hidden_shape"] == [1, 4, 8] and call["weight"]["shape"] == call["weight"]["local_shape"] == [16, 8]
    assert abs(call["weight"]["norm"] - (16 * 8) ** 0.5) < 1e-9 and not call["weight"]["is_dtensor"]
    assert call["num_items_in_batch"] == 2.0 and call["targets"] == {"valid": 2, "shift": True, "checksum": 3}
    with harness.OpSpy(Module, "op", host_reads=False) as quiet:
        Module.op(torch.ones(2, 8), torch.ones(16, 8), labels)
    assert "norm" not in quiet.calls[0]["weight"] and "num_items_in_batch" not in quiet.calls[0]


def test_report_writes_after_each_phase_and_names_the_commit(tmp_path):
    report = harness.Report("some_check", {"steps": 3}, "some_check_w2", tmp_path)
    with report.phase("reference"):
        report.data["reference_losses"] = [1.0]
    written = json.loads((tmp_path / "some_check_w2.json").read_text())
    assert written["status"] == "running" and written["reference_losses"] == [1.0]
    assert written["env"]["commit"] and "dirty" in written["env"] and "reference" in written["seconds"]
    report.check("loss", True, "fine")
    assert report.finish(["title"], [], "label")
    done = json.loads((tmp_path / "some_check_w2.json").read_text())
    assert (
        done["status"] == "done" and done["ok"] and done["checks"] == [{"name": "loss", "ok": True, "detail": "fine"}]
    )


def test_an_exported_tree_names_its_commit_and_sees_a_changed_file(tmp_path):
    tree = tmp_path / "tree"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checks" / "run_all.py"), "--export", str(tree)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    state = tree_state(tree)
    assert (tree / TREE_MANIFEST).is_file() and state["commit"] == head and state["dirty"] is False
    with open(tree / "README.md", "a") as readme:
        readme.write("changed\n")
    state = tree_state(tree)
    assert state["dirty"] is True and state["changed"] == ["README.md"]


def test_interleaved_rounds_rotates_the_order_and_pairs_the_rounds():
    from bench_common import interleaved_rounds

    order: list[str] = []
    fast_times = iter([10.0, 11.0, 9.0, 10.0])

    def timer(name, times):
        def timed():
            order.append(name)
            return next(times)

        return timed

    def failing():
        order.append("broken")
        if order.count("broken") > 1:
            raise RuntimeError("CUDA error: an illegal memory access")
        return 1.0

    result = interleaved_rounds(
        {"ref": timer("ref", iter([20.0, 22.0, 18.0, 21.0])), "fast": timer("fast", fast_times), "broken": failing},
        rounds=4,
        reference="ref",
    )
    # each round starts one method later; a method that raised is not timed again
    assert order[:3] == ["ref", "fast", "broken"] and order[3:5] == ["fast", "broken"] and order.count("broken") == 2
    fast = result["fast"]
    assert fast["ms_rounds"] == [10.0, 11.0, 9.0, 10.0] and fast["ms"] == 10.0
    assert fast["speedup"] == 20.5 / 10.0 and fast["faster_every_round"] and not fast["slower_every_round"]
    low, high = fast["speedup_interval95"]
    assert 1.5 < low <= fast["speedup"] <= high < 2.5
    assert result["broken"]["ms_rounds"] == [1.0] and "illegal memory access" in result["broken"]["error"]
    assert "speedup" not in result["broken"]  # one round is no pair
    assert "speedup" not in result["ref"] and result["ref"]["ms"] == 20.5


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "out of memory"),
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."), "surfaced as: CUDA error: out"),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), "CUBLAS"),
        (RuntimeError("NCCL Error 1: unhandled cuda error (run with NCCL_DEBUG=INFO for details)"), "NCCL Error 1"),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), None),
        (RuntimeError("NCCL communicator was aborted on rank 1 (watchdog timeout)"), None),
        (RuntimeError("CUDA error: misaligned address"), None),
        (ValueError("out of memory"), None),  # only runtime errors come from the device
    ],
)
def test_out_of_memory_is_told_apart_from_other_device_errors(error, expected):
    from bench_common import out_of_memory

    said = out_of_memory(error)
    if expected is None:
        assert said is None
    else:
        assert said is not None and expected in said
