"""axolotl's KD trainer (``kd_trainer: true``) through the real axolotl, with and without the lce_patch plugin; run by
test_axolotl_kd.py: ``python axolotl_kd_runs.py WORKDIR OUT.json``.

Builds the tiny Llama and softcapped Gemma-2 of axolotl_runs.py and a top-K distillation dataset offline: the
recipes' chat data with, per token, K teacher candidate ids and their log-probabilities (random, normalized over the
K), in the layout of axolotl's ``axolotl.integrations.kd.chat_template`` strategy (``logprobs`` and
``target_token_ids`` per position). Each configuration trains through axolotl's config loading, preprocessing and
``axolotl.train.train`` (CPU, float32) without the plugin and with it, and the script writes per-step losses, the
largest weight difference, the evaluation loss, and counts: calls of lce_patch's two ops, calls of axolotl's Liger
KD function, and ``lm_head`` outputs with more than one position (none in a KD training step either way: axolotl
asks for one position's logits).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import axolotl_runs  # noqa: E402 (sets the offline environment first)

PLUGIN = axolotl_runs.PLUGIN
MARK = axolotl_runs.MARK
TOP_K = 4


def build_kd_dataset(workdir: Path, model_path: Path, rows: int = 48) -> Path:
    """The first ``rows`` conversations of the recipes' chat data with a random top-K teacher per position."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    generator = torch.Generator().manual_seed(0)
    lines = (axolotl_runs.REPO / "recipes/data/chat.jsonl").read_text().splitlines()[:rows]
    path = workdir / "kd.jsonl"
    with path.open("w") as out:
        for line in lines:
            messages = json.loads(line)["messages"][:4]
            length = len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
            positions = max(length - 2, 1)  # axolotl pads the missing first positions (masked)
            ids = torch.stack([torch.randperm(len(tokenizer), generator=generator)[:TOP_K] for _ in range(positions)])
            logits = 2.0 * torch.randn(positions, TOP_K, generator=generator)
            logprobs = torch.log_softmax(logits, dim=-1)
            row = {"messages": messages, "logprobs": logprobs.tolist(), "target_token_ids": ids.tolist()}
            out.write(json.dumps(row) + "\n")
    return path


def kd_config(model_path: Path, workdir: Path, name: str, dataset: Path, **kd) -> dict:
    config = axolotl_runs.base_config(model_path, workdir, name)
    config.update(
        datasets=[
            dict(
                path=str(dataset),
                type="axolotl.integrations.kd.chat_template",
                ds_type="json",
                field_messages="messages",
                logprobs_field="logprobs",
                temperature=1.0,  # the teacher's sampling temperature: axolotl rescales to kd_temperature
            )
        ],
        dataset_prepared_path=str(workdir / "prepared" / name),
        plugins=["axolotl.integrations.kd.KDPlugin"],
        kd_trainer=True,
        **kd,
    )
    return config


class Counters:
    """Calls of lce_patch's ops (as the KD module calls them), of axolotl's Liger KD function, and lm_head outputs
    with more than one position."""

    def __init__(self) -> None:
        from axolotl.integrations.kd.kernels import liger

        from lce_patch.integrations.axolotl import kd as axolotl_kd

        self.counts = {"sparse_op": 0, "ce_op": 0, "liger_kd": 0}
        for name, key in (("fused_linear_sparse_divergence", "sparse_op"), ("fused_linear_cross_entropy", "ce_op")):
            setattr(axolotl_kd, name, self._counting(getattr(axolotl_kd, name), key))
        function = liger.LigerFusedLinearKLTopKLogprobFunction
        original_apply = function.apply
        counters = self

        def apply(*args, **kwargs):
            counters.counts["liger_kd"] += 1
            return original_apply(*args, **kwargs)

        function.apply = apply

    def _counting(self, original, key):
        def counting(*args, **kwargs):
            self.counts[key] += 1
            return original(*args, **kwargs)

        return counting

    def snapshot(self) -> dict:
        return dict(self.counts)


def train_once(config: dict, counters: Counters, label: str) -> dict:
    from axolotl.cli.args import TrainerCliArgs
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train
    from axolotl.utils.dict import DictDefault

    from lce_patch.integrations.axolotl.kd import FusedKDLoss
    from lce_patch.models import unwrap_causal_lm

    print(MARK + label, flush=True)
    cfg = load_cfg(DictDefault(config))
    meta = load_datasets(cfg=cfg, cli_args=TrainerCliArgs())
    wide_outputs = []
    before = counters.snapshot()
    handles = []

    def pre_train(trainer):
        head = unwrap_causal_lm(trainer.model).get_output_embeddings()

        def hook(module, args, output):
            if module.training and output.dim() == 3 and output.shape[1] > 1:
                wide_outputs.append(list(output.shape))

        handles.append(head.register_forward_hook(hook))

    import axolotl.train as axolotl_train

    original_execute = axolotl_train.execute_training

    def execute_training(cfg, trainer, resume_from_checkpoint):
        pre_train(trainer)
        return original_execute(cfg, trainer, resume_from_checkpoint)

    axolotl_train.execute_training = execute_training
    try:
        model, _, trainer = train(cfg=cfg, dataset_meta=meta)
    finally:
        axolotl_train.execute_training = original_execute
        for handle in handles:
            handle.remove()
    after = counters.snapshot()
    batch = next(iter(trainer.get_train_dataloader()))
    result = {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
        "calls": {key: after[key] - before[key] for key in after},
        "served": isinstance(getattr(trainer, "_kd_loss_fn", None), FusedKDLoss),
        "wide_head_outputs": wide_outputs,
        "kept_slots": int(batch["target_mask"].sum()),
        "labelled": int((batch["labels"] != -100).sum()),
        "weights": {name: param.detach().clone() for name, param in model.named_parameters()},
    }
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    if result["served"]:
        result["protocol"] = protocol_checks(trainer)
    return result


def protocol_checks(trainer) -> dict:
    """Unserving restores axolotl's loss object, serving again replaces it, and a foreign one is refused."""
    import torch

    from lce_patch.integrations.axolotl.kd import FusedKDLoss
    from lce_patch.integrations.serving import serve_trainer, unserve_trainer

    out = {"unserved": unserve_trainer(trainer), "restored": type(trainer._kd_loss_fn).__name__}
    out["served_again"] = serve_trainer(trainer, {}) and isinstance(trainer._kd_loss_fn, FusedKDLoss)
    unserve_trainer(trainer)
    trainer._kd_loss_fn = torch.nn.Identity()
    try:
        serve_trainer(trainer, {})
        out["foreign_loss_error"] = None
    except Exception as err:
        out["foreign_loss_error"] = f"{type(err).__name__}: {err}"
    return out


def compare(reference: dict, run: dict) -> dict:
    out = axolotl_runs.compare(
        {**reference, "train_op_calls": 0, "patched": False, "eval_op_calls": 0},
        {**run, "train_op_calls": 0, "patched": False, "eval_op_calls": 0},
    )
    for key in ("train_op_calls", "patched", "eval_op_calls", "reference_eval_op_calls"):
        out.pop(key, None)
    out.update(
        grad_norms=run["grad_norms"],
        reference_grad_norms=reference["grad_norms"],
        calls=run["calls"],
        reference_calls=reference["calls"],
        served=run["served"],
        reference_served=reference["served"],
        wide_head_outputs=run["wide_head_outputs"],
        kept_slots=run["kept_slots"],
        labelled=run["labelled"],
        protocol=run.get("protocol"),
    )
    return out


# name -> (model, axolotl KD keys, other overrides)
RUNS = {
    # forward KL at T = 2 (axolotl's T**2 on the reported value), student as given, with the cross-entropy
    "llama_fkl_t2": ("llama", dict(kd_alpha=0.6, kd_ce_alpha=0.4, kd_temperature=2.0, kd_beta=0.0), {}),
    # generalized JSD, the student renormalized over the top-K
    "llama_jsd_topk": (
        "llama",
        dict(kd_alpha=0.7, kd_ce_alpha=0.3, kd_temperature=1.5, kd_beta=0.5, kd_normalize_topk=True),
        {},
    ),
    # reverse KL, no cross-entropy term, LoRA on the decoder
    "llama_rkl_lora": (
        "llama",
        dict(kd_alpha=1.0, kd_ce_alpha=0.0, kd_temperature=1.0, kd_beta=1.0),
        dict(
            adapter="lora",
            lora_r=8,
            lora_alpha=16,
            lora_dropout=0.0,
            lora_target_linear=True,
            lora_mlp_kernel=False,
            lora_qkv_kernel=False,
            lora_o_kernel=False,
        ),
    ),
    # a softcapped model: axolotl's KD loss leaves the softcap out, and so does lce_patch's
    "gemma2_fkl": ("gemma2", dict(kd_alpha=0.5, kd_ce_alpha=0.5, kd_temperature=1.0, kd_beta=0.0), {}),
}


def main() -> None:
    workdir, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    paths = axolotl_runs.build_models(workdir)
    dataset = build_kd_dataset(workdir, paths["llama"])
    counters = Counters()
    only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None
    results: dict = {"errors": {}}
    for name, (model, kd, overrides) in RUNS.items():
        if only and name not in only:
            continue
        try:
            config = {**kd_config(paths[model], workdir, name, dataset, **kd), **overrides}
            reference = train_once(config, counters, f"{name}/reference")
            fused = train_once({**config, "plugins": [*config["plugins"], PLUGIN]}, counters, label=f"{name}/fused")
            results[name] = compare(reference, fused)
        except Exception:
            results["errors"][name] = traceback.format_exc()
    out_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
