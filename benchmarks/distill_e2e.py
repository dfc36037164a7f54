"""TRL's DistillationTrainer end to end: its own chunked divergence kernel vs lce_patch's fused divergence.

Real-sized student and teacher built from configs (random weights, bf16, on one GPU), the student fully
fine-tuned with AdamW and gradient checkpointing; each step generates ``--completion-len`` tokens per prompt with
the student's ``generate`` (on-policy), then runs both backbones and the loss. Per method: the median step time,
the median time of the loss step alone (TRL's ``_compute_loss``: both backbones, the divergence, not the
backward), the peak memory allocated over the run, and the logged loss and entropy per step. The same seed, so
the same weights, prompts and (up to the loss's rounding) completions in both runs.

    python3 benchmarks/distill_e2e.py [--student qwen1.5b --teacher qwen7b --batch-size 16 --steps 6]
    python3 benchmarks/distill_e2e.py --tiny      # tiny models on the CPU (smoke test of the script)

Needs trl and datasets (carry wheels to the GPU machine). JSON to --out (default $OUT/distill_e2e.json or
runs/distill_e2e.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from model_configs import decoder  # noqa: E402

# name -> Qwen2 config fields (the vocabularies match: TRL refuses a teacher of another vocab_size)
MODELS = {
    "qwen1.5b": decoder((1536, 8960, 28, 12, 2, 151936), tie_word_embeddings=True),
    "qwen7b": decoder((3584, 18944, 28, 28, 4, 151936), tie_word_embeddings=False),
    "tiny-student": decoder((32, 64, 2, 4, 2, 512), tie_word_embeddings=True),
    "tiny-teacher": decoder((48, 96, 2, 4, 2, 512), tie_word_embeddings=False),
}


def build_model(name: str, device, dtype, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**MODELS[name], max_position_embeddings=4096, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def run(method: str, args, device, dtype) -> dict:
    import datasets
    import torch
    import trl
    from bench_common import synchronizer, timed_calls

    from lce_patch import FusedLCECallback

    vocab = MODELS[args.student]["vocab_size"]
    tokenizer = make_tokenizer(vocab)
    gen = torch.Generator().manual_seed(args.seed)
    words = torch.randint(4, vocab, (args.batch_size * args.steps, args.prompt_len), generator=gen)
    # an explicit fingerprint: hashing the table to make one failed with pyarrow 26 under Python 3.12 (dill)
    table = datasets.table.InMemoryTable.from_pydict(
        {"prompt": [" ".join(f"w{i}" for i in row) for row in words.tolist()]}
    )
    prompts = datasets.Dataset(table, fingerprint=f"distill-e2e-prompts-{args.seed}")
    student = build_model(args.student, device, dtype, args.seed)
    teacher = build_model(args.teacher, device, dtype, args.seed + 1).eval()
    config = trl.DistillationConfig(
        output_dir=str(Path(args.out).parent / f"distill_e2e_{method}"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        max_completion_length=args.completion_len,
        beta=args.beta,
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=args.seed,
        bf16=device.type == "cuda",
        use_cpu=device.type != "cuda",
        gradient_checkpointing=True,
        disable_tqdm=True,
        shuffle_dataset=False,
    )
    callbacks = [FusedLCECallback()] if method == "lce_patch" else []
    trainer = trl.DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=prompts,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    sync = synchronizer(device)
    loss_times, step_times, generation_times = [], [], []
    # lce_patch's wrapper when served: time what the trainer calls
    trainer._compute_loss = timed_calls(trainer._compute_loss, loss_times, sync)
    trainer.training_step = timed_calls(trainer.training_step, step_times, sync)
    trainer._generate_and_score_completions = timed_calls(
        trainer._generate_and_score_completions, generation_times, sync
    )
    allocated_before = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        allocated_before = torch.cuda.memory_allocated() / 2**30
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    logs = [e for e in trainer.state.log_history if "loss" in e]
    timed = slice(1, None) if len(step_times) > 1 else slice(None)
    result = dict(
        step_s_median=statistics.median(step_times[timed]),
        loss_step_s_median=statistics.median(loss_times[timed]),
        generation_s_median=statistics.median(generation_times[timed]) if generation_times else None,
        peak_gib=peak,
        allocated_at_start_gib=allocated_before,
        losses=[e["loss"] for e in logs],
        entropy=[e.get("entropy") for e in logs],
        tokens_per_step=args.batch_size * args.completion_len,
    )
    # the timing wrappers close over the trainer: collect the cycle, so the next run starts from an empty GPU
    del trainer, student, teacher
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--student", default="qwen1.5b", choices=sorted(MODELS))
    parser.add_argument("--teacher", default="qwen7b", choices=sorted(MODELS))
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default="trl,lce_patch")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU, float32")
    default_out = os.path.join(os.environ.get("OUT", str(REPO / "runs")), "distill_e2e.json")
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()

    from bench_common import device_and_dtype, env_info

    device, dtype = device_and_dtype(args.tiny)
    if args.tiny:
        args.student, args.teacher = "tiny-student", "tiny-teacher"
        args.batch_size, args.prompt_len, args.completion_len, args.steps = 2, 6, 4, 2
    methods = args.methods.split(",")
    results = {}
    if len(methods) == 1:
        results[methods[0]] = run(methods[0], args, device, dtype)
    else:  # one process per method: nothing of one run (models, allocator state) is left for the next
        for method in methods:
            part = Path(args.out).with_suffix(f".{method}.json")
            command = [sys.executable, __file__, *sys.argv[1:], "--methods", method, "--out", str(part)]
            subprocess.run(command, check=True)
            results[method] = json.loads(part.read_text())["results"][method]
    for method, result in results.items():
        print(method, result, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(env=env_info(), args=vars(args), results=results), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
