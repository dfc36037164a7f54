"""Shared helpers for ``bench_lce.py`` and ``checks/gpu_check.py``: inputs, the fp32 reference, errors, versions.

Nothing here touches CUDA at import time; every function takes the device from its arguments.

Inputs (``make_inputs``): hidden ~ N(0, 1), weight ~ N(0, logit_std^2 / D) so that the raw logits have a
spread of about ``logit_std``; every ``ignore_every``-th label is ``ignore_index``.
  * ``flat``: as drawn (loss about ln V + logit_std^2 / 2, e.g. 12.3 nats for V = 128256).
  * ``peaked``: each valid token's hidden state gets ``beta * W[label] / |W[label]|^2`` added, which raises
    its target logit by exactly ``beta``; ``beta`` is found by bisection on a subsample (softcap included) so
    that the mean loss is about ``target_loss`` (1.5 nats), like fine-tuning a pretrained model.

Reference (``reference``): the same bf16/fp16/fp32 inputs upcast to ``ref_dtype`` (fp32 by default, TF32 off),
token chunks through torch autograd, so it never holds more than a bounded [chunk, V] block.
"""

from __future__ import annotations

import datetime
import gc
import importlib.metadata
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # lce_patch from this checkout, not an installed copy

IGNORE = -100
# The CUDA runtime and driver calls that launch a kernel, as torch.profiler names them (launch counts).
CUDA_LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"})
# NVLink multicast off in NCCL, PyTorch and NVSHMEM: on shared hosts a program using it can take the GPUs down.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# What an out of memory reads as where it does not come as torch.OutOfMemoryError: cuBLAS's failed workspace
# allocation, a CUDA error saying so, and NCCL's "unhandled cuda error" (how it surfaced inside ring attention's
# exchange); any other CUDA or NCCL error (an illegal memory access, a timeout) is a failure, not "does not fit"
DEVICE_OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "unhandled cuda error")


def out_of_memory(error: BaseException) -> str | None:
    """How ``error`` says out of memory (None when it does not): ``"out of memory"`` for the caching allocator's
    error, else "out of memory (surfaced as: ...)" for a CUDA or NCCL error that reads as one (``DEVICE_OOM_MARKERS``;
    inside ring attention's exchange an out of memory came as ``NCCL Error 1: unhandled cuda error``), after which
    the process group and the CUDA context are not to be trusted. Other errors, an illegal memory access among them,
    are None: the callers report them as failures."""
    if isinstance(error, torch.OutOfMemoryError):
        return "out of memory"
    text = str(error)
    if isinstance(error, RuntimeError) and any(marker in text for marker in DEVICE_OOM_MARKERS):
        return f"out of memory (surfaced as: {text.splitlines()[0][:200] if text else type(error).__name__})"
    return None


def set_exact_fp32() -> None:
    """fp32 matmuls in full fp32 (no TF32), so the reference is a reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


TREE_MANIFEST = ".tree.json"  # written by checks/run_all.py --export beside a committed tree without .git


def _blob_sha(path: Path) -> str:
    """git's object name of a file's content (``git hash-object``)."""
    import hashlib

    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tree_state(repo: Path = REPO) -> dict:
    """The commit this code is, and whether it is that commit: ``{"commit", "dirty", "source"}``.

    In a copy made by ``git archive`` (``checks/run_all.py --export``, what is sent to a GPU machine): the manifest
    it wrote, every listed file's content checked against its recorded object name. In a git checkout: HEAD, dirty
    when a tracked file differs from it. Otherwise the commit named by ``LCE_BENCH_COMMIT``, unverified."""
    manifest = repo / TREE_MANIFEST
    if manifest.is_file():
        import json

        listed = json.loads(manifest.read_text())
        changed = [
            name
            for name, sha in listed["files"].items()
            if not (repo / name).is_file() or _blob_sha(repo / name) != sha
        ]
        return {"commit": listed["commit"], "dirty": bool(changed), "changed": changed[:20], "source": "manifest"}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            status = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=repo,
                capture_output=True,
                text=True,
                timeout=30,
            )
            return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()), "source": "git"}
    except (OSError, subprocess.SubprocessError):
        pass
    named = os.environ.get("LCE_BENCH_COMMIT")
    return {"commit": named, "dirty": None, "source": "LCE_BENCH_COMMIT (unverified)" if named else None}


def git_revision() -> str | None:
    """Short commit of this code, with "+dirty" for changes to its tracked files (see :func:`tree_state`)."""
    state = tree_state()
    if not state["commit"]:
        return None
    return state["commit"][:7] + ("+dirty" if state["dirty"] else "")


def refuse_dirty_tree() -> None:
    """With ``LCE_BENCH_REQUIRE_CLEAN=1`` (``checks/run_all.py`` sets it): stop unless this code is a commit, so
    that every result it writes names the code that made it."""
    if os.environ.get("LCE_BENCH_REQUIRE_CLEAN", "0") != "1":
        return
    state = tree_state()
    if not state["commit"] or state["dirty"] is not False:
        raise SystemExit(
            f"refusing to run: the code is not a clean commit ({state}); commit it, or run checks/run_all.py "
            "--export DIR and run from DIR (LCE_BENCH_REQUIRE_CLEAN=0 to run anyway)"
        )


def argv_without(argv: list[str], names: tuple[str, ...], flags: tuple[str, ...] = ()) -> list[str]:
    """``argv`` less the options ``names`` with their values (``--name value`` and ``--name=value``) and the
    value-less ``flags``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in flags:
            continue
        if arg in names:
            skip = True
            continue
        if arg.split("=", 1)[0] in names:
            continue
        out.append(arg)
    return out


def out_path(out: str | Path, name: str) -> Path:
    """``out`` itself when it names a .json file, else ``out/name.json``."""
    out = Path(out)
    return out if out.suffix == ".json" else out / f"{name}.json"


def fmt(value: Any, spec: str) -> str:
    """``value`` formatted by ``spec``; "–" for None and NaN (a cell of a results table)."""
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


# The columns every op benchmark's table ends with: memory and the errors against fp32, (key, format)
ERROR_COLUMNS = (("peak_mib", ".0f"), ("loss_rel_err", ".1e"), ("dh_rel_err", ".1e"), ("dW_rel_err", ".1e"))


def cells(row: dict, columns: tuple[tuple[str, str], ...]) -> str:
    """A markdown table row's cells: ``row[key]`` by ``spec`` for each ``(key, spec)`` of ``columns``."""
    return " | ".join(fmt(row.get(key), spec) for key, spec in columns)


def add_timing_args(parser, rounds: int, budget_min: float, out_name: str) -> None:
    """The op benchmarks' do_bench and report options: --warmup, --rep, --min-reps, --rounds, --budget-min, --out
    (default ``$OUT/out_name`` when OUT is set), --md."""
    parser.add_argument("--warmup", type=float, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=float, default=100, help="do_bench repetition window, ms (at least)")
    parser.add_argument("--min-reps", type=int, default=8, help="widen the window to this many calls")
    parser.add_argument(
        "--rounds", type=int, default=rounds, help="timing rounds over all methods; the median is reported"
    )
    parser.add_argument(
        "--budget-min", type=float, default=budget_min, help="start no new shape after this many minutes"
    )
    default_out = os.path.join(os.environ["OUT"], out_name) if os.environ.get("OUT") else None
    parser.add_argument("--out", default=default_out, help=f"JSON path (default $OUT/{out_name} if OUT is set)")
    parser.add_argument("--md", default=None, help="markdown report path (default: --out with .md)")


def add_out_arg(parser, folder: str, help: str = "folder of the JSON (or its path)") -> None:
    """--out: $OUT, else runs/<folder> of the checkout."""
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / folder), help=help)


def add_sharded_head_args(parser, shapes: dict, tokens: str, tokens_help: str, warmup: int, steps: int) -> None:
    """The vocabulary-parallel head benchmarks' options: --shapes (of ``shapes``), --tokens, --warmup, --steps,
    --cpu."""
    parser.add_argument("--shapes", default=",".join(shapes), help=f"comma-separated, of {sorted(shapes)}")
    parser.add_argument("--tokens", default=tokens, help=tokens_help)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes, fp32, CPU processes over gloo (smoke test)")


def init_distributed(cpu: bool) -> torch.device:
    """Join the launch's process group: gloo on the CPU, or NCCL bound to this rank's GPU (LOCAL_RANK)."""
    import torch.distributed as dist

    if cpu:
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def write_markdown(title: str, result: dict, args, seconds: float, table, summary, summary_title: str) -> None:
    """A benchmark's markdown report: ``title``, ``table(block)`` per shape, ``summary(blocks)`` under
    ``summary_title``, the shapes skipped past ``--budget-min``; written to ``--md`` (or beside ``--out``) and
    printed with the time it took."""
    blocks = result["blocks"]
    report = f"{title}\n\n" + "\n".join(table(b) for b in blocks) + f"\n### {summary_title}\n\n" + summary(blocks)
    if result["skipped"]:
        report += f"\nnot run (over --budget-min {args.budget_min}): {', '.join(result['skipped'])}\n"
    md = args.md or (os.path.splitext(args.out)[0] + ".md" if args.out else None)
    if md:
        Path(md).write_text(report)
    print("\n" + report + f"\ntotal {seconds:.0f} s; JSON: {args.out}; markdown: {md}")


def device_and_dtype(cpu: bool) -> tuple[torch.device, torch.dtype]:
    """The GPU in bf16 when there is one and ``cpu`` is not asked for; else the CPU in fp32."""
    device = torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def synchronizer(device: torch.device | str):
    """``torch.cuda.synchronize`` on a CUDA device, else a function doing nothing."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def timed_calls(fn, times: list[float], sync, scale: float = 1.0):
    """``fn`` wrapped: each call synchronised before and after, its seconds times ``scale`` appended to ``times``."""

    def timed_fn(*args, **kwargs):
        sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        times.append((time.perf_counter() - start) * scale)
        return out

    return timed_fn


def repeat_ms(fn, reps: int, sync) -> list[float]:
    """Milliseconds of ``reps`` synchronised calls of ``fn``."""
    times: list[float] = []
    timed_fn = timed_calls(fn, times, sync, scale=1e3)
    for _ in range(reps):
        timed_fn()
    return times


def dist_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, None where it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_json(path: Path, record: dict) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))
    return path


def env_info() -> dict:
    """Device, library and peer versions, date, commit: recorded with every result."""
    import triton

    import lce_patch

    cuda = torch.cuda.is_available()
    tree = tree_state()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "lce_patch": lce_patch.__version__,
        "git": git_revision(),
        "commit": tree["commit"],
        "dirty": tree["dirty"],
        "commit_source": tree["source"],
        "liger_kernel": dist_version("liger-kernel"),
        "cut_cross_entropy": dist_version("cut-cross-entropy"),
        "trl": dist_version("trl"),
        "transformers": dist_version("transformers"),
        "accelerate": dist_version("accelerate"),
        "deepspeed": dist_version("deepspeed"),
        "peft": dist_version("peft"),
        "datasets": dist_version("datasets"),
        **{name: os.environ.get(name) for name in MULTICAST_OFF},
    }


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE) -> torch.Tensor:
    """Hugging Face causal-LM shift: position t is scored against labels[..., t + 1]; the last is ignored."""
    out = torch.full_like(labels, ignore_index)
    out[..., :-1] = labels[..., 1:]
    return out


def _mean_loss(z: torch.Tensor, labels: torch.Tensor, softcap: float | None) -> float:
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, labels).item()


def make_inputs(
    n: int,
    d: int,
    v: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    data: str = "flat",
    softcap: float | None = None,
    seed: int = 0,
    logit_std: float = 1.0,
    target_loss: float = 1.5,
    ignore_every: int = 7,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [n, d], weight [v, d], labels [n] int64), leaves without requires_grad. See the module doc."""
    if data not in ("flat", "peaked"):
        raise ValueError(f"data must be 'flat' or 'peaked', got {data!r}")
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, d, device=device, generator=gen)
    weight = (torch.randn(v, d, device=device, generator=gen) * (logit_std / d**0.5)).to(dtype)
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    if ignore_every:
        labels[::ignore_every] = IGNORE
    if data == "peaked" and n > 0:
        valid = labels != IGNORE
        w_t = weight.float()[labels.clamp(min=0)]  # [n, d]
        direction = w_t / w_t.square().sum(-1, keepdim=True)  # raises the target logit by 1 per unit
        sub = valid.nonzero().squeeze(-1)[:256]
        w32 = weight.float()
        z0 = hidden[sub] @ w32.t()  # [s, v]
        u = direction[sub] @ w32.t()  # change of every logit per unit of beta
        lo, hi = 0.0, 4.0 * (torch.log(torch.tensor(float(v))).item() + logit_std**2)
        for _ in range(40):  # loss falls as beta grows
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _mean_loss(z0 + mid * u, labels[sub], softcap) > target_loss else (lo, mid)
        del z0, u
        hidden = torch.where(valid[:, None], hidden + (0.5 * (lo + hi)) * direction, hidden)
    return hidden.to(dtype), weight, labels


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    token_grad: torch.Tensor | None = None,
    grads: tuple[bool, bool, bool] = (True, True, False),
    ref_dtype: torch.dtype = torch.float32,
    chunk_bytes: int = 512 * 2**20,
):
    """Per-token loss [N] and the gradients of sum(token_grad * loss) w.r.t. (hidden, weight, bias).

    ``hidden`` [N, D] and ``labels`` [N] are already flattened (and shifted). ``token_grad`` defaults to
    the "mean" reduction's 1 / n_valid on valid tokens. Returns (loss_tok, dh, dW, db); a gradient not
    asked for in ``grads`` is None. Everything in ``ref_dtype``.
    """
    n, v = hidden.shape[0], weight.shape[0]
    valid = labels != ignore_index
    if token_grad is None:
        token_grad = valid.to(ref_dtype) / valid.sum().clamp(min=1)
    token_grad = token_grad.to(ref_dtype)
    w = weight.detach().to(ref_dtype).requires_grad_(grads[1])
    b = None if bias is None else bias.detach().to(ref_dtype).requires_grad_(grads[2])
    loss_tok = torch.zeros(n, dtype=ref_dtype, device=hidden.device)
    dh = torch.zeros(hidden.shape, dtype=ref_dtype, device=hidden.device) if grads[0] else None
    rows = max(1, chunk_bytes // (v * torch.finfo(ref_dtype).bits // 8))
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        h = hidden[start:stop].detach().to(ref_dtype).requires_grad_(grads[0])
        y = labels[start:stop]
        with torch.enable_grad():
            z = h @ w.t() if b is None else torch.addmm(b, h, w.t())
            if logit_scale != 1.0:
                z = z * logit_scale
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            lt = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
            if z_loss:
                lt = lt + z_loss * torch.logsumexp(z, dim=-1).square() * valid[start:stop]
            if any(grads):
                (lt * token_grad[start:stop]).sum().backward()
        loss_tok[start:stop] = lt.detach()
        if dh is not None:
            dh[start:stop] = h.grad
        del z, lt, h
    return (
        loss_tok,
        dh,
        w.grad if grads[1] else None,
        b.grad if b is not None and grads[2] else None,
    )


def unfused_loss(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    ignore_index=IGNORE,
    softcap=None,
    logit_scale=1.0,
    shift=False,
    reduction="mean",
    num_items_in_batch=None,
    label_smoothing=0.0,
    z_loss=0.0,
    hf_order=True,
):
    """The unfused PyTorch path with every option of the op.

    ``hf_order``: scale and softcap in the logits' dtype before the fp32 upcast, as Hugging Face's Gemma-2
    does; otherwise upcast right after the matmul (slightly more accurate).
    """
    if shift:
        labels = shift_labels(labels, ignore_index)
    out_shape = labels.shape
    y = labels.reshape(-1)
    z = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    if not hf_order:
        z = z.float()
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z.float()
    valid = y != ignore_index
    lt = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        lt = lt + z_loss * torch.logsumexp(z, dim=-1).square() * valid
    if num_items_in_batch is not None:
        return lt.sum() / num_items_in_batch
    if reduction == "sum":
        return lt.sum()
    if reduction == "none":
        return lt.view(out_shape)
    return lt.sum() / valid.sum().clamp(min=1)


def rel_l2(x: torch.Tensor | None, ref: torch.Tensor | None, chunk_rows: int = 8192) -> float | None:
    """||x - ref|| / ||ref|| in float64, chunked over rows (no full-size fp32 copy). NaN in x gives NaN."""
    if x is None or ref is None:
        return None
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(-1, 1)
    r2 = ref.reshape(-1, ref.shape[-1]) if ref.dim() > 1 else ref.reshape(-1, 1)
    if x2.shape != r2.shape:
        raise ValueError(f"shape mismatch {tuple(x.shape)} vs {tuple(ref.shape)}")
    num = torch.zeros((), dtype=torch.float64, device=ref.device)
    den = torch.zeros((), dtype=torch.float64, device=ref.device)
    for start in range(0, x2.shape[0], chunk_rows):
        r = r2[start : start + chunk_rows].double()
        num += (x2[start : start + chunk_rows].double() - r).square().sum()
        den += r.square().sum()
    return (num.sqrt() / den.sqrt().clamp(min=1e-300)).item()


def rel_err(x: float, ref: float) -> float:
    return abs(x - ref) / max(abs(ref), 1e-30)


def ratio_interval(reference: list[float], candidate: list[float], rounds: int = 2000) -> tuple[float, float]:
    """A 95% interval of median(candidate) / median(reference) by a paired bootstrap: the steps are resampled
    as pairs (step i of both variants ran next to each other, so drift of the host reaches both alike).
    Deterministic (a fixed seed). A host-bound step varies by 10-30% from one step to the next: a ratio whose
    interval holds 1 is a tie at that many steps."""
    generator = random.Random(0)
    count = len(reference)
    ratios = []
    for _ in range(rounds):
        picks = [generator.randrange(count) for _ in range(count)]
        ratios.append(statistics.median(candidate[i] for i in picks) / statistics.median(reference[i] for i in picks))
    ratios.sort()
    return ratios[int(0.025 * rounds)], ratios[int(0.975 * rounds) - 1]


def interleaved_rounds(timers: dict[str, Any], rounds: int, reference: str | None = None) -> dict[str, dict]:
    """Time every method once per round, in turn, ``rounds`` times (the order rotated each round, so that no
    method always runs first after a reference's allocations or last on warm clocks).

    ``timers`` maps a method to a zero-argument callable that returns one timing in ms (a median of its own
    repetitions). Per method: ``ms`` (the median of its rounds) and ``ms_rounds``; against ``reference``
    (when given and timed): ``speedup`` = reference's ms / this ms, its 95% paired interval over the rounds
    (``speedup_interval95``, :func:`ratio_interval` inverted) and ``faster_every_round`` / ``slower_every_round``
    (a speedup called faster or slower needs the interval or every round on its side). A method whose timer
    raises keeps the rounds it had and its ``error``."""
    times: dict[str, list[float]] = {name: [] for name in timers}
    errors: dict[str, str] = {}
    names = list(timers)
    for index in range(rounds if names else 0):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            if name in errors:
                continue
            try:
                times[name].append(float(timers[name]()))
            except Exception as exc:  # noqa: BLE001 - recorded beside the rounds measured so far
                errors[name] = out_of_memory(exc) or f"{type(exc).__name__}: {str(exc)[:200]}"
    out: dict[str, dict] = {}
    ref = times.get(reference) if reference else None
    for name, got in times.items():
        row: dict[str, Any] = {"ms_rounds": got}
        if got:
            row["ms"] = statistics.median(got)
        if name in errors:
            row["error"] = errors[name]
        paired = min(len(got), len(ref or []))
        if ref and name != reference and paired >= 2:
            low, high = ratio_interval(ref[:paired], got[:paired])
            per_round = [r / g for r, g in zip(ref, got)]
            row["speedup"] = statistics.median(ref[:paired]) / statistics.median(got[:paired])
            row["speedup_interval95"] = [1 / high, 1 / low]
            row["faster_every_round"] = all(s > 1 for s in per_round)
            row["slower_every_round"] = all(s < 1 for s in per_round)
        out[name] = row
    return out


def timing_summary(times: list[float]) -> dict:
    ordered = sorted(times)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {
        "ms_median": statistics.median(times),
        "ms_min": ordered[0],
        "ms_p10": pct(0.1),
        "ms_p90": pct(0.9),
        "ms_max": ordered[-1],
        "steps": len(times),
    }


def compile_counters() -> dict[str, Any]:
    """Dynamo's running counts: graphs compiled and graph breaks by reason (empty before any compilation)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "breaks": dict(counters["graph_break"])}


def compile_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the warm-up of one variant compiled: graphs, graph breaks, and the breaks' reasons (first line of
    each, the counts summed by reason). The first step traces with the check's own op counter wrapped around the
    op (its list append and shape reads), the later ones without it, so a variant compiles its graphs twice."""
    reasons: dict[str, int] = {}
    for reason, count in after["breaks"].items():
        new = count - before["breaks"].get(reason, 0)
        if new > 0:
            line = str(reason).splitlines()[0][:160]
            reasons[line] = reasons.get(line, 0) + new
    return {"graphs": after["graphs"] - before["graphs"], "graph_breaks": sum(reasons.values()), "reasons": reasons}


def save_profile(prof, out: Path, name: str, cuda: bool, compress: bool = False) -> dict:
    """Write a finished torch.profiler ``prof``: its Chrome trace (``name.json``, gzipped ``name.json.gz`` with
    ``compress``) and its operator table by self device time (``name.txt``) into ``out``; :func:`step_work`'s
    summary of the trace."""
    import gzip
    import json

    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"{name}.json{'.gz' if compress else ''}"
    prof.export_chrome_trace(str(trace))  # gzipped by torch for a .gz path
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort_by, row_limit=60)
    except (AttributeError, KeyError):  # torch versions that name the device column cuda_*
        table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else sort_by, row_limit=60)
    (out / f"{name}.txt").write_text(table)
    with gzip.open(trace, "rt") if compress else open(trace) as packed:
        return step_work(json.load(packed))


_SYNCS = {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"}


def step_work(trace: dict) -> dict:
    """What one profiled step cost the host and the GPU, from its Chrome trace: the host's span (first to last
    operator, ms), operators, kernel launches, GPU busy time (kernels' durations summed, ms), the NCCL kernels'
    part of it (their waits for the other ranks included), and host-device synchronisations. A step whose host
    span is well above its GPU busy time is bound by the host: there the kernel launches, not the FLOPs, set its
    time."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    start = min((e["ts"] for e in ops), default=0.0)
    end = max((e["ts"] + e["dur"] for e in ops), default=0.0)
    return {
        "host_ms": (end - start) / 1e3,
        "cpu_ops": len(ops),
        "launches": sum(e["name"] in CUDA_LAUNCH_CALLS for e in runtime),
        "gpu_busy_ms": sum(e["dur"] for e in kernels) / 1e3,
        "collective_ms": sum(e["dur"] for e in kernels if "nccl" in e["name"].lower()) / 1e3,
        # inside the step (the profiler's own synchronisation after it is not the step's)
        "syncs": sum(e["name"] in _SYNCS and start <= e["ts"] <= end for e in runtime),
    }
