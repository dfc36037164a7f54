"""The options registry: every option of ``apply_fused_lce`` and ``FusedLCECallback`` written once, as a field of
:class:`LCEOptions` with its :class:`Option` (its doc line, whether the op checks it, whether it changes the loss or
adds an output, whether it reaches the log-probability and divergence ops, its axolotl key); the options TRL's
trainers get, the self-check's neutral options, the axolotl plugin's keys and the docs' tables are derived from it.
The options are checked when ``apply_fused_lce`` is called and held on the model (or on its class, for a class
patch) under :data:`OPTIONS_ATTR`.

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
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.core import BACKENDS, check_weights
from ..ops.linear_cross_entropy import OP_NAME, CrossEntropyOptions, build_options, check_flag, loss_weights

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
class Option:
    """What the registry says of one option of :class:`LCEOptions` (its name and default are the field's).

    doc: one line for the documentation's table and the axolotl key's description. op: checked by the op's own
    options (:class:`CrossEntropyOptions`' field of the same name), the others by :class:`LCEOptions` itself.
    changes_loss: off its default, the loss is not the plain negative log-likelihood over the labels other than
    -100 that Hugging Face's and TRL's losses compute. adds_output: calls that compute a loss return one more output.
    log_probs / divergence: reaches :func:`lce_patch.fused_linear_log_probs` (TRL's trainers built on per-token
    log-probabilities) / the divergence ops (the distillation trainers). axolotl: the axolotl plugin's key
    ``lce_patch_<name>`` sets it. choices: the values it takes, where they are few.
    """

    doc: str
    choices: tuple[str, ...] | None = None
    op: bool = False
    changes_loss: bool = False
    adds_output: bool = False
    log_probs: bool = False
    divergence: bool = False
    axolotl: bool = False


_OPTION = "lce_patch_option"  # the field metadata key of each LCEOptions field's Option


def _option(default: Any, doc: str, **what: Any) -> Any:
    return dataclasses.field(default=default, metadata={_OPTION: Option(doc, **what)})


@dataclass(frozen=True)
class LCEOptions:
    """Options of a patched model (stored on the model instance, or on the class for a class patch): the options
    registry, each option written once, with what it is and where it reaches (:class:`Option`, read through
    :data:`OPTIONS`).

    ``class_weights`` may be given as a [V] tensor (kept as a :class:`ClassWeights`). ``return_lse`` /
    ``return_token_accuracy`` / ``return_predicted_tokens``: calls that compute a loss also return the per-token
    log-sum-exp / the token accuracy / the per-token argmax on their output (``lse``, ``token_accuracy``,
    ``predicted_tokens``).
    """

    ignore_index: int = _option(-100, "The label that is not scored.", op=True, changes_loss=True)
    label_smoothing: float = _option(
        0.0, "Label smoothing, as `torch.nn.functional.cross_entropy`'s.", op=True, changes_loss=True
    )
    z_loss: float = _option(
        0.0, "Adds `z_loss * logsumexp**2` to each scored token's loss.", op=True, changes_loss=True
    )
    chunk_size: int | None = _option(
        None,
        "Tokens per chunk of logits (default: chosen from the shape); smaller: less memory, more launches.",
        op=True,
        log_probs=True,
        divergence=True,
        axolotl=True,
    )
    backend: str = _option(
        "auto",
        "'triton' kernels, the chunked 'torch' path, or 'auto' (Triton on a GPU).",
        choices=BACKENDS,
        op=True,
        log_probs=True,
        divergence=True,
        axolotl=True,
    )
    skip_ignored: bool = _option(True, "Skip the ignored tokens before the matmuls (one early count).", op=True)
    fp32_weight_grad: bool = _option(
        False, "Accumulate a bf16 head's weight gradient in fp32, rounded once.", op=True, divergence=True
    )
    # None: evaluation returns the logits like the unpatched model, except where the caller needs the
    # loss only (``loss_only()``, ``skip_logits=True``); False: never; True: always
    return_logits_in_eval: bool | None = _option(
        None,
        "Evaluation logits: unset = where the trainer needs them, true = always, false = never (then `predict()` "
        "and `compute_metrics` are refused).",
        axolotl=True,
    )
    allow_unregistered: bool = _option(
        False,
        "Patch an architecture lce_patch has no entry for, after checking it against its own loss on a test batch.",
        axolotl=True,
    )
    class_weights: ClassWeights | None = _option(
        None, "One loss weight per vocabulary entry, as `CrossEntropyLoss(weight=)`.", changes_loss=True
    )
    return_lse: bool = _option(False, "Calls with labels also return the per-token log-sum-exp.", adds_output=True)
    return_token_accuracy: bool = _option(
        False, "Calls with labels also return the fraction of tokens predicted right.", adds_output=True
    )
    return_predicted_tokens: bool = _option(
        False, "Calls with labels also return each position's argmax.", adds_output=True
    )

    def __post_init__(self) -> None:
        try:
            CrossEntropyOptions(**{name: getattr(self, name) for name, option in OPTIONS.items() if option.op})
            for name, option in OPTIONS.items():
                if option.adds_output:
                    check_flag(name, getattr(self, name))
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

    def op_options(self, **call: Any) -> CrossEntropyOptions:
        """The op's options object for one call, built once by the op's own builder (``fused_linear_cross_entropy``
        takes it as ``options=``): the options the op checks and the outputs asked for, under their names, with
        ``call``'s (the head's ``softcap`` and ``logit_scale``, the ``shift``, a call's own ``ignore_index``...)."""
        return build_options({**{name: getattr(self, name) for name in _OP_ARGUMENTS}, **call})

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> LCEOptions:
        if "deterministic" in options:
            options = {name: value for name, value in options.items() if name != "deterministic"}
            warnings.warn(
                "lce_patch: deterministic does nothing and will be removed: every path of the fused loss is "
                "deterministic already (no atomics, a fixed reduction order); leave it out",
                FutureWarning,
                stacklevel=3,
            )
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"lce_patch: unknown option(s) {unknown}; valid options: {sorted(OPTIONS)}")
        return cls(**options)


OPTIONS: dict[str, Option] = {field.name: field.metadata[_OPTION] for field in dataclasses.fields(LCEOptions)}
"""The options registry: each option of ``apply_fused_lce`` / ``FusedLCECallback`` by name, in declaration order."""
OPTION_DEFAULTS: dict[str, Any] = {field.name: field.default for field in dataclasses.fields(LCEOptions)}
"""Each option's default (an option that changes the loss is neutral there)."""


def option_names(**what: bool) -> tuple[str, ...]:
    """The options whose :class:`Option` has each of ``what`` as given, e.g. ``option_names(log_probs=True)``."""
    return tuple(name for name, option in OPTIONS.items() if all(getattr(option, k) == v for k, v in what.items()))


_OP_ARGUMENTS = option_names(op=True) + option_names(adds_output=True)
