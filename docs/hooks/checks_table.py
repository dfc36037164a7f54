"""MkDocs hook: tables generated from the raw files in ``benchmarks/results/`` when the docs are built, so a page can
neither drift from them nor cite a run without its file:

  * the Distributed page's table of the multi-GPU checks (the spot marked ``<!-- multi-gpu-checks -->``), from the
    newest ``benchmarks/checks/run_all.py`` run (``*_run_all_checks_<commit>.json`` and the checks' own JSON files of
    that commit);
  * the multi-GPU benchmark page's table (its include of ``docs/assets/multi-gpu-benchmark.md``), from the
    ``multi_gpu_train.py`` files ``benchmarks/plot_multi_gpu.py`` charts, through that script's own ``table``.

Standard library only.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
MARKER = "<!-- multi-gpu-checks -->"
BENCHMARK_INCLUDE = '--8<-- "docs/assets/multi-gpu-benchmark.md"'
# run_all.py's launches: what each is, and how its JSON names itself (check, mode or layout)
LAUNCHES = {
    "ddp": ("DDP", "multi_gpu_check", "DDP"),
    "fsdp1": ("FSDP1", "multi_gpu_check", "FSDP1"),
    "fsdp2": ("FSDP2", "multi_gpu_check", "FSDP2"),
    "zero2": ("DeepSpeed ZeRO-2", "multi_gpu_check", "ZeRO-2"),
    "zero3": ("DeepSpeed ZeRO-3", "multi_gpu_check", "ZeRO-3"),
    "cp": ("context parallelism (Trainer)", "cp_check", "cp"),
    "ulysses": ("DeepSpeed Ulysses (Trainer)", "cp_check", "sp"),
    "tp": ("`DistributedConfig` TP", "tp_check", "tp4_fsdp1"),
    "tp_fsdp": ("`DistributedConfig` TP x FSDP2", "tp_check", "tp2_fsdp2"),
    "distill_zero3": ("TRL distillation, ZeRO-3", "distill_multi_gpu_check", "ZeRO-3"),
}
_NUMBER = re.compile(r"(?:rel err|rel L2) ([0-9.]+e[-+][0-9]+)")


def _kind(report: dict) -> tuple[str, str] | None:
    check = report.get("check")
    if check == "cp_check":
        return check, report["args"]["mode"]
    if check == "tp_check":
        return check, report.get("layout") or ""
    if check in ("multi_gpu_check", "distill_multi_gpu_check"):
        return check, report.get("mode", {}).get("mode", "")
    return None


def _worst(report: dict, prefix: str) -> float | None:
    values = [float(m) for c in report["checks"] if c["name"].startswith(prefix) for m in _NUMBER.findall(c["detail"])]
    return max(values) if values else None


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.1e}"


def checks_table(results: Path = RESULTS) -> str:
    runs = sorted(results.glob("*_run_all_checks_*.json"))
    if not runs:
        return "(no run of `benchmarks/checks/run_all.py` in benchmarks/results/)"
    summary = json.loads(runs[-1].read_text())
    env = summary["env"]
    reports = {}
    for path in results.glob(f"*_{env['commit'][:7]}.json"):
        report = json.loads(path.read_text())
        kind = _kind(report) if isinstance(report, dict) and "check" in report else None
        if kind and report.get("env", {}).get("commit") == env["commit"]:
            reports[kind] = (path.name, report)
    lines = [
        f"{summary['gpus']} x {env['device']}, {env['date']}, commit {env['commit'][:7]}"
        f"{'' if env.get('dirty') is False else ' (uncommitted changes)'}, torch {env['torch']}, transformers "
        f"{env['transformers']}, accelerate {env['accelerate']}, DeepSpeed {env['deepspeed']}, TRL {env['trl']}; "
        f"raw: `results/{runs[-1].name}` and the files below.",
        "",
        "| engine / layout | verdict | losses within (of one process) | updates within (worst) | patched / unpatched step "
        "(95% interval) | seconds, launch | raw file |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, launch in summary["launches"].items():
        label, check, mode = LAUNCHES.get(name, (name, None, None))
        if "not_started" in launch:
            lines.append(f"| {label} | not started ({launch['not_started']}) | | | | | |")
            continue
        file, report = reports.get((check, mode), (None, None))
        ratio = "–"
        if report is not None and check == "tp_check":
            run = report["runs"][0].get("ratio")
            if run:
                low, high = run["interval95"]
                ratio = f"{run['median']:.3f} ({low:.3f}-{high:.3f})"
        verdict = "PASS" if launch["ok"] else ("stopped" if launch.get("stopped_after_s") else "FAIL")
        losses = _worst(report, "loss vs") if report else None
        if report is not None and check == "tp_check":
            losses = max((r.get("reference", {}).get("patched_rel") or 0.0) for r in report["runs"])
        updates = _worst(report, "updates") if report else None
        lines.append(
            f"| {label} | {verdict} | {_cell(losses)} | {_cell(updates)} | {ratio} | {launch['seconds']:.0f} | "
            + (f"`{file}`" if file else "–")
            + " |"
        )
    return "\n".join(lines)


def benchmark_table() -> str:
    """The multi-GPU benchmark's table, made from the raw files as ``plot_multi_gpu.py`` makes it beside its chart."""
    spec = importlib.util.spec_from_file_location(
        "_lce_patch_plot_multi_gpu", REPO / "benchmarks" / "plot_multi_gpu.py"
    )
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    columns = list(plot.DEFAULT_RESULTS)
    sources = [" + ".join(plot._source(path) for path in plot._column_paths(column)) for column in columns]
    return plot.table(plot.load_runs(columns), sources)


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, checks_table())
    if BENCHMARK_INCLUDE in markdown:
        markdown = markdown.replace(BENCHMARK_INCLUDE, benchmark_table())
    return markdown
