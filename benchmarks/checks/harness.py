"""What the multi-GPU checks share (``multi_gpu_check``, ``cp_check``, ``distill_multi_gpu_check``, ``tp_check``):
rank setup, the op spy, the comparison of parameters with a one-process run, the environment record, and the
report (PASS/FAIL lines, the JSON).

  * :func:`start`: NVLink multicast off (also for the processes a check starts), and, with
    ``LCE_BENCH_REQUIRE_CLEAN=1``, a refusal to run code that is not a clean commit (``checks/run_all.py`` sets it);
  * :func:`ranks`: rank, world size and device of a process started by torchrun or accelerate launch;
  * :class:`OpSpy`: wraps the name an lce_patch op is called through and records what each call got: the head
    weights (whole, a shard, a DTensor; their norms), the hidden shape, ``num_items_in_batch``, the valid targets;
  * :func:`compare_params` / :func:`update_failures`: every parameter after training against a reference, on the
    GPU when there is one (an 8B-wide model's state compared in float64 on one CPU thread takes minutes);
  * :func:`mode_of`, :func:`check_launch`, :func:`full_state_dict`: what accelerate runs, and the full state;
  * :class:`Report`: the checks' verdicts and records on rank 0; written after every phase and when the process is
    stopped (SIGTERM, SIGINT), so that a check cut short keeps what it had measured.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
for _path in (REPO, REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))  # lce_patch from this checkout; bench_common

from bench_common import (  # noqa: E402
    MULTICAST_OFF,
    add_out_arg,
    argv_without,
    env_info,
    out_path,
    refuse_dirty_tree,
    rel_err,
    rel_l2,
    set_exact_fp32,
    write_json,
)

# bench_common's helpers the checks use, importable from here (the checks import this module first)
__all__ = ["REPO", "add_out_arg", "argv_without", "rel_err", "rel_l2", "set_exact_fp32"]

IGNORE = -100


# ------------------------------------------------------------------------------------------------ options
def check_parser(description: str, launch: str) -> argparse.ArgumentParser:
    """A check's argument parser: the defaults in the help, ``launch`` (a command that runs it) below."""
    return argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter, epilog=f"Launch: {launch}"
    )


def add_op_args(parser: argparse.ArgumentParser) -> None:
    """The lce_patch op's settings: --backend, --chunk-size."""
    parser.add_argument("--backend", default="auto", help="lce_patch backend: auto, triton or torch")
    parser.add_argument("--chunk-size", type=int, default=None, help="lce_patch chunk size (default: its own)")


def add_tolerance_args(parser: argparse.ArgumentParser, params: str = "parameters") -> None:
    """--rtol-loss, --rtol-param and --rtol-update of a check against one process (``params``: what is trained)."""
    parser.add_argument("--rtol-loss", type=float, default=1e-5, help="per-step loss, relative")
    parser.add_argument("--rtol-param", type=float, default=1e-5, help=f"{params} after the steps, relative L2")
    parser.add_argument(
        "--rtol-update",
        type=float,
        default=1e-3,
        help=f"updates of the {params} (final - initial), relative L2: the gradient check",
    )


# ------------------------------------------------------------------------------------------------ processes
def start() -> None:
    """Call first in a check's main: multicast off (inherited by what the check starts), a dirty tree refused when
    asked for."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    refuse_dirty_tree()


@dataclass
class Ranks:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def ranks(cpu: bool = False, same_device: bool = False) -> Ranks:
    """This process's place in a launch (torchrun / accelerate launch environment; one process without one), its
    device selected. On GPUs the host-side work (gathering, comparing) gets the process's share of the cores:
    torchrun's ``OMP_NUM_THREADS=1`` would leave it one."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cpu or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", 0 if same_device else local_rank)
        torch.cuda.set_device(device)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    return Ranks(rank, world, local_rank, device)


# ------------------------------------------------------------------------------------------------ the op spy
def describe(weight: torch.Tensor, norm: bool = True) -> dict[str, Any]:
    """A head weight as an op call got it: global and local shape, type, DTensor placements, the local norm."""
    placements = getattr(weight, "placements", None)
    local = weight.to_local() if placements is not None else weight
    record = {
        "shape": list(weight.shape),
        "local_shape": list(local.shape),
        "type": type(weight).__name__,
        "is_dtensor": placements is not None,
        "placements": [str(p) for p in placements] if placements is not None else None,
    }
    if norm:
        record["norm"] = float(local.detach().double().norm())
    return record


class OpSpy:
    """Records every call of ``module.name`` (by default ``lce_patch.models.forward.fused_linear_cross_entropy``,
    the name the patched forward resolves at call time). ``weights`` maps a record's key to the positional index of
    a head weight; ``labels_at`` the index of the labels (their valid count, whether the op shifts them, and a
    checksum: which rows a call scored). ``host_reads=False`` leaves out what needs a read on the host (norms,
    ``num_items_in_batch``), which breaks a compiled graph. Use as a context manager or :meth:`install`."""

    def __init__(
        self,
        module: Any = None,
        name: str = "fused_linear_cross_entropy",
        weights: dict[str, int] | None = None,
        labels_at: int | None = 2,
        host_reads: bool = True,
    ) -> None:
        if module is None:
            import lce_patch.models.forward as module
        self.module, self.name = module, name
        self.weights = weights or {"weight": 1}
        self.labels_at, self.host_reads = labels_at, host_reads
        self.calls: list[dict[str, Any]] = []
        self.original = None

    def _record(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        record: dict[str, Any] = {"hidden_shape": list(args[0].shape)}
        for key, index in self.weights.items():
            record[key] = describe(args[index], self.host_reads)
        items = kwargs.get("num_items_in_batch")
        if self.host_reads:  # a read on the host: under torch.compile, a graph break of the spy's own
            record["num_items_in_batch"] = None if items is None else float(items)
        record["softcap"] = kwargs.get("softcap")
        if self.labels_at is not None and len(args) > self.labels_at:
            labels = args[self.labels_at]
            scored = labels[..., 1:] if kwargs.get("shift") else labels
            record["targets"] = {
                "valid": int((scored != kwargs.get("ignore_index", IGNORE)).sum()),
                "shift": bool(kwargs.get("shift")),
                "checksum": int(labels.clamp(min=0).sum()),
            }
        return record

    def install(self) -> OpSpy:
        if self.original is not None:
            return self
        self.original = original = getattr(self.module, self.name)

        def spied(*args, **kwargs):
            self.calls.append(self._record(args, kwargs))
            return original(*args, **kwargs)

        setattr(self.module, self.name, spied)
        return self

    def remove(self) -> None:
        if self.original is not None:
            setattr(self.module, self.name, self.original)
            self.original = None

    def take(self) -> list[dict[str, Any]]:
        """The calls recorded so far, and a fresh start."""
        calls, self.calls = self.calls, []
        return calls

    def __enter__(self) -> OpSpy:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()


# ------------------------------------------------------------------------------------------------ comparing
def _spacing(t: torch.Tensor) -> torch.Tensor:
    """The distance from each element to the next representable value away from zero, in ``t``'s dtype."""
    away = torch.where(t < 0, torch.full_like(t, -math.inf), torch.full_like(t, math.inf))
    return (torch.nextafter(t, away) - t).abs()


def compare_params(
    dist: dict, ref: dict, init: dict, device: torch.device | str | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """Per floating-point tensor of ``ref``: the distributed run's (``dist``) error and its update's (final -
    ``init``) error, relative L2 in float64, and the largest difference in units of the reference weight's spacing.
    Computed on ``device`` (default: this process's GPU if there is one), one tensor at a time."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    rows, missing = [], []
    for name, r in ref.items():
        if not torch.is_floating_point(r):
            continue
        if dist.get(name) is None:
            missing.append(name)
            continue
        r = r.to(device)
        d, r64, i64 = dist[name].to(device).double(), r.double(), init[name].to(device).double()
        delta = d - r64
        upd_ref = (r64 - i64).norm().item()
        upd_err = delta.norm().item()  # (d - init) - (ref - init)
        rows.append(
            {
                "name": name,
                "shape": list(r.shape),
                "max_abs": delta.abs().max().item() if r.numel() else 0.0,
                "rel_l2": upd_err / max(r64.norm().item(), 1e-30),
                "update_norm": upd_ref,
                "update_rel_l2": upd_err / upd_ref if upd_ref > 0 else (0.0 if upd_err == 0 else math.inf),
                # the largest difference in units of the reference weight's own spacing (its dtype's ulp there)
                "max_ulps": (delta.abs() / _spacing(r).double()).max().item() if r.numel() else 0.0,
            }
        )
        del d, r64, i64, delta, r
    return rows, missing


def update_failures(rows: list[dict[str, Any]], rtol_update: float) -> tuple[list[dict[str, Any]], str]:
    """The rows of :func:`compare_params` whose update is off, and a one-line summary. A tensor passes when its
    update is within ``rtol_update`` (relative L2) or when its final weights are within two of the weights' own
    roundings of the reference's: an update too small for the weights to resolve (a norm weight of 1.0 moved by
    1e-7) has no third significant digit left to compare."""
    failing = [p for p in rows if p["update_rel_l2"] > rtol_update and p["max_ulps"] > 2]
    worst = max(rows, key=lambda p: p["update_rel_l2"])
    detail = (
        f"worst rel L2 {worst['update_rel_l2']:.2e} ({worst['name']}, {worst['max_ulps']:.1f} ulp); "
        f"{len(failing)} tensor(s) past {rtol_update:g} and 2 ulp"
    )
    if failing:
        detail += f", e.g. {failing[0]['name']} {failing[0]['update_rel_l2']:.2e} / {failing[0]['max_ulps']:.1f} ulp"
    return failing, detail


def check_params(report: Report, against: str, rows: list[dict[str, Any]], rtol_param: float | None, rtol_update):
    """The verdicts on one comparison: every tensor present, the worst parameter (if ``rtol_param``), the updates."""
    if not rows:
        return
    if rtol_param is not None:
        worst = max(rows, key=lambda p: p["rel_l2"])
        report.check(
            f"parameters vs {against}",
            worst["rel_l2"] <= rtol_param,
            f"worst rel L2 {worst['rel_l2']:.2e} ({worst['name']})",
        )
    failing, detail = update_failures(rows, rtol_update)
    report.check(f"updates (gradients) vs {against}", not failing, detail)


def param_table(params: list[dict[str, Any]], others: list[dict[str, Any]], other_name: str) -> list[str]:
    """The five tensors with the worst updates and the head / embedding rows, against a second reference too."""
    if not params:
        return []
    lines = [
        f"{'parameter':<48} {'max abs':>9} {'rel L2':>9} {'upd rel L2':>10}"
        + (f" {'vs ' + other_name:>12}" if others else "")
    ]
    by_name = {p["name"]: p for p in others}
    shown = sorted(params, key=lambda p: -p["update_rel_l2"])[:5]
    shown += [p for p in params if ("lm_head" in p["name"] or "embed_tokens" in p["name"]) and p not in shown]
    for p in shown:
        line = f"{p['name']:<48} {p['max_abs']:>9.2e} {p['rel_l2']:>9.2e} {p['update_rel_l2']:>10.2e}"
        if p["name"] in by_name:
            line += f" {by_name[p['name']]['update_rel_l2']:>12.2e}"
        lines.append(line)
    return lines


def state_on_cpu(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ accelerate
def mode_of(accelerator) -> dict[str, Any]:
    """What accelerate runs: DDP, FSDP1/2 (with their settings), ZeRO-N, one process; backend and device."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    kind = accelerator.distributed_type
    info: dict[str, Any] = {"distributed_type": str(kind), "world_size": accelerator.num_processes}
    if kind == DistributedType.FSDP:
        plugin = state.fsdp_plugin
        version = getattr(plugin, "fsdp_version", 1)
        info.update(mode=f"FSDP{version}", fsdp_version=version)
        if version == 2:
            info["reshard_after_forward"] = str(getattr(plugin, "reshard_after_forward", None))
        else:
            info["sharding_strategy"] = str(getattr(plugin, "sharding_strategy", None))
            info["use_orig_params"] = getattr(plugin, "use_orig_params", None)
        info["auto_wrap_policy"] = str(getattr(plugin, "auto_wrap_policy", None))
    elif kind == DistributedType.NO:
        info["mode"] = "single-process"
    elif kind == DistributedType.DEEPSPEED:
        stage = state.deepspeed_plugin.zero_stage
        info.update(mode=f"ZeRO-{stage}", zero_stage=stage)
    else:
        info["mode"] = "DDP"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        info["backend"] = torch.distributed.get_backend()
    info["device"] = str(accelerator.device)
    return info


def check_launch(accelerator) -> str | None:
    """Why this process's accelerator is not what the launch asked for (None when it is)."""
    from accelerate.utils import DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        return (
            f"launched with WORLD_SIZE={launched} but accelerate runs {accelerator.num_processes} process(es) "
            f"({accelerator.distributed_type}); on a CPU machine use ACCELERATE_USE_CPU=true"
        )
    asked = {"ACCELERATE_USE_DEEPSPEED": DistributedType.DEEPSPEED, "ACCELERATE_USE_FSDP": DistributedType.FSDP}
    for variable, kind in asked.items():
        if os.environ.get(variable, "false").lower() == "true" and accelerator.distributed_type != kind:
            hint = (
                " (accelerate enables FSDP on accelerators only; on CPU add --cpu-fsdp)" if "FSDP" in variable else ""
            )
            return f"the launch config asks for {kind} but accelerate runs {accelerator.distributed_type}{hint}"
    return None


def full_state_dict(accelerator, model) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters on rank 0 (empty elsewhere), CPU."""
    if mode_of(accelerator)["mode"].startswith("ZeRO"):
        # ZeRO-3 gathers its partitions (stage3_gather_16bit_weights_on_model_save; on rank 0 only, None elsewhere);
        # ZeRO-2 keeps whole parameters on every rank.
        state = accelerator.get_state_dict(model)
    elif accelerator.num_processes > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload: rank 0 alone gets the full tensors (on CPU); FSDP1 on a CPU model segfaults with it (torch 2.13)
        offload = accelerator.device.type != "cpu"
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    else:
        state = accelerator.unwrap_model(model).state_dict()
    if not accelerator.is_main_process or state is None:
        return {}
    out = {}
    for name, value in state.items():
        if hasattr(value, "full_tensor"):  # a DTensor left in the dict
            value = value.full_tensor()
        out[name.removeprefix("module.").removeprefix("_orig_mod.")] = value.detach().to("cpu", copy=True)
    return out


def agree(ok: bool, device: torch.device | None = None) -> bool:
    """Rank 0's verdict on every rank (each exits with it)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return ok
    verdict = [ok]
    torch.distributed.broadcast_object_list(verdict, src=0)
    return bool(verdict[0])


# ------------------------------------------------------------------------------------------------ the report
class Report:
    """A check's verdicts and record, on rank 0 (elsewhere every method does nothing but keep the verdicts).

    ``with report.phase("reference"): ...`` times a phase and writes the JSON after it (status "running"); a
    SIGTERM or SIGINT writes it with the phase it stopped in; :meth:`finish` prints the verdicts and writes it
    done. The JSON holds ``env`` (device, versions, the commit and whether the tree was clean), ``args``,
    ``checks``, ``seconds`` per phase and whatever the check put in ``data``."""

    def __init__(self, check: str, args: Any, name: str, out: str | Path, rank: int = 0) -> None:
        self.check_name, self.rank0 = check, rank == 0
        self.path = out_path(out, name)
        self.checks: list[dict[str, Any]] = []
        self.t0 = time.time()
        self.current: str | None = None
        self.data: dict[str, Any] = {
            "check": check,
            "ok": None,
            "status": "running",
            "args": vars(args) if hasattr(args, "__dict__") else args,
            "env": env_info() if self.rank0 else {},
            "checks": self.checks,
            "seconds": {},
        }
        if self.rank0:
            for signum in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(ValueError):  # not the main thread
                    signal.signal(signum, self._stopped)

    def _stopped(self, signum: int, _frame) -> None:
        self.write(status=f"interrupted by {signal.Signals(signum).name} in {self.current or 'the setup'}")
        print(f"{self.check_name}: stopped by {signal.Signals(signum).name}; wrote {self.path}", flush=True)
        os._exit(128 + signum)

    @contextlib.contextmanager
    def phase(self, name: str):
        self.current, begun = name, time.time()
        try:
            yield
        finally:
            self.data["seconds"][name] = round(time.time() - begun, 2)
            self.current = None
        self.write()

    def check(self, name: str, passed: Any, detail: str) -> None:
        self.checks.append({"name": name, "ok": bool(passed), "detail": detail})

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)

    def write(self, status: str | None = None) -> None:
        if not self.rank0:
            return
        self.data["seconds"].pop("total", None)
        self.data["seconds"]["total"] = round(time.time() - self.t0, 2)
        if status is not None:
            self.data["status"] = status
        write_json(self.path, self.data)

    def finish(self, title: list[str], table: list[str], label: str) -> bool:
        """Print the title, the table, every check and the verdict; write the JSON; return the verdict."""
        ok = self.ok
        if self.rank0:
            self.data["ok"] = ok
            self.write(status="done")
            seconds = ", ".join(f"{k} {v:.1f}s" for k, v in self.data["seconds"].items())
            print("=" * 100)
            print("\n".join(title + table))
            for c in self.checks:
                print(f"{'PASS' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}")
            print(f"{'PASS' if ok else 'FAIL'} {self.check_name} {label} ({seconds})")
            print("=" * 100)
            print(f"wrote {self.path}", flush=True)
        return ok
