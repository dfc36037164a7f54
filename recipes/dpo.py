"""Preference fine-tuning with TRL's DPOTrainer, every log-probability computed by lce_patch without the logits.

DPO scores each chosen and rejected completion under the policy and under a frozen reference model
(a copy of the starting weights, or the policy with its LoRA adapters disabled under ``--lora``).
Since TRL 1.15 both go through TRL's own chunked LM head; ``lce_patch.FusedLCECallback`` serves that
head, on the policy and on the reference, with lce_patch's op, so ``--compare`` measures lce_patch
against TRL's own head. The only change to a plain DPOTrainer script is the callback.

Data: preference pairs with ``prompt``, ``chosen`` and ``rejected`` columns (conversational or plain
text, TRL's standard preference format). The embedded default builds them from the shipped
conversations: the prompt is a conversation up to a user turn, ``chosen`` is the shipped answer,
``rejected`` the answer to another conversation's question.
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
  python recipes/dpo.py --compare                     # embedded model and data: about a minute on 2 CPU cores
  python recipes/dpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/ultrafeedback_binarized --lora \\
      --bf16 --seq-len 2048 --batch-size 4 --grad-accum 4 --max-steps 500 --compare
"""

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


def preference_pairs(conversations: datasets.Dataset) -> datasets.Dataset:
    """One pair per assistant turn of the shipped conversations: the conversation so far as the prompt,
    its answer as ``chosen``, and as ``rejected`` the answer at the same turn of the next conversation
    (another question's answer: fluent, but wrong here)."""
    import datasets

    rows = []
    dialogues = conversations["messages"]
    for index, messages in enumerate(dialogues):
        other = dialogues[(index + 1) % len(dialogues)]
        for turn in range(1, len(messages), 2):
            answer = messages[turn]["content"]
            wrong = other[min(turn, len(other) - 1)]["content"]
            if wrong == answer:
                continue
            rows.append(
                {
                    "prompt": messages[:turn],
                    "chosen": [{"role": "assistant", "content": answer}],
                    "rejected": [{"role": "assistant", "content": wrong}],
                }
            )
    return datasets.Dataset.from_list(rows)


def prepare_dataset(
    args: argparse.Namespace, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase
) -> datasets.Dataset:
    """The preference columns of ``--dataset``, or pairs built from the shipped conversations."""
    columns = dataset.column_names
    if all(c in columns for c in PREFERENCE_COLUMNS):
        return dataset.select_columns(list(PREFERENCE_COLUMNS))
    if "messages" in columns and args.dataset is None:
        import _loading

        return _loading.first_examples(preference_pairs(dataset), args.max_examples)
    raise SystemExit(
        f"the dataset has columns {columns}: DPO needs preference pairs, columns 'prompt', 'chosen' and 'rejected'"
    )


def make_trainer(
    args: argparse.Namespace,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: datasets.Dataset,
    callbacks: list[TrainerCallback],
    output_dir: Path,
) -> Trainer:
    """A TRL DPOTrainer over ``dataset`` with ``callbacks``; the reference model is TRL's default (a copy
    of ``model``, or ``model`` with its adapters disabled under ``--lora``)."""
    import _loading
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(**_loading.training_kwargs(args, output_dir), max_length=args.seq_len, beta=args.beta)
    if not args.lora:
        _loading.make_loadable(model, output_dir)
    return DPOTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=_loading.lora_config(args) if args.lora else None,
        callbacks=callbacks,
    )


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: the command line) and runs the recipe; returns the exit status."""
    parser = build_parser("dpo", __doc__.split("\n\n")[0], EXAMPLES, max_steps=30, batch_size=8)
    parser.add_argument_group("DPO").add_argument(
        "--beta", type=float, default=0.1, help="DPO's beta, the strength of the KL penalty (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    check_args(parser, args)
    if not args.beta > 0:
        parser.error("--beta must be > 0")

    import _running

    metrics = ("rewards/accuracies", "rewards/margins", "logps/chosen", "logits/chosen", "mean_token_accuracy")
    recipe = _running.Recipe("dpo", "TRL head", prepare_dataset, make_trainer, metrics=metrics)
    return _running.run_recipe(recipe, args)


if __name__ == "__main__":
    sys.exit(main())
