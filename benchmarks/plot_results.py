"""Chart of a ``bench_lce.py`` run: forward+backward time and peak memory per method and shape.

Reads the JSON that ``benchmarks/bench_lce.py --out`` writes and draws, for each shape of one data kind,
two bar groups: milliseconds (with the run's GEMM floor as a line) and peak MiB above the inputs. The
documentation's chart (``docs/assets/benchmark.png``) is this script's output on the committed results:

    python benchmarks/plot_results.py                       # the default results file -> docs/assets/benchmark.png
    python benchmarks/plot_results.py --results R.json --out chart.png --data flat
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO / "benchmarks" / "results" / "2026-11-24_h100_bench_head.json"
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


def load_blocks(path: Path, data: str) -> tuple[dict, list[dict]]:
    """(env, blocks of that data kind) of a ``bench_lce.py`` results file."""
    results = json.loads(Path(path).read_text())
    blocks = [block for block in results["blocks"] if block["data"] == data]
    if not blocks:
        raise SystemExit(
            f"{path}: no '{data}' blocks (kinds present: {sorted({b['data'] for b in results['blocks']})})"
        )
    return results["env"], blocks


def plot(env: dict, blocks: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if any(r["method"] == m and "ms" in r for b in blocks for r in b["rows"])]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(methods)
    for index, method in enumerate(methods):
        times, mems, xs = [], [], []
        for position, block in enumerate(blocks):
            row = next((r for r in block["rows"] if r["method"] == method and "ms" in r), None)
            if row is not None:
                xs.append(position + (index - (len(methods) - 1) / 2) * width)
                times.append(row["ms"])
                mems.append(row["peak_mib"] / 1024)
        ax_time.bar(xs, times, width, label=METHODS[method])
        ax_mem.bar(xs, mems, width, label=METHODS[method])
    for position, block in enumerate(blocks):
        floor = block.get("gemm_floor_ms")
        if floor:
            ax_time.hlines(floor, position - 0.42, position + 0.42, colors="black", linestyles="dashed")
    labels = [f"{b['shape']}\nN={b['N']}, V={b['V']}" + (", softcap" if b.get("softcap") else "") for b in blocks]
    for ax, title in (
        (ax_time, "forward+backward, ms (dashed: GEMM floor)"),
        (ax_mem, "peak memory above inputs, GiB"),
    ):
        ax.set_xticks(range(len(blocks)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    ax_mem.set_yscale("log")
    ax_time.legend(fontsize=7, loc="upper left")
    fig.suptitle(
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']} "
        f"(bf16, {blocks[0]['data']} data, lce_patch {env['git'].split('+')[0]})",
        fontsize=9,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--results", type=Path, default=DEFAULT_RESULTS, help="bench_lce.py JSON (default: %(default)s)"
    )
    parser.add_argument("--data", default="peaked", choices=["peaked", "flat"], help="data kind to draw")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="PNG to write (default: %(default)s)")
    args = parser.parse_args()
    env, blocks = load_blocks(args.results, args.data)
    plot(env, blocks, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
