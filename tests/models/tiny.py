"""Tiny random models of every registered architecture (no downloads), and comparison helpers."""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 128
COMMON_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
_MOE = dict(output_router_logits=True, router_aux_loss_coef=0.1, num_experts_per_tok=2)

# model_type -> config kwargs. Softcaps and logit scales are far from 1 so that getting them wrong shows.
TINY_CONFIGS: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "mixtral": dict(num_local_experts=4, **_MOE),
    "gemma": dict(head_dim=8),
    "gemma2": dict(head_dim=8, final_logit_softcapping=2.0, sliding_window=8),
    "gemma3_text": dict(head_dim=8, final_logit_softcapping=2.0, sliding_window=8),
    "qwen2": {},
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32, **_MOE),
    "qwen3": dict(head_dim=8),
    "qwen3_moe": dict(head_dim=8, num_experts=4, moe_intermediate_size=16, **_MOE),
    "cohere": dict(logit_scale=0.25),
    "granite": dict(logits_scaling=4.0),
}


def tiny_config(model_type: str, **overrides):
    if model_type == "gemma3":
        text = dict(COMMON_CONFIG, **TINY_CONFIGS["gemma3_text"])
        text["final_logit_softcapping"] = 2.0  # set, yet Gemma3ForConditionalGeneration applies none
        vision = dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
        )
        return AutoConfig.for_model(
            "gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4, **overrides
        )
    return AutoConfig.for_model(model_type, **dict(COMMON_CONFIG, **TINY_CONFIGS[model_type], **overrides))


def tiny_model(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), attn_implementation="eager").float()
    with torch.no_grad():  # logits of a few units, so that softcaps and logit scales matter
        model.get_output_embeddings().weight.normal_(std=0.5)
    return model


def pair(model_type: str, **overrides):
    """(model, unpatched deep copy)."""
    model = tiny_model(model_type, **overrides)
    return model, copy.deepcopy(model)


def assert_close(actual, expected, rel=1e-5, what="", floor=0.0):
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = max(expected.abs().max().item(), floor)
    err = (actual - expected).abs().max().item()
    assert err <= rel * scale + 1e-9, f"{what}: max abs err {err:.3g} vs scale {scale:.3g}"


def assert_grads_match(model, reference, rel=1e-5):
    """Every gradient equal to ``rel`` of its own scale, or of 1e-3 of the largest (numerically zero ones)."""
    params = dict(reference.named_parameters())
    floor = 1e-3 * max((p.grad.abs().max().item() for p in params.values() if p.grad is not None), default=0.0)
    checked = 0
    for name, param in model.named_parameters():
        ref = params[name]
        if ref.grad is None:
            assert param.grad is None or not param.grad.any(), f"{name}: gradient where the reference has none"
            continue
        assert param.grad is not None, f"{name}: no gradient"
        assert_close(param.grad, ref.grad, rel, name, floor=floor)
        checked += 1
    assert checked > 0


def assert_trains_equal(model, reference, batch, grad_rel=1e-5):
    """One training forward and backward of both: no logits from the patched model, equal loss and gradients."""
    reference.train()
    model.train()
    ref = reference(**batch)  # the reference first: hooks measuring a scale on its first call see it first
    out = model(**batch)
    assert out.logits is None
    assert_close(out.loss, ref.loss, rel=1e-5, what="loss")
    ref.loss.backward()
    out.loss.backward()
    assert_grads_match(model, reference, rel=grad_rel)


def make_batch(case: str, generator: torch.Generator) -> dict:
    """A batch of tiny token ids with labels, shaped as ``case`` says a trainer or framework passes it (see
    test_patching.py's ``CASES``)."""
    if case == "packed":  # two documents in one row, as TRL's padding-free collator builds it
        input_ids = torch.randint(0, VOCAB, (1, 14), generator=generator)
        position_ids = torch.cat([torch.arange(6), torch.arange(8)]).unsqueeze(0)
        labels = input_ids.clone()
        labels[position_ids == 0] = -100
        return dict(input_ids=input_ids, position_ids=position_ids, labels=labels)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0  # right padding
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :4] = -100  # a prompt
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    if case == "logits_to_keep":  # as ms-swift calls it: the last positions scored, against their own labels
        batch["labels"] = labels[:, -5:]
        batch["logits_to_keep"] = 5
    if case == "num_items_in_batch":  # as Trainer passes it under gradient accumulation: a larger window's count
        batch["num_items_in_batch"] = torch.tensor(41)
    if case == "shift_labels":  # as context parallelism passes them: already shifted, used as given
        shift_labels = torch.full_like(labels, -100)
        shift_labels[:, :-1] = labels[:, 1:]
        shift_labels[0, 6] = -100
        batch["shift_labels"] = shift_labels
    return batch
