"""Run a test body on several CPU processes joined by a gloo process group (torch.distributed).

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, each of which initializes the
default group with the gloo backend and calls ``fn(rank, world_size, *args)``. An exception on any rank
fails the calling test with that rank's traceback. ``fn`` must be importable (a module-level function).
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NATIVE_ABORT = "terminate called without an active exception"


def rerun_on_native_abort(launch: Callable[[], subprocess.CompletedProcess]) -> subprocess.CompletedProcess:
    """``launch()`` (a launch of CPU processes over gloo), once more if a rank aborted natively.

    Seen in about one fresh-clone CI run in twenty (2026-11-24: tp_check; 2026-11-27: the ZeRO-3 check): a rank
    aborts (SIGABRT, std::terminate) after a step, and a rerun does not repeat it. A second launch tells that apart
    from a real failure, which fails again (a wrong result exits 1 with FAIL, not an abort)."""
    result = launch()
    if result.returncode != 0 and NATIVE_ABORT in result.stdout + result.stderr:
        result = launch()
    return result


def free_port() -> int:
    """A TCP port nobody listens on now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_args(processes: int) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node N`` on a port of its own (see :func:`accelerate_launch_args`)."""
    return ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", str(free_port())]


def accelerate_launch_args(config) -> list[str]:
    """``python -m accelerate.commands.launch --config_file CONFIG`` on a port of its own: two launches of the
    default port (29500) from tests running side by side would meet in one rendezvous."""
    return ["-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port", str(free_port())]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes (gloo); raises on any failure."""
    mp.start_processes(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, start_method="spawn")
