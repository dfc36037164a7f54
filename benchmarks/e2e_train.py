"""End-to-end training steps at a real size: unpatched vs lce_patch, under transformers.Trainer and
TRL's SFTTrainer (its own fused head vs lce_patch's op serving it), eager or compiled, alone or with
Liger-Kernel's kernels.

A setup is a base, ``trainer`` or ``sft`` (``sft-trl-head``: TRL's own fused head), plus any of
``+lce_patch`` (FusedLCECallback), ``+compile`` (``TrainingArguments(torch_compile=True)``; the
first, compiling step is not timed), ``+liger`` (``use_liger_kernel=True``: all of Liger's kernels,
its fused loss included) and ``+liger-nonloss`` (Liger's RMSNorm/RoPE/SwiGLU/GeGLU kernels, its
fused loss off: ``liger_kernel_config={"fused_linear_cross_entropy": False}``).

Models are built from configs (random weights, no download): Llama-3.2-1B's (hidden 2048, vocab
128256) and Gemma-2-2B's (final-logit softcap 30). One process; for each setup it runs a few
optimizer steps of batch 1 x ``--seq-len`` tokens in bf16 and reports peak GPU memory,
tokens/s over the steps after the first and those steps' spread (p10, median, p90 of the step time). The
setups run one after the other (no interleaving): a difference inside the spread of the steps is level.
Liger's setups come last (its kernels replace transformers' model classes for the rest of the process).

    python benchmarks/e2e_train.py --seq-len 4096 --steps 6
    python benchmarks/e2e_train.py --seq-len 8192 --setups trainer,trainer+lce_patch,trainer+compile+lce_patch
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time


def build_model(name: str):
    import torch
    from model_configs import decoder
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

    if name == "llama-3.2-1b":
        config = LlamaConfig(
            **decoder((2048, 8192, 16, 32, 8, 128256)),
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            rope_theta=500000.0,
        )
    else:
        config = Gemma2Config(
            **decoder((2304, 9216, 26, 8, 4, 256000)),
            head_dim=256,
            max_position_embeddings=8192,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            query_pre_attn_scalar=256,
        )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialise on the GPU: a CPU init of 2.6B parameters takes minutes
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


class _Timer:
    """Wall time of the steps after the first (synchronized at each step's start and end), and of each step."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                import torch

                torch.cuda.synchronize()
                outer.step_start = time.perf_counter()
                if state.global_step == 1:
                    outer.start = outer.step_start

            def on_step_end(self, args, state, control, **kwargs):
                import torch

                torch.cuda.synchronize()
                outer.step_s.append(time.perf_counter() - outer.step_start)

            def on_train_end(self, args, state, control, **kwargs):
                import torch

                torch.cuda.synchronize()
                outer.stop = time.perf_counter()

        self.callback = Callback()
        self.start = self.stop = self.step_start = None
        self.step_s: list[float] = []


def run(setup: str, model_name: str, seq_len: int, steps: int, out_dir: str, prompt_fraction: float = 0.0) -> dict:
    import torch

    from lce_patch import FusedLCECallback

    parts = setup.split("+")
    unknown = set(parts[1:]) - {"lce_patch", "compile", "liger", "liger-nonloss"}
    if parts[0] not in ("trainer", "sft", "sft-trl-head") or unknown:
        raise ValueError(f"unknown setup {setup!r}")

    model = build_model(model_name)
    model.gradient_checkpointing_enable()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, vocab, (seq_len,), generator=generator).tolist()} for _ in range(steps)]
    prompt_len = int(prompt_fraction * seq_len)

    def make_labels(ids: torch.Tensor) -> torch.Tensor:
        labels = ids.clone()
        labels[:, :prompt_len] = -100  # a masked prompt, as in completion-only SFT
        return labels

    timer = _Timer()
    callbacks = [timer.callback] + ([FusedLCECallback()] if "lce_patch" in parts else [])
    common = dict(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=1,
        bf16=torch.cuda.is_available(),  # the CPU only for a smoke run
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-5,
        disable_tqdm=True,
        torch_compile="compile" in parts,
    )
    if "liger" in parts or "liger-nonloss" in parts:
        common["use_liger_kernel"] = True
        if "liger-nonloss" in parts:
            common["liger_kernel_config"] = {"fused_linear_cross_entropy": False}
    torch.cuda.reset_peak_memory_stats()
    if setup.startswith("trainer"):
        from transformers import Trainer, TrainingArguments

        def collate(batch):
            ids = torch.tensor([b["input_ids"] for b in batch])
            return {"input_ids": ids, "labels": make_labels(ids)}

        trainer = Trainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=rows,  # a list: the plain Trainer needs no datasets package
            data_collator=collate,
            callbacks=callbacks,
        )
    else:
        import sys

        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
        from _loading import build_embedded_tokenizer

        trainer = SFTTrainer(
            model=model,
            # SFTTrainer wants a tokenizer and would look one up by the model's (empty) hub name; the
            # data is tokenized already, so the recipes' offline tokenizer does.
            processing_class=build_embedded_tokenizer(),
            args=SFTConfig(**common, max_length=seq_len, dataset_kwargs={"skip_prepare_dataset": True}),
            train_dataset=Dataset.from_list(rows),
            callbacks=callbacks,
            data_collator=lambda b: {
                "input_ids": torch.tensor([x["input_ids"] for x in b]),
                "attention_mask": torch.ones(len(b), len(b[0]["input_ids"]), dtype=torch.long),
                "labels": make_labels(torch.tensor([x["input_ids"] for x in b])),
            },
        )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "setup": setup,
        "model": model_name,
        "seq_len": seq_len,
        "prompt_fraction": prompt_fraction,
        "steps": steps,
        "versions": _versions(),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "tokens_per_s": seq_len * (steps - 1) / (timer.stop - timer.start),
        "step_s": timer.step_s,  # every step, the first (compiling, warming up) included
        "step_s_p10_median_p90": _spread(timer.step_s[1:]),
        "losses": losses,
    }
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _spread(times: list[float]) -> list[float] | None:
    """p10, median and p90 of the step times (s), by bench_common.timing_summary (whose keys say ms)."""
    if not times:
        return None
    from bench_common import timing_summary

    summary = timing_summary(times)
    return [summary["ms_p10"], summary["ms_median"], summary["ms_p90"]]


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "triton", "transformers", "trl", "liger-kernel"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-3.2-1b,gemma-2-2b")
    parser.add_argument("--setups", default="trainer,trainer+lce_patch,sft-trl-head,sft+lce_patch")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--prompt-fraction", type=float, default=0.0, help="leading fraction of each sequence labelled -100"
    )
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "e2e.json"))
    args = parser.parse_args()
    setups = args.setups.split(",")
    liger = [i for i, setup in enumerate(setups) if "+liger" in setup]
    if liger and any("+liger" not in setup for setup in setups[liger[0] :]):
        parser.error(
            "Liger's kernels replace transformers' model classes for the rest of the process: "
            "list the setups with +liger or +liger-nonloss last"
        )
    import sys

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_common import env_info

    env = env_info()
    results = []
    for model_name in args.models.split(","):
        for setup in setups:
            try:
                results.append(run(setup, model_name, args.seq_len, args.steps, "/tmp/e2e", args.prompt_fraction))
            except Exception as error:  # report and go on: one failing setup must not hide the others
                results.append({"setup": setup, "model": model_name, "error": repr(error)[:300]})
                torch.cuda.empty_cache()
            print(json.dumps(results[-1]), flush=True)
            with open(args.out, "w") as f:  # after every setup: a run cut short keeps what it measured
                json.dump({"env": env, "args": vars(args), "results": results}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, seq {args.seq_len}, batch 1, bf16")
    print("| model | setup | peak GiB | tokens/s | step s p10 / median / p90 | first/last loss |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['model']} | {r['setup']} | error: {r['error'][:80]} | | | |")
        else:
            print(
                f"| {r['model']} | {r['setup']} | {r['peak_gib']:.2f} | {r['tokens_per_s']:.0f} | "
                + " / ".join(f"{t:.3f}" for t in r["step_s_p10_median_p90"] or [])
                + f" | {r['losses'][0]:.3f} / {r['losses'][-1]:.3f} |"
            )


if __name__ == "__main__":
    main()
