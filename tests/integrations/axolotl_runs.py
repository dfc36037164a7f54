"""Training runs through the real axolotl, with and without the lce_patch plugin; run by test_axolotl.py.

Runs in a Python environment that has axolotl (it pins its own torch, transformers, TRL and PEFT, so it
lives apart from the test environment): ``python axolotl_runs.py WORKDIR OUT.json``. Builds a tiny Llama
and a tiny softcapped Gemma-2 on disk with the recipes' embedded tokenizer, trains each through axolotl's
own config loading, preprocessing and ``axolotl.train.train`` (CPU, float32), and writes what the tests
compare: per-step losses, the largest weight difference against the run without the plugin, evaluation
losses and logits, the fused op's call count, and the messages of the configurations the plugin refuses
(conflicting losses, misspelt ``lce_patch*`` keys). Before each run it prints ``MARK`` and the run's name to
stdout, where axolotl's console logging goes, so the test can find each run's log lines in the output.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "AXOLOTL_DO_NOT_TRACK"):
    os.environ.setdefault(name, "1")

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "lce_patch.integrations.axolotl.LCEPatchPlugin"
MARK = "@@ axolotl run: "


def build_models(workdir: Path) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

    sys.path.insert(0, str(REPO / "recipes"))
    from _loading import build_embedded_tokenizer

    tokenizer = build_embedded_tokenizer()
    common = dict(
        vocab_size=len(tokenizer) + 8,  # padded past the tokenizer, as real vocabularies are
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    configs = {
        "llama": LlamaConfig(tie_word_embeddings=False, **common),
        # tied head, softcap far from 1 so that a fused loss without it would differ
        "gemma2": Gemma2Config(head_dim=8, final_logit_softcapping=2.0, sliding_window=16, **common),
    }
    paths = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        paths[name] = workdir / name
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def base_config(model_path: Path, workdir: Path, name: str) -> dict:
    return dict(
        base_model=str(model_path),
        datasets=[
            dict(
                path=str(REPO / "recipes/data/chat.jsonl"),
                type="chat_template",
                ds_type="json",
                field_messages="messages",
            )
        ],
        chat_template="tokenizer_default",
        sequence_len=128,
        micro_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        num_epochs=1,
        learning_rate=1e-3,
        optimizer="adamw_torch",
        lr_scheduler="constant",
        val_set_size=0.05,
        eval_strategy="no",
        seed=0,
        bf16=False,
        fp16=False,
        tf32=False,
        save_strategy="no",
        logging_steps=1,
        dataset_num_proc=1,
        dataset_prepared_path=str(workdir / "prepared"),
        output_dir=str(workdir / "out" / name),
    )


class OpCounter:
    """Counts calls of the fused op through the patched forward (proof that the fused path ran)."""

    def __init__(self) -> None:
        from lce_patch.models import forward as forward_module

        self.module = forward_module
        self.original = forward_module.fused_linear_cross_entropy
        self.calls = 0

        def counting(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        forward_module.fused_linear_cross_entropy = counting


def train_once(config: dict, counter: OpCounter, predict: bool, label: str) -> dict:
    import torch
    from axolotl.cli.args import TrainerCliArgs
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train
    from axolotl.utils.dict import DictDefault

    from lce_patch.models import is_patched, unwrap_causal_lm

    print(MARK + label, flush=True)
    cfg = load_cfg(DictDefault(config))
    meta = load_datasets(cfg=cfg, cli_args=TrainerCliArgs())
    before = counter.calls
    model, _, trainer = train(cfg=cfg, dataset_meta=meta)
    result = {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "train_op_calls": counter.calls - before,
        "patched": is_patched(unwrap_causal_lm(model)),
        "weights": {name: param.detach().clone() for name, param in model.named_parameters()},
    }
    before = counter.calls
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    result["eval_op_calls"] = counter.calls - before
    if predict:
        try:
            result["logits"] = torch.as_tensor(trainer.predict(trainer.eval_dataset).predictions)
        except Exception as err:  # the refusal with return_logits_in_eval=False is a result too
            result["predict_error"] = f"{type(err).__name__}: {err}"
    return result


def compare(reference: dict, run: dict) -> dict:
    weight_diff = max(
        float((run["weights"][name].double() - reference["weights"][name].double()).abs().max())
        for name in reference["weights"]
    )
    update = max(float(param.abs().max()) for param in reference["weights"].values() if param.is_floating_point())
    out = {key: run[key] for key in ("losses", "train_op_calls", "patched", "eval_loss", "eval_op_calls")}
    out.update(
        reference_losses=reference["losses"],
        reference_eval_loss=reference["eval_loss"],
        reference_eval_op_calls=reference["eval_op_calls"],
        max_weight_diff=weight_diff,
        max_weight=update,
        same_parameter_names=sorted(run["weights"]) == sorted(reference["weights"]),
    )
    if "logits" in run and "logits" in reference:
        out["max_logit_diff"] = float((run["logits"] - reference["logits"]).abs().max())
        out["logits_shape"] = list(run["logits"].shape)
    if "predict_error" in run:
        out["predict_error"] = run["predict_error"]
    return out


REFUSED = {
    "cut_cross_entropy": dict(cut_cross_entropy=True),
    "liger_fused_linear_cross_entropy": dict(
        plugins=["axolotl.integrations.liger.LigerPlugin", PLUGIN], liger_fused_linear_cross_entropy=True
    ),
    "chunked_cross_entropy": dict(chunked_cross_entropy=True),
    "dora_on_head": dict(
        adapter="lora", lora_r=4, lora_alpha=8, peft_use_dora=True, lora_target_modules=["q_proj", "lm_head"]
    ),
}


# misspelt keys, refused by axolotl's config validation whether the plugin is on or off
MISSPELT = {
    "chunk_size": dict(lce_patch_chunksize=4096),
    "backend_plugin_off": dict(lce_patch=False, lce_patch_backnd="torch"),
    "two_keys": dict(lce_patch_chunk_size=4096, **{"LCE-PATCH-RETURN-LOGITS": True, "lce_patch_xyzzy": 1}),
}
# the same check, at the level of the args model (no axolotl config around it)
TYPOS = [
    "lce_patch_chunksize",
    "lce_patch_chunk",
    "lce_patch_backnd",
    "lce_patch_return_logits",
    "lce_patch_eval",
    "lce_patch_allow_unregisterd",
    "LCE_PATCH_CHUNK_SIZE",
    "lcepatch",
    "lce_patch_xyzzy",
]


def refusals(model_path: Path, workdir: Path, cases: dict) -> dict:
    from axolotl.cli.config import load_cfg
    from axolotl.utils.dict import DictDefault

    messages = {}
    for name, overrides in cases.items():
        config = {**base_config(model_path, workdir, "refused"), "plugins": [PLUGIN], **overrides}
        try:
            load_cfg(DictDefault(config))
            messages[name] = None
        except Exception as err:
            messages[name] = f"{type(err).__name__}: {err}"
    return messages


def key_checks(model_path: Path, workdir: Path) -> dict:
    """The misspelt-key refusals through axolotl's load_cfg and through LCEPatchArgs, and every valid key accepted."""
    from axolotl.cli.config import load_cfg
    from axolotl.utils.dict import DictDefault
    from pydantic import ValidationError

    from lce_patch.integrations.axolotl import LCEPatchArgs

    typos = {}
    for key in TYPOS:
        try:
            LCEPatchArgs.model_validate({key: 1})
            typos[key] = None
        except ValidationError as err:
            typos[key] = err.errors()[0]["msg"]
    valid = dict(
        lce_patch=True,
        lce_patch_chunk_size=64,
        lce_patch_backend="torch",
        lce_patch_return_logits_in_eval=True,
        lce_patch_allow_unregistered=False,
    )
    cfg = load_cfg(DictDefault({**base_config(model_path, workdir, "valid_keys"), "plugins": [PLUGIN], **valid}))
    return {
        "misspelt": refusals(model_path, workdir, MISSPELT),
        "typos": typos,
        "valid_keys_loaded": {key: cfg.get(key) for key in valid} == valid,
    }


def plain_4bit_on_cpu() -> None:
    """On a CPU with AVX512-BF16, bitsandbytes 0.50's Linear4bit repacks its weight for inference (eval mode, no
    grad) in blocks wider than these tiny models' hidden size (32 < 64) and fails, "shape '[32, 0]' is invalid",
    with or without the plugin. Keep the plain 4-bit path, which CPUs without AVX512-BF16 take."""
    import bitsandbytes.nn.modules

    bitsandbytes.nn.modules.has_avx512bf16 = lambda: False  # read by each Linear4bit as it is built


def main() -> None:
    workdir, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    plain_4bit_on_cpu()
    paths = build_models(workdir)
    counter = OpCounter()
    # axolotl's fused LoRA kernels are CUDA-only: off on the CPU
    kernels_off = dict(lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False)
    lora = dict(adapter="lora", lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_linear=True, **kernels_off)
    runs = {
        "llama_full": (paths["llama"], {}, {}),
        "llama_lora": (paths["llama"], dict(lora, lora_modules_to_save=["lm_head"]), {}),
        "gemma2_full": (paths["gemma2"], {}, {}),
        "gemma2_lora": (paths["gemma2"], lora, {}),
        "llama_qlora": (paths["llama"], dict(lora, adapter="qlora", load_in_4bit=True), {}),
        "llama_lora_on_head": (
            paths["llama"],
            dict(lora, lora_target_linear=False, lora_target_modules=["q_proj", "v_proj", "lm_head"]),
            {},
        ),
    }
    results: dict = {"errors": {}}
    for name, (model_path, overrides, _) in runs.items():
        try:
            config = {**base_config(model_path, workdir, name), **overrides}
            reference = train_once(config, counter, predict=name == "gemma2_full", label=f"{name}/reference")
            fused = train_once(
                {**config, "plugins": [PLUGIN]}, counter, predict=name == "gemma2_full", label=f"{name}/fused"
            )
            results[name] = compare(reference, fused)
            if name == "gemma2_full":
                options = dict(
                    lce_patch_return_logits_in_eval=False, lce_patch_chunk_size=64, lce_patch_backend="torch"
                )
                no_logits = train_once(
                    {**config, "plugins": [PLUGIN], **options}, counter, predict=True, label="gemma2_no_eval_logits"
                )
                results["gemma2_no_eval_logits"] = compare(reference, no_logits)
                switched_off = train_once(
                    {**config, "plugins": [PLUGIN], "lce_patch": False},
                    counter,
                    predict=False,
                    label="gemma2_switched_off",
                )
                results["gemma2_switched_off"] = compare(reference, switched_off)
        except Exception:
            results["errors"][name] = traceback.format_exc()
    try:
        print(MARK + "validation", flush=True)
        results["refused"] = refusals(paths["llama"], workdir, REFUSED)
    except Exception:
        results["errors"]["refused"] = traceback.format_exc()
    try:
        results["keys"] = key_checks(paths["llama"], workdir)
    except Exception:
        results["errors"]["keys"] = traceback.format_exc()
    out_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
