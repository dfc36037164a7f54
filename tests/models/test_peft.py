"""apply_fused_lce through PEFT: LoRA, modules_to_save=["lm_head"], and a refused LoRA on the head."""

from __future__ import annotations

import copy

import pytest
import torch

import lce_patch
from lce_patch.models import is_patched, unwrap_causal_lm

from .test_patching import _batch
from .tiny import assert_close, assert_grads_match, tiny_model

peft = pytest.importorskip("peft")


def _lora_config(**lora):
    lora.setdefault("target_modules", ["q_proj", "v_proj"])
    return peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **lora)


def _peft_model(model_type="llama", **lora):
    return peft.get_peft_model(tiny_model(model_type), _lora_config(**lora))


def _train_step(model, batch):
    model.train()
    out = model(**batch)
    out.loss.backward()
    return out


@pytest.mark.parametrize("patch_first", [False, True])
def test_lora_matches_unpatched(patch_first):
    batch = _batch("ignored_labels", torch.Generator().manual_seed(20))
    if patch_first:  # patch the plain model, then wrap it with PEFT
        base = tiny_model("qwen3")
        torch.manual_seed(0)  # the same random LoRA weights for both
        reference = peft.get_peft_model(copy.deepcopy(base), _lora_config())
        torch.manual_seed(0)
        model = peft.get_peft_model(lce_patch.apply_fused_lce(base), _lora_config())
    else:
        model = peft.get_peft_model(tiny_model("qwen3"), _lora_config())
        reference = copy.deepcopy(model)
        assert lce_patch.apply_fused_lce(model) is model
    assert is_patched(model) and "forward" in vars(unwrap_causal_lm(model))
    assert "forward" not in vars(model)  # the PeftModel's own forward is untouched
    out, ref = _train_step(model, batch), _train_step(reference, batch)
    assert out.logits is None
    assert_close(out.loss, ref.loss)
    assert_grads_match(model, reference)
    assert any(p.grad is not None and p.grad.any() for n, p in model.named_parameters() if "lora_" in n)
    lce_patch.revert_fused_lce(model)
    assert not is_patched(model)


def test_modules_to_save_lm_head_trains_the_copy():
    model = _peft_model("llama", target_modules=["q_proj"], modules_to_save=["lm_head"])
    reference = copy.deepcopy(model)
    lce_patch.apply_fused_lce(model)
    batch = _batch("ignored_labels", torch.Generator().manual_seed(21))
    out, ref = _train_step(model, batch), _train_step(reference, batch)
    assert out.logits is None
    assert_close(out.loss, ref.loss)
    assert_grads_match(model, reference)
    head = unwrap_causal_lm(model).lm_head
    assert head.modules_to_save["default"].weight.grad.any()
    assert head.original_module.weight.grad is None
    # with the adapters disabled (a DPO/GRPO reference pass) the original head is used
    model.eval()
    reference.eval()
    with torch.no_grad(), model.disable_adapter(), reference.disable_adapter():
        assert_close(model(**batch).loss, reference(**batch).loss)


def test_lora_on_the_lm_head_is_refused():
    model = _peft_model("llama", target_modules=["q_proj", "lm_head"])
    with pytest.raises(NotImplementedError, match="target_modules.*modules_to_save"):
        lce_patch.apply_fused_lce(model)
    assert not is_patched(model)
    # a head turned into LoRA after patching is refused at the call, not silently skipped
    base = lce_patch.apply_fused_lce(tiny_model("llama"))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["lm_head"], task_type="CAUSAL_LM"))
    with pytest.raises(NotImplementedError, match="PEFT adapter layer"):
        _train_step(model, _batch("ignored_labels", torch.Generator().manual_seed(22)))
