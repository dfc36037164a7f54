"""Multi-GPU check of TRL's DistillationTrainer served by lce_patch: FSDP2 / ZeRO-3 train exactly like one process.

Run through accelerate (from the repository root; keep NVLink multicast off on shared hosts):

    NCCL_NVLS_ENABLE=0 accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 4 \\
        benchmarks/checks/distill_multi_gpu_check.py
    (likewise recipes/accelerate/fsdp2.yaml)

Or on CPU processes (gloo) under ZeRO-3, with DeepSpeed's CPU accelerator (DeepSpeed importable):
    DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate/zero3.yaml \\
        benchmarks/checks/distill_multi_gpu_check.py --vocab 256 --hidden 32
(accelerate runs FSDP on accelerators only), or as one plain process (``python benchmarks/checks/
distill_multi_gpu_check.py``): then the served trainer runs in one process and is compared with the same references.

What it does:
  1. DISTRIBUTED, every rank: a tiny fp32 student and a wider tiny teacher of the same vocabulary, built from configs
     (Llama, untied heads, same seeds on every rank), TRL's ``DistillationTrainer`` with ``FusedLCECallback`` and
     ``--batch`` prompts per step split over the ranks; the trainer prepares the teacher as TRL does (DeepSpeed:
     ``prepare_deepspeed``, a ZeRO-3 engine of its own; FSDP2: ``accelerator.prepare_model``). Completions are
     generated greedily (no sampling: the same completions whatever the split) and stop at any of ``1/--stop-every``
     of the vocabulary, so rows end at different lengths and the ranks hold different numbers of loss tokens.
     Plain SGD (no momentum, no clipping), so equal parameters mean equal gradients.
  2. REFERENCES, rank 0 afterwards, each a fresh process with no distributed environment, the whole global batch
     per step: (a) the same trainer unserved (TRL's own chunked divergence kernel), (b) the served trainer.
Checks (all must hold for PASS):
  * the op ran on every rank once per step with both heads whole (``[V, D]``, plain tensors, not a ZeRO-3 partition
    or an FSDP2 shard), the student head's norm inside the call equal to reference (b)'s at that step;
  * the same completions as the references (greedy generation under the distribution);
  * per-step loss (the mean over ranks of each rank's loss, which TRL scales by the number of processes) against
    (a) and (b): relative error <= ``--rtol-loss``;
  * every student parameter after the steps against (a) and (b): relative L2 <= ``--rtol-param``, the update
    (final - initial) relative L2 <= ``--rtol-update`` (the gradient check).

Rank 0 prints a PASS/FAIL table and writes JSON to ``--out`` (a directory, default ``$OUT`` if set else
runs/multi_gpu; or a path ending in .json). Exit status 1 on FAIL.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from harness import (  # the checks' shared harness, next to this file (it puts the checkout first on sys.path)
    OpSpy,
    Report,
    add_op_args,
    add_out_arg,
    add_tolerance_args,
    argv_without,
    check_launch,
    check_params,
    check_parser,
    compare_params,
    full_state_dict,
    mode_of,
    param_table,
    rel_err,
    set_exact_fp32,
    start,
    state_on_cpu,
)

from lce_patch.integrations.trl import distillation as served_distillation

PAD, EOS, BOS, UNK = 0, 1, 2, 3
# What a launcher puts in the environment: removed for the single-process references.
_LAUNCH_PREFIXES = ("ACCELERATE_", "FSDP_", "TORCHELASTIC_")
_LAUNCH_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = check_parser(
        "Check that TRL's DistillationTrainer served by lce_patch (FusedLCECallback) trains the same under FSDP2 / "
        "ZeRO-3 (accelerate launch) as in one process, served and unserved: losses, student parameters (SGD), both "
        "heads whole inside the op's calls.",
        "NCCL_NVLS_ENABLE=0 accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 4 "
        "benchmarks/checks/distill_multi_gpu_check.py",
    )
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="global batch: prompts per step (split over ranks)")
    parser.add_argument("--prompt-len", type=int, default=8, help="words per prompt (all equal: no padding)")
    parser.add_argument("--completion-len", type=int, default=16, help="max_completion_length")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (student and teacher)")
    parser.add_argument("--hidden", type=int, default=64, help="student hidden size (the teacher's is 1.5x)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of each model")
    parser.add_argument("--teacher-std", type=float, default=0.2, help="init std of the teacher's weights")
    parser.add_argument("--stop-every", type=int, default=8, help="every k-th token id ends a completion")
    parser.add_argument("--beta", type=float, default=0.5, help="DistillationConfig.beta (0 forward KL, 1 reverse)")
    parser.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate (linear decay, no momentum)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    add_op_args(parser)
    add_tolerance_args(parser, "student parameters")
    add_out_arg(parser, "multi_gpu")
    parser.add_argument("--role", choices=("check", "reference"), default="check", help=argparse.SUPPRESS)
    parser.add_argument("--served", type=int, default=1, help=argparse.SUPPRESS)  # the reference's
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.prompt_len < 1 or args.completion_len < 2:
        parser.error("--steps, --batch and --prompt-len must be >= 1, --completion-len >= 2")
    if args.vocab < 2 * args.stop_every or args.stop_every < 2:
        parser.error("--stop-every must be >= 2 and --vocab >= 2 x --stop-every")
    return args


# ------------------------------------------------------------------------------------------------ setup
def build_model(args: argparse.Namespace, hidden: int, seed: int, std: float = 0.02) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * (args.prompt_len + args.completion_len),
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        use_cache=True,
        initializer_range=std,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    # A completion ends at the tokenizer's EOS or any of these (TRL reads the model's generation config)
    model.generation_config.eos_token_id = [EOS, *range(args.stop_every, args.vocab, args.stop_every)]
    return model


def build_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, "<unk>": UNK}
    words.update({f"w{i}": i for i in range(4, vocab)})
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def prompts(args: argparse.Namespace):
    import datasets

    generator = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(4, args.vocab, (args.batch * args.steps, args.prompt_len), generator=generator)
    return datasets.Dataset.from_list([{"prompt": " ".join(f"w{int(i)}" for i in row)} for row in ids])


# ------------------------------------------------------------------------------------- what the op saw
# Both head weights each call of the op got (the name the served loss resolves at call time)
SPY = OpSpy(served_distillation, "fused_linear_divergence", weights={"student": 1, "teacher": 3}, labels_at=None)


# ------------------------------------------------------------------------------------------------ training
def train(args: argparse.Namespace, served: bool, world: int, cpu: bool) -> tuple[Any, dict[str, Any]]:
    """The trainer (trained) and what each step saw on this process: losses, completions."""
    import trl

    from lce_patch import FusedLCECallback

    # Built before the config: under ZeRO-3 the DeepSpeed config it sets up would make transformers partition the
    # weights at construction (zero.Init), and the initial state is read whole. DeepSpeed partitions them when the
    # trainer prepares each model.
    student = build_model(args, args.hidden, args.seed)
    # A teacher with wider weights: peaked distributions, far from the student's (a divergence worth its gradients)
    teacher = build_model(args, args.hidden * 3 // 2, args.seed + 100, std=args.teacher_std)
    initial = state_on_cpu(student)
    config = trl.DistillationConfig(
        output_dir=tempfile.mkdtemp(prefix="distill_check_"),
        per_device_train_batch_size=args.batch // world,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        max_completion_length=args.completion_len,
        beta=args.beta,
        temperature=1.0,
        generation_kwargs={"do_sample": False},
        shuffle_dataset=False,
        learning_rate=args.lr,
        optim="sgd",
        weight_decay=0.0,
        max_grad_norm=0.0,
        bf16=False,
        fp16=False,
        use_cpu=cpu and world == 1,
        ddp_backend="gloo" if cpu and world > 1 else None,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
        disable_tqdm=True,
    )
    options = {"backend": args.backend, "chunk_size": args.chunk_size}
    callbacks = [FusedLCECallback(**{k: v for k, v in options.items() if v is not None})] if served else []
    trainer = trl.DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=prompts(args),
        processing_class=build_tokenizer(args.vocab),
        callbacks=callbacks,
    )
    if trainer.is_fsdp_enabled and not cpu:
        # TRL 1.16 prepares the teacher with accelerate's prepare_model(evaluation_mode=True), which under FSDP
        # neither wraps nor places it: a teacher built on the CPU stays there. Users put it on their GPU.
        trainer.teacher_model.to(trainer.accelerator.device)
    seen: dict[str, Any] = {"losses": [], "completions": [], "valid_tokens": []}
    compute_loss = trainer.compute_loss

    def recording_compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        out = compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if model.training:
            loss = out[0] if return_outputs else out
            seen["losses"].append(float(loss.detach()))
            mask = inputs["completion_mask"].bool().cpu()
            seen["completions"].append([ids[m].tolist() for ids, m in zip(inputs["completion_ids"].cpu(), mask)])
            seen["valid_tokens"].append(int(mask.sum()))
        return out

    trainer.compute_loss = recording_compute_loss
    seen["initial_state"] = initial
    trainer.train()
    return trainer, seen


def run_reference(args: argparse.Namespace) -> int:
    """One process, the whole batch per step: writes losses, completions, calls and the student state to --out."""
    set_exact_fp32()
    SPY.install()
    trainer, seen = train(args, bool(args.served), world=1, cpu=not torch.cuda.is_available())
    torch.save({**seen, "state": state_on_cpu(trainer.model), "calls": SPY.take()}, args.out)
    return 0


def visible_device(local_rank: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of this process's GPU (``local_rank``-th of those visible)."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[local_rank] if local_rank < len(visible) else str(local_rank)


def spawn_reference(args: argparse.Namespace, served: bool, argv: list[str], folder: Path) -> dict[str, Any]:
    """Run a reference in a fresh process without the launcher's environment; its record."""
    path = folder / f"reference_{'served' if served else 'trl'}.pt"
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_NAMES and not k.startswith(_LAUNCH_PREFIXES)}
    if torch.cuda.is_available():
        # This rank's GPU alone: with several visible, a one-process Trainer wraps the model in nn.DataParallel,
        # which TRL's DistillationTrainer refuses.
        env["CUDA_VISIBLE_DEVICES"] = visible_device(int(os.environ.get("LOCAL_RANK", "0")))
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--role", "reference"]
    command += ["--served", str(int(served)), "--out", str(path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"reference ({'served' if served else 'TRL'}) failed:\n{result.stderr[-6000:]}")
    return torch.load(path, weights_only=False)


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    start()
    args = parse_args(argv)
    if args.role == "reference":
        return run_reference(args)
    set_exact_fp32()
    cpu = not torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the number of processes {world}")
    SPY.install()
    rank = int(os.environ.get("RANK", "0"))
    report = Report("distill_multi_gpu_check", args, "distill_multi_gpu_check", args.out, rank=rank)
    with report.phase("distributed"):
        trainer, seen = train(args, served=True, world=world, cpu=cpu)
        accelerator = trainer.accelerator
        problem = check_launch(accelerator)
        if problem:
            print(f"FAIL distill_multi_gpu_check: {problem}", file=sys.stderr, flush=True)
            return 2
        mode = mode_of(accelerator)
        report.path = report.path.with_name(f"distill_multi_gpu_check_{mode['mode'].lower()}_{world}.json")
        state = full_state_dict(accelerator, trainer.model_wrapped)
        mine = {"rank": rank, "calls": SPY.take(), **{k: seen[k] for k in ("losses", "completions", "valid_tokens")}}
        mine["model_class"] = type(trainer.model_wrapped).__name__
        mine["teacher_class"] = type(trainer.teacher_model).__name__
        ranks = [mine]
        if world > 1:
            ranks = [None] * world
            torch.distributed.all_gather_object(ranks, mine)
        report.data.update(mode=mode, ranks=ranks)
        accelerator.wait_for_everyone()
        # Done with collectives: a rank that leaves with its process group alive can abort at exit (gloo's threads)
        accelerator.end_training()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if rank != 0:
        return 0
    # References, one fresh process each (rank 0; the other ranks are done).
    with report.phase("references"), tempfile.TemporaryDirectory(prefix="distill_check_ref_") as folder:
        passed = argv_without(argv, ("--role", "--served", "--out"))
        ref_trl = spawn_reference(args, False, passed, Path(folder))
        ref_fused = spawn_reference(args, True, passed, Path(folder))
    with report.phase("compare"):
        judge(report, args, ranks, state, seen["initial_state"], ref_trl, ref_fused, world)
    title = [
        f"distill_multi_gpu_check  mode={mode['mode']}  world_size={world}  backend={mode.get('backend', '-')}  "
        f"device={mode['device']}  lce_patch backend={args.backend}  beta={args.beta}",
        f"student {ranks[0]['model_class']}, teacher {ranks[0]['teacher_class']}; V={args.vocab} "
        f"D={args.hidden}/{args.hidden * 3 // 2} layers={args.layers}; {args.batch} prompts/step "
        f"({args.batch // world}/rank) x {args.prompt_len} + up to {args.completion_len}; SGD lr={args.lr}",
        f"{'step':>4} {'TRL 1 proc':>14} {'served 1 proc':>14} {'served dist':>14} {'vs TRL':>9} {'vs served':>9}",
    ]
    table = [
        f"{r['step']:>4} {r['trl']:>14.8f} {r['fused']:>14.8f} {r['dist']:>14.8f} "
        f"{r['rel_err_vs_trl']:>9.2e} {r['rel_err_vs_fused']:>9.2e}  local " + " ".join(f"{x:.6f}" for x in r["local"])
        for r in report.data["losses"]
    ]
    table += param_table(report.data["params_vs_trl"], report.data["params_vs_served"], "served")
    ok = report.finish(title, table, f"{mode['mode']} world_size={world}")
    return 0 if ok else 1


def judge(report: Report, args, ranks, state, init, ref_trl, ref_fused, world: int) -> None:
    """The verdicts: both heads whole in every call, the completions, the losses, the student's parameters."""
    check = report.check
    student_shape = [args.vocab, args.hidden]
    teacher_shape = [args.vocab, args.hidden * 3 // 2]
    for info in ranks:
        calls = info["calls"]
        whole = all(
            c["student"]["shape"] == c["student"]["local_shape"] == student_shape
            and c["teacher"]["shape"] == c["teacher"]["local_shape"] == teacher_shape
            and not c["student"]["is_dtensor"]
            and not c["teacher"]["is_dtensor"]
            for c in calls
        )
        seen_shapes = sorted({(tuple(c["student"]["local_shape"]), tuple(c["teacher"]["local_shape"])) for c in calls})
        types = sorted({c[head]["type"] for c in calls for head in ("student", "teacher")})
        check(
            f"rank{info['rank']} op calls",
            len(calls) == args.steps and whole,
            f"{len(calls)} calls for {args.steps} steps; (student, teacher) head weights inside the call "
            f"{seen_shapes}, types {types}",
        )
        norm_errs = [
            rel_err(c[head]["norm"], r[head]["norm"])
            for c, r in zip(calls, ref_fused["calls"])
            for head in ("student", "teacher")
        ]
        worst = max(norm_errs, default=math.inf)
        check(
            f"rank{info['rank']} heads gathered",
            worst <= args.rtol_param,
            f"norms of both head weights inside the op's call vs the one-process served run, worst rel err {worst:.2e}",
        )
    check(
        "reference calls",
        len(ref_fused["calls"]) == args.steps and not ref_trl["calls"],
        f"served {len(ref_fused['calls'])}, TRL's {len(ref_trl['calls'])} (none: its own kernel)",
    )

    # Completions: the ranks' rows together are the global batch's (the samplers may order its rows differently).
    def rows(completions: list[list[int]]) -> list[tuple[int, ...]]:
        return sorted(tuple(c) for c in completions)

    dist_rows = [rows(sum((info["completions"][s] for info in ranks), [])) for s in range(args.steps)]
    differing = [
        (name, s)
        for name, ref in (("TRL", ref_trl), ("served", ref_fused))
        for s in range(args.steps)
        if s >= len(ref["completions"]) or dist_rows[s] != rows(ref["completions"][s])
    ]
    check(
        "same completions",
        not differing,
        f"greedy completions of each step's prompts under the distribution vs one process (differing (reference, "
        f"step): {differing[:4]}); loss tokens per step "
        f"{[sum(info['valid_tokens'][s] for info in ranks) for s in range(args.steps)]}, per rank "
        f"{[[info['valid_tokens'][s] for info in ranks] for s in range(args.steps)]}",
    )
    loss_rows = []
    for s in range(args.steps):
        local = [info["losses"][s] for info in ranks]
        dist_loss = sum(local) / world  # TRL scales each rank's loss by the number of processes
        loss_rows.append(
            {
                "step": s,
                "trl": ref_trl["losses"][s],
                "fused": ref_fused["losses"][s],
                "dist": dist_loss,
                "rel_err_vs_trl": rel_err(dist_loss, ref_trl["losses"][s]),
                "rel_err_vs_fused": rel_err(dist_loss, ref_fused["losses"][s]),
                "local": local,
            }
        )
    report.data["losses"] = loss_rows
    for against in ("trl", "fused"):
        worst = max(r[f"rel_err_vs_{against}"] for r in loss_rows)
        check(f"loss vs {against}", worst <= args.rtol_loss, f"worst per-step rel err {worst:.2e}")
    for against, ref, key in (("trl", ref_trl, "params_vs_trl"), ("fused", ref_fused, "params_vs_served")):
        params, missing = compare_params(state, ref["state"], init)
        report.data[key] = params
        check(f"student parameters gathered ({against})", not missing and params, f"{len(params)}, missing {missing}")
        check_params(report, against, params, args.rtol_param, args.rtol_update)
    report.data["reference_calls"] = ref_fused["calls"]


if __name__ == "__main__":
    sys.exit(main())
