"""Convergence: does a model trained through lce_patch follow the loss curve of the same model trained without it?

The fused op computes the same loss and gradients as Hugging Face's head + cross-entropy, but in a
different order (chunked GEMMs, its own reductions), so its bf16 roundings differ and training
drifts apart a little, step by step. This script measures that drift and puts it next to the two
spreads that are there anyway:

  * ``unpatched``        the reference run (data order from seed 0);
  * ``unpatched-rerun``  the same run again: the GPU's own run-to-run nondeterminism (0 if it has none);
  * ``patched``          the same run with ``apply_fused_lce(model)`` applied before training;
  * ``unpatched-seed1``  the same initial weights, data in another order (seed 1): the natural spread.

All four start from the same initial weights (``--init-seed``) and see the same sequences; only the
seed-1 run sees them in another order. The verdict: "patched within spread: yes" when the largest
difference of the 20-step moving averages, patched vs unpatched, is at most that of unpatched-seed1
vs unpatched.

Models are built from configs (random weights, no download) of two registered architectures:
``llama`` (hidden 512, 8 layers, vocab 32000, untied head) and ``gemma2`` (hidden 512, 6 layers,
vocab 32000, tied head, final-logit softcap 30, attention softcap 50). Data needs no download
either: sequences of a random first-order Markov chain over the whole vocabulary (each token has 8
successors; frequent tokens follow a Zipf law, like text), drawn once from ``--data-seed``. The loss
starts near ln(32000) = 10.4 and falls towards the chain's entropy (about 1.8 nats) as the model
learns the transitions. Each sequence begins with a "prompt" of 1/16 to 1/4 of its tokens whose
labels are -100, so ignore_index is exercised; labels are otherwise the input ids (Hugging Face
shifts them inside the model).

Precision: fp32 master weights, forward and backward under ``torch.autocast(bfloat16)``, as
``Trainer(bf16=True)`` does; the fused op then casts like ``F.linear`` would. ``--dtype fp32`` turns
autocast off. Training: a plain PyTorch loop, AdamW (betas 0.9/0.95, weight decay 0.1), lr 3e-4
with a linear warm-up of 20 steps and a cosine decay to 10%, gradients clipped to norm 1; no
dropout, so the data order is the only randomness.

On a GPU (defaults: both architectures, 300 steps of batch 8 x 512 tokens; 2.5 minutes on an H100,
about 15 s a run):

    python benchmarks/checks/convergence.py --out runs/convergence

CPU smoke test (tiny configs, fp32; the patched model falls back to the torch backend):

    python benchmarks/checks/convergence.py --device cpu --tiny --steps 3 --out /tmp/conv

Writes ``convergence.json`` (every run's per-step losses and gradient norms, the summary, the
environment) and ``convergence.png`` (loss curves, and the moving-average differences) to ``--out``
(default: ``$OUT`` if set, else ``runs/convergence``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_common, in benchmarks/
from bench_common import IGNORE, env_info, free  # noqa: E402  (it puts this checkout's lce_patch first on sys.path)
from model_configs import decoder, tiny  # noqa: E402

ARCHS = ("llama", "gemma2")
REFERENCE, RERUN, PATCHED, OTHER_ORDER = "unpatched", "unpatched-rerun", "patched", "unpatched-seed1"
# run name -> (data-order seed, patched)
RUNS: dict[str, tuple[int, bool]] = {
    REFERENCE: (0, False),
    RERUN: (0, False),
    PATCHED: (0, True),
    OTHER_ORDER: (1, False),
}
COMPARED = (PATCHED, RERUN, OTHER_ORDER)  # each against REFERENCE

# Config fields per architecture: full size (the GPU run) and --tiny (the CPU smoke test).
_LLAMA = decoder(
    (512, 1536, 8, 8, 4, 32000),
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
_GEMMA2 = decoder(
    (512, 1536, 6, 8, 4, 32000),
    head_dim=64,
    query_pre_attn_scalar=64,
    max_position_embeddings=1024,
    sliding_window=256,
    final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0,
)
_TINY = tiny(vocab_size=512, max_position_embeddings=128)
_TINY_GEMMA2 = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=32)
# Gemma-2's attention softcap needs the eager attention (SDPA has no softcap).
ATTENTION = {"llama": "sdpa", "gemma2": "eager"}


def build_config(arch: str, tiny: bool) -> Any:
    from transformers import AutoConfig

    fields = dict(_LLAMA) if arch == "llama" else dict(_GEMMA2)
    if tiny:
        fields.update(_TINY, **(_TINY_GEMMA2 if arch == "gemma2" else {}))
    return AutoConfig.for_model(arch, **fields)


def build_initial_model(arch: str, tiny: bool, init_seed: int) -> torch.nn.Module:
    """The fp32 model every run of ``arch`` starts from (a deep copy of it), on the CPU."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(init_seed)
    return AutoModelForCausalLM.from_config(
        build_config(arch, tiny), attn_implementation=ATTENTION[arch], dtype=torch.float32
    )


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainingSet:
    """Fixed sequences with their labels; a run reads them in the order of its own seed."""

    input_ids: torch.Tensor  # [num_sequences, seq_len] int64
    labels: torch.Tensor  # the input ids with each sequence's prompt prefix set to IGNORE
    entropy_nats: float  # bound on the chain's entropy per token, about the lowest reachable loss

    def order(self, seed: int) -> torch.Tensor:
        return torch.randperm(len(self.input_ids), generator=torch.Generator().manual_seed(seed))


def markov_training_set(
    num_sequences: int, seq_len: int, vocab_size: int, seed: int, successors: int = 8, zipf_exponent: float = 1.1
) -> TrainingSet:
    """Sequences of a random first-order Markov chain over the vocabulary, with masked prompt prefixes.

    Each token has ``successors`` next tokens, drawn by a Zipf law over a shuffled vocabulary (so some
    tokens are frequent, as in text), taken with probabilities proportional to 1/rank.
    """
    generator = torch.Generator().manual_seed(seed)
    rank_weights = torch.arange(1, vocab_size + 1, dtype=torch.float64).pow(-zipf_exponent)
    token_of_rank = torch.randperm(vocab_size, generator=generator)
    next_tokens = token_of_rank[
        torch.multinomial(rank_weights, vocab_size * successors, replacement=True, generator=generator)
    ].view(vocab_size, successors)
    next_probs = 1.0 / torch.arange(1, successors + 1, dtype=torch.float64)
    next_probs /= next_probs.sum()
    cumulative = next_probs.cumsum(0).expand(num_sequences, successors).contiguous()

    input_ids = torch.empty(num_sequences, seq_len, dtype=torch.int64)
    input_ids[:, 0] = token_of_rank[torch.multinomial(rank_weights, num_sequences, True, generator=generator)]
    for position in range(1, seq_len):
        uniform = torch.rand(num_sequences, 1, generator=generator, dtype=torch.float64)
        choice = torch.searchsorted(cumulative, uniform).clamp_(max=successors - 1).squeeze(1)
        input_ids[:, position] = next_tokens[input_ids[:, position - 1], choice]

    prompt_lengths = torch.randint(max(seq_len // 16, 1), seq_len // 4 + 1, (num_sequences,), generator=generator)
    labels = input_ids.clone()
    labels[torch.arange(seq_len) < prompt_lengths[:, None]] = IGNORE
    # Repeated successors of one token merge, so this is an upper bound of the true entropy.
    entropy = float(-(next_probs * next_probs.log()).sum())
    return TrainingSet(input_ids=input_ids, labels=labels, entropy_nats=entropy)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainingOptions:
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    use_bf16_autocast: bool
    device: torch.device


@dataclasses.dataclass
class RunResult:
    name: str
    data_seed: int
    patched: bool
    fused_path_used: bool  # the training forward returned no logits (lce_patch's fused loss ran)
    losses: list[float]
    grad_norms: list[float]
    seconds: float
    tokens_per_second: float | None  # over the steps after the first five (warm-up, compilation)
    peak_gib: float | None


def lr_multiplier(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up, then a cosine decay to 10% of the peak."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    name: str,
    initial_model: torch.nn.Module,
    data: TrainingSet,
    options: TrainingOptions,
    data_seed: int,
    patched: bool,
) -> RunResult:
    """One run from a copy of ``initial_model``: ``options.steps`` AdamW steps, losses kept on the device."""
    from lce_patch import apply_fused_lce

    device = options.device
    model = copy.deepcopy(initial_model).to(device)
    if patched:
        apply_fused_lce(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, options.warmup_steps, options.steps)
    )
    order = data.order(data_seed)
    input_ids, labels = data.input_ids.to(device), data.labels.to(device)
    torch.manual_seed(data_seed)  # nothing in the step draws random numbers (no dropout); set for good measure
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    warm_steps = min(5, options.steps - 1)
    losses: list[torch.Tensor] = []
    grad_norms: list[torch.Tensor] = []
    fused_path_used = False
    synchronize(device)
    start = timed_from = time.perf_counter()
    for step in range(options.steps):
        if step == warm_steps:
            synchronize(device)
            timed_from = time.perf_counter()
        batch = order[step * options.batch_size : (step + 1) * options.batch_size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=options.use_bf16_autocast):
            outputs = model(input_ids=input_ids[batch], labels=labels[batch])
        if step == 0:
            fused_path_used = outputs.logits is None
        outputs.loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(outputs.loss.detach())
        del outputs
    synchronize(device)
    stop = time.perf_counter()

    timed_steps = options.steps - warm_steps
    tokens_per_step = options.batch_size * input_ids.shape[1]
    result = RunResult(
        name=name,
        data_seed=data_seed,
        patched=patched,
        fused_path_used=fused_path_used,
        losses=torch.stack(losses).float().tolist(),
        grad_norms=torch.stack(grad_norms).float().tolist(),
        seconds=stop - start,
        tokens_per_second=tokens_per_step * timed_steps / (stop - timed_from) if timed_steps > 0 else None,
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    )
    del model, optimizer, schedule
    free()
    return result


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------


def moving_average(values: list[float], window: int) -> list[float]:
    """Means of every ``window`` consecutive values (len(values) - window + 1 of them)."""
    window = max(1, min(window, len(values)))
    tensor = torch.tensor(values, dtype=torch.float64)
    return tensor.unfold(0, window, 1).mean(1).tolist()


def difference_stats(run: list[float], reference: list[float], window: int) -> dict[str, float]:
    """Mean and max |run - reference| per step and between their ``window``-step moving averages."""
    per_step = (torch.tensor(run, dtype=torch.float64) - torch.tensor(reference, dtype=torch.float64)).abs()
    smoothed = (torch.tensor(moving_average(run, window)) - torch.tensor(moving_average(reference, window))).abs()
    return {
        "first_step": per_step[0].item(),
        "mean": per_step.mean().item(),
        "max": per_step.max().item(),
        "moving_average_mean": smoothed.mean().item(),
        "moving_average_max": smoothed.max().item(),
    }


def summarize(results: dict[str, RunResult], window: int) -> dict[str, Any]:
    reference = results[REFERENCE].losses
    window = max(1, min(window, len(reference)))  # shorter runs: one window over all their steps
    differences = {name: difference_stats(results[name].losses, reference, window) for name in COMPARED}
    within = differences[PATCHED]["moving_average_max"] <= differences[OTHER_ORDER]["moving_average_max"]
    return {
        "window": window,
        "differences_vs_unpatched": differences,
        "final_loss": {name: sum(r.losses[-window:]) / window for name, r in results.items()},
        "patched_within_spread": within,
    }


def format_report(arch: str, results: dict[str, RunResult], summary: dict[str, Any], max_rows: int = 12) -> str:
    names = list(results)
    steps = len(results[REFERENCE].losses)
    every = max(1, math.ceil(steps / max_rows))
    shown = sorted({*range(0, steps, every), steps - 1})
    width = max(len(n) for n in names)
    lines = [
        f"== {arch}: loss per step (every step in convergence.json)",
        "  step  " + "  ".join(f"{n:>{width}}" for n in names),
    ]
    for step in shown:
        lines.append(f"{step + 1:>6}  " + "  ".join(f"{results[n].losses[step]:>{width}.4f}" for n in names))

    window = summary["window"]
    header = f"{'|difference| vs unpatched':<20}{'step 1':>10}{'mean':>10}{'max':>10}{f'MA{window} mean':>12}{f'MA{window} max':>12}"
    lines += ["", header]
    for name, stats in summary["differences_vs_unpatched"].items():
        lines.append(
            f"{name:<20}{stats['first_step']:>10.2e}{stats['mean']:>10.2e}{stats['max']:>10.2e}"
            f"{stats['moving_average_mean']:>12.2e}{stats['moving_average_max']:>12.2e}"
        )
    lines += ["", f"{'run':<18}{'final loss':>12}{'fused path':>12}{'seconds':>9}{'tokens/s':>11}{'peak GiB':>10}"]
    for name, result in results.items():
        tokens = "n/a" if result.tokens_per_second is None else f"{result.tokens_per_second:,.0f}"
        peak = "n/a" if result.peak_gib is None else f"{result.peak_gib:.2f}"
        lines.append(
            f"{name:<18}{summary['final_loss'][name]:>12.4f}{'yes' if result.fused_path_used else 'no':>12}"
            f"{result.seconds:>9.1f}{tokens:>11}{peak:>10}"
        )
    lines.append(f"(final loss: mean of the last {window} steps; MA{window}: {window}-step moving average)")
    patched_max = summary["differences_vs_unpatched"][PATCHED]["moving_average_max"]
    spread_max = summary["differences_vs_unpatched"][OTHER_ORDER]["moving_average_max"]
    verdict = "yes" if summary["patched_within_spread"] else "no"
    lines.append(
        f"{arch}: patched within spread: {verdict} "
        f"(MA{window} max |patched - unpatched| {patched_max:.2e} vs |unpatched-seed1 - unpatched| {spread_max:.2e})"
    )
    return "\n".join(lines)


def plot(per_arch: dict[str, dict[str, RunResult]], window: int, title: str, path: Path) -> None:
    """Top row: the loss curves of the four runs, one panel per architecture. Bottom row: each run's
    |difference| from ``unpatched``, per step and of the moving averages (log scale: exact zeros leave gaps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = list(per_arch)
    fig, axes = plt.subplots(2, len(archs), figsize=(6.5 * len(archs), 7.5), squeeze=False, sharex="col")
    styles = {
        REFERENCE: ("black", "-"),
        RERUN: ("tab:gray", ":"),
        PATCHED: ("tab:blue", "--"),
        OTHER_ORDER: ("tab:orange", "-"),
    }
    for column, arch in enumerate(archs):
        results = per_arch[arch]
        ax_loss, ax_diff = axes[0][column], axes[1][column]
        for name, result in results.items():
            color, style = styles[name]
            ax_loss.plot(range(1, len(result.losses) + 1), result.losses, style, color=color, label=name, linewidth=1.1)
        ax_loss.set(title=f"{arch}: training loss", ylabel="loss")
        ax_loss.grid(alpha=0.3)
        ax_loss.legend()

        reference_losses = results[REFERENCE].losses
        reference = moving_average(reference_losses, window)
        effective_window = len(reference_losses) - len(reference) + 1
        marker = "." if len(reference_losses) < 30 else None  # short runs: a point must show
        for name in COMPARED:
            color, style = styles[name]
            per_step = [abs(a - b) or math.nan for a, b in zip(results[name].losses, reference_losses)]
            smoothed = [abs(a - b) or math.nan for a, b in zip(moving_average(results[name].losses, window), reference)]
            identical = all(math.isnan(d) for d in per_step)
            label = f"{name} - unpatched" + (" (identical)" if identical else "")
            ax_diff.plot(range(1, len(per_step) + 1), per_step, "-", color=color, alpha=0.2, linewidth=0.8)
            ax_diff.plot(
                range(effective_window, effective_window + len(smoothed)),
                smoothed,
                style,
                color=color,
                label=label,
                linewidth=1.5,
                marker=marker,
            )
        ax_diff.set(
            title=f"{arch}: |difference| from unpatched (faint: per step; bold: MA{effective_window})",
            xlabel="optimizer step",
            ylabel="|loss difference|",
        )
        ax_diff.set_yscale("log")
        ax_diff.grid(alpha=0.3, which="both")
        ax_diff.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=[*ARCHS, "all"], default="all", help="model config to train (default: both)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8; --tiny: 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 512; --tiny: 64)")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--window", type=int, default=20, help="moving-average window and final-loss steps")
    parser.add_argument("--init-seed", type=int, default=0, help="seed of the initial weights (shared by all runs)")
    parser.add_argument("--data-seed", type=int, default=1234, help="seed of the Markov chain and its sequences")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="bf16: fp32 weights under bf16 autocast (default on CUDA); fp32: no autocast (default on CPU)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny configs (vocab 512, hidden 64) for a CPU smoke test")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/convergence"))
    args = parser.parse_args()
    if args.batch_size is None:
        args.batch_size = 4 if args.tiny else 8
    if args.seq_len is None:
        args.seq_len = 64 if args.tiny else 512
    if args.dtype is None:
        args.dtype = "bf16" if torch.device(args.device).type == "cuda" else "fp32"
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    archs = list(ARCHS) if args.arch == "all" else [args.arch]
    args.out.mkdir(parents=True, exist_ok=True)
    options = TrainingOptions(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        use_bf16_autocast=args.dtype == "bf16",
        device=device,
    )
    precision = "fp32 weights, bf16 autocast" if options.use_bf16_autocast else "fp32"
    setup = (
        f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens, {precision}, AdamW lr {args.lr:g} "
        f"(warm-up {args.warmup_steps}, cosine), {'tiny configs, ' if args.tiny else ''}device {device}"
    )
    print(setup, flush=True)

    per_arch: dict[str, dict[str, RunResult]] = {}
    record: dict[str, Any] = {
        "setup": setup,
        "args": {**vars(args), "out": str(args.out)},
        "env": env_info(),
        "archs": {},
    }
    reports = []
    for arch in archs:
        initial_model = build_initial_model(arch, args.tiny, args.init_seed)
        config = initial_model.config
        data = markov_training_set(args.steps * args.batch_size, args.seq_len, config.vocab_size, args.data_seed)
        parameters = sum(p.numel() for p in initial_model.parameters())
        print(
            f"\n{arch}: {parameters / 1e6:.1f}M parameters, hidden {config.hidden_size}, {config.num_hidden_layers} "
            f"layers, vocab {config.vocab_size}; data: {len(data.input_ids)} sequences, chain entropy <= "
            f"{data.entropy_nats:.2f} nats",
            flush=True,
        )
        results: dict[str, RunResult] = {}
        for name, (data_seed, patched) in RUNS.items():
            results[name] = train(name, initial_model, data, options, data_seed, patched)
            r = results[name]
            print(
                f"  {name:<16} loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f}  {r.seconds:.1f} s"
                + ("" if r.patched == r.fused_path_used else "  (warning: fused path used != patched)"),
                flush=True,
            )
        summary = summarize(results, args.window)
        per_arch[arch] = results
        reports.append(format_report(arch, results, summary))
        print("\n" + reports[-1], flush=True)
        record["archs"][arch] = {
            "config": config.to_diff_dict(),
            "parameters": parameters,
            "attention": ATTENTION[arch],
            "chain_entropy_nats": data.entropy_nats,
            "summary": summary,
            "runs": {name: dataclasses.asdict(r) for name, r in results.items()},
        }
        del initial_model, data
        free()

    json_path, png_path = args.out / "convergence.json", args.out / "convergence.png"
    json_path.write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
    plot(per_arch, args.window, f"lce_patch convergence: {setup}", png_path)
    print("\n" + "\n".join(r.splitlines()[-1] for r in reports))
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
