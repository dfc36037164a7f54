"""``lce-patch run``: the fused loss switched on in a program lce_patch's user did not write.

``lce-patch run [--option NAME=VALUE ...] [--report PATH] -- COMMAND [ARGS ...]`` (``lce_patch/cli.py``) runs
COMMAND with ``site/`` first on ``PYTHONPATH``; its ``sitecustomize`` runs at the start of every Python process
COMMAND starts, however it starts them (torchrun, ``accelerate launch``, ``deepspeed``, a front end's launcher:
each passes its environment on), and wraps ``transformers.Trainer.__init__`` once ``transformers.trainer`` is
imported. The first Trainer built calls :func:`install`, which, for every Trainer of the process:

- adds ``FusedLCECallback(**options)`` to the callbacks it is built with, unless one is there already (passed by
  the program, e.g. axolotl's plugin or a ``--callbacks`` option): then the program's is kept, with its options;
- a ``FusedLCECallback`` added after construction (``trainer.add_callback``) replaces the launcher's, its options
  applied to the model.

The callback says its one line once the first optimizer step shows that the fused ops ran, and warns where they
did not (``integrations/trainer.py``). With ``--report PATH`` each process that built a Trainer appends one JSON
line to PATH when it exits: its pid, argv, and per Trainer its class, the model, whether the fused ops ran in its
first step, the line, and the fused ops' calls in the process.

A plain install changes nothing: only a process started under the launcher has ``site/`` on its path.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

from ...models import apply_fused_lce, is_patched, unannounced, unwrap_causal_lm
from ...ops import op_calls
from ..trainer import FusedLCECallback

__all__ = ["OPTIONS_ENV", "REPORT_ENV", "SITE_DIR", "install", "launch_environment"]

OPTIONS_ENV = "LCE_PATCH_RUN_OPTIONS"
"""The environment variable holding the options, as a JSON object."""
REPORT_ENV = "LCE_PATCH_REPORT"
"""The environment variable naming the report file (JSON lines), if any."""
HOME_ENV = "LCE_PATCH_HOME"
SITE_DIR = Path(__file__).resolve().parent / "site"
"""The folder put first on ``PYTHONPATH``; holds the ``sitecustomize`` that switches the launcher on."""

_MARK = "__lce_patch_launcher__"
# Per Trainer built: its class name, its FusedLCECallback (None: given as a class), whether the launcher added it.
_TRAINERS: list[tuple[str, FusedLCECallback | None, bool]] = []


def launch_environment(options: dict[str, Any], report: str | None, environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with the launcher switched on: ``site/`` first on ``PYTHONPATH``, the options (JSON), the report
    path (absolute), and lce_patch's folder as a last resort for an interpreter that does not have it installed."""
    env = dict(environ)
    path = [str(SITE_DIR), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR))]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env[OPTIONS_ENV] = json.dumps(options)
    if report is not None:
        env[REPORT_ENV] = str(Path(report).resolve())
    else:
        env.pop(REPORT_ENV, None)
    env[HOME_ENV] = str(Path(__file__).resolve().parents[3])
    return env


def _options() -> dict[str, Any]:
    raw = os.environ.get(OPTIONS_ENV) or "{}"
    options = json.loads(raw)
    if not isinstance(options, dict):
        raise ValueError(f"lce_patch: {OPTIONS_ENV} must hold a JSON object of options, got {raw!r}")
    return options


def _is_fused_callback(callback: Any) -> bool:
    cls = callback if isinstance(callback, type) else type(callback)
    return issubclass(cls, FusedLCECallback)


def install(trainer_class: type, original_init: Any) -> None:
    """Give every ``trainer_class`` (``transformers.Trainer``) built from now on the launcher's callback.

    ``original_init``: the ``__init__`` the bootstrap found. Idempotent. Called by ``site/sitecustomize.py``."""
    if getattr(trainer_class.__init__, _MARK, None) == "installed":
        return
    options = _options()
    FusedLCECallback(**options)  # a bad option fails at the first Trainer, naming it
    signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        callbacks = list(bound.arguments.get("callbacks") or [])
        theirs = [c for c in callbacks if _is_fused_callback(c)]
        if theirs:
            _TRAINERS.append((type(self).__name__, theirs[0] if not isinstance(theirs[0], type) else None, False))
        else:
            ours = FusedLCECallback(**options)
            bound.arguments["callbacks"] = [*callbacks, ours]
            _TRAINERS.append((type(self).__name__, ours, True))
        original_init(*bound.args, **bound.kwargs)

    setattr(__init__, _MARK, "installed")
    trainer_class.__init__ = __init__

    original_add = trainer_class.add_callback

    @functools.wraps(original_add)
    def add_callback(self, callback: Any) -> None:
        if _is_fused_callback(callback):
            launchers = [ours for _, ours, launched in _TRAINERS if launched]
            for existing in list(self.callback_handler.callbacks):
                if any(existing is ours for ours in launchers):
                    self.callback_handler.remove_callback(existing)
                    added = callback() if isinstance(callback, type) else callback
                    if self.model is not None and is_patched(unwrap_causal_lm(self.model)):
                        with unannounced():  # patching again replaces the options; the callback's line says it
                            apply_fused_lce(self.model, **added.options)
                    for i, (name, ours, _) in enumerate(_TRAINERS):
                        if ours is existing:
                            _TRAINERS[i] = (name, added, False)
                    return original_add(self, added)
        return original_add(self, callback)

    trainer_class.add_callback = add_callback
    if os.environ.get(REPORT_ENV):
        atexit.register(_write_report, os.environ[REPORT_ENV])


def _write_report(path: str) -> None:
    """Append this process's line to the report: every Trainer built, what its first step showed."""
    trainers = []
    for name, callback, launched in _TRAINERS:
        outcomes = callback.outcomes if callback is not None else []
        # a Trainer built but never trained (or whose callback the program gave as a class) says so
        for outcome in outcomes or [{"trainer": name, "fused": None, "line": None, "op_calls": {}}]:
            trainers.append({**outcome, "callback": "launcher" if launched else "program"})
    record = {"pid": os.getpid(), "argv": sys.argv, "trainers": trainers, "op_calls": op_calls()}
    with open(path, "a", encoding="utf-8") as report:  # one write per process: lines of processes do not mix
        report.write(json.dumps(record, default=str) + "\n")
