"""QLoRA: a 4-bit (nf4) base with LoRA adapters, patched vs unpatched, on the CPU (bitsandbytes' CPU
backend); and a quantized LM head refused with an error that says how to keep it unquantized."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

import lce_patch  # noqa: E402

from .tiny import assert_close  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, num_key_value_heads=2))
    with torch.no_grad():  # logits of a few units
        model.lm_head.weight.normal_(std=0.3)
    path = tmp_path_factory.mktemp("qlora")
    model.save_pretrained(path)
    return path


def _qlora(path, **quantization):
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32, **quantization
    )
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=quantization, device_map="cpu")
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    return peft.get_peft_model(model, lora)


def test_qlora_trains_like_the_unpatched_model(checkpoint):
    model, reference = _qlora(checkpoint), _qlora(checkpoint)
    assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    head = model.base_model.model.lm_head
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.float32  # left unquantized, upcast
    lce_patch.apply_fused_lce(model)
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, 128, (2, 16), generator=generator)
    labels = input_ids.clone()
    labels[0, :6] = -100
    model.train()
    reference.train()
    out = model(input_ids=input_ids, labels=labels)
    ref = reference(input_ids=input_ids, labels=labels)
    assert out.logits is None
    assert_close(out.loss, ref.loss, what="QLoRA loss")
    out.loss.backward()
    ref.loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    checked = 0
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert_close(param.grad, grads[name], rel=1e-5, what=name)
            checked += 1
    assert checked == 2 * 3 * 2  # lora_A and lora_B of three targets in two layers


def test_a_quantized_head_is_refused_naming_the_fix(checkpoint):
    # A list in llm_int8_skip_modules replaces transformers' default exclusion: the head gets quantized.
    model = _qlora(checkpoint, llm_int8_skip_modules=["mlp"])
    assert isinstance(model.base_model.model.lm_head, bnb.nn.Linear4bit)
    with pytest.raises(ValueError, match="LM head is quantized.*Linear4bit.*llm_int8_skip_modules"):
        lce_patch.apply_fused_lce(model)
    assert not lce_patch.models.is_patched(model)
