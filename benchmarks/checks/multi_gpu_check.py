"""Multi-GPU check: the patched model under DDP / FSDP1 / FSDP2 trains exactly like one process.

Run through accelerate on two GPUs (from the repository root; keep NVLink multicast off on shared hosts):

    NCCL_NVLS_ENABLE=0 accelerate launch --config_file recipes/accelerate/ddp.yaml \\
        benchmarks/checks/multi_gpu_check.py [--arch llama|gemma2] [--steps 3]
    (likewise recipes/accelerate/fsdp2.yaml and recipes/accelerate/fsdp1.yaml)

``--compile inductor`` runs the prepared (wrapped) patched model under torch.compile (graphs and graph breaks
are recorded; the check's own op counter reads a norm on the host, a break of its own). Or on CPU through
gloo, to debug:  accelerate launch --cpu --num_processes 2 benchmarks/checks/multi_gpu_check.py,
or as one plain process (``python benchmarks/checks/multi_gpu_check.py``): then it only compares the patched model
with the unpatched one, single-process.

What it does, on every rank with the same seed:
  1. builds a small fp32 model from a config (``--arch llama``: Llama with tied embeddings, the hard case
     for FSDP since the head weight is the embedding; ``--arch gemma2``: tied, final_logit_softcapping=30),
     and a fixed global batch per step (``--batch`` sequences x ``--seq-len`` tokens, a random prefix of each
     row ignored (-100); at step 2 every row of the last rank is ignored, so one rank holds no label at all);
  2. REFERENCE (rank 0, before accelerate sees the model): a deep copy, unpatched, on the whole global batch
     in one process, ``--steps`` steps of plain SGD (no momentum, so equal parameters mean equal gradients);
     on more than one process also a patched deep copy the same way ("ref_fused", which separates errors
     of the distribution from the op's own error against Hugging Face's loss);
  3. DISTRIBUTED: ``apply_fused_lce(model)``, ``accelerator.prepare(model, optimizer)``, each rank takes its
     own rows of the same global batch, same steps; then the full parameters are gathered
     (``get_model_state_dict(..., full_state_dict=True)``) and compared with the reference.

Loss scaling (why the distributed update equals the single-process one). With N = the number of
non-ignored *shifted* labels of the whole global batch (``(labels[:, 1:] != -100).sum()``, what
Hugging Face's ``ForCausalLMLoss`` counts) and S_r the sum of token losses on rank r's rows:
  * reference: ``loss = model(..., num_items_in_batch=N).loss = sum_r S_r / N``;
  * each of the W ranks: ``loss_r = model(..., num_items_in_batch=N).loss = S_r / N`` (the *global* N),
    and it back-propagates ``W * loss_r``. DDP and FSDP average the gradients over the ranks, so the
    step uses ``(1/W) sum_r W grad(S_r) / N = grad(sum_r S_r) / N``: the reference gradient. This is what
    the transformers Trainer does with ``average_tokens_across_devices`` (gathered num_items_in_batch,
    loss times the number of processes).
  * the global loss reported for a step is ``sum_r loss_r`` (an all-reduce of the local losses).
Per-rank means (num_items_in_batch=None) would weight the ranks' tokens unequally; the uneven masks
here make that show.

Checks (all must hold for PASS):
  * the op ran: lce_patch's ``fused_linear_cross_entropy`` (the name ``lce_patch.models.forward`` calls,
    wrapped here to count) was called once per step on every rank, with the full ``[V, D]`` head weight as a
    plain tensor (FSDP gathered it; not a shard, not a DTensor) whose norm equals the reference head's at
    that step; ``outputs.logits`` is None in training; ``is_patched`` holds after ``prepare``;
  * per-step global loss vs the reference: relative error <= ``--rtol-loss``;
  * every parameter after the steps, per tensor: relative L2 error <= ``--rtol-param``, and the relative
    L2 error of the update (final - initial, i.e. lr x the summed gradients) <= ``--rtol-update``; the
    worst tensor and the head / embedding rows are printed. (The update check is the gradient check; its
    floor is the fp32 rounding of the parameters themselves, ~1e-5 relative for q/k projections whose
    updates are small next to their weights, hence the looser default.)
  * on 2+ processes the losses and parameters are checked both against the unpatched reference and
    against ref_fused. Failing only the former points at the op's accuracy (benchmarks/checks/gpu_check.py),
    failing the latter at the distribution.

Rank 0 prints a PASS/FAIL table and writes JSON to ``--out`` (a directory, default ``$OUT`` if set else
runs/multi_gpu; or a path ending in .json). Exit status 1 on FAIL (on every rank).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from typing import Any

import torch
from harness import (  # the checks' shared harness, next to this file (it puts the checkout first on sys.path)
    OpSpy,
    Report,
    add_op_args,
    add_out_arg,
    add_tolerance_args,
    agree,
    check_launch,
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

from lce_patch import apply_fused_lce
from lce_patch.models import is_patched

IGNORE = -100


# ------------------------------------------------------------------------------------------------ setup
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = check_parser(
        "Check that the lce_patch-patched model trains the same under DDP / FSDP1 / FSDP2 (accelerate launch) as in "
        "one process: losses, gradients (via SGD parameters), head weight gathering.",
        "NCCL_NVLS_ENABLE=0 accelerate launch --config_file recipes/accelerate/fsdp2.yaml "
        "benchmarks/checks/multi_gpu_check.py --arch gemma2",
    )
    parser.add_argument("--arch", choices=("llama", "gemma2"), default="llama", help="model family (both tied)")
    parser.add_argument("--steps", type=int, default=3, help="SGD steps")
    parser.add_argument("--batch", type=int, default=4, help="global batch: sequences per step (split over ranks)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate (no momentum)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    parser.add_argument(
        "--head-std",
        type=float,
        default=None,
        help="std of the (tied) head/embedding init (default: 0.02 llama, 0.1 gemma2: the token's own logit "
        "is about hidden * std, ~5 and ~26, so gemma2's softcap of 30 bends it)",
    )
    add_op_args(parser)
    parser.add_argument("--no-empty-shard", action="store_true", help="do not ignore all of the last rank's rows")
    add_tolerance_args(parser)
    parser.add_argument(
        "--cpu-fsdp",
        action="store_true",
        help="debug on a CPU machine: take accelerate's FSDP path on gloo with the FSDP settings of the launch config "
        "(ACCELERATE_USE_CPU=true accelerate launch --config_file recipes/accelerate/fsdp2.yaml ... --cpu-fsdp); "
        "accelerate itself silently falls back to DDP on CPU",
    )
    parser.add_argument(
        "--inject",
        choices=("none", "local-mean", "no-world-scale"),
        default="none",
        help="negative control, must FAIL on 2+ processes: local-mean = each rank's own token mean "
        "(num_items_in_batch=None); no-world-scale = backward of the local loss without the x world_size",
    )
    parser.add_argument(
        "--compile",
        default="none",
        help="torch.compile the prepared (wrapped) patched model with this backend (inductor on GPUs; aot_eager "
        "to debug on CPU); none: eager",
    )
    add_out_arg(parser, "multi_gpu")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq_len < 2:
        parser.error("--steps and --batch must be >= 1, --seq-len >= 2")
    if args.head_std is None:
        args.head_std = 0.1 if args.arch == "gemma2" else 0.02
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(args.seq_len, 64),
        tie_word_embeddings=True,
        use_cache=False,
    )
    if args.arch == "gemma2":
        config = AutoConfig.for_model(
            "gemma2",
            head_dim=args.hidden // 4,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            sliding_window=max(args.seq_len // 4, 2),
            **common,
        )
    else:
        config = AutoConfig.for_model("llama", **common)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():  # tied: the token's own logit ~ hidden * std (large enough for the softcap to matter)
        model.get_output_embeddings().weight.normal_(std=args.head_std)
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError("expected tied input/output embeddings")
    model.train()
    return model


def make_batches(args: argparse.Namespace, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(input_ids, labels, N) per step on the CPU; N counts the non-ignored shifted labels of the global batch."""
    generator = torch.Generator().manual_seed(args.seed + 1)
    batches = []
    per_rank = args.batch // world_size
    for step in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator)
        labels = ids.clone()
        prefix = torch.randint(0, 3 * args.seq_len // 4, (args.batch,), generator=generator)
        for row in range(args.batch):
            labels[row, : int(prefix[row])] = IGNORE
        if step == 1 and world_size > 1 and not args.no_empty_shard:
            labels[(world_size - 1) * per_rank :] = IGNORE  # the last rank holds no label this step
        n_items = int((labels[:, 1:] != IGNORE).sum())
        batches.append((ids, labels, n_items))
    return batches


SPY = OpSpy(labels_at=None)  # the op's calls: what head weight each got


# ---------------------------------------------------------------------------------------- reference
def run_reference(base, batches, args, device, patched: bool) -> dict[str, Any]:
    """One process, whole global batch, SGD: per-step losses, head norms, final state dict (CPU)."""
    model = copy.deepcopy(base).to(device)
    if patched:
        apply_fused_lce(model, backend=args.backend, chunk_size=args.chunk_size)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0)
    losses, head_norms, logits_none = [], [], []
    SPY.take()
    for ids, labels, n_items in batches:
        head_norms.append(float(model.get_output_embeddings().weight.detach().double().norm()))
        out = model(
            input_ids=ids.to(device),
            labels=labels.to(device),
            num_items_in_batch=torch.tensor(n_items, device=device),
            use_cache=False,
        )
        logits_none.append(out.logits is None)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
    state = state_on_cpu(model)
    calls = SPY.take()
    del model, optimizer
    return {"losses": losses, "head_norms": head_norms, "state": state, "calls": calls, "logits_none": logits_none}


# -------------------------------------------------------------------------------------- distributed
def force_cpu_fsdp(accelerator) -> None:
    """Debug: make a MULTI_CPU (gloo) accelerator take its FSDP path, with the launch config's FSDP plugin.

    accelerate enables FSDP only on accelerators; its launcher still exports the config's FSDP_* settings,
    from which the plugin is built here as accelerate would (sync_module_states off: accelerate needs an
    accelerator device for it, and every rank builds the same weights anyway).
    """
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        raise SystemExit(
            "--cpu-fsdp needs a multi-process CPU run: ACCELERATE_USE_CPU=true accelerate launch --config_file "
            f"recipes/accelerate/fsdp2.yaml ... (got {accelerator.distributed_type})"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        raise SystemExit("--cpu-fsdp needs an FSDP launch config (recipes/accelerate/fsdp1.yaml or fsdp2.yaml)")
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* environment, FSDP_SYNC_MODULE_STATES=false
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    if plugin.fsdp_version == 1:
        # accelerate hands FSDP1 device_id=cpu:0, which FSDP1 finds inconsistent with its compute device "cpu".
        accelerator.state.device = torch.device("cpu")


def local_numel(model: torch.nn.Module) -> int:
    """Parameter elements this rank holds between steps (a shard under FSDP and ZeRO-3, everything under DDP)."""
    total = 0
    for param in model.parameters():
        to_local = getattr(param, "to_local", None)  # FSDP2: DTensor shards
        if hasattr(param, "ds_tensor"):  # ZeRO-3: the rank's partition
            total += param.ds_tensor.numel()
        else:
            total += to_local().numel() if callable(to_local) else param.numel()
    return total


def run_distributed(accelerator, base, batches, args) -> dict[str, Any]:
    device = accelerator.device
    world, rank = accelerator.num_processes, accelerator.process_index
    model = base
    apply_fused_lce(model, backend=args.backend, chunk_size=args.chunk_size)
    model.to(device)
    full_numel = sum(p.numel() for p in model.parameters())
    if mode_of(accelerator)["mode"] == "FSDP1":
        # FSDP1 (use_orig_params=False) replaces the parameters by flat ones and accelerate does not remap an
        # optimizer built before: build it on the wrapped model (as accelerate's FSDP1 docs ask).
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0))
    else:  # FSDP2 and DeepSpeed need both in one call (the optimizer is remapped onto the sharded parameters)
        if mode_of(accelerator)["mode"].startswith("ZeRO"):
            config = accelerator.state.deepspeed_plugin.deepspeed_config
            config["train_micro_batch_size_per_gpu"] = args.batch // world  # no dataloader to infer it from
            config["zero_allow_untested_optimizer"] = True  # plain SGD, so parameters compare as gradients
            config["gradient_clipping"] = 0.0  # accelerate's default clips at 1.0; the reference does not
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0)
        model, optimizer = accelerator.prepare(model, optimizer)
    local_fraction = local_numel(model) / full_numel
    patched_after_prepare = bool(is_patched(accelerator.unwrap_model(model)))
    per_rank = args.batch // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    # Compiled: the wrapped model's forward (FSDP2's hooks, the patched forward, the head) under torch.compile;
    # the state is still read from the model itself.
    forward = model if args.compile == "none" else torch.compile(model, backend=args.compile)
    SPY.take()
    losses, local_losses, logits_none = [], [], []
    for ids, labels, n_items in batches:
        out = forward(
            input_ids=ids[rows].to(device),
            labels=labels[rows].to(device),
            # the global count, as Trainer gathers it
            num_items_in_batch=None if args.inject == "local-mean" else torch.tensor(n_items, device=device),
            use_cache=False,
        )
        logits_none.append(out.logits is None)
        loss = out.loss
        scale = world if args.inject == "none" else 1
        accelerator.backward(loss * scale)  # DDP/FSDP average over ranks: see the module docstring
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        local = loss.detach().reshape(1).float()
        local_losses.append(float(local))
        reduction = "mean" if args.inject == "local-mean" else "sum"
        losses.append(float(accelerator.reduce(local.clone(), reduction=reduction)))
    state = full_state_dict(accelerator, model)
    # What every rank saw, on rank 0.
    mine = {
        "rank": rank,
        "calls": SPY.take(),
        "logits_none": logits_none,
        "local_losses": local_losses,
        "patched_after_prepare": patched_after_prepare,
        "local_param_fraction": local_fraction,
        "model_class": type(model).__name__,
        "inner_class": type(accelerator.unwrap_model(model)).__name__,
        "lm_head_class": type(accelerator.unwrap_model(model).get_output_embeddings()).__name__,
    }
    if args.compile != "none":  # what dynamo made of it: graphs compiled, and why it broke them
        from torch._dynamo.utils import counters

        mine["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
        mine["graph_breaks"] = {str(reason)[:200]: int(n) for reason, n in counters["graph_break"].items()}
    gathered = [mine]
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, mine)
    return {"losses": losses, "state": state, "ranks": gathered}


def main(argv: list[str] | None = None) -> int:
    start()
    args = parse_args(argv)
    set_exact_fp32()
    from accelerate import Accelerator

    if args.cpu_fsdp:  # accelerate's FSDP plugin needs an accelerator device for sync_module_states
        os.environ["FSDP_SYNC_MODULE_STATES"] = "false"
    # Built before the Accelerator: under ZeRO-3 its DeepSpeed config would make transformers partition the
    # weights at construction (zero.Init), and the single-process reference needs them whole.
    base = build_model(args)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not torch.cuda.is_available():
        # DeepSpeed on a CPU machine (DS_ACCELERATOR=cpu, to debug): accelerate picks no backend for it and
        # would run one process; gloo it is.
        from accelerate import PartialState

        PartialState(backend="gloo")
    accelerator = Accelerator()
    if args.cpu_fsdp:
        force_cpu_fsdp(accelerator)
    problem = check_launch(accelerator)
    if problem:
        print(f"FAIL multi_gpu_check: {problem}", file=sys.stderr, flush=True)
        return 2
    if accelerator.device.type == "cuda":  # the host-side work gets this process's share of the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // accelerator.num_processes))
    world = accelerator.num_processes
    main_process = accelerator.is_main_process
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the number of processes {world}")
    mode = mode_of(accelerator)
    device = accelerator.device
    suffix = ("" if args.inject == "none" else f"_{args.inject}") + (
        "" if args.compile == "none" else f"_compile-{args.compile}"
    )
    report = Report(
        "multi_gpu_check",
        args,
        f"multi_gpu_check_{mode['mode'].lower()}_{args.arch}{suffix}",
        args.out,
        rank=accelerator.process_index,
    )
    report.data["mode"] = mode
    SPY.install()

    batches = make_batches(args, world)
    ref = ref_fused = init_state = None
    with report.phase("reference"):
        if main_process:
            init_state = state_on_cpu(base)
            ref = run_reference(base, batches, args, device, patched=False)
            ref_fused = run_reference(base, batches, args, device, patched=True) if world > 1 else None
            report.data["reference_losses"] = ref["losses"]
        accelerator.wait_for_everyone()
    with report.phase("distributed"):
        dist = run_distributed(accelerator, base, batches, args)
        report.data.update(ranks=dist["ranks"], distributed_losses=dist["losses"])
    with report.phase("compare"):
        if main_process:
            judge(report, args, dist, ref, ref_fused, init_state, batches, mode, world)
    ok = report.finish(*describe_run(report, args, dist, ref_fused, mode, world))
    ok = agree(ok) if world > 1 else ok
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0 if ok else 1


def judge(report: Report, args, dist, ref, ref_fused, init_state, batches, mode, world) -> None:
    """The verdicts (rank 0): the op's calls on every rank, the losses, the parameters."""
    check = report.check
    vocab, hidden = args.vocab, args.hidden
    # The op ran on every rank, once per step, with the full gathered head weight.
    for info in dist["ranks"]:
        r = info["rank"]
        weights = [c["weight"] for c in info["calls"]]
        whole = all(w["shape"] == w["local_shape"] == [vocab, hidden] and not w["is_dtensor"] for w in weights)
        check(
            f"rank{r} op calls",
            len(weights) == args.steps and whole,
            f"{len(weights)} calls for {args.steps} steps; head weight {sorted({tuple(w['shape']) for w in weights})}"
            f" local {sorted({tuple(w['local_shape']) for w in weights})} types {sorted({w['type'] for w in weights})}",
        )
        errs = [rel_err(w["norm"], ref["head_norms"][s]) for s, w in enumerate(weights) if s < len(ref["head_norms"])]
        worst_norm = max(errs, default=math.inf)
        check(
            f"rank{r} head weight gathered",
            worst_norm <= args.rtol_param,
            f"norm of the weight inside lm_head's call vs the reference head, worst rel err {worst_norm:.2e}",
        )
        check(f"rank{r} logits None", all(info["logits_none"]), f"outputs.logits is None: {info['logits_none']}")
        check(f"rank{r} is_patched", info["patched_after_prepare"], f"after prepare ({info['model_class']})")
        if args.compile != "none":
            breaks = info["graph_breaks"]
            check(
                f"rank{r} compiled",
                info["compiled_graphs"] >= 1,
                f"{info['compiled_graphs']} graphs, {sum(breaks.values())} graph breaks: {sorted(breaks)[:4]}",
            )
        if mode["mode"].startswith("FSDP"):
            fraction = info["local_param_fraction"]
            check(f"rank{r} sharded", fraction <= 1.5 / world, f"holds {fraction:.3f} of the parameter elements")
    if ref_fused is not None:
        check("ref_fused op calls", len(ref_fused["calls"]) == args.steps, f"{len(ref_fused['calls'])} calls")

    loss_rows = []
    for s in range(args.steps):
        row = {
            "step": s,
            "n_items": batches[s][2],
            "ref": ref["losses"][s],
            "dist": dist["losses"][s],
            "rel_err": rel_err(dist["losses"][s], ref["losses"][s]),
            "local": [info["local_losses"][s] for info in dist["ranks"]],
        }
        if ref_fused is not None:
            row["ref_fused"] = ref_fused["losses"][s]
            row["rel_err_vs_ref_fused"] = rel_err(dist["losses"][s], ref_fused["losses"][s])
        loss_rows.append(row)
    worst_loss = max(r["rel_err"] for r in loss_rows)
    check("loss vs reference", worst_loss <= args.rtol_loss, f"worst per-step rel err {worst_loss:.2e}")
    params, missing = compare_params(dist["state"], ref["state"], init_state)
    check("all parameters gathered", not missing and params, f"{len(params)} compared, missing {missing}")
    check_worst(report, "reference", params, args)
    params_fused: list[dict[str, Any]] = []
    if ref_fused is not None:
        # The same op in one process: isolates the distribution (gathering, all-reduce, loss scaling)
        # from the op's own error against Hugging Face's loss.
        worst_lf = max(r["rel_err_vs_ref_fused"] for r in loss_rows)
        check("loss vs ref_fused", worst_lf <= args.rtol_loss, f"worst per-step rel err {worst_lf:.2e}")
        params_fused, _ = compare_params(dist["state"], ref_fused["state"], init_state)
        check_worst(report, "ref_fused", params_fused, args)
    report.data.update(
        losses=loss_rows,
        params=params,
        params_vs_ref_fused=params_fused,
        ref_calls=ref_fused["calls"] if ref_fused is not None else [],
    )


def check_worst(report: Report, against: str, rows: list[dict[str, Any]], args) -> None:
    """Worst parameter and worst update (the gradient check, no ulp allowance here) against one reference run."""
    if not rows:
        return
    worst_p = max(rows, key=lambda p: p["rel_l2"])
    worst_u = max(rows, key=lambda p: p["update_rel_l2"])
    report.check(
        f"parameters vs {against}",
        worst_p["rel_l2"] <= args.rtol_param,
        f"worst rel L2 {worst_p['rel_l2']:.2e} ({worst_p['name']})",
    )
    report.check(
        f"updates (gradients) vs {against}",
        worst_u["update_rel_l2"] <= args.rtol_update,
        f"worst rel L2 {worst_u['update_rel_l2']:.2e} ({worst_u['name']})",
    )


def describe_run(report: Report, args, dist, ref_fused, mode, world) -> tuple[list[str], list[str], str]:
    """The title, the loss and parameter table, and the verdict's label."""
    lead = dist["ranks"][0]
    title = [
        f"multi_gpu_check  arch={args.arch}  mode={mode['mode']}  world_size={world}  inject={args.inject}  "
        f"backend={mode.get('backend', '-')}  device={mode['device']}  lce_patch backend={args.backend}  "
        f"compile={args.compile}",
        f"model: {lead['model_class']} around {lead['inner_class']}, lm_head {lead['lm_head_class']}; V={args.vocab} "
        f"D={args.hidden} layers={args.layers}; batch {args.batch}x{args.seq_len} ({args.batch // world} rows/rank); "
        f"SGD lr={args.lr}",
    ]
    fused = ref_fused is not None
    table = [
        f"{'step':>4} {'N':>6} {'ref loss':>14} {'dist loss':>14} {'rel err':>9}"
        + (f" {'ref_fused':>14} {'rel err':>9}" if fused else "")
        + "  local losses"
    ]
    for r in report.data.get("losses", []):
        line = f"{r['step']:>4} {r['n_items']:>6} {r['ref']:>14.8f} {r['dist']:>14.8f} {r['rel_err']:>9.2e}"
        if fused:
            line += f" {r['ref_fused']:>14.8f} {r['rel_err_vs_ref_fused']:>9.2e}"
        table.append(line + "  " + " ".join(f"{x:.6f}" for x in r["local"]))
    table += param_table(report.data.get("params", []), report.data.get("params_vs_ref_fused", []), "ref_fused")
    label = f"{args.arch} {mode['mode']} world_size={world}" + (
        "" if args.compile == "none" else f" compile={args.compile}"
    )
    return title, table, label


if __name__ == "__main__":
    sys.exit(main())
