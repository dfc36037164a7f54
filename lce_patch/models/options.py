"""The options of a patched model (:class:`LCEOptions`), checked when ``apply_fused_lce`` is called, and the
attribute that holds them on the model (or on its class, for a class patch).

Most options are passed on to the op. They are checked up front by building the op's own options object from
them (:class:`CrossEntropyOptions`, whose construction is the op's checks), so that a bad option fails at
``apply_fused_lce`` (and at ``FusedLCECallback(...)``) rather than at the first training step.

``class_weights`` is a tensor, which a frozen, compared and hashed options object cannot hold as is: it is kept
as a :class:`ClassWeights`, an immutable copy compared by value, which also holds the copies the op reads (one
per device and dtype, made on first use instead of on every step).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.core import check_weights
from ..ops.linear_cross_entropy import OP_NAME, CrossEntropyOptions, check_flag, loss_weights

# Where apply_fused_lce stores the LCEOptions: on the instance, or on the class for a class patch.
OPTIONS_ATTR = "_lce_patch_options"


def _as_ours(error: ValueError) -> ValueError:
    """The op's message, under the name the user called."""
    return ValueError(str(error).replace(f"{OP_NAME}:", "lce_patch:", 1))


class ClassWeights:
    """``LCEOptions.class_weights``: one loss weight per vocabulary entry (as ``torch.nn.CrossEntropyLoss(weight=)``).

    Holds a float64 CPU copy of the tensor it was given (later changes to that tensor do not reach it) and
    compares by value: two option sets with equal weights are equal, with different weights unequal. The op
    reads :meth:`on`'s copy for the head's device, made once per device and dtype and reused on every step.
    Deep copies share it (it is immutable); pickling keeps the values only.
    """

    __slots__ = ("_values", "_hash", "_copies", "_lock")

    def __init__(self, weights: torch.Tensor) -> None:
        """``weights``: [V], floating point, finite and >= 0 (any device); checked by the op's own checks."""
        if isinstance(weights, torch.Tensor) and weights.dim() != 1:
            raise ValueError(f"lce_patch: class_weights must be a 1-D tensor [V], got shape {tuple(weights.shape)}")
        try:
            vocab = weights.shape[0] if isinstance(weights, torch.Tensor) else 0
            device = weights.device if isinstance(weights, torch.Tensor) else None
            loss_weights(None, weights, (1,), vocab, device, CrossEntropyOptions())
            values = weights.detach().to("cpu", torch.float64, copy=True)
            check_weights(values, "class_weights", OP_NAME)  # on the CPU copy: a ValueError, also for CUDA weights
        except ValueError as error:
            raise _as_ours(error) from None
        self._values = values
        self._hash = hash(values.numpy().tobytes())  # once: the options are hashed and compared often
        self._copies: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._lock = threading.Lock()

    @property
    def values(self) -> torch.Tensor:
        """The weights: [V] float64 on the CPU (a copy)."""
        return self._values.clone()

    def __len__(self) -> int:
        return self._values.shape[0]

    def on(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The weights on ``device`` in ``dtype`` ([V]), made on the first call for that pair and reused."""
        key = (torch.device(device), dtype)
        copy = self._copies.get(key)
        if copy is None:
            with self._lock:
                copy = self._copies.get(key)
                if copy is None:
                    copy = self._values.to(device=key[0], dtype=dtype)
                    self._copies[key] = copy
        return copy

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClassWeights):
            return NotImplemented
        return self is other or (self._hash == other._hash and torch.equal(self._values, other._values))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        values = self._values
        return f"ClassWeights(V={len(self)}, min={float(values.min()):.4g}, max={float(values.max()):.4g})"

    def __reduce__(self) -> tuple:
        return (ClassWeights, (self._values,))

    def __deepcopy__(self, memo: dict) -> ClassWeights:
        return self


@dataclass(frozen=True)
class LCEOptions:
    """Options of a patched model (stored on the model instance, or on the class for a class patch).

    ``class_weights`` may be given as a [V] tensor (kept as a :class:`ClassWeights`). ``return_lse`` /
    ``return_token_accuracy`` / ``return_predicted_tokens``: calls that compute a loss also return the per-token
    log-sum-exp / the token accuracy / the per-token argmax on their output (``lse``, ``token_accuracy``,
    ``predicted_tokens``).
    """

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
    class_weights: ClassWeights | None = None
    return_lse: bool = False
    return_token_accuracy: bool = False
    return_predicted_tokens: bool = False

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
            check_flag("return_lse", self.return_lse)
            check_flag("return_token_accuracy", self.return_token_accuracy)
            check_flag("return_predicted_tokens", self.return_predicted_tokens)
        except ValueError as error:
            raise _as_ours(error) from None
        if self.class_weights is not None and not isinstance(self.class_weights, ClassWeights):
            object.__setattr__(self, "class_weights", ClassWeights(self.class_weights))
        # not the op's: the patched forward reads it
        if self.return_logits_in_eval not in (None, True, False):
            raise ValueError(
                f"lce_patch: return_logits_in_eval must be None, True or False, got {self.return_logits_in_eval!r}"
            )

    @property
    def extra_outputs(self) -> tuple[str, ...]:
        """The outputs that calls computing a loss attach (of ``lse``, ``token_accuracy``, ``predicted_tokens``)."""
        asked = (self.return_lse, self.return_token_accuracy, self.return_predicted_tokens)
        return tuple(name for name, flag in zip(("lse", "token_accuracy", "predicted_tokens"), asked) if flag)

    @property
    def returns_extras(self) -> bool:
        """Whether calls that compute a loss attach any of the extra outputs."""
        return bool(self.extra_outputs)

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> LCEOptions:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"lce_patch: unknown option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**options)
