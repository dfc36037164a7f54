"""apply_fused_lce / revert_fused_lce: instance patches (a loaded model) and class patches (a model_type).

Which classes a model belongs to is in ``lookups.py``, the refusals in ``refusals.py``, and the self-check that
lets ``allow_unregistered`` patch an unregistered model in ``self_check.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch

from ..ops.core import stats_dtype
from .adapters import resolve_head_module, unwrap_causal_lm
from .forward import (
    PREVIOUS_FORWARD_ATTR,
    SPEC_ATTR,
    BoundForward,
    LossFunctionStandIn,
    ensure_slot,
    make_forward,
    unpatched,
)
from .head import SLOT_ATTR, remove_interceptor
from .lookups import inline_loss_of, is_registered, mapped_classes, output_embeddings
from .loss_options import prepare_output_classes
from .options import OPTION_DEFAULTS, OPTIONS_ATTR, LCEOptions, option_names
from .refusals import inline_loss_of_type, refusal
from .registry import REGISTRY, ArchSpec, HeadConfig, derived_spec
from .self_check import check_against_own_forward

_MISSING = object()

logger = logging.getLogger(__name__)

# Off while an integration that reports the patch itself (FusedLCECallback, the axolotl plugin) patches a model.
_ANNOUNCE: contextvars.ContextVar[bool] = contextvars.ContextVar("lce_patch_announce", default=True)


def _spec_for(model: torch.nn.Module) -> ArchSpec:
    spec = getattr(model, SPEC_ATTR, None)
    if spec is None:
        model_type = getattr(model.config, "model_type", type(model).__name__)
        spec = derived_spec(unpatched(type(model).forward), model_type, registered=is_registered(model))
    return spec


def _head_config_of(model: torch.nn.Module) -> HeadConfig:
    return getattr(model, SPEC_ATTR).head_config(model)


def get_head_config(model: torch.nn.Module) -> HeadConfig:
    """Softcap and logit scale of the model's LM head (PEFT wrappers are unwrapped)."""
    model = unwrap_causal_lm(model)
    return _spec_for(model).head_config(model)


def is_patched(model_or_model_type: Any) -> bool:
    """Whether apply_fused_lce is in effect on this model (instance or class patch) or model_type's classes."""
    if isinstance(model_or_model_type, str):
        classes = mapped_classes(model_or_model_type)
        return bool(classes) and all(OPTIONS_ATTR in vars(cls) for cls in classes)
    return getattr(unwrap_causal_lm(model_or_model_type), OPTIONS_ATTR, None) is not None


@contextlib.contextmanager
def unannounced() -> Iterator[None]:
    """Within the block, :func:`apply_fused_lce` does not log its line: for integrations that log their own."""
    token = _ANNOUNCE.set(False)
    try:
        yield
    finally:
        _ANNOUNCE.reset(token)


def options_text(opts: LCEOptions) -> str:
    """The options in force as ``name=value`` pairs: ``chunk_size`` and ``backend`` always, the others where they
    differ from their defaults."""
    shown = {"chunk_size": "auto" if opts.chunk_size is None else opts.chunk_size, "backend": opts.backend}
    for name, default in OPTION_DEFAULTS.items():
        value = getattr(opts, name)
        if name not in shown and value != default:
            shown[name] = value
    return ", ".join(f"{name}={value}" for name, value in shown.items())


def patch_summary(model: torch.nn.Module) -> str:
    """What a patched model is, in words: its class (and the PEFT wrapper around it), the architecture entry its
    head's logit transform comes from, and that transform (softcap, logit scale)."""
    inner = unwrap_causal_lm(model)
    spec = _spec_for(inner)
    what = type(inner).__name__ + (f" in {type(model).__name__}" if inner is not model else "")
    entry = f"architecture {spec.model_type!r}" if spec.registered else "unregistered, checked against its own loss"
    head = spec.head_config(inner)
    transform = "no softcap" if head.softcap is None else f"softcap {head.softcap:g}"
    if head.logit_scale != 1.0:
        transform += f", logit scale {head.logit_scale:g}"
    return f"{what} ({entry}, {transform})"


def _announce_level() -> int:
    """WARNING, the level a script and a Trainer show by default; INFO on the processes of a process group but
    the first, so that a launched job prints the line once."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return logging.INFO
    return logging.WARNING


def apply_fused_lce(model_or_model_type: Any, **options: Any) -> Any:
    """Make training compute the causal-LM loss with the fused linear cross-entropy (no logits tensor).

    ``model_or_model_type`` is a loaded model (a Hugging Face CausalLM or a PEFT model around one, patched
    in place and returned) or a ``config.model_type`` string (that architecture's classes are patched, for
    models loaded afterwards; the tuple of patched classes is returned). Options (each in :data:`.options.OPTIONS`):
    ``ignore_index``, ``label_smoothing``, ``z_loss``, ``backend``, ``chunk_size``, ``skip_ignored``,
    ``fp32_weight_grad``, ``return_logits_in_eval``
    (evaluation with labels runs the model's own forward and returns the logits), ``allow_unregistered``
    (patch a model of an unregistered type after checking its fused loss and gradients against its own),
    ``class_weights`` (a [V] float tensor, finite and >= 0, V the LM head's out_features: each label's loss weight,
    as ``torch.nn.CrossEntropyLoss(weight=)``), ``return_lse``, ``return_token_accuracy`` and
    ``return_predicted_tokens`` (calls that compute a loss also return ``lse``, per token, ``token_accuracy``, 0-d,
    and ``predicted_tokens``, each position's argmax, on their output). A call may pass
    ``token_weights`` (the labels' shape, each label's loss weight). Patching again replaces the options.

    A patch that changes something (a model or class patched, or given other options) logs one line at WARNING,
    the level a script shows by default, on the ``lce_patch`` logger, naming the model, its architecture entry,
    its head's softcap and the options: ``logging.getLogger("lce_patch").setLevel(logging.ERROR)`` silences it.
    ``FusedLCECallback`` logs its own line instead, when training starts.
    """
    opts = LCEOptions.from_kwargs(options)
    if isinstance(model_or_model_type, str):
        classes = [cls for cls in mapped_classes(model_or_model_type) if vars(cls).get(OPTIONS_ATTR) != opts]
        patched = _patch_classes(model_or_model_type, opts)
        if classes and _ANNOUNCE.get():
            logger.log(
                _announce_level(),
                "lce_patch: patched the %s classes (%s): their models train with the fused linear cross-entropy; %s",
                repr(model_or_model_type),
                ", ".join(cls.__name__ for cls in patched),
                options_text(opts),
            )
        return patched
    model = unwrap_causal_lm(model_or_model_type)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"lce_patch: apply_fused_lce expects a Hugging Face model or a model_type string, got "
            f"{type(model_or_model_type).__name__}"
        )
    if opts.class_weights is not None:
        _check_class_weights(model, opts)
    if opts.returns_extras:
        prepare_output_classes(unpatched(type(model).forward))
    newly_patched = OPTIONS_ATTR not in vars(model)
    changed = vars(model).get(OPTIONS_ATTR) != opts
    if newly_patched:
        head = output_embeddings(model)
        if head is None:
            raise refusal(model)
        weight = getattr(resolve_head_module(head), "weight", None)  # refuses an adapter the op cannot compute
        if isinstance(weight, torch.Tensor) and not weight.is_floating_point():
            raise ValueError(
                f"lce_patch: {type(model).__name__}'s LM head is quantized ({type(head).__module__}."
                f"{type(head).__name__}, weight {weight.dtype}); the fused loss needs a floating-point head weight. "
                "Keep the head unquantized: with bitsandbytes, add 'lm_head' to llm_int8_skip_modules (a list "
                "given there replaces transformers' default, which excludes the head)."
            )
        if inline_loss_of(type(model)) is not None:  # its loss is not the loss_function's: nothing can stand in
            raise refusal(model)
        registered = is_registered(model)
        model_type = getattr(model.config, "model_type", None)
        if not registered and not opts.allow_unregistered:
            raise refusal(model)
        spec = derived_spec(unpatched(type(model).forward), model_type, registered=registered)
        previous = vars(model).get("forward", _MISSING)
        original = unpatched(type(model).forward)
        model.forward = BoundForward(model, make_forward(original, _head_config_of), _head_config_of)
        if previous is not _MISSING:
            setattr(model, PREVIOUS_FORWARD_ATTR, previous)
        setattr(model, SPEC_ATTR, spec)
        ensure_slot(model)
    if newly_patched and not getattr(model, SPEC_ATTR).registered:
        # The check compares with the model's own loss, which has none of the options that change the loss.
        loss_changes = option_names(changes_loss=True) + option_names(adds_output=True)
        neutral = dataclasses.replace(opts, **{name: OPTION_DEFAULTS[name] for name in loss_changes})
        setattr(model, OPTIONS_ATTR, neutral)
        try:
            check_against_own_forward(model)
        except Exception as err:
            revert_fused_lce(model)
            if isinstance(err, ValueError) and str(err).startswith("lce_patch"):
                raise
            raise refusal(
                model, f"the self-check failed on a test batch: {type(err).__name__}: {err}", self_checked=True
            ) from err
    setattr(model, OPTIONS_ATTR, opts)
    if changed and _ANNOUNCE.get():
        logger.log(
            _announce_level(),
            "lce_patch: patched %s: training calls with labels compute the fused linear cross-entropy; %s",
            patch_summary(model_or_model_type),
            options_text(opts),
        )
    return model_or_model_type


def _check_class_weights(model: torch.nn.Module, opts: LCEOptions) -> None:
    """Class weights must have one entry per row of the LM head's weight; their copy for the head's device and
    dtype is made now, not in the first step."""
    head = output_embeddings(model)
    if head is None:
        raise refusal(model)
    module = resolve_head_module(head)
    weight = getattr(module, "weight", None)
    # out_features (or DeepSpeed's ds_shape) first: a ZeRO-3 partitioned weight's own shape is [0]
    vocab = getattr(module, "out_features", None) or getattr(weight, "ds_shape", getattr(weight, "shape", (None,)))[0]
    if vocab is not None and len(opts.class_weights) != vocab:
        raise ValueError(
            f"lce_patch: class_weights must have one weight per vocabulary entry of {type(model).__name__}'s LM head "
            f"(out_features {vocab}), got {len(opts.class_weights)}"
        )
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.device.type != "meta":
        opts.class_weights.on(weight.device, stats_dtype(weight.dtype))


def revert_fused_lce(model_or_model_type: Any) -> Any:
    """Undo apply_fused_lce exactly (instance or class); a no-op on what is not patched."""
    if isinstance(model_or_model_type, str):
        if model_or_model_type not in REGISTRY:
            raise refusal(model_or_model_type)
        for cls in mapped_classes(model_or_model_type):
            if OPTIONS_ATTR in vars(cls):
                cls.forward = unpatched(vars(cls)["forward"])
                delattr(cls, OPTIONS_ATTR)
                delattr(cls, SPEC_ATTR)
        return tuple(mapped_classes(model_or_model_type))
    model = unwrap_causal_lm(model_or_model_type)
    state = vars(model)
    if OPTIONS_ATTR in state:
        previous = state.pop(PREVIOUS_FORWARD_ATTR, _MISSING)
        if previous is _MISSING:
            del model.forward
        else:
            model.forward = previous
        del state[OPTIONS_ATTR]
        state.pop(SPEC_ATTR, None)
    if SLOT_ATTR in state:  # also after a class patch, whose first fused call installed the slot
        remove_interceptor(model.get_output_embeddings())
        stand_in = state.get("_loss_function")
        if isinstance(stand_in, LossFunctionStandIn):  # else the user replaced it since: theirs stays
            if stand_in.previous is None:
                del state["_loss_function"]
            else:
                state["_loss_function"] = stand_in.previous
        del state[SLOT_ATTR]
    return model_or_model_type


def _patch_classes(model_type: str, opts: LCEOptions) -> tuple[type, ...]:
    if model_type not in REGISTRY or inline_loss_of_type(model_type) is not None:
        raise refusal(model_type)
    if opts.allow_unregistered:
        raise ValueError("lce_patch: allow_unregistered applies to model instances, not to model_type strings")
    for cls in mapped_classes(model_type):
        if opts.returns_extras:
            prepare_output_classes(unpatched(vars(cls)["forward"]))
        if OPTIONS_ATTR not in vars(cls):
            cls.forward = make_forward(unpatched(vars(cls)["forward"]), _head_config_of)
            # The head's transform fields come from the class's forward; their values from each instance.
            setattr(cls, SPEC_ATTR, derived_spec(unpatched(vars(cls)["forward"]), model_type, registered=True))
        setattr(cls, OPTIONS_ATTR, opts)
    return tuple(mapped_classes(model_type))
