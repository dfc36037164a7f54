"""axolotl's preference modes (``rl: dpo | ipo | kto | orpo | simpo``) with the lce_patch plugin, through the real
axolotl in its own environment (see axolotl_rl_runs.py and test_axolotl.py).

axolotl 0.19 pins TRL 1.9, which has no fused-LM-head protocol: its DPO and KTO trainers score the sequences from
the full logits of a forward without labels, so ``rl: dpo``, ``ipo`` and ``kto`` train unfused, exactly as without
the plugin, and the plugin says so when axolotl validates the config. ``rl: orpo`` and ``rl: simpo`` train with TRL's
experimental ORPOTrainer and CPOTrainer, whose log-probabilities FusedLCECallback computes with the fused op: the
losses, the metrics and the weights are those of the run without the plugin.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version

from tests.integrations.axolotl_helpers import log_sections, run_in_axolotl

pytestmark = pytest.mark.slow  # the real axolotl, in its own environment: about two minutes

RUNS = Path(__file__).with_name("axolotl_rl_runs.py")
TRAIN_STEPS, GRAD_ACCUM = 2, 2
SERVED = {  # run -> the TRL class its axolotl trainer derives from
    "orpo": "trl.experimental.orpo.orpo_trainer.ORPOTrainer",
    "simpo": "trl.experimental.cpo.cpo_trainer.CPOTrainer",
    "orpo_lora": "trl.experimental.orpo.orpo_trainer.ORPOTrainer",
    "simpo_lora": "trl.experimental.cpo.cpo_trainer.CPOTrainer",
}
UNFUSED = {
    "dpo": "trl.trainer.dpo_trainer.DPOTrainer",
    "ipo": "trl.trainer.dpo_trainer.DPOTrainer",
    "kto": "trl.trainer.kto_trainer.KTOTrainer",
}
NO_CALLS = {"cross_entropy": 0, "log_probs": 0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    results = run_in_axolotl(RUNS, tmp_path_factory, "axolotl_rl")
    results["sections"] = log_sections(results["output"])
    return results


def _warnings(runs: dict, section: str) -> list[str]:
    return [line for line in runs["sections"][section] if "lce_patch: `rl:" in line]


@pytest.mark.parametrize("name", sorted(SERVED))
def test_orpo_and_simpo_train_through_the_fused_op_like_axolotl_without_it(runs, name):
    run = runs[name]
    assert SERVED[name] in run["trl_bases"], run["trl_bases"]
    assert run["patched"]
    # one call of the fused log-probabilities per training micro-batch (chosen and rejected rows together)
    assert run["op_calls"] == {"cross_entropy": 0, "log_probs": TRAIN_STEPS * GRAD_ACCUM}
    assert run["reference_op_calls"] == NO_CALLS
    assert len(run["losses"]) == len(run["reference_losses"]) == TRAIN_STEPS
    assert run["losses"] == pytest.approx(run["reference_losses"], rel=1e-5)
    assert run["reference_losses"][0] != run["reference_losses"][-1]  # it trained
    assert set(run["metrics"]) == set(run["reference_metrics"]) >= {"rewards/margins", "logits/chosen", "nll_loss"}
    for key, values in run["metrics"].items():
        assert values == pytest.approx(run["reference_metrics"][key], rel=1e-4, abs=1e-6), key
    # float32 on the CPU; two AdamW steps of 1e-3 move weights by ~2e-3, so 1e-5 tells a wrong gradient apart
    assert run["max_weight_diff"] <= 1e-5 * max(run["max_weight"], 1.0)
    assert not _warnings(runs, f"{name}/fused")


@pytest.mark.parametrize("name", sorted(UNFUSED))
def test_dpo_ipo_kto_on_trl_without_fused_heads_train_as_without_the_plugin_and_warn(runs, name):
    if Version(runs["trl_version"]) >= Version("1.15"):
        pytest.fail(
            f"axolotl's environment has TRL {runs['trl_version']}, whose DPO and KTO trainers lce_patch fuses: check "
            "that these modes now train through the op and update this test"
        )
    run = runs[name]
    assert UNFUSED[name] in run["trl_bases"], run["trl_bases"]
    # TRL < 1.15's trainers read the model's full logits: the patch is taken off before their first loss
    assert not run["patched"] and run["op_calls"] == run["reference_op_calls"] == NO_CALLS
    assert len(run["losses"]) == TRAIN_STEPS and run["reference_losses"][0] != run["reference_losses"][-1]
    assert run["losses"] == run["reference_losses"] and run["metrics"] == run["reference_metrics"]
    assert run["max_weight_diff"] == 0.0
    lines = _warnings(runs, f"{name}/fused")
    assert len(lines) == 1, lines
    assert "[WARNING] [axolotl.integrations.lce_patch] " in lines[0]
    assert (
        f"lce_patch: `rl: {name}` trains with TRL {runs['trl_version']}, and its trainer scores the sequences from "
        "the full [tokens x vocabulary] logits of a forward without labels, which lce_patch fuses through TRL's "
        "fused-LM-head protocol (TRL >= 1.15); `rl: orpo` and `rl: simpo` do train fused with this TRL. The model's "
        "patch is taken off for this training, which runs unfused, with the losses of a run without the plugin."
    ) in lines[0]


def test_runs_without_the_plugin_log_nothing_of_it(runs):
    references = [name for name in runs["sections"] if name.endswith("/reference")]
    assert len(references) == len(SERVED) + len(UNFUSED)
    for name in references:
        assert not [line for line in runs["sections"][name] if "lce_patch:" in line], name
