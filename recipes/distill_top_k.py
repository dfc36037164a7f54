"""Offline distillation from a teacher's top-K log-probabilities, the student's loss computed by lce_patch without
its logits.

Two stages. First the teacher scores the training data once: per token position, its K most likely next tokens
and their log-probabilities (at ``--temperature``), written as a ``datasets.Dataset`` (columns ``input_ids``,
``teacher_ids``, ``teacher_logprobs``) to ``<output-dir>/teacher_top_k``; ``--teacher-data DIR`` loads such a
folder instead of running the teacher again. Then the student trains on that dataset with
``lce_patch.fused_linear_sparse_divergence``, which takes the student's hidden states and LM head and never builds
its ``[tokens x vocabulary]`` logits. ``--compare`` trains the same student from the same weights on the same
batches with the unfused loss (the full logits, their log-softmax gathered at the K ids, the same divergence).

The loss per position (defaults in brackets): the divergence between the teacher's and the student's next-token
distributions over the teacher's top-K (``--top-k`` [16]), with a (K+1)-th bucket holding each side's mass
outside them (``--no-tail-bucket``: both renormalized over the K instead), ``--beta`` [0: forward KL(teacher ‖
student); 1: reverse KL; between: the generalized JSD], the student's logits divided by ``--temperature`` [1];
plus ``--ce-weight`` [0] times the cross-entropy on the data's own next tokens (at temperature 1). Both terms
are summed over the positions and divided by their number in the optimizer step. Tail bucket, beta 0 and no
temperature-squared factor are the defaults of TRL's ``AsyncDistillationTrainer`` (whose K is 8).

The embedded default uses distill.py's teacher (a wider Llama that first fits the shipped conversations for
``--teacher-steps`` steps) and the embedded Llama as the student, from fresh weights. With ``--model``, give
``--teacher`` too (a causal LM of the same vocabulary), or ``--teacher-data``. One process (no distributed
launch): the loss calls the student's backbone directly.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _cli import build_parser, check_args
from distill import add_teacher_options, check_teacher_args

if TYPE_CHECKING:
    import argparse

    import datasets
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback

EXAMPLES = """\
  python recipes/distill_top_k.py --compare           # embedded teacher, student and data: under a minute on 2 CPU cores
  python recipes/distill_top_k.py --compare --teacher-data runs/distill_top_k-compare/teacher_top_k
  python recipes/distill_top_k.py --model Qwen/Qwen2.5-0.5B-Instruct --teacher Qwen/Qwen2.5-1.5B-Instruct \\
      --dataset trl-lib/Capybara --max-examples 5000 --seq-len 1024 --bf16 --max-steps 300 --compare
"""

TEACHER_DATA = "teacher_top_k"  # the folder under --output-dir the teacher's top-K go to
SETTINGS_FILE = "recipe_settings.json"  # in that folder: what the top-K were computed with


# ---------------------------------------------------------------------------------------------------------------
# Stage 1: the teacher's top-K, once


def teacher_settings(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What the teacher's top-K depend on, saved beside them and checked when they are loaded."""
    return {
        "teacher": args.teacher or f"embedded, {args.teacher_steps} steps, seed {args.seed}",
        "data": args.dataset or "shipped",
        "max_examples": args.max_examples,
        "seq_len": args.seq_len,
        "top_k": args.top_k,
        "temperature": args.temperature,
        "tokenizer_size": len(tokenizer),
    }


def score_with_teacher(
    args: argparse.Namespace, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase
) -> datasets.Dataset:
    """Tokenizes ``dataset`` (sequences of at most ``--seq-len`` tokens) and adds the teacher's top-K at each position
    but the last: ``teacher_ids`` and ``teacher_logprobs``, [tokens - 1][K], the log-softmax at ``--temperature``."""
    import datasets
    import torch
    from distill import load_teacher
    from train import token_ids

    columns = dataset.column_names
    if "messages" not in columns and args.text_column not in columns:
        raise SystemExit(f"the dataset has columns {columns}: expected 'messages' or '{args.text_column}'")

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        return {"input_ids": [ids[: args.seq_len] for ids in token_ids(batch, tokenizer, args.text_column)]}

    encoded = dataset.map(tokenize, batched=True, remove_columns=columns)
    encoded = encoded.filter(lambda row: len(row["input_ids"]) > 1)  # a position needs a next token
    teacher = load_teacher(args, tokenizer)

    @torch.no_grad()
    def top_k(batch: dict[str, list[list[int]]]) -> dict[str, list[Any]]:
        lengths = [len(ids) for ids in batch["input_ids"]]
        input_ids = torch.full((len(lengths), max(lengths)), tokenizer.pad_token_id)
        for row, ids in enumerate(batch["input_ids"]):
            input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask = (torch.arange(input_ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
        logits = teacher(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        best = (logits.float() / args.temperature).log_softmax(-1).topk(args.top_k, dim=-1)
        return {
            "teacher_ids": [best.indices[row, : n - 1].tolist() for row, n in enumerate(lengths)],
            "teacher_logprobs": [best.values[row, : n - 1].tolist() for row, n in enumerate(lengths)],
        }

    features = datasets.Features(
        input_ids=datasets.List(datasets.Value("int32")),
        teacher_ids=datasets.List(datasets.List(datasets.Value("int32"))),
        teacher_logprobs=datasets.List(datasets.List(datasets.Value("float32"))),
    )
    # a fresh fingerprint: the datasets cache must neither hash the teacher nor reuse another teacher's result
    return encoded.map(
        top_k,
        batched=True,
        batch_size=args.batch_size,
        features=features,
        new_fingerprint=f"teacher-top-k-{uuid.uuid4().hex}",
        load_from_cache_file=False,
    )


def load_teacher_data(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
    """``--teacher-data``: a folder stage 1 wrote, checked against the options of this run."""
    import _loading
    import datasets

    path = args.teacher_data
    settings_path = path / SETTINGS_FILE
    if not settings_path.is_file():
        raise SystemExit(f"--teacher-data {path}: no {SETTINGS_FILE} there; give a folder this recipe wrote")
    saved = json.loads(settings_path.read_text(encoding="utf-8"))
    if saved["tokenizer_size"] != len(tokenizer):
        raise SystemExit(f"--teacher-data {path}: written with a tokenizer of {saved['tokenizer_size']} tokens")
    if saved["temperature"] != args.temperature:
        raise SystemExit(
            f"--teacher-data {path}: the teacher's log-probabilities are at temperature {saved['temperature']}; "
            f"give --temperature {saved['temperature']}"
        )
    if args.top_k > saved["top_k"]:
        raise SystemExit(f"--teacher-data {path} holds the top {saved['top_k']}: give --top-k <= {saved['top_k']}")
    kept = f"the first {args.top_k} of each position" if args.top_k < saved["top_k"] else "all of them"
    print(f"teacher's top-{saved['top_k']} loaded from {path} ({saved['teacher']}); training on {kept}")
    return _loading.first_examples(datasets.load_from_disk(str(path)), args.max_examples)


def prepare_dataset(
    args: argparse.Namespace, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase
) -> datasets.Dataset:
    """The teacher's top-K over ``dataset``: computed and saved to ``<output-dir>/teacher_top_k``, or loaded."""
    if args.teacher_data is not None:
        return load_teacher_data(args, tokenizer)
    scored = score_with_teacher(args, dataset, tokenizer)
    path = args.output_dir / TEACHER_DATA
    scored.save_to_disk(str(path))
    settings = teacher_settings(args, tokenizer)
    (path / SETTINGS_FILE).write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")
    print(f"teacher's top-{args.top_k} of {len(scored)} sequences saved to {path} (reuse: --teacher-data {path})")
    return scored


# ---------------------------------------------------------------------------------------------------------------
# Stage 2: the student


@dataclasses.dataclass
class TopKCollator:
    """Pads a batch: ``input_ids``/``attention_mask`` [B, T]; ``labels`` (the Trainer counts the positions of a
    step from them) and ``shift_labels`` [B, T - 1], -100 at padding; the teacher's first ``top_k`` candidates
    [B, T - 1, top_k], id -1 at padding."""

    pad_token_id: int
    top_k: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        import torch

        width = max(len(row["input_ids"]) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        teacher_ids = torch.full((len(rows), width - 1, self.top_k), -1)
        teacher_logprobs = torch.zeros(len(rows), width - 1, self.top_k)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[i, :n] = labels[i, :n] = torch.tensor(row["input_ids"])
            teacher_ids[i, : n - 1] = torch.tensor(row["teacher_ids"])[:, : self.top_k]
            teacher_logprobs[i, : n - 1] = torch.tensor(row["teacher_logprobs"])[:, : self.top_k]
        return {
            "input_ids": input_ids,
            "attention_mask": (labels != -100).long(),
            "labels": labels,
            "shift_labels": labels[:, 1:],
            "teacher_ids": teacher_ids,
            "teacher_logprobs": teacher_logprobs,
        }


def unfused_loss(
    args: argparse.Namespace, hidden: torch.Tensor, head: torch.nn.Module, inputs: dict[str, torch.Tensor], count: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(divergence, cross-entropy, entropy per position) from the student's full logits: the baseline of --compare.

    The positions with a teacher candidate are kept, the logits of all V tokens computed there, their log-softmax
    gathered at the candidates; then the same loss as the fused op's."""
    import torch.nn.functional as F

    from lce_patch.ops.linear_sparse_divergence.naive import sparse_token_divergence, with_tail_bucket

    ids, kept_slot = inputs["teacher_ids"], inputs["teacher_ids"] >= 0
    kept = kept_slot.any(-1)
    ids, kept_slot, teacher = ids[kept], kept_slot[kept], inputs["teacher_logprobs"][kept]
    logits = head(hidden[kept]).float()  # [positions, V]
    log_probs = (logits / args.temperature).log_softmax(-1)
    student = log_probs.gather(-1, ids.clamp(min=0)).masked_fill(~kept_slot, float("-inf"))
    teacher = teacher.masked_fill(~kept_slot, float("-inf"))
    if args.tail_bucket:
        (student, support), (teacher, _) = with_tail_bucket(student, kept_slot), with_tail_bucket(teacher, kept_slot)
    else:
        support = kept_slot
        student, teacher = student - student.logsumexp(-1, True), teacher - teacher.logsumexp(-1, True)
    divergence = sparse_token_divergence(student, teacher, support, args.beta).sum() / count
    cross_entropy = divergence.new_zeros(())
    if args.ce_weight:
        cross_entropy = F.cross_entropy(logits, inputs["shift_labels"][kept], reduction="sum") / count
    entropy = -(log_probs.exp() * log_probs).sum(-1).detach()
    return divergence, cross_entropy, entropy


def fused_loss(
    args: argparse.Namespace, hidden: torch.Tensor, head: torch.nn.Module, inputs: dict[str, torch.Tensor], count: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(divergence, cross-entropy, entropy per position) from lce_patch's fused ops: no ``[tokens x V]`` logits."""
    import torch

    import lce_patch

    weight, bias = head.weight, head.bias
    if torch.is_autocast_enabled(hidden.device.type):  # the dtype the head would compute in
        dtype = torch.get_autocast_dtype(hidden.device.type)
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    hidden = hidden.to(weight.dtype)
    options = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    divergence, entropy = lce_patch.fused_linear_sparse_divergence(
        hidden,
        weight,
        inputs["teacher_ids"],
        inputs["teacher_logprobs"],
        candidate_mask=inputs["teacher_ids"] >= 0,
        beta=args.beta,
        temperature=args.temperature,
        add_tail_bucket=args.tail_bucket,
        reduction="sum",
        num_items_in_batch=count,
        bias=bias,
        return_entropy=True,
        **options,
    )
    cross_entropy = divergence.new_zeros(())
    if args.ce_weight:
        labels = inputs["shift_labels"]
        cross_entropy = lce_patch.fused_linear_cross_entropy(
            hidden, weight, labels, bias=bias, reduction="sum", num_items_in_batch=count, **options
        )
    return divergence, cross_entropy, entropy[(inputs["teacher_ids"] >= 0).any(-1)]


def trainer_class() -> type[Trainer]:
    """A transformers Trainer whose loss is the top-K distillation loss of ``fused_loss`` or ``unfused_loss``
    (a class made on call: transformers is imported once the arguments are parsed, so --help answers at once)."""
    from transformers import Trainer

    class TopKDistillationTrainer(Trainer):
        def __init__(self, *, recipe_args: argparse.Namespace, fused: bool, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.recipe_args, self.top_k_loss = recipe_args, fused_loss if fused else unfused_loss
            # since the last log: divergence, cross-entropy, entropy, positions (tensors: no host sync per step)
            self.sums: dict[str, Any] = {}
            self.last_logged_step = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            args = self.recipe_args
            positions = (inputs["shift_labels"] != -100).sum()
            count = positions if num_items_in_batch is None else num_items_in_batch  # the whole step's positions
            with self.accelerator.autocast():  # what the model's own forward would run in
                backbone = model.get_decoder()
                hidden = backbone(
                    input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False
                ).last_hidden_state[:, :-1]
                head = model.get_output_embeddings()
                divergence, cross_entropy, entropy = self.top_k_loss(args, hidden, head, inputs, count)
            loss = divergence + args.ce_weight * cross_entropy if args.ce_weight else divergence
            for key, value in (
                ("divergence", divergence),
                ("cross_entropy", cross_entropy),
                ("entropy_sum", entropy.sum()),
                ("positions", positions),
            ):
                self.sums[key] = self.sums.get(key, 0.0) + value.detach().float()
            return (loss, None) if return_outputs else loss

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if "loss" in logs and self.sums:
                steps = max(self.state.global_step - self.last_logged_step, 1)
                logs["divergence"] = self.sums["divergence"].item() / steps
                if self.recipe_args.ce_weight:
                    logs["cross_entropy"] = self.sums["cross_entropy"].item() / steps
                logs["entropy"] = self.sums["entropy_sum"].item() / max(self.sums["positions"].item(), 1)
                self.sums, self.last_logged_step = {}, self.state.global_step
            super().log(logs, start_time)

    return TopKDistillationTrainer


def make_trainer(
    args: argparse.Namespace,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: datasets.Dataset,
    callbacks: list[TrainerCallback],
    output_dir: Path,
) -> Trainer:
    """The top-K distillation Trainer. The runs of the recipe give the fused run ``lce_patch.FusedLCECallback``:
    here it only says which loss to use (the model is not patched: the loss calls the backbone and the head)."""
    import _loading
    from transformers import TrainingArguments

    import lce_patch

    fused = any(isinstance(callback, lce_patch.FusedLCECallback) for callback in callbacks)
    callbacks = [callback for callback in callbacks if not isinstance(callback, lce_patch.FusedLCECallback)]
    if args.lora:
        from peft import get_peft_model

        model = get_peft_model(model, _loading.lora_config(args))
    trainer = trainer_class()(
        recipe_args=args,
        fused=fused,
        model=model,
        args=TrainingArguments(**_loading.training_kwargs(args, output_dir), remove_unused_columns=False),
        train_dataset=dataset,
        data_collator=TopKCollator(tokenizer.pad_token_id, args.top_k),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    if trainer.accelerator.num_processes > 1:
        raise SystemExit("recipes/distill_top_k.py runs in one process (its loss calls the student's backbone)")
    return trainer


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: the command line) and runs the recipe; returns the exit status."""
    parser = build_parser("distill_top_k", __doc__.split("\n\n")[0], EXAMPLES, max_steps=40, seq_len=128)
    group = parser.add_argument_group("distillation from the teacher's top-K")
    add_teacher_options(group)
    group.add_argument(
        "--teacher-data",
        type=Path,
        help="load the teacher's top-K from this folder (a previous run's <output-dir>/teacher_top_k) "
        "instead of running the teacher; the data options are then ignored",
    )
    group.add_argument("--top-k", type=int, default=16, help="teacher candidates per position (default: %(default)s)")
    group.add_argument(
        "--no-tail-bucket",
        dest="tail_bucket",
        action="store_false",
        help="renormalize both sides over the K candidates instead of adding a bucket for the mass outside them",
    )
    group.add_argument(
        "--beta",
        type=float,
        default=0.0,
        help="0 forward KL(teacher ‖ student), 1 reverse KL, between: generalized JSD (default: %(default)s)",
    )
    group.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="divides the student's logits; the teacher's log-probabilities are computed at it (default: %(default)s)",
    )
    group.add_argument(
        "--ce-weight",
        type=float,
        default=0.0,
        help="weight of an added cross-entropy on the data's next tokens (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.model and not args.teacher and args.teacher_data is None:
        parser.error("--model needs --teacher (a causal LM with the student's vocabulary) or --teacher-data")
    check_teacher_args(parser, args, needed=False)
    if args.top_k < 1 or not 0 <= args.beta <= 1 or not args.temperature > 0 or args.ce_weight < 0:
        parser.error("--top-k must be >= 1, --beta in [0, 1], --temperature > 0 and --ce-weight >= 0")
    if args.teacher_data is not None and not args.teacher_data.is_dir():
        parser.error(f"--teacher-data {args.teacher_data}: not a folder")

    import _running

    metrics = ("divergence", "entropy", *(("cross_entropy",) if args.ce_weight else ()))
    recipe = _running.Recipe("distill_top_k", "unfused top-K", prepare_dataset, make_trainer, metrics=metrics)
    return _running.run_recipe(recipe, args)


if __name__ == "__main__":
    sys.exit(main())
