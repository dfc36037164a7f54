"""How close can a token-chunked fused loss get to the GEMM floor? Its GEMMs alone, timed beside the op.

The target it measures against: the op (no ignored tokens) at 97% of the GEMM floor (Llama-3-8B,
Qwen2.5-7B; 95% Gemma-2) at a peak memory just above the gradients themselves: dW [V, D] and dh [N, D],
plus about one chunk of bf16 logits [C, V] (C ~ 1024 rows for these vocabularies). Any design that keeps
a whole-row chunk of logits (the softmax needs the row's log-sum-exp before the gradient exists) and runs
its matrix products on cuBLAS pays at least the chunk schedule's GEMMs. This times, in one process and in interleaved rounds:

* ``floor``: the workload's three full-size cuBLAS GEMMs (logits h.W^T [N, V], dh = G.W, dW = G^T.h), as in
  ``bench_lce.py``'s "% GEMM floor";
* ``schedule``: the op's default chunk schedule with the row pass left out: per chunk of C rows, logits
  into a [C, V] bf16 buffer, dh rows = G.W, dW = G^T.h for the first chunk then ``addmm_`` (bf16 dW, as
  the op keeps it), on a realistic G (softmax minus one-hot of the first chunk's logits, scaled by 1/N);
* ``schedule_dw_mm``: the same with every dW product a plain ``mm`` (no read of the old dW: what a
  free accumulation would cost; numerically wrong, a bound only);
* ``schedule_two_streams``: the same with each chunk's dW product on a second stream beside its dh
  product (both only read the chunk's G), so that the dW read-back can overlap dh's compute;
* ``schedule_dh_split{S}``: dh as a split-K ``bmm`` over S vocabulary slices into fp32 partials, summed
  and rounded once (more output tiles for thin D);
* ``schedule[c=R]`` (``--chunk-rows``): the schedule with R-row chunks (e.g. the largest chunk a memory
  target leaves room for), and ``schedule_dw_mm[c=R]`` the same without the dW read;
* ``op``: ``fused_linear_cross_entropy`` forward+backward at its defaults (the row pass included), with
  its peak memory above the inputs; ``op[c=R]`` the same with ``chunk_size=R``;
* ``compile``: ``torch.compile`` of the unfused loss (``bench_lce.py``'s), forward+backward.
Each round times every variant once, starting one variant later than the round before (the first of a
round tends to find the GPU cooler; benchmarks/NOTES.md); medians of the rounds are reported.

``schedule / floor`` bounds what the op can reach with cuBLAS GEMMs at that chunk size; ``op - schedule``
is what the row pass and the small kernels cost. Needs a CUDA GPU. Prints a table, writes JSON to
``--out`` (default ``$OUT`` or runs/schedule_bound).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # lce_patch from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_common, bench_lce from benchmarks/

from bench_common import env_info, make_inputs  # noqa: E402
from bench_lce import SHAPES, build  # noqa: E402

from lce_patch.ops.core.chunking import resolve_chunks  # noqa: E402
from lce_patch.ops.linear_cross_entropy import fused_linear_cross_entropy  # noqa: E402

SHAPE_NAMES = ("llama3-8b", "qwen2.5-7b", "gemma2-2b")  # bench_lce.py's shapes with a trainable W


def _bench(fn, grad_to_none=None) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=200, grad_to_none=grad_to_none, return_mode="median")


def _chunks(n: int, rows: int) -> list[slice]:
    return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]


def _split_dh(grad: torch.Tensor, weight: torch.Tensor, splits: int, partials: torch.Tensor, out: torch.Tensor):
    """out = grad @ weight as ``splits`` vocabulary slices multiplied at once into fp32 ``partials``."""
    c, v = grad.shape
    piece = v // splits  # a vocabulary not divisible by the splits loses its last V % S rows (the error is printed)
    a = grad[:, : piece * splits].view(c, splits, piece).transpose(0, 1)  # [S, C, V/S], strided
    b = weight[: piece * splits].view(splits, piece, weight.shape[1])  # [S, V/S, D]
    torch.bmm(a, b, out_dtype=torch.float32, out=partials)
    torch.sum(partials, dim=0, out=out)


def measure(name: str, rounds: int, splits: list[int], chunk_rows: list[int]) -> list[dict]:
    n, d, v, softcap, _frozen = SHAPES[name]
    h, w, y = make_inputs(n, d, v, dtype=torch.bfloat16, device="cuda", data="peaked", softcap=softcap, ignore_every=0)
    hidden = h.detach().requires_grad_(True)
    weight = w.detach().requires_grad_(True)
    rows = resolve_chunks(None, n, hidden, weight, use_triton=True, any_grad=True)[0][1]  # the first chunk's rows
    largest = max([rows, *chunk_rows])
    buffer = torch.empty(largest, v, device="cuda", dtype=torch.bfloat16)
    grad = torch.empty(largest, v, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():  # a realistic G: softmax minus one-hot, over N (what the op's buffer holds)
        for part in _chunks(largest, 1024):
            logits = (h[part] @ w.t()).float()
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            g = torch.softmax(logits, dim=1)
            g[torch.arange(g.shape[0], device="cuda"), y[part].clamp(min=0)] -= 1.0
            grad[part] = g / n
            del logits, g
    dh = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
    dw = torch.empty(v, d, device="cuda", dtype=torch.bfloat16)

    side = torch.cuda.Stream()

    def schedule(dh_product=None, dw_accumulate=True, chunk=rows, two_streams=False):
        main = torch.cuda.current_stream()
        for index, part in enumerate(_chunks(n, chunk)):
            c = part.stop - part.start
            torch.mm(h[part], w.t(), out=buffer[:c])
            g = grad[:c]
            if two_streams:  # dW on a side stream beside dh; the next chunk waits for both
                side.wait_stream(main)
            with torch.cuda.stream(side if two_streams else main):
                if index == 0 or not dw_accumulate:
                    torch.mm(g.t(), h[part], out=dw)
                else:
                    dw.addmm_(g.t(), h[part])
            if dh_product is None:
                torch.mm(g, w, out=dh[part])
            else:
                dh_product(g, dh[part])
            if two_streams:
                main.wait_stream(side)

    full_logits = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
    variants = {
        "floor": None,  # timed as three GEMMs below
        "schedule": schedule,
        "schedule_dw_mm": lambda: schedule(dw_accumulate=False),
        "schedule_two_streams": lambda: schedule(two_streams=True),
    }
    for chunk in chunk_rows:
        variants[f"schedule[c={chunk}]"] = lambda c=chunk: schedule(chunk=c)
        variants[f"schedule_dw_mm[c={chunk}]"] = lambda c=chunk: schedule(dw_accumulate=False, chunk=c)
        variants[f"schedule_two_streams[c={chunk}]"] = lambda c=chunk: schedule(chunk=c, two_streams=True)
    reference = torch.mm(grad[:rows], w)
    for s in splits:
        partials = torch.empty(s, rows, d, device="cuda", dtype=torch.float32)

        def dh_split(g, out, s=s, partials=partials):
            _split_dh(g, w, s, partials[:, : g.shape[0]], out)

        out = torch.empty(rows, d, device="cuda", dtype=torch.bfloat16)
        dh_split(grad[:rows], out)
        error = float((out.float() - reference.float()).norm() / reference.float().norm())
        print(f"{name}: dh split {s} vs mm, relative L2 {error:.3g}")
        variants[f"schedule_dh_split{s}"] = lambda f=dh_split: schedule(dh_product=f)

    def op(chunk=None):
        fused_linear_cross_entropy(hidden, weight, y, softcap=softcap, chunk_size=chunk).backward()

    compiled = build("compile", hidden, weight, y, softcap)
    variants["op"] = op
    for chunk in chunk_rows:
        variants[f"op[c={chunk}]"] = lambda c=chunk: op(c)
    variants["compile"] = lambda: compiled().backward()
    peak_mib = {}
    for key in variants:
        if key.startswith("op"):
            hidden.grad = weight.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            variants[key]()
            torch.cuda.synchronize()
            peak_mib[key] = (torch.cuda.max_memory_allocated() - base) / 2**20
            hidden.grad = weight.grad = None
    times: dict[str, list[float]] = {key: [] for key in variants}
    names = list(variants)
    for round_index in range(rounds):
        for position in range(len(names)):
            key = names[(position + round_index) % len(names)]
            if key == "floor":
                total = _bench(lambda: torch.mm(h, w.t(), out=full_logits))
                total += _bench(lambda: torch.mm(full_logits, w, out=dh))
                total += _bench(lambda: torch.mm(full_logits.t(), h, out=dw))
                times[key].append(total)
            else:
                grads = [hidden, weight] if key.startswith(("op", "compile")) else None
                times[key].append(_bench(variants[key], grad_to_none=grads))
    floor = statistics.median(times["floor"])
    results = []
    print(f"\n{name} (N {n}, D {d}, V {v}, softcap {softcap}), default chunks of {rows} rows:")
    for key, values in times.items():
        ms = statistics.median(values)
        row = {"shape": name, "chunk_rows": rows, "variant": key, "ms": ms, "ms_rounds": values}
        row["pct_floor"] = 100 * floor / ms
        memory = ""
        if key in peak_mib:
            row["peak_mib"] = peak_mib[key]
            memory = f", peak {peak_mib[key]:.0f} MiB above the inputs"
        results.append(row)
        spread = f"{min(values):.2f}-{max(values):.2f}"
        print(f"  {key:22s} {ms:8.2f} ms ({spread})  {row['pct_floor']:5.1f}% of the GEMM floor{memory}")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPE_NAMES), choices=SHAPE_NAMES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--splits", type=int, nargs="*", default=[], help="split-K factors for dh (e.g. 2 4)")
    parser.add_argument("--chunk-rows", type=int, nargs="*", default=[], help="schedule also at these chunk sizes")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/schedule_bound")
    args = parser.parse_args(argv)
    results = []
    for name in args.shapes:
        results += measure(name, args.rounds, args.splits, args.chunk_rows)
        torch.cuda.empty_cache()
    path = Path(args.out)
    path = path if path.suffix == ".json" else path / "schedule_bound.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env_info(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
