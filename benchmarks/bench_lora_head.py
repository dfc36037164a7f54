"""Benchmark: LoRA on the LM head, fused (lce_patch's low-rank term) beside PEFT's unfused head.

One process, one CUDA device, every method on the same inputs: bf16 hidden states h [N, D] (requires grad),
a frozen bf16 head W [V, D], LoRA A [r, D] and B [V, r] in fp32 (as PEFT keeps adapters beside a bf16
model), scaling alpha / r = 2, labels with every 7th ignored ("peaked" data, ``bench_common.make_inputs``).
Gradients: h, A and B (W frozen), except where a method says otherwise.

Methods:
  * peft_unfused: PEFT's LoRA forward and Hugging Face's loss: ``F.linear(h, W)`` in bf16, plus
    ``lora_B(lora_A(h.float())) * s`` in fp32, the sum cast back to bf16 (the logits), then
    ``cross_entropy(logits.float())``;
  * peft_compile: ``torch.compile`` of peft_unfused;
  * lce_patch_lora: the fused op with ``low_rank_hidden = s * lora_A(h.float())`` (autograd) and
    ``low_rank_weight = B``, as a patched PEFT model calls it;
  * lce_patch_frozen: the fused op without an adapter, W frozen (h's gradient only): what the head costs
    with no adapter, the yardstick for the adapter's overhead;
  * lce_patch_full_head: the fused op with W trainable (dW too): the cost of ``modules_to_save=["lm_head"]``,
    the alternative to LoRA on the head (optimizer state for a V x D copy not counted).

Per method: fwd+bwd median (``triton.testing.do_bench``, gradients reset outside the timed region) in each of
``--rounds`` rounds that time every method in turn, the median of the rounds and, against peft_unfused, the
speedup with its 95% paired interval over the rounds (``bench_common.interleaved_rounds``); peak
memory of one fwd+bwd above the inputs (the gradients it produces included: dW for the full head), and the relative L2 error of the loss and of dh, dA, dB against an
fp32 reference (the unfused computation in fp32, TF32 off).

    python3 benchmarks/bench_lora_head.py                     # Llama-3-8B head, N 8192, r 16 and 64
    python3 benchmarks/bench_lora_head.py --n 4096 16384 --ranks 16 64 --methods lce_patch_lora peft_unfused
    python3 benchmarks/bench_lora_head.py --tiny             # CPU smoke test of the script

JSON to --out (default $OUT/bench_lora_head.json when OUT is set, else runs/bench_lora_head.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    REPO,
    env_info,
    free,
    interleaved_rounds,
    make_inputs,
    repeat_ms,
    set_exact_fp32,
    synchronizer,
)

from lce_patch import fused_linear_cross_entropy  # noqa: E402

METHODS = ("peft_unfused", "peft_compile", "lce_patch_lora", "lce_patch_frozen", "lce_patch_full_head")
SCALE = 2.0


def peft_unfused(h, w, a, b, y):
    logits = F.linear(h, w)
    lora = F.linear(F.linear(h.float(), a), b) * SCALE
    logits = (logits + lora).to(h.dtype)
    return F.cross_entropy(logits.float(), y, ignore_index=-100)


_compiled = None


def peft_compile(h, w, a, b, y):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(peft_unfused)
    return _compiled(h, w, a, b, y)


def lce_patch_lora(h, w, a, b, y):
    low = F.linear(h.float(), a) * SCALE
    return fused_linear_cross_entropy(h, w, y, low_rank_hidden=low, low_rank_weight=b)


def lce_patch_frozen(h, w, a, b, y):
    return fused_linear_cross_entropy(h, w, y)


lce_patch_full_head = lce_patch_frozen  # the same call; prepare_method makes W trainable for this method


def reference(h, w, a, b, y):
    """fp32 loss and (dh, dA, dB) of the unfused computation, TF32 off."""
    set_exact_fp32()
    hf, af, bf = (t.detach().float().requires_grad_() for t in (h, a, b))
    logits = F.linear(hf, w.float()) + F.linear(F.linear(hf, af), bf) * SCALE
    loss = F.cross_entropy(logits, y, ignore_index=-100)
    grads = torch.autograd.grad(loss, [hf, af, bf])
    del logits
    # the timed runs then take fp32 matmuls (the adapter's input side) at TF32, as Trainer(tf32=True) does
    torch.backends.cuda.matmul.allow_tf32 = True
    return loss.detach(), grads


def rel_l2(x, ref):
    if x is None:
        return None
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).norm() / ref.norm().clamp(min=1e-30))


def prepare_method(method, h, w, a, b, y, ref, device):
    """Warm-up (and compile), errors against the fp32 reference and the peak memory of one fwd+bwd: the row, and
    a timer (one do_bench median, ms) for the rounds, None when the method failed."""
    fn = globals()[method]
    w_used = w.detach().requires_grad_(method == "lce_patch_full_head")
    inputs = [h, a, b] + ([w_used] if w_used.requires_grad else [])

    def step():
        for t in inputs:
            t.grad = None
        loss = fn(h, w_used, a, b, y)
        loss.backward()
        return loss

    def timed() -> float:
        if device.type == "cuda":
            import triton.testing

            ms = triton.testing.do_bench(step, warmup=5, rep=60, return_mode="median")
        else:  # the CPU smoke test: wall clock
            ms = statistics.median(repeat_ms(step, 3, synchronizer(device)))
        for t in inputs:
            t.grad = None
        return ms

    row = {"method": method}
    try:
        loss = step()  # warm-up (and compile)
        if method not in ("lce_patch_frozen", "lce_patch_full_head"):  # another function: no error to report
            row["loss_rel_err"] = rel_l2(loss, ref[0])
            for name, got, want in zip(("dh", "dA", "dB"), (h.grad, a.grad, b.grad), ref[1]):
                row[f"{name}_rel_l2"] = rel_l2(got, want)
        del loss
        for t in inputs:  # the peak below counts the gradients each method produces, as bench_lce.py does
            t.grad = None
        free()
        if device.type == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as err:  # a failing method is reported in its row
        row["error"] = f"{type(err).__name__}: {err}"[:300]
    for t in inputs:
        t.grad = None
    free()
    return row, (None if "error" in row else timed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[8192], help="tokens per step")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64], help="LoRA ranks on the head")
    parser.add_argument("--d", type=int, default=4096, help="hidden size (Llama-3-8B: 4096)")
    parser.add_argument("--v", type=int, default=128256, help="vocabulary size (Llama-3: 128256)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--rounds", type=int, default=5, help="timing rounds over every method of a shape, in turn (median reported)"
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (smoke test of the script)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        args.n, args.ranks, args.d, args.v = [64], [4], 32, 96
        args.methods = [m for m in args.methods if m != "peft_compile"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for n in args.n:
        h, w, y = make_inputs(n, args.d, args.v, dtype=dtype, device=device, data="peaked")
        h.requires_grad_()
        for rank in args.ranks:
            gen = torch.Generator(device=device).manual_seed(rank)
            a = (torch.randn(rank, args.d, device=device, generator=gen) / args.d**0.5).requires_grad_()
            # B is trained from zero in practice; a trained adapter's B is what the error check needs
            b = (torch.randn(args.v, rank, device=device, generator=gen) * 0.02).requires_grad_()
            ref = reference(h, w, a, b, y)
            free()
            shape_rows, timers = {}, {}
            for method in args.methods:
                shape_rows[method], timer = prepare_method(method, h, w, a, b, y, ref, device)
                shape_rows[method].update(n=n, rank=rank, d=args.d, v=args.v)
                if timer is not None:
                    timers[method] = timer
            del ref
            free()
            baseline = "peft_unfused" if "peft_unfused" in timers else None
            for method, timing in interleaved_rounds(timers, args.rounds, baseline).items():
                shape_rows[method].update(timing)
            for row in shape_rows.values():
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(
        "| N | r | method | fwd+bwd ms | x PEFT unfused (95% interval) | peak MiB | loss err | dh err | dA err | dB err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")

    def fmt(row, key, spec):
        value = row.get(key)
        return "-" if value is None else format(value, spec)

    for row in rows:
        speedup = "-"
        if "speedup" in row:
            low, high = row["speedup_interval95"]
            speedup = f"{row['speedup']:.2f} ({low:.2f}-{high:.2f})"
        cells = [row["n"], row["rank"], row["method"], fmt(row, "ms", ".2f"), speedup, fmt(row, "peak_mib", ".0f")]
        cells += [fmt(row, k, ".1e") for k in ("loss_rel_err", "dh_rel_l2", "dA_rel_l2", "dB_rel_l2")]
        if "error" in row:
            cells[3] = row["error"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    out = Path(
        args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "runs") / "bench_lora_head.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env_info(), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
