"""The options of a patched model (:class:`LCEOptions`), checked when ``apply_fused_lce`` is called, and the
attribute that holds them on the model (or on its class, for a class patch).

Most options are passed on to the op. They are checked up front by building the op's own options object from
them (:class:`CrossEntropyOptions`, whose construction is the op's checks), so that a bad option fails at
``apply_fused_lce`` (and at ``FusedLCECallback(...)``) rather than at the first training step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..ops.linear_cross_entropy.options import OP_NAME, CrossEntropyOptions

# Where apply_fused_lce stores the LCEOptions: on the instance, or on the class for a class patch.
OPTIONS_ATTR = "_lce_patch_options"


@dataclass(frozen=True)
class LCEOptions:
    """Options of a patched model (stored on the model instance, or on the class for a class patch)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    backend: str = "auto"
    chunk_size: int | None = None
    deterministic: bool = False
    skip_ignored: bool = True
    fp32_weight_grad: bool = False
    # None: evaluation returns the logits like the unpatched model, except where the caller needs the
    # loss only (``loss_only()``, ``skip_logits=True``); False: never; True: always
    return_logits_in_eval: bool | None = None
    allow_unregistered: bool = False

    def __post_init__(self) -> None:
        try:
            CrossEntropyOptions(
                ignore_index=self.ignore_index,
                label_smoothing=self.label_smoothing,
                z_loss=self.z_loss,
                backend=self.backend,
                chunk_size=self.chunk_size,
                skip_ignored=self.skip_ignored,
                fp32_weight_grad=self.fp32_weight_grad,
            )
        except ValueError as error:  # the op's message, under the name the user called
            raise ValueError(str(error).replace(f"{OP_NAME}:", "lce_patch:", 1)) from None
        # not the op's: the patched forward reads it
        if self.return_logits_in_eval not in (None, True, False):
            raise ValueError(
                f"lce_patch: return_logits_in_eval must be None, True or False, got {self.return_logits_in_eval!r}"
            )

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> LCEOptions:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"lce_patch: unknown option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**options)
