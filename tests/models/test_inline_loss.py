"""A model whose forward computes its loss inline (not through ``self.loss_function``) is refused at patch time.

The fused loss stands in for what ``self.loss_function`` returns; a forward that builds its own cross-entropy on the
logits would get a zero-width stand-in for them and fail at its first training call. ``apply_fused_lce`` reads the
installed forward's code instead and refuses such a model, naming its class and the transformers version.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

import lce_patch
from lce_patch.models.registry import inline_loss_reason


def _config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )


class InlineLossLM(LlamaForCausalLM):
    """A Llama whose forward computes the causal-LM loss itself, as older Hugging Face forwards did."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss_fct = torch.nn.CrossEntropyLoss()
            loss = loss_fct(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class FunctionalLossLM(LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class SuperForwardLM(LlamaForCausalLM):
    """An override that calls the base forward (whose loss is ``self.loss_function``'s)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class HelperLossLM(LlamaForCausalLM):
    """A forward computing its loss in a method of its own, through ``self.loss_function``."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        return CausalLMOutputWithPast(loss=self._loss(logits, labels), logits=logits)

    def _loss(self, logits, labels):
        return None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)


class ShiftedLabelsLM(LlamaForCausalLM):
    """A forward passing its loss_function labels it shifted itself (Moshi on transformers 5.6)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        shift_labels = labels[..., 1:].contiguous()
        loss = self.loss_function(logits[..., :-1, :], shift_labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class MovedLabelsLM(LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        loss = self.loss_function(logits, labels.to(logits.device), vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_inline_losses_are_read_from_the_code():
    assert "a CrossEntropyLoss on the logits" in inline_loss_reason(InlineLossLM.forward, InlineLossLM)
    assert "cross_entropy on the logits" in inline_loss_reason(FunctionalLossLM.forward, FunctionalLossLM)
    assert "labels of its own (shift_labels)" in inline_loss_reason(ShiftedLabelsLM.forward, ShiftedLabelsLM)
    for cls in (LlamaForCausalLM, SuperForwardLM, HelperLossLM, MovedLabelsLM):
        assert inline_loss_reason(cls.forward, cls) is None, cls.__name__


@pytest.mark.parametrize("options", [{}, {"allow_unregistered": True}], ids=["default", "allow_unregistered"])
def test_a_forward_computing_its_loss_inline_is_refused(options):
    torch.manual_seed(0)
    model = InlineLossLM(_config())
    message = (
        rf"InlineLossLM \(model_type='llama'\) is not a supported architecture: InlineLossLM's forward in the "
        rf"installed transformers {transformers.__version__} computes its loss inline \(a CrossEntropyLoss on the "
        r"logits\), not through self\.loss_function"
    )
    with pytest.raises(ValueError, match=message) as info:
        lce_patch.apply_fused_lce(model, backend="torch", **options)
    assert "allow_unregistered=True checks" not in str(info.value)  # no self-check can help
    assert not lce_patch.is_patched(model) and "forward" not in vars(model)
    ids = torch.randint(0, 64, (2, 8))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)  # untouched: its own loss


def test_overrides_reaching_loss_function_are_patched():
    torch.manual_seed(0)
    for cls in (SuperForwardLM, HelperLossLM):
        model = cls(_config())
        lce_patch.apply_fused_lce(model, backend="torch", allow_unregistered=True)
        ids = torch.randint(0, 64, (2, 8))
        model.train()
        out = model(input_ids=ids, labels=ids)
        assert out.logits is None and torch.isfinite(out.loss), cls.__name__
        lce_patch.revert_fused_lce(model)
