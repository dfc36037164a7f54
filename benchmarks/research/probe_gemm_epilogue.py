"""Research probe: can a Triton logits GEMM carry the softmax statistics in its epilogue at cuBLAS speed?

The chunked op runs the logits GEMM on cuBLAS, then a memory-bound statistics pass over the [C, V] buffer
(benchmarks/NOTES.md). Fusing that pass into the GEMM only pays if the Triton GEMM itself runs within a few
percent of cuBLAS. This times, on one chunk's shape (C rows of hidden [C, D] times W [V, D] transposed):

* ``cublas``: ``torch.mm(h, W.T)`` into a bf16 buffer;
* ``triton``: a persistent TMA GEMM (one program per SM, tiles in grouped order) writing the same buffer;
* ``triton+stats``: the same GEMM whose epilogue also writes, per row and vocabulary tile, the max and the
  sum of exponentials of the tile's rounded logits ([C, V / BLOCK_N] fp32 each), from which a tiny
  reduction gives each row's log-sum-exp; checked against ``torch.logsumexp`` of the buffer.

With ``--gemms backward`` also the chunk's backward GEMMs, dh = G @ W and dW = G.T @ h, on cuBLAS (dW also
as the op's ``addmm_``) and on the same persistent kernel with operands in either major order (dW also in an
accumulating form that starts from the old tile, and forms that add the old tile, read by TMA, after the K loop:
whole or in two halves, with warp specialization, or with its load issued before the loop; ``ACCUMULATE_MODES``).
Findings: benchmarks/NOTES.md, v16 and v17.

Each variant in several tile configurations (``PROBE_CONFIGS=best``: the first only), interleaved over
rounds (median of ``do_bench`` medians). Needs a Hopper GPU; prints a table and writes JSON to ``--out``
(default ``$OUT`` or runs/probe).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

SHAPES = {"llama3-8b": (4096, 128256), "qwen2.5-7b": (3584, 152064), "gemma2-2b": (2304, 256000)}
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
CONFIGS = [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8), (128, 128, 128, 3, 8)]
if os.environ.get("PROBE_CONFIGS") == "best":
    CONFIGS = CONFIGS[:1]


@triton.jit
def _tile_origin(tile_id, num_pid_m, num_pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """First (row, column) of ``tile_id``'s output tile in grouped order: GROUP_M row tiles share each column tile
    in L2."""
    group = tile_id // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return (first_m + (tile_id % size_m)) * BLOCK_M, ((tile_id % (GROUP_M * num_pid_n)) // size_m) * BLOCK_N


@triton.jit
def _gemm_stats_kernel(
    a_desc,
    b_desc,
    c_desc,
    max_ptr,
    sum_ptr,
    M,
    N,
    K,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    WRITE_STATS: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        off_m, off_n = _tile_origin(tile_id, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        logits = acc.to(tl.bfloat16)
        c_desc.store([off_m, off_n], logits)
        if WRITE_STATS:
            cols = off_n + tl.arange(0, BLOCK_N)
            rows = off_m + tl.arange(0, BLOCK_M)
            z = tl.where(cols[None, :] < N, logits.to(tl.float32), float("-inf"))
            tile_max = tl.max(z, 1)
            tile_sum = tl.sum(tl.exp(z - tile_max[:, None]), 1)
            offsets = rows * num_pid_n + off_n // BLOCK_N
            tl.store(max_ptr + offsets, tile_max, mask=rows < M)
            tl.store(sum_ptr + offsets, tile_sum, mask=rows < M)


# How the generic kernel adds into C (dW += G.T @ h): not at all, from an accumulator started at the old tile
# (loaded before the K loop), or by adding the old tile, read by TMA, to the result: after the K loop, after it
# in two [BLOCK_M, BLOCK_N / 2] halves, or with its load issued before the loop.
ACCUMULATE_MODES = {None: 0, "start": 1, "after": 2, "after_halves": 3, "prefetch": 4}


@triton.jit
def _gemm_kernel(
    a_desc,
    b_desc,
    c_desc,
    c_ptr,
    M,
    N,
    K,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_M_MAJOR: tl.constexpr,
    B_K_MAJOR: tl.constexpr,
    ACCUMULATE: tl.constexpr = 0,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    """C [M, N] (+)= A @ B; A stored [M, K] (or [K, M] with A_M_MAJOR), B stored [K, N] (or [N, K] with B_K_MAJOR);
    ACCUMULATE: a value of ACCUMULATE_MODES (fp32 sum, one rounding, in every mode)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        off_m, off_n = _tile_origin(tile_id, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        if ACCUMULATE == 1:
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            acc = tl.load(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if ACCUMULATE == 4:
            old = c_desc.load([off_m, off_n])
        for ki in range(k_tiles):
            if A_M_MAJOR:
                a = a_desc.load([ki * BLOCK_K, off_m]).T
            else:
                a = a_desc.load([off_m, ki * BLOCK_K])
            if B_K_MAJOR:
                b = b_desc.load([off_n, ki * BLOCK_K]).T
            else:
                b = b_desc.load([ki * BLOCK_K, off_n])
            acc = tl.dot(a, b, acc)
        if ACCUMULATE == 3:
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            old0 = c_desc.load([off_m, off_n])
            c_desc.store([off_m, off_n], (acc0 + old0.to(tl.float32)).to(tl.bfloat16))
            old1 = c_desc.load([off_m, off_n + BLOCK_N // 2])
            c_desc.store([off_m, off_n + BLOCK_N // 2], (acc1 + old1.to(tl.float32)).to(tl.bfloat16))
        else:
            if ACCUMULATE == 2:
                old = c_desc.load([off_m, off_n])
            if ACCUMULATE == 2 or ACCUMULATE == 4:
                acc += old.to(tl.float32)
            c_desc.store([off_m, off_n], acc.to(tl.bfloat16))


def product(
    kind: str, grad, h, w, out, config, num_sms: int, accumulate: str | None = None, warp_specialize: bool = False
):
    """dh = G @ W ([C, D]) or dW (+)= G.T @ h ([V, D]) with the generic kernel; ``accumulate``: a key of
    ACCUMULATE_MODES."""
    block_m, block_n, block_k, stages, warps = config
    if accumulate == "start":  # the loaded tile's layout change takes shared memory of its own: one stage fewer
        stages = max(2, stages - 1)
    if kind == "dh":
        m, k, n = grad.shape[0], grad.shape[1], w.shape[1]
        a_desc = TensorDescriptor.from_tensor(grad, [block_m, block_k])
        b_desc = TensorDescriptor.from_tensor(w, [block_k, block_n])
        a_m_major = False
    else:
        m, k, n = grad.shape[1], grad.shape[0], h.shape[1]
        a_desc = TensorDescriptor.from_tensor(grad, [block_k, block_m])
        b_desc = TensorDescriptor.from_tensor(h, [block_k, block_n])
        a_m_major = True
    c_desc = TensorDescriptor.from_tensor(out, [block_m, block_n // 2 if accumulate == "after_halves" else block_n])
    grid = (min(num_sms, triton.cdiv(m, block_m) * triton.cdiv(n, block_n)),)
    _gemm_kernel[grid](
        a_desc, b_desc, c_desc, out, m, n, k,
        NUM_SMS=num_sms, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        A_M_MAJOR=a_m_major, B_K_MAJOR=False, ACCUMULATE=ACCUMULATE_MODES[accumulate],
        WARP_SPECIALIZE=warp_specialize, num_stages=stages, num_warps=warps,
    )  # fmt: skip


def gemm(h, w, out, config, stats: bool, num_sms: int):
    block_m, block_n, block_k, stages, warps = config
    m, k = h.shape
    n = w.shape[0]
    n_tiles = triton.cdiv(n, block_n)
    tile_max = torch.empty(m, n_tiles, device=h.device, dtype=torch.float32) if stats else out
    tile_sum = torch.empty(m, n_tiles, device=h.device, dtype=torch.float32) if stats else out
    a_desc = TensorDescriptor.from_tensor(h, [block_m, block_k])
    b_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
    c_desc = TensorDescriptor.from_tensor(out, [block_m, block_n])
    grid = (min(num_sms, triton.cdiv(m, block_m) * n_tiles),)
    _gemm_stats_kernel[grid](
        a_desc, b_desc, c_desc, tile_max, tile_sum, m, n, k,
        NUM_SMS=num_sms, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, WRITE_STATS=stats,
        num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return tile_max, tile_sum


def probe(shape: str, rows: int, w: torch.Tensor, rounds: int, num_sms: int) -> list[dict]:
    d = w.shape[1]
    v = w.shape[0]
    h = torch.randn(rows, d, device=w.device, dtype=torch.bfloat16)
    out = torch.empty(rows, v, device=w.device, dtype=torch.bfloat16)
    reference = torch.mm(h, w.t())
    variants = {"cublas": lambda: torch.mm(h, w.t(), out=out)}
    for config in CONFIGS:
        try:
            tile_max, tile_sum = gemm(h, w, out, config, True, num_sms)
        except Exception as err:  # a configuration this GPU cannot hold (shared memory)
            print(f"{shape} C={rows} {config}: {type(err).__name__}: {str(err)[:120]}")
            continue
        lse = tile_max.max(1).values
        lse = lse + torch.log((tile_sum * torch.exp(tile_max - lse[:, None])).sum(1))
        lse_err = float((lse - torch.logsumexp(out.float(), 1)).abs().max())
        logits_err = float((out.float() - reference.float()).abs().max())
        print(f"{shape} C={rows} {config}: max |logits - cuBLAS| {logits_err:.3g}, max |lse err| {lse_err:.3g}")
        variants[f"triton {config}"] = lambda c=config: gemm(h, w, out, c, False, num_sms)
        variants[f"triton+stats {config}"] = lambda c=config: gemm(h, w, out, c, True, num_sms)
    return _time(shape, rows, "logits", variants, rounds, 2 * rows * v * d)


def probe_backward(shape: str, rows: int, w: torch.Tensor, rounds: int, num_sms: int) -> list[dict]:
    """The chunk's dh = G @ W and dW = G.T @ h on cuBLAS and on the generic Triton kernel."""
    d, v = w.shape[1], w.shape[0]
    h = torch.randn(rows, d, device=w.device, dtype=torch.bfloat16)
    grad = (torch.randn(rows, v, device=w.device) * 1e-3).to(torch.bfloat16)
    results = []
    for kind in ("dh", "dw"):
        out = torch.empty((rows, d) if kind == "dh" else (v, d), device=w.device, dtype=torch.bfloat16)
        reference = grad @ w if kind == "dh" else grad.t() @ h
        if kind == "dh":
            variants = {"cublas": lambda o=out: torch.mm(grad, w, out=o)}
        else:
            variants = {"cublas": lambda o=out: torch.mm(grad.t(), h, out=o)}
            variants["cublas addmm"] = lambda o=out: o.addmm_(grad.t(), h)
        for config in CONFIGS:
            try:
                product(kind, grad, h, w, out, config, num_sms)
            except Exception as err:
                print(f"{shape} C={rows} {kind} {config}: {type(err).__name__}: {str(err)[:120]}")
                continue
            error = float((out.float() - reference.float()).norm() / reference.float().norm())
            print(f"{shape} C={rows} {kind} {config}: rel err vs cuBLAS {error:.3g}")
            variants[f"triton {config}"] = lambda c=config, k=kind, o=out: product(k, grad, h, w, o, c, num_sms)
            if kind == "dw":
                variants[f"triton += {config}"] = lambda c=config, o=out: product(
                    "dw", grad, h, w, o, c, num_sms, "start"
                )
                for mode, ws in (
                    ("after", False),
                    ("after_halves", False),
                    ("after_halves", True),
                    ("prefetch", False),
                    ("prefetch", True),
                ):
                    for stage_count in (2, 3) if mode == "prefetch" else (config[3],):
                        cfg = (*config[:3], stage_count, config[4])
                        name = f"triton += {mode}{' ws' if ws else ''} {cfg}"
                        before = out.clone()
                        try:
                            product("dw", grad, h, w, out, cfg, num_sms, mode, ws)
                        except Exception as err:
                            print(f"{shape} C={rows} {name}: {type(err).__name__}: {str(err)[:160]}")
                            continue
                        expect = before.float() + reference.float()
                        error = float((out.float() - expect).norm() / expect.norm())
                        print(f"{shape} C={rows} {name}: rel err vs fp32 sum {error:.3g}")
                        variants[name] = lambda c=cfg, o=out, m=mode, x=ws: product(
                            "dw", grad, h, w, o, c, num_sms, m, x
                        )
        results += _time(shape, rows, kind, variants, rounds, 2 * rows * v * d)
    return results


def _time(shape, rows, kind, variants, rounds, flops) -> list[dict]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(triton.testing.do_bench(fn, warmup=25, rep=100))
    base = statistics.median(times["cublas"])
    results = []
    for name, values in times.items():
        ms = statistics.median(values)
        row = {"shape": shape, "rows": rows, "gemm": kind, "variant": name, "ms": ms, "tflops": flops / ms / 1e9}
        row["vs_cublas"] = ms / base
        results.append(row)
        print(
            f"{shape:11s} C={rows:5d} {kind:6s} {name:34s} {1e3 * ms:8.1f} us {row['tflops']:4.0f} TFLOP/s {ms / base:5.3f}x"
        )
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1024, 2048], help="chunk rows C")
    parser.add_argument("--shapes", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gemms", nargs="+", default=["logits", "backward"], choices=["logits", "backward"])
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/probe")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    results = []
    for shape in args.shapes:
        d, v = SHAPES[shape]
        w = (torch.randn(v, d, device=device) / d**0.5 * 2).to(torch.bfloat16)
        for rows in args.rows:
            if "logits" in args.gemms:
                results += probe(shape, rows, w, args.rounds, num_sms)
            if "backward" in args.gemms:
                results += probe_backward(shape, rows, w, args.rounds, num_sms)
    path = Path(args.out)
    path = path if path.suffix == ".json" else path / "probe_gemm_epilogue.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    path.write_text(json.dumps({**report, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
