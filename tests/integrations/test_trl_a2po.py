"""TRL's experimental A2POTrainer (A*-PO) served by fused_linear_log_probs (CPU).

Each case trains twice from the same tiny model and seed, once on TRL's path and once with FusedLCECallback. The
completions are sampled by ``generate`` (untouched by the callback), so both runs see the same ones; the policy's
and the reference's sequence log-probabilities come from the op, and every logged metric (loss, implicit reward,
advantage, reward, V*, gradient norm) must agree to float32 rounding (see test_trl_preference.py).
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
a2po = pytest.importorskip("trl.experimental.a2po")

import lce_patch.ops as lce_ops  # noqa: E402
from lce_patch import FusedLCECallback  # noqa: E402
from lce_patch.integrations import serving  # noqa: E402
from lce_patch.integrations.trl import TRLProtocolError  # noqa: E402
from lce_patch.integrations.trl import a2po as trl_a2po  # noqa: E402
from tests.integrations.trl_helpers import (  # noqa: E402
    COMPARED_STEPS,
    VOCAB,
    assert_same_logs,
    compared_run,
    loss_logs,
    make_tokenizer,
    preference_lora,
    preference_model,
    record_calls,
    words,
)


def _reward(completions, **kwargs):
    """Binary, as A*-PO assumes: whether the completion mentions w5 or w6."""
    return [float(any(word in completion.split() for word in ("w5", "w6"))) for completion in completions]


def _prompts(n=8):
    g = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_list(
        [{"prompt": words(torch.randint(4, VOCAB - 4, (3 + i % 3,), generator=g).tolist())} for i in range(n)]
    )


def make_trainer(tmp_path, callbacks=(), kind="llama", peft=False, **config):
    tokenizer = make_tokenizer()
    tokenizer.padding_side = "left"
    model = preference_model(kind)
    if peft:
        from peft import get_peft_model

        torch.manual_seed(2)
        model = get_peft_model(model, preference_lora())
    args = a2po.A2POConfig(
        **compared_run(
            tmp_path,
            max_steps=COMPARED_STEPS,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_prompt_length=16,
            max_completion_length=6,
            num_value_samples=3,
            filter_all_incorrect=False,
            beta2=0.5,  # the implicit reward large enough that the log-probabilities matter in the loss
            **config,
        )
    )
    return a2po.A2POTrainer(
        model=model,
        reward_funcs=_reward,
        args=args,
        train_dataset=_prompts(),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )


@pytest.fixture
def op_calls(monkeypatch):
    return record_calls(monkeypatch, "fused_linear_log_probs", lce_ops)


@pytest.mark.parametrize("kind, peft", [("llama", False), ("gemma2", False), ("llama", True)])
def test_a2po_metrics_equal_trl(tmp_path, op_calls, kind, peft):
    theirs = make_trainer(tmp_path / "trl", kind=kind, peft=peft)
    theirs.train()
    assert not op_calls
    ours = make_trainer(tmp_path / "ours", [FusedLCECallback()], kind=kind, peft=peft)
    assert "_get_sequence_logps" in vars(ours)
    ours.train()
    # per micro-batch: the reference's log-probabilities in _prepare_inputs, then the policy's in compute_loss
    assert len(op_calls) == 2 * 2 * COMPARED_STEPS
    if kind == "gemma2":
        assert op_calls[0]["softcap"] == ours.model.config.final_logit_softcapping
    logs = loss_logs(ours)
    assert {"implicit_reward", "advantage", "reward", "v_star"} <= set(logs[0])
    assert_same_logs(loss_logs(theirs), logs)
    assert logs[0]["implicit_reward"] != 0.0 or logs[-1]["implicit_reward"] != 0.0  # the log-probabilities mattered


def test_no_full_logits_in_a_training_step(tmp_path):
    """No [.., >1 positions, vocabulary] output of the policy's or the reference's head with the callback; without
    it both occur. ``generate`` decodes one position at a time after a prefill whose logits it trims to one."""
    seen = []

    def watch(trainer):
        seen.clear()

        def hook(module, args, output):
            if isinstance(output, torch.Tensor) and output.shape[-1] == VOCAB and output.shape[-2] > 1:
                seen.append(tuple(output.shape))

        for model in (trainer.model, trainer.ref_model):
            model.get_output_embeddings().register_forward_hook(hook)

    plain = make_trainer(tmp_path / "trl")
    watch(plain)
    plain.train()
    assert seen
    served = make_trainer(tmp_path / "ours", [FusedLCECallback()])
    watch(served)
    served.train()
    assert seen == []


def test_serving_is_per_trainer_and_reversible(tmp_path):
    served = make_trainer(tmp_path / "a", [FusedLCECallback()])
    plain = make_trainer(tmp_path / "b")
    assert "_get_sequence_logps" in vars(served) and "_get_sequence_logps" not in vars(plain)
    assert trl_a2po.serve(served, serving.find_row(served), {})  # already served: nothing more
    assert serving.unserve_trainer(served)
    assert "_get_sequence_logps" not in vars(served) and not trl_a2po.unserve(served, serving.find_row(served))


def test_a_subclass_with_its_own_method_is_left_to_trl():
    class CustomA2PO(a2po.A2POTrainer):
        def _get_sequence_logps(self, model, input_ids, attention_mask, logits_to_keep):
            return super()._get_sequence_logps(model, input_ids, attention_mask, logits_to_keep)

    trainer = CustomA2PO.__new__(CustomA2PO)  # what serving inspects: the class and the instance's attributes
    with pytest.warns(UserWarning, match="overrides A2POTrainer's _get_sequence_logps"):
        assert not trl_a2po.serve(trainer, serving.find_row(trainer), {})
    assert "_get_sequence_logps" not in vars(trainer)


def test_unknown_trl_code_is_refused(tmp_path, monkeypatch):
    def _get_sequence_logps(self, model, input_ids, attention_mask, logits_to_keep):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1).sum(-1)

    monkeypatch.setattr(a2po.A2POTrainer, "_get_sequence_logps", _get_sequence_logps)
    with pytest.raises(TRLProtocolError, match="A2POTrainer of TRL .*_get_sequence_logps"):
        make_trainer(tmp_path, [FusedLCECallback()])
