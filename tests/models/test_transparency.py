"""A patched model returns what the unpatched model returns, however users touch it.

Each class of what users do to a model is tried on a patched model and on an unpatched copy with the
same weights and inputs: the loss and the outputs must agree (the one documented difference: no
logits in training), and where the fused loss cannot honour something the user set up (a custom
loss function, a forward hook, a subclass forward under a class patch), the call runs unfused with a
one-time warning instead of silently computing something else.
"""

from __future__ import annotations

import copy
import inspect
import io
import multiprocessing
import pickle
import threading
import warnings

import pytest
import torch
from transformers import LlamaForCausalLM

import lce_patch
from lce_patch.models import is_patched

from .tiny import VOCAB, assert_close, assert_grads_match, assert_trains_equal, make_batch, pair, tiny_model


def _batch(seed: int, batch: int = 2, length: int = 12) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, length), generator=generator)
    labels = input_ids.clone()
    labels[0, : length // 3] = -100
    return dict(input_ids=input_ids, labels=labels)


def _fused_calls(monkeypatch) -> list:
    from lce_patch.models import forward as forward_module

    calls = []
    real = forward_module.fused_linear_cross_entropy
    monkeypatch.setattr(forward_module, "fused_linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if "lce_patch" in str(w.message)]


# --- Losses: the same value as Hugging Face, NaN included ---------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_moe"])
def test_loss_and_outputs_equal_in_training_and_evaluation(model_type):
    model, reference = pair(model_type)
    lce_patch.apply_fused_lce(model)
    for seed in range(3):
        batch = _batch(seed)
        assert_trains_equal(model, reference, batch)
        model.zero_grad()
        reference.zero_grad()
    model.eval()
    reference.eval()
    with torch.no_grad():
        batch = _batch(5)
        out, ref = model(**batch), reference(**batch)
        assert_close(out.loss, ref.loss, what="eval loss")
        assert_close(out.logits, ref.logits, rel=1e-6, what="eval logits")


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_shift_labels_without_labels_returns_logits_and_no_loss(model_type):
    """Hugging Face computes a loss only when ``labels`` are given; ``shift_labels`` alone give none."""
    model, reference = pair(model_type)
    lce_patch.apply_fused_lce(model)
    batch = _batch(1)
    for training in (True, False):
        model.train(training)
        reference.train(training)
        out = model(input_ids=batch["input_ids"], shift_labels=batch["labels"])
        ref = reference(input_ids=batch["input_ids"], shift_labels=batch["labels"])
        assert out.loss is None and ref.loss is None
        assert torch.equal(out.logits, ref.logits)
    # with labels too, shift_labels are the targets, as in Hugging Face's loss
    model.train()
    reference.train()
    shifted = torch.roll(batch["labels"], -2, dims=1)
    out = model(**batch, shift_labels=shifted)
    ref = reference(**batch, shift_labels=shifted)
    assert out.logits is None
    assert_close(out.loss, ref.loss, what="loss with shift_labels")


# --- What the user set up on the model: honoured, unfused, with a warning -------------------------------


def _scaled_square_loss(logits, labels, vocab_size, **kwargs):
    """A custom loss a user might set: not cross-entropy."""
    return 0.5 * logits.float().pow(2).mean() + 0 * labels.sum()


@pytest.mark.parametrize("when", ["before", "after"])
def test_custom_loss_function_is_honoured_unfused_with_one_warning(when, monkeypatch):
    calls = _fused_calls(monkeypatch)
    model, reference = pair("llama")
    reference.loss_function = _scaled_square_loss
    if when == "before":
        model.loss_function = _scaled_square_loss
    lce_patch.apply_fused_lce(model)
    if when == "after":
        model.loss_function = _scaled_square_loss
    model.train()
    reference.train()
    ref = reference(**_batch(0))
    out, messages = _warnings_of(lambda: model(**_batch(0)))
    assert len(messages) == 1 and "custom loss_function" in messages[0] and "_scaled_square_loss" in messages[0]
    assert_close(out.loss, ref.loss, what="custom loss")
    out.loss.backward()
    ref.loss.backward()
    assert_grads_match(model, reference)
    _, messages = _warnings_of(lambda: model(**_batch(1)))
    assert messages == []  # once per model
    assert calls == []
    # Hugging Face's own causal-LM loss set explicitly is what the fused loss computes: fused again
    from transformers.loss.loss_utils import LOSS_MAPPING

    model.loss_function = LOSS_MAPPING["ForCausalLM"]
    assert model(**_batch(2)).logits is None and calls == [1]
    lce_patch.revert_fused_lce(model)
    assert model.loss_function is LOSS_MAPPING["ForCausalLM"]  # the user's choice stays after reverting


def _double_logits(module, args, output):
    return output * 2.0


def _mask_token_five(module, args, output):
    return output.index_fill(-1, torch.tensor([5]), -1e4)


@pytest.mark.parametrize("hook", [_double_logits, _mask_token_five])
def test_forward_hook_on_the_head_is_honoured_unfused(hook, monkeypatch):
    calls = _fused_calls(monkeypatch)
    model, reference = pair("gemma2")
    lce_patch.apply_fused_lce(model)
    handles = [m.lm_head.register_forward_hook(hook) for m in (model, reference)]
    model.train()
    reference.train()
    batch = _batch(3)
    out, messages = _warnings_of(lambda: model(**batch))
    assert len(messages) == 1 and "hook" in messages[0] and hook.__name__ in messages[0]
    ref = reference(**batch)
    assert_close(out.loss, ref.loss, what="hooked loss")
    assert calls == []
    for handle in handles:
        handle.remove()
    assert model(**batch).logits is None and calls == [1]  # hook removed: fused again
    assert_close(model(**batch).loss, reference(**batch).loss, what="loss after removing the hook")


def test_backward_hook_on_the_head_is_honoured_unfused(monkeypatch):
    """A module backward hook on the head that scales the logits' gradient changes the unpatched model's
    gradients; the fused loss builds no logits gradient, so that call runs unfused."""
    calls = _fused_calls(monkeypatch)
    model, reference = pair("llama")
    lce_patch.apply_fused_lce(model)

    def scale_logit_grad(module, grad_output):
        return (grad_output[0] * 0.5,)

    for m in (model, reference):
        m.lm_head.register_full_backward_pre_hook(scale_logit_grad)
        m.train()
    batch = _batch(11)
    out, messages = _warnings_of(lambda: model(**batch))
    ref = reference(**batch)
    assert len(messages) == 1 and "scale_logit_grad" in messages[0] and calls == []
    out.loss.backward()
    ref.loss.backward()
    assert_grads_match(model, reference)


def test_global_forward_hook_and_a_hook_on_the_model_are_honoured(monkeypatch):
    calls = _fused_calls(monkeypatch)
    model, reference = pair("llama")
    lce_patch.apply_fused_lce(model)
    model.train()
    reference.train()
    batch = _batch(4)
    seen = []

    def read_logits(module, args, output):  # a hook on the model that reads its output's logits
        seen.append(output.logits.shape)

    handle = model.register_forward_hook(read_logits)
    out, messages = _warnings_of(lambda: model(**batch))
    assert len(messages) == 1 and "read_logits" in messages[0]
    assert seen == [(2, 12, VOCAB)] and calls == []
    assert_close(out.loss, reference(**batch).loss)
    handle.remove()

    def scale_linear_outputs(module, args, output):
        return output * 1.5 if isinstance(module, torch.nn.Linear) else output

    handle = torch.nn.modules.module.register_module_forward_hook(scale_linear_outputs)
    try:
        out, messages = _warnings_of(lambda: model(**batch))
        ref = reference(**batch)
    finally:
        handle.remove()
    assert len(messages) == 1 and "scale_linear_outputs" in messages[0] and calls == []
    assert_close(out.loss, ref.loss, what="loss under a global hook")


def test_pre_hook_on_the_head_is_honoured_fused(monkeypatch):
    """A forward pre-hook changes the head's input, which the fused loss reads inside the head's call."""
    calls = _fused_calls(monkeypatch)
    model, reference = pair("llama")
    lce_patch.apply_fused_lce(model)
    for m in (model, reference):
        m.lm_head.register_forward_pre_hook(lambda module, args: (args[0] * 3.0,))
    _, messages = _warnings_of(lambda: assert_trains_equal(model, reference, _batch(6)))
    assert messages == [] and calls == [1]


def test_class_patch_reaches_no_subclass_that_overrides_forward(monkeypatch):
    calls = _fused_calls(monkeypatch)

    class ReadsLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.loss = out.loss + 0.01 * out.logits.float().pow(2).mean()
            return out

    class Inherits(LlamaForCausalLM):
        pass

    base = tiny_model("llama")
    try:
        lce_patch.apply_fused_lce("llama")
        subclassed = ReadsLogits(base.config)
        subclassed.load_state_dict(base.state_dict())
        inheriting = Inherits(base.config)
        inheriting.load_state_dict(base.state_dict())
        for m in (subclassed, inheriting):
            m.train()
        batch = _batch(7)
        out, messages = _warnings_of(lambda: subclassed(**batch))
        assert len(messages) == 1 and "ReadsLogits overrides forward" in messages[0] and calls == []
        inherited = inheriting(**batch)  # no override: the class patch applies
        assert inherited.logits is None and calls == [1]
    finally:
        lce_patch.revert_fused_lce("llama")
    expected = ReadsLogits(base.config)
    expected.load_state_dict(base.state_dict())
    expected.train()
    assert_close(out.loss, expected(**batch).loss, what="subclass loss")
    assert_close(inherited.loss, base.train()(**batch).loss, what="inherited loss")


# --- What users do to a patched model: it stays patched and equal --------------------------------------


def _still_patched_and_equal(model, reference, seed=8):
    assert is_patched(model)
    model.zero_grad()
    reference.zero_grad()
    assert_trains_equal(model, reference, _batch(seed))


def test_pickle_torch_save_and_deepcopy():
    model, reference = pair("gemma2")
    lce_patch.apply_fused_lce(model, z_loss=0.0, chunk_size=8)
    model.train()
    model(**_batch(0)).loss.backward()  # the slot, interceptor and loss stand-in all exist
    model.zero_grad()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.forward.__self__ is loaded and loaded._lce_patch_options.chunk_size == 8
    _still_patched_and_equal(loaded, reference)
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        _still_patched_and_equal(copied, copy.deepcopy(reference))
        assert copied.lm_head.forward.module is copied.lm_head
    lce_patch.revert_fused_lce(loaded)
    assert not is_patched(loaded) and "forward" not in vars(loaded.lm_head)
    _still_patched_and_equal(model, reference)  # the original is untouched


def _loss_in_child(payload: bytes, queue) -> None:
    model, batch = pickle.loads(payload)
    model.train()
    out = model(**batch)
    queue.put((out.logits is None, float(out.loss)))


def test_patched_model_crosses_a_spawned_process():
    model, reference = pair("llama")
    lce_patch.apply_fused_lce(model, backend="torch")
    batch = _batch(9)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_loss_in_child, args=(pickle.dumps((model, batch)), queue))
    process.start()
    no_logits, loss = queue.get(timeout=300)
    process.join(timeout=60)
    reference.train()
    assert no_logits
    assert loss == pytest.approx(float(reference(**batch).loss.detach()), rel=1e-5)


def test_save_pretrained_and_reload(tmp_path):
    model, reference = pair("llama")
    lce_patch.apply_fused_lce(model)
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert not is_patched(loaded)  # a checkpoint holds weights, not the patch: apply it again after loading
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    lce_patch.apply_fused_lce(loaded)
    _still_patched_and_equal(loaded, reference)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_and_device_moves(dtype):
    model, reference = pair("gemma2")
    lce_patch.apply_fused_lce(model)
    model.to(dtype)
    reference.to(dtype)
    model.to("cpu")
    model.train()
    reference.train()
    batch = _batch(10)
    out, ref = model(**batch), reference(**batch)
    assert out.logits is None and out.loss.dtype == ref.loss.dtype
    assert_close(out.loss, ref.loss, rel=1e-5 if dtype == torch.float64 else 2e-2, what=f"{dtype} loss")
    model.half()
    assert model.lm_head.weight.dtype == torch.float16 and is_patched(model)


def test_resize_token_embeddings():
    model, reference = pair("llama")
    lce_patch.apply_fused_lce(model)
    for m in (model, reference):
        torch.manual_seed(0)
        m.resize_token_embeddings(VOCAB + 16)
    assert model.lm_head.weight.shape[0] == VOCAB + 16
    _still_patched_and_equal(model, reference)


def test_peft_merge_and_unload():
    peft = pytest.importorskip("peft")
    model, reference = pair("llama")
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(3)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**config))
    torch.manual_seed(3)
    peft_reference = peft.get_peft_model(reference, peft.LoraConfig(**config))
    lce_patch.apply_fused_lce(peft_model)
    merged = peft_model.merge_and_unload()
    merged_reference = peft_reference.merge_and_unload()
    assert merged is model
    for p in merged.parameters():
        p.requires_grad_(True)
    for p in merged_reference.parameters():
        p.requires_grad_(True)
    _still_patched_and_equal(merged, merged_reference)


# --- Concurrency: per-call state is per thread ----------------------------------------------------------


@pytest.mark.parametrize("patch", ["instance", "class"])
def test_concurrent_calls_from_threads(patch):
    reference = tiny_model("llama")
    try:
        if patch == "class":
            lce_patch.apply_fused_lce("llama")
            model = tiny_model("llama")  # its slot is made by whichever thread calls first
        else:
            model = copy.deepcopy(reference)
            lce_patch.apply_fused_lce(model)
        batches = [_batch(20 + i) for i in range(24)]
        expected = []
        for training in (True, False):
            reference.train(training)
            with torch.no_grad():
                expected += [float(reference(**b).loss) for b in batches]
        results, errors = {}, []
        start = threading.Barrier(4)

        def work(worker: int) -> None:
            start.wait()
            for index in range(worker, 2 * len(batches), 4):
                try:
                    model.train(index < len(batches))  # shared flag: only read at the forward's start
                    with torch.no_grad():
                        out = model(**batches[index % len(batches)])
                    results[index] = float(out.loss)
                except Exception as err:  # noqa: BLE001 - collected and reported below
                    errors.append(repr(err))

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        if patch == "class":
            lce_patch.revert_fused_lce("llama")
    assert errors == []
    assert len(results) == len(expected)
    for index, value in results.items():
        assert value == pytest.approx(expected[index], rel=1e-5), index


def test_the_loss_functions_signature_is_the_models_own():
    # Trainers read it: axolotl looks for num_items_in_batch there to decide how the loss is averaged over
    # gradient accumulation, so the stand-in the patch installs must not hide it behind (*args, **kwargs)
    model, reference = pair("llama")
    lce_patch.apply_fused_lce(model, backend="torch")
    model.train()
    model(**make_batch("ignored_labels", torch.Generator().manual_seed(5)))  # installs the stand-in
    assert type(model.__dict__["_loss_function"]).__name__ == "LossFunctionStandIn"
    signature = inspect.signature(model.loss_function)
    assert signature == inspect.signature(reference.loss_function)
    assert "num_items_in_batch" in signature.parameters
