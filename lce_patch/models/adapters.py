"""The LM head under PEFT: which module computes it right now (the active ``modules_to_save`` copy, a LoRA
layer, trainable tokens), the weight, bias and LoRA term the fused loss computes it with, and the adapters it
refuses rather than skip silently (DoRA and the other LoRA variants, ``lora_bias``, tuners other than LoRA).

PEFT is optional: without it every head is the plain module. An FSDP1 wrapper is looked through
(:func:`fsdp1_inner`) to reach the PEFT layer inside it.
"""

from __future__ import annotations

import functools

import torch


def lora_linear_class() -> type | None:
    """PEFT's LoRA layer for ``nn.Linear`` (None when PEFT is absent)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def peft_classes() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
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


def fsdp1_inner(module: torch.nn.Module) -> torch.nn.Module:
    """The module an FSDP1 ``FullyShardedDataParallel`` wraps (or ``module`` itself)."""
    return getattr(module, "_fsdp_wrapped_module", module)


def resolve_head_module(lm_head: torch.nn.Module) -> torch.nn.Module:
    """The module whose weight the head uses right now: the active ``modules_to_save`` copy under PEFT, or
    a PEFT LoRA layer (its ``weight`` is the base layer's; :func:`head_operands` adds the adapters).

    Raises ``NotImplementedError`` for a PEFT adapter the fused loss cannot compute (DoRA and the other
    LoRA variants, ``lora_bias``, tuners other than LoRA): reading the base weight would silently skip it.
    """
    modules_to_save, trainable_tokens, tuner_layers = peft_classes()
    head = fsdp1_inner(lm_head)
    if modules_to_save and isinstance(head, modules_to_save):
        active = head.active_adapters
        if head.disable_adapters or not active or any(name not in head._adapters for name in active):
            return head.original_module
        return head.modules_to_save[active[0]]
    if trainable_tokens and isinstance(head, trainable_tokens):
        return lm_head  # its ``weight`` attribute already merges the trained token rows
    lora_linear = lora_linear_class()
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
    lora_linear = lora_linear_class()
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


def deepspeed_tensor_parallel_layer(module: torch.nn.Module) -> type | None:
    """The DeepSpeed AutoTP layer class ``module`` is an instance of (``LinearLayer``, ``LmHeadLinearAllreduce``,
    ``VocabParallelLinear``, ...: subclasses of its ``TensorParallel_Layer``), else None. By name, so that
    DeepSpeed is never imported here."""
    for cls in type(module).__mro__:
        if cls.__name__ == "TensorParallel_Layer" and cls.__module__.startswith("deepspeed."):
            return type(module)
    return None


def _refuse_deepspeed_tensor_parallel(module: torch.nn.Module) -> None:
    layer = deepspeed_tensor_parallel_layer(module)
    if layer is None:
        return
    raise NotImplementedError(
        f"lce_patch: the LM head is DeepSpeed AutoTP's {layer.__module__}.{layer.__name__}, which holds a plain "
        "local shard of the head weight (of the vocabulary or of the hidden size); the fused loss would cover "
        "one rank's part of it. Use transformers' tensor parallelism instead "
        "(from_pretrained(..., distributed_config=DistributedConfig(tp_size=N)); the fused loss then runs "
        "vocabulary-parallel on the head's DTensor), keep lm_head out of AutoTP (a partition_config whose "
        "layer_specs do not match it, and vocab_parallel_lm_head=False), or do not patch this model."
    )


def _head_params(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    _refuse_deepspeed_tensor_parallel(module)
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


def head_leaves(head: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that compute the head: every copy behind a PEFT ``modules_to_save`` wrapper, else the head."""
    modules_to_save, _, _ = peft_classes()
    head = fsdp1_inner(head)
    if modules_to_save and isinstance(head, modules_to_save):
        return [fsdp1_inner(head.original_module), *(fsdp1_inner(m) for m in head.modules_to_save.values())]
    return [head]
