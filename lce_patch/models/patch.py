"""apply_fused_lce / revert_fused_lce: instance patches (a loaded model) and class patches (a model_type)."""

from __future__ import annotations

import functools
import math
import types
from typing import Any

import torch

from .forward import (
    OPTIONS_ATTR,
    PREVIOUS_FORWARD_ATTR,
    SPEC_ATTR,
    BoundForward,
    LCEOptions,
    LossFunctionStandIn,
    ensure_slot,
    make_forward,
    unpatched,
)
from .head import (
    SLOT_ATTR,
    _lora_linear_class,
    _peft_classes,
    head_leaves,
    remove_interceptor,
    resolve_head_module,
    unwrap_causal_lm,
)
from .registry import REGISTRY, UNSUPPORTED, ArchSpec, HeadConfig, derived_spec

_MISSING = object()


def _unsupported(what: str) -> ValueError:
    examples = ", ".join(t for t in ("llama", "gemma2", "gemma3", "mistral", "qwen3") if t in REGISTRY)
    return ValueError(
        f"lce_patch: {what} is not a supported architecture (supported: the {len(REGISTRY)} model types of "
        f"lce_patch.supported_architectures(), e.g. {examples}). A model whose LM head is a Linear layer applied "
        "once to the decoder's last hidden state, with its loss computed by self.loss_function, can be patched "
        "with apply_fused_lce(model, allow_unregistered=True), which first checks the fused loss and every "
        "gradient against the model's own forward on a test batch."
    )


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


def _is_registered(model: torch.nn.Module) -> bool:
    """Whether this instance is of a class a registered type maps to, with that class's own forward.

    The registry is keyed by the auto mappings' model_type, which may differ from the config's
    (Emu3ForCausalLM is mapped under ``emu3`` but its config says ``emu3_text_model``).
    """
    if not _plain_linear_head(model):
        return False  # a custom head module: its forward may transform the logits
    class_names = {cls.__name__ for cls in type(model).__mro__}
    for model_type, names in _mapping_names().items():
        if model_type not in REGISTRY or not class_names.intersection(names):
            continue
        for cls in _mapped_classes(model_type):
            if isinstance(model, cls) and unpatched(type(model).forward) is unpatched(cls.forward):
                return True
    return False  # another head class, or a subclass that overrides forward


def _plain_linear_head(model: torch.nn.Module) -> bool:
    """Whether every module computing the head runs ``torch.nn.Linear.forward`` (or is PEFT's trainable tokens,
    or PEFT's LoRA layer over a Linear)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        return False
    _, trainable_tokens, _ = _peft_classes()
    if trainable_tokens and isinstance(head, trainable_tokens):
        return True
    lora_linear = _lora_linear_class()

    def plain(leaf: torch.nn.Module) -> bool:
        if lora_linear is not None and isinstance(leaf, lora_linear):
            leaf = leaf.get_base_layer()
        return type(leaf).forward is torch.nn.Linear.forward

    return all(plain(leaf) for leaf in head_leaves(head))


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


def apply_fused_lce(model_or_model_type: Any, **options: Any) -> Any:
    """Make training compute the causal-LM loss with the fused linear cross-entropy (no logits tensor).

    ``model_or_model_type`` is a loaded model (a Hugging Face CausalLM or a PEFT model around one, patched
    in place and returned) or a ``config.model_type`` string (that architecture's classes are patched, for
    models loaded afterwards; the tuple of patched classes is returned). Options: ``ignore_index``, ``label_smoothing``,
    ``z_loss``, ``backend``, ``chunk_size``, ``deterministic``, ``skip_ignored``, ``return_logits_in_eval``
    (evaluation with labels runs the model's own forward and returns the logits), ``allow_unregistered``
    (patch a model of an unregistered type after checking its fused loss and gradients against its own).
    Patching again replaces the options.
    """
    opts = LCEOptions.from_kwargs(options)
    if isinstance(model_or_model_type, str):
        return _patch_classes(model_or_model_type, opts)
    model = unwrap_causal_lm(model_or_model_type)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"lce_patch: apply_fused_lce expects a Hugging Face model or a model_type string, got "
            f"{type(model_or_model_type).__name__}"
        )
    newly_patched = OPTIONS_ATTR not in vars(model)
    if newly_patched:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(head, torch.nn.Module):
            raise _unsupported(f"{type(model).__name__}: it has no output embedding (get_output_embeddings());")
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
            reason = f" ({UNSUPPORTED[model_type]})" if model_type in UNSUPPORTED else ""
            raise _unsupported(f"{type(model).__name__} (model_type={model_type!r}){reason}")
        spec = derived_spec(unpatched(type(model).forward), model_type, registered=registered)
        previous = vars(model).get("forward", _MISSING)
        original = unpatched(type(model).forward)
        model.forward = BoundForward(model, make_forward(original, _head_config_of), _head_config_of)
        if previous is not _MISSING:
            setattr(model, PREVIOUS_FORWARD_ATTR, previous)
        setattr(model, SPEC_ATTR, spec)
        ensure_slot(model)
    setattr(model, OPTIONS_ATTR, opts)
    if newly_patched and not getattr(model, SPEC_ATTR).registered:
        try:
            check_against_own_forward(model)
        except Exception as err:
            revert_fused_lce(model)
            if isinstance(err, ValueError) and str(err).startswith("lce_patch"):
                raise
            raise _unsupported(
                f"{type(model).__name__} (the self-check failed on a test batch: {type(err).__name__}: {err});"
            ) from err
    return model_or_model_type


def revert_fused_lce(model_or_model_type: Any) -> Any:
    """Undo apply_fused_lce exactly (instance or class); a no-op on what is not patched."""
    if isinstance(model_or_model_type, str):
        if model_or_model_type not in REGISTRY:
            raise _unsupported(repr(model_or_model_type))
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
        reason = f" ({UNSUPPORTED[model_type]})" if model_type in UNSUPPORTED else ""
        raise _unsupported(repr(model_type) + reason)
    if opts.allow_unregistered:
        raise ValueError("lce_patch: allow_unregistered applies to model instances, not to model_type strings")
    for cls in _mapped_classes(model_type):
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
                raise _unsupported(f"{type(model).__name__}: the patched forward did not take the fused path;")
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
        raise _unsupported(
            f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r}): on a test batch "
            f"with large logits the fused forward differs from the model's own in: {shown}, so its forward does "
            "something the fused loss does not (e.g. a custom logit transform or a loss term outside "
            "loss_function);"
        )
