"""A patched model's loss options beyond Hugging Face's loss: per-call ``token_weights``, the model's
``class_weights``, and the ``lse`` / ``token_accuracy`` outputs (``return_lse``, ``return_token_accuracy``).

The fused path hands them to the op (``forward.LossJob``). A call that runs unfused (a hook on the LM head, a
subclass's forward, ``logits_to_keep``) computes the same loss from the logits the model hands its
``loss_function`` (:class:`LogitsLoss`), so that no loss a patched model returns drops the weights. The extra
outputs are attached to the model's output object as fields of a subclass of its class
(:func:`with_loss_outputs`): a new key on the model's own class would break the pytree round trip that DDP,
FSDP and ``torch.compile`` put outputs through (transformers rebuilds an output from its keys).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import typing
from typing import Any

import torch

from ..ops.core import stats_dtype
from ..ops.linear_cross_entropy import shift_labels
from .options import LCEOptions

EXTRA_OUTPUTS = ("lse", "token_accuracy", "predicted_tokens")
_LOCK = threading.Lock()


def check_token_weights(token_weights: Any, targets: torch.Tensor, targets_name: str) -> None:
    """Refuse token weights that are not a floating-point tensor of ``targets``' shape (before the model runs).
    Their values (finite, >= 0) are checked by the op, without a host sync on CUDA."""
    if not isinstance(token_weights, torch.Tensor):
        raise ValueError(f"lce_patch: token_weights must be a torch.Tensor, got {type(token_weights).__name__}")
    if tuple(token_weights.shape) != tuple(targets.shape):
        raise ValueError(
            f"lce_patch: token_weights must have the shape of {targets_name} {tuple(targets.shape)} (one weight per "
            f"label), got {tuple(token_weights.shape)}"
        )
    if not token_weights.dtype.is_floating_point:
        raise ValueError(f"lce_patch: token_weights must be a floating-point tensor, got {token_weights.dtype}")


def op_token_weights(token_weights: torch.Tensor, shift: bool, device: torch.device) -> torch.Tensor:
    """The token weights as the op reads them: on ``device`` and, when the labels are shifted, shifted with them
    (the op's weight t is position t's, whose target is label t + 1: it gets the user's weight t + 1; the last
    position, which has no target, gets 0)."""
    token_weights = token_weights.detach().to(device)
    if not shift:
        return token_weights
    shifted = torch.zeros_like(token_weights)
    shifted[..., :-1] = token_weights[..., 1:]
    return shifted


def op_class_weights(options: LCEOptions, hidden: torch.Tensor) -> torch.Tensor | None:
    """The model's class weights on ``hidden``'s device in the dtype the op accumulates in (cached: no copy per
    step)."""
    if options.class_weights is None:
        return None
    return options.class_weights.on(hidden.device, stats_dtype(hidden.dtype))


class LogitsLoss:
    """Stands in for the model's ``loss_function`` during a call that runs unfused while loss options the model's
    own loss lacks are in effect: the fused loss's definition (class and token weights, ``label_smoothing``,
    ``z_loss``, ``num_items_in_batch``, the label shift), computed from the logits, and the extra outputs.

    Without weights the loss is the model's own (``function``, a custom ``loss_function`` included) and only the
    extra outputs are computed here.
    """

    def __init__(self, options: LCEOptions, ignore_index: int, token_weights: torch.Tensor | None) -> None:
        self.options = options
        self.ignore_index = ignore_index
        self.token_weights = token_weights
        self.weighted = options.class_weights is not None or token_weights is not None
        self.called = False
        self.extras: dict[str, torch.Tensor] = {}

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        from transformers.loss.loss_utils import ForCausalLMLoss

        bound = inspect.signature(ForCausalLMLoss).bind(*args, **kwargs).arguments
        extra = bound.get("kwargs", {})
        logits, labels = bound["logits"], bound.get("labels")
        targets = bound.get("shift_labels", extra.get("shift_labels"))
        shift = targets is None
        targets = labels if shift else targets
        ignore_index = bound.get("ignore_index", extra.get("ignore_index", self.ignore_index))
        num_items = bound.get("num_items_in_batch", extra.get("num_items_in_batch"))
        self.called = True
        loss = None if self.weighted else function(*args, **kwargs)
        weighted, self.extras = loss_from_logits(
            logits,
            targets,
            shift,
            options=self.options,
            ignore_index=ignore_index,
            num_items_in_batch=num_items,
            token_weights=self.token_weights,
            loss=self.weighted,
        )
        return weighted if loss is None else loss


def loss_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    shift: bool,
    *,
    options: LCEOptions,
    ignore_index: int,
    num_items_in_batch: int | torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    loss: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(loss, extra outputs) from the final logits [..., V], as the fused op gives them.

    ``targets``: labels of ``logits``' shape without V (shifted here when ``shift``); ``token_weights``: the
    targets' shape, each label's weight (shifted with it). loss: fp32 0-d, the options' weighted loss (``None``
    unless ``loss``), NaN where Hugging Face's is (no valid label, ``num_items_in_batch`` 0). The extra outputs
    the options ask for (no gradient), by name: ``lse`` per token, targets' shape, 0 where ignored;
    ``token_accuracy`` 0-d; ``predicted_tokens`` int64, targets' shape, ``ignore_index`` where ignored.
    """
    if shift:
        targets = shift_labels(targets, ignore_index)
        if token_weights is not None:
            token_weights = op_token_weights(token_weights, True, logits.device)
    logits = logits.to(stats_dtype(logits.dtype))
    flat = logits.reshape(-1, logits.shape[-1])
    labels = targets.reshape(-1).to(flat.device)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0)
    lse = torch.logsumexp(flat, -1)
    value = None
    extras: dict[str, torch.Tensor] = {}
    if loss:
        log_probs = flat - lse.unsqueeze(-1)
        nll = -log_probs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        class_weights = label_weight = None
        if options.class_weights is not None:
            class_weights = options.class_weights.on(flat.device, flat.dtype)
            label_weight = class_weights[safe]
        # as F.cross_entropy(weight=, label_smoothing=): the target's term weighted by its class, the smoothing
        # term by each class's weight; the z-loss term by the target's class
        per_token = nll if label_weight is None else nll * label_weight
        if options.label_smoothing:
            smoothing = options.label_smoothing
            spread = log_probs.mean(-1) if class_weights is None else (log_probs * class_weights).mean(-1)
            per_token = (1 - smoothing) * per_token - smoothing * spread
        if options.z_loss:
            z_term = options.z_loss * lse * lse
            per_token = per_token + (z_term if label_weight is None else z_term * label_weight)
        if token_weights is not None:
            per_token = per_token * token_weights.detach().reshape(-1).to(flat)
        total = torch.where(valid, per_token, 0.0).sum()
        count = valid.sum()
        if num_items_in_batch is not None:
            denominator = torch.as_tensor(num_items_in_batch, device=flat.device).reshape(()).to(flat.dtype)
            undefined = denominator == 0
        else:
            denominator = count.to(flat.dtype) if label_weight is None else torch.where(valid, label_weight, 0).sum()
            undefined = count == 0
        value = total / torch.where(denominator == 0, 1.0, denominator)
        value = torch.where(undefined, torch.nan, value).float()
    with torch.no_grad():
        if options.return_lse:
            extras["lse"] = torch.where(valid, lse, 0.0).float().view(targets.shape)
        if options.return_token_accuracy or options.return_predicted_tokens:
            predicted = flat.argmax(-1)
        if options.return_token_accuracy:
            hits = (predicted == labels) & valid
            extras["token_accuracy"] = (hits.sum() / valid.sum().clamp(min=1)).float()
        if options.return_predicted_tokens:
            extras["predicted_tokens"] = torch.where(valid, predicted, ignore_index).view(targets.shape)
    return value, extras


# --- The extra outputs on the model's output ------------------------------------------------------------------


def with_loss_outputs(outputs: Any, extras: dict[str, torch.Tensor | None]) -> Any:
    """``outputs`` with the extra outputs ``extras`` (names of ``EXTRA_OUTPUTS``; those not None) added.

    A ``ModelOutput`` becomes an instance of a subclass of its class with the fields of ``EXTRA_OUTPUTS``
    (attributes and keys, ``isinstance`` of its class still true, picklable); a tuple (``return_dict=False``) gets
    them appended, in ``EXTRA_OUTPUTS``' order, as the subclass's ``to_tuple()`` would; a plain dict gets the keys.
    """
    from transformers.utils import ModelOutput

    values = {name: extras.get(name) for name in EXTRA_OUTPUTS}
    if isinstance(outputs, tuple):
        return outputs + tuple(value for value in values.values() if value is not None)
    if isinstance(outputs, ModelOutput) and dataclasses.is_dataclass(outputs):
        cls = _with_extra_fields(getattr(type(outputs), "__lce_patch_base__", type(outputs)))
        fields = {k: v for k, v in outputs.items() if k not in EXTRA_OUTPUTS}
        return cls(**fields, **values)
    if isinstance(outputs, dict):
        outputs.update({name: value for name, value in values.items() if value is not None})
        return outputs
    raise TypeError(
        f"lce_patch: return_lse / return_token_accuracy / return_predicted_tokens attach to the model's output, "
        f"which is a {type(outputs).__name__} here (expected a ModelOutput, a dict or a tuple)"
    )


def _reduce_with_extras(output: Any) -> tuple:
    base = type(output).__lce_patch_base__
    return (_rebuild_with_extras, (base, dict(output.items())))


def _rebuild_with_extras(base: type, items: dict[str, Any]) -> Any:
    extras = {name: items.pop(name, None) for name in EXTRA_OUTPUTS}
    return with_loss_outputs(base(**items), extras)


_EXTENDED: dict[type, type] = {}  # ModelOutput class -> its subclass with the extra fields


def _with_extra_fields(base: type) -> type:
    extended = _EXTENDED.get(base)
    return extended if extended is not None else _make_extended(base)


@torch.compiler.disable  # a class made while tracing is a graph break anyway; made once, then a dict hit
def _make_extended(base: type) -> type:
    """A dataclass subclass of the ModelOutput class ``base`` with the fields of ``EXTRA_OUTPUTS``
    (registered as a pytree node by transformers, as every ModelOutput class; pickled as ``base`` plus the
    values, since the class is made at run time)."""
    with _LOCK:
        if base in _EXTENDED:
            return _EXTENDED[base]
        name = f"{base.__name__}WithLossOutputs"
        taken = {cls.__name__ for cls in _EXTENDED.values()}
        while name in taken:  # two bases of one name (remote code): each its own pytree type name
            name += "_"
        fields = [(field, torch.Tensor | None, dataclasses.field(default=None)) for field in EXTRA_OUTPUTS]
        namespace = {"__module__": __name__, "__lce_patch_base__": base, "__reduce__": _reduce_with_extras}
        _EXTENDED[base] = dataclasses.make_dataclass(name, fields, bases=(base,), namespace=namespace)
        return _EXTENDED[base]


def prepare_output_classes(forward: Any) -> None:
    """Make the extended classes of the ModelOutput classes ``forward``'s return annotation names, so that a
    compiled forward finds them made (best effort: an annotation that does not resolve is skipped)."""
    from transformers.utils import ModelOutput

    try:
        annotation = typing.get_type_hints(forward).get("return")
    except Exception:
        return
    for cls in typing.get_args(annotation) or (annotation,):
        if isinstance(cls, type) and issubclass(cls, ModelOutput) and dataclasses.is_dataclass(cls):
            _with_extra_fields(cls)
