"""TRL's trainers left on TRL's path: a warning, once per trainer class.

GOLD, SDFT, SDPO and IW-OPD compute their loss from the full ``[tokens x vocabulary]`` logits in ways no op of this
version replaces (see the Trainer and TRL page); ``FusedLCECallback`` only patches their model. :func:`serve` warns
and returns False; :func:`unserve` has nothing to undo.

On a TRL without the fused-LM-head protocol (TRL < 1.15) the serving table routes SFT, DPO, KTO, GRPO, RLOO and the
trainers built on them here too (``serving.without_fused_head``): they read the model's full logits themselves (SFT
its entropy and token accuracy), so :func:`serve` warns (``protocol.no_fused_head_warning``) and makes the trainer's
``compute_loss`` revert the callback's patch of its model before the first call, which then trains as without
lce_patch; :func:`unserve` puts ``compute_loss`` back (the model stays unpatched).
"""

from __future__ import annotations

import warnings
from typing import Any

from ...models import is_patched, revert_fused_lce
from ..serving import ROWS, Row, without_fused_head
from ..shared import is_served, replace_method, restore_method
from .protocol import no_fused_head_warning

__all__ = ["serve", "unserve"]

_TABLE = {row.key: row for row in ROWS}

_warned: set[str] = set()


def _warn_once(name: str, message: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(message, stacklevel=4)


def serve(trainer: Any, row: Row, options: dict[str, Any]) -> bool:
    """Warn, once per trainer class, that ``trainer`` (of ``row``'s class, which the serving table routes to this
    module) trains as without lce_patch; on a TRL without the fused LM head, also make its ``compute_loss`` revert the
    model's patch. Returns False: nothing is served."""
    del options
    if row.serving != __name__:
        return False
    if row is without_fused_head(_TABLE.get(row.key, row)):  # a fused-head row, on TRL < 1.15
        _warn_once(row.name, no_fused_head_warning(row.name))
        if not is_served(vars(trainer).get("compute_loss")):
            replace_method(trainer, "compute_loss", _reverting_compute_loss(trainer))
        return False
    _warn_once(
        row.name,
        f"lce_patch: TRL's {row.name} computes its loss from the full [tokens x vocabulary] logits, which this "
        "lce_patch does not replace; FusedLCECallback only patches the model's own loss, and this trainer trains "
        "as without it. See the TRL trainer table in lce_patch's docs.",
    )
    return False


def _reverting_compute_loss(trainer: Any) -> Any:
    """``trainer.compute_loss``, first reverting the instance patch of ``trainer.model`` (the callback patches it at
    the end of ``__init__`` and again when training starts), so that TRL's loss reads the model's own logits."""
    compute_loss = trainer.compute_loss

    def served(*args: Any, **kwargs: Any) -> Any:
        model = getattr(trainer, "model", None)
        if model is not None and is_patched(model):
            revert_fused_lce(model)
        return compute_loss(*args, **kwargs)

    return served


def unserve(trainer: Any, row: Row) -> bool:
    """Put back the ``compute_loss`` that :func:`serve` wrapped on a trainer without TRL's fused head; whether there
    was one. (The model's patch, reverted by that wrapper, stays reverted.)"""
    del row
    return restore_method(trainer, "compute_loss")
