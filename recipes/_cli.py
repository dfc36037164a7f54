"""Command-line options shared by the recipes.

This module imports only the standard library, so ``--help`` answers at once; the heavy imports
(torch, transformers, TRL) happen in ``_loading``, ``_measuring``, ``_reporting`` and ``_running``, which
the recipes import after the arguments are parsed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent
EMBEDDED_DATA = RECIPES_DIR / "data" / "chat.jsonl"

EPILOG = """\
With no --model and no --dataset the recipe needs no download and no GPU: it builds a small Llama
from a config, trains a tokenizer on the shipped data (recipes/data/chat.jsonl, conversations
about capitals, opposites, plurals, animals, days, counting and sums) and fine-tunes on that.

--compare runs the same steps twice, without and with the fused loss, from the same initial weights
and in the same data order, then prints a table (loss per step, peak memory, time per step,
tokens/s) and writes <output-dir>/compare.png (loss, time per step, peak memory) and compare.json.
Time per step and tokens/s are medians over the steps after the warm-up (the first step, the first
two from 10 steps on), with their middle half (25th-75th percentile); the change is between the
medians, so a few slow steps (a busy machine, a compilation) do not decide it. Peak memory is
torch.cuda.max_memory_allocated on a GPU. On a CPU it is the peak of live tensor bytes (weights
included), tracked op by op with a TorchDispatchMode, which slows both runs alike (by 10-25%).
"""


def build_parser(recipe: str, description: str, examples: str, **defaults: object) -> argparse.ArgumentParser:
    """The parser holding the options both recipes share; ``defaults`` overrides some of their defaults."""
    parser = argparse.ArgumentParser(
        prog=f"python recipes/{recipe}.py",
        description=description,
        epilog=f"examples:\n{examples}\n{EPILOG}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    data = parser.add_argument_group("model and data")
    data.add_argument(
        "--model",
        help="hub id or local path of a causal LM (default: a small Llama built from a config, random weights)",
    )
    data.add_argument(
        "--dataset",
        help=f"hub id, or a local .json/.jsonl file (default: the shipped {EMBEDDED_DATA.relative_to(RECIPES_DIR.parent)})",
    )
    data.add_argument("--dataset-config", help="hub dataset configuration (subset) name")
    data.add_argument("--dataset-split", default="train", help="dataset split (default: %(default)s)")
    data.add_argument(
        "--text-column",
        default="text",
        help="column of plain-text data; a 'messages' column is used as conversations instead (default: %(default)s)",
    )
    data.add_argument("--max-examples", type=int, help="use only the first N examples")

    train = parser.add_argument_group("training")
    train.add_argument("--max-steps", type=int, default=60, help="optimizer steps (default: %(default)s)")
    train.add_argument("--seq-len", type=int, default=256, help="maximum tokens per sequence (default: %(default)s)")
    train.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch (default: %(default)s)")
    train.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default: %(default)s)"
    )
    train.add_argument(
        "--lr",
        type=float,
        help="peak learning rate, cosine schedule with 10%% warmup "
        "(default: 1e-3 for the embedded model, 2e-4 with --lora, 2e-5 otherwise)",
    )
    train.add_argument("--bf16", action="store_true", help="bf16 mixed precision (autocast)")
    train.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    train.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) instead of all weights")
    train.add_argument("--lora-rank", type=int, default=16, help="LoRA rank, alpha = 2 * rank (default: %(default)s)")
    train.add_argument(
        "--seed", type=int, default=0, help="seed of the weights and the data order (default: %(default)s)"
    )
    train.add_argument(
        "--chunk-size",
        type=int,
        help="fused loss: tokens per chunk, the memory/speed knob (default: lce_patch's own choice)",
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--output-dir",
        type=Path,
        help=f"where the trained model goes (default: runs/{recipe}), or with --compare the comparison's plot, "
        f"JSON and one subfolder per run (default: runs/{recipe}-compare)",
    )
    out.add_argument(
        "--compare",
        action="store_true",
        help="train twice, without and with the fused loss, and print/plot the comparison",
    )
    parser.set_defaults(**defaults)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject values that would only fail later, deep inside the Trainer."""
    for name in ("max_steps", "seq_len", "batch_size", "grad_accum", "lora_rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_examples is not None and args.max_examples < 1:
        parser.error("--max-examples must be >= 1")
    if args.chunk_size is not None and args.chunk_size < 1:
        parser.error("--chunk-size must be >= 1")
    if args.lr is not None and not args.lr > 0:
        parser.error("--lr must be > 0")
