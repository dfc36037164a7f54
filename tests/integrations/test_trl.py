"""TRL >= 1.15 fused-LM-head protocol served by lce_patch (lce_patch/integrations/trl.py).

CPU, tiny models built from configs, a word-level tokenizer built offline: no downloads.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import types
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
trl_utils = pytest.importorskip("trl.trainer.utils")
if not hasattr(trl_utils, "add_fused_lm_head"):
    pytest.skip("TRL without add_fused_lm_head (< 1.15)", allow_module_level=True)

from lce_patch.integrations.trl import (  # noqa: E402
    TRLProtocolError,
    find_trl_head,
    maybe_install_trl_head,
    remove_trl_head,
)
from tests.integrations.trl_helpers import (  # noqa: E402
    VOCAB,
    compared_run,
    cpu_run,
    lce_callback,
    make_model,
    make_tokenizer,
    spies,
)

add_fused_lm_head = trl_utils.add_fused_lm_head
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
ALL_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")  # DPO with WPO weighting


def trl_and_ours(kind: str, **head_kwargs):
    trl_model = make_model(kind)
    add_fused_lm_head(trl_model, **{"outputs": SFT_OUTPUTS, **head_kwargs})
    our_model = copy.deepcopy(trl_model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lce_patch")  # the head config agrees with TRL's
        assert maybe_install_trl_head(our_model, {}) is True
    return trl_model, our_model


def batch(seed: int = 0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    labels = ids.clone()
    if ignore:
        labels[0, :4] = -100  # a prompt
        labels[1, -3:] = -100  # padding
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return ids, labels, mask


def run(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(fused_lm_head=True, **kwargs)
    # an upstream gradient on every differentiable per-token output (not just the mean NLL)
    w = torch.linspace(0.5, 1.5, out.log_probs.numel()).view_as(out.log_probs)
    objective = out.loss + (w * out.log_probs).sum() * 0.1
    if out.entropy is not None:
        objective = objective + 0.3 * (w.flip(-1) * out.entropy).sum()
    objective.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(a, b, ga, gb, atol=1e-5):
    for name in (
        "loss",
        "log_probs",
        "entropy",
        "is_top1",
        "label_mask",
        "aux_loss",
        "mean_logits",
        "log_sum_sq_probs",
    ):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is None:
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, (name, x.shape, y.shape, x.dtype, y.dtype)
        if x.dtype == torch.bool:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, atol=atol, rtol=1e-5, msg=name)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=atol, rtol=1e-4, msg=name)


# ------------------------------------------------------------------------------------------------------------------
# The protocol, call by call


@pytest.mark.parametrize("kind", ["llama", "gemma2", "cohere", "mixtral"])
@pytest.mark.parametrize("shifted", [False, True], ids=["labels", "shift_labels"])
def test_forward_matches_trl(kind, shifted):
    trl_model, our_model = trl_and_ours(kind)
    ids, labels, mask = batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, **({"shift_labels": labels} if shifted else {"labels": labels}))
    with spies() as s:
        theirs, g_theirs = run(trl_model, **kwargs)
        assert s.theirs.call_count == 1 and s.ours.call_count == 0
        ours, g_ours = run(our_model, **kwargs)
        assert s.theirs.call_count == 1 and s.ours.call_count == 1 and s.ours_fn.call_count == 1
    assert ours.log_probs.shape == (2, 12 if shifted else 11)
    ignored = ~ours.label_mask
    assert ignored.any()
    assert (ours.log_probs[ignored] == 0).all() and (ours.entropy[ignored] == 0).all()
    assert not ours.is_top1[ignored].any()
    assert_same(theirs, ours, g_theirs, g_ours)
    if kind == "mixtral":
        assert ours.aux_loss is not None


@pytest.mark.parametrize(
    "head_kwargs",
    [
        dict(temperature=0.7),
        dict(outputs=("log_probs",)),
        dict(outputs=("log_probs", "is_top1"), temperature=1.3),
        dict(cast_lm_head_to_fp32=True),
        dict(outputs=ALL_OUTPUTS, temperature=0.9),
        dict(outputs=("log_probs", "mean_logits")),
    ],
    ids=["temperature", "log_probs_only", "top1_temperature", "cast_fp32", "all_outputs", "mean_logits"],
)
def test_head_options_match_trl(head_kwargs):
    trl_model, our_model = trl_and_ours("gemma2", **head_kwargs)
    ids, labels, mask = batch(1)
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(37))
    theirs, g_theirs = run(trl_model, **kwargs)
    ours, g_ours = run(our_model, **kwargs)
    assert_same(theirs, ours, g_theirs, g_ours)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_lora_on_the_head_enters_the_fused_head(kind):
    """TRL's own fused head reads ``lm_head.weight``, which under a LoRA layer is the base weight: the
    adapter is skipped. lce_patch's adds the adapter's term; the reference here is the model's own
    unfused logits (LoRA term and softcap included), log-softmaxed in float64."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    reference = make_model(kind)  # built, not copied: TRL's head binds its model
    torch.manual_seed(0)
    reference = peft.get_peft_model(reference, config)
    model = make_model(kind)
    add_fused_lm_head(model, outputs=SFT_OUTPUTS)
    torch.manual_seed(0)
    ours = peft.get_peft_model(model, config)
    assert maybe_install_trl_head(ours.get_base_model(), {}) is True
    ids, labels, mask = batch(2)
    with spies() as s:
        out, grads = run(ours, input_ids=ids, attention_mask=mask, labels=labels)
        assert s.ours.call_count == 1 and s.theirs.call_count == 0

    reference.zero_grad(set_to_none=True)
    logits = reference(input_ids=ids, attention_mask=mask).logits[:, :-1].double()
    targets = labels[:, 1:]
    valid = targets != -100
    log_p = logits.log_softmax(-1)
    log_probs = log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    entropy = -(log_p.exp() * log_p).sum(-1) * valid
    w = torch.linspace(0.5, 1.5, log_probs.numel(), dtype=torch.float64).view_as(log_probs)
    loss = -log_probs.sum() / valid.sum()
    (loss + (w * log_probs).sum() * 0.1 + 0.3 * (w.flip(-1) * entropy).sum()).backward()
    torch.testing.assert_close(out.log_probs.double(), log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy.double(), entropy, atol=1e-5, rtol=1e-5)
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys() and any("lm_head.lora_B" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name].to(grads[name].dtype), atol=1e-5, rtol=1e-4, msg=name)


def test_all_ignored_batch_is_a_differentiable_zero():
    trl_model, our_model = trl_and_ours("llama")
    ids, labels, mask = batch()
    labels = torch.full_like(labels, -100)
    for model in (trl_model, our_model):
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        assert out.loss.item() == 0 and not out.label_mask.any()
        out.loss.backward()  # connected to the graph
        assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() == 0


def test_unfused_calls_reach_the_original_forward():
    trl_model, our_model = trl_and_ours("llama")
    ids, labels, _ = batch()
    with spies() as s:
        a = trl_model(input_ids=ids, labels=labels)
        b = our_model(input_ids=ids, labels=labels)
        assert s.ours.call_count == 0 and s.theirs.call_count == 0
    torch.testing.assert_close(a.logits, b.logits)
    torch.testing.assert_close(a.loss, b.loss)
    generated = our_model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 7)


def test_install_is_idempotent_and_reversible():
    model = make_model()
    add_fused_lm_head(model, outputs=SFT_OUTPUTS)
    trl_forward = model.forward
    assert maybe_install_trl_head(model, {}) is True
    ours = model.forward
    assert ours.__func__ is not trl_forward.__func__ and find_trl_head(model) is model
    assert maybe_install_trl_head(model, {}) is True and model.forward == ours
    assert remove_trl_head(model) is True
    assert model.forward == trl_forward and model.forward.__func__.__code__.co_name == "_fused_forward"
    assert remove_trl_head(model) is False


def test_no_trl_head_returns_false():
    model = make_model()
    assert maybe_install_trl_head(model, {}) is False
    assert "forward" not in vars(model)
    assert find_trl_head(model) is None


def test_under_accelerate_mixed_precision_wrappers():
    """Trainer prepares the model (autocast + fp32-output wrappers around TRL's forward) before on_train_begin."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    trl_model, _ = trl_and_ours("llama")
    AcceleratorState._reset_state(reset_partial_state=True)  # an earlier Trainer test may have set fp32
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    if not accelerator.native_amp:
        pytest.skip("accelerate has no CPU autocast here")
    trl_model = accelerator.prepare_model(trl_model)
    our_model = copy.deepcopy(trl_model)  # shares the wrapper functions with trl_model: they must not change
    wrapper = our_model.forward
    assert maybe_install_trl_head(our_model, {}) is True
    assert our_model.forward != wrapper and find_trl_head(our_model) is our_model
    ids, labels, mask = batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    with spies() as s:
        theirs, g_theirs = run(trl_model, **kwargs)
        ours, g_ours = run(our_model, **kwargs)
        assert s.ours.call_count == 1 and s.theirs.call_count == 1
        assert s.autocast == [True]  # accelerate's autocast still wraps our forward
    assert_same(theirs, ours, g_theirs, g_ours, atol=2e-2)
    assert remove_trl_head(our_model) is True and our_model.forward == wrapper
    with spies() as s:
        run(our_model, **kwargs)
        assert s.theirs.call_count == 1 and s.ours.call_count == 0
    AcceleratorState._reset_state(reset_partial_state=True)  # leave no bf16 state to later tests


# ------------------------------------------------------------------------------------------------------------------
# Protocols this version does not recognise fail loudly


def _version_and(what):
    return rf"TRL {trl.__version__}.*{what}"


@pytest.mark.parametrize(
    "outputs, what",
    [
        (("log_probs", "log_probs_squared"), "log_probs_squared.*unknown"),
        (("log_probs", "entropy", "top5"), "top5.*unknown"),
    ],
)
def test_unknown_outputs_raise(outputs, what):
    model = make_model()
    add_fused_lm_head(model, outputs=outputs)
    with pytest.raises(TRLProtocolError, match=_version_and(what)):
        maybe_install_trl_head(model, {})
    assert model.forward.__func__.__code__.co_name == "_fused_forward"  # left as TRL installed it


def _rebuild_trl_forward(model, **global_overrides):
    """TRL's installed forward, rebuilt against a modified copy of its module globals (TRL itself is untouched)."""
    fn = model.forward.__func__
    namespace = {**fn.__globals__, **global_overrides}
    clone = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    model.forward = types.MethodType(clone, model)


def test_changed_output_class_raises():
    model = make_model()
    add_fused_lm_head(model, outputs=SFT_OUTPUTS)

    @dataclasses.dataclass
    class FusedCausalLMOutput(trl_utils.FusedCausalLMOutput):
        log_variance: torch.Tensor | None = None

    _rebuild_trl_forward(model, FusedCausalLMOutput=FusedCausalLMOutput)
    with pytest.raises(TRLProtocolError, match=_version_and("log_variance")):
        maybe_install_trl_head(model, {})


def test_changed_installer_signature_raises():
    model = make_model()
    add_fused_lm_head(model, outputs=SFT_OUTPUTS)

    def add_fused_lm_head_v2(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=(), top_k=None):
        pass

    _rebuild_trl_forward(model, add_fused_lm_head=add_fused_lm_head_v2)
    with pytest.raises(TRLProtocolError, match=_version_and("top_k")):
        maybe_install_trl_head(model, {})


def _fake_trl_forward(source: str):
    namespace = {"__name__": "trl.trainer.utils_future"}
    exec(source, namespace)  # a forward "defined in TRL" with another protocol
    return namespace["make"]()


def test_changed_forward_signature_raises():
    fn = _fake_trl_forward(
        "def make():\n"
        "    original_forward = text_config = backbone_attr = cast_lm_head_to_fp32 = temperature = outputs = None\n"
        "    def _fused_forward(self, *args, fused_lm_head=False, labels=None, packed_seq_lens=None, **kwargs):\n"
        "        return (original_forward, text_config, backbone_attr, cast_lm_head_to_fp32, temperature, outputs)\n"
        "    return _fused_forward\n"
    )
    model = make_model()
    model.forward = types.MethodType(fn, model)
    with pytest.raises(TRLProtocolError, match=_version_and("packed_seq_lens")):
        maybe_install_trl_head(model, {})


def test_changed_closure_raises():
    fn = _fake_trl_forward(
        "def make():\n"
        "    original_forward = text_config = backbone_attr = cast_lm_head_to_fp32 = temperature = outputs = None\n"
        "    vocab_parallel_group = None\n"
        "    def _fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,\n"
        "                       num_items_in_batch=None, **kwargs):\n"
        "        return (original_forward, text_config, backbone_attr, cast_lm_head_to_fp32, temperature, outputs,\n"
        "                vocab_parallel_group)\n"
        "    return _fused_forward\n"
    )
    model = make_model()
    model.forward = types.MethodType(fn, model)
    with pytest.raises(TRLProtocolError, match=_version_and("vocab_parallel_group")):
        maybe_install_trl_head(model, {})


def test_other_trl_forward_raises():
    fn = _fake_trl_forward(
        "def make():\n    def _chunked_lm_head_forward(self, *args, **kwargs):\n        pass\n"
        "    return _chunked_lm_head_forward\n"
    )
    model = make_model()
    model.forward = types.MethodType(fn, model)
    with pytest.raises(TRLProtocolError, match=_version_and("_chunked_lm_head_forward")):
        maybe_install_trl_head(model, {})


def test_loss_changing_options_are_refused():
    model = make_model()
    add_fused_lm_head(model, outputs=SFT_OUTPUTS)
    with pytest.raises(ValueError, match="z_loss"):
        maybe_install_trl_head(model, {"z_loss": 1e-4})
    assert maybe_install_trl_head(model, {"z_loss": 0.0, "backend": "torch", "chunk_size": 5}) is True
    ids, labels, _ = batch()
    with spies() as s:
        model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert s.ours.call_args.kwargs["chunk_size"] == 5 and s.ours.call_args.kwargs["backend"] == "torch"


# ------------------------------------------------------------------------------------------------------------------
# SFTTrainer end to end


def make_dataset(n=48):
    """Pre-tokenized arithmetic progressions (learnable), of varying lengths, so that padding is ignored."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        start, step = torch.randint(0, VOCAB - 4, (2,), generator=g).tolist()
        length = int(torch.randint(6, 20, (1,), generator=g))
        rows.append({"input_ids": [4 + (start + i * (step % 5 + 1)) % (VOCAB - 4) for i in range(length)]})
    return Dataset.from_list(rows)


def train_sft(tmp_path, kind="llama", callbacks=(), peft_config=None, **config):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        **compared_run(tmp_path, **{"max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 0.3, **config})
    )
    model = make_model(kind)
    if peft_config is not None:
        torch.manual_seed(1)  # LoRA init
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=make_dataset(),
        eval_dataset=make_dataset(8),
        processing_class=make_tokenizer(),
        callbacks=list(callbacks),
        peft_config=peft_config,
    )
    with spies() as s:
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert len(logs) == 3
        logs.append(trainer.evaluate())  # prediction_loss_only: the fused head under no_grad
    return trainer, logs, s


def assert_same_logs(theirs, ours, rtol):
    for a, b in zip(theirs, ours, strict=True):
        prefix = "eval_" if "eval_loss" in a else ""
        for key in ("loss", "entropy", "mean_token_accuracy"):
            key = prefix + key
            assert b[key] == pytest.approx(a[key], rel=rtol, abs=rtol), (key, a, b)
        assert a[prefix + "num_tokens"] == b[prefix + "num_tokens"]


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_sft_trainer_callback_matches_trl_head(tmp_path, kind, caplog):
    trl_trainer, theirs, s_theirs = train_sft(tmp_path / "trl", kind)
    assert s_theirs.theirs.call_count == 3 + 1 and s_theirs.ours.call_count == 0  # 3 steps, 1 eval batch
    with caplog.at_level(logging.DEBUG, logger="lce_patch"):
        trainer, ours, s_ours = train_sft(tmp_path / "ours", kind, callbacks=[lce_callback()])
    # one line, at WARNING (shown by default), says that the fused loss is on and how
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("lce_patch")]
    model = {"llama": "LlamaForCausalLM (architecture 'llama', no softcap)"}.get(
        kind, "Gemma2ForCausalLM (architecture 'gemma2', softcap 0.7)"
    )
    assert lines == [
        (
            logging.WARNING,
            f"lce_patch: SFTTrainer trains {model} with the fused loss (TRL's fused LM head runs "
            "fused_linear_log_probs); chunk_size=auto, backend=auto",
        )
    ]
    # lce_patch's op ran every training step and eval batch; TRL's kernel never did
    assert s_ours.ours.call_count == 4 and s_ours.ours_fn.call_count == 4 and s_ours.theirs.call_count == 0
    assert any(entry["mean_token_accuracy"] > 0 for entry in ours) and all(entry["entropy"] > 0 for entry in ours[:3])
    assert_same_logs(theirs, ours, rtol=1e-4)
    assert find_trl_head(trainer.model) is trainer.model
    for (name, a), b in zip(trl_trainer.model.named_parameters(), trainer.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_trainer_gradient_precompute_and_its_fallback(tmp_path, loss_type, monkeypatch):
    # With loss_type="nll" the op's forward precomputes the gradient (no recompute in backward); "dft"
    # weights each token differently, so the backward recomputes. Both must train like TRL's head.
    from lce_patch.ops.linear_cross_entropy import autograd, chunked

    backward_projections = []
    real_backward = autograd.op_backward
    real_matmul = chunked.logits_into

    def counting_backward(*args, **kwargs):
        calls = []
        monkeypatch.setattr(chunked, "logits_into", lambda *a: calls.append(1) or real_matmul(*a))
        try:
            return real_backward(*args, **kwargs)
        finally:
            monkeypatch.setattr(chunked, "logits_into", real_matmul)
            backward_projections.append(len(calls))

    monkeypatch.setattr(autograd, "op_backward", counting_backward)
    _, theirs, _ = train_sft(tmp_path / "trl", loss_type=loss_type)
    _, ours, _ = train_sft(tmp_path / "ours", callbacks=[lce_callback()], loss_type=loss_type)
    assert_same_logs(theirs, ours, rtol=1e-4)
    assert len(backward_projections) == 3  # one backward per training step
    assert all((count > 0) == (loss_type == "dft") for count in backward_projections), backward_projections


def test_sft_trainer_peft_lora(tmp_path):
    peft = pytest.importorskip("peft")
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    _, theirs, _ = train_sft(tmp_path / "trl", peft_config=peft.LoraConfig(**lora))
    trainer, ours, s_ours = train_sft(
        tmp_path / "ours", callbacks=[lce_callback()], peft_config=peft.LoraConfig(**lora)
    )
    assert isinstance(trainer.model, peft.PeftModel)
    assert find_trl_head(trainer.model) is trainer.model.get_base_model()
    assert s_ours.ours.call_count == 4 and s_ours.theirs.call_count == 0
    assert_same_logs(theirs, ours, rtol=1e-4)


def test_sft_trainer_bf16_mixed_precision(tmp_path):
    """bf16 on CPU: accelerate wraps TRL's forward in autocast before on_train_begin; ours goes under the wrappers."""
    _, theirs, _ = train_sft(tmp_path / "trl", bf16=True)
    _, ours, s_ours = train_sft(tmp_path / "ours", callbacks=[lce_callback()], bf16=True)
    assert s_ours.ours.call_count == 4 and s_ours.theirs.call_count == 0
    assert s_ours.autocast == [True] * 4
    assert_same_logs(theirs, ours, rtol=2e-2)


def test_sft_trainer_unrecognised_protocol_fails_loudly(tmp_path):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(**cpu_run(tmp_path, max_steps=1, bf16=False))
    trainer = SFTTrainer(
        model=make_model(),
        args=args,
        train_dataset=make_dataset(8),
        processing_class=make_tokenizer(),
        callbacks=[lce_callback()],
    )
    # e.g. a future TRL asking for a per-token output lce_patch does not know
    add_fused_lm_head(trainer.model, outputs=("log_probs", "top5_probs"))
    with pytest.raises(TRLProtocolError, match=_version_and("top5_probs")):
        trainer.train()


def test_sft_trainer_callback_added_after_init(tmp_path):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(**cpu_run(tmp_path, max_steps=1, bf16=False))
    trainer = SFTTrainer(
        model=make_model(), args=args, train_dataset=make_dataset(8), processing_class=make_tokenizer()
    )
    trainer.add_callback(lce_callback())
    with spies() as s:
        trainer.train()
    assert s.ours.call_count == 1 and s.theirs.call_count == 0
