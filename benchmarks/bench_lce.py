"""Benchmark: lce_patch's fused linear cross-entropy beside the unfused path, torch.compile and the peers.

One process, one CUDA device, every method on the same inputs (``bench_common.make_inputs``: bf16 h [N, D]
and W [V, D] with requires_grad, int64 labels with every 7th = -100; "flat" or "peaked" data).

Per method and shape:
  * fwd+bwd: ``triton.testing.do_bench`` median (gradients reset to None outside the timed region);
    forward-only under no_grad for lce_patch / unfused / compile. ``--rounds`` (default 3) times every
    method of a shape once per round, in turn, and reports the median of the rounds.
  * peak: max_memory_allocated during one fwd+bwd minus what was allocated before (inputs), so it
    includes dh and dW, which every method must produce.
  * errors vs an fp32 chunked reference on the same bf16 inputs: loss relative error, relative L2 of
    dh and dW (the unfused bf16 path's errors are the yardstick: the target is <= 1.25x them).
  * floors: 6*N*V*D FLOPs (4 frozen; 2 forward-only) at the bf16 rate of an 8192^3 mm measured in this
    run, and the workload's own cuBLAS GEMMs at full N (logits h.W^T, dh = G.W, dW = G^T.h; no dW when
    frozen): "% floor" = floor / time.

Methods: lce_patch (backend triton, default chunking), lce_patch_skip
(the same with skip_ignored=True: matmuls on the non-ignored rows only, given the count of those rows as
a patched model is: it starts the count before the decoder runs, so reading it stalls nothing; here it is
taken once outside the timed region), lce_patch_skip_sync (opt-in: the op counts the rows itself, a
host sync inside the timed region), lce_patch_fp32dw (opt-in: lce_patch with ``fp32_weight_grad=True``),
lce_patch_skip[c=N] (``--chunk-sizes``: lce_patch_skip with
chunk_size=N), unfused (F.linear,
float, F.cross_entropy; softcap in bf16 as Hugging Face does), compile (torch.compile of unfused), liger
(LigerFusedLinearCrossEntropyLoss 0.8.5), cce (cut_cross_entropy.linear_cross_entropy, default filter),
cce_nofilter (filter_eps=None, opt-in), lce_patch_tokens (opt-in: per-token log-probs, entropy and
argmax flags reduced to TRL's SFT loss, as the TRL integration runs it), trl (TRL 1.16 fused head: ChunkedLogProbFunction on hidden[mask],
32768-wide vocab tiles, outputs=("log_probs",) (SFTTrainer also asks for entropy and is_top1, slightly more
work), -log_probs.sum() / n_valid). A peer that is missing or fails is reported in its row, not fatal.

Peers on the GPU machine (no registry there), from the repository root (wheels in .whl/, carried):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    PYTHONUNBUFFERED=1 python3 benchmarks/bench_lce.py            # all shapes, both data kinds
    python3 benchmarks/bench_lce.py --quick                       # llama3-8b + gemma2-2b, peaked
The JSON names the commit from git; on a copy whose .git is not the checkout's (the GPU machine's), set
LCE_BENCH_COMMIT=<commit> to record it (checks/gpu_check.py does the same).
TRL's backward imports trl.trainer.utils (needs `datasets`); if that import fails, a stand-in module
provides the one name it uses (a ZeRO-3 gather context, a no-op on one GPU); the JSON records which.
Output: a markdown table per shape on stdout, JSON to --out (default $OUT/bench.json when OUT is set),
rewritten after every shape so a run cut short keeps what it measured, and the same report as markdown
beside it (bench.md). ``--budget-min`` (default 8) starts no new shape/data block after that many minutes
and lists the rest as skipped: run them again with ``--shapes``/``--data``.
Expected time on an H100 (estimates; torch.compile recompiles per shape, ~30 s each): --quick about
3 min; the default 9 shapes x 2 data kinds about 9-10 min, so the last blocks may be skipped by the budget
(``--data peaked`` and ``--data flat`` as two calls fit comfortably).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F
from bench_common import (
    ERROR_COLUMNS,
    IGNORE,
    add_timing_args,
    cells,
    env_info,
    fmt,
    free,
    make_inputs,
    reference,
    rel_err,
    rel_l2,
    set_exact_fp32,
    write_markdown,
)

# name: (N, D, V, softcap, frozen weight)
SHAPES = {
    "llama3-8b": (8192, 4096, 128256, None, False),
    "gemma2-2b": (8192, 2304, 256000, 30.0, False),
    "llama3-8b-frozen": (8192, 4096, 128256, None, True),
    "gemma2-2b-frozen": (8192, 2304, 256000, 30.0, True),  # LoRA on Gemma-2: the one-pass gradient
    "llama3-8b-n1024": (1024, 4096, 128256, None, False),
    "llama3-8b-n4096": (4096, 4096, 128256, None, False),
    "llama3-8b-n16384": (16384, 4096, 128256, None, False),
    "llama3-8b-n32768": (32768, 4096, 128256, None, False),
    "llama3-8b-n65536": (65536, 4096, 128256, None, False),
    "gemma2-2b-n32768": (32768, 2304, 256000, 30.0, False),
    "gemma2-2b-n65536": (65536, 2304, 256000, 30.0, False),
    "qwen2.5-7b": (8192, 3584, 152064, None, False),
    "mistral-7b": (8192, 4096, 32768, None, False),
    # Small models' heads (hidden sizes of 896-2048 against vocabularies of 128k-262k), 16384 tokens
    "qwen2.5-0.5b": (16384, 896, 151936, None, False),
    "qwen3-0.6b": (16384, 1024, 151936, None, False),
    "gemma3-1b": (16384, 1152, 262144, None, False),
    "qwen3-1.7b": (16384, 2048, 151936, None, False),
    "llama3.2-1b": (16384, 2048, 128256, None, False),
}
METHODS = ("lce_patch", "lce_patch_skip", "unfused", "compile", "liger", "cce", "trl")
OPTIONAL_METHODS = ("cce_nofilter", "lce_patch_tokens", "lce_patch_skip_sync", "lce_patch_fp32dw")
FWD_ONLY = ("lce_patch", "lce_patch_skip", "lce_patch_skip_sync", "unfused", "compile")


# ----------------------------------------------------------------------------------------------- methods
def hf_unfused(h, w, y, softcap):
    z = F.linear(h, w)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z.float(), y, ignore_index=IGNORE)


_COMPILED = {}  # the compiled unfused function (one per process, so its graphs cache) and TRL's import mode
_GEMM_FLOORS = {}  # shape name -> ms, measured once per shape


def _trl_backward_import() -> str:
    """TRL's backward imports trl.trainer.utils (which needs `datasets`) for a ZeRO-3 gather context only."""
    try:
        import trl.trainer.utils  # noqa: F401

        return "real"
    except Exception as exc:  # any import failure: stand in the one name the backward needs
        stub = types.ModuleType("trl.trainer.utils")
        stub.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        sys.modules["trl.trainer.utils"] = stub
        return f"stub ({type(exc).__name__}: {str(exc)[:120]})"


def build(method: str, h, w, y, softcap):
    """A zero-argument callable returning the scalar mean loss; raises if the method is unavailable."""
    if method == "lce_patch":
        from lce_patch import fused_linear_cross_entropy

        return lambda: fused_linear_cross_entropy(h, w, y, softcap=softcap, backend="triton")
    if method == "lce_patch_fp32dw":
        from lce_patch import fused_linear_cross_entropy

        return lambda: fused_linear_cross_entropy(h, w, y, softcap=softcap, backend="triton", fp32_weight_grad=True)
    if method == "lce_patch_skip_sync":
        from lce_patch import fused_linear_cross_entropy

        # The op counts the non-ignored labels itself: a host sync inside the timed region.
        return lambda: fused_linear_cross_entropy(h, w, y, softcap=softcap, backend="triton", skip_ignored=True)
    if method == "lce_patch_skip" or method.startswith("lce_patch_skip[c="):
        from lce_patch import fused_linear_cross_entropy
        from lce_patch.ops import start_valid_token_count

        chunk = int(method[len("lce_patch_skip[c=") : -1]) if "[" in method else None
        # What a patched model runs: the count of non-ignored labels is started before the decoder
        # (start_valid_token_count) and read after it, so it stalls nothing; here it is taken once,
        # outside the timed region (the labels do not change between calls).
        n_valid = start_valid_token_count(y, IGNORE)()
        return lambda: fused_linear_cross_entropy(
            h, w, y, softcap=softcap, backend="triton", skip_ignored=True, num_valid_tokens=n_valid, chunk_size=chunk
        )
    if method == "lce_patch_tokens":
        from lce_patch import fused_linear_log_probs
        from lce_patch.ops import start_valid_token_count

        n_valid = start_valid_token_count(y, IGNORE)()  # as the TRL integration does, before the decoder

        def sft_loss():  # what TRL's SFTTrainer does with the head that FusedLCECallback serves
            out = fused_linear_log_probs(
                h, w, y, softcap=softcap, backend="triton", return_entropy=True, return_is_top1=True,
                skip_ignored=True, num_valid_tokens=n_valid, precompute_grad=True,
            )  # fmt: skip
            return -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)

        return sft_loss
    if method == "unfused":
        return lambda: hf_unfused(h, w, y, softcap)
    if method == "compile":
        if "fn" not in _COMPILED:
            _COMPILED["fn"] = torch.compile(hf_unfused, dynamic=False)
        fn = _COMPILED["fn"]
        return lambda: fn(h, w, y, softcap)
    if method == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        mod = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, softcap=softcap)
        return lambda: mod(w, h, y)
    if method in ("cce", "cce_nofilter"):
        from cut_cross_entropy import linear_cross_entropy

        kw = {"filter_eps": None} if method == "cce_nofilter" else {}
        return lambda: linear_cross_entropy(h, w, y, ignore_index=IGNORE, softcap=softcap, **kw)
    if method == "trl":
        from trl.kernels import ChunkedLogProbFunction

        _COMPILED.setdefault("trl_import", _trl_backward_import())

        def trl_head():
            mask = y != IGNORE
            lp = ChunkedLogProbFunction.apply(h[mask], w, None, y[mask], 1.0, 32768, softcap, 1.0, ("log_probs",))
            return -lp[0].sum() / mask.sum().clamp(min=1)

        return trl_head
    raise ValueError(f"unknown method {method!r}")


# ----------------------------------------------------------------------------------------------- timing
def bench_ms(fn, args, grad_to_none=None) -> float:
    """Median ms; the repetition window is at least min_reps calls of a first estimate."""
    import triton.testing

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    est = start.elapsed_time(end)
    rep = max(args.rep, args.min_reps * est)
    return triton.testing.do_bench(fn, warmup=args.warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def matmul_tflops(args) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, args)
    return 2 * 8192**3 / ms / 1e9


def gemm_floor_ms(n, d, v, frozen, args) -> float:
    """Time of the workload's own cuBLAS GEMMs at full N on random bf16 data."""
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * 0.02
    g = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
    total = bench_ms(lambda: torch.mm(h, w.t(), out=g), args)  # g now holds random-looking values
    total += bench_ms(lambda: torch.mm(g, w, out=dh), args)
    if not frozen:
        dw = torch.empty(v, d, device="cuda", dtype=torch.bfloat16)
        total += bench_ms(lambda: torch.mm(g.t(), h, out=dw), args)
    return total


# ----------------------------------------------------------------------------------------------- one method
def run_method(method, h, w, y, softcap, ref, args) -> dict:
    row: dict = {"method": method}
    try:
        fn = build(method, h, w, y, softcap)
        fn().backward()  # warm-up: compilation and autotuning stay out of the memory reading
        h.grad = w.grad = None
        free()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["loss"] = loss.item()
        row["loss_rel_err"] = rel_err(row["loss"], ref["loss"])
        row["dh_rel_err"] = rel_l2(h.grad, ref["dh"])
        row["dW_rel_err"] = rel_l2(w.grad, ref["dW"]) if w.requires_grad else None
        del loss
        h.grad = w.grad = None

        def step():
            fn().backward()

        row["ms_rounds"] = [bench_ms(step, args, grad_to_none=[h, w])]
        if method in FWD_ONLY or "[c=" in method:
            with torch.no_grad():
                fn()
                row["fwd_ms_rounds"] = [bench_ms(fn, args)]
    except Exception as exc:  # a failing peer is a result, not a crash
        row["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    finally:
        h.grad = w.grad = None
        free()
    return row


def retime(row, h, w, y, softcap, args) -> None:
    """One more timing round of a method that ran (its correctness and memory were read once)."""
    try:
        fn = build(row["method"], h, w, y, softcap)
        row["ms_rounds"].append(bench_ms(lambda: fn().backward(), args, grad_to_none=[h, w]))
        if "fwd_ms_rounds" in row:
            with torch.no_grad():
                row["fwd_ms_rounds"].append(bench_ms(fn, args))
    except Exception as exc:  # keep the rounds measured so far
        row.setdefault("retime_errors", []).append(f"{type(exc).__name__}: {str(exc)[:200]}")
    finally:
        h.grad = w.grad = None
        free()


def run_shape(name, data, methods, args, tflops) -> dict:
    n, d, v, softcap, frozen = SHAPES[name]
    torch.manual_seed(0)
    h, w, y = make_inputs(n, d, v, dtype=torch.bfloat16, device="cuda", data=data, softcap=softcap, seed=1)
    h.requires_grad_(True)
    w.requires_grad_(not frozen)
    loss_tok, dh_ref, dw_ref, _ = reference(h, w, y, softcap=softcap, grads=(True, not frozen, False))
    n_valid = int((y != IGNORE).sum())
    ref = {"loss": loss_tok.double().sum().item() / n_valid, "dh": dh_ref, "dW": dw_ref}
    del loss_tok
    free()
    flops = (4 if frozen else 6) * n * v * d
    block = {
        "shape": name,
        "data": data,
        "N": n,
        "D": d,
        "V": v,
        "softcap": softcap,
        "frozen_W": frozen,
        "n_valid": n_valid,
        "ref_loss": ref["loss"],
        "floor_ms": flops / tflops / 1e9,
        "fwd_floor_ms": 2 * n * v * d / tflops / 1e9,
        "gemm_floor_ms": _GEMM_FLOORS.get(name) or _GEMM_FLOORS.setdefault(name, gemm_floor_ms(n, d, v, frozen, args)),
        "rows": [],
    }
    free()
    for method in methods:
        t0 = time.time()
        row = run_method(method, h, w, y, softcap, ref, args)
        row["wall_s"] = round(time.time() - t0, 1)
        block["rows"].append(row)
        print(f"  {name}/{data} {method}: " + (row.get("error") or f"{row['ms_rounds'][0]:.2f} ms"), flush=True)
    # The GPU's clocks drift over a long run (power and heat), which favours whichever method runs
    # first; more rounds, each over every method in turn, and the median of the rounds even that out.
    for _ in range(args.rounds - 1):
        for row in block["rows"]:
            if "error" not in row:
                retime(row, h, w, y, softcap, args)
    for row in block["rows"]:
        if "error" in row:
            continue
        row["ms"] = statistics.median(row["ms_rounds"])
        row["pct_floor"] = 100 * block["floor_ms"] / row["ms"]
        row["pct_gemm_floor"] = 100 * block["gemm_floor_ms"] / row["ms"]
        if "fwd_ms_rounds" in row:
            row["fwd_ms"] = statistics.median(row["fwd_ms_rounds"])
            row["pct_fwd_floor"] = 100 * block["fwd_floor_ms"] / row["fwd_ms"]
    del h, w, y, ref, dh_ref, dw_ref
    free()
    return block


# ----------------------------------------------------------------------------------------------- report
_f = fmt  # a cell: "–" for None and NaN
# The columns of a shape's table after the method: (key, format)
COLUMNS = (
    ("ms", ".2f"),
    ("pct_floor", ".0f"),
    ("pct_gemm_floor", ".0f"),
    ("fwd_ms", ".2f"),
    ("pct_fwd_floor", ".0f"),
    *ERROR_COLUMNS,
)


def table(block) -> str:
    b = block
    head = (
        f"### {b['shape']} (N={b['N']}, D={b['D']}, V={b['V']}"
        + (f", softcap {b['softcap']:g}" if b["softcap"] else "")
        + (", W frozen" if b["frozen_W"] else "")
        + f"), {b['data']} data, ref loss {b['ref_loss']:.3f}: floor {b['floor_ms']:.1f} ms, "
        f"GEMM floor {b['gemm_floor_ms']:.1f} ms, fwd floor {b['fwd_floor_ms']:.1f} ms\n\n"
        "| method | fwd+bwd ms | % floor | % GEMM floor | fwd ms | % fwd floor | peak MiB "
        "| loss rel err | dh rel err | dW rel err |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in b["rows"]:
        if "error" in r:
            lines.append(f"| {r['method']} | error: {r['error'][:100]} |||||||||")
            continue
        lines.append(f"| {r['method']} | {cells(r, COLUMNS)} |")
    return head + "\n".join(lines) + "\n"


def summary(blocks) -> str:
    """lce_patch per shape: % of floors, memory, and speedup over every other method (their ms / ours)."""
    ours_methods = ("lce_patch", "lce_patch_skip", "lce_patch_tokens")
    others = [m for m in METHODS + OPTIONAL_METHODS if m not in ours_methods]
    out = ["| shape | data | ours | ms | % floor | % GEMM floor | peak MiB | leanest peer MiB | "
           + " | ".join(f"vs {m}" for m in others) + " |"]  # fmt: skip
    out.append("|---" * (8 + len(others)) + "|")
    for b in blocks:
        rows = {r["method"]: r for r in b["rows"] if "ms" in r}
        peers = [rows[m]["peak_mib"] for m in ("liger", "cce", "cce_nofilter", "trl", "compile") if m in rows]
        for name in ours_methods:
            ours = rows.get(name)
            if ours is None:
                continue
            ratios = [f"{rows[m]['ms'] / ours['ms']:.2f}x" if m in rows else "–" for m in others]
            out.append(
                f"| {b['shape']} | {b['data']} | {name} | {ours['ms']:.2f} | {ours['pct_floor']:.0f} "
                f"| {ours['pct_gemm_floor']:.0f} | {ours['peak_mib']:.0f} | {_f(min(peers, default=None), '.0f')} | "
                + " | ".join(ratios)
                + " |"
            )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list from: {', '.join(SHAPES)}")
    p.add_argument("--data", choices=("flat", "peaked", "both"), default="both")
    p.add_argument("--methods", default=",".join(METHODS), help=f"from {METHODS + OPTIONAL_METHODS}")
    p.add_argument("--chunk-sizes", default="", help="comma list of chunk_size values: adds lce_patch_skip[c=...] rows")
    p.add_argument("--quick", action="store_true", help="llama3-8b and gemma2-2b, peaked data only")
    add_timing_args(p, rounds=3, budget_min=8.0, out_name="bench.json")
    args = p.parse_args(argv)

    if args.quick:
        args.shapes, args.data = "llama3-8b,gemma2-2b", "peaked"
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS + OPTIONAL_METHODS]
    if unknown or bad:
        p.error(f"unknown shapes {unknown} / methods {bad}")
    methods += [f"lce_patch_skip[c={int(c)}]" for c in args.chunk_sizes.split(",") if c]
    datas = ["peaked", "flat"] if args.data == "both" else [args.data]
    if not torch.cuda.is_available():
        print("bench_lce.py needs a CUDA device", file=sys.stderr)
        return 2

    t_start = time.time()
    set_exact_fp32()
    for name in ("recompile_limit", "cache_size_limit"):  # one compiled graph per shape and grad mode
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    env = env_info()
    tflops = matmul_tflops(args)
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | bf16 mm {tflops:.0f} TFLOP/s")
    result = {"env": env, "tflops": tflops, "args": vars(args), "blocks": [], "skipped": []}
    for name in shapes:
        for data in datas:
            if time.time() - t_start > 60 * args.budget_min:
                result["skipped"].append(f"{name}/{data}")
                continue
            block = run_shape(name, data, methods, args, tflops)
            block["wall_s"] = round(time.time() - t_start, 1)
            result["blocks"].append(block)
            result["env"]["trl_backward_import"] = _COMPILED.get("trl_import")
            print(table(block), flush=True)
            if args.out:
                with open(args.out, "w") as fh:
                    json.dump(result, fh, indent=1)

    env = result["env"]
    title = (
        f"## lce_patch benchmark: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"liger {env['liger_kernel']}, cce {env['cut_cross_entropy']}, trl {env['trl']} "
        f"(backward import: {env.get('trl_backward_import')}), lce_patch {env['lce_patch']} ({env['git']}), "
        f"{env['date']}; bf16 mm {tflops:.0f} TFLOP/s"
    )
    write_markdown(title, result, args, time.time() - t_start, table, summary, "Summary")
    return 0


if __name__ == "__main__":
    sys.exit(main())
