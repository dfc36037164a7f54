"""Reaching the LM head the way distributed wrappers expect: through the module call.

FSDP1, FSDP2 and DeepSpeed ZeRO-3 gather a module's parameters in its forward hooks and arm their
backward hooks on its outputs. :func:`head_call` therefore runs the fused loss *inside*
``lm_head(...)``, by redirecting the head module's ``forward`` for the duration of one call, instead
of reading ``lm_head.weight`` behind the wrappers' back.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch


def _lora_linear_class() -> type | None:
    """PEFT's LoRA layer for ``nn.Linear`` (None when PEFT is absent)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def _peft_classes() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(ModulesToSaveWrapper, TrainableTokensWrapper, BaseTunerLayer) classes, empty when PEFT is absent."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return (), (), ()
    try:
        from peft.utils.other import TrainableTokensWrapper

        trainable_tokens: tuple[type, ...] = (TrainableTokensWrapper,)
    except ImportError:
        trainable_tokens = ()
    return (ModulesToSaveWrapper,), trainable_tokens, (BaseTunerLayer,)


def unwrap_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face CausalLM under a PEFT wrapper (``PeftModel``), or ``model`` itself."""
    try:
        from peft import PeftModel
    except ImportError:
        return model
    if isinstance(model, PeftModel):
        return model.get_base_model()
    return model


def _fsdp1_inner(module: torch.nn.Module) -> torch.nn.Module:
    """The module an FSDP1 ``FullyShardedDataParallel`` wraps (or ``module`` itself)."""
    return getattr(module, "_fsdp_wrapped_module", module)


def resolve_head_module(lm_head: torch.nn.Module) -> torch.nn.Module:
    """The module whose weight the head uses right now: the active ``modules_to_save`` copy under PEFT, or
    a PEFT LoRA layer (its ``weight`` is the base layer's; :func:`head_operands` adds the adapters).

    Raises ``NotImplementedError`` for a PEFT adapter the fused loss cannot compute (DoRA and the other
    LoRA variants, ``lora_bias``, tuners other than LoRA): reading the base weight would silently skip it.
    """
    modules_to_save, trainable_tokens, tuner_layers = _peft_classes()
    head = _fsdp1_inner(lm_head)
    if modules_to_save and isinstance(head, modules_to_save):
        active = head.active_adapters
        if head.disable_adapters or not active or any(name not in head._adapters for name in active):
            return head.original_module
        return head.modules_to_save[active[0]]
    if trainable_tokens and isinstance(head, trainable_tokens):
        return lm_head  # its ``weight`` attribute already merges the trained token rows
    lora_linear = _lora_linear_class()
    if lora_linear is not None and isinstance(head, lora_linear):
        _check_lora_head(head)
        return head
    if tuner_layers and isinstance(head, tuner_layers):
        raise NotImplementedError(
            f"lce_patch: the LM head is a PEFT adapter layer the fused loss does not support "
            f"({type(head).__module__}.{type(head).__name__}); it supports LoRA on a Linear head. Reading the "
            "head's weight would silently skip the adapter. Use LoRA on the head, remove 'lm_head' from "
            "target_modules (or train it fully with modules_to_save=['lm_head']), or do not patch this model."
        )
    return lm_head


def _active_lora_adapters(layer: torch.nn.Module) -> list[str]:
    """The adapters whose term the LoRA layer adds in its forward right now (none when merged or disabled)."""
    if layer.disable_adapters or layer.merged:
        return []
    return [name for name in layer.active_adapters if name in layer.lora_A.keys()]


def _check_lora_head(layer: torch.nn.Module) -> None:
    """Refuse what the fused low-rank term does not compute: LoRA variants (DoRA, ...) and ``lora_bias``."""
    variants = getattr(layer, "lora_variant", {})
    for name in _active_lora_adapters(layer):
        if name in variants or getattr(layer, "use_dora", {}).get(name, False):
            kind = "DoRA" if getattr(layer, "use_dora", {}).get(name, False) else type(variants[name]).__name__
            raise NotImplementedError(
                f"lce_patch: the LM head's LoRA adapter {name!r} is a {kind} adapter; the fused loss computes plain "
                "LoRA on the head (rslora and lora_dropout included). Use plain LoRA on 'lm_head', train the head "
                "with modules_to_save=['lm_head'], or keep 'lm_head' out of target_modules."
            )
        if getattr(layer, "lora_bias", {}).get(name, False):
            raise NotImplementedError(
                f"lce_patch: the LM head's LoRA adapter {name!r} has lora_bias=True, which the fused loss does not "
                "compute; use lora_bias=False for the head, or keep 'lm_head' out of target_modules."
            )


def head_operands(
    module: torch.nn.Module, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """(weight, bias, low_rank) of the head module as called on ``hidden``: ``low_rank`` is None, or for a
    PEFT LoRA layer with active unmerged adapters the op's low-rank term ``(low_rank_hidden [..., r],
    low_rank_weight [V, r])``: ``scaling * lora_A(lora_dropout(hidden))`` and ``lora_B.weight``, in the
    adapters' dtype, built with the layer's own modules as its forward does (the same dropout draws,
    the same input cast; several active adapters side by side along r).

    A disabled adapter on a merged layer is unmerged first, as PEFT's forward does."""
    weight, bias = _head_params(module)
    lora_linear = _lora_linear_class()
    if lora_linear is None or not isinstance(module, lora_linear):
        return weight, bias, None
    _check_lora_head(module)
    if module.disable_adapters and module.merged:
        module.unmerge()
        weight, bias = _head_params(module)
    terms = []
    for name in _active_lora_adapters(module):
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        cast = getattr(module, "_cast_input_dtype", None)  # PEFT >= 0.15; before, a plain cast
        x = cast(hidden, lora_a.weight.dtype) if cast is not None else hidden.to(lora_a.weight.dtype)
        terms.append((lora_a(module.lora_dropout[name](x)) * module.scaling[name], lora_b.weight))
    if not terms:
        return weight, bias, None
    if len(terms) == 1:
        return weight, bias, terms[0]
    dtype = functools.reduce(torch.promote_types, (t[0].dtype for t in terms))
    low_hidden = torch.cat([t[0].to(dtype) for t in terms], dim=-1)
    return weight, bias, (low_hidden, torch.cat([t[1].to(dtype) for t in terms], dim=1))


def _head_params(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = module.weight
    try:
        bias = module.bias
    except AttributeError:
        bias = None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(
            f"lce_patch: the LM head ({type(module).__name__}) has no 2-D weight; only Linear-like heads are supported"
        )
    return weight, bias if isinstance(bias, torch.Tensor) else None


def _forward_attr(module: torch.nn.Module) -> str:
    """The attribute holding the computation to replace: accelerate's hooks (device_map / offload) keep
    the real forward in ``_old_forward`` and call it after moving the weights, so that one, keeping
    their pre-forward; else ``forward``."""
    return "_old_forward" if "_old_forward" in module.__dict__ else "forward"


def head_call(lm_head: torch.nn.Module, fn: Callable[..., Any], *args: Any, low_rank: bool = False) -> Any:
    """Run ``fn(weight, bias, *args)`` inside the call of the ``lm_head`` module; ``args[0]`` is the
    hidden states the head is called on.

    The head module's ``forward`` is redirected for this one call, so FSDP1/FSDP2/ZeRO-3 hooks gather
    the weight before ``fn`` runs and register their backward hooks on its output. ``weight`` and
    ``bias`` are read inside the call (the gathered tensors). A PEFT ``ModulesToSaveWrapper`` resolves to
    its active copy. With ``low_rank=True`` ``fn`` also gets ``low_rank=`` (:func:`head_operands`: a
    LoRA layer's term, or None); without it a LoRA layer with active adapters raises
    ``NotImplementedError``. Tensor arguments should be passed in ``args`` (not captured by ``fn``)
    when the hooks must see them, e.g. to cast inputs.
    """
    module = resolve_head_module(lm_head)
    inner = _fsdp1_inner(module)

    def call_fn(*call_args: Any) -> Any:
        weight, bias, term = head_operands(inner, call_args[0])
        if low_rank:
            return fn(weight, bias, *call_args, low_rank=term)
        if term is not None:
            raise NotImplementedError(
                f"lce_patch: the LM head carries a LoRA adapter ({type(inner).__name__}), which this fused loss "
                "does not compute; keep 'lm_head' out of target_modules (or train it with "
                "modules_to_save=['lm_head']) for this trainer."
            )
        return fn(weight, bias, *call_args)

    if torch.compiler.is_compiling():
        # dynamo cannot trace a module whose ``forward`` is swapped for one call; a compiled model
        # reads the head's parameters directly (FSDP/ZeRO-3 with a compiled patched model: not verified).
        return call_fn(*args)

    attr = _forward_attr(inner)
    had_own = attr in inner.__dict__
    previous = inner.__dict__.get(attr)
    setattr(inner, attr, call_fn)
    try:
        return module(*args)
    finally:
        if had_own:
            setattr(inner, attr, previous)
        else:
            delattr(inner, attr)


# --- The head interceptor -------------------------------------------------------------------------
#
# A patched model keeps its own ``forward``: the patch arms a *job* (labels and options), then calls
# it. While armed, the LM head module computes the fused loss from the hidden states it is called
# with (inside its own call, so FSDP/ZeRO-3 hooks gather its weight and arm their backward hooks on
# its output) and returns a zero-width stand-in for the logits that carries the loss's autograd
# graph; the model's logit transforms run on the stand-in for free, and its ``loss_function``
# returns the fused loss. Unarmed, the head is the plain module.

SLOT_ATTR = "_lce_patch_slot"
_INTERCEPTED_ATTR = "_lce_patch_intercepted"


class JobSlot:
    """The armed job of one patched model, per thread (None when idle). Shared, not copied, by ``deepcopy``.

    A job lives for the length of one forward, in the thread that runs it: a model called from several
    threads at once (serving, threaded evaluation, ``nn.DataParallel``'s replicas, which share their
    modules' attributes) arms one job per thread. Deep copies of a patched model (a TRL reference model,
    PEFT's ``modules_to_save`` copies of the head) keep one slot with the original, which keeps every
    copy of the head reachable from the forward that arms it. A pickled slot comes back empty.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self.warned: set[str] = set()  # one-time warnings already given for this model

    @property
    def job(self) -> Any:
        return getattr(self._local, "job", None)

    @job.setter
    def job(self, job: Any) -> None:
        self._local.job = job

    def __deepcopy__(self, memo: dict) -> JobSlot:
        return self

    def __reduce__(self) -> tuple:
        return (JobSlot, ())


def head_leaves(head: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that compute the head: every copy behind a PEFT ``modules_to_save`` wrapper, else the head."""
    modules_to_save, _, _ = _peft_classes()
    head = _fsdp1_inner(head)
    if modules_to_save and isinstance(head, modules_to_save):
        return [_fsdp1_inner(head.original_module), *(_fsdp1_inner(m) for m in head.modules_to_save.values())]
    return [head]


class InterceptingForward:
    """A head module's ``forward`` while patched: the fused loss when its model's job is armed (in this
    thread), else the module's own computation. A callable object rather than a bound method, so that a
    pickled (``torch.save``, multiprocessing) or deep-copied head rebuilds it around the new module."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __reduce__(self) -> tuple:
        return (InterceptingForward, (self.module,))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        job = module.__dict__[SLOT_ATTR].job
        if job is None:
            _, previous = module.__dict__[_INTERCEPTED_ATTR]
            if previous is not None:
                return previous(*args, **kwargs)
            return type(module).forward(module, *args, **kwargs)
        if kwargs or len(args) != 1:
            raise RuntimeError(
                f"lce_patch: the LM head was called with {len(args)} positional and {sorted(kwargs)} keyword "
                "arguments; the fused loss expects it to be called on the hidden states alone"
            )
        weight, bias, low_rank = head_operands(module, args[0])
        return job.run_head(weight, bias, args[0], low_rank)


def install_interceptor(head: torch.nn.Module, slot: JobSlot) -> None:
    """Route ``head``'s computation through ``slot`` (idempotent). Accelerate hooks keep working."""
    for leaf in head_leaves(head):
        if _INTERCEPTED_ATTR in leaf.__dict__:
            if leaf.__dict__.get(SLOT_ATTR) is not slot:  # no write on the hot path (it runs per call)
                leaf.__dict__[SLOT_ATTR] = slot
            continue
        attr = _forward_attr(leaf)
        leaf.__dict__[_INTERCEPTED_ATTR] = (attr, leaf.__dict__.get(attr))
        leaf.__dict__[SLOT_ATTR] = slot
        leaf.__dict__[attr] = InterceptingForward(leaf)


def remove_interceptor(head: torch.nn.Module) -> None:
    """Undo :func:`install_interceptor` exactly."""
    for leaf in head_leaves(head):
        state = leaf.__dict__
        if _INTERCEPTED_ATTR not in state:
            continue
        attr, previous = state.pop(_INTERCEPTED_ATTR)
        state.pop(SLOT_ATTR, None)
        if previous is None:
            state.pop(attr, None)
        else:
            state[attr] = previous
