"""Tensor-parallel check: the vocabulary-parallel loss against one process, on GPUs.

Two parts, run under torchrun (keep NVLink multicast off on shared hosts):

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/checks/tp_check.py --part model --arch llama
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/checks/tp_check.py --part op

``--part op``: every rank holds a vocabulary shard of a real head (Llama-3.2-1B: D=2048, V=128256;
Gemma-2-2B: D=2304, V=256000, softcap 30) and calls ``fused_linear_cross_entropy(..., vocab_shard=...)``
in bf16 on the Triton kernels; its loss, dh and dW shard are compared with the same op on the whole
weight in one process (and the loss with an fp32 unfused reference).

``--part model``: a model of the chosen shape (random weights, bf16, ``--layers`` decoder layers) saved
once and loaded by every rank with ``tp_plan="auto"`` (the LM head vocab-sharded), then one training
step (forward + backward) unpatched and patched on the same batch: losses and every gradient compared
(bf16 noise), per-rank peak memory above the model and median step time. Needs one GPU per rank.

``--same-device`` puts every rank on cuda:0 with the gloo backend: a check of the values on one GPU
(its times and memory mean nothing). ``--cpu`` runs both parts on a tiny shape in fp32 on CPU processes over
gloo (``torchrun --nproc_per_node 2 benchmarks/checks/tp_check.py --cpu --part model``): a smoke test, run in CI.

Rank 0 prints a table and writes JSON to ``--out`` (default ``$OUT`` or runs/tp_check); exit 1 on FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # bench_common, in benchmarks/

from bench_common import rel_err, rel_l2  # noqa: E402

import lce_patch  # noqa: E402
from lce_patch import VocabShard, fused_linear_cross_entropy  # noqa: E402

SHAPES = {
    "llama": dict(hidden=2048, vocab=128256, softcap=None, heads=32, kv_heads=8, intermediate=8192),
    "gemma2": dict(hidden=2304, vocab=256000, softcap=30.0, heads=8, kv_heads=4, intermediate=9216),
}
# --cpu: the same checks on a tiny shape over gloo, in fp32 (a smoke test of the script; CI runs it).
TINY = dict(hidden=64, vocab=509, heads=4, kv_heads=2, intermediate=128)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--part", choices=("op", "model"), default="op")
    parser.add_argument("--arch", choices=sorted(SHAPES), default="llama")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (op) / batch x seq (model)")
    parser.add_argument("--seq-len", type=int, default=2048, help="model part: tokens per sequence")
    parser.add_argument("--layers", type=int, default=4, help="model part: decoder layers")
    parser.add_argument("--steps", type=int, default=5, help="model part: timed steps per variant")
    parser.add_argument(
        "--same-device", action="store_true", help="all ranks on cuda:0 over gloo (checks values; no timing)"
    )
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on CPU processes over gloo, fp32 (smoke test)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / "tp_check"))
    args = parser.parse_args(argv)
    if args.cpu:
        args.tokens, args.seq_len, args.layers = min(args.tokens, 256), min(args.seq_len, 64), min(args.layers, 2)
    return args


def shape_of(args) -> dict:
    shape = dict(SHAPES[args.arch])
    if args.cpu:
        shape.update(TINY, softcap=shape["softcap"] and 2.0)
    return shape


def compute_dtype(args) -> torch.dtype:
    return torch.float32 if args.cpu else torch.bfloat16


def shard_bounds(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """torch.chunk's split, as DTensor's Shard(0) makes it."""
    size = -(-vocab // world)
    return min(rank * size, vocab), min((rank + 1) * size, vocab)


def check_op(args, rank: int, world: int, device: torch.device) -> dict:
    shape = shape_of(args)
    dtype = compute_dtype(args)
    gen = torch.Generator(device=device).manual_seed(0)
    n, d, v = args.tokens, shape["hidden"], shape["vocab"]
    hidden = torch.randn(n, d, device=device, generator=gen).to(dtype)
    weight = (torch.randn(v, d, device=device, generator=gen) * (2.0 / d**0.5)).to(dtype)
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    labels[::7] = -100
    start, stop = shard_bounds(v, world, rank)
    options = dict(softcap=shape["softcap"], backend="torch" if args.cpu else "triton")

    h = hidden.clone().requires_grad_()
    w = weight[start:stop].clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, labels, vocab_shard=VocabShard(start, v), **options)
    loss.backward()

    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = fused_linear_cross_entropy(h_ref, w_ref, labels, **options)
    ref.backward()
    with torch.no_grad():  # fp32 unfused loss, chunked over tokens to bound its memory
        total, count = 0.0, 0
        for i in range(0, n, 512):
            logits = hidden[i : i + 512].double() @ weight.double().t()
            if shape["softcap"]:
                logits = shape["softcap"] * torch.tanh(logits / shape["softcap"])
            total += float(torch.nn.functional.cross_entropy(logits, labels[i : i + 512], reduction="sum"))
            count += int((labels[i : i + 512] != -100).sum())
        fp32_loss = total / count
    return {
        "rank": rank,
        "shard": [start, stop],
        "loss": float(loss),
        "loss_one_process": float(ref),
        "loss_fp32_unfused": fp32_loss,
        "loss_rel_vs_one_process": rel_err(float(loss), float(ref)),
        "loss_rel_vs_fp32": rel_err(float(loss), fp32_loss),
        "dh_rel_vs_one_process": rel_l2(h.grad, h_ref.grad),
        "dw_rel_vs_one_process": rel_l2(w.grad, w_ref.grad[start:stop]),
    }


def check_model(args, rank: int, world: int, device: torch.device) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = shape_of(args)
    dtype = compute_dtype(args)
    path = Path(tempfile.gettempdir()) / f"tp_check_{args.arch}_{args.layers}{'_cpu' if args.cpu else ''}"
    if rank == 0 and not (path / "config.json").exists():
        extra = {}
        if args.arch == "gemma2":
            extra = dict(final_logit_softcapping=shape["softcap"], head_dim=16 if args.cpu else 256)
        config = AutoConfig.for_model(
            args.arch,
            vocab_size=shape["vocab"],
            hidden_size=shape["hidden"],
            intermediate_size=shape["intermediate"],
            num_hidden_layers=args.layers,
            num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv_heads"],
            tie_word_embeddings=True,
            **extra,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
    model.train()
    model.gradient_checkpointing_enable()
    gen = torch.Generator().manual_seed(1)
    batch_size = max(1, args.tokens // args.seq_len)
    ids = torch.randint(0, shape["vocab"], (batch_size, args.seq_len), generator=gen).to(device)
    labels = ids.clone()
    labels[:, : args.seq_len // 4] = -100
    cuda = device.type == "cuda"
    model_bytes = torch.cuda.memory_allocated(device) if cuda else 0

    def step() -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        return float(out.loss), grads

    results = {}
    for variant in ("unpatched", "patched"):
        if variant == "patched":
            lce_patch.apply_fused_lce(model)
        loss, grads = step()  # warm-up, and the values compared
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(1e3 * (time.perf_counter() - start))
        peak = torch.cuda.max_memory_allocated(device) - model_bytes if cuda else 0
        results[variant] = {"loss": loss, "grads": grads, "ms": statistics.median(times), "peak_mib": peak / 2**20}
    grads_u, grads_p = results["unpatched"].pop("grads"), results["patched"].pop("grads")
    errors = {name: rel_l2(grads_p[name], grads_u[name]) for name in grads_u}
    worst = max(errors, key=errors.get)
    return {
        "rank": rank,
        "lm_head_local_rows": int(model.lm_head.weight.to_local().shape[0]),
        "unpatched": results["unpatched"],
        "patched": results["patched"],
        "loss_rel": rel_err(results["patched"]["loss"], results["unpatched"]["loss"]),
        "worst_grad": worst,
        "worst_grad_rel": errors[worst],
        "head_grad_rel": errors.get("lm_head.weight", errors.get("model.embed_tokens.weight")),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", 0 if args.same_device else local_rank)
        if args.same_device:
            os.environ["LOCAL_RANK"] = "0"  # transformers' TP loading binds cuda:LOCAL_RANK
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.same_device or args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = check_op(args, rank, world, device) if args.part == "op" else check_model(args, rank, world, device)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    ok = True
    if rank == 0:
        # bf16 on GPUs: bf16 noise; fp32 on CPU: fp32 noise.
        grad_tol, loss_tol = (1e-4, 1e-5) if args.cpu else (2e-2, 1e-4)
        if args.part == "op":
            ok = all(r["loss_rel_vs_one_process"] < 1e-5 and r["dh_rel_vs_one_process"] < grad_tol for r in gathered)
            ok = ok and all(
                r["dw_rel_vs_one_process"] < grad_tol and r["loss_rel_vs_fp32"] < loss_tol for r in gathered
            )
        else:
            ok = all(r["loss_rel"] < 10 * loss_tol and r["worst_grad_rel"] < 2.5 * grad_tol for r in gathered)
        report = {
            "part": args.part,
            "arch": args.arch,
            "world_size": world,
            "same_device": args.same_device,
            "device": "cpu" if args.cpu else torch.cuda.get_device_name(device),
            "versions": {
                "torch": torch.__version__,
                "transformers": __import__("transformers").__version__,
                "python": platform.python_version(),
            },
            "date": time.strftime("%Y-%m-%d"),
            "ranks": gathered,
            "ok": ok,
        }
        print(json.dumps(report, indent=1))
        out = Path(args.out)
        out = out if out.suffix == ".json" else out / f"tp_check_{args.part}_{args.arch}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(("PASS" if ok else "FAIL") + f" tp_check {args.part} {args.arch} world_size={world}")
    flag = torch.tensor([int(ok)], device=device)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return 0 if int(flag) else 1


if __name__ == "__main__":
    sys.exit(main())
