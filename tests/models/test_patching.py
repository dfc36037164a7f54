"""apply_fused_lce on every registered architecture: loss and gradients equal the unpatched model's."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

import lce_patch
from lce_patch.models import get_head_config, is_patched
from lce_patch.models.patch import unannounced
from lce_patch.models.refusals import inline_loss_of_type
from lce_patch.ops.core.backend import triton_usable

from .tiny import TINY_CONFIGS, VOCAB, assert_close, assert_grads_match, make_batch, pair, tiny_config, tiny_model

# The core types, through every option and batch layout (test_every_architecture.py covers all types).
ARCHS = [
    pytest.param(t, marks=pytest.mark.skipif(bool(inline_loss_of_type(t)), reason=f"refused: {inline_loss_of_type(t)}"))
    for t in sorted({*TINY_CONFIGS, "gemma3"})  # gemma3 computes its loss inline on transformers 5.6
]
CASES = ["ignored_labels", "num_items_in_batch", "shift_labels", "packed", "logits_to_keep"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("model_type", ARCHS)
def test_training_loss_and_gradients_match(model_type, case):
    model, reference = pair(model_type)
    lce_patch.apply_fused_lce(model, backend="torch")
    batch = make_batch(case, torch.Generator().manual_seed(1))
    model.train()
    reference.train()
    out = model(**batch)
    ref = reference(**batch)
    assert out.logits is None
    assert out.loss.requires_grad
    assert_close(out.loss, ref.loss, what="loss")
    if getattr(ref, "aux_loss", None) is not None:
        assert_close(out.aux_loss, ref.aux_loss, what="aux_loss")
    out.loss.backward()
    ref.loss.backward()
    assert_grads_match(model, reference)


@pytest.mark.parametrize("model_type", ARCHS)
def test_inference_generate_and_eval(model_type):
    model, reference = pair(model_type)
    lce_patch.apply_fused_lce(model)
    model.eval()
    reference.eval()
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(2))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        # no labels: the original forward, logits identical; logits_to_keep honoured
        assert torch.equal(model(**inputs).logits, reference(**inputs).logits)
        assert torch.equal(model(**inputs, logits_to_keep=1).logits, reference(**inputs, logits_to_keep=1).logits)
        # evaluation with labels: the fused loss and the logits, as the unpatched model returns them
        out, ref = model(**batch), reference(**batch)
        assert_close(out.loss, ref.loss, what="eval loss")
        assert_close(out.logits, ref.logits, rel=1e-6, what="eval logits")
        # the loss only where the caller says so: loss_only() (the Trainer's loss-only steps), an option
        with lce_patch.models.loss_only():
            out = model(**batch)
            assert out.logits is None
            assert_close(out.loss, ref.loss, what="loss-only eval loss")
            lce_patch.apply_fused_lce(model, return_logits_in_eval=True)  # True: always
            assert_close(model(**batch).logits, ref.logits, rel=1e-6, what="eval logits")
        lce_patch.apply_fused_lce(model, return_logits_in_eval=False)  # False: never
        out = model(**batch)
        assert out.logits is None
        assert_close(out.loss, ref.loss, what="eval loss")
        prompt = batch["input_ids"][:, :5]
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        if getattr(model.config, "output_router_logits", False):
            # transformers 5.17's own MoE forward fails computing the aux loss while decoding
            kwargs["output_router_logits"] = False
        assert torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))
    assert "logits_to_keep" in inspect.signature(model.forward).parameters
    assert inspect.signature(model.forward) == inspect.signature(reference.forward)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_revert_restores_the_original_forward(model_type):
    model, reference = pair(model_type)
    cls_forward = type(model).__dict__["forward"]
    lce_patch.apply_fused_lce(model)
    lce_patch.apply_fused_lce(model, z_loss=1e-4)  # patching twice is harmless: it only replaces the options
    assert model._lce_patch_options.z_loss == 1e-4
    assert is_patched(model)
    lce_patch.revert_fused_lce(model)
    lce_patch.revert_fused_lce(model)  # and reverting twice too
    assert not is_patched(model)
    assert "forward" not in vars(model) and not hasattr(model, "_lce_patch_options")
    assert model.forward.__func__ is cls_forward
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(3))
    model.train()
    reference.train()
    out, ref = model(**batch), reference(**batch)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)


def test_patching_one_instance_leaves_another_alone():
    model, other = pair("llama")
    lce_patch.apply_fused_lce(model)
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(4))
    other.train()
    assert other(**batch).logits is not None
    assert "forward" not in vars(other) and not is_patched(other)
    assert type(model).forward is type(other).forward  # the class is untouched


def test_class_patch_by_model_type():
    from transformers import LlamaForCausalLM

    original = LlamaForCausalLM.__dict__["forward"]
    reference = tiny_model("llama")
    try:
        assert lce_patch.apply_fused_lce("llama", backend="torch") == (LlamaForCausalLM,)
        lce_patch.apply_fused_lce("llama", backend="torch")  # twice: harmless
        assert is_patched("llama")
        model = tiny_model("llama")  # built after patching: uses the fused loss
        assert "forward" not in vars(model)
        batch = make_batch("ignored_labels", torch.Generator().manual_seed(5))
        model.train()
        out = model(**batch)
        assert out.logits is None
        lce_patch.revert_fused_lce(reference)  # no-op on an unpatched instance
        reference.train()
        lce_patch.revert_fused_lce("llama")
        ref = reference(**batch)
        assert_close(out.loss, ref.loss)
        # an instance patch on top of a class patch, then reverted, leaves the class patch in place
        lce_patch.apply_fused_lce("llama")
        lce_patch.apply_fused_lce(model, z_loss=0.5)
        lce_patch.revert_fused_lce(model)
        assert model(**batch).logits is None
    finally:
        lce_patch.revert_fused_lce("llama")
    assert LlamaForCausalLM.__dict__["forward"] is original
    assert not hasattr(LlamaForCausalLM, "_lce_patch_options")


def test_return_dict_false_and_positional_args():
    model, reference = pair("llama")
    lce_patch.apply_fused_lce(model)
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(6))
    model.train()
    reference.train()
    out = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"], return_dict=False)
    ref = reference(batch["input_ids"], batch["attention_mask"], labels=batch["labels"], return_dict=False)
    assert isinstance(out, tuple)
    assert_close(out[0], ref[0])
    out = model(**batch, return_dict=None)  # PEFT passes return_dict=None explicitly
    assert out.loss is not None and out.logits is None


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                not triton_usable(torch.device("cpu")), reason="triton (or its CPU interpreter) is not available"
            ),
        ),
    ],
)
def test_empty_micro_batch_gives_hugging_face_loss_and_zero_gradients(backend):
    """Every label ignored: the loss Hugging Face gives (NaN for its mean over no token, 0 for a sum
    divided by num_items_in_batch), in training and evaluation; the gradients are zeros, never NaN."""
    model, reference = pair("llama")
    lce_patch.apply_fused_lce(model, backend=backend)
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(7))
    batch["labels"] = torch.full_like(batch["labels"], -100)
    for training in (True, False):
        model.train(training)
        reference.train(training)
        for extra in ({}, {"num_items_in_batch": 5}, {"num_items_in_batch": torch.tensor(5)}):
            model.zero_grad()
            loss = model(**batch, **extra).loss
            expected = reference(**batch, **extra).loss
            if extra:  # sum / num_items_in_batch
                assert loss.item() == expected.item() == 0.0
            else:  # mean over no token
                assert loss.isnan() and expected.isnan()
            assert loss.requires_grad
            loss.backward()
            assert all(not p.grad.any() for p in model.parameters() if p.grad is not None)
    # a batch with one valid label is a number again
    batch["labels"][0, 3] = 7
    assert_close(model(**batch).loss, reference(**batch).loss)


def test_ignore_index_option_and_kwarg():
    model, reference = pair("qwen2")
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(8))
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == -100, -1)
    model.train()
    reference.train()
    ref = reference(**batch, ignore_index=-1)
    lce_patch.apply_fused_lce(model, ignore_index=-1)
    assert_close(model(**batch).loss, ref.loss)
    lce_patch.apply_fused_lce(model)  # default -100, the kwarg wins as in Hugging Face's loss
    assert_close(model(**batch, ignore_index=-1).loss, ref.loss)


def test_loss_options_reach_the_op():
    model, reference = pair("llama")
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(9))
    model.train()
    reference.train()
    ref = reference(**batch)
    lce_patch.apply_fused_lce(model, label_smoothing=0.1)
    smoothed = model(**batch).loss
    logits = ref.logits[:, :-1].reshape(-1, VOCAB)
    targets = batch["labels"][:, 1:].reshape(-1)
    expected = torch.nn.functional.cross_entropy(logits, targets, label_smoothing=0.1)
    assert_close(smoothed, expected)
    lce_patch.apply_fused_lce(model, label_smoothing=0.0, z_loss=1e-3)
    lse = torch.logsumexp(logits[targets != -100], dim=-1)
    expected = torch.nn.functional.cross_entropy(logits, targets) + 1e-3 * (lse**2).mean()
    assert_close(model(**batch).loss, expected)


@pytest.mark.parametrize("case", ["ignored_labels", "shift_labels"])
def test_ignored_tokens_are_counted_for_the_op(case, monkeypatch):
    # The patched forward counts the valid targets before the decoder runs and hands the count to the
    # op (which then skips ignored rows without a host sync); skip_ignored=False hands nothing.
    from lce_patch.models import forward as forward_module

    seen = []
    real_op = forward_module.fused_linear_cross_entropy

    def spy(*args, **kwargs):
        seen.append(kwargs["options"].num_valid_tokens)  # the forward hands the op one options object
        return real_op(*args, **kwargs)

    monkeypatch.setattr(forward_module, "fused_linear_cross_entropy", spy)
    model, reference = pair("llama")
    batch = make_batch(case, torch.Generator().manual_seed(4))
    targets = batch["shift_labels"] if case == "shift_labels" else batch["labels"][:, 1:]
    expected_count = int((targets != -100).sum())
    losses = []
    for skip_ignored in (True, False):
        lce_patch.apply_fused_lce(model, backend="torch", skip_ignored=skip_ignored)
        losses.append(model(**batch).loss)
    assert seen == [expected_count, None]
    assert_close(losses[0], losses[1], what="loss with and without skipping")


def test_other_kwargs_reach_the_decoder():
    model = tiny_model("llama")
    lce_patch.apply_fused_lce(model)
    seen = {}
    model.model.register_forward_pre_hook(lambda mod, args, kwargs: seen.update(kwargs), with_kwargs=True)
    batch = make_batch("packed", torch.Generator().manual_seed(10))
    cu = torch.tensor([0, 6, 14], dtype=torch.int32)
    model.train()
    model(**batch, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=8, max_length_k=8, output_hidden_states=True)
    assert seen["cu_seq_lens_q"] is cu and seen["max_length_k"] == 8 and seen["output_hidden_states"]
    assert seen["position_ids"] is batch["position_ids"]
    assert "skip_logits" not in seen


def test_tied_embeddings_receive_the_gradient_once():
    model, reference = pair("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    lce_patch.apply_fused_lce(model)
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(11))
    model.train()
    reference.train()
    model(**batch).loss.backward()
    reference(**batch).loss.backward()
    assert_grads_match(model, reference)


def test_head_weight_is_read_inside_the_head_module_call():
    model = tiny_model("gemma2")
    lce_patch.apply_fused_lce(model)
    calls = []
    model.lm_head.register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape))
    model.train()
    model(**make_batch("ignored_labels", torch.Generator().manual_seed(12)))
    assert calls == [torch.Size([2, 12, 32])]  # the hidden states went through lm_head(...) (where FSDP hooks fire)
    lce_patch.revert_fused_lce(model)
    assert "forward" not in vars(model.lm_head) and "_loss_function" not in vars(model)  # the interception is undone
    assert not any(name.startswith("_lce_patch") for name in vars(model.lm_head))


def test_head_call_redirects_one_call():
    from lce_patch.models import head_call

    head = torch.nn.Linear(4, 3)
    hidden = torch.randn(2, 4)
    seen = []
    head.register_forward_hook(lambda mod, args, out: seen.append(out))
    out = head_call(head, lambda w, b, h, k: (h @ w.t() + b) * k, hidden, 2.0)
    assert torch.allclose(out, head(hidden) * 2.0)
    assert seen[0] is out and "forward" not in vars(head)


def test_softcap_and_logit_scale_come_from_the_registry():
    assert get_head_config(tiny_model("gemma2")).softcap == 2.0
    assert get_head_config(tiny_model("gemma3_text")).softcap == 2.0
    assert get_head_config(tiny_model("gemma3")).softcap is None  # HF's Gemma3ForConditionalGeneration: no softcap
    assert get_head_config(tiny_model("cohere")).logit_scale == 0.25
    assert get_head_config(tiny_model("granite")).logit_scale == 0.25  # 1 / logits_scaling
    head = get_head_config(tiny_model("llama"))
    assert head.softcap is None and head.logit_scale == 1.0
    # the tiny models' logits exceed the cap, so a missing softcap would change the loss
    model = tiny_model("gemma2")
    with torch.no_grad():
        hidden = model.model(input_ids=torch.arange(10).unsqueeze(0)).last_hidden_state
    assert model.lm_head(hidden).abs().max() > 4.0


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_aux_loss_is_added_as_hugging_face_does(model_type):
    model, reference = pair(model_type)
    lce_patch.apply_fused_lce(model)
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(13))
    model.train()
    reference.train()
    out = model(**batch)
    ref = reference(**batch, output_router_logits=False)
    assert out.aux_loss is not None and out.router_logits is not None
    assert_close(out.loss - model.router_aux_loss_coef * out.aux_loss, ref.loss, what="CE part")
    out = model(**batch, output_router_logits=False)
    assert out.aux_loss is None
    assert_close(out.loss, ref.loss)


def test_errors_are_clear():
    with pytest.raises(ValueError, match="not a supported architecture.*llama"):
        lce_patch.apply_fused_lce("no_such_model")
    with pytest.raises(TypeError, match="unknown option"):
        lce_patch.apply_fused_lce(tiny_model("llama"), chunksize=4)
    with pytest.raises(ValueError, match="backend"):
        lce_patch.apply_fused_lce(tiny_model("llama"), backend="cuda")
    with pytest.raises(TypeError, match="Hugging Face model"):
        lce_patch.apply_fused_lce(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "model_type, meant",
    [("Llama", "llama"), ("lama", "llama"), ("qwen-3", "qwen3"), ("gemma_2", "gemma2"), ("GEMMA-2", "gemma2")],
)
def test_a_misspelled_model_type_is_answered_with_the_registered_types_it_may_mean(model_type, meant):
    for call in (lce_patch.apply_fused_lce, lce_patch.revert_fused_lce):
        with pytest.raises(
            ValueError, match=rf"'{model_type}' is not a supported architecture\. Did you mean '{meant}'[,?]"
        ) as info:
            call(model_type)
        assert "allow_unregistered" not in str(info.value)  # a class patch has no instance to check
    with pytest.raises(ValueError, match=rf"Did you mean '{meant}'") as info:
        lce_patch.apply_fused_lce(model_type, allow_unregistered=True)
    assert not is_patched(meant)


@pytest.mark.parametrize(
    "model_type, message",
    [
        ("no_such_model", r"'no_such_model' is not a supported architecture\. Supported: the \d+ model types .*llama"),
        ("bart", r"'bart' is not a supported architecture: computes its loss inline .* Supported: "),
        ("Bart", r"'Bart' is not a supported architecture\. Did you mean 'bart'\? That type is refused too: computes"),
    ],
)
def test_a_refused_model_type_string_gets_no_allow_unregistered_hint(model_type, message):
    with pytest.raises(ValueError, match=message) as info:
        lce_patch.apply_fused_lce(model_type)
    assert "allow_unregistered" not in str(info.value)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: AutoModel.from_config(tiny_config("llama")),
            r"LlamaModel has no language-model head \(get_output_embeddings\(\) gives none\), so there is no "
            r"language-model loss to fuse: load it with LlamaForCausalLM \(or AutoModelForCausalLM\)\.$",
        ),
        (
            lambda: AutoModel.from_config(tiny_config("gemma3")),
            r"Gemma3Model has no language-model head .* load it with Gemma3ForConditionalGeneration \(or AutoModelFor",
        ),
        (
            lambda: AutoModelForSequenceClassification.from_config(tiny_config("llama")),
            r"LlamaForSequenceClassification has no language-model head .* load it with LlamaForCausalLM ",
        ),
        (
            lambda: AutoModel.from_config(
                AutoConfig.for_model(
                    "vit", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
                )
            ),
            r"ViTModel has no language-model head .*: transformers has no causal-LM class for model_type 'vit'\.$",
        ),
    ],
    ids=["base_model", "multimodal_base_model", "sequence_classifier", "no_causal_lm_class"],
)
def test_a_model_without_an_lm_head_is_told_which_class_to_load(build, message):
    model = build()
    with pytest.raises(ValueError, match=message) as info:
        lce_patch.apply_fused_lce(model)
    assert "allow_unregistered" not in str(info.value) and not is_patched(model)
    with pytest.raises(ValueError, match="has no language-model head"):
        lce_patch.apply_fused_lce(model, allow_unregistered=True)


def test_triton_backend_through_a_patched_model():
    from lce_patch.ops.core.backend import triton_usable

    if not triton_usable(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("triton (or its CPU interpreter) is not available")
    model, reference = pair("gemma2")  # softcap and tied embeddings through the kernels
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    reference.to(device)
    lce_patch.apply_fused_lce(model, backend="triton", chunk_size=8)
    batch = {k: v.to(device) for k, v in make_batch("ignored_labels", torch.Generator().manual_seed(14)).items()}
    model.train()
    reference.train()
    out, ref = model(**batch), reference(**batch)
    assert_close(out.loss, ref.loss)
    out.loss.backward()
    ref.loss.backward()
    assert_grads_match(model, reference)


def test_deepcopy_of_a_patched_model_is_patched_and_independent():
    import copy

    model = tiny_model("llama")
    lce_patch.apply_fused_lce(model)
    clone = copy.deepcopy(model)  # as TRL builds reference models
    assert clone.forward.__self__ is clone
    lce_patch.revert_fused_lce(model)
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(15))
    clone.train()
    model.train()
    assert clone(**batch).logits is None
    assert model(**batch).logits is not None


def test_gradient_checkpointing():
    model, reference = pair("qwen3")
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    lce_patch.apply_fused_lce(model)
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(16))
    out, ref = model(**batch), reference(**batch)
    assert_close(out.loss, ref.loss)
    out.loss.backward()
    ref.loss.backward()
    assert_grads_match(model, reference)


def test_a_patch_logs_one_line_naming_the_model_its_entry_softcap_and_options(caplog):
    model = tiny_model("gemma2")
    softcap = get_head_config(model).softcap
    with caplog.at_level(logging.DEBUG, logger="lce_patch"):
        lce_patch.apply_fused_lce(model)
        lce_patch.apply_fused_lce(model)  # the same options: nothing changes, nothing logged
        model.train()
        ids = torch.randint(0, VOCAB, (2, 8))
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()  # nor in training steps
        lce_patch.apply_fused_lce(model, chunk_size=16, z_loss=1e-4)  # other options: a line saying which
        with unannounced():
            lce_patch.apply_fused_lce(model)
    records = [r for r in caplog.records if r.name.startswith("lce_patch")]
    assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING]
    said = "training calls with labels compute the fused linear cross-entropy"
    assert records[0].getMessage() == (
        f"lce_patch: patched Gemma2ForCausalLM (architecture 'gemma2', softcap {softcap:g}): {said}; "
        "chunk_size=auto, backend=auto"
    )
    assert records[1].getMessage().endswith(f"{said}; chunk_size=16, backend=auto, z_loss=0.0001")
    lce_patch.revert_fused_lce(model)


def test_a_class_patch_logs_one_line(caplog):
    try:
        with caplog.at_level(logging.DEBUG, logger="lce_patch"):
            lce_patch.apply_fused_lce("llama")
            lce_patch.apply_fused_lce("llama")
        records = [r for r in caplog.records if r.name.startswith("lce_patch")]
        assert len(records) == 1 and records[0].levelno == logging.WARNING
        assert records[0].getMessage().startswith("lce_patch: patched the 'llama' classes (LlamaForCausalLM")
        assert (
            records[0].getMessage().endswith("train with the fused linear cross-entropy; chunk_size=auto, backend=auto")
        )
    finally:
        lce_patch.revert_fused_lce("llama")


def test_logits_to_keep_fuses_exactly_the_kept_positions():
    # ms-swift's default: logits_to_keep=k with the labels of the last k positions. The op runs (counted), on the
    # kept positions only; labels of another length are refused by name, where the unpatched loss fails too.
    from lce_patch.ops.core.calls import calls_since, op_calls

    model, reference = pair("llama")
    lce_patch.apply_fused_lce(model, backend="torch")
    model.train()
    reference.train()
    batch = make_batch("ignored_labels", torch.Generator().manual_seed(3))
    for keep in (5, torch.tensor([3, 7, 8, 11])):  # a count of last positions, or the positions themselves
        labels = batch["labels"][:, -keep:] if isinstance(keep, int) else batch["labels"][:, keep]
        kept = dict(batch, labels=labels, logits_to_keep=keep)
        before = op_calls()
        out = model(**kept)
        assert calls_since(before) == {"fused_linear_cross_entropy": 1}
        ref = reference(**kept)
        assert out.logits is None
        assert_close(out.loss, ref.loss, what=f"loss, logits_to_keep={keep}")
        out.loss.backward()
        ref.loss.backward()
        assert_grads_match(model, reference)
        model.zero_grad()
        reference.zero_grad()
    with pytest.raises(ValueError, match=r"LM head scores \(2, 5\) positions but the call's labels are \(2, 12\)"):
        model(**batch, logits_to_keep=5)
    with pytest.raises(ValueError):  # the unpatched model's loss fails on these shapes too
        reference(**batch, logits_to_keep=5)
