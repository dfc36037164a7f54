"""Shared pieces of the axolotl tests: axolotl runs in a virtual environment of its own (it pins its own torch,
transformers, TRL and PEFT; ``.ci/run`` builds one in ``.ci-deps/axolotl``, ``LCE_PATCH_AXOLOTL_PYTHON`` names
another). Each test file's runs script trains there once, with this checkout's lce_patch, and writes what it
measured; the tests read it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARK = "@@ axolotl run: "  # the runs scripts print it and the run's name before each run


def axolotl_python() -> str | None:
    """The axolotl environment's interpreter, or None where there is none."""
    configured = os.environ.get("LCE_PATCH_AXOLOTL_PYTHON")
    if configured:
        return configured
    default = REPO / ".ci-deps" / "axolotl" / "bin" / "python"
    return str(default) if default.exists() else None


def log_sections(output: str) -> dict[str, list[str]]:
    """Each run's lines of the runs' stdout, by the run's name."""
    sections: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in output.splitlines():
        if line.startswith(MARK):
            lines = sections.setdefault(line[len(MARK) :].strip(), [])
        else:
            lines.append(line)
    return sections


def run_in_axolotl(script: Path, tmp_path_factory: pytest.TempPathFactory, name: str) -> dict:
    """Run ``script WORKDIR OUT.json`` in the axolotl environment (skipped without one, failed in CI) with this
    checkout's lce_patch and axolotl's default log levels; its results, with its stdout under ``"output"``."""
    python = axolotl_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the axolotl checks: .ci/run builds .ci-deps/axolotl")
        pytest.skip("no axolotl environment (.ci-deps/axolotl or LCE_PATCH_AXOLOTL_PYTHON)")
    workdir = tmp_path_factory.mktemp(name)
    out = workdir / "runs.json"
    env = {key: value for key, value in os.environ.items() if key not in ("AXOLOTL_LOG_LEVEL", "LOG_LEVEL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [python, str(script), str(workdir), str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=workdir,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert not results["errors"], "\n".join(results["errors"].values())
    results["output"] = proc.stdout  # where axolotl's console logging writes
    return results
