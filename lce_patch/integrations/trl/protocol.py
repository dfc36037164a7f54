"""What the TRL serving modules check TRL's code against, and the error they raise when it differs.

Detection is by feature, not by version: a serving module finds TRL's class among the trainer's bases by module and
name, and compares the code of each method whose work it replicates (the global and attribute names it uses, its
parameters) with TRL 1.16's. Code that differs raises :class:`TRLProtocolError`, naming the TRL version and what
changed; a subclass that overrides such a method keeps TRL's path, with a warning.

TRL's fused-LM-head protocol (TRL >= 1.15) is found the same way, by feature (:func:`has_fused_lm_head`): on an older
TRL, SFT, DPO, KTO, GRPO and RLOO have no head for lce_patch to serve and read the model's full logits themselves, so
the serving table routes them to TRL's own path (``unserved``), with the warning of :func:`no_fused_head_warning`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from typing import Any, NoReturn

from ..serving import Row
from ..shared import code_names, function

__all__ = [
    "TRLProtocolError",
    "check_names",
    "has_fused_lm_head",
    "no_fused_head_warning",
    "served_base",
    "trainer_protocol_error",
    "trl_version",
]


class TRLProtocolError(RuntimeError):
    """TRL's code (its fused LM head, or a trainer's method lce_patch replicates) is not the one this version of
    lce_patch recognises."""


def trl_version() -> str:
    """The installed TRL's version, for messages ("unknown" if it cannot be read)."""
    try:
        from importlib.metadata import version

        return version("trl")
    except Exception:  # noqa: BLE001 - only for the message
        try:
            import trl

            return str(getattr(trl, "__version__", "unknown"))
        except Exception:  # noqa: BLE001
            return "unknown"


@functools.cache
def has_fused_lm_head() -> bool:
    """Whether the installed TRL has its fused-LM-head protocol: ``trl.trainer.utils.add_fused_lm_head``, through
    which SFT, DPO, KTO, GRPO and RLOO (TRL >= 1.15) put their own LM head on the model, the head lce_patch serves."""
    try:
        utils = importlib.import_module("trl.trainer.utils")
    except ImportError:
        return False
    return callable(getattr(utils, "add_fused_lm_head", None))


def no_fused_head_warning(trainer_name: str) -> str:
    """The warning for TRL's ``trainer_name`` on a TRL without the fused-LM-head protocol (TRL < 1.15)."""
    return (
        f"lce_patch: TRL {trl_version()} has no fused LM head (TRL >= 1.15 installs one on the model, which lce_patch "
        f"serves), and its {trainer_name} reads the model's full logits: it trains on TRL's own unfused path, "
        "building the [tokens x vocabulary] logits, and FusedLCECallback leaves its model unpatched. The "
        f"transformers Trainer is fused on any TRL; upgrade TRL to 1.15 or later to train {trainer_name} fused."
    )


def trainer_protocol_error(trainer_name: str, what: str) -> NoReturn:
    """Raise :class:`TRLProtocolError` for TRL's ``trainer_name`` whose code differs from TRL 1.16's in ``what``."""
    raise TRLProtocolError(
        f"lce_patch does not recognise {trainer_name} of TRL {trl_version()}: {what}. lce_patch replicates the "
        f"training-step methods of TRL 1.16's {trainer_name} with its fused op. Upgrade lce_patch, pin a TRL it "
        "supports, or train without FusedLCECallback (TRL's own methods then build the full logits)."
    )


def check_names(trainer_name: str, base: type, method: str, known: frozenset[str], *, unwrap: bool = False) -> None:
    """Raise :class:`TRLProtocolError` unless TRL's ``base.method`` uses exactly the ``known`` names (``unwrap``: the
    function under its decorators, e.g. TRL's profiling one)."""
    fn = function(base, method)
    if not inspect.isfunction(fn):
        trainer_protocol_error(trainer_name, f"it has no function {method}")
    used = code_names(inspect.unwrap(fn) if unwrap else fn)
    if used != known:
        trainer_protocol_error(
            trainer_name,
            f"{method} uses names unknown to this lce_patch ({sorted(used - known)}) or no longer uses known "
            f"ones ({sorted(known - used)})",
        )


def served_base(trainer: Any, row: Row, method: str, known: frozenset[str]) -> type | None:
    """TRL's class of ``row`` among the trainer's bases, if the trainer runs its ``method`` and that method uses the
    ``known`` names; None (with a warning where a subclass overrides the method) otherwise.

    Raises:
        TRLProtocolError: TRL's method is not the one replicated here.
    """
    name = row.name
    base = row.base_of(trainer)
    if base is None:
        return None
    check_names(name, base, method, known)
    if function(type(trainer), method) is not function(base, method) or method in vars(trainer):
        warnings.warn(
            f"lce_patch: {type(trainer).__name__} overrides {name}'s {method}; this trainer keeps TRL's own path, "
            "which builds the full [tokens x vocabulary] logits.",
            stacklevel=3,
        )
        return None
    return base
