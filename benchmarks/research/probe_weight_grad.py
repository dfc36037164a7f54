"""Research probe: the chunk's weight-gradient GEMM ``dW += G^T h`` on cuBLAS and on a Gluon kernel.

The chunked op adds each chunk's dW into one bf16 buffer; cuBLAS's ``addmm_`` reads the old tile after its main
loop (NOTES v17, v19). This checks gluon_weight_grad.py's kernel (which reads it under the main loop) against a float64
reference next to cuBLAS's own error, on odd sizes and views (a check passes when the kernel's error is at most
1.25x cuBLAS's; the script exits 1 if one fails), then times, per shape at the op's chunk rows:

* ``cublas_addmm``: ``dW.addmm_(G.T, h)`` (what the op runs);
* ``cublas_mm``: ``torch.mm(G.T, h, out=dW)`` (no old tile: the bound an accumulating GEMM aims at);
* ``gluon_acc`` / ``gluon_mm``: the Gluon kernel accumulating / writing a fresh dW;
* ``pair_cublas`` / ``pair_gluon``: the op's schedule for one chunk, dh = G @ W on the current stream and the
  dW GEMM on a second stream (core.grads.OVERLAP_WEIGHT_GRADS), with either dW GEMM.

Variants interleaved over ``--rounds`` rounds (median of ``do_bench`` medians). Needs a Hopper GPU. Prints JSON
lines and writes them to ``--out`` (default ``$OUT/probe_weight_grad.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gluon_weight_grad as weight_grad  # noqa: E402

# name: (D, V, chunk rows to time)
SHAPES = {
    "llama3-8b": (4096, 128256, (1024,)),
    "qwen2.5-7b": (3584, 152064, (1152,)),
    "gemma2-2b": (2304, 256000, (512, 1792)),
}


def check(rows: int, vocab: int, hidden: int, accumulate: bool, view: bool, dtype: torch.dtype) -> dict:
    """Gluon vs cuBLAS error against float64, on random data of the op's scale."""
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + vocab + hidden)
    grad = (torch.randn(rows, vocab, device="cuda", generator=gen) * 1e-3).to(dtype)
    source = torch.randn(rows + 3 if view else rows, hidden, device="cuda", generator=gen).to(dtype)
    hidden_chunk = source[3:] if view else source  # a row-offset view, as a later chunk of hidden is
    old = (torch.randn(vocab, hidden, device="cuda", generator=gen) * 1e-2).to(dtype)
    reference = grad.double().t() @ hidden_chunk.double() + (old.double() if accumulate else 0)
    ours = old.clone()
    assert weight_grad.supports(ours, grad, hidden_chunk), (rows, vocab, hidden)
    weight_grad.add_weight_grad_(ours, grad, hidden_chunk, accumulate=accumulate)
    theirs = old.clone()
    if accumulate:
        theirs.addmm_(grad.t(), hidden_chunk)
    else:
        torch.mm(grad.t(), hidden_chunk, out=theirs)
    scale = reference.abs().max().item()
    err_ours = (ours.double() - reference).abs().max().item() / scale
    err_theirs = (theirs.double() - reference).abs().max().item() / scale
    return {
        "check": [rows, vocab, hidden],
        "accumulate": accumulate,
        "view": view,
        "dtype": str(dtype),
        "err_gluon": err_ours,
        "err_cublas": err_theirs,
        "ok": bool(err_ours <= 1.25 * err_theirs + 1e-6),
    }


def time_shape(name: str, rows: int, rounds: int) -> dict:
    import triton.testing

    hidden, vocab, _ = SHAPES[name]
    grad = (torch.randn(rows, vocab, device="cuda") * 1e-3).bfloat16()
    hidden_chunk = torch.randn(rows, hidden, device="cuda").bfloat16()
    weight = (torch.randn(vocab, hidden, device="cuda") * 0.02).bfloat16()
    dw = torch.zeros(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def pair(dw_gemm):
        def run():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                dw_gemm()
            torch.mm(grad, weight, out=dh)
            main.wait_stream(side)

        return run

    variants = {
        "cublas_addmm": lambda: dw.addmm_(grad.t(), hidden_chunk),
        "cublas_mm": lambda: torch.mm(grad.t(), hidden_chunk, out=dw),
        "gluon_acc": lambda: weight_grad.add_weight_grad_(dw, grad, hidden_chunk, accumulate=True),
        "gluon_mm": lambda: weight_grad.add_weight_grad_(dw, grad, hidden_chunk, accumulate=False),
        "dh_alone": lambda: torch.mm(grad, weight, out=dh),
        "pair_cublas": pair(lambda: dw.addmm_(grad.t(), hidden_chunk)),
        "pair_gluon": pair(lambda: weight_grad.add_weight_grad_(dw, grad, hidden_chunk, accumulate=True)),
    }
    times: dict[str, list[float]] = {key: [] for key in variants}
    names = list(variants)
    for round_index in range(rounds):
        for key in names if round_index % 2 == 0 else reversed(names):
            times[key].append(triton.testing.do_bench(variants[key], warmup=10, rep=100, return_mode="median"))
    flops = 2 * rows * vocab * hidden
    result = {"shape": name, "rows": rows, "D": hidden, "V": vocab}
    for key, values in times.items():
        ms = statistics.median(values)
        result[key + "_us"] = round(ms * 1e3, 1)
        if not key.startswith("pair") and key != "dh_alone":
            result[key + "_tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list from: {', '.join(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-checks", action="store_true")
    default_out = os.path.join(os.environ.get("OUT") or "runs", "probe_weight_grad.json")
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()
    rows: list[dict] = []
    if not args.skip_checks:
        for size in [(100, 1000, 200), (64, 128, 256), (1, 256, 512), (700, 4104, 264), (1030, 8192, 4096)]:
            for accumulate in (True, False):
                for view in (False, True):
                    rows.append(check(*size, accumulate, view, torch.bfloat16))
        rows.append(check(1030, 8192, 4096, True, True, torch.float16))
    for name in args.shapes.split(","):
        for chunk_rows in SHAPES[name][2]:
            rows.append(time_shape(name, chunk_rows, args.rounds))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as handle:
        for row in rows:
            print(json.dumps(row), flush=True)
            handle.write(json.dumps(row) + "\n")
    failed = [row["check"] for row in rows if row.get("ok") is False]
    if failed:
        print(f"FAIL: {len(failed)} checks: {failed}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
