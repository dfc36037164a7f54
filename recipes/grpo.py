"""Reinforcement learning with TRL's GRPOTrainer, every log-probability computed by lce_patch without the logits.

GRPO samples several completions per prompt, scores them with reward functions, and trains the policy
on the completions' per-token log-probabilities (and entropies), with a KL penalty against a frozen
reference model when ``--beta`` > 0. Since TRL 1.15 both models' log-probabilities go through TRL's
own chunked LM head; ``lce_patch.FusedLCECallback`` serves that head with lce_patch's op, so
``--compare`` measures lce_patch against TRL's own head. Generation is the model's own ``generate``
(no vLLM needed). The only change to a plain GRPOTrainer script is the callback.

Data: a ``prompt`` column (conversational or plain text) and, for the built-in reward, a reference
answer column (``--answer-column``). The embedded default takes both from the shipped conversations:
the conversation up to a user turn, and the shipped answer. The reward is the overlap of the
completion with the reference answer (word F1, plus character-bigram F1 so that even an untrained
model's completions get different rewards).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _cli import build_parser, check_args

if TYPE_CHECKING:
    import argparse

    import datasets
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback

EXAMPLES = """\
  python recipes/grpo.py --compare                    # embedded model and data: about a minute on 2 CPU cores
  python recipes/grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --dataset-config main \\
      --answer-column answer --lora --bf16 --batch-size 8 --num-generations 8 --max-steps 200 --compare
"""


def prompts_and_answers(conversations: datasets.Dataset) -> datasets.Dataset:
    """One row per assistant turn of the shipped conversations: the conversation up to the user's turn as
    the prompt, the shipped reply as the reference answer."""
    import datasets

    rows = [
        {"prompt": messages[:turn], "answer": messages[turn]["content"]}
        for messages in conversations["messages"]
        for turn in range(1, len(messages), 2)
    ]
    return datasets.Dataset.from_list(rows)


def _text(completion: Any) -> str:
    """A completion as text: conversational completions are lists of messages."""
    if isinstance(completion, list):
        return " ".join(str(message.get("content", "")) for message in completion)
    return str(completion)


def _f1(predicted: list[str], reference: list[str]) -> float:
    common = sum((Counter(predicted) & Counter(reference)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def answer_overlap_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """Word F1 plus half the character-bigram F1 between each completion and its reference answer."""
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        text, reference = _text(completion).lower(), str(reference).lower()
        bigrams = [text[i : i + 2] for i in range(len(text) - 1)]
        reference_bigrams = [reference[i : i + 2] for i in range(len(reference) - 1)]
        rewards.append(_f1(text.split(), reference.split()) + 0.5 * _f1(bigrams, reference_bigrams))
    return rewards


def prepare_dataset(
    args: argparse.Namespace, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase
) -> datasets.Dataset:
    """``prompt`` and ``answer`` columns: from ``--dataset`` (``--prompt-column``, ``--answer-column``), or
    built from the shipped conversations."""
    columns = dataset.column_names
    if args.dataset is None and "messages" in columns:
        import _loading

        return _loading.first_examples(prompts_and_answers(dataset), args.max_examples)
    missing = [c for c in (args.prompt_column, args.answer_column) if c not in columns]
    if missing:
        raise SystemExit(
            f"the dataset has columns {columns}, not {missing}: GRPO here needs prompts (--prompt-column) and "
            "reference answers for the built-in reward (--answer-column)"
        )
    dataset = dataset.select_columns([args.prompt_column, args.answer_column])
    renames = {args.prompt_column: "prompt", args.answer_column: "answer"}
    return dataset.rename_columns({old: new for old, new in renames.items() if old != new})


def make_trainer(
    args: argparse.Namespace,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: datasets.Dataset,
    callbacks: list[TrainerCallback],
    output_dir: Path,
) -> Trainer:
    """A TRL GRPOTrainer over ``dataset`` with ``callbacks`` and the answer-overlap reward."""
    import _loading
    from trl import GRPOConfig, GRPOTrainer

    # GRPO's batches hold prompts, not ``input_ids``: the Trainer's token count would warn at every step that
    # it cannot count them; the recipe counts the tokens GRPO trains on from TRL's own ``num_tokens`` instead.
    config = GRPOConfig(
        **{**_loading.training_kwargs(args, output_dir), "include_num_input_tokens_seen": "no"},
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        beta=args.beta,
        temperature=args.temperature,
    )
    if args.beta > 0 and not args.lora:
        _loading.make_loadable(model, output_dir)
    return GRPOTrainer(
        model=model,
        reward_funcs=answer_overlap_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=_loading.lora_config(args) if args.lora else None,
        callbacks=callbacks,
    )


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: the command line) and runs the recipe; returns the exit status."""
    parser = build_parser("grpo", __doc__.split("\n\n")[0], EXAMPLES, max_steps=20, batch_size=8)
    group = parser.add_argument_group("GRPO")
    group.add_argument("--num-generations", type=int, default=4, help="completions per prompt (default: %(default)s)")
    group.add_argument(
        "--max-completion-length", type=int, default=24, help="tokens per completion (default: %(default)s)"
    )
    group.add_argument(
        "--beta", type=float, default=0.04, help="KL penalty; 0 drops the reference model (default: %(default)s)"
    )
    group.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: %(default)s)")
    group.add_argument("--prompt-column", default="prompt", help="prompt column of --dataset (default: %(default)s)")
    group.add_argument(
        "--answer-column", default="answer", help="reference answers of --dataset (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.num_generations < 2:
        parser.error("--num-generations must be >= 2 (GRPO compares completions of one prompt)")
    if args.batch_size % args.num_generations:
        parser.error("--batch-size must be a multiple of --num-generations")
    if args.max_completion_length < 1 or args.beta < 0 or not args.temperature > 0:
        parser.error("--max-completion-length must be >= 1, --beta >= 0 and --temperature > 0")

    import _running

    metrics = ("reward", "reward_std", "kl", "entropy", "completions/mean_length")
    recipe = _running.Recipe("grpo", "TRL head", prepare_dataset, make_trainer, metrics=metrics)
    return _running.run_recipe(recipe, args)


if __name__ == "__main__":
    sys.exit(main())
