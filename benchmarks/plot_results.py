"""Chart and table of a ``bench_lce.py`` run: forward+backward time and peak memory per method and shape.

Reads the JSON that ``benchmarks/bench_lce.py --out`` writes and draws, for each shape of one data kind,
two bar groups, one above the other: milliseconds (with the run's GEMM floor as a dashed line) and peak GiB
above the inputs. Beside the chart it writes the same numbers as a Markdown table (same name, ``.md``). The
documentation's chart and table (``docs/assets/benchmark.png``, ``docs/assets/benchmark.md``) are this
script's output on the committed results:

    python benchmarks/plot_results.py                       # the default results file -> docs/assets/benchmark.{png,md}
    python benchmarks/plot_results.py --results R.json --out chart.png --data flat
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO / "benchmarks" / "results" / "2026-11-28_h200_bench_head_753bdc1.json"
DEFAULT_OUT = REPO / "docs" / "assets" / "benchmark.png"
# Methods in the order drawn, with their legend labels; others in the file are left out.
METHODS = {
    "lce_patch_skip": "lce_patch (patched model)",
    "lce_patch": "lce_patch, every row",
    "compile": "torch.compile",
    "liger": "Liger-Kernel",
    "cce": "Cut Cross-Entropy",
    "trl": "TRL fused head",
    "unfused": "unfused (Hugging Face)",
}
# Display names of bench_lce.py's shapes; a shape not named here is shown as bench_lce.py names it.
SHAPES = {
    "llama3-8b": "Llama-3-8B",
    "qwen2.5-7b": "Qwen2.5-7B",
    "gemma2-2b": "Gemma-2-2B",
    "llama3-8b-frozen": "Llama-3-8B, W frozen",
    "gemma2-2b-frozen": "Gemma-2-2B, W frozen",
}
MEMORY_TICKS_GIB = (0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50)


def load_blocks(path: Path, data: str) -> tuple[dict, list[dict]]:
    """(env, blocks of that data kind) of a ``bench_lce.py`` results file."""
    results = json.loads(Path(path).read_text())
    blocks = [block for block in results["blocks"] if block["data"] == data]
    if not blocks:
        raise SystemExit(
            f"{path}: no '{data}' blocks (kinds present: {sorted({b['data'] for b in results['blocks']})})"
        )
    return results["env"], blocks


def _methods(blocks: list[dict]) -> list[str]:
    return [m for m in METHODS if any(r["method"] == m and "ms" in r for b in blocks for r in b["rows"])]


def _row(block: dict, method: str) -> dict | None:
    return next((r for r in block["rows"] if r["method"] == method and "ms" in r), None)


def _shape_name(block: dict) -> str:
    return SHAPES.get(block["shape"], block["shape"])


def _shape_details(block: dict) -> str:
    details = f"D {block['D']}, V {block['V']}"
    return details + (f", softcap {block['softcap']:g}" if block.get("softcap") else "")


def _setup(env: dict, blocks: list[dict]) -> tuple[str, str]:
    """The run's setup in two lines: the workload, and the machine and versions."""
    sizes = sorted({b["N"] for b in blocks})
    tokens = f"N = {sizes[0]} tokens" if len(sizes) == 1 else "N = " + " / ".join(map(str, sizes)) + " tokens"
    workload = f"Loss forward+backward, {tokens}, bf16, {blocks[0]['data']} data"
    machine = f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date'].split()[0]}"
    return workload, machine


def plot(env: dict, blocks: list[dict], out: Path) -> None:
    """Draw the chart: time above, peak memory below, one bar group per shape, a legend on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter, NullLocator

    methods = _methods(blocks)
    # 8 inches wide: at the documentation's ~700 px column an 11-13 pt label is 13-16 px tall.
    plt.rcParams.update({"font.size": 12, "axes.titlesize": 13, "legend.fontsize": 11.5})
    fig, (ax_time, ax_mem) = plt.subplots(2, 1, figsize=(8, 7.4), sharex=True, layout="constrained")
    width = 0.84 / len(methods)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles = []
    for index, method in enumerate(methods):
        times, mems, xs = [], [], []
        for position, block in enumerate(blocks):
            row = _row(block, method)
            if row is not None:
                xs.append(position + (index - (len(methods) - 1) / 2) * width)
                times.append(row["ms"])
                mems.append(row["peak_mib"] / 1024)
        color = colors[index % len(colors)]
        handles.append(ax_time.bar(xs, times, width, color=color, label=METHODS[method]))
        ax_mem.bar(xs, mems, width, color=color)
    floors = [(position, b.get("gemm_floor_ms")) for position, b in enumerate(blocks) if b.get("gemm_floor_ms")]
    for position, floor in floors:
        ax_time.hlines(floor, position - 0.45, position + 0.45, colors="black", linestyles="dashed", linewidth=1.5)
    if floors:
        handles.append(Line2D([], [], color="black", linestyle="dashed", linewidth=1.5, label="GEMM floor"))

    ax_time.set_title("Forward+backward time, ms (lower is better)", loc="left")
    ax_mem.set_title("Peak memory above the inputs, GiB (log scale)", loc="left")
    ax_time.yaxis.set_major_locator(MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10]))
    ax_mem.set_yscale("log")
    low = min(r["peak_mib"] for b in blocks for r in b["rows"] if r["method"] in methods and "ms" in r) / 1024
    high = max(r["peak_mib"] for b in blocks for r in b["rows"] if r["method"] in methods and "ms" in r) / 1024
    ax_mem.set_ylim(low / 1.4, high * 1.4)
    ax_mem.yaxis.set_major_locator(FixedLocator([t for t in MEMORY_TICKS_GIB if low / 1.4 <= t <= high * 1.4]))
    ax_mem.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax_mem.yaxis.set_minor_locator(NullLocator())
    ax_mem.yaxis.set_minor_formatter(NullFormatter())
    for ax in (ax_time, ax_mem):
        ax.grid(axis="y", alpha=0.35)
        ax.set_axisbelow(True)
        ax.spines[["top", "right"]].set_visible(False)
    ax_mem.set_xticks(range(len(blocks)), [f"{_shape_name(b)}\n{_shape_details(b)}" for b in blocks], fontsize=11.5)
    ax_time.tick_params(axis="x", length=0)
    ax_mem.tick_params(axis="x", length=0)
    workload, machine = _setup(env, blocks)
    # The setup as the legend's title: constrained layout places a legend outside the axes, not beside a suptitle.
    legend = fig.legend(
        handles=handles,
        loc="outside upper center",
        ncol=2,
        frameon=False,
        columnspacing=1.5,
        title=f"{workload}\n{machine}",
        title_fontsize=12.5,
    )
    legend.get_title().set_multialignment("center")
    fig.get_layout_engine().set(w_pad=0.12, h_pad=0.08, hspace=0.06)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)


def table(env: dict, blocks: list[dict], source: str) -> str:
    """The chart's numbers as a Markdown table: a row per method, a column per shape, "ms / MiB" cells."""
    workload, machine = _setup(env, blocks)
    workload = workload.replace("Loss forward+backward", "Forward+backward ms / peak MiB above the inputs")
    lines = [
        f"<!-- Generated by benchmarks/plot_results.py from {source}; regenerate it rather than editing. -->",
        "",
        "| method | " + " | ".join(f"{_shape_name(b)} ({_shape_details(b)})" for b in blocks) + " |",
        "|---|" + "---|" * len(blocks),
    ]
    for method in _methods(blocks):
        cells = []
        for block in blocks:
            row = _row(block, method)
            cells.append("" if row is None else f"{row['ms']:.2f} ms / {row['peak_mib']:.0f} MiB")
        if method == "lce_patch_skip":
            lines.append(f"| **{METHODS[method]}** | " + " | ".join(f"**{c}**" if c else c for c in cells) + " |")
        else:
            lines.append(f"| {METHODS[method]} | " + " | ".join(cells) + " |")
    if any(b.get("gemm_floor_ms") for b in blocks):
        floors = [f"{b['gemm_floor_ms']:.1f} ms" if b.get("gemm_floor_ms") else "" for b in blocks]
        lines.append("| GEMM floor | " + " | ".join(floors) + " |")
    lines += ["", f"{workload}; {machine}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--results", type=Path, default=DEFAULT_RESULTS, help="bench_lce.py JSON (default: %(default)s)"
    )
    parser.add_argument("--data", default="peaked", choices=["peaked", "flat"], help="data kind to draw")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="PNG to write; the table goes beside it (default: %(default)s)"
    )
    args = parser.parse_args()
    env, blocks = load_blocks(args.results, args.data)
    plot(env, blocks, args.out)
    source = args.results.resolve()
    source = source.relative_to(REPO).as_posix() if source.is_relative_to(REPO) else source.name
    args.out.with_suffix(".md").write_text(table(env, blocks, source))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
