"""Chart and table of ``multi_gpu_train.py`` launches: training tokens/s per GPU and peak memory per method.

Reads the JSON files that ``benchmarks/multi_gpu_train.py`` writes (one per launch: a model, a sequence length and
an engine, several loss setups, the "methods") and draws a panel per launch, a bar per method: tokens/s per GPU,
the bar labelled with its peak GiB per GPU; a method that did not run in a launch (or ran out of memory) is said in
words where its bar would be. Beside the chart it writes the same numbers as a Markdown table (same name, ``.md``).
The documentation's chart and table (``docs/assets/multi-gpu-benchmark.png``, ``docs/assets/multi-gpu-benchmark.md``)
are this script's output on the committed four-GPU runs (four H100s; the 32k-token FSDP2 columns four H200s):

    python benchmarks/plot_multi_gpu.py                     # the default results -> docs/assets/multi-gpu-benchmark.{png,md}
    python benchmarks/plot_multi_gpu.py --results A.json B.json --out chart.png
    python benchmarks/plot_multi_gpu.py --results A.json B1.json+B2.json+B3.json   # B: one method per launch

Launches joined with ``+`` make one column: a setup whose methods each ran in a launch of their own (DeepSpeed
ZeRO-3 on GPUs, see multi_gpu_train.py), the same engine, GPUs, model and sequence length in each.
"""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_RESULTS = REPO / "benchmarks" / "results"
_ZERO3 = ("lce_patch", "unpatched", "liger_fused_loss", "trl_fused_head", "liger_kernels+lce_patch")
# A column per entry: one launch's JSON, or a tuple of launches that make one column (one method each).
DEFAULT_RESULTS: tuple[Path | tuple[Path, ...], ...] = (
    *(
        _RESULTS / f"2026-11-27_4xh100_multi_gpu_train_{cell}.json"
        for cell in (
            "fsdp2_llama-3.1-8b_8192",
            "fsdp2_qwen2.5-7b_8192",
            "fsdp2_gemma-2-9b_8192",
        )
    ),
    # 32k tokens: every method in one launch on four H200s (the four-H100 launch left two methods out for time)
    _RESULTS / "2026-11-28_4xh200_multi_gpu_train_fsdp2_llama-3.1-8b_32768_918c8d6.json",
    _RESULTS / "2026-11-28_4xh200_multi_gpu_train_fsdp2_qwen2.5-7b_32768_918c8d6.json",
    _RESULTS / "2026-11-27_4xh100_multi_gpu_train_fsdp2_llama-3.1-8b-lora_8192.json",
    tuple(_RESULTS / f"2026-11-28_4xh100_multi_gpu_train_zero3_llama-3.1-8b_8192_{m}_64453c6.json" for m in _ZERO3),
    _RESULTS / "2026-11-27_4xh100_multi_gpu_train_tp2xfsdp2_llama-3.1-8b_8192.json",
    _RESULTS / "2026-11-28_4xh100_multi_gpu_train_tp4_llama-3.1-8b_8192_run2_64453c6.json",
)
DEFAULT_OUT = REPO / "docs" / "assets" / "multi-gpu-benchmark.png"
# Methods in the order drawn, with their labels; a method not named here follows them under its own name.
METHODS = {
    "unpatched": "unpatched",
    "lce_patch": "lce_patch",
    "liger_fused_loss": "Liger fused loss",
    "trl_fused_head": "TRL fused head",
    "liger_kernels+lce_patch": "Liger's other kernels + lce_patch",
    "liger_all": "Liger, every kernel",
    "compile": "torch.compile",
}
# The loss options: the model otherwise as Transformers builds it. The others also replace its other layers.
LOSS_OPTIONS = ("unpatched", "lce_patch", "liger_fused_loss", "trl_fused_head", "compile")
MODELS = {
    "llama-3.1-8b": "Llama-3.1-8B",
    "llama-3.1-8b-lora": "Llama-3.1-8B LoRA",
    "qwen2.5-7b": "Qwen2.5-7B",
    "gemma-2-9b": "Gemma-2-9B",
}
VERSIONS = ("torch", "transformers", "liger-kernel", "trl")
REQUIRED = ("engine", "world_size", "device", "model", "seq_len", "micro_batch", "methods")
HIGHLIGHT = "#1f77b4"  # lce_patch
HIGHLIGHT_LIGHT = "#9ecae1"  # lce_patch with Liger's other kernels
MUTED = "#bdbdbd"
FAILED = "#b2182b"
LEFT_MARK = "†"  # a method that started with memory an earlier method of its launch left allocated


def _read(path: Path) -> dict:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"{path}: cannot read a multi_gpu_train.py report ({error})") from None
    missing = [key for key in REQUIRED if key not in report]
    if missing:
        raise SystemExit(f"{path}: not a multi_gpu_train.py report (no {', '.join(missing)})")
    return report


# What the launches of one column must share; the other facts (commit, steps, date) are joined where they differ.
SAME_SETUP = ("engine", "world_size", "device", "model", "layers", "seq_len", "micro_batch")


def merge_launches(reports: list[dict], paths: list[Path]) -> dict:
    """One column from launches of one setup that ran different methods: the first report with every launch's
    methods. A setup fact that differs between them, or a method in two of them, is an error."""
    merged = {**reports[0], "methods": {}}
    for report, path in zip(reports, paths, strict=True):
        differ = [key for key in SAME_SETUP if report.get(key) != reports[0].get(key)]
        if differ:
            raise SystemExit(f"{path}: not the setup of {paths[0]} ({', '.join(differ)} differ): not one column")
        twice = sorted(set(report["methods"]) & set(merged["methods"]))
        if twice:
            raise SystemExit(f"{path}: {', '.join(twice)} already in an earlier launch of its column")
        merged["methods"].update(report["methods"])
    for key in ("git", "timed_steps", "date"):
        values = list(dict.fromkeys(str(report.get(key)) for report in reports if report.get(key) is not None))
        if len(values) > 1:
            merged[key] = " / ".join(values)
    merged["launches"] = len(reports)
    return merged


def _column_paths(column: Path | str | tuple[Path, ...]) -> list[Path]:
    if isinstance(column, tuple | list):
        return [Path(path) for path in column]
    return [Path(part) for part in str(column).split("+")]


def load_runs(columns: list | tuple) -> list[dict]:
    """A report per column, in the order given: a ``multi_gpu_train.py`` launch's, or several launches' of one
    setup merged (a tuple of paths, or paths joined with ``+``)."""
    if not columns:
        raise SystemExit("no results files given")
    runs = []
    for column in columns:
        paths = _column_paths(column)
        reports = [_read(path) for path in paths]
        runs.append(reports[0] if len(reports) == 1 else merge_launches(reports, paths))
    return runs


def engine_name(engine: str) -> str:
    """Readable name of ``multi_gpu_train.py``'s engine: fsdp2 -> FSDP2, zero3 -> DeepSpeed ZeRO-3, tp2xfsdp2 ..."""
    if match := re.fullmatch(r"fsdp(\d)", engine):
        return f"FSDP{match[1]}"
    if match := re.fullmatch(r"zero(\S)", engine):
        return f"DeepSpeed ZeRO-{match[1]}"
    if match := re.fullmatch(r"tp(\d+)(?:xfsdp(\d+))?", engine):
        return f"tensor parallel {match[1]}" + (f" x FSDP2 {match[2]}" if match[2] else "")
    return {"ddp": "DDP", "single": "one GPU"}.get(engine, engine)


# multi_gpu_train.py's interleaved A/B of unpatched and lce_patch: a ratio of two variants, not one setup's bar
NOT_DRAWN = ("lce_patch_interleaved",)


def _methods(runs: list[dict]) -> list[str]:
    present = [method for run in runs for method in run["methods"] if method not in NOT_DRAWN]
    return [m for m in METHODS if m in present] + sorted({m for m in present if m not in METHODS})


def _label(method: str) -> str:
    return METHODS.get(method, method)


def _cells(runs: list[dict]) -> list[str]:
    """A column name per launch: model, tokens per GPU, the engine where the launches' engines differ."""
    engines = {run["engine"] for run in runs}
    names = []
    for run in runs:
        tokens = run.get("tokens_per_gpu_step", run["seq_len"] * run["micro_batch"])
        name = f"{MODELS.get(run['model'], run['model'])}, {tokens} tok/GPU"
        if run.get("layers") is not None and run.get("full_layers") and run["layers"] < run["full_layers"]:
            name += f" ({run['layers']} of {run['full_layers']} layers)"
        names.append(name + (f", {engine_name(run['engine'])}" if len(engines) > 1 else ""))
    return names


def _outcome(run: dict, method: str) -> tuple[float | None, float | None, str]:
    """(tokens/s per GPU, peak GiB, words for a method without numbers) of one method of one launch."""
    record = run["methods"].get(method)
    if record is None or record.get("status") == "skipped":
        return None, None, "not run"
    if record.get("status") == "oom":
        return None, None, "out of memory"
    if record.get("status") != "ok":
        return None, None, "failed"
    if record.get("tokens_per_s_per_gpu") is None:
        return None, record.get("peak_gib"), "no timed steps"
    return record["tokens_per_s_per_gpu"], record.get("peak_gib"), ""


def _left(run: dict, method: str) -> float | None:
    return run["methods"].get(method, {}).get("left_by_earlier_gib")


def _facts(run: dict) -> dict[str, str]:
    """What a launch ran on and with, a value a fact (PHRASES words them)."""
    versions = run.get("versions", {})
    facts = {
        "engine": engine_name(run["engine"]),
        "gpus": f"{run['world_size']} x {run['device']}",
        "micro-batch": str(run["micro_batch"]),
        "precision": run.get("precision", ""),
        "checkpointing": "gradient checkpointing" if run.get("gradient_checkpointing") else "",
        "steps": str(run.get("timed_steps") or ""),
        "versions": ", ".join(f"{name} {versions[name]}" for name in VERSIONS if versions.get(name)),
        "date": str(run.get("date", "")).split(" ")[0],
        "commit": re.sub(r"\b([0-9a-f]{7})[0-9a-f]{33}\b", r"\1", str(run.get("git") or "")),
    }
    return {key: value for key, value in facts.items() if value}


PHRASES = {"micro-batch": "micro-batch {}", "steps": "median of {} timed steps", "commit": "commit {}"}


def _phrase(key: str, value: str) -> str:
    return PHRASES.get(key, "{}").format(value)


def _shared_and_own(runs: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The facts every launch shares, and each launch's own (those where the launches differ but for the engine,
    which then is in the launch's name), worded."""
    facts = [_facts(run) for run in runs]
    keys = list(dict.fromkeys(key for f in facts for key in f))
    if len({f["engine"] for f in facts}) > 1:
        keys.remove("engine")
    shared = [key for key in keys if all(f.get(key) == facts[0].get(key) for f in facts)]
    return (
        [_phrase(key, facts[0][key]) for key in shared if key in facts[0]],
        [[_phrase(key, f[key]) for key in keys if key not in shared and key in f] for f in facts],
    )


def _by_value(runs: list[dict], cells: list[str], key: str) -> str:
    """One fact over the launches, worded: the most common value, then the others with the columns that have them."""
    values: dict[str, list[str]] = {}
    for run, cell in zip(runs, cells, strict=True):
        values.setdefault(_facts(run).get(key, "?"), []).append(cell)
    common, *others = sorted(values, key=lambda value: -len(values[value]))
    if not others:
        return _phrase(key, common)
    return _phrase(key, common) + " (" + "; ".join(f"{v} for {' / '.join(values[v])}" for v in others) + ")"


def _lines(phrases: list[str], width: int) -> str:
    """The phrases joined by commas, broken into lines of about ``width`` characters between phrases."""
    lines = [""]
    for phrase in phrases:
        if lines[-1] and len(lines[-1]) + len(phrase) + 2 > width:
            lines[-1] += ","
            lines.append("")
        lines[-1] += (", " if lines[-1] else "") + phrase
    return "\n".join(lines)


def plot(runs: list[dict], out: Path) -> None:
    """Draw the chart: a panel per launch, a horizontal bar per method, the method labels on the left."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    methods, cells = _methods(runs), _cells(runs)
    shared, own = _shared_and_own(runs)
    nrows = -(-len(runs) // 3)  # at most three panels a row: a panel's title lines then fit its width
    ncols = -(-len(runs) // nrows)
    # 10 inches wide: at the documentation's ~700 px column a 10-12 pt label is 10-12 px tall.
    plt.rcParams.update({"font.size": 11, "axes.titlesize": 11})
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(10, 1.6 + nrows * (0.5 * len(methods) + 0.4)),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    ys = [-index for index in range(len(methods))]
    any_left = False
    for index, (run, cell) in enumerate(zip(runs, cells, strict=True)):
        ax = axes[index // ncols][index % ncols]
        numbers = [_outcome(run, method) for method in methods]
        top = max((tps for tps, _, _ in numbers if tps is not None), default=1.0)
        for y, method, (tps, peak, words) in zip(ys, methods, numbers, strict=True):
            mark = f" {LEFT_MARK}" if _left(run, method) is not None else ""
            any_left |= bool(mark)
            if tps is None:
                failed = words in ("out of memory", "failed")
                ax.text(
                    top * 0.02,
                    y,
                    words + mark,
                    va="center",
                    fontsize=9.5,
                    style="italic",
                    color=FAILED if failed else "dimgray",
                )
                continue
            strong = method == "lce_patch"
            color = {"lce_patch": HIGHLIGHT, "liger_kernels+lce_patch": HIGHLIGHT_LIGHT}.get(method, MUTED)
            ax.barh(y, tps, height=0.72, color=color)
            ax.text(
                tps - top * 0.03,
                y,
                f"{tps:.0f}",
                ha="right",
                va="center",
                fontsize=9.5,
                color="white" if strong else "#252525",
                fontweight="bold" if strong else "normal",
            )
            ax.text(
                tps + top * 0.03,
                y,
                (f"{peak:.1f} GiB" if peak is not None else "") + mark,
                va="center",
                fontsize=9.5,
                color="#252525",
            )
        ax.set_xlim(0, top * 1.55)
        ax.set_ylim(ys[-1] - 0.6, ys[0] + 0.6)
        name, _, rest = cell.partition(", ")
        title = [name, textwrap.fill(rest, 32), *(textwrap.fill(fact, 30) for fact in own[index])]
        ax.set_title("\n".join(title), fontsize=10.5)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=3, steps=[1, 2, 2.5, 5, 10]))
        ax.tick_params(axis="both", length=0, labelsize=9.5)
        ax.grid(axis="x", alpha=0.35)
        ax.set_axisbelow(True)
        ax.spines[["top", "right", "left"]].set_visible(False)
    for ax in axes.flat[len(runs) :]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_yticks(ys, [textwrap.fill(_label(m), 22) for m in methods], fontsize=10.5)
        for tick, method in zip(row[0].get_yticklabels(), methods, strict=True):
            if method == "lce_patch":
                tick.set_fontweight("bold")
                tick.set_color(HIGHLIGHT)
    setup = _lines(shared, 110)
    fig.suptitle(
        f"Training tokens/s per GPU (higher is better), peak GiB per GPU beside each bar\n{setup}", fontsize=11.5
    )
    if any_left:
        fig.supxlabel(
            f"{LEFT_MARK} started with GPU memory an earlier method of its launch left allocated", fontsize=9.5
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)


def table(runs: list[dict], sources: list[str]) -> str:
    """The chart's numbers as a Markdown table: a row per method, a column per launch, "tokens/s / GiB" cells."""
    methods, cells = _methods(runs), _cells(runs)
    lines = [
        f"<!-- Generated by benchmarks/plot_multi_gpu.py from {', '.join(sources)}; regenerate it rather than editing."
        " -->",
        "",
        "| method | " + " | ".join(cells) + " |",
        "|---|" + "---|" * len(cells),
    ]
    columns, left_notes = [], []
    for run, cell in zip(runs, cells, strict=True):
        numbers = {method: _outcome(run, method) for method in methods}
        timed = {m: tps for m, (tps, _, _) in numbers.items() if tps is not None}
        best = {max(timed, key=timed.get)} if timed else set()
        loss = {m: tps for m, tps in timed.items() if m in LOSS_OPTIONS}
        best |= {max(loss, key=loss.get)} if loss else set()
        column = {}
        for method, (tps, peak, words) in numbers.items():
            if tps is None:
                entry = "–" if words == "not run" else words
            else:
                entry = f"{tps:.0f} / {peak:.1f} GiB" if peak is not None else f"{tps:.0f}"
                entry = f"**{entry}**" if method in best else entry
            if _left(run, method) is not None:
                entry += f" {LEFT_MARK}"
                left_notes.append(f"{_label(method)}, {cell}: {_left(run, method):.1f} GiB")
            column[method] = entry
        columns.append(column)
    for method in methods:
        lines.append(f"| {_label(method)} | " + " | ".join(column[method] for column in columns) + " |")
    setup = ", ".join(
        _by_value(runs, cells, key)
        for key in ("engine", "gpus", "micro-batch", "precision", "checkpointing", "steps", "versions", "date")
        if any(key in _facts(run) for run in runs)
    )
    commits = _by_value(runs, cells, "commit")
    loss_labels = ", ".join(_label(m) for m in LOSS_OPTIONS)
    lines += [
        "",
        f"Tokens/s per GPU / peak allocated GiB per GPU (the maximum over ranks). In bold, per column: the fastest "
        f"loss option ({loss_labels}: the rest of the model as Transformers builds it) and the fastest setup. "
        f"{setup}; {commits}.",
    ]
    if left_notes:
        lines += [
            "",
            f"{LEFT_MARK} Started with GPU memory an earlier method of its launch left allocated ("
            + "; ".join(left_notes)
            + "): its numbers are not its alone; run it in a launch of its own.",
        ]
    return "\n".join(lines) + "\n"


def _source(path: Path) -> str:
    path = Path(path).resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--results",
        nargs="+",
        default=list(DEFAULT_RESULTS),
        help="multi_gpu_train.py JSON files, a panel and a column each, in this order; A.json+B.json makes one "
        "column of launches of one setup (default: the committed four-GPU runs)",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="PNG to write; the table goes beside it (default: %(default)s)"
    )
    args = parser.parse_args()
    runs = load_runs(args.results)
    plot(runs, args.out)
    sources = [" + ".join(_source(path) for path in _column_paths(column)) for column in args.results]
    args.out.with_suffix(".md").write_text(table(runs, sources))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
