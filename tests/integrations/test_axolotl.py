"""The axolotl plugin, through the real axolotl (its own environment: see axolotl_runs.py).

axolotl pins its own torch, transformers, TRL and PEFT, so it is installed in a virtual environment of
its own (``.ci/run`` builds one in ``.ci-deps/axolotl``; ``LCE_PATCH_AXOLOTL_PYTHON`` names another). The
runs happen once, in that environment; the tests here read what they measured.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from tests.integrations.axolotl_helpers import log_sections, run_in_axolotl

pytestmark = pytest.mark.slow  # the real axolotl, in its own environment: about two minutes

RUNS = Path(__file__).with_name("axolotl_runs.py")
TRAIN_STEPS, GRAD_ACCUM = 3, 2
PLUGIN_KEYS = (
    "lce_patch, lce_patch_chunk_size, lce_patch_backend, lce_patch_return_logits_in_eval, lce_patch_allow_unregistered"
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return run_in_axolotl(RUNS, tmp_path_factory, "axolotl")


@pytest.mark.parametrize(
    "name", ["llama_full", "llama_lora", "gemma2_full", "gemma2_lora", "llama_qlora", "llama_lora_on_head"]
)
def test_plugin_trains_like_axolotl_without_it(runs, name):
    run = runs[name]
    assert run["patched"]
    # every training micro-batch went through the fused op (axolotl's end-of-training evaluation adds more)
    assert run["train_op_calls"] >= TRAIN_STEPS * GRAD_ACCUM
    assert len(run["losses"]) == len(run["reference_losses"]) == TRAIN_STEPS
    assert run["losses"] == pytest.approx(run["reference_losses"], rel=1e-5)
    assert run["reference_losses"][0] != run["reference_losses"][-1]  # it trained
    assert run["same_parameter_names"]
    # float32 on the CPU; three AdamW steps of 1e-3 move weights by ~3e-3, so 1e-5 tells a wrong gradient apart
    assert run["max_weight_diff"] <= 1e-5 * max(run["max_weight"], 1.0)
    # evaluation with labels and without compute_metrics is loss-only: fused, and equal
    assert run["eval_op_calls"] > 0 and run["reference_eval_op_calls"] == 0
    assert run["eval_loss"] == pytest.approx(run["reference_eval_loss"], rel=1e-5)


def test_predict_returns_the_logits_of_the_unpatched_model(runs):
    run = runs["gemma2_full"]  # a softcapped head: the logits returned must be the softcapped ones
    assert run["logits_shape"][0] > 0 and run["logits_shape"][-1] > 1000
    assert run["max_logit_diff"] <= 1e-5


def test_no_eval_logits_keeps_a_fused_eval_loss_and_refuses_predict(runs):
    run = runs["gemma2_no_eval_logits"]
    assert run["eval_loss"] == pytest.approx(run["reference_eval_loss"], rel=1e-5)
    assert "return_logits_in_eval=False" in run["predict_error"]


def test_plugin_listed_but_switched_off_does_nothing(runs):
    run = runs["gemma2_switched_off"]
    assert not run["patched"] and run["train_op_calls"] == 0 and run["eval_op_calls"] == 0
    assert run["losses"] == run["reference_losses"] and run["max_weight_diff"] == 0.0


@pytest.mark.parametrize(
    "name", ["cut_cross_entropy", "liger_fused_linear_cross_entropy", "chunked_cross_entropy", "dora_on_head"]
)
def test_conflicting_configurations_are_refused_at_validation(runs, name):
    message = runs["refused"][name]
    assert message is not None, f"{name}: the config was accepted"
    assert "lce_patch: this configuration cannot train with the fused loss" in message
    key = "peft_use_dora" if name == "dora_on_head" else name
    assert f"`{key}`" in message


def test_plugin_is_registered_as_an_axolotl_entry_point():
    # axolotl >= 0.21 registers installed plugins from this group (they stay off until their key is on)
    try:
        distribution = importlib.metadata.distribution("lce-patch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("lce_patch is not installed (run from a checkout)")
    points = [point for point in distribution.entry_points if point.group == "axolotl.plugins"]
    assert [(point.name, point.value) for point in points] == [
        ("lce_patch", "lce_patch.integrations.axolotl:LCEPatchPlugin")
    ]


DEFAULTS = "chunk_size=auto, backend=auto, return_logits_in_eval=auto, allow_unregistered=False"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama_full/fused", f"LlamaForCausalLM (model_type llama) {{}}: {DEFAULTS}"),
        ("llama_lora/fused", f"LlamaForCausalLM (model_type llama, in PeftModelForCausalLM) {{}}: {DEFAULTS}"),
        ("gemma2_full/fused", f"Gemma2ForCausalLM (model_type gemma2) {{}}: {DEFAULTS}"),
        (
            "gemma2_no_eval_logits",
            "Gemma2ForCausalLM (model_type gemma2) {}: "
            "chunk_size=64, backend=torch, return_logits_in_eval=False, allow_unregistered=False",
        ),
    ],
)
def test_patched_model_is_logged_at_axolotl_default_level(runs, name, expected):
    # at axolotl's default levels (INFO for axolotl's loggers, WARNING for the rest), through axolotl's own handler
    sections = log_sections(runs["output"])
    lines = [line for line in sections[name] if "lce_patch: patched" in line]
    line = "lce_patch: patched " + expected.format("to train with the fused linear cross-entropy")
    assert len(lines) == 1, lines
    assert "[INFO] [axolotl.integrations.lce_patch] " + line in lines[0]


def test_no_patched_line_without_the_plugin_or_with_it_off(runs):
    sections = log_sections(runs["output"])
    quiet = [name for name in sections if name.endswith("/reference")] + ["gemma2_switched_off"]
    assert len(quiet) == 7
    for name in quiet:
        assert not [line for line in sections[name] if "lce_patch: patched" in line], name
    # every run with the plugin on logs its line once
    fused = [name for name in sections if name.endswith("/fused")] + ["gemma2_no_eval_logits"]
    assert len(fused) == 7
    for name in fused:
        assert sum("lce_patch: patched" in line for line in sections[name]) == 1, name


@pytest.mark.parametrize(
    ("name", "unknown"),
    [
        ("chunk_size", "key `lce_patch_chunksize` (did you mean `lce_patch_chunk_size`?)"),
        ("backend_plugin_off", "key `lce_patch_backnd` (did you mean `lce_patch_backend`?)"),
        (
            "two_keys",
            "keys `LCE-PATCH-RETURN-LOGITS` (did you mean `lce_patch_return_logits_in_eval`?), `lce_patch_xyzzy`",
        ),
    ],
)
def test_misspelt_keys_are_refused_at_validation(runs, name, unknown):
    message = runs["keys"]["misspelt"][name]
    assert message is not None, f"{name}: the config was accepted"
    assert f"lce_patch: unknown {unknown}; the plugin's keys are {PLUGIN_KEYS}" in message


def test_every_valid_key_is_accepted(runs):
    assert runs["keys"]["valid_keys_loaded"]


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("lce_patch_chunksize", "lce_patch_chunk_size"),
        ("lce_patch_chunk", "lce_patch_chunk_size"),
        ("lce_patch_backnd", "lce_patch_backend"),
        ("lce_patch_return_logits", "lce_patch_return_logits_in_eval"),
        ("lce_patch_eval", "lce_patch_return_logits_in_eval"),
        ("lce_patch_allow_unregisterd", "lce_patch_allow_unregistered"),
        ("LCE_PATCH_CHUNK_SIZE", "lce_patch_chunk_size"),
        ("lcepatch", "lce_patch"),
        ("lce_patch_xyzzy", None),
    ],
)
def test_misspelt_key_names_the_closest_valid_key(runs, key, suggestion):
    # LCEPatchArgs alone, in the axolotl environment
    message = runs["keys"]["typos"][key]
    hint = f" (did you mean `{suggestion}`?)" if suggestion else ""
    assert message == f"Value error, lce_patch: unknown key `{key}`{hint}; the plugin's keys are {PLUGIN_KEYS}"
