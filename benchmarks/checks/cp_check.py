"""Long-sequence check: the patched model trains through ``transformers.Trainer`` + ``FusedLCECallback`` under context
parallelism (accelerate ``ParallelismConfig(cp_size=N)``, FSDP2, torch's ring attention on SDPA) and under DeepSpeed
Ulysses sequence parallelism (``sp_size=N, sp_backend="deepspeed"``) exactly like one process on the whole sequence.

Launch (from the repository root; keep NVLink multicast off on shared hosts):

    NCCL_NVLS_ENABLE=0 accelerate launch --config_file recipes/accelerate/cp.yaml benchmarks/checks/cp_check.py
    NCCL_NVLS_ENABLE=0 accelerate launch --config_file recipes/accelerate/ulysses.yaml benchmarks/checks/cp_check.py
    (4 GPUs: add --num_processes 4 after the config file; the script sets cp_size / sp_size to the number of
    processes)

Context parallelism needs CUDA (torch's ring attention runs on the CUDA SDPA kernels; accelerate enables FSDP on
accelerators only). Ulysses also runs on CPU processes (gloo) with DeepSpeed's CPU accelerator, tiny shapes:
``DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate/ulysses.yaml benchmarks/checks/cp_check.py
--cpu`` (DeepSpeed on the path).

What it does, every rank with the same seed:
  1. builds a model from a config (``--shape tiny``: a few-unit Llama or Gemma-3; ``--shape full``: ``--layers``
     decoder layers of Llama-3.1-8B's or Gemma-3-12B's shape, Gemma-3 with a final logit softcap of 30), SDPA
     attention, fp32 (``--dtype bf16``: mixed precision), and a dataset of ``--steps`` x ``--grad-accum`` x
     ``--batch`` sequences of ``--seq-len`` tokens with ``position_ids``, a random prefix of each
     ignored (-100); at the second step every label that rank 0's slice scores is ignored (rank 0 then holds no valid
     label). Under Ulysses with gradient accumulation the micro-batches of a step share their mask: the Trainer
     averages the micro-batches' means there (it passes no ``num_items_in_batch``), which equals one process only
     when their counts are equal;
  2. REFERENCE (rank 0, before the Trainer exists): the same model in one process on the whole sequences, as the
     one-process Trainer trains it (``num_items_in_batch`` over the step's micro-batches, plain SGD, no clipping),
     unpatched ("ref") and patched ("ref_fused");
  3. DISTRIBUTED: ``Trainer(..., callbacks=[FusedLCECallback()])`` (``--unpatched``: no callback, a check of the
     setup) with ``TrainingArguments(parallelism_config=...)``, ``optim="sgd"``, constant learning rate,
     ``max_grad_norm=0``, sequential sampling; the per-step losses the Trainer logs and the full parameters after
     training are compared with the reference.

Checks (all must hold for PASS): lce_patch's op ran once per micro-batch on every rank, on the rank's slice of the
sequence (``seq_len / N`` positions), with the whole ``[V, D]`` head weight; under context parallelism it was given
the Trainer's ``num_items_in_batch`` (the step's count of valid shifted labels); the logged loss per step and the
parameter updates equal the references within the dtype's tolerance. Rank 0 prints a PASS/FAIL table and writes
JSON to ``--out`` (default ``$OUT`` or runs/cp_check). Exit status 1 on FAIL.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
from typing import Any

import torch
from harness import (  # the checks' shared harness, next to this file (it puts the checkout first on sys.path)
    OpSpy,
    Report,
    add_out_arg,
    agree,
    check_parser,
    compare_params,
    full_state_dict,
    mode_of,
    ranks,
    rel_err,
    start,
    state_on_cpu,
    update_failures,
)
from model_configs import tiny

import lce_patch
from lce_patch import apply_fused_lce

IGNORE = -100

# (hidden, intermediate, heads, kv heads, head_dim, vocab) of the full-size shapes
SHAPES = {
    "llama": dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256
    ),
    "gemma3": dict(
        hidden_size=3840,
        intermediate_size=15360,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=262208,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = check_parser(
        "Check that a patched model trains through the Trainer under context parallelism (cp_size=N, FSDP2) or "
        "DeepSpeed Ulysses (sp_size=N) exactly like one process on the whole sequence.",
        "NCCL_NVLS_ENABLE=0 accelerate launch --config_file recipes/accelerate/cp.yaml benchmarks/checks/cp_check.py "
        "--arch llama",
    )
    parser.add_argument(
        "--mode",
        choices=("auto", "cp", "sp"),
        default="auto",
        help="cp: context parallelism; sp: Ulysses; auto: from the launch config (PARALLELISM_CONFIG_*)",
    )
    parser.add_argument(
        "--arch",
        choices=("llama", "gemma3"),
        default="llama",
        help="llama: untied head; gemma3: tied head, final_logit_softcapping=30 (Gemma-2 has no SDPA attention in "
        "transformers 5.x, which context parallelism needs; under Ulysses it needs FlashAttention-2)",
    )
    parser.add_argument(
        "--shape",
        choices=("tiny", "full"),
        default=None,
        help="tiny: hidden 64, vocab 512; full: Llama-3.1-8B / Gemma-3-12B layer and head shapes (default: tiny on "
        "--cpu, else full)",
    )
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 64 tiny, 4096 full)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (SGD, no momentum)")
    parser.add_argument("--lr", type=float, default=None, help="SGD learning rate (default 1e-2 tiny, 1.0 full)")
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32: the exact check (losses and updates against one process); bf16: mixed precision as users train "
        "(losses checked; the updates are reported, not checked: the one-process reference under autocast and the "
        "engines' bf16 parameters round differently, by more than an SGD step moves a weight)",
    )
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="TrainingArguments.gradient_checkpointing"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", help="lce_patch backend: auto, triton or torch")
    parser.add_argument("--unpatched", action="store_true", help="train without FusedLCECallback (setup control)")
    parser.add_argument("--cpu", action="store_true", help="CPU processes (gloo); Ulysses only")
    parser.add_argument("--rtol-loss", type=float, default=None, help="per-step loss (default 1e-5 fp32, 2e-2 bf16)")
    parser.add_argument(
        "--rtol-update",
        type=float,
        default=None,
        help="parameter updates (final - initial), relative L2 (default 1e-3; checked at fp32 only)",
    )
    add_out_arg(parser, "cp_check")
    args = parser.parse_args(argv)
    if args.shape is None:
        args.shape = "tiny" if args.cpu or not torch.cuda.is_available() else "full"
    tiny = args.shape == "tiny"
    args.seq_len = args.seq_len or (64 if tiny else 4096)
    # full: updates far above the weights' fp32 resolution (a 2-layer random model barely moves at 1e-3)
    args.lr = args.lr or (1e-2 if tiny else 1.0)
    bf16 = args.dtype == "bf16"
    args.rtol_loss = args.rtol_loss or (2e-2 if bf16 else 1e-5)
    args.rtol_update = args.rtol_update or (1e-1 if bf16 else 1e-3)
    if args.mode == "auto":
        if int(os.environ.get("PARALLELISM_CONFIG_CP_SIZE", "1")) > 1:
            args.mode = "cp"
        elif int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1")) > 1:
            args.mode = "sp"
        else:
            parser.error(
                "--mode auto needs a launch config with a parallelism_config (recipes/accelerate/cp.yaml or ulysses.yaml)"
            )
    return args


SPY = OpSpy()  # the op's calls: the slice, the head weight, num_items_in_batch, the valid targets


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.shape == "tiny":
        dims = tiny(vocab_size=512)
        dims.pop("num_hidden_layers")  # --layers
        if args.arch == "gemma3":
            dims["head_dim"] = 16
    else:
        dims = dict(SHAPES[args.arch])
        if args.mode == "cp" and args.dtype == "fp32":
            # torch's ring attention shards the flash / memory-efficient SDPA kernels only, and neither takes fp32
            # with grouped KV heads (SDPA falls back to its math path, which context parallelism cannot shard)
            dims["num_key_value_heads"] = dims["num_attention_heads"]
    common = dict(
        num_hidden_layers=args.layers, max_position_embeddings=max(args.seq_len, 128), use_cache=False, **dims
    )
    if args.arch == "gemma3":
        # Every layer global: torch's ring attention takes a causal mask only (is_causal), no sliding window
        config = AutoConfig.for_model(
            "gemma3_text",
            final_logit_softcapping=30.0,
            layer_types=["full_attention"] * args.layers,
            tie_word_embeddings=True,
            **common,
        )
    else:
        config = AutoConfig.for_model("llama", tie_word_embeddings=False, **common)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # the token's own logit of a few units: the softcap bends it
        model.get_output_embeddings().weight.normal_(std=0.02 if args.shape == "full" else 0.1)
    model.train()
    return model


def rank0_positions(args: argparse.Namespace, world: int) -> torch.Tensor:
    """The positions rank 0 holds: Ulysses' first chunk; context parallelism's chunks 0 and 2N-1 (torch's
    load-balanced order for causal attention)."""
    if args.mode == "sp":
        return torch.arange(args.seq_len).chunk(world)[0]
    chunks = torch.arange(args.seq_len).chunk(2 * world)
    return torch.cat([chunks[0], chunks[-1]])


def make_dataset(args: argparse.Namespace, vocab: int, world: int) -> list[dict[str, torch.Tensor]]:
    """The sequences in training order: step s's micro-batch m is rows [(s * GA + m) * B, ...)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    empty = rank0_positions(args, world) + 1  # the labels rank 0's positions score (shift_labels[t] = labels[t+1])
    empty = empty[empty < args.seq_len]
    rows = []
    for step in range(args.steps):
        shared = torch.randint(0, args.seq_len // 2, (args.batch,), generator=gen)
        for _ in range(args.grad_accum):
            prefix = shared if args.mode == "sp" else torch.randint(0, args.seq_len // 2, (args.batch,), generator=gen)
            for row in range(args.batch):
                ids = torch.randint(0, vocab, (args.seq_len,), generator=gen)
                labels = ids.clone()
                labels[: int(prefix[row])] = IGNORE
                if step == 1:
                    labels[empty] = IGNORE
                rows.append({"input_ids": ids, "labels": labels, "position_ids": torch.arange(args.seq_len)})
    if args.mode == "sp":
        # Under Ulysses every rank draws its own rows (the loader is sharded over all ranks, the last partial round
        # dropped) and the ranks then train them in turn: with fewer rows than a multiple of the world size the
        # loader would start over before the last steps. Rows past the steps' are never trained.
        while len(rows) % world:
            rows.append({key: value.clone() for key, value in rows[-1].items()})
    return rows


def micro_batches(
    dataset: list[dict[str, torch.Tensor]], args: argparse.Namespace
) -> list[list[dict[str, torch.Tensor]]]:
    """Per step, its micro-batches (stacked)."""
    steps = []
    for step in range(args.steps):
        batches = []
        for micro in range(args.grad_accum):
            start = (step * args.grad_accum + micro) * args.batch
            rows = dataset[start : start + args.batch]
            batches.append({key: torch.stack([row[key] for row in rows]) for key in rows[0]})
        steps.append(batches)
    return steps


def n_items(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def label_checksum(batch: dict[str, torch.Tensor]) -> int:
    """The sum of the shifted labels (ignored ones as 0): what the ranks' slices of ``shift_labels`` add up to."""
    return int(batch["labels"][:, 1:].clamp(min=0).sum())


def run_reference(base, dataset, args, device, patched: bool) -> dict[str, Any]:
    """One process on the whole sequences, as the one-process Trainer trains: SGD, the loss over each step's
    micro-batches normalized by their valid shifted labels."""
    model = copy.deepcopy(base).to(device)
    if patched:
        apply_fused_lce(model, backend=args.backend)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    losses = []
    SPY.take()
    for batches in micro_batches(dataset, args):
        total = torch.tensor(sum(n_items(b) for b in batches), device=device)
        step_loss = 0.0
        for batch in batches:
            with autocast:
                out = model(**{k: v.to(device) for k, v in batch.items()}, num_items_in_batch=total, use_cache=False)
            out.loss.backward()
            step_loss += float(out.loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
    state = state_on_cpu(model)
    calls = len(SPY.take())
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"losses": losses, "state": state, "calls": calls}


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def _collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def run_trainer(base, dataset, args, world: int) -> dict[str, Any]:
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lce_patch.integrations.trainer import FusedLCECallback

    if args.mode == "cp":
        parallelism = ParallelismConfig(cp_size=world)
    else:
        parallelism = ParallelismConfig(sp_size=world, sp_backend="deepspeed")
    logged: list[float] = []

    class LossLog(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append(float(logs["loss"]))

    out_dir = tempfile.mkdtemp(prefix="cp_check_")
    training_args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        logging_nan_inf_filter=False,
        save_strategy="no",
        report_to=[],
        bf16=args.dtype == "bf16",
        gradient_checkpointing=args.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None,
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
        dataloader_drop_last=True,
        seed=args.seed,
        parallelism_config=parallelism,
        # DeepSpeed on CPU processes (DS_ACCELERATOR=cpu): accelerate picks no backend for it (one process); gloo
        ddp_backend="gloo" if args.cpu else None,
    )
    callbacks: list[TrainerCallback] = [LossLog()]
    if not args.unpatched:
        callbacks.append(FusedLCECallback(backend=args.backend))
    trainer = Trainer(
        model=base, args=training_args, train_dataset=_ListDataset(dataset), data_collator=_collate, callbacks=callbacks
    )
    SPY.take()
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)  # nothing is saved there (save_strategy "no")
    accelerator = trainer.accelerator
    state = full_state_dict(accelerator, trainer.model_wrapped)
    mine = {
        "rank": torch.distributed.get_rank(),
        "calls": SPY.take(),
        "patched": bool(lce_patch.models.is_patched(accelerator.unwrap_model(trainer.model_wrapped))),
        "model_class": type(trainer.model_wrapped).__name__,
    }
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    return {"losses": logged, "state": state, "ranks": gathered, "mode": mode_of(accelerator), "trainer": trainer}


def main(argv: list[str] | None = None) -> int:
    start()
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("cp_check: no CUDA device; pass --cpu (Ulysses only) to run on CPU processes")
    if args.cpu and args.mode == "cp":
        raise SystemExit(
            "cp_check: context parallelism needs CUDA (torch's ring attention runs on the CUDA SDPA kernels, and "
            "accelerate enables FSDP on accelerators only); use --mode sp on CPU processes"
        )
    place = ranks(cpu=args.cpu)
    world, rank, device = place.world, place.rank, place.device
    if world < 2:
        raise SystemExit("cp_check: launch it on 2+ processes (accelerate launch --config_file recipes/accelerate/...)")
    if args.seq_len % (2 * world):
        raise SystemExit(f"cp_check: --seq-len {args.seq_len} must be divisible by 2 x {world} processes")
    if args.cpu:
        torch.set_num_threads(1)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    label = "unpatched" if args.unpatched else "patched"
    report = Report("cp_check", args, f"cp_check_{args.mode}_{args.arch}_{label}_w{world}", args.out, rank=rank)
    SPY.install()
    base = build_model(args)  # before TrainingArguments: a ZeRO-3 config would partition it at construction
    dataset = make_dataset(args, base.config.vocab_size, world)
    ref = ref_fused = init_state = None
    with report.phase("reference"):
        if rank == 0:
            init_state = state_on_cpu(base)
            ref = run_reference(base, dataset, args, device, patched=False)
            ref_fused = run_reference(base, dataset, args, device, patched=True)
            report.data["reference_losses"] = {"ref": ref["losses"], "ref_fused": ref_fused["losses"]}
    with report.phase("trainer"):
        dist = run_trainer(base, dataset, args, world)
        report.data.update(mode=dist.pop("mode"), ranks=dist["ranks"], trainer_losses=dist["losses"])
    trainer = dist.pop("trainer")
    with report.phase("compare"):
        if rank == 0:
            judge(report, args, dist, ref, ref_fused, init_state, dataset, base.config, world)
    mode = report.data.get("mode", {})
    title = [
        f"cp_check  mode={args.mode} ({mode.get('mode')})  world_size={world}  arch={args.arch} shape={args.shape} "
        f"layers={args.layers} dtype={args.dtype}  {label}  seq {args.seq_len} (slice {args.seq_len // world})  "
        f"batch {args.batch} x grad_accum {args.grad_accum}  device={device}",
        f"{'step':>4} {'N':>7} {'ref':>12} {'ref_fused':>12} {'trainer':>12} {'rel err':>9} {'vs fused':>9}",
    ]
    table = [
        f"{r['step']:>4} {r['n_items']:>7} {r['ref']:>12.6f} {r['ref_fused']:>12.6f} {r['dist']:>12.6f} "
        f"{r['rel_err']:>9.2e} {r['rel_err_vs_ref_fused']:>9.2e}"
        for r in report.data.get("losses", [])
    ]
    ok = agree(report.finish(title, table, f"{args.mode} {args.arch} {label} world_size={world}"))
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return 0 if ok else 1


def judge(report: Report, args, dist, ref, ref_fused, init_state, dataset, config, world: int) -> None:
    """The verdicts (rank 0): the op's calls and targets on every rank, the logged losses, the parameters."""
    check = report.check
    vocab, hidden = config.vocab_size, config.hidden_size
    slice_len = args.seq_len // world
    expected_calls = 0 if args.unpatched else args.steps * args.grad_accum
    steps = micro_batches(dataset, args)
    step_items = [sum(n_items(b) for b in batches) for batches in steps]
    for info in dist["ranks"]:
        calls = info["calls"]
        shapes = sorted({tuple(c["hidden_shape"]) for c in calls})
        weights = sorted({tuple(c["weight"]["shape"]) for c in calls})
        check(
            f"rank{info['rank']} op calls",
            len(calls) == expected_calls
            and all(
                c["hidden_shape"][-2] == slice_len and c["weight"]["local_shape"] == [vocab, hidden] for c in calls
            ),
            f"{len(calls)} calls for {expected_calls} micro-batches; hidden {shapes} (slice {slice_len}); weight "
            f"{weights}",
        )
        if args.mode == "cp" and calls:
            given = [c["num_items_in_batch"] for c in calls]
            wanted = [float(n) for n in step_items for _ in range(args.grad_accum)]
            note = ""
            if args.dtype == "bf16":
                # transformers' Trainer divides the count by the context-parallel size (a float tensor), and
                # FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) casts float forward inputs to bf16:
                # the model (patched or not) gets the count rounded to 8 significant bits.
                wanted = torch.tensor(wanted).bfloat16().float().tolist()
                note = " (rounded to bfloat16 by FSDP2's forward-input cast, as every model gets it)"
            check(
                f"rank{info['rank']} num_items_in_batch",
                given == wanted,
                f"given {given}, the steps' valid shifted labels {wanted}{note}",
            )
        check(f"rank{info['rank']} is_patched", info["patched"] != args.unpatched, f"patched={info['patched']}")

    if not args.unpatched:
        # Every valid shifted label scored once: the ranks' valid targets add up to each micro-batch's count,
        # and the op was given them pre-shifted (shift=False), as the Trainer built them.
        targets = [[c["targets"] for c in info["calls"]] for info in dist["ranks"]]
        per_micro = [n_items(b) for batches in steps for b in batches]
        complete = all(len(mine) == len(per_micro) for mine in targets)
        summed = [sum(mine[i]["valid"] for mine in targets) for i in range(len(per_micro))] if complete else []
        shifted = any(t["shift"] for mine in targets for t in mine)
        check(
            "labels across slices",
            summed == per_micro and not shifted,
            f"valid targets summed over ranks {summed}, micro-batches' valid shifted labels {per_micro}; "
            f"shifted again inside a slice: {shifted}",
        )
        # Each micro-batch trained the row the reference trained (not a repeat of an earlier one)
        sums = [label_checksum(b) for batches in steps for b in batches]
        got = [sum(mine[i]["checksum"] for mine in targets) for i in range(len(sums))] if complete else []
        trained = [sums.index(g) if g in sums else None for g in got]
        check(
            "micro-batches in order",
            trained == list(range(len(sums))),
            f"micro-batch i trained the reference's micro-batch {trained}",
        )
        empty = [info["rank"] for info, mine in zip(dist["ranks"], targets) if any(t["valid"] == 0 for t in mine)]
        check("a rank with no valid label", bool(empty), f"ranks holding none in some micro-batch: {empty}")

    loss_rows = []
    for s in range(args.steps):
        got = dist["losses"][s] if s < len(dist["losses"]) else float("nan")
        loss_rows.append(
            {
                "step": s,
                "n_items": step_items[s],
                "ref": ref["losses"][s],
                "ref_fused": ref_fused["losses"][s],
                "dist": got,
                "rel_err": rel_err(got, ref["losses"][s]),
                "rel_err_vs_ref_fused": rel_err(got, ref_fused["losses"][s]),
            }
        )
    report.data["losses"] = loss_rows
    check("logged losses", len(dist["losses"]) == args.steps, f"{len(dist['losses'])} logged for {args.steps}")
    for against, key in (("ref", "rel_err"), ("ref_fused", "rel_err_vs_ref_fused")):
        worst = max(r[key] for r in loss_rows)
        check(f"loss vs {against}", worst <= args.rtol_loss, f"worst per-step rel err {worst:.2e}")
    report.data["params"] = {}
    for against, reference in (("ref", ref), ("ref_fused", ref_fused)):
        rows, missing = compare_params(dist["state"], reference["state"], init_state)
        report.data["params"][against] = rows
        check(f"parameters gathered vs {against}", bool(rows) and not missing, f"{len(rows)}, missing {missing}")
        if rows:
            failing, detail = update_failures(rows, args.rtol_update)
            if args.dtype == "bf16":
                detail += " (reported, not checked at bf16: --dtype fp32 checks the updates)"
            check(f"updates (gradients) vs {against}", args.dtype == "bf16" or not failing, detail)


if __name__ == "__main__":
    sys.exit(main())
