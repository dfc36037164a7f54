"""TRL's DistillationTrainer served by fused_linear_divergence through FusedLCECallback (CPU, float32)."""

from __future__ import annotations

import gc
import importlib
import logging

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
distillation = pytest.importorskip("trl.trainer.distillation_trainer")


from lce_patch import FusedLCECallback  # noqa: E402
from lce_patch.integrations.serving import SERVED, find_row  # noqa: E402
from lce_patch.integrations.trl import distillation as trl_distillation  # noqa: E402
from tests.integrations.trl_helpers import VOCAB, cpu_run, distillation_model, lora_config, make_tokenizer  # noqa: E402

METRICS = ("loss", "grad_norm", "entropy")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _train(tokenizer, callbacks, student_kind="llama", beta=0.5, tmp_path=None, peft=False, **config):
    prompts = datasets.Dataset.from_list(
        [{"prompt": " ".join(f"w{4 + (i * 7 + j) % 50}" for j in range(6))} for i in range(8)]
    )
    args = trl.DistillationConfig(
        **cpu_run(
            tmp_path,
            per_device_train_batch_size=4,
            max_steps=2,
            max_completion_length=12,
            beta=beta,
            learning_rate=1e-2,
            **config,
        )
    )
    peft_config = lora_config() if peft else None
    trainer = trl.DistillationTrainer(
        model=distillation_model(student_kind, 32, 0),
        teacher_model=distillation_model(student_kind, 48, 1),  # a wider teacher
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, logs


@pytest.fixture
def op_calls(monkeypatch):
    calls = []
    original = trl_distillation.fused_linear_divergence

    def counting(*args, **kwargs):
        # TRL's kernel takes fp32 logits and accumulates dW in fp32: the served op is asked for the same precision
        assert kwargs.get("fp32_logits") and kwargs.get("fp32_weight_grad"), kwargs
        calls.append(kwargs.get("num_items_in_batch"))
        return original(*args, **kwargs)

    monkeypatch.setattr(trl_distillation, "fused_linear_divergence", counting)
    return calls


@pytest.mark.parametrize(
    ("student_kind", "beta", "peft"),
    [("llama", 0.5, False), ("llama", 0.0, False), ("llama", 1.0, False), ("gemma2", 0.5, False), ("llama", 0.5, True)],
    ids=["llama-0.5", "llama-0", "llama-1", "gemma2-softcap", "llama-lora"],
)
def test_logged_metrics_equal_trl_kernel(tokenizer, op_calls, tmp_path, student_kind, beta, peft, caplog):
    _, reference = _train(tokenizer, [], student_kind, beta, tmp_path=tmp_path / "trl", peft=peft)
    assert not op_calls
    with caplog.at_level(logging.DEBUG, logger="lce_patch"):
        trainer, logs = _train(
            tokenizer, [FusedLCECallback()], student_kind, beta, tmp_path=tmp_path / "fused", peft=peft
        )
    # one line says so, naming the path the loss takes
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("lce_patch")]
    assert len(lines) == 1 and lines[0][0] == logging.WARNING, lines
    assert lines[0][1].startswith("lce_patch: DistillationTrainer trains ")
    assert "with the fused loss (its loss runs fused_linear_divergence)" in lines[0][1]
    assert len(op_calls) == 2  # one call per step (batch of 4, no gradient accumulation)
    assert len(logs) == len(reference) == 2
    for ours, theirs in zip(logs, reference):
        for name in METRICS:
            assert ours[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-7), name
        assert ours["completions/mean_length"] == theirs["completions/mean_length"]  # same generations
    assert reference[0]["loss"] > 0


def test_serving_is_per_trainer_and_reversible(tokenizer, tmp_path):
    module = importlib.import_module("trl.trainer.distillation_trainer")
    installed = module._chunked_divergence_loss  # the dispatcher if a trainer of another test is still alive
    original = getattr(installed, SERVED, installed)
    served, _ = _train(tokenizer, [FusedLCECallback()], tmp_path=tmp_path / "a")
    plain, _ = _train(tokenizer, [], tmp_path=tmp_path / "b")
    assert "_compute_loss" in vars(served) and "_compute_loss" not in vars(plain)
    assert module._chunked_divergence_loss is not original  # the dispatcher, TRL's own for the plain trainer
    gc.collect()  # the served trainers of other tests
    assert trl_distillation.unserve(served, find_row(served))
    assert module._chunked_divergence_loss is original and "_compute_loss" not in vars(served)


class _PartitionedHead(torch.nn.Linear):
    """A head whose weight is whole only inside its own call, as under DeepSpeed ZeRO-3: outside, an empty tensor
    (the partition); its forward hooks gather it and release it again, and record what the call returned."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__(hidden, vocab, bias=False)
        self.whole = self.weight.detach().clone()
        self.outputs: list[object] = []
        self.weight.data = torch.empty(0)
        self.register_forward_pre_hook(lambda module, args: setattr(module.weight, "data", module.whole))
        self.register_forward_hook(self._release)

    def _release(self, module, args, output):
        self.outputs.append(output)
        self.weight.data = torch.empty(0)


def test_heads_read_inside_their_calls():
    # TRL passes lm_head.weight read outside the heads' calls: under ZeRO-3 an empty partition. The served loss
    # reads each head's weight inside its own call (teacher nested in student), and the teacher's call hands its
    # result out boxed (no backward hooks armed on the frozen teacher's head).
    torch.manual_seed(0)
    student, teacher = _PartitionedHead(VOCAB, 16), _PartitionedHead(VOCAB, 24)
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    teacher_hidden = torch.randn(2, 5, 24)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    options = {"op": {"backend": "torch"}, "heads": lambda: (student, teacher)}
    loss, entropy_sum, valid = trl_distillation._fused_divergence_loss(
        hidden, teacher_hidden, student.weight, teacher.weight, mask, 0.5, options=options
    )
    expected, entropy = trl_distillation.fused_linear_divergence(
        hidden, student.whole, teacher_hidden, teacher.whole, mask=mask, beta=0.5, backend="torch", return_entropy=True
    )
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(entropy_sum, entropy[mask.bool()].sum())
    assert int(valid) == 8
    assert student.weight.numel() == teacher.weight.numel() == 0  # released after the calls
    assert len(student.outputs) == len(teacher.outputs) == 1
    assert isinstance(student.outputs[0], tuple) and student.outputs[0][0] is loss  # the student's call: the loss
    assert not isinstance(teacher.outputs[0], (torch.Tensor, tuple, list, dict))  # the teacher's: boxed
    # Weights that are not the heads' own (another caller's tensors) are used as given.
    other = torch.randn(VOCAB, 16)
    loss_other, _, _ = trl_distillation._fused_divergence_loss(
        hidden, teacher_hidden, other, teacher.weight, mask, 0.5, options=options
    )
    expected_other = trl_distillation.fused_linear_divergence(
        hidden, other, teacher_hidden, teacher.whole, mask=mask, beta=0.5, backend="torch"
    )
    torch.testing.assert_close(loss_other, expected_other)
    assert len(student.outputs) == 1 and len(teacher.outputs) == 2
