"""The cross-entropy op's default chunking against every chunk size, at long sequences.

For each head (Llama-3-8B, Qwen2.5-7B, Gemma-2-2B with its softcap), token count N, data kind and
``skip_ignored`` setting: fused_linear_cross_entropy forward+backward (dh and dW, bf16, every 7th label
ignored, as bench_lce.py) at the default chunking and at each ``--chunk-sizes`` value; median time (CUDA
events, at least ``--reps`` calls and 0.3 s) and the peak memory allocated above the inputs during one call. The question
it answers: is the default within 1% of the fastest chunk size whose peak is no larger than the default's?
A chunk size that makes the same chunks as the default (``same_chunks_as_default``) is the same work and is
left out of that comparison: its difference is the run's noise.

    python3 benchmarks/chunk_sweep.py --heads llama3-8b --tokens 8192,32768,131072
    python3 benchmarks/chunk_sweep.py --tiny      # a tiny head on the CPU (smoke test of the script)

JSON to --out (default $OUT/chunk_sweep.json or runs/chunk_sweep.json), rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

# name -> (D, V, softcap)
HEADS = {
    "llama3-8b": (4096, 128256, None),
    "qwen2.5-7b": (3584, 152064, None),
    "gemma2-2b": (2304, 256000, 30.0),
    "tiny": (32, 300, None),
}


def measure(fn, device, reps: int) -> tuple[float, float | None]:
    """(median ms of fn() over at least ``reps`` calls and 0.3 s, peak MiB allocated above what was allocated
    before one call), after a warm-up call."""
    import statistics
    import time

    import torch

    fn()
    peak = None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    times = []
    while len(times) < reps or sum(times) < 300:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="llama3-8b,qwen2.5-7b,gemma2-2b", help=f"of {sorted(HEADS)}")
    parser.add_argument("--tokens", default="8192,32768,131072")
    parser.add_argument("--data", default="flat,peaked")
    parser.add_argument("--skip", default="off,on", help="skip_ignored settings to run: off, on")
    parser.add_argument("--chunk-sizes", default="1024,2048,4096,8192")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the tiny head on the CPU")
    default_out = os.path.join(os.environ.get("OUT", str(REPO / "runs")), "chunk_sweep.json")
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()

    import torch
    from bench_common import device_and_dtype, env_info, free, make_inputs

    from lce_patch import fused_linear_cross_entropy
    from lce_patch.ops.core.chunking import chunk_spans, resolve_chunks

    device, dtype = device_and_dtype(args.tiny)
    heads = ["tiny"] if args.tiny else args.heads.split(",")
    tokens = [64] if args.tiny else [int(n) for n in args.tokens.split(",")]
    sizes = [16, 32] if args.tiny else [int(c) for c in args.chunk_sizes.split(",")]
    backend = "triton" if device.type == "cuda" else "torch"
    rows = []
    for head in heads:
        dim, vocab, softcap = HEADS[head]
        for n in tokens:
            for data in args.data.split(","):
                hidden, weight, labels = make_inputs(
                    n, dim, vocab, dtype=dtype, device=device, data=data, softcap=softcap
                )
                hidden = hidden.to(dtype).requires_grad_(True)
                weight = weight.requires_grad_(True)
                num_valid = int((labels != -100).sum())
                for skip in args.skip.split(","):
                    row = dict(head=head, N=n, data=data, skip_ignored=skip == "on", results={})
                    for chunk in [None, *sizes]:
                        options = dict(softcap=softcap, backend=backend, chunk_size=chunk)
                        if skip == "on":
                            options.update(skip_ignored=True, num_valid_tokens=num_valid)

                        def step(options=options, hidden=hidden, weight=weight, labels=labels):
                            hidden.grad = weight.grad = None
                            fused_linear_cross_entropy(hidden, weight, labels, **options).backward()

                        try:
                            ms, peak = measure(step, device, args.reps)
                            row["results"][str(chunk or "default")] = dict(ms=ms, peak_mib=peak)
                        except torch.OutOfMemoryError as exc:
                            row["results"][str(chunk or "default")] = dict(error=str(exc)[:120])
                        free()
                    default = row["results"]["default"]
                    # a chunk_size that makes the default's chunks is the same work: its difference is noise
                    processed = num_valid if skip == "on" else n
                    default_spans = resolve_chunks(None, processed, hidden, weight, backend == "triton", True)
                    same = [str(c) for c in sizes if chunk_spans(processed, c) == default_spans]
                    row["same_chunks_as_default"] = same
                    fits = [
                        (r["ms"], name)
                        for name, r in row["results"].items()
                        if "ms" in r
                        and name not in same
                        and (r["peak_mib"] is None or r["peak_mib"] <= default.get("peak_mib", 0) * 1.001)
                    ]
                    best_ms, best = min(fits)
                    row["best_at_no_more_memory"] = best
                    row["default_over_best_pct"] = 100 * (default["ms"] / best_ms - 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps(dict(env=env_info(), rows=rows), indent=1))
                del hidden, weight, labels
                free()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
