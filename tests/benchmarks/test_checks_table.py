"""docs/hooks/checks_table.py: the Distributed page's table of the multi-GPU checks, generated from the raw files of
the newest benchmarks/checks/run_all.py run in benchmarks/results/."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _hook():
    spec = importlib.util.spec_from_file_location("checks_table", REPO / "docs" / "hooks" / "checks_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_launch_has_a_row_that_names_its_raw_file():
    hook = _hook()
    table = hook.checks_table()
    newest = sorted((REPO / "benchmarks" / "results").glob("*_run_all_checks_*.json"))[-1]
    launches = json.loads(newest.read_text())["launches"]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| engine")]
    assert len(rows) == len(launches)
    for row in rows:
        named = re.findall(r"`([^`]+\.json)`", row)
        assert named and all((REPO / "benchmarks" / "results" / name).is_file() for name in named), row
    assert newest.name in table and "uncommitted" not in table


def test_the_page_marker_is_replaced(tmp_path):
    hook = _hook()
    page = (REPO / "docs" / "distributed.md").read_text()
    assert hook.MARKER in page
    assert hook.MARKER not in hook.on_page_markdown(page, None, None, None)
    assert "no run of" in hook.checks_table(tmp_path)  # no raw files: said in words


def test_the_benchmark_table_is_made_from_the_raw_files_as_the_script_makes_it():
    # The page's table comes from the raw files at build time; the committed copy beside the chart says the same.
    hook = _hook()
    assert hook.benchmark_table() == (REPO / "docs" / "assets" / "multi-gpu-benchmark.md").read_text()
    page = (REPO / "docs" / "multi-gpu-benchmark.md").read_text()
    assert hook.BENCHMARK_INCLUDE in page and hook.BENCHMARK_INCLUDE not in hook.on_page_markdown(
        page, None, None, None
    )


def test_the_long_context_tables_come_from_their_raw_files():
    hook = _hook()
    longest, timed = hook.long_context_tables()
    for table in (longest, timed):
        rows = [line for line in table.splitlines()[2:]]
        assert len(rows) == len(hook.LONG_CONTEXT)
        for row in rows:
            (name,) = re.findall(r"`([^`]+\.json)`", row)
            assert (REPO / "benchmarks" / "results" / name).is_file()
    assert "out of memory" in longest and "≥" in longest  # the unpatched limits found, the fused ones bracketed
    page = hook.on_page_markdown((REPO / "docs" / "long-context.md").read_text(), None, None, None)
    assert hook.LONGEST_MARKER not in page and hook.THROUGHPUT_MARKER not in page and longest in page
