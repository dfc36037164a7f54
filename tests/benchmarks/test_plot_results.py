"""The documentation's benchmark chart and table are generated from the committed results by benchmarks/plot_results.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

REPO = Path(__file__).parents[2]
SCRIPT = REPO / "benchmarks" / "plot_results.py"


def _module():
    spec = importlib.util.spec_from_file_location("plot_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chart_is_drawn_from_the_committed_results(tmp_path):
    plot_results = _module()
    assert plot_results.DEFAULT_RESULTS.exists(), "the results file the docs' chart is drawn from is committed"
    env, blocks = plot_results.load_blocks(plot_results.DEFAULT_RESULTS, "peaked")
    assert env["device"] and {"lce_patch", "compile"} <= {row["method"] for row in blocks[0]["rows"]}
    out = tmp_path / "chart.png"
    plot_results.plot(env, blocks, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert plot_results.DEFAULT_OUT == REPO / "docs" / "assets" / "benchmark.png"
    assert plot_results.DEFAULT_OUT.exists()


def test_docs_table_is_the_scripts_output_on_the_committed_results():
    # The performance page includes this table; it must hold the numbers of the results file the chart shows.
    plot_results = _module()
    env, blocks = plot_results.load_blocks(plot_results.DEFAULT_RESULTS, "peaked")
    source = plot_results.DEFAULT_RESULTS.relative_to(REPO).as_posix()
    committed = plot_results.DEFAULT_OUT.with_suffix(".md").read_text()
    assert committed == plot_results.table(env, blocks, source), "run python benchmarks/plot_results.py"
    assert "**35.22 ms / 1317 MiB**" in committed  # lce_patch_skip on Llama-3-8B, as in benchmarks/RESULTS.md


def test_script_writes_the_chart_and_its_table(tmp_path, monkeypatch):
    plot_results = _module()
    monkeypatch.setattr("sys.argv", ["plot_results.py", "--out", str(tmp_path / "chart.png"), "--data", "flat"])
    plot_results.main()
    assert (tmp_path / "chart.png").stat().st_size > 10_000
    table = (tmp_path / "chart.md").read_text()
    assert "| **lce_patch (patched model)** |" in table and "flat data" in table


def test_unknown_data_kind_is_a_clear_error():
    plot_results = _module()
    with pytest.raises(SystemExit, match="no 'nothing' blocks"):
        plot_results.load_blocks(plot_results.DEFAULT_RESULTS, "nothing")
