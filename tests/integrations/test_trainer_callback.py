"""FusedLCECallback: a Trainer run with the callback equals an unpatched run; evaluation still works."""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainingArguments

import lce_patch
from lce_patch import FusedLCECallback
from lce_patch.models import forward as forward_module
from lce_patch.models import is_patched, unwrap_causal_lm
from tests.models.tiny import VOCAB, assert_close, tiny_model

SEQ = 16


def _dataset(n: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        input_ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        labels = input_ids.clone()
        labels[: (3 * i) % 11] = -100  # prompts of varying length: micro-batches hold different token counts
        attention_mask = torch.ones(SEQ, dtype=torch.long)
        if i % 3 == 0:
            attention_mask[-4:] = 0
            labels[-4:] = -100
        rows.append(dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels))
    return rows


def _args(tmp_path, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=3,
        # SGD: the final weights are then a linear function of the gradients, so rel 1e-5 is meaningful
        # (Adam's m / sqrt(v) amplifies float noise in near-zero gradient entries)
        optim="sgd",
        learning_rate=0.05,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    options.update(overrides)
    return TrainingArguments(**options)


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the fused op's calls through the patched forward (proof that the fused path ran)."""
    calls = []
    original = forward_module.fused_linear_cross_entropy

    def counting(*args, **kwargs):
        calls.append(kwargs.get("num_items_in_batch"))
        return original(*args, **kwargs)

    monkeypatch.setattr(forward_module, "fused_linear_cross_entropy", counting)
    return calls


def _lora(model):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        init_lora_weights=False,
        target_modules=["q_proj", "v_proj"],
    )
    return peft.get_peft_model(model, config)


def _train(tmp_path, callbacks, model_type="llama", use_lora=False, **args):
    model = tiny_model(model_type)
    if use_lora:
        model = _lora(model)
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    trainer = Trainer(model=model, args=_args(tmp_path, **args), train_dataset=_dataset(12, 0), callbacks=callbacks)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    final = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
    return trainer, losses, (initial, final)


def _assert_same_run(tmp_path, op_calls, **kwargs):
    _, ref_losses, (_, ref_final) = _train(tmp_path / "ref", [], **kwargs)
    assert not op_calls
    trainer, losses, (initial, final) = _train(tmp_path / "fused", [FusedLCECallback(backend="torch")], **kwargs)
    assert is_patched(trainer.model)
    assert len(op_calls) == 3 * trainer.args.gradient_accumulation_steps  # every micro-batch went through the op
    assert len(losses) == len(ref_losses) == 3
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert any(not torch.equal(final[name], initial[name]) for name in final)
    for name, param in final.items():
        assert_close(param, ref_final[name], rel=1e-6, what=name)
        # what training changed agrees too (to fp32 rounding of the weights themselves)
        assert_close(param - initial[name], ref_final[name] - initial[name], rel=1e-3, what=f"update of {name}")
    return trainer


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_training_equals_an_unpatched_run(tmp_path, op_calls, model_type):
    _assert_same_run(tmp_path, op_calls, model_type=model_type)


def test_gradient_accumulation_uses_num_items_in_batch(tmp_path, op_calls):
    _assert_same_run(tmp_path, op_calls, gradient_accumulation_steps=2)
    assert all(n is not None for n in op_calls)  # the loss is sum / num_items_in_batch, never / GA steps


def test_peft_lora(tmp_path, op_calls):
    trainer = _assert_same_run(tmp_path, op_calls, use_lora=True, gradient_accumulation_steps=2)
    assert type(trainer.model).__name__.startswith("PeftModel")
    assert "forward" in vars(unwrap_causal_lm(trainer.model))


def _token_accuracy(prediction):
    predictions, labels = prediction.predictions, prediction.label_ids
    predicted = predictions.argmax(-1)[:, :-1]
    targets = labels[:, 1:]
    mask = targets != -100
    return {"token_accuracy": float((predicted == targets)[mask].mean())}


def test_evaluation_with_prediction_loss_only_and_with_compute_metrics(tmp_path, op_calls):
    eval_dataset = _dataset(6, 1)
    results = {}
    for name, callbacks, metrics in [
        ("ref_loss", [], None),
        ("fused_loss", [FusedLCECallback()], None),
        ("ref_metrics", [], _token_accuracy),
        ("fused_metrics", [FusedLCECallback(return_logits_in_eval=True)], _token_accuracy),
    ]:
        trainer = Trainer(
            model=tiny_model("qwen2"),
            args=_args(tmp_path / name),
            eval_dataset=eval_dataset,
            compute_metrics=metrics,
            callbacks=callbacks,
        )
        results[name] = trainer.evaluate()
    assert len(op_calls) == 2 * 3  # both patched evaluations (3 batches each) used the fused op
    assert_close(torch.tensor(results["fused_loss"]["eval_loss"]), torch.tensor(results["ref_loss"]["eval_loss"]))
    assert_close(torch.tensor(results["fused_metrics"]["eval_loss"]), torch.tensor(results["ref_metrics"]["eval_loss"]))
    assert results["fused_metrics"]["eval_token_accuracy"] == results["ref_metrics"]["eval_token_accuracy"]


def test_refuses_liger_fused_cross_entropy_and_label_smoothing(tmp_path):
    model = tiny_model("llama")
    liger_imported_at_init = False
    try:
        with pytest.raises(ValueError, match="fused_linear_cross_entropy"):
            Trainer(model=model, args=_args(tmp_path, use_liger_kernel=True), callbacks=[FusedLCECallback()])
    except ImportError as err:  # transformers 4.57 and 5.0 look for liger-kernel in Trainer.__init__, before callbacks
        assert "liger-kernel" in str(err) and importlib.util.find_spec("liger_kernel") is None, err
        liger_imported_at_init = True
    assert not is_patched(model)
    with pytest.raises(ValueError, match="label_smoothing"):
        Trainer(model=model, args=_args(tmp_path, label_smoothing_factor=0.1), callbacks=[FusedLCECallback()])
    if liger_imported_at_init:
        return
    # Liger with its fused cross-entropy off is fine
    args = _args(tmp_path, use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": False})
    Trainer(model=model, args=args, callbacks=[FusedLCECallback()])
    assert is_patched(model)
    lce_patch.revert_fused_lce(model)


def test_bad_option_fails_at_construction():
    with pytest.raises(TypeError, match="unknown option"):
        FusedLCECallback(chunksize=3)


def test_trl_hook_is_called_at_train_begin(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(
        FusedLCECallback, "install_trainer_heads", lambda self, model, args, trainer: seen.append((model, trainer))
    )
    trainer, _, _ = _train(tmp_path, [FusedLCECallback()])
    assert seen == [(trainer.model, trainer)]  # the running trainer is found (TRL keeps its ref_model there)


def test_torch_compile_training_equals_an_unpatched_eager_run(tmp_path, monkeypatch):
    """``TrainingArguments(torch_compile=True)`` with the callback: the compiled patched model trains
    like the unpatched model in eager mode (losses and final weights), through the op's compiled path."""
    from lce_patch.ops.linear_cross_entropy import functional

    traced = []
    real = functional.compiled_linear_cross_entropy
    monkeypatch.setattr(functional, "compiled_linear_cross_entropy", lambda *a, **k: traced.append(1) or real(*a, **k))
    torch._dynamo.reset()
    _, ref_losses, (_, ref_final) = _train(tmp_path / "ref", [])
    trainer, losses, (initial, final) = _train(
        tmp_path / "compiled", [FusedLCECallback(backend="torch")], torch_compile=True
    )
    torch._dynamo.reset()
    assert is_patched(trainer.model)
    assert trainer.args.torch_compile and traced  # the loss went through the custom operator
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert any(not torch.equal(final[name], initial[name]) for name in final)
    for name, param in final.items():
        assert_close(param, ref_final[name], rel=1e-6, what=name)


@pytest.mark.parametrize("liger_first", [True, False])
def test_composes_with_liger_non_loss_kernels(liger_first):
    """Liger's RMSNorm/RoPE/SwiGLU kernels with its fused loss off leave the forward to lce_patch, in
    either order, and reverting lce_patch leaves Liger's modules. (Liger's kernels do not run under the
    CPU interpreter; the numbers of this combination come from the H100 runs of e2e_train.py.) Skipped
    where liger-kernel is not installed, as in CI: with it installed, TRL routes its own losses through
    Liger's kernels, which the CPU interpreter cannot run."""
    liger = pytest.importorskip("liger_kernel.transformers")
    model = tiny_model("llama")
    original_forward = type(model).forward

    def apply_liger():
        liger.apply_liger_kernel_to_llama(
            model=model, fused_linear_cross_entropy=False, cross_entropy=False, rope=True, rms_norm=True, swiglu=True
        )

    if liger_first:
        apply_liger()
    lce_patch.apply_fused_lce(model)
    if not liger_first:
        apply_liger()
    assert is_patched(model)

    def liger_norm() -> bool:  # Liger swaps the instance's forward (and sometimes its class)
        return "Liger" in type(model.model.norm).__name__ + model.model.norm.forward.__qualname__

    assert liger_norm()
    assert type(model).forward is original_forward  # Liger did not replace the class's forward
    lce_patch.revert_fused_lce(model)
    assert not is_patched(model) and liger_norm()


# --- Evaluation and prediction give what the unpatched model gives ------------------------------------


def _eval_dataset_with_empty_batches() -> list[dict]:
    """Eval rows in pairs (batch size 2); the second pair has every label ignored (Hugging Face: NaN loss; the
    Trainer drops it from its mean on transformers 5.24, not on 5.6, where the eval loss is NaN with or without
    lce_patch)."""
    rows = _dataset(8, 3)
    for row in rows[2:4]:
        row["labels"] = torch.full_like(row["labels"], -100)
    return rows


def _evaluate_both(tmp_path, callback_options=None, **trainer_kwargs):
    results = {}
    for name, callbacks in [("ref", []), ("fused", [FusedLCECallback(**(callback_options or {}))])]:
        trainer = Trainer(
            model=tiny_model("qwen2"),
            args=_args(tmp_path / name),
            eval_dataset=_eval_dataset_with_empty_batches(),
            callbacks=callbacks,
            **trainer_kwargs,
        )
        results[name] = trainer
    return results["ref"], results["fused"]


def test_eval_loss_with_all_ignored_batches_equals_unpatched(tmp_path, op_calls):
    ref, fused = _evaluate_both(tmp_path)
    ref_metrics, fused_metrics = ref.evaluate(), fused.evaluate()
    assert len(op_calls) == 4  # every eval batch ran the fused op, the empty one included
    assert fused_metrics["eval_loss"] == pytest.approx(ref_metrics["eval_loss"], rel=1e-6, nan_ok=True)


def test_predict_returns_the_logits_of_the_unpatched_model(tmp_path, op_calls):
    ref, fused = _evaluate_both(tmp_path)
    dataset = _eval_dataset_with_empty_batches()
    expected, got = ref.predict(dataset), fused.predict(dataset)
    assert len(op_calls) == 4  # the loss still fused
    assert got.predictions.shape == expected.predictions.shape == (8, SEQ, VOCAB)
    np.testing.assert_allclose(got.predictions, expected.predictions, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got.label_ids, expected.label_ids)
    assert got.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-6, nan_ok=True)
    # evaluation that needs the loss only still builds no logits
    op_calls.clear()
    assert fused.evaluate()["eval_loss"] == pytest.approx(ref.evaluate()["eval_loss"], rel=1e-6, nan_ok=True)


def _argmax_logits(logits, labels):
    return logits.argmax(-1)


def _accuracy_of_ids(prediction):
    predicted, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
    mask = labels != -100
    return {"accuracy": float((predicted == labels)[mask].mean())}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(compute_metrics=_token_accuracy),
        dict(compute_metrics=_accuracy_of_ids, preprocess_logits_for_metrics=_argmax_logits),
    ],
    ids=["compute_metrics", "preprocess_logits_for_metrics"],
)
def test_compute_metrics_gets_the_logits_with_the_default_callback(tmp_path, op_calls, kwargs):
    ref, fused = _evaluate_both(tmp_path, **kwargs)
    ref_metrics, fused_metrics = ref.evaluate(), fused.evaluate()
    assert len(op_calls) == 4
    assert ref_metrics.keys() == fused_metrics.keys()
    for key in ref_metrics:
        if not key.endswith(("runtime", "per_second", "preparation_time")):
            assert fused_metrics[key] == pytest.approx(ref_metrics[key], rel=1e-6, nan_ok=True), key


def test_return_logits_in_eval_false_is_refused_where_logits_are_needed(tmp_path):
    with pytest.raises(ValueError, match="compute_metrics.*return_logits_in_eval=False"):
        Trainer(
            model=tiny_model("qwen2"),
            args=_args(tmp_path),
            compute_metrics=_token_accuracy,
            callbacks=[FusedLCECallback(return_logits_in_eval=False)],
        )
    trainer = Trainer(
        model=tiny_model("qwen2"), args=_args(tmp_path), callbacks=[FusedLCECallback(return_logits_in_eval=False)]
    )
    unpatched = Trainer(model=tiny_model("qwen2"), args=_args(tmp_path / "ref")).evaluate(
        _eval_dataset_with_empty_batches()
    )
    loss = trainer.evaluate(_eval_dataset_with_empty_batches())["eval_loss"]  # the loss only: fine
    assert loss == pytest.approx(unpatched["eval_loss"], rel=1e-6, nan_ok=True)
    with pytest.raises(ValueError, match="predict.*return_logits_in_eval=False"):
        trainer.predict(_eval_dataset_with_empty_batches())


def test_compute_loss_func_is_named_as_running_unfused(tmp_path):
    def my_loss(outputs, labels, num_items_in_batch=None):
        return outputs.logits.float().mean()

    with pytest.warns(UserWarning, match="compute_loss_func.*unfused"):
        trainer = Trainer(
            model=tiny_model("qwen2"),
            args=_args(tmp_path),
            train_dataset=_dataset(4, 0),
            compute_loss_func=my_loss,
            callbacks=[FusedLCECallback()],
        )
    trainer.train()  # trains, as unpatched (the Trainer hands the model no labels)


def _lce_records(caplog) -> list:
    return [record for record in caplog.records if record.name.startswith("lce_patch")]


def test_one_line_says_the_fused_loss_is_on_when_training_starts(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="lce_patch"):
        model = tiny_model("gemma2")
        trainer = Trainer(
            model=model, args=_args(tmp_path), train_dataset=_dataset(6, 0), callbacks=[FusedLCECallback()]
        )
        assert not _lce_records(caplog)  # patched at __init__, said when training starts
        trainer.train()
        trainer.train()  # once, however often the trainer trains
    records = _lce_records(caplog)
    assert [r.levelno for r in records] == [logging.WARNING]  # shown by default, as the Trainer's warnings are
    softcap = model.config.final_logit_softcapping
    assert records[0].getMessage() == (
        f"lce_patch: Trainer trains Gemma2ForCausalLM (architecture 'gemma2', softcap {softcap:g}) with the fused "
        "loss (the model's forward runs fused_linear_cross_entropy); chunk_size=auto, backend=auto"
    )


def test_the_line_follows_the_trainers_log_level_and_is_left_out_where_training_runs_unfused(tmp_path, caplog):
    import transformers

    verbosity = transformers.logging.get_verbosity()
    try:
        with caplog.at_level(logging.DEBUG, logger="lce_patch"):
            trainer = Trainer(
                model=tiny_model("qwen2"),
                args=_args(tmp_path, log_level="error"),
                train_dataset=_dataset(4, 0),
                callbacks=[FusedLCECallback(chunk_size=8)],
            )
            trainer.train()
    finally:
        transformers.logging.set_verbosity(verbosity)  # the Trainer set it from log_level
    records = _lce_records(caplog)
    assert [r.levelno for r in records] == [logging.DEBUG]
    assert records[0].getMessage().endswith("chunk_size=8, backend=auto")

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="lce_patch"), pytest.warns(UserWarning, match="compute_loss_func"):
        trainer = Trainer(
            model=tiny_model("qwen2"),
            args=_args(tmp_path),
            train_dataset=_dataset(4, 0),
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.float().mean(),
            callbacks=[FusedLCECallback()],
        )
        trainer.train()
    assert not _lce_records(caplog)  # the warning says it runs unfused; no line says otherwise


class _LossOutsideTheModel(Trainer):
    """A front end's trainer that takes the labels out of the call and scores the logits itself."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return (loss, logits) if return_outputs else loss


def test_no_line_claims_a_fused_loss_the_op_did_not_compute(tmp_path, caplog):
    # The line waits for the first optimizer step and reads the fused ops' call count: a trainer whose loss never
    # reaches the patched forward gets a warning saying it trains unfused, and no line saying otherwise.
    callback = FusedLCECallback()
    with caplog.at_level(logging.DEBUG, logger="lce_patch"), pytest.warns(UserWarning, match="WITHOUT the fused"):
        trainer = _LossOutsideTheModel(
            model=tiny_model("llama"), args=_args(tmp_path), train_dataset=_dataset(4, 0), callbacks=[callback]
        )
        trainer.train()
    assert not any("with the fused loss" in r.getMessage() for r in _lce_records(caplog))
    assert callback.outcomes == [
        dict(trainer="_LossOutsideTheModel", model="LlamaForCausalLM", fused=False, line=callback.outcomes[0]["line"],
             op_calls={})
    ]  # fmt: skip
    assert callback.outcomes[0]["line"].startswith("lce_patch: _LossOutsideTheModel trains LlamaForCausalLM WITHOUT")

    # the same model and data through the Trainer's own loss: fused, one call per micro-batch of the first step
    callback = FusedLCECallback()
    trainer = Trainer(
        model=tiny_model("llama"),
        args=_args(tmp_path, gradient_accumulation_steps=2),
        train_dataset=_dataset(8, 0),
        callbacks=[callback],
    )
    trainer.train()
    [outcome] = callback.outcomes
    assert outcome["fused"] and outcome["op_calls"] == {"fused_linear_cross_entropy": 2}
    assert "with the fused loss (the model's forward runs fused_linear_cross_entropy)" in outcome["line"]
