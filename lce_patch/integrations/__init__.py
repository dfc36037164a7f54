"""Training-framework integrations: ``FusedLCECallback`` for ``transformers.Trainer`` (``trainer.py``), the table
of the trainers it serves (``serving.py``) and what their serving modules share (``shared.py``), TRL's trainers
(``trl/``) and the axolotl plugin (``axolotl/``).

Imported lazily so that ``import lce_patch`` does not import the Trainer stack.
"""

from typing import Any

__all__ = ["FusedLCECallback"]


def __getattr__(name: str) -> Any:
    if name == "FusedLCECallback":
        from .trainer import FusedLCECallback

        return FusedLCECallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
