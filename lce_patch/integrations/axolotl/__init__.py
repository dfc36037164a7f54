"""axolotl integration: the plugin (``plugins: [lce_patch.integrations.axolotl.LCEPatchPlugin]``, in ``plugin``)
and axolotl's knowledge-distillation trainer served by lce_patch's ops (``kd``).

The plugin's classes are imported on first use, so that ``kd`` and the serving table can be read without axolotl.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LCEPatchArgs", "LCEPatchPlugin"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
