"""axolotl end to end: LoRA / QLoRA training of a Llama-3.2-1B-shaped model with and without lce_patch's plugin,
and with axolotl's Liger plugin (fused linear cross-entropy), each setup in a process of its own.

Builds the model from its config (random weights, no download) with the recipes' embedded tokenizer,
writes a chat dataset of long conversations (the shipped chats joined, about ``--seq-len`` tokens each,
loss on the assistant turns only), and trains through axolotl's config loading, preprocessing and
``axolotl.train.train`` (bf16, sdpa attention, gradient checkpointing). Reports per setup: the per-step
losses, the median step time after ``--warmup`` steps, tokens/s (every token of the micro-batches) and the
peak allocated GPU memory.

    python3 benchmarks/axolotl_bench.py [--adapter lora|qlora] [--seq-len 4096] [--batch 2] [--steps 12]
    python3 benchmarks/axolotl_bench.py --tiny     # a tiny model on the CPU (smoke test of the script)

Needs axolotl (0.19.0 measured). JSON to --out (default $OUT/axolotl_bench.json or runs/axolotl_bench.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUPS = ("axolotl", "axolotl+lce_patch", "axolotl+liger_flce")
PLUGIN = "lce_patch.integrations.axolotl.LCEPatchPlugin"
TIMING_PLUGIN = "axolotl_bench.TimingPlugin"


def build_inputs(workdir: Path, tiny: bool, seq_len: int) -> Path:
    """The model and tokenizer on disk, and a JSONL of conversations of about ``seq_len`` tokens."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(REPO / "recipes"))
    from _loading import build_embedded_tokenizer

    tokenizer = build_embedded_tokenizer()
    shape = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        if tiny
        else dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
        )
    )
    config = LlamaConfig(
        vocab_size=512 * 3 if tiny else 128256,
        max_position_embeddings=max(8192, seq_len),
        tie_word_embeddings=True,
        rope_theta=500000.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **shape,
    )
    torch.manual_seed(0)
    model_dir = workdir / "model"
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    chats = [json.loads(line)["messages"] for line in (REPO / "recipes/data/chat.jsonl").read_text().splitlines()]
    lengths = [len(tokenizer(tokenizer.apply_chat_template(chat, tokenize=False)).input_ids) for chat in chats]
    rows, messages, tokens = [], [], 0
    budget = int(seq_len * 0.9)  # below sequence_len: axolotl drops longer rows
    for index in range(64 * (budget // min(lengths) + 1)):
        chat, length = chats[index % len(chats)], lengths[index % len(chats)]
        if tokens + length > budget:
            rows.append({"messages": messages})
            messages, tokens = [], 0
            if len(rows) == 64:
                break
        messages, tokens = messages + chat, tokens + length
    data = workdir / "long_chats.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows))
    return model_dir


def config_for(setup: str, args: argparse.Namespace, workdir: Path, model_dir: Path) -> dict:
    config = dict(
        base_model=str(model_dir),
        datasets=[
            dict(
                path=str(workdir / "long_chats.jsonl"), type="chat_template", ds_type="json", field_messages="messages"
            )
        ],
        chat_template="tokenizer_default",
        sequence_len=args.seq_len,
        micro_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        num_epochs=100,
        learning_rate=2e-4,
        optimizer="adamw_torch",
        lr_scheduler="constant",
        val_set_size=0,
        seed=0,
        bf16=not args.tiny,
        fp16=False,
        tf32=False,
        sdp_attention=not args.tiny,
        gradient_checkpointing=not args.tiny,
        save_strategy="no",
        logging_steps=1,
        dataset_num_proc=1,
        dataset_prepared_path=str(workdir / f"prepared_{setup}"),
        output_dir=str(workdir / "out" / setup),
        adapter=args.adapter,
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        lora_target_linear=True,
        plugins=[TIMING_PLUGIN],
    )
    if args.adapter == "qlora":
        config["load_in_4bit"] = True
    if args.tiny:  # axolotl's fused LoRA kernels are CUDA-only
        config.update(lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False)
    if setup == "axolotl+lce_patch":
        config["plugins"] = [TIMING_PLUGIN, PLUGIN]
    elif setup == "axolotl+liger_flce":
        config["plugins"] = [TIMING_PLUGIN, "axolotl.integrations.liger.LigerPlugin"]
        config["liger_fused_linear_cross_entropy"] = True
    return config


def _timing_plugin_class():
    from axolotl.integrations.base import BasePlugin
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.peaks: list[int] = []  # bytes allocated at most during each step
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
                self.peaks.append(torch.cuda.max_memory_allocated())
            self.times.append(time.perf_counter() - self.start)

    class TimingPlugin(BasePlugin):
        callback = StepTimes()

        def add_callbacks_pre_trainer(self, cfg, model):
            return [TimingPlugin.callback]

    return TimingPlugin


_TIMING_PLUGIN = None


def __getattr__(name: str):
    global _TIMING_PLUGIN
    if name == "TimingPlugin":  # axolotl imports it by name; built lazily so that --help needs no axolotl
        if _TIMING_PLUGIN is None:
            _TIMING_PLUGIN = _timing_plugin_class()
        return _TIMING_PLUGIN
    raise AttributeError(name)


def run_setup(setup: str, args: argparse.Namespace, workdir: Path) -> dict:
    """One setup, in this process (the parent starts one process per setup)."""
    from axolotl.cli.args import TrainerCliArgs
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train
    from axolotl.utils.dict import DictDefault

    module = sys.modules[__name__]
    sys.modules.setdefault("axolotl_bench", module)  # the name axolotl imports the timing plugin by
    plugin_class = module.TimingPlugin

    cfg = load_cfg(DictDefault(config_for(setup, args, workdir, workdir / "model")))
    meta = load_datasets(cfg=cfg, cli_args=TrainerCliArgs())
    mean_tokens = args.batch * statistics.mean(len(ids) for ids in meta.train_dataset["input_ids"])
    _, _, trainer = train(cfg=cfg, dataset_meta=meta)
    times = plugin_class.callback.times[args.warmup :]
    median = statistics.median(times) if times else float("nan")
    return dict(
        setup=setup,
        losses=[entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        step_times_s=plugin_class.callback.times,
        median_step_s=median,
        tokens_per_step=mean_tokens,
        tokens_per_s=mean_tokens / median if times else None,
        # the largest of the steps' own peaks (each reset at its step's start)
        peak_allocated_gib=max(plugin_class.callback.peaks) / 2**30 if plugin_class.callback.peaks else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", choices=["lora", "qlora"], default="lora")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size (sequences)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--tiny", action="store_true", help="a tiny model, float32, on the CPU")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--one-setup", default=None, help=argparse.SUPPRESS)  # the child process
    default_out = os.path.join(os.environ.get("OUT", str(REPO / "runs")), "axolotl_bench.json")
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "AXOLOTL_DO_NOT_TRACK"):
        os.environ.setdefault(name, "1")
    if args.tiny:
        args.seq_len, args.steps, args.warmup = min(args.seq_len, 256), min(args.steps, 3), min(args.warmup, 1)

    if args.one_setup:
        workdir = Path(args.workdir)
        (workdir / f"{args.one_setup}.json").write_text(json.dumps(run_setup(args.one_setup, args, workdir)))
        return

    import tempfile

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="axolotl_bench_"))
    build_inputs(workdir, args.tiny, args.seq_len)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    results = []
    for setup in args.setups.split(","):
        command = [sys.executable, __file__, "--one-setup", setup, "--workdir", str(workdir)]
        command += ["--adapter", args.adapter, "--seq-len", str(args.seq_len), "--batch", str(args.batch)]
        command += ["--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--tiny"] if args.tiny else [])
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            results.append(dict(setup=setup, error=(proc.stdout + proc.stderr)[-4000:]))
            print(f"{setup}: failed\n{results[-1]['error']}", flush=True)
            continue
        results.append(json.loads((workdir / f"{setup}.json").read_text()))
        row = results[-1]
        print(
            f"{setup:22s} median step {row['median_step_s']:.3f} s  tokens/s {row['tokens_per_s'] or 0:.0f}  "
            f"peak {row['peak_allocated_gib'] or 0:.2f} GiB  losses {[round(x, 4) for x in row['losses']]}",
            flush=True,
        )
    import torch

    import lce_patch

    meta = dict(
        adapter=args.adapter,
        seq_len=args.seq_len,
        batch=args.batch,
        steps=args.steps,
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        lce_patch=lce_patch.__version__,
    )
    try:
        import importlib.metadata as metadata

        meta.update(
            {name: metadata.version(name) for name in ("axolotl", "transformers", "peft", "trl", "liger-kernel")}
        )
    except Exception:
        pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
