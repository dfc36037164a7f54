"""Reporting: what a run prints, and the ``--compare`` table and plot.

:func:`describe` names the model, data and batch shape of a run in one line; :func:`format_table`
sets the two runs of ``--compare`` side by side as text (loss per step, peak memory, time per step,
tokens/s, the recipe's metrics), ending with :func:`speed_note`; :func:`plot_comparison` draws them
as a PNG. ``FUSED`` and ``BASELINE`` are the names of the two runs.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import datasets
import torch
from _cli import EMBEDDED_DATA
from _loading import EMBEDDED_CONFIG, embedded_vocab
from _measuring import MIB, RunResult, Spread, speed_verdict, warmup_steps
from transformers import PreTrainedTokenizerBase

# The names of the two runs of --compare, in the table, the plot and compare.json.
FUSED, BASELINE = "lce_patch", "baseline"


def pct_change(new: float | None, old: float | None) -> str:
    """The change from ``old`` to ``new`` as "+12.3%", or "" where either is missing or NaN or ``old`` is 0."""
    if new is None or old is None or not old or math.isnan(new) or math.isnan(old):
        return ""
    return f"{100 * (new - old) / old:+.1f}%"


def format_table(
    baseline: RunResult,
    fused: RunResult,
    baseline_label: str,
    max_rows: int = 60,
    metrics: tuple[str, ...] = ("mean_token_accuracy", "entropy"),
) -> str:
    """The comparison as text: loss per step (every step, or evenly spaced ones), then a summary."""
    steps = len(baseline.losses)
    every = 1 if steps <= max_rows else math.ceil(steps / (max_rows // 2))
    shown = sorted({*range(0, steps, every), steps - 1}) if steps else []
    width = max(len(baseline_label), len(FUSED), 12)
    lines = [f"{'step':>6}  {baseline_label:>{width}}  {FUSED:>{width}}  {'difference':>10}"]
    for i in shown:
        a, b = baseline.losses[i], fused.losses[i] if i < len(fused.losses) else math.nan
        lines.append(f"{i + 1:>6}  {a:>{width}.4f}  {b:>{width}.4f}  {b - a:>+10.2e}")
    if every > 1:
        lines.append(f"(one step in {every} shown; every step is in compare.json)")
    differences = [abs(b - a) for a, b in zip(baseline.losses, fused.losses)]
    if differences:
        lines.append(f"largest loss difference: {max(differences):.2e}")
    for key in metrics:
        pairs = [(a[key], b[key]) for a, b in zip(baseline.step_logs, fused.step_logs) if key in a and key in b]
        if pairs:
            lines.append(f"largest {key} difference: {max(abs(b - a) for a, b in pairs):.2e}")

    def mib(result: RunResult) -> float | None:
        return None if result.peak_bytes is None else result.peak_bytes / MIB

    def cell(value: float | None, fmt: str) -> str:
        return "n/a" if value is None or math.isnan(value) else format(value, fmt)

    def middle_half(spread: Spread, fmt: str) -> str:
        return "n/a" if not spread.count else f"{spread.p25:{fmt}}-{spread.p75:{fmt}}"

    # (label, baseline cell, fused cell, change)
    rows: list[tuple[str, str, str, str]] = [
        (
            "peak memory (MiB)",
            cell(mib(baseline), ".1f"),
            cell(mib(fused), ".1f"),
            pct_change(mib(fused), mib(baseline)),
        )
    ]
    for label, (a, b), fmt in (
        ("time per step (s)", (baseline.step_time, fused.step_time), ".3f"),
        ("tokens/s", (baseline.tokens_per_second, fused.tokens_per_second), ",.0f"),
    ):
        rows.append((f"{label}, median", cell(a.median, fmt), cell(b.median, fmt), pct_change(b.median, a.median)))
        rows.append(("  middle half (p25-p75)", middle_half(a, fmt), middle_half(b, fmt), ""))
    final_losses = (baseline.losses[-1] if steps else None, fused.losses[-1] if fused.losses else None)
    final_change = pct_change(final_losses[1], final_losses[0])
    rows.append(("final loss", cell(final_losses[0], ".4f"), cell(final_losses[1], ".4f"), final_change))
    for key in metrics:
        if key in baseline.last_metrics and key in fused.last_metrics:
            a, b = baseline.last_metrics[key], fused.last_metrics[key]
            rows.append((f"final {key}", cell(a, ".4f"), cell(b, ".4f"), pct_change(b, a)))
    label = max(len(r[0]) for r in rows)
    width = max(width, *(len(r[i]) for r in rows for i in (1, 2)))
    lines += ["", f"{'':<{label}}  {baseline_label:>{width}}  {FUSED:>{width}}  {'change':>10}"]
    for name, a_cell, b_cell, change in rows:
        lines.append(f"{name:<{label}}  {a_cell:>{width}}  {b_cell:>{width}}  {change:>10}".rstrip())
    lines.append(f"peak memory: {fused.memory_method}")
    lines.append(speed_note(baseline, fused, baseline_label))
    return "\n".join(lines)


def speed_note(baseline: RunResult, fused: RunResult, baseline_label: str) -> str:
    """What the speed rows cover, and the verdict of :func:`speed_verdict` in words: which run is faster, or that
    the difference is within the runs' noise (and why), with what to do about it."""
    steps = len(fused.step_seconds)
    first = warmup_steps(steps) + 1
    covered = f"step {first}" if first == steps else f"steps {first}-{steps}"
    skipped = "" if first == 1 else " (warm-up left out)"
    note = f"time per step and tokens/s: medians over {covered}{skipped}; change: between the medians"
    verdict = speed_verdict(baseline.step_seconds, fused.step_seconds, baseline_label, FUSED)
    if verdict.call != "too noisy to call":
        a, b = baseline.step_time, fused.step_time
        amount = f"{100 * abs(verdict.change):.1f}% {verdict.call}"
        return (
            f"{note}\nspeed: {FUSED}'s median step is {amount} than {baseline_label}'s, beyond both runs' "
            f"step-to-step spread (middle halves {b.p25:.3g}-{b.p75:.3g} s and {a.p25:.3g}-{a.p75:.3g} s)"
        )
    change = pct_change(fused.step_time.median, baseline.step_time.median)
    lines = [note, f"speed: too noisy to call{f' (the medians differ by {change})' if change else ''}:"]
    lines += [f"  - {reason}" for reason in verdict.reasons]
    loads = [r.load_average for r in (baseline, fused)]
    if all(load is not None for load in loads):
        cores = os.cpu_count() or 1
        lines.append(
            f"  - the machine's 1-minute load average at the end of each run: {loads[0]:.1f} and {loads[1]:.1f}, "
            f"on {cores} CPU core{'s' * (cores != 1)} (this process counts in it)"
        )
    lines.append("  Rerun on an idle machine, or with more --max-steps, before reading a speed difference here.")
    return "\n".join(lines)


def plot_comparison(baseline: RunResult, fused: RunResult, baseline_label: str, title: str, path: Path) -> None:
    """Writes a PNG: both loss curves (left), both runs' time per step (middle), both peak memories (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_time, ax_mem) = plt.subplots(1, 3, figsize=(16, 4.4), gridspec_kw={"width_ratios": [2.2, 2.2, 1]})
    runs = ((baseline, baseline_label, "-", "tab:gray"), (fused, FUSED, "--", "tab:blue"))
    for result, label, style, color in runs:
        steps = range(1, len(result.losses) + 1)
        ax_loss.plot(steps, result.losses, style, label=label, linewidth=1.8, color=color)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title="loss per step")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()

    # Time per step, each run's median (over the steps after the warm-up) as a horizontal line.
    warmup = warmup_steps(len(fused.step_seconds))
    timed_max = 0.0
    for result, label, style, color in runs:
        steps = range(1, len(result.step_seconds) + 1)
        ax_time.plot(steps, result.step_seconds, style, color=color, linewidth=1.2, marker=".", markersize=4)
        spread = result.step_time
        if spread.count:
            ax_time.axhline(
                spread.median, color=color, linewidth=1.5, alpha=0.8, label=f"{label}: median {spread.median:.3g} s"
            )
            timed_max = max(timed_max, spread.max)
    if warmup:
        ax_time.axvspan(0.5, warmup + 0.5, color="0.85", alpha=0.6, label="warm-up (left out)")
    if timed_max > 0:
        ax_time.set_ylim(0, timed_max * 1.15)  # a slow warm-up step may run off the top
    change = pct_change(fused.step_time.median, baseline.step_time.median)
    if change and speed_verdict(baseline.step_seconds, fused.step_seconds).call == "too noisy to call":
        change += ", too noisy to call"
    ax_time.set(
        xlabel="optimizer step",
        ylabel="seconds",
        title=f"time per step (median change {change})" if change else "time per step",
    )
    ax_time.grid(alpha=0.3)
    for ax in (ax_loss, ax_time):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_time.legend(fontsize="small")

    if baseline.peak_bytes is not None and fused.peak_bytes is not None:
        values = [baseline.peak_bytes / MIB, fused.peak_bytes / MIB]
        bars = ax_mem.bar([baseline_label, FUSED], values, color=["tab:gray", "tab:blue"])
        ax_mem.bar_label(bars, fmt="%.0f MiB")
        saved = values[0] - values[1]
        verb = "saved" if saved >= 0 else "more"
        ax_mem.set_title(f"peak memory\n{abs(saved):.0f} MiB {verb} ({100 * abs(saved) / values[0]:.0f}%)")
        ax_mem.set_ylabel("MiB")
        ax_mem.set_ylim(0, max(values) * 1.18)
    else:
        ax_mem.text(0.5, 0.5, "peak memory not measured", ha="center", va="center")
        ax_mem.set_axis_off()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def describe(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, dataset: datasets.Dataset) -> str:
    """One line naming the model, data and batch shape of the run."""
    layers, hidden, vocab = (
        EMBEDDED_CONFIG["num_hidden_layers"],
        EMBEDDED_CONFIG["hidden_size"],
        embedded_vocab(tokenizer),
    )
    model = args.model or f"a small Llama built from a config ({layers} layers, hidden {hidden}, vocab {vocab})"
    data = args.dataset or EMBEDDED_DATA.name
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    return (
        f"{model}{' + LoRA' if args.lora else ''} on {data} ({len(dataset)} training sequences), {args.max_steps} steps of "
        f"{args.batch_size}x{args.grad_accum} sequences <= {args.seq_len} tokens, "
        f"{'bf16' if args.bf16 else 'fp32'}, {device}"
    )
