"""Every multi-GPU check in one command, each in a launch of its own with a time limit, on a clean commit.

    python benchmarks/checks/run_all.py --gpus 4 --out runs/checks            # all of them (table below)
    python benchmarks/checks/run_all.py --gpus 4 --only fsdp2,cp --out runs/checks
    python benchmarks/checks/run_all.py --export DIR    # the committed tree (git archive HEAD) + a manifest, to run
                                                        # on a machine without the repository's .git

Launches (``--gpus N`` processes each; accelerate's configs are recipes/accelerate/*.yaml):

    ddp, fsdp1, fsdp2, zero2, zero3   multi_gpu_check.py (DDP, FSDP1, FSDP2, DeepSpeed ZeRO-2/3): losses and updates
                                      against one process
    cp, ulysses                       cp_check.py: the Trainer under context parallelism (cp_size=N) and DeepSpeed
                                      Ulysses (sp_size=N), against one process on the whole sequence
    tp, tp_fsdp                       tp_check.py --part model through DistributedConfig: tensor parallel N, and
                                      TP N/2 x FSDP2 2 (transformers >= 5.24)
    distill_zero3                     distill_multi_gpu_check.py: TRL's DistillationTrainer served under ZeRO-3

Every launch gets NVLink multicast off and ``LCE_BENCH_REQUIRE_CLEAN=1`` (the checks refuse code that is not a
clean commit; ``--allow-dirty`` to run anyway), writes its JSON and log into ``--out/NAME/``, and is stopped after
``--timeout`` seconds (SIGTERM, then SIGKILL): a check stopped writes what it had. ``--out/run_all.json`` holds
each launch's exit status, seconds and verdict line, rewritten after each launch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHECKS = Path(__file__).resolve().parent
REPO = CHECKS.parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_common import MULTICAST_OFF, TREE_MANIFEST, env_info, tree_state, write_json  # noqa: E402

CONFIGS = REPO / "recipes" / "accelerate"


def launches(gpus: int) -> dict[str, list[str]]:
    """Each launch's command line (python's arguments) for ``gpus`` processes."""

    def accelerate(config: str, script: str, *extra: str) -> list[str]:
        args = ["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / f"{config}.yaml")]
        args += ["--num_processes", str(gpus)]
        if config == "cp":
            args += ["--parallelism_config_cp_size", str(gpus)]
        if config == "ulysses":
            args += ["--parallelism_config_sp_size", str(gpus)]
        return [*args, str(CHECKS / script), *extra]

    def torchrun(script: str, *extra: str) -> list[str]:
        return ["-m", "torch.distributed.run", "--nproc_per_node", str(gpus), str(CHECKS / script), *extra]

    return {  # the order they run in
        **{name: accelerate(name, "multi_gpu_check.py") for name in ("ddp", "fsdp1", "fsdp2", "zero2", "zero3")},
        "cp": accelerate("cp", "cp_check.py"),
        "ulysses": accelerate("ulysses", "cp_check.py"),
        "tp": torchrun("tp_check.py", "--part", "model"),
        "tp_fsdp": torchrun("tp_check.py", "--part", "model", "--fsdp-size", "2"),
        "distill_zero3": accelerate("zero3", "distill_multi_gpu_check.py"),
    }


def export(dest: Path) -> None:
    """The committed tree (``git archive HEAD``) into ``dest``, with the manifest that lets the checks there name
    its commit and find out whether a file was changed since (bench_common.tree_state)."""
    dest.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    listing = subprocess.run(["git", "ls-tree", "-r", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    files = {}
    for line in listing.stdout.splitlines():
        meta, name = line.split("\t", 1)
        mode, kind, sha = meta.split()
        if kind == "blob" and mode != "120000":  # links are left out
            files[name] = sha
    manifest = {"commit": commit.stdout.strip(), "files": files}
    (dest / TREE_MANIFEST).write_text(json.dumps(manifest))
    print(f"exported {manifest['commit'][:7]} ({len(files)} files) to {dest}")


def run_one(name: str, args: list[str], out: Path, timeout: float, env: dict[str, str]) -> dict:
    """One launch in its own process group; stopped (SIGTERM, then SIGKILL) past ``timeout``."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"{name}.log"
    begun = time.time()
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO,
            env={**env, "OUT": str(folder)},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = process.wait(timeout=timeout)
            stopped = False
        except subprocess.TimeoutExpired:
            stopped = True
            os.killpg(process.pid, signal.SIGTERM)
            try:
                rc = process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                rc = process.wait()
    text = log.read_text(errors="replace")
    verdicts = [line for line in text.splitlines() if line.startswith(("PASS ", "FAIL ")) and "(" in line]
    return {
        "rc": rc,
        "seconds": round(time.time() - begun, 1),
        "stopped_after_s": timeout if stopped else None,
        "verdict": verdicts[-1] if verdicts else None,
        "ok": rc == 0 and bool(verdicts) and verdicts[-1].startswith("PASS"),
        "json": sorted(str(p.relative_to(out)) for p in folder.glob("*.json")),
        "tail": None if rc == 0 else text[-1500:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=4, help="processes per launch")
    parser.add_argument(
        "--only", default=None, help=f"comma-separated launches (default: all): {', '.join(launches(1))}"
    )
    parser.add_argument("--skip", default="", help="comma-separated launches to leave out")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per launch")
    parser.add_argument("--budget", type=float, default=None, help="seconds in all; launches past it are not started")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / "checks"))
    parser.add_argument("--allow-dirty", action="store_true", help="run code that is not a clean commit")
    parser.add_argument("--export", default=None, metavar="DIR", help="export the committed tree to DIR and stop")
    args = parser.parse_args(argv)
    if args.export:
        export(Path(args.export))
        return 0
    table = launches(args.gpus)
    names = args.only.split(",") if args.only else list(table)
    unknown = sorted(set(names + [n for n in args.skip.split(",") if n]) - set(table))
    if unknown:
        parser.error(f"unknown launches {unknown}; known: {sorted(table)}")
    names = [n for n in names if n not in args.skip.split(",")]
    tree = tree_state()
    if not args.allow_dirty and (not tree["commit"] or tree["dirty"] is not False):
        raise SystemExit(f"run_all: the code is not a clean commit ({tree}); commit, or --export and run there")
    env = {**os.environ, **MULTICAST_OFF, "LCE_BENCH_REQUIRE_CLEAN": "0" if args.allow_dirty else "1"}
    out = Path(args.out)
    summary = {"env": env_info(), "gpus": args.gpus, "timeout_s": args.timeout, "launches": {}}
    begun = time.time()
    for name in names:
        if args.budget is not None and time.time() - begun + 30 > args.budget:
            summary["launches"][name] = {"ok": False, "not_started": f"past --budget {args.budget:.0f} s"}
            continue
        print(f"[run_all] {name}: {' '.join(table[name][-3:])}", flush=True)
        result = run_one(name, table[name], out, args.timeout, env)
        summary["launches"][name] = result
        write_json(out / "run_all.json", summary)
        print(f"[run_all] {name}: rc {result['rc']}, {result['seconds']} s: {result['verdict']}", flush=True)
        if result["tail"]:
            print(result["tail"], flush=True)
    print("\n| launch | verdict | seconds |\n|---|---|---|")
    for name, result in summary["launches"].items():
        if "not_started" in result:
            print(f"| {name} | not started ({result['not_started']}) | |")
            continue
        verdict = "PASS" if result["ok"] else ("stopped" if result["stopped_after_s"] else f"FAIL (rc {result['rc']})")
        print(f"| {name} | {verdict} | {result['seconds']} |")
    return 0 if all(r["ok"] for r in summary["launches"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
