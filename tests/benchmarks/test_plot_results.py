"""The documentation's benchmark chart is generated from the committed results by benchmarks/plot_results.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "plot_results.py"


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
    assert (Path(__file__).parents[2] / "docs" / "assets" / "benchmark.png").exists()


def test_unknown_data_kind_is_a_clear_error():
    plot_results = _module()
    with pytest.raises(SystemExit, match="no 'nothing' blocks"):
        plot_results.load_blocks(plot_results.DEFAULT_RESULTS, "nothing")
