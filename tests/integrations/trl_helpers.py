"""Shared pieces of the TRL integration tests: tiny models, a word-level tokenizer built offline, the training
arguments every CPU run shares (and those of runs compared with each other), a LoRA config, spies on lce_patch's op
and on TRL's chunked kernel, a recorder of the served op's calls; the preference trainers' models and the comparison
of their logs, the distillation trainers' students and teachers."""

from __future__ import annotations

import types
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

import lce_patch.ops as lce_ops
from lce_patch.ops.linear_cross_entropy.autograd import LinearCrossEntropyFunction
from tests.models.tiny import COMMON_CONFIG

VOCAB = 64
_COMMON = dict(
    COMMON_CONFIG, vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=2
)


def make_model(kind: str = "llama", seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_COMMON))
    if kind == "gemma2":  # a small softcap so that the tanh matters at these logit sizes
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**_COMMON, head_dim=8, final_logit_softcapping=0.7))
    if kind == "cohere":
        return tf.CohereForCausalLM(tf.CohereConfig(**_COMMON, logit_scale=0.5))
    if kind == "mixtral":
        return tf.MixtralForCausalLM(
            tf.MixtralConfig(
                **_COMMON,
                num_local_experts=4,
                num_experts_per_tok=2,
                output_router_logits=True,
                router_aux_loss_coef=0.1,
            )
        )
    raise ValueError(kind)


@contextmanager
def spies():
    """Count calls of lce_patch's op and of TRL's chunked kernel; record whether autocast was on for ours."""
    autocast_states = []

    def op(*args, **kwargs):
        autocast_states.append(torch.is_autocast_enabled(args[0].device.type))
        return real_op(*args, **kwargs)

    real_op = lce_ops.fused_linear_log_probs
    with (
        mock.patch.object(lce_ops, "fused_linear_log_probs", side_effect=op) as ours,
        mock.patch.object(LinearCrossEntropyFunction, "apply", wraps=LinearCrossEntropyFunction.apply) as ours_fn,
        mock.patch.object(ChunkedLogProbFunction, "apply", wraps=ChunkedLogProbFunction.apply) as theirs,
    ):
        yield types.SimpleNamespace(ours=ours, ours_fn=ours_fn, theirs=theirs, autocast=autocast_states)


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i + 4 for i in range(VOCAB - 4)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def cpu_run(output_dir, **overrides) -> dict:
    """The arguments of a TRL config that every CPU test run shares (logging each step, no saving, no report, seed
    0), with ``overrides``."""
    common = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    return {**common, **overrides}


def compared_run(output_dir, **overrides) -> dict:
    """:func:`cpu_run`'s arguments for a run whose logs are compared with another's (with and without lce_patch):
    float32 (TRL's default bf16 would round the two runs' logits differently) and SGD at learning rate 0.1 (Adam
    would turn fp32 noise in near-zero gradients into lr-sized weight differences), with ``overrides``."""
    return cpu_run(output_dir, **{"bf16": False, "optim": "sgd", "learning_rate": 0.1, **overrides})


def record_calls(monkeypatch, name: str, *modules) -> list[dict]:
    """The keyword arguments of every call of the function ``name`` of ``modules`` (where the served code looks it
    up; the first module's is called) from now on, appended as they come."""
    calls = []
    original = getattr(modules[0], name)

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    for module in modules:
        monkeypatch.setattr(module, name, counting)
    return calls


def lora_config(**overrides):
    """A small LoRA on the attention's q and v projections (no dropout: runs with and without lce_patch draw alike)."""
    from peft import LoraConfig

    return LoraConfig(
        **{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, **overrides}
    )


def lce_callback():
    from lce_patch import FusedLCECallback

    return FusedLCECallback()


# The preference trainers' compared runs (ORPO, CPO, TPO, Online DPO, A2PO)
COMPARED_STEPS = 2
_TIMING_KEYS = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")
RTOL, ATOL = 1e-5, 1e-6  # see test_trl_preference.py


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def preference_model(kind: str) -> torch.nn.Module:
    model = make_model(kind)
    with torch.no_grad():  # logits of a few units, so that the softcap and the mean-logit metrics matter
        model.get_output_embeddings().weight.normal_(std=0.5, generator=torch.Generator().manual_seed(1))
    return model


def preference_lora(head: bool = False):
    targets = ["q_proj", "v_proj"] + (["lm_head"] if head else [])
    return lora_config(target_modules=targets, task_type="CAUSAL_LM")


def loss_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry or "eval_loss" in entry]


def assert_same_logs(theirs, ours):
    assert len(theirs) == len(ours) > 0
    for a, b in zip(theirs, ours, strict=True):
        assert a.keys() == b.keys()
        for key in (key for key in a if not key.endswith(_TIMING_KEYS)):
            assert b[key] == pytest.approx(a[key], rel=RTOL, abs=ATOL), (key, a[key], b[key])


def distillation_model(kind: str, hidden: int, seed: int):
    """A two-layer Llama (untied head) or Gemma-2 (softcapped) of ``hidden`` size: the distillation tests' student and
    teacher."""
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=2,
    )
    if kind == "gemma2":
        config = Gemma2Config(head_dim=8, final_logit_softcapping=3.0, sliding_window=16, **common)
    else:
        config = LlamaConfig(tie_word_embeddings=False, **common)
    return AutoModelForCausalLM.from_config(config)
