"""Causal-LM training with the plain transformers Trainer, the loss computed by lce_patch without the logits.

The text (a ``messages`` column rendered with the tokenizer's chat template, or ``--text-column``)
is tokenized, concatenated and cut into blocks of ``--seq-len`` tokens, as in transformers'
``run_clm`` example. The only change to a plain Trainer script is
``callbacks=[lce_patch.FusedLCECallback()]``; ``--compare`` measures it against the unpatched model.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _cli import build_parser, check_args

if TYPE_CHECKING:
    import argparse

    import datasets
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback

EXAMPLES = """\
  python recipes/train.py --compare                   # embedded model and data: about a minute on 2 CPU cores
  python recipes/train.py --model HuggingFaceTB/SmolLM2-135M --dataset roneneldan/TinyStories \\
      --max-examples 20000 --seq-len 1024 --batch-size 8 --bf16 --max-steps 300 --compare
"""


def token_ids(batch: dict[str, list[Any]], tokenizer: PreTrainedTokenizerBase, text_column: str) -> list[list[int]]:
    """Token ids of each example: a rendered conversation, or a text followed by the EOS token."""
    if "messages" in batch:
        texts = [tokenizer.apply_chat_template(messages, tokenize=False) for messages in batch["messages"]]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids = tokenizer(batch[text_column])["input_ids"]
    eos = tokenizer.eos_token_id
    return [row + [eos] if eos is not None and (not row or row[-1] != eos) else row for row in ids]


def prepare_dataset(
    args: argparse.Namespace, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase
) -> datasets.Dataset:
    """Tokenizes, concatenates and cuts the data into ``--seq-len`` blocks (the last partial block is dropped)."""
    columns = dataset.column_names
    if "messages" in columns:
        if tokenizer.chat_template is None:
            raise SystemExit(f"{args.model}'s tokenizer has no chat template for the 'messages' column")
    elif args.text_column not in columns:
        raise SystemExit(f"the dataset has columns {columns}: expected 'messages' or '{args.text_column}'")

    def to_blocks(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        stream = [token for row in token_ids(batch, tokenizer, args.text_column) for token in row]
        size = args.seq_len
        blocks = [stream[i : i + size] for i in range(0, max(len(stream) - size, 0) + 1, size)]
        return {"input_ids": blocks, "attention_mask": [[1] * len(block) for block in blocks]}

    # Batches of 1000 examples are concatenated and cut on their own (as in run_clm).
    return dataset.map(to_blocks, batched=True, batch_size=1000, remove_columns=columns)


def make_trainer(
    args: argparse.Namespace,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: datasets.Dataset,
    callbacks: list[TrainerCallback],
    output_dir: Path,
) -> Trainer:
    """A transformers Trainer over the token blocks with ``callbacks`` (the fused-loss callback among them, or not)."""
    import _loading
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    if args.lora:
        from peft import get_peft_model

        model = get_peft_model(model, _loading.lora_config(args))
    return Trainer(
        model=model,
        args=TrainingArguments(**_loading.training_kwargs(args, output_dir)),
        train_dataset=dataset,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: the command line) and runs the recipe; returns the exit status."""
    # Packed blocks are full: 4 x 256 tokens a step costs as much as sft.py's 8 padded conversations.
    parser = build_parser("train", __doc__.split("\n\n")[0], EXAMPLES, batch_size=4)
    args = parser.parse_args(argv)
    check_args(parser, args)

    import _running

    recipe = _running.Recipe("train", "unpatched", prepare_dataset, make_trainer)
    return _running.run_recipe(recipe, args)


if __name__ == "__main__":
    sys.exit(main())
