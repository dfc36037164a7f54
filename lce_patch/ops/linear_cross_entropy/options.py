"""The cross-entropy op's name (every message starts with it), its checks bound to that name, and
:class:`CrossEntropyOptions`, everything about one call that is not a tensor, with :class:`VocabShard`, the
rank's part of a vocabulary split across a process group (used by ``vocab_parallel.py``).

The public functions build one options object per call (its checks run there, once); the label shift and the
vocabulary-parallel path read it, the chunked forward and backward take it whole, and the custom operators take
its fields as their arguments (:mod:`..core.schema`). A patched model's options are checked by building one too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..core import checks, reduction
from ..core.backend import BACKENDS
from ..core.schema import OPERATOR, OptionsSchema
from ..core.transform import LogitTransform

OP_NAME = "fused_linear_cross_entropy"
REDUCTIONS = reduction.REDUCTIONS


def fail(message: str) -> None:
    checks.fail(message, OP_NAME)


def check_int(name: str, value, **bounds) -> None:
    checks.check_int(name, value, op_name=OP_NAME, **bounds)


def check_real(name: str, value, **bounds) -> None:
    checks.check_real(name, value, op_name=OP_NAME, **bounds)


def check_flag(name: str, value) -> None:
    checks.check_flag(name, value, OP_NAME)


@dataclass(frozen=True)
class VocabShard:
    """This rank's part of a vocabulary split across a process group.

    start: the vocabulary id of the local weight's first row; total: the whole vocabulary's size V;
    group: the ``torch.distributed`` process group the vocabulary is split over (None: the default
    group). The local weight holds rows ``[start, start + V_local)``; the shards of the group's ranks
    must tile ``[0, total)`` exactly, and hidden states and labels must be the same on every rank.
    """

    start: int
    total: int
    group: Any = None


class ExtraOutputs(NamedTuple):
    """The per-row outputs a call computes beside the loss (``CrossEntropyOptions.want``): the entropy, whether the
    label is the argmax, the mean final logit, log(sum p^2), the log-sum-exp, and the argmax ids."""

    entropy: bool = False
    is_top1: bool = False
    mean_logit: bool = False
    log_sum_sq: bool = False
    lse: bool = False
    predicted: bool = False


@dataclass(frozen=True)
class CrossEntropyOptions(LogitTransform):
    """One call of the op, checked on construction. The logit transform's fields
    (:class:`..core.transform.LogitTransform`: ``ignore_index``, ``softcap``, ``logit_scale``, ``temperature``,
    ``label_smoothing``, ``z_loss``, ``vocab_size``) come first; the row passes read this object as that transform.

    reduction: one of :data:`..core.reduction.REDUCTIONS`: "mean" (over valid labels) or "sum" for a scalar loss
    (either one the sum / ``num_items_in_batch`` when the call passes that count, a 0-d tensor beside the options),
    "none" for per-token outputs. backend: as asked ("auto", "triton", "torch"); use_triton: what it resolved to
    for the call's tensors. shift: the labels are shifted (position t's target is label t + 1), by the public
    function or, with ``shift_rows`` > 0, inside the chunked op's label preparation (rows of that length,
    flattened; set by the function, never by the caller): the chunked op reads only ``shift_rows``. needs_grad:
    whether (hidden, weight, bias) get gradients; needs_low_rank_grad: whether the low-rank term's (hidden,
    weight) do. want: the :class:`ExtraOutputs` to compute (a plain tuple of six flags is taken in that
    order). chunk_size: rows per chunk, None for the default. skip_ignored / num_valid_tokens: process the valid
    rows only (see :func:`..core.checks.selected_rows`). precompute_grad: see :func:`fused_linear_log_probs`.
    fp32_weight_grad: accumulate a bf16 dW in fp32 (rounded once at the end). shard: the weight is this rank's
    shard of a vocabulary split across a process group (vocab_parallel.py; ``vocab_size`` is then the whole
    vocabulary's, and ``want`` all False); never through the custom operators.
    """

    reduction: str = "mean"
    backend: str = "auto"
    use_triton: bool = False
    shift: bool = False
    shift_rows: int = 0
    needs_grad: tuple[bool, bool, bool] = (False, False, False)
    needs_low_rank_grad: tuple[bool, bool] = (False, False)
    # Annotated as the tuple the operator schema passes (bool[]); always an ExtraOutputs once constructed.
    want: tuple[bool, bool, bool, bool, bool, bool] = ExtraOutputs()
    chunk_size: int | None = None
    skip_ignored: bool = False
    num_valid_tokens: int | None = None
    precompute_grad: bool = False
    fp32_weight_grad: bool = False
    shard: VocabShard | None = dataclasses.field(default=None, metadata={OPERATOR: False})

    def __post_init__(self) -> None:
        check_int("ignore_index", self.ignore_index)
        check_real("softcap", self.softcap, positive=True, allow_none=True)
        check_real("logit_scale", self.logit_scale)
        check_real("temperature", self.temperature, positive=True)
        check_real("label_smoothing", self.label_smoothing, minimum=0.0, maximum=1.0)
        check_real("z_loss", self.z_loss, minimum=0.0)
        check_int("vocab_size", self.vocab_size, minimum=1, allow_none=True)
        if self.reduction not in REDUCTIONS:
            fail(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.backend not in BACKENDS:
            fail(f"unknown backend {self.backend!r}; expected one of {BACKENDS}")
        check_int("chunk_size", self.chunk_size, minimum=1, allow_none=True)
        check_int("num_valid_tokens", self.num_valid_tokens, minimum=0, allow_none=True)
        check_int("shift_rows", self.shift_rows, minimum=0)
        for name in ("use_triton", "shift", "skip_ignored", "precompute_grad", "fp32_weight_grad"):
            check_flag(name, getattr(self, name))
        if type(self.want) is not ExtraOutputs:
            if len(self.want) != len(ExtraOutputs._fields):
                fail(f"want must name {len(ExtraOutputs._fields)} flags {ExtraOutputs._fields}, got {self.want!r}")
            object.__setattr__(self, "want", ExtraOutputs(*self.want))
        # Python numbers of the schema's types from any real or integral number (a numpy scalar, say)
        for name in ("softcap", "logit_scale", "temperature", "label_smoothing", "z_loss"):
            value = getattr(self, name)
            if value is not None and type(value) is not float:
                object.__setattr__(self, name, float(value))
        for name in ("ignore_index", "vocab_size", "chunk_size", "num_valid_tokens", "shift_rows"):
            value = getattr(self, name)
            if value is not None and type(value) is not int:
                object.__setattr__(self, name, int(value))

    @property
    def scalar(self) -> bool:
        """Whether the loss is one number (its gradients are then computed in the forward)."""
        return self.reduction != "none"

    @property
    def selects_rows(self) -> bool:
        """Whether only the rows with a valid label are processed."""
        return self.skip_ignored or self.num_valid_tokens is not None

    @property
    def any_grad(self) -> bool:
        return any(self.needs_grad) or any(self.needs_low_rank_grad)


SCHEMA = OptionsSchema(CrossEntropyOptions)
_FIELD_DEFAULTS = {field.name: field.default for field in dataclasses.fields(CrossEntropyOptions)}


# The options the public functions take as keywords, with their defaults, in the order their checks run. A
# ``return_*`` flag sets one field of ``want`` (:data:`_WANTS`); the others are CrossEntropyOptions' fields.
LOSS_KEYWORDS: dict[str, Any] = {
    "ignore_index": -100,
    "softcap": None,
    "logit_scale": 1.0,
    "shift": False,
    "reduction": "mean",
    "label_smoothing": 0.0,
    "z_loss": 0.0,
    "backend": "auto",
    "chunk_size": None,
    "skip_ignored": False,
    "num_valid_tokens": None,
    "return_lse": False,
    "return_token_accuracy": False,
    "return_predicted_tokens": False,
    "fp32_weight_grad": False,
}
"""``fused_linear_cross_entropy``'s option keywords and their defaults."""
LOG_PROBS_KEYWORDS: dict[str, Any] = {
    "ignore_index": -100,
    "softcap": None,
    "logit_scale": 1.0,
    "temperature": 1.0,
    "shift": False,
    "return_entropy": False,
    "return_is_top1": False,
    "return_mean_logits": False,
    "return_log_sum_sq_probs": False,
    "backend": "auto",
    "chunk_size": None,
    "skip_ignored": False,
    "num_valid_tokens": None,
    "precompute_grad": False,
}
"""``fused_linear_log_probs``'s option keywords and their defaults (its reduction is always "none")."""
_WANTS = {
    "return_lse": "lse",
    "return_token_accuracy": "is_top1",
    "return_predicted_tokens": "predicted",
    "return_entropy": "entropy",
    "return_is_top1": "is_top1",
    "return_mean_logits": "mean_logit",
    "return_log_sum_sq_probs": "log_sum_sq",
}


def build_options(keywords: dict[str, Any], log_probs: bool = False) -> CrossEntropyOptions:
    """The one builder of :class:`CrossEntropyOptions` from the public functions' keywords (each a key of
    :data:`LOSS_KEYWORDS`, or of :data:`LOG_PROBS_KEYWORDS` with ``log_probs``, which sets ``reduction="none"``):
    the ``return_*`` flags checked and gathered into ``want``, the rest passed on as fields (checked there)."""
    for name, value in keywords.items():
        if name in _WANTS:
            check_flag(name, value)
    want = ExtraOutputs(**{_WANTS[name]: value for name, value in keywords.items() if name in _WANTS})
    fields = {name: value for name, value in keywords.items() if name not in _WANTS}
    if log_probs:
        fields["reduction"] = "none"
    return CrossEntropyOptions(**fields, want=want)


def _at_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


# What a caller's options object may set: the fields the keywords set (``want`` apart); every other field holds
# the value the function gives it (the op's own fields, filled in per call, their defaults).
_LOSS_FIELDS = frozenset(LOSS_KEYWORDS) - set(_WANTS)
_LOG_PROBS_FIELDS = frozenset(LOG_PROBS_KEYWORDS) - set(_WANTS)
_LOSS_WANTS = frozenset(_WANTS[name] for name in LOSS_KEYWORDS if name in _WANTS)
_LOG_PROBS_WANTS = frozenset(_WANTS[name] for name in LOG_PROBS_KEYWORDS if name in _WANTS)


def given_options(options: Any, keywords: dict[str, Any], op_name: str, log_probs: bool = False) -> CrossEntropyOptions:
    """A caller's ``options=`` object, checked: a :class:`CrossEntropyOptions` (else a TypeError), given without
    any option keyword off its default (else a TypeError: one form or the other), and setting only what the
    function's keywords set (else a ValueError naming the fields; ``fused_linear_log_probs`` needs
    ``reduction="none"``). Returned as is: its own checks ran when it was built."""
    if not isinstance(options, CrossEntropyOptions):
        raise TypeError(f"{op_name}: options must be a CrossEntropyOptions, got {type(options).__name__}")
    defaults = LOG_PROBS_KEYWORDS if log_probs else LOSS_KEYWORDS
    given = [name for name, value in keywords.items() if not _at_default(value, defaults[name])]
    if given:
        raise TypeError(
            f"{op_name}: options= was given together with the option keyword(s) {given}; pass the options either "
            "as one CrossEntropyOptions or as keywords, not both"
        )
    settable = _LOG_PROBS_FIELDS if log_probs else _LOSS_FIELDS
    wants = _LOG_PROBS_WANTS if log_probs else _LOSS_WANTS
    fixed = {"reduction": "none"} if log_probs else {}
    wrong = [
        name
        for name in SCHEMA.all_names
        if name not in settable and name != "want" and getattr(options, name) != fixed.get(name, _FIELD_DEFAULTS[name])
    ]
    wrong += [f"want.{name}" for name, flag in zip(ExtraOutputs._fields, options.want) if flag and name not in wants]
    if wrong:
        raise ValueError(
            f"{op_name}: options sets {wrong}, which this function does not take"
            + (' (its reduction is "none")' if log_probs else "")
        )
    return options
