"""axolotl's preference modes (``rl:``), with and without the lce_patch plugin; run by test_axolotl_rl.py.

Runs in axolotl's own environment, as axolotl_runs.py does: ``python axolotl_rl_runs.py WORKDIR OUT.json``.
Builds the tiny Llama of axolotl_runs.py and preference data from the shipped conversations in the formats
axolotl's loaders take (``chat_template.default`` pairs for DPO, IPO and SimPO, ``chat_template.argilla``
conversations for ORPO, ``user_defined`` rows for KTO), trains each mode for a few steps through axolotl's
config loading, preprocessing and ``axolotl.train.train``, and writes what the tests compare: the logged losses
and metrics, the largest weight difference against the run without the plugin, the trainer class (and the TRL
classes it derives from), the calls of lce_patch's ops, and the warnings the plugin logs (each run's stdout
follows a ``MARK`` line, as in axolotl_runs.py).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import axolotl_runs  # noqa: E402 (this file's folder is on sys.path when it is run as a script)
from axolotl_runs import MARK, PLUGIN, base_config, build_models

# mode -> (the dataset file, its axolotl `type`, extra config)
MODES = {
    "dpo": ("pairs.jsonl", "chat_template.default", dict(rl="dpo")),
    "ipo": ("pairs.jsonl", "chat_template.default", dict(rl="ipo")),
    "kto": (
        "kto.jsonl",
        {"field_prompt": "prompt", "field_completion": "completion", "field_label": "label"},
        dict(rl="kto", remove_unused_columns=False),
    ),
    "orpo": ("argilla.jsonl", "chat_template.argilla", dict(rl="orpo", orpo_alpha=0.1)),
    "simpo": ("pairs.jsonl", "chat_template.default", dict(rl="simpo", cpo_alpha=0.5, simpo_gamma=0.5)),
}
# run name -> (mode, more config): each mode, and the served ones with a LoRA adapter too. The LoRA runs come
# after full fine-tuning ones: the first training of a process draws from the random number generator on the way
# (one-time setup), and a LoRA run there would initialize its adapters unlike the run it is compared with.
LORA = dict(
    adapter="lora",
    lora_r=8,
    lora_alpha=16,
    lora_dropout=0.0,
    lora_target_linear=True,
    lora_mlp_kernel=False,  # axolotl's fused LoRA kernels are CUDA-only
    lora_qkv_kernel=False,
    lora_o_kernel=False,
)
RUNS = {**{mode: (mode, {}) for mode in MODES}, "orpo_lora": ("orpo", LORA), "simpo_lora": ("simpo", LORA)}
# the metrics (beside the loss) that each run logs and the tests compare
METRICS = ("rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen", "nll_loss")


def write_data(workdir: Path) -> None:
    """Preference data from the shipped conversations: the first question, its answer (chosen) and the next
    conversation's first answer (rejected)."""
    rows = [json.loads(line) for line in (axolotl_runs.REPO / "recipes/data/chat.jsonl").read_text().splitlines()]
    firsts = [row["messages"][:2] for row in rows[:48]]
    pairs, argilla, kto = [], [], []
    for index, (question, answer) in enumerate(firsts):
        wrong = firsts[(index + 1) % len(firsts)][1]
        pairs.append(dict(messages=[question], chosen=answer, rejected=wrong))
        argilla.append(dict(chosen=[question, answer], rejected=[question, wrong]))
        kto.append(dict(prompt=question["content"], completion=answer["content"], label=True))
        kto.append(dict(prompt=question["content"], completion=wrong["content"], label=False))
    for name, data in (("pairs.jsonl", pairs), ("argilla.jsonl", argilla), ("kto.jsonl", kto)):
        (workdir / name).write_text("".join(json.dumps(row) + "\n" for row in data))


class OpCounter:
    """Calls of lce_patch's fused cross-entropy through the patched forward and of its fused log-probabilities."""

    def __init__(self) -> None:
        import lce_patch.ops
        from lce_patch.models import forward as forward_module

        self.calls = {"cross_entropy": 0, "log_probs": 0}
        for owner, attr, key in (
            (forward_module, "fused_linear_cross_entropy", "cross_entropy"),
            (lce_patch.ops, "fused_linear_log_probs", "log_probs"),
        ):
            setattr(owner, attr, self._counting(getattr(owner, attr), key))

    def _counting(self, original, key):
        def counting(*args, **kwargs):
            self.calls[key] += 1
            return original(*args, **kwargs)

        return counting


def config_for(model_path: Path, workdir: Path, mode: str, name: str) -> dict:
    data, ds_type, extra = MODES[mode]
    config = base_config(model_path, workdir, name)
    dataset = dict(path=str(workdir / data), ds_type="json", split="train", type=ds_type)
    config.update(
        datasets=[dataset],
        val_set_size=0.0,
        max_steps=2,
        dataset_prepared_path=str(workdir / "prepared" / mode),
        **extra,
    )
    return config


def train_once(config: dict, counter: OpCounter, label: str) -> dict:
    from axolotl.cli.args import TrainerCliArgs
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_preference_datasets
    from axolotl.train import train
    from axolotl.utils.dict import DictDefault

    from lce_patch.models import is_patched, unwrap_causal_lm

    print(MARK + label, flush=True)
    cfg = load_cfg(DictDefault(config))
    meta = load_preference_datasets(cfg=cfg, cli_args=TrainerCliArgs())
    before = dict(counter.calls)
    model, _, trainer = train(cfg=cfg, dataset_meta=meta)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "losses": [entry["loss"] for entry in logged],
        "metrics": {key: [entry.get(key) for entry in logged] for key in METRICS if any(key in e for e in logged)},
        "op_calls": {key: counter.calls[key] - before[key] for key in counter.calls},
        "patched": is_patched(unwrap_causal_lm(model)),
        "trainer": type(trainer).__name__,
        "trl_bases": sorted(
            {f"{cls.__module__}.{cls.__name__}" for cls in type(trainer).__mro__ if cls.__module__.startswith("trl.")}
        ),
        "weights": {name: param.detach().clone() for name, param in model.named_parameters()},
    }


def compare(reference: dict, run: dict) -> dict:
    weight_diff = max(
        float((run["weights"][name].double() - reference["weights"][name].double()).abs().max())
        for name in reference["weights"]
    )
    out = {key: value for key, value in run.items() if key != "weights"}
    out.update(
        reference_losses=reference["losses"],
        reference_metrics=reference["metrics"],
        reference_op_calls=reference["op_calls"],
        max_weight_diff=weight_diff,
        max_weight=max(float(p.abs().max()) for p in reference["weights"].values() if p.is_floating_point()),
    )
    return out


def main() -> None:
    import trl

    workdir, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    paths = build_models(workdir)
    write_data(workdir)
    counter = OpCounter()
    results: dict = {"errors": {}, "trl_version": trl.__version__}
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(RUNS)
    for name in names:
        mode, overrides = RUNS[name]
        try:
            config = {**config_for(paths["llama"], workdir, mode, name), **overrides}
            reference = train_once(config, counter, label=f"{name}/reference")
            fused = train_once({**config, "plugins": [PLUGIN]}, counter, label=f"{name}/fused")
            results[name] = compare(reference, fused)
        except Exception:
            results["errors"][name] = traceback.format_exc()
    out_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
