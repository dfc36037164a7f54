"""MkDocs hook: tables generated from the raw files in ``benchmarks/results/`` when the docs are built, so a page can
neither drift from them nor cite a run without its file:

  * the Distributed page's table of the multi-GPU checks (the spot marked ``<!-- multi-gpu-checks -->``), from the
    newest ``benchmarks/checks/run_all.py`` run (``*_run_all_checks_<commit>.json`` and the checks' own JSON files of
    that commit);
  * the multi-GPU benchmark page's table (its include of ``docs/assets/multi-gpu-benchmark.md``), from the
    ``multi_gpu_train.py`` files ``benchmarks/plot_multi_gpu.py`` charts, through that script's own ``table``;
  * the Long context page's two tables (``<!-- long-context-longest -->``, ``<!-- long-context-throughput -->``), from
    the ``long_context.py`` files named in ``LONG_CONTEXT`` below.

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


# The Long context page's rows: (label, shape, the search's file, the timed run's file), 4 x H100, 2026-11-27
_LC = "2026-11-27_4xh100_long_context_"
LONG_CONTEXT = (
    ("Llama-3.1-8B, 1 GPU", "llama3.1-8b", "search_w1_llama3.1-8b", "timed_w1_llama3.1-8b"),
    ("Llama-3.1-8B, context parallelism, 2 GPUs", "llama3.1-8b", "search_cp_w2_llama3.1-8b", "timed_cp_w2_llama3.1-8b"),
    ("Llama-3.1-8B, context parallelism, 4 GPUs", "llama3.1-8b", "cp_w4_llama3.1-8b", "cp_w4_llama3.1-8b"),
    (
        "Llama-3.1-8B, FSDP2 + Ulysses attention, 2 GPUs",
        "llama3.1-8b",
        "ulysses_w2_llama3.1-8b",
        "ulysses_w2_llama3.1-8b",
    ),
    (
        "Llama-3.1-8B, FSDP2 + Ulysses attention, 4 GPUs",
        "llama3.1-8b",
        "ulysses_w4_llama3.1-8b",
        "ulysses_w4_llama3.1-8b",
    ),
    ("Qwen2.5-7B, 1 GPU", "qwen2.5-7b", "search_w1_qwen2.5-7b", "timed_w1_qwen2.5-7b"),
)
LONGEST_MARKER = "<!-- long-context-longest -->"
THROUGHPUT_MARKER = "<!-- long-context-throughput -->"
SETUPS = (("unpatched", "unpatched"), ("lce_patch", "lce_patch"), ("liger", "Liger's fused loss"))


def _longest(found: dict) -> str:
    """``longest (peak GiB there; the next length tried, out of memory)``, or ``≥ longest (peak)`` when no longer
    length was tried or none ran out of memory."""
    trials = {int(n): t for n, t in found.get("trials", {}).items()}
    longest = found.get("longest", 0)
    peak = (trials.get(longest) or {}).get("peak_gib")
    failed = sorted(n for n, t in trials.items() if not t["ok"] and n > longest)
    peak_text = "–" if peak is None else f"{peak:.1f}"
    if failed:
        return f"{longest} ({peak_text} GiB; {failed[0]} out of memory)"
    return f"≥ {longest} ({peak_text} GiB)"


def long_context_tables(results: Path = RESULTS) -> tuple[str, str]:
    """The longest length each setup trained (and its peak), and tokens/s at the longest length all fit."""
    longest = [
        "| setup | " + " | ".join(label for _, label in SETUPS) + " | raw file |",
        "|---" * (len(SETUPS) + 2) + "|",
    ]
    timed = [
        "| setup, length | " + " | ".join(label for _, label in SETUPS) + " | raw file |",
        "|---" * (len(SETUPS) + 2) + "|",
    ]
    for label, shape, search, run in LONG_CONTEXT:
        found = json.loads((results / f"{_LC}{search}.json").read_text())["results"][shape]
        cells = [_longest(found[key]) if key in found else "not run" for key, _ in SETUPS]
        longest.append(f"| {label} | " + " | ".join(cells) + f" | `{_LC}{search}.json` |")
        rows = json.loads((results / f"{_LC}{run}.json").read_text()).get("throughput", {}).get(shape, {})
        length = next((row["length"] for row in rows.values()), "–")
        cells = [
            f"{rows[key]['tokens_per_s']:.0f} / {rows[key]['peak_gib']:.2f}"
            if key in rows and rows[key].get("ok") and rows[key].get("tokens_per_s")
            else "not timed"
            for key, _ in SETUPS
        ]
        timed.append(f"| {label}, {length} | " + " | ".join(cells) + f" | `{_LC}{run}.json` |")
    return "\n".join(longest), "\n".join(timed)


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, checks_table())
    if LONGEST_MARKER in markdown or THROUGHPUT_MARKER in markdown:
        longest, timed = long_context_tables()
        markdown = markdown.replace(LONGEST_MARKER, longest).replace(THROUGHPUT_MARKER, timed)
    if BENCHMARK_INCLUDE in markdown:
        markdown = markdown.replace(BENCHMARK_INCLUDE, benchmark_table())
    return markdown
