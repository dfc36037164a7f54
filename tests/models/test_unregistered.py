"""allow_unregistered: a compatible model is patched after a self-check; an incompatible one is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import lce_patch
from lce_patch.models import is_patched

from .test_patching import _batch
from .tiny import assert_close, assert_grads_match, tiny_model

UNREGISTERED = {
    "olmo2": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64),
    "olmoe": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
    ),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


@pytest.mark.parametrize("model_type", sorted(UNREGISTERED))
def test_unregistered_model_after_self_check(model_type):
    assert model_type not in lce_patch.supported_architectures()
    config = AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=32, num_hidden_layers=2, **UNREGISTERED[model_type]
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    reference = copy.deepcopy(model)
    with pytest.raises(ValueError, match="not a supported architecture.*llama.*allow_unregistered=True"):
        lce_patch.apply_fused_lce(model)
    assert not is_patched(model)
    lce_patch.apply_fused_lce(model, allow_unregistered=True)
    batch = _batch("ignored_labels", torch.Generator().manual_seed(30))
    model.train()
    reference.train()
    out, ref = model(**batch), reference(**batch)
    assert out.logits is None
    assert_close(out.loss, ref.loss)
    out.loss.backward()
    ref.loss.backward()
    assert_grads_match(model, reference)


class _Passthrough(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class _ScaledLoss(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss * 2  # something the generic forward cannot know
        return out


def _subclass_instance(cls):
    base = tiny_model("llama")
    model = cls(base.config)
    model.load_state_dict(base.state_dict())
    return model


def test_subclass_overriding_forward_needs_the_self_check():
    model = _subclass_instance(_Passthrough)
    with pytest.raises(ValueError, match="not a supported architecture"):
        lce_patch.apply_fused_lce(model)
    lce_patch.apply_fused_lce(model, allow_unregistered=True)
    model.train()
    assert model(**_batch("ignored_labels", torch.Generator().manual_seed(31))).logits is None


def test_failed_self_check_is_refused_and_reverted():
    model = _subclass_instance(_ScaledLoss)
    with pytest.raises(ValueError, match="its own loss is .* but the fused loss is .*Supported model types"):
        lce_patch.apply_fused_lce(model, allow_unregistered=True)
    assert not is_patched(model) and "forward" not in vars(model)
