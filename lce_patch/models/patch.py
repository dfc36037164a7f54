"""apply_fused_lce / revert_fused_lce: instance patches (a loaded model) and class patches (a model_type)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import logging
import math
import re
import types
from collections.abc import Iterator
from typing import Any

import torch

from ..ops.core.backend import stats_dtype
from .adapters import head_leaves, lora_linear_class, peft_classes, resolve_head_module, unwrap_causal_lm
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
from .loss_options import prepare_output_classes
from .options import OPTIONS_ATTR, LCEOptions
from .registry import REGISTRY, UNSUPPORTED, ArchSpec, HeadConfig, derived_spec

_MISSING = object()

logger = logging.getLogger(__name__)

# Off while an integration that reports the patch itself (FusedLCECallback, the axolotl plugin) patches a model.
_ANNOUNCE: contextvars.ContextVar[bool] = contextvars.ContextVar("lce_patch_announce", default=True)


@functools.cache
def _mapping_names() -> dict[str, tuple[str, ...]]:
    """model_type -> the causal-LM and image-text-to-text class names of transformers' auto mappings."""
    from transformers.models.auto import modeling_auto

    names: dict[str, tuple[str, ...]] = {}
    for mapping in (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    ):
        for model_type, class_names in mapping.items():
            class_names = (class_names,) if isinstance(class_names, str) else tuple(class_names)
            names[model_type] = tuple(dict.fromkeys(names.get(model_type, ()) + class_names))
    return names


def _mapped_classes(model_type: str) -> list[type]:
    """The classes transformers' auto mappings name for ``model_type``."""
    import transformers

    classes = [getattr(transformers, name, None) for name in _mapping_names().get(model_type, ())]
    return [cls for cls in dict.fromkeys(classes) if cls is not None]


def _registered_classes(model: torch.nn.Module) -> list[type]:
    """The classes of registered types that ``model`` is an instance of.

    The registry is keyed by the auto mappings' model_type, which may differ from the config's
    (Emu3ForCausalLM is mapped under ``emu3`` but its config says ``emu3_text_model``).
    """
    class_names = {cls.__name__ for cls in type(model).__mro__}
    return [
        cls
        for model_type, names in _mapping_names().items()
        if model_type in REGISTRY and class_names.intersection(names)
        for cls in _mapped_classes(model_type)
        if isinstance(model, cls)
    ]


def _is_registered(model: torch.nn.Module) -> bool:
    """Whether this instance is of a class a registered type maps to, with that class's own forward."""
    if not _plain_linear_head(model):
        return False  # a custom head module: its forward may transform the logits
    forward = unpatched(type(model).forward)
    return any(forward is unpatched(cls.forward) for cls in _registered_classes(model))


def _plain_linear_head(model: torch.nn.Module) -> bool:
    """Whether every module computing the head runs ``torch.nn.Linear.forward`` (or is PEFT's trainable tokens,
    or PEFT's LoRA layer over a Linear)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        return False
    _, trainable_tokens, _ = peft_classes()
    if trainable_tokens and isinstance(head, trainable_tokens):
        return True
    lora_linear = lora_linear_class()

    def plain(leaf: torch.nn.Module) -> bool:
        if lora_linear is not None and isinstance(leaf, lora_linear):
            leaf = leaf.get_base_layer()
        return type(leaf).forward is torch.nn.Linear.forward

    return all(plain(leaf) for leaf in head_leaves(head))


# --- Refusals: each says what to do instead ------------------------------------------------------------

_EXAMPLES = ("llama", "gemma2", "gemma3", "mistral", "qwen3")
_ALLOW_UNREGISTERED_HINT = (
    "To patch it anyway, apply_fused_lce(model, allow_unregistered=True) checks the fused loss and every gradient "
    "against the model's own forward on a test batch and patches the model if they agree (as they do when its LM "
    "head is a Linear layer applied once to the last hidden state and its loss is computed by self.loss_function)."
)


def _supported() -> str:
    examples = ", ".join(t for t in _EXAMPLES if t in REGISTRY)
    return f"Supported: the {len(REGISTRY)} model types of lce_patch.supported_architectures(), e.g. {examples}."


def _normalized(model_type: str) -> str:
    """A model_type without case and separators: 'Qwen-3', 'qwen_3' and 'qwen3' are one key."""
    return re.sub(r"[-_. ]", "", model_type.lower())


def _closest_types(model_type: str) -> list[str]:
    """The registered types ``model_type`` may mean: the one equal up to case and separators, else the closest."""
    by_key = {_normalized(t): t for t in sorted(REGISTRY)}
    key = _normalized(model_type)
    if key in by_key:
        return [by_key[key]]
    return [by_key[k] for k in difflib.get_close_matches(key, by_key, n=3)]


def _type_string_hint(model_type: str) -> str:
    """Why a model_type string is refused, and the registered types it may mean.

    allow_unregistered is never suggested: a class patch has no instance to check.
    """
    if model_type in UNSUPPORTED:
        return f": {UNSUPPORTED[model_type]}. {_supported()}"
    if model_type in _mapping_names():
        return f": lce_patch has not verified this model type of the installed transformers. {_supported()}"
    refused = {_normalized(t): t for t in UNSUPPORTED}.get(_normalized(model_type))
    if refused is not None:
        return f". Did you mean {refused!r}? That type is refused too: {UNSUPPORTED[refused]}. {_supported()}"
    closest = [repr(t) for t in _closest_types(model_type)]
    if not closest:
        return f". {_supported()}"
    options = closest[0] if len(closest) == 1 else f"{', '.join(closest[:-1])} or {closest[-1]}"
    return (
        f". Did you mean {options}? (model_type strings are config.model_type values; "
        f"lce_patch.supported_architectures() lists all {len(REGISTRY)})"
    )


def _output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's LM head module (get_output_embeddings()), or None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, torch.nn.Module) else None


def _is_lm_class(model: torch.nn.Module) -> bool:
    """Whether the model is (a subclass of) a class transformers' causal-LM or image-text-to-text mappings name."""
    class_names = {cls.__name__ for cls in type(model).__mro__}
    return any(class_names.intersection(names) for names in _mapping_names().values())


def _lm_class_hint(model_type: str | None) -> str:
    """How to load a model of ``model_type`` with its language-model head."""
    import transformers
    from transformers.models.auto import modeling_auto

    for mapping, auto_class in (
        (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "AutoModelForCausalLM"),
        (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "AutoModelForImageTextToText"),
    ):
        names = mapping.get(model_type, ())
        for name in (names,) if isinstance(names, str) else names:
            if hasattr(transformers, name):
                return f"load it with {name} (or {auto_class})"
    return f"transformers has no causal-LM class for model_type {model_type!r}"


def _unregistered_reason(model: torch.nn.Module) -> str | None:
    """Why an instance is not registered, where more can be said than its model_type."""
    model_type = getattr(model.config, "model_type", None)
    if model_type in UNSUPPORTED:
        return UNSUPPORTED[model_type]
    head = _output_embeddings(model)
    if head is None:
        return "its LM head is not exposed by get_output_embeddings()"
    if not _plain_linear_head(model):
        return f"its LM head ({type(head).__name__}) is not a plain torch.nn.Linear and may transform the logits"
    bases = _registered_classes(model)
    if bases:
        return f"it overrides the forward of {bases[0].__name__}, which may change the loss"
    return None


def _self_check_applies(model: torch.nn.Module) -> bool:
    """Whether allow_unregistered can patch the model: a type not refused outright, a floating-point head weight."""
    head = _output_embeddings(model)
    if getattr(model.config, "model_type", None) in UNSUPPORTED or head is None:
        return False
    try:
        weight = getattr(resolve_head_module(head), "weight", None)
    except NotImplementedError:
        return False
    return isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 2


def _refusal(target: Any, reason: str | None = None, self_checked: bool = False) -> ValueError:
    """The error refusing a model_type string or a model instance, with the hint that applies to it.

    ``reason`` replaces the one derived from the model; ``self_checked``: allow_unregistered's check already ran.
    """
    if isinstance(target, str):
        return ValueError(f"lce_patch: {target!r} is not a supported architecture{_type_string_hint(target)}")
    name = type(target).__name__
    model_type = getattr(target.config, "model_type", None)
    if _output_embeddings(target) is None and not _is_lm_class(target):
        return ValueError(
            f"lce_patch: {name} has no language-model head (get_output_embeddings() gives none), so there is no "
            f"language-model loss to fuse: {_lm_class_hint(model_type)}."
        )
    reason = reason or _unregistered_reason(target)
    message = f"lce_patch: {name} (model_type={model_type!r}) is not a supported architecture"
    message += f": {reason}." if reason else "."
    if model_type not in REGISTRY:
        message += f" {_supported()}"
    if not self_checked and _self_check_applies(target):
        message += f" {_ALLOW_UNREGISTERED_HINT}"
    return ValueError(message)


def _spec_for(model: torch.nn.Module) -> ArchSpec:
    spec = getattr(model, SPEC_ATTR, None)
    if spec is None:
        model_type = getattr(model.config, "model_type", type(model).__name__)
        spec = derived_spec(unpatched(type(model).forward), model_type, registered=_is_registered(model))
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
        classes = _mapped_classes(model_or_model_type)
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
    for field in dataclasses.fields(opts):
        value = getattr(opts, field.name)
        if field.name not in shown and value != field.default:
            shown[field.name] = value
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
    models loaded afterwards; the tuple of patched classes is returned). Options: ``ignore_index``, ``label_smoothing``,
    ``z_loss``, ``backend``, ``chunk_size``, ``deterministic``, ``skip_ignored``, ``fp32_weight_grad``, ``return_logits_in_eval``
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
        classes = [cls for cls in _mapped_classes(model_or_model_type) if vars(cls).get(OPTIONS_ATTR) != opts]
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
        head = _output_embeddings(model)
        if head is None:
            raise _refusal(model)
        weight = getattr(resolve_head_module(head), "weight", None)  # refuses an adapter the op cannot compute
        if isinstance(weight, torch.Tensor) and not weight.is_floating_point():
            raise ValueError(
                f"lce_patch: {type(model).__name__}'s LM head is quantized ({type(head).__module__}."
                f"{type(head).__name__}, weight {weight.dtype}); the fused loss needs a floating-point head weight. "
                "Keep the head unquantized: with bitsandbytes, add 'lm_head' to llm_int8_skip_modules (a list "
                "given there replaces transformers' default, which excludes the head)."
            )
        registered = _is_registered(model)
        model_type = getattr(model.config, "model_type", None)
        if not registered and not opts.allow_unregistered:
            raise _refusal(model)
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
        neutral = dataclasses.replace(
            opts,
            label_smoothing=0.0,
            z_loss=0.0,
            class_weights=None,
            return_lse=False,
            return_token_accuracy=False,
            return_predicted_tokens=False,
        )
        setattr(model, OPTIONS_ATTR, neutral)
        try:
            check_against_own_forward(model)
        except Exception as err:
            revert_fused_lce(model)
            if isinstance(err, ValueError) and str(err).startswith("lce_patch"):
                raise
            raise _refusal(
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
    head = _output_embeddings(model)
    if head is None:
        raise _refusal(model)
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
            raise _refusal(model_or_model_type)
        for cls in _mapped_classes(model_or_model_type):
            if OPTIONS_ATTR in vars(cls):
                cls.forward = unpatched(vars(cls)["forward"])
                delattr(cls, OPTIONS_ATTR)
                delattr(cls, SPEC_ATTR)
        return tuple(_mapped_classes(model_or_model_type))
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
    if model_type not in REGISTRY:
        raise _refusal(model_type)
    if opts.allow_unregistered:
        raise ValueError("lce_patch: allow_unregistered applies to model instances, not to model_type strings")
    for cls in _mapped_classes(model_type):
        if opts.returns_extras:
            prepare_output_classes(unpatched(vars(cls)["forward"]))
        if OPTIONS_ATTR not in vars(cls):
            cls.forward = make_forward(unpatched(vars(cls)["forward"]), _head_config_of)
            # The head's transform fields come from the class's forward; their values from each instance.
            setattr(cls, SPEC_ATTR, derived_spec(unpatched(vars(cls)["forward"]), model_type, registered=True))
        setattr(cls, OPTIONS_ATTR, opts)
    return tuple(_mapped_classes(model_type))


# --- The self-check of unregistered models -----------------------------------------------------------

_PROBES = 3  # random projections per parameter gradient


def _special_token_ids(config: Any) -> set[int]:
    ids: set[int] = set()
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    for cfg in configs:
        for name, value in vars(cfg).items():
            if (name.endswith("_token_id") or name.endswith("_token_index")) and isinstance(value, int):
                ids.add(value)
    return ids


def _test_batch(model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab_size = getattr(text_config, "vocab_size", None) or model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    allowed = torch.tensor(sorted(set(range(min(vocab_size, 4096))) - _special_token_ids(config)))
    input_ids = allowed[torch.randint(0, len(allowed), (2, 12), generator=generator)].to(device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :4] = -100
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
    if hasattr(text_config, "output_router_logits"):
        batch["output_router_logits"] = True
    return batch


def _gradient_probes(params: list[tuple[str, torch.nn.Parameter]]) -> dict[str, list[float] | None]:
    """Per parameter: the gradient's norm and its dot products with fixed random tensors (None: no gradient)."""
    probes: dict[str, list[float] | None] = {}
    for index, (name, param) in enumerate(params):
        grad = param.grad
        if grad is None:
            probes[name] = None
            continue
        grad = grad.detach().float()
        values = [float(grad.norm())]
        generator = torch.Generator(device=grad.device).manual_seed(1000 + index)
        for _ in range(_PROBES):
            direction = torch.randn(grad.shape, generator=generator, device=grad.device)
            values.append(float((grad * direction).sum()))
        probes[name] = values
    return probes


class _LargeLogits:
    """A head pre-hook scaling the hidden states so the raw logits have a standard deviation of ``target``.

    A tiny or random model's logits are a few units, where a softcap of 30 is the identity to 1e-3: the
    check must run where a missing softcap or scale changes the loss. The factor is set on the first call
    (the reference forward) and reused (the fused one).
    """

    def __init__(self, head: torch.nn.Module, target: float = 50.0) -> None:
        self.weight = resolve_head_module(head).weight
        self.target = target
        self.factor: float | None = None

    def __call__(self, module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        if self.factor is None:
            with torch.no_grad():
                raw = hidden.detach().float() @ self.weight.detach().float().t()
                std = float(raw.std())
            self.factor = self.target / std if std > 0 else 1.0
        return (hidden * self.factor, *args[1:])


def check_against_own_forward(model: torch.nn.Module) -> None:
    """The fused loss and every trainable parameter's gradient must equal the model's own on a test batch.

    Runs the model's own forward and the patched one on the same batch (eval mode, logits scaled large),
    backpropagates both and compares the loss and, per parameter, the gradient's norm and three random
    projections (no second copy of the gradients is held). Raises ``ValueError`` naming what differs.
    The parameters' existing gradients and the training mode are restored.
    """
    param = next(model.parameters())
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    batch = _test_batch(model, param.device)
    tolerance = 1e-3 if param.dtype in (torch.float32, torch.float64) else 5e-2
    own_forward = vars(model).get(PREVIOUS_FORWARD_ATTR) or types.MethodType(unpatched(type(model).forward), model)
    saved_grads = {name: p.grad for name, p in params}
    was_training = model.training
    head = model.get_output_embeddings()
    scaling = _LargeLogits(head)
    hook = head.register_forward_pre_hook(scaling)
    model.eval()
    try:
        results = []
        for forward in (own_forward, functools.partial(model.forward, skip_logits=True)):
            for _, p in params:
                p.grad = None
            out = forward(**batch)
            if forward is not own_forward and out.logits is not None:
                raise _refusal(
                    model, "the patched forward did not take the fused path on a test batch", self_checked=True
                )
            loss = out.loss
            if params:
                loss.backward()
            results.append((float(loss.detach()), _gradient_probes(params)))
    finally:
        hook.remove()
        for name, p in params:
            p.grad = saved_grads[name]
        model.train(was_training)
    (own_loss, own_probes), (fused_loss, fused_probes) = results
    problems = []
    if not (math.isfinite(fused_loss) and math.isclose(fused_loss, own_loss, rel_tol=tolerance, abs_tol=tolerance)):
        problems.append(f"loss {fused_loss:.6g} (its own: {own_loss:.6g})")
    # A gradient that is numerically zero (say 1e-11 beside gradients of 1) is compared at the scale of
    # the largest one: its relative error is rounding noise.
    floor = 1e-5 * max((probe[0] for probe in own_probes.values() if probe is not None), default=0.0)
    for name, _ in params:
        own, fused = own_probes[name], fused_probes[name]
        if own is None or fused is None:
            present = own if own is not None else fused
            if (own is None) != (fused is None) and present[0] > floor:
                problems.append(f"{name} (a gradient on one side only)")
            continue
        scale = max(own[0], floor) + 1e-30
        if any(abs(a - b) > tolerance * scale for a, b in zip(own, fused)):
            problems.append(f"{name} (gradient differs by ~{max(abs(a - b) for a, b in zip(own, fused)) / scale:.2g})")
    if problems:
        shown = ", ".join(problems[:8]) + (f" and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise _refusal(
            model,
            f"on a test batch with large logits the fused forward differs from the model's own in: {shown}, so its "
            "forward does something the fused loss does not (e.g. a custom logit transform or a loss term outside "
            "loss_function)",
            self_checked=True,
        )
