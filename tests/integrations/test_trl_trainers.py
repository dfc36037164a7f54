"""FusedLCECallback in TRL's preference and RL trainers: DPO, KTO, GRPO, RLOO (TRL >= 1.15).

Each trainer runs twice from the same tiny model saved to disk and loaded by path (so TRL builds its
reference model the way it does for real checkpoints): once with TRL's own fused LM head, once with
the callback. The callback must serve every fused-head call, on the policy and on the reference
model (``trainer.ref_model``, or the policy with its adapters disabled under PEFT), so that TRL's
chunked kernel never runs, and every logged metric must equal TRL's within float noise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")
trl_utils = pytest.importorskip("trl.trainer.utils")
if not hasattr(trl_utils, "add_fused_lm_head"):
    pytest.skip("TRL without add_fused_lm_head (< 1.15)", allow_module_level=True)
datasets = pytest.importorskip("datasets")

from tests.integrations.trl_helpers import (  # noqa: E402
    VOCAB,
    compared_run,
    lce_callback,
    lora_config,
    make_model,
    make_tokenizer,
    spies,
)

# Wall-clock keys differ run to run; everything else TRL logs must agree.
_TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
_STEPS = 2


def _words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def _peaked_model(kind: str) -> torch.nn.Module:
    """A tiny model whose head is a scaled copy of its embeddings: it predicts the current token again
    with some confidence, so repeated words are argmax hits (``mean_token_accuracy`` is not all zeros)."""
    model = make_model(kind)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.get_input_embeddings().weight * 4.0)
    return model


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    paths = {}
    for kind in ("llama", "gemma2"):
        path = tmp_path_factory.mktemp(kind)
        _peaked_model(kind).save_pretrained(path)
        make_tokenizer().save_pretrained(path)
        paths[kind] = str(path)
    return paths


def preference_dataset(n=16):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        prompt = torch.randint(4, VOCAB - 4, (3,), generator=g).tolist()
        rejected = torch.randint(4, VOCAB - 4, (4,), generator=g).tolist()
        rows.append({"prompt": _words(prompt), "chosen": _words([prompt[-1]] * 4), "rejected": _words(rejected)})
    return datasets.Dataset.from_list(rows)


def unpaired_dataset(n=16):
    rows = [
        {"prompt": row["prompt"], "completion": row[key], "label": key == "chosen"}
        for row in preference_dataset(n // 2)
        for key in ("chosen", "rejected")
    ]
    return datasets.Dataset.from_list(rows)


def prompt_dataset(n=16):
    g = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_list(
        [{"prompt": _words(torch.randint(4, VOCAB - 4, (4,), generator=g).tolist())} for _ in range(n)]
    )


def reward_w5(completions, **kwargs):
    return [completion.split().count("w5") + 0.1 * len(completion.split()) for completion in completions]


def make_trainer(name, path, callbacks=(), peft_config=None, **config):
    common = compared_run(config.pop("output_dir"), max_steps=_STEPS, per_device_train_batch_size=4)
    kwargs = dict(model=path, processing_class=make_tokenizer(), callbacks=list(callbacks), peft_config=peft_config)
    if peft_config is not None:
        torch.manual_seed(1)  # LoRA init
    if name == "dpo":
        args = trl.DPOConfig(**common, **config)
        return trl.DPOTrainer(args=args, train_dataset=preference_dataset(), **kwargs)
    if name == "kto":
        args = trl.KTOConfig(**common, **config)
        return trl.KTOTrainer(args=args, train_dataset=unpaired_dataset(), **kwargs)
    rl = dict(num_generations=2, max_completion_length=6, beta=0.04)  # beta > 0: a reference model
    if name == "grpo":
        args = trl.GRPOConfig(**common, **rl, **config)
        return trl.GRPOTrainer(args=args, reward_funcs=reward_w5, train_dataset=prompt_dataset(), **kwargs)
    if name == "rloo":
        args = trl.RLOOConfig(**common, **rl, **config)
        return trl.RLOOTrainer(args=args, reward_funcs=reward_w5, train_dataset=prompt_dataset(), **kwargs)
    raise ValueError(name)


def train(name, path, tmp_path, callbacks=(), **config):
    trainer = make_trainer(name, path, callbacks, output_dir=str(tmp_path), **config)
    with spies() as calls:
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == _STEPS
    return trainer, logs, calls


def assert_same_logs(theirs, ours, rtol=1e-4, atol=1e-5):
    for a, b in zip(theirs, ours, strict=True):
        assert a.keys() == b.keys()
        for key in a.keys() - set(_TIMING_KEYS):
            assert b[key] == pytest.approx(a[key], rel=rtol, abs=atol), (key, a[key], b[key])


CASES = {
    "dpo": ("dpo", "llama", {}),
    "dpo-gemma2-wpo": ("dpo", "gemma2", {"use_weighting": True}),  # softcap; WPO asks for log(sum p^2)
    "kto": ("kto", "llama", {}),
    "grpo": ("grpo", "llama", {}),
    "grpo-fp32-head-temperature": ("grpo", "gemma2", {"cast_lm_head_to_fp32": True, "temperature": 0.7}),
    "rloo": ("rloo", "llama", {}),
}


# LoRA on the plain case of each trainer: the reference is then the policy with its adapters disabled
PARAMS = [(case, False) for case in CASES] + [(name, True) for name in ("dpo", "kto", "grpo", "rloo")]


@pytest.mark.parametrize("case, peft", PARAMS, ids=[f"{case}-{'lora' if peft else 'full'}" for case, peft in PARAMS])
def test_trainer_metrics_match_trl_head(model_paths, tmp_path, case, peft):
    name, kind, config = CASES[case]
    peft_config = lora_config(task_type="CAUSAL_LM") if peft else None
    path = model_paths[kind]
    _, theirs, trl_calls = train(name, path, tmp_path / "trl", peft_config=peft_config, **config)
    assert trl_calls.theirs.call_count > 0 and trl_calls.ours.call_count == 0
    trainer, ours, our_calls = train(
        name, path, tmp_path / "ours", callbacks=[lce_callback()], peft_config=peft_config, **config
    )
    # every fused-head call, policy and reference, ran lce_patch's op; TRL's kernel never ran
    assert our_calls.theirs.call_count == 0
    assert our_calls.ours.call_count == trl_calls.theirs.call_count
    # the reference model (a separate model, or the policy with adapters disabled) took its share
    ref_model = getattr(trainer, "ref_model", None)
    assert (ref_model is None) == peft
    assert_same_logs(theirs, ours)
    if name == "dpo":  # is_top1 is exercised: some labels are argmax hits
        assert any(entry["mean_token_accuracy"] > 0 for entry in ours)


def test_reference_model_head_is_served(model_paths, tmp_path):
    """The reference model's forward is lce_patch's after training begins, and TRL's before."""
    from lce_patch.integrations.trl import find_trl_head
    from lce_patch.integrations.trl.head import is_head_served

    trainer = make_trainer("dpo", model_paths["llama"], [lce_callback()], output_dir=str(tmp_path))
    assert find_trl_head(trainer.ref_model) is not None and not is_head_served(trainer.ref_model)
    with spies():
        trainer.train()
    assert is_head_served(trainer.ref_model)
    assert is_head_served(trainer.model)


@pytest.mark.parametrize("name, column", [("dpo", "ref_chosen_logps"), ("kto", "ref_logps")])
def test_precomputed_reference_log_probs_are_served(model_paths, tmp_path, name, column):
    """``precompute_ref_log_probs=True``: TRL scores the reference model inside ``__init__``, before any
    training callback runs; that pass goes through lce_patch's op as well, with TRL's values, and the
    training that follows logs what TRL's does."""
    path = model_paths["llama"]
    with spies() as ours_init:
        ours = make_trainer(
            name, path, [lce_callback()], output_dir=str(tmp_path / "ours"), precompute_ref_log_probs=True
        )
    assert ours_init.ours.call_count > 0 and ours_init.theirs.call_count == 0
    with spies() as theirs_init:
        theirs = make_trainer(name, path, output_dir=str(tmp_path / "trl"), precompute_ref_log_probs=True)
    assert theirs_init.theirs.call_count > 0  # computed again, not read from a cache of the first trainer's
    np.testing.assert_allclose(ours.train_dataset[column], theirs.train_dataset[column], rtol=1e-5, atol=1e-5)
    with spies() as calls:
        ours.train()
    assert calls.theirs.call_count == 0
    theirs.train()
    logs = [[entry for entry in t.state.log_history if "loss" in entry] for t in (theirs, ours)]
    assert_same_logs(*logs)
