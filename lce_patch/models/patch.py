"""apply_fused_lce / revert_fused_lce: instance patches (a loaded model) and class patches (a model_type)."""

from __future__ import annotations

import math
import types
from typing import Any

import torch

from .forward import (
    OPTIONS_ATTR,
    PREVIOUS_FORWARD_ATTR,
    SPEC_ATTR,
    LCEOptions,
    make_forward,
    unpatched,
)
from .head import resolve_head_module, unwrap_causal_lm
from .registry import REGISTRY, ArchSpec, HeadConfig, inferred_spec, supported_architectures

_MISSING = object()


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"lce_patch: {what} is not a supported architecture. Supported model types: "
        f"{', '.join(supported_architectures())}. A model whose decoder returns last_hidden_state and whose "
        "output embedding is a Linear layer can be patched with apply_fused_lce(model, allow_unregistered=True), "
        "which first checks the fused loss against the model's own on a tiny batch."
    )


def _registered_spec(model: torch.nn.Module) -> ArchSpec | None:
    """The registry entry for this instance, if its class is the registered class with its own forward."""
    spec = REGISTRY.get(getattr(model.config, "model_type", None))
    if spec is None:
        return None
    try:
        cls = spec.load_class()
    except (ImportError, AttributeError):
        return None
    if not isinstance(model, cls) or unpatched(type(model).forward) is not unpatched(cls.forward):
        return None  # another head class for this model_type, or a subclass that overrides forward
    return spec


def _spec_for(model: torch.nn.Module) -> ArchSpec:
    spec = getattr(model, SPEC_ATTR, None) or _registered_spec(model)
    return spec if spec is not None else inferred_spec(model)


def get_head_config(model: torch.nn.Module) -> HeadConfig:
    """Softcap and logit scale of the model's LM head, from its registry entry (PEFT wrappers are unwrapped).

    Unregistered models get the same best guess from their config that TRL's fused head makes.
    """
    model = unwrap_causal_lm(model)
    return _spec_for(model).head_config(model.config)


def is_patched(model_or_model_type: Any) -> bool:
    """Whether apply_fused_lce is in effect on this model (instance or class patch) or model_type's class."""
    if isinstance(model_or_model_type, str):
        spec = REGISTRY.get(model_or_model_type)
        return spec is not None and OPTIONS_ATTR in vars(spec.load_class())
    return getattr(unwrap_causal_lm(model_or_model_type), OPTIONS_ATTR, None) is not None


def apply_fused_lce(model_or_model_type: Any, **options: Any) -> Any:
    """Make training compute the causal-LM loss with the fused linear cross-entropy (no logits tensor).

    ``model_or_model_type`` is a loaded model (a Hugging Face CausalLM or a PEFT model around one, patched
    in place and returned) or a ``config.model_type`` string (that architecture's class is patched, for
    models loaded afterwards; the class is returned). Options: ``ignore_index``, ``label_smoothing``,
    ``z_loss``, ``backend``, ``chunk_size``, ``deterministic``, ``return_logits_in_eval`` (evaluation with
    labels also returns the logits), ``allow_unregistered`` (patch an unregistered model after checking
    its fused loss against its own). Patching again replaces the options.
    """
    opts = LCEOptions.from_kwargs(options)
    if isinstance(model_or_model_type, str):
        return _patch_class(model_or_model_type, opts)
    model = unwrap_causal_lm(model_or_model_type)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"lce_patch: apply_fused_lce expects a Hugging Face model or a model_type string, got "
            f"{type(model_or_model_type).__name__}"
        )
    spec = getattr(model, SPEC_ATTR, None) if OPTIONS_ATTR in vars(model) else None
    if spec is None:
        spec = _registered_spec(model)
    if spec is None:
        if not opts.allow_unregistered:
            raise _unsupported(f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r})")
        try:
            spec = inferred_spec(model)
        except ValueError as err:
            raise _unsupported(f"{type(model).__name__}: {err}") from err
    resolve_head_module(getattr(model, spec.head))  # refuses a LoRA layer on the head now, not mid-training

    newly_patched = OPTIONS_ATTR not in vars(model)
    if newly_patched:
        previous = vars(model).get("forward", _MISSING)
        original = unpatched(type(model).forward)
        model.forward = types.MethodType(make_forward(original, spec), model)
        if previous is not _MISSING:
            setattr(model, PREVIOUS_FORWARD_ATTR, previous)
        setattr(model, SPEC_ATTR, spec)
    setattr(model, OPTIONS_ATTR, opts)
    if newly_patched and not spec.registered:
        try:
            _self_check(model)
        except Exception as err:
            revert_fused_lce(model)
            if isinstance(err, ValueError) and str(err).startswith("lce_patch"):
                raise
            raise _unsupported(
                f"{type(model).__name__} (the generic forward failed on a test batch: {type(err).__name__}: {err});"
            ) from err
    return model_or_model_type


def revert_fused_lce(model_or_model_type: Any) -> Any:
    """Undo apply_fused_lce exactly (instance or class); a no-op on what is not patched."""
    if isinstance(model_or_model_type, str):
        spec = REGISTRY.get(model_or_model_type)
        if spec is None:
            raise _unsupported(repr(model_or_model_type))
        cls = spec.load_class()
        if OPTIONS_ATTR in vars(cls):
            cls.forward = unpatched(vars(cls)["forward"])
            delattr(cls, OPTIONS_ATTR)
        return cls
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
    return model_or_model_type


def _patch_class(model_type: str, opts: LCEOptions) -> type:
    spec = REGISTRY.get(model_type)
    if spec is None:
        raise _unsupported(repr(model_type))
    if opts.allow_unregistered:
        raise ValueError("lce_patch: allow_unregistered applies to model instances, not to model_type strings")
    cls = spec.load_class()
    if OPTIONS_ATTR not in vars(cls):
        cls.forward = make_forward(unpatched(vars(cls)["forward"]), spec)
    setattr(cls, OPTIONS_ATTR, opts)
    return cls


def _self_check(model: torch.nn.Module) -> None:
    """The fused loss must equal the model's own loss on a tiny batch (unregistered models)."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab_size = getattr(text_config, "vocab_size", None) or model.get_output_embeddings().weight.shape[0]
    param = next(model.parameters())
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (2, 8), generator=generator).to(param.device)
    labels = input_ids.clone()
    labels[0, :3] = -100
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            own_forward = vars(model).get(PREVIOUS_FORWARD_ATTR) or types.MethodType(
                unpatched(type(model).forward), model
            )
            reference = own_forward(input_ids=input_ids, labels=labels, use_cache=False)
            fused = model.forward(input_ids=input_ids, labels=labels, use_cache=False, skip_logits=True)
    finally:
        model.train(was_training)
    if fused.logits is not None:
        raise _unsupported(f"{type(model).__name__}: the generic forward did not take the fused path on a test batch;")
    ref_loss, fused_loss = float(reference.loss), float(fused.loss)
    tolerance = 1e-4 if param.dtype in (torch.float32, torch.float64) else 3e-2
    if not (math.isfinite(fused_loss) and math.isclose(fused_loss, ref_loss, rel_tol=tolerance, abs_tol=tolerance)):
        raise _unsupported(
            f"{type(model).__name__} (model_type={getattr(config, 'model_type', None)!r}): its own loss is "
            f"{ref_loss:.6g} but the fused loss is {fused_loss:.6g} on a test batch, so its head does something "
            "the generic forward does not (e.g. a custom logit transform);"
        )
