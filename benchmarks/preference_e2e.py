"""TRL 1.16's experimental preference trainers end to end at a real size: ORPO, SimPO and Online DPO, TRL alone
(full logits) vs lce_patch's FusedLCECallback serving them.

A setup is a trainer, ``orpo`` (``trl.experimental.orpo.ORPOTrainer``), ``simpo``
(``trl.experimental.cpo.CPOTrainer`` with ``loss_type="simpo"``, ``cpo_alpha=0``: SimPO proper, no NLL term) or
``online-dpo`` (``trl.experimental.online_dpo.OnlineDPOTrainer``), alone or with ``+lce_patch`` (the callback).
The model is Llama-3.2-1B's shape (``e2e_train.build_model``: hidden 2048, 16 layers, vocab 128256, tied
embeddings), random weights, built in bf16 on the GPU, fully fine-tuned with AdamW, gradient checkpointing on and
``bf16=True``; a fresh model per setup (same seed, same weights) and the same data.

What each trainer runs per step (batch ``--batch-size`` preference pairs, or prompts for Online DPO):

- ORPO and SimPO: no reference model (both are reference-free). The chosen and rejected sequences, each
  ``--seq-len`` tokens (BOS + prompt: ``--prompt-len``; completion + EOS: the rest), go through the model stacked in
  one batch; TRL's ``concatenated_forward`` takes the full ``[2B, seq_len, V]`` logits from the model's forward and
  reads from them the completion log-probabilities (and ORPO's NLL over every attended token of the chosen rows).
  With the callback that method runs the backbone and one call of lce_patch's op (``lce_patch/integrations/trl/preference.py``).
- Online DPO: a reference model, a copy of the policy (TRL's default when no ``ref_model`` and no PEFT), and a
  python reward function (the number of distinct tokens of a completion: no download, no second big model). Each
  step samples 2 completions per prompt with ``generate`` (exactly ``--max-new-tokens`` tokens: ``min_new_tokens``
  is set; with the KV cache, which TRL would turn off because of gradient checkpointing although it disables the
  checkpointing around ``generate``), then ``OnlineDPOTrainer._forward`` runs the policy (with gradient) and the
  reference (without) on prompt + completion, ``--seq-len`` tokens in all. TRL's ``_forward`` calls the model for
  ``output.logits`` over every position of prompt + completion (``[2B, seq_len, V]``: the head's matmul and the
  logits are over the prompt too) and only then slices the completion's positions for its ``log_softmax``; with the
  callback the op scores the completion's positions alone (``lce_patch/integrations/trl/online_dpo.py``). Generation is the same in both
  setups (``generate`` builds one position's logits per new token) and its time is reported apart.

Per setup: the median optimizer-step time over the steps after the first (a TrainerCallback, synchronized), the
peak GPU memory allocated during ``train()`` (peak stats reset just before it: weights, reference model and
optimizer state included), the logged losses and metrics. One JSON line per setup, all of them with the versions
and the device to ``--out``, and a markdown table at the end.

    python benchmarks/preference_e2e.py [--batch-size 1 --seq-len 2048 --prompt-len 512 --steps 6]
    python benchmarks/preference_e2e.py --setups online-dpo,online-dpo+lce_patch --max-new-tokens 64
    python benchmarks/preference_e2e.py --tiny    # tiny Llama in float32 on the CPU (smoke test of the script)

With ``--tiny`` the two setups of a trainer must give the same losses (float32; lce_patch's op differs from TRL's
log-softmax by rounding only): the script prints their largest relative difference. Needs trl and datasets (carry
wheels to the GPU machine). JSON to --out (default $OUT/preference_e2e.json or runs/preference_e2e.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

TRAINERS = ("orpo", "simpo", "online-dpo")
SETUPS = [f"{t}{s}" for t in TRAINERS for s in ("", "+lce_patch")]
_TIMING_KEYS = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")


def build_tiny_model(vocab: int):
    """A tiny Llama (hidden 32, 2 layers) in float32 on the CPU, for the smoke run."""
    import torch
    from model_configs import tiny
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **tiny(hidden_size=32, intermediate_size=64, vocab_size=vocab, max_position_embeddings=4096),
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def _dataset(columns: dict[str, list[str]], name: str):
    import datasets

    # an explicit fingerprint: hashing the table to make one failed with pyarrow 26 under Python 3.12 (dill)
    return datasets.Dataset(datasets.table.InMemoryTable.from_pydict(columns), fingerprint=f"preference-e2e-{name}")


def make_data(trainer_name: str, args, vocab: int):
    """Random words of the word-level tokenizer (one token each, ids 4..V-1), so that the tokenized lengths are
    exact: ORPO and CPO add BOS to the prompt and EOS to each completion, Online DPO's generate adds nothing."""
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    rows = args.batch_size * args.steps

    def draw(n: int) -> list[list[int]]:
        return torch.randint(4, vocab, (rows, n), generator=gen).tolist()

    if trainer_name == "online-dpo":
        return _dataset({"prompt": [_words(p) for p in draw(args.seq_len - args.max_new_tokens)]}, "prompts")
    completion_len = args.seq_len - args.prompt_len - 1
    prompts, chosen, rejected = draw(args.prompt_len - 1), draw(completion_len), draw(completion_len)
    return _dataset(
        {
            "prompt": [_words(p) for p in prompts],
            # the leading space keeps the completion's first word apart from the prompt's last in prompt + completion
            "chosen": [" " + _words(c) for c in chosen],
            "rejected": [" " + _words(r) for r in rejected],
        },
        "pairs",
    )


def distinct_tokens_reward(completions, **kwargs) -> list[float]:
    """Online DPO's reward: the number of distinct tokens of a completion (a cheap, deterministic judge)."""
    return [float(len(set(completion.split()))) for completion in completions]


class _StepTimer:
    def __init__(self, cuda: bool, profile_step: int | None = None):
        import torch
        from transformers import TrainerCallback

        sync = torch.cuda.synchronize if cuda else (lambda: None)
        outer = self
        self.step_s: list[float] = []
        self.profile: str | None = None

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                sync()
                if state.global_step + 1 == profile_step:
                    activities = [torch.profiler.ProfilerActivity.CPU]
                    if cuda:
                        activities.append(torch.profiler.ProfilerActivity.CUDA)
                    outer.profiler = torch.profiler.profile(activities=activities)
                    outer.profiler.__enter__()
                outer.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                sync()
                outer.step_s.append(time.perf_counter() - outer.start)
                if state.global_step == profile_step:
                    outer.profiler.__exit__(None, None, None)
                    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
                    outer.profile = outer.profiler.key_averages().table(sort_by=sort, row_limit=15)

        self.callback = Callback()


def run(setup: str, args, device, dtype) -> dict:
    import torch
    from bench_common import synchronizer, timed_calls
    from distill_e2e import make_tokenizer

    from lce_patch import FusedLCECallback

    trainer_name, _, extra = setup.partition("+")
    if trainer_name not in TRAINERS or extra not in ("", "lce_patch"):
        raise ValueError(f"unknown setup {setup!r}; known: {', '.join(SETUPS)}")
    cuda = device.type == "cuda"
    if args.tiny:
        model = build_tiny_model(vocab=512)
    else:
        from e2e_train import build_model

        model = build_model("llama-3.2-1b")
    vocab = model.config.vocab_size
    tokenizer = make_tokenizer(vocab)  # word-level, built offline: "w{i}" is token i
    for config in (model.config, model.generation_config):  # the tokenizer's special tokens
        config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 2
    data = make_data(trainer_name, args, vocab)
    timer = _StepTimer(cuda, args.profile_step)
    callbacks = [timer.callback] + ([FusedLCECallback()] if extra == "lce_patch" else [])
    common = dict(
        output_dir=str(Path(args.out).parent / f"preference_e2e_{setup.replace('+', '_')}"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        learning_rate=args.lr,
        max_length=args.seq_len,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=args.seed,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=True,
        disable_tqdm=True,
    )
    generation_s: list[float] = []
    sequence_tokens: list[int] = []
    if trainer_name == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer = ORPOTrainer(
            model=model, args=ORPOConfig(**common), train_dataset=data, processing_class=tokenizer, callbacks=callbacks
        )
    elif trainer_name == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        trainer = CPOTrainer(
            model=model,
            args=CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0),
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    else:
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        config = OnlineDPOConfig(
            **common,
            max_new_tokens=args.max_new_tokens,
            generation_kwargs={"min_new_tokens": args.max_new_tokens, "use_cache": True},
        )
        trainer = OnlineDPOTrainer(
            model=model,
            ref_model=None,  # TRL copies the policy
            reward_funcs=distinct_tokens_reward,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=callbacks,
        )
        generate = timed_calls(trainer._generate, generation_s, synchronizer("cuda" if cuda else "cpu"))

        def timed_generate(*a, **k):
            out = generate(*a, **k)
            sequence_tokens.append(out[0].shape[1] + out[2].shape[1])  # prompt + completion
            return out

        trainer._generate = timed_generate
    if trainer_name != "online-dpo":
        first = trainer.train_dataset[0]
        sequence_tokens = [len(first["chosen_input_ids"]), len(first["rejected_input_ids"])]
    served = any(name in vars(trainer) for name in ("concatenated_forward", "_forward"))
    allocated_before = None
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        allocated_before = torch.cuda.memory_allocated() / 2**30
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    logs = [
        {k: v for k, v in entry.items() if not k.endswith(_TIMING_KEYS)}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    timed = slice(1, None) if len(timer.step_s) > 1 else slice(None)
    result = dict(
        setup=setup,
        trainer=trainer_name,
        lce_patch=extra == "lce_patch",
        served=served,
        model="tiny-llama" if args.tiny else "llama-3.2-1b",
        dtype=str(dtype).removeprefix("torch."),
        gradient_checkpointing=bool(
            getattr(trainer.accelerator.unwrap_model(trainer.model), "is_gradient_checkpointing", False)
        ),
        batch_size=args.batch_size,
        sequences_per_step=2 * args.batch_size,
        sequence_tokens=sorted(set(sequence_tokens)),
        steps=args.steps,
        step_s=timer.step_s,
        step_s_median=statistics.median(timer.step_s[timed]),
        generation_s_median=statistics.median(generation_s[timed]) if generation_s else None,
        peak_gib=peak,
        allocated_at_start_gib=allocated_before,
        losses=[entry["loss"] for entry in logs],
        logs=logs,
    )
    if timer.profile is not None:
        result["profile"] = timer.profile
        print(f"{setup}, step {args.profile_step}:\n{timer.profile}", flush=True)
    # the timing wrappers close over the trainer: collect the cycle, so the next setup starts from an empty GPU
    del trainer, model, data, callbacks, timer
    if trainer_name == "online-dpo":
        del generate, timed_generate
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _agreement(results: list[dict]) -> dict[str, float]:
    """Per trainer, the largest relative difference between its two setups over the logged loss and log-probabilities
    (``logps/chosen``, ``logps/rejected``) of every step: Online DPO logs its loss rounded to 4 digits, the
    log-probabilities in full."""
    by_setup = {r["setup"]: r for r in results if "error" not in r}
    agreement = {}
    for name in TRAINERS:
        theirs, ours = by_setup.get(name), by_setup.get(f"{name}+lce_patch")
        if theirs is None or ours is None or len(theirs["logs"]) != len(ours["logs"]) or not theirs["logs"]:
            continue
        agreement[name] = max(
            abs(a[key] - b[key]) / max(abs(a[key]), 1e-12)
            for a, b in zip(theirs["logs"], ours["logs"])
            for key in ("loss", "logps/chosen", "logps/rejected")
            if key in a and key in b
        )
    return agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--batch-size", type=int, default=None, help="preference pairs (prompts) per step (1)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence, prompt + completion (2048)")
    parser.add_argument("--prompt-len", type=int, default=None, help="ORPO/SimPO prompt tokens, BOS included (512)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="Online DPO completion tokens; its prompt is the rest (64)"
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (6)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--profile-step", type=int, default=None, help="profile this optimizer step (1-based) and print its top ops"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny Llama (hidden 32, 2 layers, vocab 512) in float32 on the CPU; defaults batch 2, seq 128, "
        "prompt 64, 16 new tokens, 3 steps",
    )
    default_out = os.path.join(os.environ.get("OUT", str(REPO / "runs")), "preference_e2e.json")
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()
    defaults = (2, 128, 64, 16, 3) if args.tiny else (1, 2048, 512, 64, 6)
    for name, value in zip(("batch_size", "seq_len", "prompt_len", "max_new_tokens", "steps"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not 1 < args.prompt_len < args.seq_len - 1 or not 0 < args.max_new_tokens < args.seq_len:
        parser.error("need 1 < --prompt-len < --seq-len - 1 and 0 < --max-new-tokens < --seq-len")

    import torch
    from bench_common import device_and_dtype, dist_version, env_info

    device, dtype = device_and_dtype(args.tiny)
    if device.type == "cpu" and not args.tiny:
        parser.error("no GPU: the real size runs on one; --tiny runs on the CPU")
    env = env_info()
    env["datasets"] = dist_version("datasets")
    results = []
    for setup in args.setups.split(","):
        try:
            results.append(run(setup, args, device, dtype))
        except Exception as error:  # report and go on: one failing setup must not hide the others
            results.append({"setup": setup, "error": repr(error)[:500]})
        gc.collect()  # after the except block: its traceback no longer holds the failed setup's model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(results[-1]), flush=True)
    agreement = _agreement(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = dict(env=env, args=vars(args), results=results, max_rel_diff=agreement)
    Path(args.out).write_text(json.dumps(report, indent=1))

    print(
        f"\n{env['device']}, torch {env['torch']}, trl {env['trl']}, {results[0].get('model', '')} "
        f"{str(dtype).removeprefix('torch.')}, {args.batch_size} pair(s)/step, seq {args.seq_len} "
        f"(ORPO/SimPO prompt {args.prompt_len}; Online DPO {args.max_new_tokens} new tokens), {args.steps} steps"
    )
    print("| setup | served | peak GiB | median step s | of which generate s | first/last loss |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['setup']} | error: {r['error'][:100]} | | | | |")
            continue
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        gen = "" if r["generation_s_median"] is None else f"{r['generation_s_median']:.3f}"
        losses = f"{r['losses'][0]:.6g} / {r['losses'][-1]:.6g}" if r["losses"] else "none logged"
        served = "yes" if r["served"] else "no"
        print(f"| {r['setup']} | {served} | {peak} | {r['step_s_median']:.3f} | {gen} | {losses} |")
    for name, diff in agreement.items():
        print(f"{name} vs {name}+lce_patch: max relative difference of loss and logps over the steps {diff:.2e}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
