"""Loading: the model, tokenizer and data a recipe trains on, and the settings its Trainer is built with.

``--model`` and ``--dataset`` (hub ids or local paths), or by default the embedded ones, which need no
download and no GPU: a small Llama built from a config with fresh weights, a byte-level BPE tokenizer
trained at startup on the shipped conversations (``recipes/data/chat.jsonl``), and those conversations.
Also the TrainingArguments fields and the LoRA configuration that every recipe's Trainer takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import datasets
import torch
from _cli import EMBEDDED_DATA
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    TrainingArguments,
    set_seed,
)

# The embedded model: a Llama small enough to train on two CPU cores in about a minute. The
# tokenizer learns about 1,300 tokens from the shipped data; the model's vocabulary is padded to
# EMBEDDED_VOCAB rows (real models pad theirs too), so that, with V >> hidden as in every real LLM,
# the LM head and its logits take the share of memory they take at scale.
EMBEDDED_VOCAB = 4096
EMBEDDED_CONFIG: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
EMBEDDED_LR, LORA_LR, FULL_LR = 1e-3, 2e-4, 2e-5

# The embedded tokenizer: byte-level BPE trained on the shipped data at startup (deterministic, ~0.1 s).
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# One role token per message, content, <|end|>. The assistant's part is marked for
# return_assistant_tokens_mask (TRL's assistant_only_loss).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# transformers 5.19 renamed gradient_checkpointing (now a deprecated alias) to activation_checkpointing.
CHECKPOINTING_FIELD = next(
    (f.name for f in dataclasses.fields(TrainingArguments) if f.name == "activation_checkpointing"),
    "gradient_checkpointing",
)


def learning_rate(args: argparse.Namespace) -> float:
    """``--lr``, or a default that suits the model: from scratch, LoRA, or full fine-tuning."""
    if args.lr is not None:
        return args.lr
    if args.model is None:
        return EMBEDDED_LR
    return LORA_LR if args.lora else FULL_LR


def build_embedded_tokenizer(
    data_path: Path = EMBEDDED_DATA, vocab_size: int = EMBEDDED_VOCAB
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the messages of ``data_path``, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [
        message["content"]
        for line in data_path.read_text(encoding="utf-8").splitlines()
        if line.strip()
        for message in json.loads(line).get("messages", [])
    ]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=EMBEDDED_CONFIG["max_position_embeddings"],
    )


def load_tokenizer(args: argparse.Namespace) -> PreTrainedTokenizerBase:
    """The model's tokenizer (``--model``) or the embedded one; a pad token is always set."""
    tokenizer = AutoTokenizer.from_pretrained(args.model) if args.model else build_embedded_tokenizer()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def embedded_vocab(tokenizer: PreTrainedTokenizerBase) -> int:
    """Rows of the embedded model's vocabulary: the tokenizer's, padded to EMBEDDED_VOCAB."""
    return max(EMBEDDED_VOCAB, len(tokenizer))


def load_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """``--model`` from the hub or disk, or the embedded Llama with fresh weights from ``--seed``.

    Called once per run, so both runs of ``--compare`` start from the same weights.
    """
    set_seed(args.seed)
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = LlamaConfig(
        vocab_size=embedded_vocab(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **EMBEDDED_CONFIG,
    )
    return AutoModelForCausalLM.from_config(config)


def load_train_dataset(args: argparse.Namespace) -> datasets.Dataset:
    """``--dataset`` (local JSON/JSONL file or hub id), or the shipped conversations."""
    source = args.dataset
    if source is None or Path(source).is_file():
        path = Path(source) if source else EMBEDDED_DATA
        if path.suffix not in (".json", ".jsonl"):
            raise SystemExit(f"--dataset {path}: a local dataset must be a .json or .jsonl file")
        dataset = datasets.load_dataset("json", data_files=str(path), split="train")
    else:
        dataset = datasets.load_dataset(source, args.dataset_config, split=args.dataset_split)
    return first_examples(dataset, args.max_examples)


def first_examples(dataset: datasets.Dataset, count: int | None) -> datasets.Dataset:
    """The first ``count`` rows of ``dataset`` (``--max-examples``), or all of them for None."""
    return dataset if count is None else dataset.select(range(min(count, len(dataset))))


def lora_config(args: argparse.Namespace) -> Any:
    """The peft LoraConfig of ``--lora``: every linear layer of the decoder, the LM head excluded."""
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


def make_loadable(model: PreTrainedModel, output_dir: Path) -> None:
    """Give a model built from a config (the embedded one) a path TRL can load it from.

    TRL's DPO, GRPO and RLOO trainers build their reference model with ``from_pretrained`` from the
    policy's ``config._name_or_path``; a model built from a config has none, so its initial weights are
    saved under ``output_dir/initial`` and that becomes its path."""
    if model.config._name_or_path:
        return
    path = output_dir / "initial"
    model.save_pretrained(path)
    model.config._name_or_path = str(path)


def accelerator_available() -> bool:
    """Whether torch sees a GPU (CUDA, or another accelerator through ``torch.accelerator``)."""
    accelerator = getattr(torch, "accelerator", None)
    return torch.cuda.is_available() or bool(accelerator is not None and accelerator.is_available())


def training_kwargs(args: argparse.Namespace, output_dir: Path) -> dict[str, Any]:
    """TrainingArguments fields every recipe uses (also valid for TRL's configs, such as SFTConfig)."""
    return dict(
        output_dir=str(output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=learning_rate(args),
        lr_scheduler_type="cosine",
        warmup_steps=math.ceil(0.1 * args.max_steps),
        weight_decay=0.0,
        bf16=args.bf16,
        **{CHECKPOINTING_FIELD: args.gradient_checkpointing},
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        include_num_input_tokens_seen="non_padding",
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=not accelerator_available(),  # also lets --bf16 autocast on a CPU
    )
