"""allow_unregistered: a compatible model is patched after a self-check; an incompatible one is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import lce_patch
from lce_patch.models import is_patched

from .tiny import assert_trains_equal, make_batch, tiny_model

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
def test_unregistered_model_after_self_check(model_type, monkeypatch):
    # As if a newer transformers had added the type: the registry does not know it.
    from lce_patch.models import lookups, refusals

    class_name = type(AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, num_hidden_layers=0))).__name__
    aliases = {key for key, names in lookups.mapping_names().items() if class_name in names}  # gpt2 and gpt-sw3
    for module in (lookups, refusals):
        monkeypatch.setattr(module, "REGISTRY", module.REGISTRY - aliases)
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
    assert_trains_equal(model, reference, make_batch("ignored_labels", torch.Generator().manual_seed(30)))


class _Passthrough(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class _ScaledLoss(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss * 2  # wraps the forward the patch runs: the fused loss is doubled too
        return out


class _GradientOnlyHead(torch.nn.Linear):
    """Same logits as a Linear, but their gradient is scaled by 1.5: invisible to a loss-only check."""

    def forward(self, x):
        y = super().forward(x)
        return y + 0.5 * (y - y.detach())


class _SoftcappedHead(torch.nn.Linear):
    """A softcap inside the head's own forward (named by no config field): shows only on large logits."""

    def forward(self, x):
        return 30.0 * torch.tanh(super().forward(x) / 30.0)


class _InlineLoss(LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        if labels is not None:
            logits = out.logits[:, :-1].flatten(0, 1)
            out.loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)
        return out


def _subclass_instance(cls, head_cls=None):
    base = tiny_model("llama")
    model = cls(base.config)
    if head_cls is not None:
        model.lm_head = head_cls(model.config.hidden_size, model.config.vocab_size, bias=False)
    model.load_state_dict(base.state_dict())
    return model


def test_subclass_overriding_forward_needs_the_self_check():
    model = _subclass_instance(_Passthrough)
    with pytest.raises(
        ValueError,
        match=r"_Passthrough \(model_type='llama'\) is not a supported architecture: it overrides the "
        r"forward of LlamaForCausalLM, which may change the loss\. To patch it anyway, apply_fused_lce\(model, "
        r"allow_unregistered=True\)",
    ):
        lce_patch.apply_fused_lce(model)
    lce_patch.apply_fused_lce(model, allow_unregistered=True)
    model.train()
    assert model(**make_batch("ignored_labels", torch.Generator().manual_seed(31))).logits is None


def test_subclass_changing_the_loss_after_the_forward_trains_equal():
    model = _subclass_instance(_ScaledLoss)
    reference = copy.deepcopy(model)
    lce_patch.apply_fused_lce(model, allow_unregistered=True)
    assert_trains_equal(model, reference, make_batch("ignored_labels", torch.Generator().manual_seed(32)))


@pytest.mark.parametrize(
    "cls, head_cls, message",
    [
        # equal loss, wrong gradient: the check compares every parameter's gradient
        (
            _Passthrough,
            _GradientOnlyHead,
            r"differs from the model's own in: model\.embed_tokens\.weight \(gradient differs by",
        ),
        # a softcap a tiny model's logits would hide: the check scales the logits up
        (LlamaForCausalLM, _SoftcappedHead, r"differs from the model's own in: loss"),
        (_InlineLoss, None, r"did not compute its loss through self.loss_function"),
    ],
    ids=["gradient_only", "hidden_softcap", "inline_loss"],
)
def test_failed_self_check_is_refused_and_reverted(cls, head_cls, message):
    model = _subclass_instance(cls, head_cls)
    # a registered class with a custom head module is not registered: it goes through the check too
    grads_before = {name: p.grad for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message) as info:
        lce_patch.apply_fused_lce(model, allow_unregistered=True)
    assert "allow_unregistered=True)" not in str(info.value)  # it ran: suggesting it again leads nowhere
    assert not is_patched(model) and "forward" not in vars(model) and "_loss_function" not in vars(model)
    assert not any(name.startswith("_lce_patch") for name in vars(model.lm_head))
    assert all(p.grad is grads_before[name] for name, p in model.named_parameters())


def test_a_custom_head_module_is_named_and_offered_the_self_check():
    model = _subclass_instance(LlamaForCausalLM, _SoftcappedHead)
    with pytest.raises(
        ValueError,
        match=r"LlamaForCausalLM \(model_type='llama'\) is not a supported architecture: its LM head "
        r"\(_SoftcappedHead\) is not a plain torch.nn.Linear and may transform the logits\. To patch it anyway, "
        r"apply_fused_lce\(model, allow_unregistered=True\)",
    ):
        lce_patch.apply_fused_lce(model)


class _HiddenHead(LlamaForCausalLM):
    def get_output_embeddings(self):
        return None


def test_a_refused_type_and_a_hidden_head_get_no_allow_unregistered_hint():
    # the self-check refuses every type in UNSUPPORTED, and cannot run without a head
    config = AutoConfig.for_model(
        "bart",
        vocab_size=128,
        d_model=32,
        decoder_layers=1,
        decoder_attention_heads=2,
        decoder_ffn_dim=32,
        encoder_layers=1,
        encoder_attention_heads=2,
        encoder_ffn_dim=32,
    )
    cases = [
        (
            AutoModelForCausalLM.from_config(config),
            r"BartForCausalLM \(model_type='bart'\) is not a supported architecture: computes its loss inline .* "
            r"Supported: the \d+ model types of lce_patch\.supported_architectures\(\), e\.g\. llama",
        ),
        (
            _subclass_instance(_HiddenHead),
            r"_HiddenHead \(model_type='llama'\) is not a supported architecture: its LM head is not exposed by "
            r"get_output_embeddings\(\)\.$",
        ),
    ]
    for model, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            lce_patch.apply_fused_lce(model)
        assert "allow_unregistered" not in str(info.value)


def test_a_registered_types_other_head_is_pointed_to_its_causal_lm():
    # 'bert' is registered (BertLMHeadModel); BertForMaskedLM computes its loss inline: refused, pointing to the
    # causal-LM class, without hints that cannot work (allow_unregistered, reverting a model never patched)
    from transformers import AutoModelForMaskedLM

    config = AutoConfig.for_model(
        "bert", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    model = AutoModelForMaskedLM.from_config(config)
    for options in ({}, {"allow_unregistered": True}):
        with pytest.raises(ValueError, match="load it with BertLMHeadModel") as refused:
            lce_patch.apply_fused_lce(model, **options)
        assert "allow_unregistered" not in str(refused.value) and "revert" not in str(refused.value)
    assert not lce_patch.is_patched(model)
