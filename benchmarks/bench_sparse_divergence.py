"""Benchmark: distillation from a teacher's top-K, lce_patch's fused_linear_sparse_divergence beside TRL's and
axolotl's losses and the unfused full-logits path, forward+backward (dh and dW of the student), bf16, one GPU.

One process, one device, every method on the same inputs. Per shape (N tokens, student D, V, K candidates):
  * student: h [N, D] ~ N(0, 1) plus, per position, 32 "plausible" tokens whose logits are raised by 16, 15.25,
    ... (so the student puts most of its mass on a few tokens), W [V, D] ~ N(0, 1 / D); bf16 leaves.
  * teacher: its logits are the student's (fp32, from the bf16 h and W) plus N(0, 1) noise; ``candidate_ids`` are
    its top-K, ``teacher_logprobs`` its log-softmax there (fp32). 5% of positions have their last 1..K-1 slots
    padded. The JSON records the teacher's top-K mass and the student's mass on the same ids.
  * two loss definitions, each with its own inputs' padding format and fp32 reference:
      trl: TRL 1.16's AsyncDistillationTrainer defaults (beta 0, add_tail_bucket, temperature 1); padded slots
        have id -1, log-prob -inf, mask False; the sum over positions divided by N (the trainer's tokens per rank).
      axolotl: axolotl 0.19's top-K forward KL (kd_beta 0, kd_normalize_topk off, kd_temperature T); padded slots
        have id 0, log-prob -1e9, mask 0 (its collator's format); the sum over kept (position, candidate) slots
        divided by N (num_items_in_batch, every position labelled).

Methods (``--methods``; a peer that cannot be imported is listed as skipped with the reason, one that runs out
of memory as OOM, the run goes on):
  lce_patch-trl      fused_linear_sparse_divergence(h, W, ids, logprobs, candidate_mask=mask, beta=0,
                     add_tail_bucket=True, reduction="sum", return_entropy=True) / N: what lce_patch's TRL
                     integration runs in place of TRL's function (TRL's function also returns the entropy sum).
  lce_patch-trl-fp32, lce_patch-axolotl-fp32
                     the same with fp32_logits=True, fp32_weight_grad=True (the op's precision options).
  trl                TRL's _chunked_jsd_loss(h, W, None, 1.0, None, ids, logprobs, mask, 0.0, 1.0, True, None, 1,
                     256)[0] / N, as AsyncDistillationTrainer.compute_loss calls it (fp32 logits, 256-row chunks
                     under activation checkpointing).
  unfused-trl        F.linear in bf16, .float(), log_softmax, gather, TRL's tail bucket and forward KL.
  lce_patch-axolotl  fused_linear_sparse_divergence(..., candidate_mask=mask, renormalize=False, beta=0,
                     temperature=T, reduction="sum") / N.
  axolotl            axolotl's ChunkedTopKKDLoss(num_output_chunks=8, kd_temperature=T) on the student's full bf16
                     logits [1, N, V] (h @ W.T), num_items_in_batch=N: axolotl's logits-based top-K KD loss.
  axolotl-liger      axolotl's LigerFusedLinearKLTopKLogprobLoss(kd_ce_alpha=0, kd_alpha=1, T, kd_beta=0,
                     compute_ce_loss=False, normalize_topk=False) on h [1, N, D] and W, divided by N, as
                     AxolotlKDTrainer.compute_loss calls it (torch.compile of its chunk step, 1024-row chunks).
                     Its forward reports T**2 times the loss (its gradients are not scaled): the loss error
                     divides that factor out.
  unfused-axolotl    F.linear in bf16, .float(), / T, log_softmax, gather, forward KL over the kept slots.

Measured per method: fwd+bwd ``triton.testing.do_bench`` median (gradients reset outside the timed region;
``--rounds`` rounds over all methods of a shape, median of the rounds), peak memory allocated above what was
allocated before one fwd+bwd (so it includes dh and dW), the loss's relative error and the relative L2 error of dh
and dW against the definition's fp32 reference (fp32 copies of h and W, full fp32 logits a chunk of rows at a time
through autograd, TF32 off), and "% of floor": the student's three cuBLAS bf16 GEMMs at full N, measured in the
same run (logits = h @ W.T [N, V], dh = G @ W, dW = G.T @ h), divided by the method's time.

On the GPU machine (no registry there; wheels in .whl/): trl 1.16.0, liger-kernel 0.8.5 and axolotl 0.19.0
installed --no-deps to a target directory on PYTHONPATH:
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \\
        .whl/trl-1.16.0-*.whl .whl/liger_kernel-0.8.5-*.whl .whl/axolotl-0.19.0-*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/bench_sparse_divergence.py --quick
TRL's module imports ``datasets``, ``pyarrow`` and ``pandas`` at import time for other parts of its trainer; where
one is not installed an empty stand-in module is registered for the import (the JSON lists which). axolotl's
modules are imported without running ``axolotl.integrations.kd``'s package ``__init__`` (the plugin and trainer
machinery, which would pull axolotl's whole dependency tree): only ``topk_logprob/forward_kl.py``,
``kernels/liger.py`` and ``utils.py`` of the installed axolotl run (``kernels/liger.py`` needs liger-kernel).

Output: a markdown table per shape on stdout, JSON to --out (default $OUT/bench_sparse_divergence.json when OUT is
set) rewritten after every shape, the same report as markdown beside it (--md). ``--budget-min`` starts no new
shape after that many minutes. ``--device cpu --shapes tiny`` runs tiny shapes on the CPU (lce_patch's torch
backend, axolotl's Liger loss uncompiled, wall-clock medians, no memory): a smoke test of the script.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F
from bench_common import (
    ERROR_COLUMNS,
    add_timing_args,
    cells,
    dist_version,
    env_info,
    fmt,
    free,
    rel_err,
    rel_l2,
    set_exact_fp32,
    write_markdown,
)

# name: (N, D, V, K)
MODELS = {"qwen2.5-1.5b": (1536, 151936), "llama3.2-1b": (2048, 128256)}
SHAPES = {
    f"{model}-k{k}-n{n}": (n, d, v, k) for model, (d, v) in MODELS.items() for k in (8, 20, 64) for n in (4096, 16384)
}
SHAPES["tiny"] = (96, 64, 1000, 8)
SHAPES["tiny-k20"] = (80, 48, 777, 20)
DEFAULT_SHAPES = ("qwen2.5-1.5b-k20-n4096", "llama3.2-1b-k64-n4096", "qwen2.5-1.5b-k64-n16384", "llama3.2-1b-k8-n16384")
QUICK_SHAPES = ("qwen2.5-1.5b-k20-n4096", "llama3.2-1b-k64-n16384")

# method: loss definition it computes
METHODS = {
    "lce_patch-trl": "trl",
    "lce_patch-trl-fp32": "trl",
    "trl": "trl",
    "unfused-trl": "trl",
    "lce_patch-axolotl": "axolotl",
    "lce_patch-axolotl-fp32": "axolotl",
    "axolotl": "axolotl",
    "axolotl-liger": "axolotl",
    "unfused-axolotl": "axolotl",
}
OURS = ("lce_patch-trl", "lce_patch-axolotl")
TRL_BETA, TRL_TAIL, TRL_TEMPERATURE, TRL_CHUNK = 0.0, True, 1.0, 256  # AsyncDistillationConfig defaults
PLAUSIBLE = 32  # tokens per position the student's logits are raised at
PAD_FRACTION = 0.05

_PEERS: dict = {}  # import outcome per peer, recorded in the JSON


class MissingPeer(Exception):
    """A peer library that cannot be imported: its rows are skipped."""


# ----------------------------------------------------------------------------------------------- peers
class _StandIn(types.ModuleType):
    """An empty module whose every attribute is a new placeholder class (``from datasets import Dataset``)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def trl_module():
    """TRL's async distillation trainer module; stand-ins for its import-time-only dependencies if missing."""
    if "trl" not in _PEERS:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        missing = [name for name in ("datasets", "pyarrow", "pandas") if importlib.util.find_spec(name) is None]
        finder = _StandInFinder(missing)
        sys.meta_path.append(finder)
        try:
            from trl.experimental.async_distillation import async_distillation_trainer as module

            _PEERS["trl"] = dict(module=module, stand_ins=missing)
        except Exception as exc:  # noqa: BLE001 - any import failure makes the peer missing
            _PEERS["trl"] = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}", stand_ins=missing)
        finally:
            sys.meta_path.remove(finder)
    if "error" in _PEERS["trl"]:
        raise MissingPeer(_PEERS["trl"]["error"])
    return _PEERS["trl"]["module"]


def axolotl_losses():
    """(ChunkedTopKKDLoss, LigerFusedLinearKLTopKLogprobLoss) from the installed axolotl, skipping the KD
    plugin's package ``__init__``."""
    if "axolotl" not in _PEERS:
        try:
            name = "axolotl.integrations.kd"
            if name not in sys.modules:
                spec = importlib.util.find_spec("axolotl.integrations")  # runs axolotl/__init__.py (light)
                if spec is None or not spec.submodule_search_locations:
                    raise ImportError("axolotl.integrations not found")
                package = types.ModuleType(name)
                package.__path__ = [os.path.join(list(spec.submodule_search_locations)[0], "kd")]
                package.__package__ = name
                sys.modules[name] = package
            from axolotl.integrations.kd.topk_logprob.forward_kl import ChunkedTopKKDLoss

            entry = dict(chunked=ChunkedTopKKDLoss)
            try:
                from axolotl.integrations.kd.kernels.liger import LigerFusedLinearKLTopKLogprobLoss

                entry["liger"] = LigerFusedLinearKLTopKLogprobLoss
            except Exception as exc:  # noqa: BLE001
                entry["liger_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            _PEERS["axolotl"] = entry
        except Exception as exc:  # noqa: BLE001
            _PEERS["axolotl"] = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
    entry = _PEERS["axolotl"]
    if "error" in entry:
        raise MissingPeer(entry["error"])
    return entry


# ----------------------------------------------------------------------------------------------- inputs
@torch.no_grad()
def make_inputs(n, d, v, k, *, device, seed=0, row_block=2048) -> dict:
    """Student leaves (bf16), the teacher's top-K in TRL's and axolotl's formats, and statistics."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(v, d, device=device, generator=gen) / d**0.5
    w_sq = w.square().sum(-1)
    h = torch.randn(n, d, device=device, generator=gen)
    steps = torch.arange(PLAUSIBLE, device=device, dtype=torch.float32)
    for start in range(0, n, row_block):  # raise the plausible tokens' logits (W's rows are nearly orthogonal)
        rows = min(row_block, n - start)
        tokens = torch.randint(0, v, (rows, PLAUSIBLE), device=device, generator=gen)
        boost = 16.0 - 0.75 * steps + 0.5 * torch.randn(rows, PLAUSIBLE, device=device, generator=gen)
        h[start : start + rows] += torch.einsum("rm,rmd->rd", boost / w_sq[tokens], w[tokens])
    h, w = h.to(torch.bfloat16), w.to(torch.bfloat16)
    ids = torch.empty(n, k, dtype=torch.long, device=device)
    logprobs = torch.empty(n, k, dtype=torch.float32, device=device)
    teacher_mass, student_mass, top1_agree = 0.0, 0.0, 0.0
    w32 = w.float()
    rows_per_block = max(1, min(n, (512 * 2**20) // (4 * v)))
    for start in range(0, n, rows_per_block):
        stop = min(start + rows_per_block, n)
        student = h[start:stop].float() @ w32.T
        teacher = student + torch.randn(student.shape, device=device, generator=gen)
        top, idx = teacher.topk(k, dim=-1)
        ids[start:stop] = idx
        logprobs[start:stop] = top - teacher.logsumexp(-1, keepdim=True)
        teacher_mass += logprobs[start:stop].exp().sum().item()
        student_mass += (student.gather(-1, idx) - student.logsumexp(-1, keepdim=True)).exp().sum().item()
        top1_agree += (student.argmax(-1) == idx[:, 0]).sum().item()
        del student, teacher
    # 5% of positions keep only their first 1..K-1 candidates (a teacher that returned fewer)
    kept = torch.full((n,), k, device=device, dtype=torch.long)
    padded = torch.rand(n, device=device, generator=gen) < PAD_FRACTION
    if k > 1:
        kept = torch.where(padded, torch.randint(1, k, (n,), device=device, generator=gen), kept)
    mask = torch.arange(k, device=device)[None, :] < kept[:, None]
    return dict(
        h=h,
        w=w,
        trl=dict(ids=torch.where(mask, ids, -1), logprobs=logprobs.masked_fill(~mask, float("-inf")), mask=mask),
        axolotl=dict(ids=torch.where(mask, ids, 0), logprobs=logprobs.masked_fill(~mask, -1e9), mask=mask.int()),
        stats=dict(
            teacher_topk_mass=teacher_mass / n,
            student_mass_on_teacher_topk=student_mass / n,
            top1_agreement=top1_agree / n,
            padded_positions=int((kept < k).sum()),
            kept_slots=int(mask.sum()),
        ),
    )


# ----------------------------------------------------------------------------------------------- losses
def _log_probs(h, w, temperature=1.0):
    """The unfused path: bf16 (or fp32) logits, upcast, temperature, log-softmax over the vocabulary."""
    z = F.linear(h, w).float()
    if temperature != 1.0:
        z = z / temperature
    return z.log_softmax(-1)


def _tail(log_probs):
    """TRL's _add_tail_bucket: log(1 - mass of the candidates), the mass clamped below 1."""
    log_mass = log_probs.logsumexp(-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([log_probs, torch.log(-torch.expm1(log_mass))], dim=-1)


def trl_definition_sum(h, w, t) -> torch.Tensor:
    """Sum over positions of TRL's divergence at beta 0 with the tail bucket, from the full logits."""
    log_probs = _log_probs(h, w, TRL_TEMPERATURE)
    neg_inf = torch.tensor(float("-inf"), device=h.device)
    student = torch.where(t["mask"], log_probs.gather(-1, t["ids"].clamp(min=0)), neg_inf)
    teacher = torch.where(t["mask"], t["logprobs"], neg_inf)
    support = torch.cat([t["mask"], torch.ones_like(t["mask"][:, :1])], dim=-1)
    a, b = _tail(student), _tail(teacher)
    zero = torch.zeros((), device=h.device)
    a, b = torch.where(support, a, zero), torch.where(support, b, zero)
    return torch.where(support, b.exp() * (b - a), zero).sum()  # forward KL (beta 0)


def axolotl_definition_sum(h, w, t, temperature) -> torch.Tensor:
    """Sum over kept (position, candidate) slots of axolotl's top-K forward KL, from the full logits."""
    log_probs = _log_probs(h, w, temperature)
    keep = t["mask"].bool()
    teacher = torch.where(keep, t["logprobs"], 0.0)
    student = torch.where(keep, log_probs.gather(-1, t["ids"]), 0.0)
    return torch.where(keep, teacher.exp() * (teacher - student), 0.0).sum()


def reference(data, definition, temperature, chunk_bytes=256 * 2**20) -> dict:
    """Loss, dh and dW of ``definition`` on fp32 copies of h and W, full fp32 logits a chunk of rows at a time."""
    h, w = data["h"], data["w"]
    n, v = h.shape[0], w.shape[0]
    t = data[definition]
    w32 = w.detach().float().requires_grad_(True)
    dh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    total = 0.0
    rows = max(1, chunk_bytes // (4 * v))
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        h32 = h[start:stop].detach().float().requires_grad_(True)
        part = {key: value[start:stop] for key, value in t.items()}
        with torch.enable_grad():
            if definition == "trl":
                loss = trl_definition_sum(h32, w32, part) / n
            else:
                loss = axolotl_definition_sum(h32, w32, part, temperature) / n
            loss.backward()
        total += loss.double().item()
        dh[start:stop] = h32.grad
        del h32, loss
    return dict(loss=total, dh=dh, dW=w32.grad)


def build(method, data, temperature, device):
    """A zero-argument callable returning the scalar loss of ``method`` (a MissingPeer if it cannot run)."""
    h, w, n = data["h"], data["w"], data["h"].shape[0]
    if method.startswith("lce_patch"):
        from lce_patch import fused_linear_sparse_divergence

        # "-fp32": the op's precision options (fp32 logits, fp32 dW accumulation)
        precise = dict.fromkeys(("fp32_logits", "fp32_weight_grad"), method.endswith("-fp32"))
        if method.startswith("lce_patch-trl"):
            t = data["trl"]

            def lce_trl():
                loss, _entropy = fused_linear_sparse_divergence(
                    h, w, t["ids"], t["logprobs"], candidate_mask=t["mask"], beta=TRL_BETA,
                    temperature=TRL_TEMPERATURE, add_tail_bucket=TRL_TAIL, reduction="sum", return_entropy=True,
                    **precise,
                )  # fmt: skip
                return loss / n

            return lce_trl
        t = data["axolotl"]
        return lambda: fused_linear_sparse_divergence(
            h, w, t["ids"], t["logprobs"], candidate_mask=t["mask"], beta=0.0, temperature=temperature,
            renormalize=False, reduction="sum", **precise,
        ) / n  # fmt: skip
    if method == "unfused-trl":
        return lambda: trl_definition_sum(h, w, data["trl"]) / n
    if method == "unfused-axolotl":
        return lambda: axolotl_definition_sum(h, w, data["axolotl"], temperature) / n
    if method == "trl":
        module = trl_module()
        t = data["trl"]
        return lambda: module._chunked_jsd_loss(
            h, w, None, 1.0, None, t["ids"], t["logprobs"], t["mask"], TRL_BETA, TRL_TEMPERATURE, TRL_TAIL,
            None, 1, TRL_CHUNK,
        )[0] / n  # fmt: skip
    if method == "axolotl":
        loss_fn = axolotl_losses()["chunked"](num_output_chunks=8, kd_temperature=temperature)
        t = {key: value[None] for key, value in data["axolotl"].items()}  # [1, N, K]: one packed sequence
        return lambda: loss_fn(F.linear(h[None], w), t["ids"], t["logprobs"], t["mask"], num_items_in_batch=n)
    if method == "axolotl-liger":
        entry = axolotl_losses()
        if "liger" not in entry:
            raise MissingPeer(entry["liger_error"])
        loss_fn = entry["liger"](
            0.0, 1.0, temperature, 0.0, compute_ce_loss=False, normalize_topk=False, compiled=device.type == "cuda"
        )
        t = {key: value[None] for key, value in data["axolotl"].items()}
        labels = torch.zeros(1, n, dtype=torch.long, device=h.device)
        return lambda: loss_fn(w, h[None], t["ids"], t["logprobs"], t["mask"], true_labels=labels) / n
    raise ValueError(f"unknown method {method!r}")


# ----------------------------------------------------------------------------------------------- timing
def bench_ms(fn, args, device, grad_to_none=None) -> float:
    """Median ms: triton's do_bench on CUDA (window at least --min-reps calls), wall clock on the CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(max(3, args.min_reps // 2)):
            for p in grad_to_none or ():
                p.grad = None
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    import triton.testing

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep = max(args.rep, args.min_reps * start.elapsed_time(end))
    return triton.testing.do_bench(fn, warmup=args.warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def gemm_floor_ms(n, d, v, args, device) -> float:
    """The student's three GEMMs at full N, bf16: logits = h @ W.T, dh = G @ W, dW = G.T @ h."""
    h = torch.randn(n, d, device=device, dtype=torch.bfloat16)
    w = torch.randn(v, d, device=device, dtype=torch.bfloat16) * 0.02
    g = torch.empty(n, v, device=device, dtype=torch.bfloat16)
    dh = torch.empty(n, d, device=device, dtype=torch.bfloat16)
    dw = torch.empty(v, d, device=device, dtype=torch.bfloat16)
    total = bench_ms(lambda: torch.mm(h, w.t(), out=g), args, device)  # g now holds random-looking values
    total += bench_ms(lambda: torch.mm(g, w, out=dh), args, device)
    total += bench_ms(lambda: torch.mm(g.t(), h, out=dw), args, device)
    return total  # the caller frees the buffers


# ----------------------------------------------------------------------------------------------- one method
def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def run_method(method, data, refs, temperature, args, device) -> dict:
    row: dict = {"method": method, "definition": METHODS[method]}
    h, w = data["h"], data["w"]
    cuda = device.type == "cuda"
    try:
        fn = build(method, data, temperature, device)
        fn().backward()  # warm-up: compilation and autotuning stay out of the memory reading
        h.grad = w.grad = None
        free()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        loss = fn()
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        ref = refs[METHODS[method]]
        row["loss"] = loss.item()
        reported = row["loss"] / temperature**2 if method == "axolotl-liger" else row["loss"]  # its T**2 factor
        row["loss_rel_err"] = rel_err(reported, ref["loss"])
        row["dh_rel_err"] = rel_l2(h.grad, ref["dh"])
        row["dW_rel_err"] = rel_l2(w.grad, ref["dW"])
        del loss
        h.grad = w.grad = None
        row["ms_rounds"] = [bench_ms(lambda: fn().backward(), args, device, grad_to_none=[h, w])]
        row["status"] = "ok"
    except MissingPeer as exc:
        row.update(status="skipped", reason=str(exc))
    except torch.cuda.OutOfMemoryError as exc:
        row.update(status="oom", reason=_short(exc))
    except Exception as exc:  # noqa: BLE001 - a failing peer is a result, not a crash
        oom = "out of memory" in str(exc).lower()
        row.update(status="oom" if oom else "error", reason=_short(exc))
    finally:
        h.grad = w.grad = None
        free()
    return row


def retime(row, data, temperature, args, device) -> None:
    h, w = data["h"], data["w"]
    try:
        fn = build(row["method"], data, temperature, device)
        row["ms_rounds"].append(bench_ms(lambda: fn().backward(), args, device, grad_to_none=[h, w]))
    except Exception as exc:  # noqa: BLE001 - keep the rounds measured so far
        row.setdefault("retime_errors", []).append(_short(exc))
    finally:
        h.grad = w.grad = None
        free()


def run_shape(name, methods, args, device) -> dict:
    n, d, v, k = SHAPES[name]
    t0 = time.time()
    data = make_inputs(n, d, v, k, device=device, seed=args.seed)
    data["h"].requires_grad_(True)
    data["w"].requires_grad_(True)
    definitions = sorted({METHODS[m] for m in methods})
    refs = {}
    for definition in definitions:
        refs[definition] = reference(data, definition, args.kd_temperature)
        free()
    block = {
        "shape": name,
        "N": n,
        "D": d,
        "V": v,
        "K": k,
        "kd_temperature": args.kd_temperature,
        "inputs": data["stats"],
        "ref_loss": {key: value["loss"] for key, value in refs.items()},
        "gemm_floor_ms": gemm_floor_ms(n, d, v, args, device),
        "setup_s": round(time.time() - t0, 1),
        "rows": [],
    }
    free()
    for method in methods:
        t1 = time.time()
        row = run_method(method, data, refs, args.kd_temperature, args, device)
        row["wall_s"] = round(time.time() - t1, 1)
        block["rows"].append(row)
        shown = f"{row['ms_rounds'][0]:.2f} ms" if row["status"] == "ok" else f"{row['status']}: {row['reason']}"
        print(f"  {name} {method}: {shown}", flush=True)
    # clocks drift over a run; more rounds over every method in turn, and their median, even that out
    for _ in range(args.rounds - 1):
        for row in block["rows"]:
            if row["status"] == "ok":
                retime(row, data, args.kd_temperature, args, device)
    for row in block["rows"]:
        if row["status"] == "ok":
            row["ms"] = statistics.median(row["ms_rounds"])
            row["pct_floor"] = 100 * block["gemm_floor_ms"] / row["ms"]
    del data, refs
    free()
    return block


# ----------------------------------------------------------------------------------------------- report
_f = fmt  # a cell: "–" for None and NaN
# The columns of a shape's table after the method and its definition: (key, format)
COLUMNS = (("ms", ".2f"), ("pct_floor", ".0f"), *ERROR_COLUMNS)


def table(block) -> str:
    b, s = block, block["inputs"]
    head = (
        f"### {b['shape']} (N={b['N']}, D={b['D']}, V={b['V']}, K={b['K']}): GEMM floor {b['gemm_floor_ms']:.2f} ms; "
        f"teacher top-K mass {s['teacher_topk_mass']:.2f}, student mass there {s['student_mass_on_teacher_topk']:.2f}, "
        f"{s['padded_positions']} padded positions; ref loss "
        + ", ".join(f"{key} {value:.4f}" for key, value in b["ref_loss"].items())
        + "\n\n| method | definition | fwd+bwd ms | % of floor | peak MiB | loss rel err | dh rel err | dW rel err |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in b["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {r['definition']} | {r['status']}: {r['reason'][:120]} ||||||")
            continue
        lines.append(f"| {r['method']} | {r['definition']} | {cells(r, COLUMNS)} |")
    return head + "\n".join(lines) + "\n"


def summary(blocks) -> str:
    """lce_patch per shape and definition: its time and memory, and each peer's time and memory over ours."""
    out = [
        "| shape | ours | ms | % of floor | peak MiB | peer | peer ms / ours | peer MiB / ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in blocks:
        rows = {r["method"]: r for r in b["rows"]}
        for ours_name in OURS:
            ours = rows.get(ours_name)
            if ours is None or ours["status"] != "ok":
                continue
            for name, r in rows.items():
                if name.startswith(OURS) or r["definition"] != ours["definition"]:
                    continue
                if r["status"] != "ok":
                    ratio, mem = r["status"], "–"
                else:
                    ratio = f"{r['ms'] / ours['ms']:.2f}x"
                    mem = (
                        f"{r['peak_mib'] / ours['peak_mib']:.1f}x"
                        if r.get("peak_mib") and ours.get("peak_mib")
                        else "–"
                    )
                out.append(
                    f"| {b['shape']} | {ours_name} | {ours['ms']:.2f} | {ours['pct_floor']:.0f} | "
                    f"{_f(ours.get('peak_mib'), '.0f')} | {name} | {ratio} | {mem} |"
                )
    return "\n".join(out) + "\n"


def peers_line() -> str:
    parts = []
    trl = _PEERS.get("trl")
    if trl is not None:
        parts.append(
            "trl: " + (trl.get("error") or "imported")
            + (f" (stand-ins for {', '.join(trl['stand_ins'])})" if trl.get("stand_ins") else "")
        )  # fmt: skip
    ax = _PEERS.get("axolotl")
    if ax is not None:
        parts.append(
            "axolotl: "
            + (ax.get("error") or "imported" + (f"; Liger loss: {ax['liger_error']}" if "liger_error" in ax else ""))
        )
    return "; ".join(parts)


def _json_peers() -> dict:
    out = {}
    for name, entry in _PEERS.items():
        out[name] = {key: value for key, value in entry.items() if isinstance(value, (str, list))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma list from: {', '.join(SHAPES)}")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list from: {', '.join(METHODS)}")
    p.add_argument("--quick", action="store_true", help=f"shapes {', '.join(QUICK_SHAPES)}, one timing round")
    p.add_argument("--kd-temperature", type=float, default=1.0, help="axolotl's kd_temperature (default 1)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test with the tiny shapes)")
    p.add_argument("--seed", type=int, default=0)
    add_timing_args(p, rounds=2, budget_min=3.5, out_name="bench_sparse_divergence.json")
    args = p.parse_args(argv)

    if args.quick:
        args.shapes, args.rounds = ",".join(QUICK_SHAPES), 1
    shapes = [s for s in args.shapes.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    unknown = [s for s in shapes if s not in SHAPES] + [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown shapes or methods: {unknown}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --shapes tiny for a smoke test", file=sys.stderr)
        return 2

    t_start = time.time()
    set_exact_fp32()  # the fp32 reference (and TRL's fp32 logits) without TF32: PyTorch's default
    env = env_info()
    env["axolotl"] = dist_version("axolotl")
    print(
        f"{env['device']} | torch {env['torch']} | triton {env['triton']} | lce_patch {env['lce_patch']} ({env['git']})"
    )
    result = {"env": env, "args": vars(args), "blocks": [], "skipped": []}
    for name in shapes:
        if time.time() - t_start > 60 * args.budget_min:
            result["skipped"].append(name)
            continue
        block = run_shape(name, methods, args, device)
        block["wall_s"] = round(time.time() - t_start, 1)
        result["blocks"].append(block)
        result["peers"] = _json_peers()
        print(table(block), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1)

    title = (
        f"## Top-K distillation losses: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"trl {env['trl']}, liger-kernel {env['liger_kernel']}, axolotl {env['axolotl']}, "
        f"lce_patch {env['lce_patch']} ({env['git']}), {env['date']}; bf16 h and W, fwd+bwd (dh, dW); "
        f"axolotl kd_temperature {args.kd_temperature:g}\n\n{peers_line()}"
    )
    summary_title = "Summary (peer over lce_patch, same loss definition)"
    write_markdown(title, result, args, time.time() - t_start, table, summary, summary_title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
