"""TRL's experimental GKDTrainer served by fused_linear_divergence through FusedLCECallback (CPU)."""

from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
gkd = pytest.importorskip("trl.experimental.gkd")

from lce_patch import FusedLCECallback  # noqa: E402
from lce_patch.integrations.serving import find_row  # noqa: E402
from lce_patch.integrations.trl import gkd as trl_gkd  # noqa: E402
from tests.integrations.trl_helpers import cpu_run, distillation_model, lora_config, make_tokenizer, record_calls  # noqa: E402

METRICS = ("loss", "grad_norm")
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _dataset(uneven: bool = True):
    rows = []
    for i in range(8):
        prompt = " ".join(f"w{4 + (i * 7 + j) % 50}" for j in range(4 + (i % 3 if uneven else 0)))
        answer = " ".join(f"w{4 + (i * 5 + 3 * j) % 50}" for j in range(5 + (i % 4 if uneven else 0)))
        rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return datasets.Dataset.from_list(rows)


def _train(tokenizer, callbacks, tmp_path, student_kind="llama", beta=0.5, peft=False, **config):
    args = gkd.GKDConfig(
        **cpu_run(
            tmp_path,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=2,
            lmbda=0.0,  # the dataset's completions (no on-policy sampling): the same batches in both runs
            beta=beta,
            learning_rate=1e-2,
            **config,
        )
    )
    peft_config = lora_config() if peft else None
    trainer = gkd.GKDTrainer(
        # float64: the divergence of two random models is small (~4e-3 nats), a difference of log-probabilities of
        # size ~4, so fp32 rounding alone moves it by ~1e-4 relative; in float64 both losses agree to 1e-9
        model=distillation_model(student_kind, 32, 0).double(),
        teacher_model=distillation_model(student_kind, 48, 1).double(),  # a wider teacher
        args=args,
        # Gemma-2's eager attention gives NaN logits in float64 with left padding (with or without lce_patch)
        train_dataset=_dataset(uneven=student_kind != "gemma2"),
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
    )
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.fixture
def op_calls(monkeypatch):
    return record_calls(monkeypatch, "fused_linear_divergence", trl_gkd)


@pytest.mark.parametrize(
    ("student_kind", "beta", "peft"),
    [("llama", 0.5, False), ("llama", 0.0, False), ("llama", 1.0, False), ("gemma2", 0.5, False), ("llama", 0.5, True)],
    ids=["llama-0.5", "llama-0", "llama-1", "gemma2-softcap", "llama-lora"],
)
def test_logged_metrics_equal_trl_loss(tokenizer, op_calls, tmp_path, student_kind, beta, peft):
    _, reference = _train(tokenizer, [], tmp_path / "trl", student_kind, beta, peft)
    assert not op_calls
    _, logs = _train(tokenizer, [FusedLCECallback()], tmp_path / "fused", student_kind, beta, peft)
    assert len(op_calls) == 4  # 2 steps x 2 micro-batches
    assert all(call["num_items_in_batch"] is not None for call in op_calls)  # the Trainer's count, as TRL gets it
    if student_kind == "gemma2":
        assert op_calls[0]["softcap"] == 3.0 and op_calls[0]["teacher_softcap"] == 3.0
    assert len(logs) == len(reference) == 2
    for ours, theirs in zip(logs, reference, strict=True):
        for name in METRICS:
            assert ours[name] == pytest.approx(theirs[name], rel=1e-9, abs=1e-12), name
    assert reference[0]["loss"] > 0


def test_serving_is_per_trainer_and_reversible(tokenizer, tmp_path):
    served, _ = _train(tokenizer, [FusedLCECallback()], tmp_path / "a")
    plain, _ = _train(tokenizer, [], tmp_path / "b")
    assert "compute_loss" in vars(served) and "compute_loss" not in vars(plain)
    assert trl_gkd.unserve(served, find_row(served))
    assert "compute_loss" not in vars(served) and not trl_gkd.unserve(served, find_row(served))


def test_a_subclass_with_its_own_loss_is_left_alone(tokenizer, tmp_path):
    class CustomGKD(gkd.GKDTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = gkd.GKDConfig(**cpu_run(tmp_path, max_steps=1))
    with pytest.warns(UserWarning, match="overrides GKDTrainer's compute_loss"):
        trainer = CustomGKD(
            model=distillation_model("llama", 32, 0),
            teacher_model=distillation_model("llama", 48, 1),
            args=args,
            train_dataset=_dataset(),
            processing_class=tokenizer,
            callbacks=[FusedLCECallback()],
        )
    assert "compute_loss" not in vars(trainer)
