"""Every test here is a smoke test of a script in benchmarks/ on the CPU: marked ``benchmark_script``, so that
CI can leave out the slow ones (``-m "not (slow and benchmark_script)"``), which launch the multi-GPU checks'
processes; the scripts run for real on GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.benchmark_script)
