"""TRL's experimental ORPO, CPO (every loss type), TPO and Online DPO trainers served by fused_linear_log_probs (CPU).

Each case trains twice from the same tiny model, with the same batches: once on TRL's path (full logits), once
with FusedLCECallback. Every logged metric (losses, rewards, log-probabilities, the NLL term, the mean logits of
the chosen and rejected sequences, the gradient norm) must agree. Both runs are float32 and differ only in how the
log-softmax is summed (lce_patch's op reduces the vocabulary a chunk at a time, TRL's ``log_softmax`` in one pass):
a few float32 ulps per log-probability, a relative difference of ~1e-7 that two SGD steps carry into the weights.
The largest relative difference seen across these cases is below 1e-6; the tests allow 1e-5 (and 1e-6 absolute for
metrics near zero, such as reward margins and mean logits).
"""

from __future__ import annotations

import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
orpo = pytest.importorskip("trl.experimental.orpo")
cpo = pytest.importorskip("trl.experimental.cpo")
tpo = pytest.importorskip("trl.experimental.tpo")
online_dpo = pytest.importorskip("trl.experimental.online_dpo")

import lce_patch.ops as lce_ops  # noqa: E402
from lce_patch import FusedLCECallback  # noqa: E402
from lce_patch.integrations import serving  # noqa: E402
from lce_patch.integrations.trl import TRLProtocolError, unserved  # noqa: E402
from lce_patch.integrations.trl import preference as trl_preference  # noqa: E402
from tests.integrations.trl_helpers import (  # noqa: E402
    COMPARED_STEPS,
    VOCAB,
    assert_same_logs,
    compared_run,
    cpu_run,
    loss_logs,
    make_tokenizer,
    preference_lora,
    preference_model,
    record_calls,
    words,
)


def _dataset(n=8, gold=False):
    """Prompts and completions of uneven lengths (padding in both halves of the concatenated batch)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        prompt = torch.randint(4, VOCAB - 4, (3 + i % 3,), generator=g).tolist()
        rejected = torch.randint(4, VOCAB - 4, (2 + i % 4,), generator=g).tolist()
        row = {"prompt": words(prompt), "chosen": words([prompt[-1]] * (3 + i % 2)), "rejected": words(rejected)}
        if gold:
            row["reference"] = words([prompt[0]] * 3)  # TPO's gold completion
        rows.append(row)
    return datasets.Dataset.from_list(rows)


def _reward(completions, **kwargs):
    return [completion.split().count("w5") + 0.1 * len(completion.split()) for completion in completions]


def make_trainer(name, tmp_path, callbacks=(), kind="llama", peft_config=None, eval_dataset=None, **config):
    common = compared_run(
        tmp_path, max_steps=COMPARED_STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_length=32
    )
    if peft_config is not None:
        torch.manual_seed(2)  # LoRA init
    if name == "tpo":
        common.pop("max_length")
        return tpo.TPOTrainer(
            model=preference_model(kind),
            args=tpo.TPOConfig(**common, **config),
            train_dataset=_dataset(gold=True),
            processing_class=make_tokenizer(),
            callbacks=list(callbacks),
            peft_config=peft_config,
        )
    if name == "online_dpo":
        return online_dpo.OnlineDPOTrainer(
            model=preference_model(kind),
            ref_model=None if peft_config is not None else preference_model(kind),
            reward_funcs=_reward,
            args=online_dpo.OnlineDPOConfig(**common, max_new_tokens=6, **config),
            train_dataset=_dataset().select_columns(["prompt"]),
            processing_class=make_tokenizer(),
            callbacks=list(callbacks),
            peft_config=peft_config,
        )
    trainer_class, config_class = {"orpo": (orpo.ORPOTrainer, orpo.ORPOConfig), "cpo": (cpo.CPOTrainer, cpo.CPOConfig)}[
        name
    ]
    return trainer_class(
        model=preference_model(kind),
        args=config_class(**common, **config),
        train_dataset=_dataset(),
        eval_dataset=eval_dataset,
        processing_class=make_tokenizer(),
        callbacks=list(callbacks),
        peft_config=peft_config,
    )


@pytest.fixture
def op_calls(monkeypatch):
    return record_calls(monkeypatch, "fused_linear_log_probs", lce_ops)


CASES = {
    "orpo": ("orpo", "llama", {}),
    "orpo-gemma2-softcap": ("orpo", "gemma2", {}),
    "orpo-mixtral-aux-loss": ("orpo", "mixtral", {}),
    "cpo-sigmoid": ("cpo", "llama", {"loss_type": "sigmoid"}),
    "cpo-sigmoid-smoothed": ("cpo", "llama", {"loss_type": "sigmoid", "label_smoothing": 0.1}),
    "cpo-hinge": ("cpo", "llama", {"loss_type": "hinge"}),
    "cpo-ipo": ("cpo", "llama", {"loss_type": "ipo"}),
    "cpo-simpo": ("cpo", "llama", {"loss_type": "simpo", "cpo_alpha": 0.0}),
    "cpo-simpo-with-nll": ("cpo", "llama", {"loss_type": "simpo", "cpo_alpha": 0.5}),
    "cpo-alphapo": ("cpo", "llama", {"loss_type": "alphapo", "alpha": 0.25}),
}
# LoRA on the attention projections for each trainer, and LoRA on the head too (the op computes its term)
PARAMS = [(case, None) for case in CASES] + [
    ("orpo", "lora"),
    ("cpo-sigmoid", "lora"),
    ("orpo", "lora-head"),
    ("cpo-simpo", "lora-head"),
]


@pytest.mark.parametrize("case, peft", PARAMS, ids=[f"{case}-{peft or 'full'}" for case, peft in PARAMS])
def test_logged_metrics_equal_trl(tmp_path, op_calls, case, peft):
    name, kind, config = CASES[case]
    peft_config = None if peft is None else preference_lora(head=peft == "lora-head")
    theirs = make_trainer(name, tmp_path / "trl", kind=kind, peft_config=peft_config, **config)
    theirs.train()
    assert not op_calls
    ours = make_trainer(name, tmp_path / "ours", [FusedLCECallback()], kind, peft_config, **config)
    ours.train()
    assert (
        len(op_calls) == 2 * COMPARED_STEPS
    )  # one per micro-batch: the log-probs, the NLL and the mean logits at once
    assert all(call["return_mean_logits"] for call in op_calls)
    if kind == "gemma2":
        assert op_calls[0]["softcap"] == ours.model.config.final_logit_softcapping
    if peft == "lora-head":
        assert all(call["low_rank_hidden"] is not None for call in op_calls)
    assert_same_logs(loss_logs(theirs), loss_logs(ours))
    if kind == "mixtral":
        assert ours.aux_loss_enabled


ONLINE_CASES = {
    "tpo-sigmoid": ("tpo", {}),
    "tpo-hinge": ("tpo", {"loss_type": "hinge"}),
    "tpo-ipo": ("tpo", {"loss_type": "ipo"}),
    "tpo-l": ("tpo", {"loss_type": "tpo-l"}),
    "tpo-no-nll": ("tpo", {"tpo_alpha": 0.0}),
    "online-dpo": ("online_dpo", {}),
    "online-dpo-ipo": ("online_dpo", {"loss_type": "ipo"}),
}
ONLINE_PARAMS = [(case, False) for case in ONLINE_CASES] + [("tpo-sigmoid", True), ("online-dpo", True)]


@pytest.mark.parametrize("case, peft", ONLINE_PARAMS, ids=[f"{c}-{'lora' if p else 'full'}" for c, p in ONLINE_PARAMS])
def test_tpo_and_online_dpo_metrics_equal_trl(tmp_path, op_calls, case, peft):
    """TPO: every metric it logs (entropy, mean logits, token accuracy, rewards, log-probs) from one op call per
    micro-batch. Online DPO: the policy's and the reference's log-probabilities of the sampled completions (the
    reference is a separate model, or the policy with its adapters disabled under LoRA)."""
    name, config = ONLINE_CASES[case]
    peft_config = preference_lora() if peft else None
    theirs = make_trainer(name, tmp_path / "trl", peft_config=peft_config, **config)
    theirs.train()
    assert not op_calls
    ours = make_trainer(name, tmp_path / "ours", [FusedLCECallback()], peft_config=peft_config, **config)
    ours.train()
    per_micro_batch = 1 if name == "tpo" else 2  # Online DPO: the policy, then the reference
    assert len(op_calls) == per_micro_batch * 2 * COMPARED_STEPS
    assert_same_logs(loss_logs(theirs), loss_logs(ours))


def test_evaluation_metrics_equal_trl(tmp_path, op_calls):
    """evaluate() reads the same metrics (prefixed eval_) through the served method."""
    results = []
    for callbacks in ([], [FusedLCECallback()]):
        trainer = make_trainer("orpo", tmp_path / str(len(callbacks)), callbacks, eval_dataset=_dataset(4))
        results.append(trainer.evaluate())
    assert len(op_calls) == 1  # the 4 pairs make one evaluation batch
    theirs, ours = results
    assert "eval_logits/chosen" in ours and "eval_nll_loss" in ours
    assert_same_logs([theirs], [ours])


@pytest.mark.parametrize("name", ["orpo", "cpo", "tpo", "online_dpo"])
def test_no_full_logits_in_a_training_step(tmp_path, name):
    """With the callback neither the model's forward nor a [.., vocabulary] output of the head occurs in
    training; without it (checking the check) both do. Online DPO samples its completions with ``generate``, whose
    one-position logits ([B, 1, vocabulary] per new token) are not the training step's and are let through."""
    seen = {}

    def watch(trainer):
        seen.clear()
        model = trainer.model
        head = model.get_output_embeddings()

        def head_hook(module, args, output):
            if isinstance(output, torch.Tensor) and output.shape[-1] == VOCAB and output.shape[-2] > 1:
                seen["full_logits"] = tuple(output.shape)

        def model_hook(module, args, kwargs, output):
            if output.logits.shape[-2] > 1:  # not a decoding step of generate
                seen["model_forward"] = True

        return [head.register_forward_hook(head_hook), model.register_forward_hook(model_hook, with_kwargs=True)]

    plain = make_trainer(name, tmp_path / "trl")
    hooks = watch(plain)
    plain.train()
    assert seen.get("full_logits") and seen.get("model_forward")
    for hook in hooks:
        hook.remove()

    served = make_trainer(name, tmp_path / "ours", [FusedLCECallback()])
    watch(served)
    served.train()
    assert seen == {}


def test_serving_is_per_trainer_and_reversible(tmp_path):
    served = make_trainer("cpo", tmp_path / "a", [FusedLCECallback()])
    plain = make_trainer("cpo", tmp_path / "b")
    assert "concatenated_forward" in vars(served) and "concatenated_forward" not in vars(plain)
    assert trl_preference.serve(served, serving.find_row(served), {})  # already served: nothing more
    assert trl_preference.unserve(served, serving.find_row(served))
    assert "concatenated_forward" not in vars(served) and not trl_preference.unserve(served, serving.find_row(served))
    assert type(served).concatenated_forward is cpo.CPOTrainer.concatenated_forward


def test_a_subclass_with_its_own_forward_is_left_to_trl(tmp_path):
    class CustomORPO(orpo.ORPOTrainer):
        def concatenated_forward(self, model, batch):
            return super().concatenated_forward(model, batch)

    args = orpo.ORPOConfig(**cpu_run(tmp_path, bf16=False, max_steps=1))
    with pytest.warns(UserWarning, match="overrides ORPOTrainer's concatenated_forward"):
        trainer = CustomORPO(
            model=preference_model("llama"),
            args=args,
            train_dataset=_dataset(),
            processing_class=make_tokenizer(),
            callbacks=[FusedLCECallback()],
        )
    assert "concatenated_forward" not in vars(trainer)


def test_unknown_trl_code_is_refused(tmp_path, monkeypatch):
    """TRL's own method doing something else than the one replicated (here: its log-probs) is refused."""

    def get_batch_logps(logits, labels, average_log_prob=False, is_encoder_decoder=False):
        return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1).sum(-1)

    monkeypatch.setattr(cpo.CPOTrainer, "get_batch_logps", staticmethod(get_batch_logps))
    with pytest.raises(TRLProtocolError, match="CPOTrainer of TRL .*get_batch_logps"):
        make_trainer("cpo", tmp_path, [FusedLCECallback()])


def test_trainers_left_on_trl_path_are_warned_about_once():
    def trainer_of(module, name):
        return type(name, (), {"__module__": module})()

    sdft = trainer_of("trl.experimental.sdft.sdft_trainer", "SDFTTrainer")
    gkd = trainer_of("trl.experimental.gkd.gkd_trainer", "GKDTrainer")
    unserved._warned.discard("SDFTTrainer")
    assert serving.find_row(sdft).serving == unserved.__name__
    with pytest.warns(UserWarning, match="SDFTTrainer computes its loss from the full"):
        assert serving.serve_trainer(sdft, {}) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert unserved.serve(sdft, serving.find_row(sdft), {}) is False  # already warned for this class: silent
        assert not unserved.serve(gkd, serving.find_row(gkd), {})
