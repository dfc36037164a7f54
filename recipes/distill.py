"""On-policy distillation with TRL's DistillationTrainer, the divergence computed by lce_patch without the logits.

The student samples completions of the prompts; the loss is the generalized Jensen-Shannon divergence (``--beta``:
0 forward KL, 1 reverse KL) between the student's and the teacher's next-token distributions on them. TRL computes
it with its own chunked divergence kernel; ``lce_patch.FusedLCECallback`` serves the trainer with
``lce_patch.fused_linear_divergence`` instead, so ``--compare`` measures lce_patch against TRL's kernel. Generation
is the model's own ``generate`` (no vLLM needed). The only change to a plain DistillationTrainer script is the
callback.

Data: a ``prompt`` column (conversational or plain text). The embedded default takes the prompts from the shipped
conversations (each conversation up to a user turn); its teacher is a wider Llama (hidden 384) that first learns
the shipped conversations for ``--teacher-steps`` steps (the fused cross-entropy loss, a plain loop), so the
student has something to learn from it; the student is the embedded Llama from fresh weights. With ``--model``,
give ``--teacher`` too (a causal LM of the same vocabulary).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from _cli import build_parser, check_args

if TYPE_CHECKING:
    import argparse

    import datasets
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback

EXAMPLES = """\
  python recipes/distill.py --compare                 # embedded teacher, student and data: about a minute on 2 CPU cores
  python recipes/distill.py --model Qwen/Qwen2.5-0.5B-Instruct --teacher Qwen/Qwen2.5-1.5B-Instruct \\
      --dataset trl-lib/Capybara --prompt-column messages --bf16 --batch-size 8 --max-steps 200 --compare
"""

# The embedded teacher: the embedded student's shape, wider.
TEACHER_CONFIG = dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2)
TEACHER_LR = 2e-3

_teacher_cache: dict[str, PreTrainedModel] = {}


def add_teacher_options(group: argparse._ArgumentGroup) -> None:
    """``--teacher`` and ``--teacher-steps``, the options of the teacher (also distill_top_k.py's)."""
    group.add_argument(
        "--teacher",
        help="hub id or local path of the teacher, same vocabulary as the student (default: the embedded teacher)",
    )
    group.add_argument(
        "--teacher-steps",
        type=int,
        default=60,
        help="steps the embedded teacher first trains on the shipped data (default: %(default)s)",
    )


def check_teacher_args(parser: argparse.ArgumentParser, args: argparse.Namespace, needed: bool = True) -> None:
    """A real student needs a real teacher of its vocabulary, and the reverse (unless no teacher is ``needed``)."""
    if needed and args.model and not args.teacher:
        parser.error("--model needs --teacher (a causal LM with the student's vocabulary)")
    if args.teacher and not args.model:
        parser.error("--teacher needs --model (the embedded student's vocabulary is the embedded tokenizer's)")
    if args.teacher_steps < 0:
        parser.error("--teacher-steps must be >= 0")


def train_embedded_teacher(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, conversations: datasets.Dataset
) -> PreTrainedModel:
    """A wider embedded Llama fitted to the shipped conversations for ``--teacher-steps`` steps (fused loss)."""
    import _loading
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, set_seed

    import lce_patch

    set_seed(args.seed + 1)
    config = LlamaConfig(
        vocab_size=_loading.embedded_vocab(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **{**_loading.EMBEDDED_CONFIG, **TEACHER_CONFIG},
    )
    teacher = AutoModelForCausalLM.from_config(config)
    lce_patch.apply_fused_lce(teacher)
    encoded = [
        tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)[: args.seq_len]
        for messages in conversations["messages"]
    ]
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=TEACHER_LR)
    generator = torch.Generator().manual_seed(args.seed)
    teacher.train()
    for _ in range(args.teacher_steps):
        picks = torch.randint(len(encoded), (args.batch_size,), generator=generator).tolist()
        batch = [encoded[i] for i in picks]
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.tensor(ids)
        loss = teacher(input_ids=input_ids, attention_mask=(labels != -100).long(), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    lce_patch.revert_fused_lce(teacher)
    print(f"embedded teacher: hidden {config.hidden_size}, {args.teacher_steps} steps, final loss {loss.item():.3f}")
    return teacher.eval()


def load_teacher(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """``--teacher`` from the hub or disk, or the embedded teacher; built once per setting, the same for both runs."""
    # Everything the teacher depends on: another setting in the same process (tests) builds its own teacher.
    key = repr(
        (args.teacher, args.teacher_steps, args.seed, args.seq_len, args.batch_size, getattr(args, "dataset", None))
    )
    if key not in _teacher_cache:
        if args.teacher:
            import torch
            from transformers import AutoModelForCausalLM

            _teacher_cache[key] = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
        else:
            import _loading

            conversations = _loading.load_train_dataset(args)
            _teacher_cache[key] = train_embedded_teacher(args, tokenizer, conversations)
    return copy.deepcopy(_teacher_cache[key])


def prepare_dataset(
    args: argparse.Namespace, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase
) -> datasets.Dataset:
    """A ``prompt`` column: from ``--dataset`` (``--prompt-column``), or the shipped conversations up to each
    user turn."""
    import _loading

    columns = dataset.column_names
    if args.dataset is None and "messages" in columns:
        from grpo import prompts_and_answers

        return _loading.first_examples(prompts_and_answers(dataset).select_columns(["prompt"]), args.max_examples)
    if args.prompt_column not in columns:
        raise SystemExit(f"the dataset has columns {columns}, not the prompt column '{args.prompt_column}'")
    dataset = dataset.select_columns([args.prompt_column])
    if args.prompt_column == "messages":  # whole conversations: prompt with everything before the last reply
        return dataset.map(lambda row: {"prompt": row["messages"][:-1]}, remove_columns=["messages"])
    return dataset.rename_column(args.prompt_column, "prompt") if args.prompt_column != "prompt" else dataset


def make_trainer(
    args: argparse.Namespace,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: datasets.Dataset,
    callbacks: list[TrainerCallback],
    output_dir: Path,
) -> Trainer:
    """A TRL DistillationTrainer over ``dataset`` with ``callbacks``, the student ``model`` and the teacher."""
    import _loading
    from trl import DistillationConfig, DistillationTrainer

    # The batches hold prompts, not ``input_ids``: the recipe counts tokens from TRL's own ``num_tokens``.
    config = DistillationConfig(
        **{**_loading.training_kwargs(args, output_dir), "include_num_input_tokens_seen": "no"},
        beta=args.beta,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
    )
    return DistillationTrainer(
        model=model,
        teacher_model=load_teacher(args, tokenizer),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=_loading.lora_config(args) if args.lora else None,
        callbacks=callbacks,
    )


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: the command line) and runs the recipe; returns the exit status."""
    parser = build_parser("distill", __doc__.split("\n\n")[0], EXAMPLES, max_steps=20, batch_size=8)
    group = parser.add_argument_group("distillation")
    add_teacher_options(group)
    group.add_argument(
        "--beta",
        type=float,
        default=0.5,
        help="0 forward KL, 1 reverse KL, between: generalized JSD (default: %(default)s)",
    )
    group.add_argument(
        "--max-completion-length", type=int, default=24, help="tokens per sampled completion (default: %(default)s)"
    )
    group.add_argument(
        "--temperature", type=float, default=1.0, help="sampling and divergence temperature (default: %(default)s)"
    )
    group.add_argument("--prompt-column", default="prompt", help="prompt column of --dataset (default: %(default)s)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    check_teacher_args(parser, args)
    if not 0 <= args.beta <= 1 or args.max_completion_length < 1 or not args.temperature > 0:
        parser.error("--beta must be in [0, 1], --max-completion-length >= 1 and --temperature > 0")

    import _running

    metrics = ("entropy", "completions/mean_length")
    recipe = _running.Recipe("distill", "TRL kernel", prepare_dataset, make_trainer, metrics=metrics)
    return _running.run_recipe(recipe, args)


if __name__ == "__main__":
    sys.exit(main())
