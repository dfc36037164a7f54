"""``lce-patch``, the command line: ``lce-patch run [--option NAME=VALUE ...] [--report PATH] -- COMMAND [ARGS ...]``
runs COMMAND with the fused loss switched on in every ``transformers.Trainer`` of every Python process it starts
(``lce_patch.integrations.launch``). ``python -m lce_patch`` is the same command."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

_EPILOG = """\
examples:
  lce-patch run -- llamafactory-cli train examples/train_lora/llama3_lora_sft.yaml
  lce-patch run --option chunk_size=4096 -- swift sft --model Qwen/Qwen2.5-0.5B-Instruct --dataset data.jsonl
  lce-patch run --report lce.jsonl -- torchrun --nproc_per_node 2 train.py

Each Trainer logs one line once its first optimizer step has run the fused loss (a warning where it did not).
Options are FusedLCECallback's (docs: the options table); VALUE is read as JSON (8, 0.1, true, null), else as text.
"""


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"True": True, "False": False, "None": None}.get(text, text)


def _options(pairs: list[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            parser.error(f"--option takes NAME=VALUE, got {pair!r}")
        options[name.strip()] = _value(value)
    from .models import LCEOptions

    try:
        LCEOptions.from_kwargs(options)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    return options


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lce-patch", description="lce_patch's command line.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run a program with the fused loss on in every transformers Trainer it builds",
        description="Run COMMAND with lce_patch's fused loss switched on in every transformers.Trainer built in "
        "it and in every Python process it starts (torchrun, accelerate launch, deepspeed, a front end's own "
        "launcher).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--option", action="append", default=[], metavar="NAME=VALUE", help="a FusedLCECallback option (repeatable)"
    )
    run.add_argument(
        "--report",
        metavar="PATH",
        help="append one JSON line per process that built a Trainer: whether the fused ops ran, their call counts",
    )
    run.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS ...]")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("run needs a command: lce-patch run [--option NAME=VALUE ...] -- COMMAND [ARGS ...]")
    options = _options(args.option, parser)
    from .integrations.launch import launch_environment

    env = launch_environment(options, args.report, dict(os.environ))
    executable = shutil.which(program[0], path=env.get("PATH"))
    if executable is None:
        print(f"lce-patch run: command not found: {program[0]}", file=sys.stderr)
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, program, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
