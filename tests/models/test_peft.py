"""apply_fused_lce through PEFT: LoRA, modules_to_save=["lm_head"], LoRA on the head, and refused head adapters."""

from __future__ import annotations

import copy

import pytest
import torch

import lce_patch
from lce_patch.models import is_patched, unwrap_causal_lm

from .tiny import assert_close, assert_grads_match, make_batch, tiny_model

peft = pytest.importorskip("peft")


def _lora_config(**lora):
    lora = {"target_modules": ["q_proj", "v_proj"], "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **lora}
    return peft.LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **lora)


def _peft_model(model_type="llama", **lora):
    return peft.get_peft_model(tiny_model(model_type), _lora_config(**lora))


def _train_step(model, batch):
    model.train()
    out = model(**batch)
    out.loss.backward()
    return out


@pytest.mark.parametrize("patch_first", [False, True])
def test_lora_matches_unpatched(patch_first):
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(20))
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
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(21))
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


def _lora_head_pair(model_type="llama", seed=0, **lora):
    """(patched PEFT model with LoRA on lm_head, unpatched deep copy); B initialized non-zero."""
    lora.setdefault("target_modules", ["q_proj", "lm_head"])
    models = []
    for _ in range(2):  # built twice with the same seeds: ensure_weight_tying's tied views cannot be deep-copied
        base = tiny_model(model_type)
        torch.manual_seed(seed)
        models.append(peft.get_peft_model(base, _lora_config(**lora)))
    lce_patch.apply_fused_lce(models[0])
    return models[0], models[1]


def _seeded_step(model, batch, seed=0):
    torch.manual_seed(seed)  # the same dropout draws on both sides
    return _train_step(model, batch)


def _head_lora_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if "lm_head.lora_" in n}


@pytest.mark.parametrize(
    "model_type,lora",
    [
        ("llama", {}),
        ("llama", {"lora_dropout": 0.3}),
        ("llama", {"use_rslora": True}),
        ("gemma2", {}),  # a final-logit softcap: the adapter's term goes inside it
        ("qwen3", {"lora_dropout": 0.1, "use_rslora": True}),
        ("cohere", {}),  # a logit scale and a tied head
        ("cohere", {"ensure_weight_tying": True, "target_modules": ["q_proj", "embed_tokens", "lm_head"]}),
    ],
    ids=lambda value: ",".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value,
)
def test_lora_on_the_lm_head_matches_unpatched(model_type, lora):
    model, reference = _lora_head_pair(model_type, **lora)
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(22))
    out, ref = _seeded_step(model, batch), _seeded_step(reference, batch)
    assert out.logits is None
    assert_close(out.loss, ref.loss)
    assert_grads_match(model, reference)
    head_grads = _head_lora_grads(model)
    assert set(head_grads) == {n for n in dict(reference.named_parameters()) if "lm_head.lora_" in n}
    assert all(g is not None and g.any() for g in head_grads.values())
    assert unwrap_causal_lm(model).lm_head.base_layer.weight.grad is None  # W stays frozen
    # evaluation keeps the head's real output (LoRA term included) beside the fused loss
    model.eval()
    reference.eval()
    with torch.no_grad():
        out, ref = model(**batch), reference(**batch)
    assert_close(out.loss, ref.loss)
    assert_close(out.logits, ref.logits)


def test_lora_on_the_lm_head_merged_disabled_and_two_adapters():
    model, reference = _lora_head_pair("llama")
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(23))
    for m in (model, reference):
        torch.manual_seed(3)  # the same random weights for both
        m.add_adapter("second", _lora_config(target_modules=["lm_head"], r=2))
        m.base_model.set_adapter(["default", "second"])  # both adapters' terms are added
        for name, param in m.named_parameters():  # set_adapter leaves only the active ones trainable
            if "lora_" in name:
                param.requires_grad_(True)
    out, ref = _seeded_step(model, batch), _seeded_step(reference, batch)
    assert_close(out.loss, ref.loss)
    assert_grads_match(model, reference)
    assert all(g is not None and g.any() for g in _head_lora_grads(model).values())
    model.eval()
    reference.eval()
    with torch.no_grad():
        with model.disable_adapter(), reference.disable_adapter():  # a DPO/GRPO reference pass: the base head
            assert_close(model(**batch).loss, reference(**batch).loss)
        for m in (model, reference):
            m.base_model.set_adapter("default")
            m.merge_adapter()  # the merged weight carries the adapter: no separate term
        assert_close(model(**batch).loss, reference(**batch).loss)
        unmerged = reference(**batch).loss
        for m in (model, reference):
            m.unmerge_adapter()
        assert_close(model(**batch).loss, reference(**batch).loss)
        assert_close(model(**batch).loss, unmerged, rel=1e-4)


def test_lora_put_on_the_head_after_patching():
    base = lce_patch.apply_fused_lce(tiny_model("llama"))
    reference = copy.deepcopy(base)
    lce_patch.revert_fused_lce(reference)
    config = _lora_config(target_modules=["lm_head"])
    torch.manual_seed(1)
    model = peft.get_peft_model(base, config)
    torch.manual_seed(1)
    reference = peft.get_peft_model(reference, config)
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(24))
    out, ref = _seeded_step(model, batch), _seeded_step(reference, batch)
    assert out.logits is None
    assert_close(out.loss, ref.loss)
    assert_grads_match(model, reference)


@pytest.mark.parametrize(
    "lora,message",
    [({"use_dora": True}, "DoRA adapter"), ({"lora_bias": True}, "lora_bias=True")],
    ids=["dora", "lora_bias"],
)
def test_adapters_the_fused_head_cannot_compute_are_refused(lora, message):
    model = _peft_model("llama", target_modules=["q_proj", "lm_head"], **lora)
    with pytest.raises(NotImplementedError, match=message):
        lce_patch.apply_fused_lce(model)
    assert not is_patched(model)
    # put on the head after patching: refused at the call, not silently skipped
    base = lce_patch.apply_fused_lce(tiny_model("llama"))
    model = peft.get_peft_model(base, _lora_config(target_modules=["lm_head"], **lora))
    with pytest.raises(NotImplementedError, match=message):
        _train_step(model, make_batch("ignored_labels", torch.Generator().manual_seed(22)))


def test_other_tuners_on_the_head_are_refused():
    model = peft.get_peft_model(tiny_model("llama"), peft.IA3Config(target_modules=["lm_head"], feedforward_modules=[]))
    with pytest.raises(NotImplementedError, match="does not support"):
        lce_patch.apply_fused_lce(model)
