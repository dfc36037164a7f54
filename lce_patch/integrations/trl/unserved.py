"""TRL's experimental trainers left on TRL's path: a warning, once per trainer class.

GOLD, SDFT, SDPO and IW-OPD compute their loss from the full ``[tokens x vocabulary]`` logits in ways no op of this
version replaces (see the Trainer and TRL page); ``FusedLCECallback`` only patches their model. :func:`serve` warns
and returns False; :func:`unserve` has nothing to undo.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..serving import ROWS, mro_lookup

__all__ = ["serve", "unserve"]

_warned: set[str] = set()


def serve(trainer: Any, options: dict[str, Any]) -> bool:
    """Warn, once per trainer class, that ``trainer`` (one of the serving table's rows served by this module) trains
    as without lce_patch. Returns False: nothing is served."""
    del options
    rows = {row.key: row for row in ROWS if row.serving == __name__}
    found = mro_lookup(type(trainer), rows)
    if found is None:
        return False
    name = found[0].__name__
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"lce_patch: TRL's {name} computes its loss from the full [tokens x vocabulary] logits, which "
            "this lce_patch does not replace; FusedLCECallback only patches the model's own loss, and this "
            "trainer trains as without it. See the TRL trainer table in lce_patch's docs.",
            stacklevel=3,
        )
    return False


def unserve(trainer: Any) -> bool:
    """Nothing was served: returns False."""
    del trainer
    return False
