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
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # lce_patch from this checkout, not an installed copy
sys.path.insert(0, str(REPO / "benchmarks"))  # bench_common, in benchmarks/

from bench_common import rel_err, set_exact_fp32  # noqa: E402

import lce_patch  # noqa: E402
import lce_patch.models.forward as lce_forward  # noqa: E402
from lce_patch import apply_fused_lce  # noqa: E402
from lce_patch.models import is_patched  # noqa: E402

IGNORE = -100


# ------------------------------------------------------------------------------------------------ setup
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Check that the lce_patch-patched model trains the same under DDP / FSDP1 / FSDP2 "
        "(accelerate launch) as in one process: losses, gradients (via SGD parameters), head weight gathering.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Launch: NCCL_NVLS_ENABLE=0 accelerate launch --config_file recipes/accelerate/fsdp2.yaml "
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
    parser.add_argument("--backend", default="auto", help="lce_patch backend: auto, triton or torch")
    parser.add_argument("--chunk-size", type=int, default=None, help="lce_patch chunk size (default: its own)")
    parser.add_argument("--no-empty-shard", action="store_true", help="do not ignore all of the last rank's rows")
    parser.add_argument("--rtol-loss", type=float, default=1e-5, help="per-step loss, relative")
    parser.add_argument("--rtol-param", type=float, default=1e-5, help="parameters after the steps, relative L2")
    parser.add_argument(
        "--rtol-update",
        type=float,
        default=1e-3,
        help="parameter updates (final - initial), relative L2: the gradient check",
    )
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
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(REPO / "runs" / "multi_gpu"),
        help="directory for the JSON (or a .json path)",
    )
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


# ------------------------------------------------------------------------------------- the op's calls
CALLS: list[dict[str, Any]] = []


def install_call_counter() -> None:
    """Count (and describe) calls of the op through the name the patched forward resolves at call time."""
    original = lce_forward.fused_linear_cross_entropy
    if getattr(original, "_multi_gpu_check", False):
        return

    def counting(hidden, weight, labels, **kwargs):
        try:
            from torch.distributed.tensor import DTensor

            is_dtensor = isinstance(weight, DTensor)
        except ImportError:
            is_dtensor = False
        local = weight.to_local() if is_dtensor else weight
        CALLS.append(
            {
                "weight_shape": list(weight.shape),
                "weight_local_shape": list(local.shape),
                "weight_type": type(weight).__name__,
                "weight_is_dtensor": is_dtensor,
                "weight_norm": float(local.detach().double().norm()),
                "hidden_shape": list(hidden.shape),
                "softcap": kwargs.get("softcap"),
                "num_items_in_batch": None
                if kwargs.get("num_items_in_batch") is None
                else float(kwargs["num_items_in_batch"]),
            }
        )
        return original(hidden, weight, labels, **kwargs)

    counting._multi_gpu_check = True  # type: ignore[attr-defined]
    lce_forward.fused_linear_cross_entropy = counting


# ---------------------------------------------------------------------------------------- reference
def run_reference(base, batches, args, device, patched: bool) -> dict[str, Any]:
    """One process, whole global batch, SGD: per-step losses, head norms, final state dict (CPU)."""
    model = copy.deepcopy(base).to(device)
    if patched:
        apply_fused_lce(model, backend=args.backend, chunk_size=args.chunk_size)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0)
    losses, head_norms, logits_none = [], [], []
    CALLS.clear()
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
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    calls = list(CALLS)
    del model, optimizer
    return {"losses": losses, "head_norms": head_norms, "state": state, "calls": calls, "logits_none": logits_none}


# -------------------------------------------------------------------------------------- distributed
def mode_of(accelerator) -> dict[str, Any]:
    from accelerate.utils import DistributedType

    state = accelerator.state
    dtype = accelerator.distributed_type
    info: dict[str, Any] = {"distributed_type": str(dtype), "world_size": accelerator.num_processes}
    if dtype == DistributedType.FSDP:
        plugin = state.fsdp_plugin
        version = getattr(plugin, "fsdp_version", 1)
        info["mode"] = f"FSDP{version}"
        info["fsdp_version"] = version
        if version == 2:
            info["reshard_after_forward"] = str(getattr(plugin, "reshard_after_forward", None))
        else:
            info["sharding_strategy"] = str(getattr(plugin, "sharding_strategy", None))
            info["use_orig_params"] = getattr(plugin, "use_orig_params", None)
        info["auto_wrap_policy"] = str(getattr(plugin, "auto_wrap_policy", None))
    elif dtype == DistributedType.NO:
        info["mode"] = "single-process"
    elif dtype == DistributedType.DEEPSPEED:
        stage = state.deepspeed_plugin.zero_stage
        info["mode"] = f"ZeRO-{stage}"
        info["zero_stage"] = stage
    else:
        info["mode"] = "DDP"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        info["backend"] = torch.distributed.get_backend()
    info["device"] = str(accelerator.device)
    return info


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


def check_launch(accelerator) -> str | None:
    """Why this process's accelerator is not what the launch asked for (None when it is)."""
    from accelerate.utils import DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        return (
            f"launched with WORLD_SIZE={launched} but accelerate runs {accelerator.num_processes} process(es) "
            f"({accelerator.distributed_type}); on a CPU machine use ACCELERATE_USE_CPU=true"
        )
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and (
        accelerator.distributed_type != DistributedType.DEEPSPEED
    ):
        return f"the launch config asks for DeepSpeed but accelerate runs {accelerator.distributed_type}"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and (
        accelerator.distributed_type != DistributedType.FSDP
    ):
        return (
            f"the launch config asks for FSDP but accelerate runs {accelerator.distributed_type} (accelerate "
            "enables FSDP on accelerators only; on CPU add --cpu-fsdp to force it)"
        )
    return None


def full_state_dict(accelerator, model) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters on rank 0 (empty elsewhere), CPU."""
    if mode_of(accelerator)["mode"].startswith("ZeRO"):
        # ZeRO-3 gathers its partitions (stage3_gather_16bit_weights_on_model_save; fp32 here, no
        # mixed precision); ZeRO-2 keeps whole parameters on every rank.
        state = accelerator.get_state_dict(model)
    elif accelerator.num_processes > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload: rank 0 alone gets the full tensors (on CPU); FSDP1 on a CPU model segfaults with it (torch 2.13)
        offload = accelerator.device.type != "cpu"
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    else:
        state = accelerator.unwrap_model(model).state_dict()
    if not accelerator.is_main_process:
        return {}
    out = {}
    for name, value in state.items():
        if hasattr(value, "full_tensor"):  # a DTensor left in the dict
            value = value.full_tensor()
        out[name.removeprefix("module.").removeprefix("_orig_mod.")] = value.detach().to("cpu", copy=True)
    return out


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
    CALLS.clear()
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
        "calls": list(CALLS),
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


# ---------------------------------------------------------------------------------------- comparing
def _spacing(t: torch.Tensor) -> torch.Tensor:
    """The distance from each element to the next representable value away from zero, in ``t``'s dtype."""
    away = torch.where(t < 0, torch.full_like(t, -math.inf), torch.full_like(t, math.inf))
    return (torch.nextafter(t, away) - t).abs()


def compare_params(dist: dict, ref: dict, init: dict) -> tuple[list[dict[str, Any]], list[str]]:
    rows, missing = [], []
    for name, r in ref.items():
        if not torch.is_floating_point(r):
            continue
        d = dist.get(name)
        if d is None:
            missing.append(name)
            continue
        d, r64, i64 = d.double(), r.double(), init[name].double()
        diff = (d - r64).norm().item()
        upd_ref = (r64 - i64).norm().item()
        upd_err = ((d - i64) - (r64 - i64)).norm().item()
        rows.append(
            {
                "name": name,
                "shape": list(r.shape),
                "max_abs": (d - r64).abs().max().item(),
                "rel_l2": diff / max(r64.norm().item(), 1e-30),
                "update_norm": upd_ref,
                "update_rel_l2": upd_err / upd_ref if upd_ref > 0 else (0.0 if upd_err == 0 else math.inf),
                # the largest difference in units of the reference weight's own spacing (its dtype's ulp there)
                "max_ulps": ((d - r64).abs() / _spacing(r).double()).max().item() if r.numel() else 0.0,
            }
        )
    return rows, missing


def update_failures(rows: list[dict[str, Any]], rtol_update: float) -> tuple[list[dict[str, Any]], str]:
    """The rows of :func:`compare_params` whose update is off, and a one-line summary. A tensor passes when its
    update is within ``rtol_update`` (relative L2) or when its final weights are within two of the weights' own
    roundings of the reference's: an update too small for the weights to resolve (a norm weight of 1.0 moved by
    1e-7) has no third significant digit left to compare."""
    failing = [p for p in rows if p["update_rel_l2"] > rtol_update and p["max_ulps"] > 2]
    worst = max(rows, key=lambda p: p["update_rel_l2"])
    detail = (
        f"worst rel L2 {worst['update_rel_l2']:.2e} ({worst['name']}, {worst['max_ulps']:.1f} ulp); "
        f"{len(failing)} tensor(s) past {rtol_update:g} and 2 ulp"
    )
    if failing:
        detail += f", e.g. {failing[0]['name']} {failing[0]['update_rel_l2']:.2e} / {failing[0]['max_ulps']:.1f} ulp"
    return failing, detail


def main(argv: list[str] | None = None) -> int:
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
    world = accelerator.num_processes
    main_process = accelerator.is_main_process
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the number of processes {world}")
    mode = mode_of(accelerator)
    device = accelerator.device
    t0 = time.time()
    install_call_counter()

    batches = make_batches(args, world)
    ref = ref_fused = None
    init_state = None
    if main_process:
        init_state = {k: v.detach().to("cpu", copy=True) for k, v in base.state_dict().items()}
        ref = run_reference(base, batches, args, device, patched=False)
        if world > 1:
            ref_fused = run_reference(base, batches, args, device, patched=True)
        else:
            ref_fused = None
    accelerator.wait_for_everyone()
    t_ref = time.time() - t0
    dist = run_distributed(accelerator, base, batches, args)
    t_dist = time.time() - t0 - t_ref

    ok = True
    report: dict[str, Any] = {}
    if main_process:
        checks: list[dict[str, Any]] = []

        def check(name: str, passed: bool, detail: str) -> None:
            checks.append({"name": name, "ok": bool(passed), "detail": detail})

        vocab, hidden = args.vocab, args.hidden
        # The op ran on every rank, once per step, with the full gathered head weight.
        for info in dist["ranks"]:
            r = info["rank"]
            calls = info["calls"]
            shapes_ok = all(
                c["weight_shape"] == [vocab, hidden] and c["weight_local_shape"] == [vocab, hidden] for c in calls
            )
            plain = not any(c["weight_is_dtensor"] for c in calls)
            check(
                f"rank{r} op calls",
                len(calls) == args.steps and shapes_ok and plain,
                f"{len(calls)} calls for {args.steps} steps; head weight {sorted({tuple(c['weight_shape']) for c in calls})}"
                f" local {sorted({tuple(c['weight_local_shape']) for c in calls})}"
                f" types {sorted({c['weight_type'] for c in calls})}",
            )
            norm_errs = [
                rel_err(c["weight_norm"], ref["head_norms"][s])
                for s, c in enumerate(calls)
                if s < len(ref["head_norms"])
            ]
            worst_norm = max(norm_errs, default=math.inf)
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
            fraction = info["local_param_fraction"]
            if mode["mode"].startswith("FSDP"):
                check(
                    f"rank{r} sharded",
                    fraction <= 1.5 / world,
                    f"holds {fraction:.3f} of the parameter elements between steps",
                )
        if ref_fused is not None:
            check("ref_fused op calls", len(ref_fused["calls"]) == args.steps, f"{len(ref_fused['calls'])} calls")

        # Losses.
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

        # Parameters.
        params, missing = compare_params(dist["state"], ref["state"], init_state)
        check("all parameters gathered", not missing and params, f"{len(params)} compared, missing {missing}")

        def check_params(against: str, compared: list[dict[str, Any]]) -> None:
            """Worst parameter and worst update (the gradient check) against one reference run."""
            if not compared:
                return
            worst_p = max(compared, key=lambda p: p["rel_l2"])
            worst_u = max(compared, key=lambda p: p["update_rel_l2"])
            check(
                f"parameters vs {against}",
                worst_p["rel_l2"] <= args.rtol_param,
                f"worst rel L2 {worst_p['rel_l2']:.2e} ({worst_p['name']})",
            )
            check(
                f"updates (gradients) vs {against}",
                worst_u["update_rel_l2"] <= args.rtol_update,
                f"worst rel L2 {worst_u['update_rel_l2']:.2e} ({worst_u['name']})",
            )

        check_params("reference", params)
        params_fused: list[dict[str, Any]] = []
        if ref_fused is not None:
            # The same op in one process: isolates the distribution (gathering, all-reduce, loss scaling)
            # from the op's own error against Hugging Face's loss.
            worst_lf = max(r["rel_err_vs_ref_fused"] for r in loss_rows)
            check("loss vs ref_fused", worst_lf <= args.rtol_loss, f"worst per-step rel err {worst_lf:.2e}")
            params_fused, _ = compare_params(dist["state"], ref_fused["state"], init_state)
            check_params("ref_fused", params_fused)

        ok = all(c["ok"] for c in checks)
        # ------------------------------------------------------------------ the table
        print("=" * 100)
        print(
            f"multi_gpu_check  arch={args.arch}  mode={mode['mode']}  world_size={world}  inject={args.inject}  "
            f"backend={mode.get('backend', '-')}  device={mode['device']}  lce_patch backend={args.backend}  "
            f"compile={args.compile}"
        )
        print(
            f"model: {dist['ranks'][0]['model_class']} around {dist['ranks'][0]['inner_class']}, lm_head "
            f"{dist['ranks'][0]['lm_head_class']}; V={vocab} D={hidden} layers={args.layers}; "
            f"batch {args.batch}x{args.seq_len} ({args.batch // world} rows/rank); SGD lr={args.lr}"
        )
        print(
            f"{'step':>4} {'N':>6} {'ref loss':>14} {'dist loss':>14} {'rel err':>9}"
            + (f" {'ref_fused':>14} {'rel err':>9}" if ref_fused is not None else "")
            + "  local losses"
        )
        for r in loss_rows:
            line = f"{r['step']:>4} {r['n_items']:>6} {r['ref']:>14.8f} {r['dist']:>14.8f} {r['rel_err']:>9.2e}"
            if ref_fused is not None:
                line += f" {r['ref_fused']:>14.8f} {r['rel_err_vs_ref_fused']:>9.2e}"
            print(line + "  " + " ".join(f"{x:.6f}" for x in r["local"]))
        if params:
            print(
                f"{'parameter':<48} {'max abs':>9} {'rel L2':>9} {'upd rel L2':>10}"
                + (f" {'vs ref_fused':>12}" if params_fused else "")
            )
            fused_by_name = {p["name"]: p for p in params_fused}
            shown = sorted(params, key=lambda p: -p["update_rel_l2"])[:5]
            for p in params:
                if ("lm_head" in p["name"] or "embed_tokens" in p["name"]) and p not in shown:
                    shown.append(p)
            for p in shown:
                line = f"{p['name']:<48} {p['max_abs']:>9.2e} {p['rel_l2']:>9.2e} {p['update_rel_l2']:>10.2e}"
                if p["name"] in fused_by_name:
                    line += f" {fused_by_name[p['name']]['update_rel_l2']:>12.2e}"
                print(line)
        for c in checks:
            print(f"{'PASS' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}")
        print(
            f"{'PASS' if ok else 'FAIL'} multi_gpu_check {args.arch} {mode['mode']} world_size={world} "
            + ("" if args.compile == "none" else f"compile={args.compile} ")
            + f"(reference {t_ref:.1f}s, distributed {t_dist:.1f}s)"
        )
        print("=" * 100, flush=True)

        report = {
            "ok": ok,
            "args": vars(args),
            "mode": mode,
            "checks": checks,
            "losses": loss_rows,
            "params": params,
            "params_vs_ref_fused": params_fused,
            "ranks": dist["ranks"],
            "ref_calls": ref_fused["calls"] if ref_fused is not None else [],
            "env": {
                "torch": torch.__version__,
                "lce_patch": lce_patch.__version__,
                "python": platform.python_version(),
                "cuda": torch.version.cuda,
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
            },
            "seconds": {"reference": t_ref, "distributed": t_dist},
        }
        try:
            import accelerate
            import transformers

            report["env"].update(transformers=transformers.__version__, accelerate=accelerate.__version__)
        except ImportError:
            pass
        out = Path(args.out)
        suffix = "" if args.inject == "none" else f"_{args.inject}"
        suffix += "" if args.compile == "none" else f"_compile-{args.compile}"
        path = (
            out if out.suffix == ".json" else out / f"multi_gpu_check_{mode['mode'].lower()}_{args.arch}{suffix}.json"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {path}", flush=True)

    if world > 1:
        verdict = [ok]
        torch.distributed.broadcast_object_list(verdict, src=0)
        ok = bool(verdict[0])
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
