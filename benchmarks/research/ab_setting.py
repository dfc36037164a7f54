"""A/B of one module-level setting of the chunked op, in one process, on the shapes of bench_lce.py.

``--setting NAME=A,B`` names a constant of ``lce_patch.ops.core.chunking`` or ``lce_patch.ops.core.grads`` and two values
(Python literals), e.g. ``OVERLAP_WEIGHT_GRADS=True,False`` (dW GEMMs on a second stream or not) or
``TAIL_FOLD_FRACTION=8,1000000000`` (a short last chunk folded into the one before, or never). For each
shape and token count N it times ``fused_linear_cross_entropy`` forward+backward (bf16, peaked data,
``--ignore-every`` as in the benchmark, optionally ``skip_ignored``) under each value, alternating which
goes first over ``--rounds`` rounds, and records the median, the peak memory above the inputs and the
chunk spans of each. Needs a CUDA GPU. Prints JSON lines; writes them to ``--out`` (default
``$OUT/ab_setting.json``).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # lce_patch from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_common, bench_lce from benchmarks/

from bench_common import IGNORE, env_info, make_inputs  # noqa: E402
from bench_lce import SHAPES  # noqa: E402

from lce_patch.ops.core import chunking, grads  # noqa: E402
from lce_patch.ops.linear_cross_entropy import fused_linear_cross_entropy  # noqa: E402


def setting_module(setting: str):
    """The core module that holds ``setting`` (the chunk policy's or the gradient accumulation's), or None."""
    return next((module for module in (chunking, grads) if hasattr(module, setting)), None)


def measure(name: str, n: int, setting: str, values: list, args) -> dict:
    import triton.testing

    _, d, v, softcap, frozen = SHAPES[name]
    h, w, y = make_inputs(
        n, d, v, dtype=torch.bfloat16, device="cuda", data="peaked", softcap=softcap, ignore_every=args.ignore_every
    )
    h.requires_grad_(True)
    w.requires_grad_(not frozen)
    leaves = [h] if frozen else [h, w]

    def step():
        fused_linear_cross_entropy(h, w, y, softcap=softcap, skip_ignored=args.skip_ignored).backward()

    module = setting_module(setting)
    original = getattr(module, setting)
    times: list[list[float]] = [[] for _ in values]
    row: dict = {"shape": name, "n": n, "setting": setting, "skip_ignored": args.skip_ignored}
    try:
        for round_index in range(args.rounds):
            order = range(len(values)) if round_index % 2 == 0 else reversed(range(len(values)))
            for index in order:
                setattr(module, setting, values[index])
                times[index].append(
                    triton.testing.do_bench(step, warmup=10, rep=150, grad_to_none=leaves, return_mode="median")
                )
        for index, value in enumerate(values):
            setattr(module, setting, value)
            for leaf in leaves:
                leaf.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            processed = int((y != IGNORE).sum()) if args.skip_ignored else n  # the rows the op chunks
            chunks = chunking.resolve_chunks(None, processed, h, w, True, True)
            row[repr(value)] = {
                "ms": statistics.median(times[index]),
                "ms_rounds": times[index],
                "peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20,
                "chunks": len(chunks),
                "last_two_chunk_rows": [stop - start for start, stop in chunks[-2:]],
            }
    finally:
        setattr(module, setting, original)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--setting", required=True, help="NAME=A,B: a constant of core/chunking.py or core/grads.py and two values"
    )
    p.add_argument("--shapes", default="llama3-8b,qwen2.5-7b,gemma2-2b", help=f"from: {', '.join(SHAPES)}")
    p.add_argument("--n", default="", help="comma list of token counts (default: each shape's own N)")
    p.add_argument("--ignore-every", type=int, default=0, help="every k-th label ignored (0: none)")
    p.add_argument("--skip-ignored", action="store_true")
    p.add_argument("--rounds", type=int, default=4)
    default_out = os.path.join(os.environ["OUT"], "ab_setting.json") if os.environ.get("OUT") else None
    p.add_argument("--out", default=default_out)
    args = p.parse_args(argv)
    setting, _, raw_values = args.setting.partition("=")
    if setting_module(setting) is None:
        p.error(f"neither core/chunking.py nor core/grads.py has a setting {setting!r}")
    values = [ast.literal_eval(value) for value in raw_values.split(",")]
    if not torch.cuda.is_available():
        print("ab_setting.py needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for name in args.shapes.split(","):
        for n in [int(value) for value in args.n.split(",") if value] or [SHAPES[name][0]]:
            rows.append(measure(name, n, setting, values, args))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"env": env_info(), "args": vars(args), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
