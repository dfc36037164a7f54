"""Supervised fine-tuning with TRL's SFTTrainer, the loss computed by lce_patch without the logits.

Conversational data (a ``messages`` column) is rendered with the tokenizer's chat template;
plain-text data (``--text-column``) and prompt/completion data are taken as they are. Full
fine-tuning by default, LoRA adapters with ``--lora``. The only change to a plain SFTTrainer script
is ``callbacks=[lce_patch.FusedLCECallback()]``.

Since TRL 1.15, SFTTrainer computes its loss with its own chunked LM head; the callback replaces that
head with lce_patch's op, so ``--compare`` here measures lce_patch against TRL's own head.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from _cli import build_parser, check_args

if TYPE_CHECKING:
    import argparse

    import datasets
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback

EXAMPLES = """\
  python recipes/sft.py --compare                     # embedded model and data: about a minute on 2 CPU cores
  python recipes/sft.py --max-steps 200               # train the embedded model longer, save it to runs/sft
  python recipes/sft.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/Capybara --lora --bf16 \\
      --seq-len 2048 --batch-size 4 --grad-accum 4 --max-steps 500 --compare
"""

# Columns SFTTrainer reads, by dataset format; anything else is dropped before it sees the data.
CONVERSATION_COLUMNS = ("messages",)
PROMPT_COMPLETION_COLUMNS = ("prompt", "completion")


def prepare_dataset(
    args: argparse.Namespace, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase
) -> datasets.Dataset:
    """Keeps the columns of the dataset's format; SFTTrainer tokenizes (and templates) the rest itself."""
    columns = dataset.column_names
    for keep in (CONVERSATION_COLUMNS, PROMPT_COMPLETION_COLUMNS, (args.text_column,)):
        if all(c in columns for c in keep):
            if keep == CONVERSATION_COLUMNS and tokenizer.chat_template is None:
                raise SystemExit(f"{args.model}'s tokenizer has no chat template for the 'messages' column")
            return dataset.select_columns(list(keep))
    raise SystemExit(
        f"the dataset has columns {columns}: expected 'messages' (conversations), 'prompt' and 'completion', "
        f"or the text column '{args.text_column}' (see --text-column)"
    )


def make_trainer(
    args: argparse.Namespace,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: datasets.Dataset,
    callbacks: list[TrainerCallback],
    output_dir: Path,
) -> Trainer:
    """A TRL SFTTrainer over ``dataset`` with ``callbacks`` (the fused-loss callback among them, or not)."""
    import _loading
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(
        **_loading.training_kwargs(args, output_dir),
        max_length=args.seq_len,
        dataset_text_field=args.text_column,
        packing=False,
    )
    return SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=_loading.lora_config(args) if args.lora else None,
        callbacks=callbacks,
    )


def baseline_label() -> str:
    """What SFTTrainer does without the callback: TRL's own chunked head (TRL >= 1.15) or full logits."""
    import trl.trainer.utils

    return "TRL head" if hasattr(trl.trainer.utils, "add_fused_lm_head") else "unpatched"


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: the command line) and runs the recipe; returns the exit status."""
    parser = build_parser("sft", __doc__.split("\n\n")[0], EXAMPLES)
    args = parser.parse_args(argv)
    check_args(parser, args)

    import _running

    recipe = _running.Recipe("sft", baseline_label(), prepare_dataset, make_trainer)
    return _running.run_recipe(recipe, args)


if __name__ == "__main__":
    sys.exit(main())
