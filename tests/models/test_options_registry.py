"""The options registry: each option of ``apply_fused_lce`` / ``FusedLCECallback`` written once (``LCEOptions``), and
what is derived from it (the options TRL's trainers get, the self-check's neutral options, the docs' tables); the
deprecated ``deterministic``."""

from __future__ import annotations

import dataclasses
import inspect
import runpy
import types
import warnings
from pathlib import Path

import pytest
import torch

import lce_patch
from lce_patch.integrations.shared import divergence_options, log_prob_options
from lce_patch.models import OPTION_DEFAULTS, OPTIONS, LCEOptions, is_patched, option_names
from lce_patch.ops.linear_cross_entropy import LOSS_KEYWORDS, CrossEntropyOptions, ExtraOutputs

from .tiny import tiny_model

REPO = Path(__file__).resolve().parents[2]


def _docs_hook() -> types.SimpleNamespace:
    return types.SimpleNamespace(**runpy.run_path(str(REPO / "docs" / "hooks" / "options_table.py")))


def test_every_option_is_one_registry_entry():
    assert list(OPTIONS) == [field.name for field in dataclasses.fields(LCEOptions)]
    for name, option in OPTIONS.items():
        assert option.doc and "\n" not in option.doc and option.doc.endswith("."), name
        assert not (option.changes_loss and option.adds_output), name
    assert LCEOptions() == LCEOptions(**OPTION_DEFAULTS)
    assert set(option_names(op=True)) <= {
        field.name for field in dataclasses.fields(lce_patch.ops.linear_cross_entropy.CrossEntropyOptions)
    }


def test_the_docs_tables_are_the_registry():
    hook = _docs_hook()
    entries = hook.read_registry()
    assert [entry.name for entry in entries] == list(OPTIONS)
    for entry in entries:
        assert entry.doc == OPTIONS[entry.name].doc
        assert entry.default == repr(OPTION_DEFAULTS[entry.name])
        assert f"`{entry.name}`" in hook.options_table(entries)
    keys = hook.axolotl_keys(entries)
    assert all((f"`lce_patch_{name}`" in keys) == OPTIONS[name].axolotl for name in OPTIONS)


def test_options_reach_trl_trainers_as_the_registry_says():
    given = {"chunk_size": 8, "backend": "torch", "skip_ignored": False, "fp32_weight_grad": True}
    assert log_prob_options({**OPTION_DEFAULTS, **given}) == {
        name: given[name] for name in option_names(log_probs=True)
    }
    assert divergence_options(given) == {name: given[name] for name in option_names(divergence=True)}
    assert set(log_prob_options(OPTION_DEFAULTS)) <= set(option_names(log_probs=True))


@pytest.mark.parametrize("name", option_names(changes_loss=True) + option_names(adds_output=True))
def test_an_option_that_changes_the_loss_is_refused_under_trl(name):
    value = {"ignore_index": 3, "label_smoothing": 0.1, "z_loss": 1e-4}.get(name, True)
    if name == "class_weights":
        value = torch.ones(4)
    with pytest.raises(ValueError, match=f"option {name}"):
        log_prob_options({name: value})


def test_deterministic_is_deprecated_and_does_nothing():
    model = tiny_model("llama")
    with pytest.warns(FutureWarning, match="deterministic does nothing"):
        lce_patch.apply_fused_lce(model, deterministic=True)
    assert is_patched(model)
    hidden, weight = torch.randn(6, 8), torch.randn(11, 8)
    labels = torch.randint(0, 11, (6,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = lce_patch.fused_linear_cross_entropy(hidden, weight, labels)
    with pytest.warns(FutureWarning, match="deterministic does nothing"):
        got = lce_patch.fused_linear_cross_entropy(hidden, weight, labels, deterministic=True)
    assert torch.equal(got, expected)
    with pytest.warns(FutureWarning, match="deterministic does nothing"):
        lce_patch.FusedLinearCrossEntropy(deterministic=False)


def test_the_op_takes_every_option_the_forward_hands_it():
    parameters = inspect.signature(lce_patch.fused_linear_cross_entropy).parameters
    names = option_names(op=True) + option_names(adds_output=True)
    assert set(names) <= set(LOSS_KEYWORDS) <= set(parameters) and "options" in parameters
    options = LCEOptions(return_lse=True, z_loss=0.5).op_options(ignore_index=3, shift=True)
    assert isinstance(options, CrossEntropyOptions)
    assert options.ignore_index == 3 and options.shift and options.z_loss == 0.5
    assert options.want == ExtraOutputs(lse=True) and options.skip_ignored
