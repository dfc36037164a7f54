"""recipes/distill_top_k.py: the teacher's top-K written once and reused; the student's loss from
lce_patch.fused_linear_sparse_divergence equal, step by step, to the unfused loss on the full logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# A shortened default: a few steps of the teacher, a few sequences, three steps of the student.
SHORT = ["--teacher-steps", "4", "--max-examples", "24", "--batch-size", "4", "--max-steps", "3"]


def _compare(argv: list[str], out_dir: Path) -> dict:
    import distill_top_k

    assert distill_top_k.main([*argv, "--compare", "--output-dir", str(out_dir)]) == 0
    return json.loads((out_dir / "compare.json").read_text())


def _assert_runs_agree(record: dict, metrics: tuple[str, ...]) -> None:
    """float32 on the CPU: the two loss curves (and the logged metrics) agree to float noise."""
    baseline, fused = record["runs"]
    assert [baseline["name"], fused["name"]] == ["baseline", "lce_patch"]
    assert len(baseline["losses"]) == len(fused["losses"]) == 3
    assert fused["losses"] == pytest.approx(baseline["losses"], rel=1e-5, abs=1e-5)
    assert baseline["losses"][-1] < baseline["losses"][0]  # the student learns
    for theirs, ours in zip(baseline["step_logs"], fused["step_logs"], strict=True):
        for key in metrics:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-5), key
    assert baseline["peak_bytes"] > 0 and fused["peak_bytes"] > 0
    assert all(t > 0 for t in baseline["step_tokens"] + fused["step_tokens"])


def test_compare_agrees_and_the_teacher_data_is_reused(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """The default loss (forward KL with the tail bucket, K = 16), then, from the saved top-K without running the
    teacher again, the other options: K = 8 of the saved 16, renormalized, beta 0.5, a cross-entropy term."""
    import datasets

    first = _compare(SHORT, tmp_path / "first")
    _assert_runs_agree(first, ("divergence", "entropy"))
    out = capfd.readouterr().out
    assert "largest loss difference" in out  # (the teacher's own line is printed once per setting and process)

    saved = tmp_path / "first" / "teacher_top_k"
    settings = json.loads((saved / "recipe_settings.json").read_text())
    assert settings["top_k"] == 16 and settings["temperature"] == 1.0
    data = datasets.load_from_disk(str(saved))
    assert len(data) == 24 and data.column_names == ["input_ids", "teacher_ids", "teacher_logprobs"]
    row = data[0]
    assert len(row["teacher_ids"]) == len(row["input_ids"]) - 1 and len(row["teacher_ids"][0]) == 16
    assert row["teacher_logprobs"][0] == sorted(row["teacher_logprobs"][0], reverse=True)
    assert sum(2.718281828**v for v in row["teacher_logprobs"][0]) < 1.0 + 1e-5

    options = ["--teacher-data", str(saved), "--top-k", "8", "--no-tail-bucket", "--beta", "0.5"]
    second = _compare([*SHORT, *options, "--ce-weight", "0.5"], tmp_path / "second")
    _assert_runs_agree(second, ("divergence", "cross_entropy", "entropy"))
    out = capfd.readouterr().out
    assert "embedded teacher" not in out and "teacher's top-16 loaded from" in out
    assert not (tmp_path / "second" / "teacher_top_k").exists()
    assert second["runs"][0]["losses"][0] != pytest.approx(first["runs"][0]["losses"][0])


def test_saved_top_k_must_match_the_run(tmp_path: Path) -> None:
    """A --teacher-data folder with fewer candidates, or log-probabilities at another temperature, is refused."""
    import distill_top_k

    folder = tmp_path / "teacher_top_k"
    folder.mkdir()
    settings = {"teacher": "x", "top_k": 4, "temperature": 1.0, "tokenizer_size": 1}
    (folder / "recipe_settings.json").write_text(json.dumps(settings))
    with pytest.raises(SystemExit, match="tokenizer of 1 tokens"):
        distill_top_k.main(["--teacher-data", str(folder), "--output-dir", str(tmp_path / "out")])
    from _loading import build_embedded_tokenizer

    settings["tokenizer_size"] = len(build_embedded_tokenizer())
    (folder / "recipe_settings.json").write_text(json.dumps(settings))
    with pytest.raises(SystemExit, match="give --top-k <= 4"):
        distill_top_k.main(["--teacher-data", str(folder), "--output-dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="give --temperature 1.0"):
        distill_top_k.main(
            ["--teacher-data", str(folder), "--top-k", "4", "--temperature", "2", "--output-dir", str(tmp_path / "out")]
        )
