"""The one forward shared by every registered architecture.

``make_forward(original, spec)`` returns a replacement for a CausalLM's ``forward`` that keeps the
original's signature (``generate()`` and PEFT inspect it). When the call carries labels (or
``shift_labels``) and the logits are not wanted, it runs the decoder, then the fused linear
cross-entropy through the LM head module; every other call goes to the original forward unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import typing
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.linear_cross_entropy.functional import fused_linear_cross_entropy, start_valid_token_count
from .head import head_call
from .registry import ArchSpec

# Marks a patched forward; holds the forward it replaced.
ORIGINAL_ATTR = "__lce_patch_original__"
# Instance attributes written by apply_fused_lce.
OPTIONS_ATTR = "_lce_patch_options"
SPEC_ATTR = "_lce_patch_spec"
PREVIOUS_FORWARD_ATTR = "_lce_patch_previous_forward"

_BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class LCEOptions:
    """Options of a patched model (stored on the model instance, or on the class for a class patch)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    backend: str = "auto"
    chunk_size: int | None = None
    deterministic: bool = False
    skip_ignored: bool = True
    return_logits_in_eval: bool = False
    allow_unregistered: bool = False

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"lce_patch: unknown backend {self.backend!r}; expected one of {_BACKENDS}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"lce_patch: label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if self.z_loss < 0:
            raise ValueError(f"lce_patch: z_loss must be >= 0, got {self.z_loss}")
        if self.chunk_size is not None and (
            isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1
        ):
            raise ValueError(f"lce_patch: chunk_size must be a positive int, got {self.chunk_size!r}")

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> LCEOptions:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"lce_patch: unknown option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**options)


def unpatched(forward: Any) -> Any:
    """The forward a patched forward replaced (``forward`` itself when not patched)."""
    return getattr(forward, ORIGINAL_ATTR, forward)


def _output_class(original: Any, spec: ArchSpec) -> type:
    """The ModelOutput class the original forward returns (from its return annotation)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    from transformers.utils import ModelOutput

    try:
        annotation = typing.get_type_hints(original).get("return")
    except Exception:  # unresolvable annotation strings: fall back below
        annotation = inspect.signature(original).return_annotation
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, ModelOutput):
            return candidate
    return MoeCausalLMOutputWithPast if spec.moe else CausalLMOutputWithPast


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def fused_causal_lm_loss(
    model: torch.nn.Module,
    spec: ArchSpec,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    loss_kwargs: dict[str, Any],
    options: LCEOptions,
    num_valid_tokens: int | None = None,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` contract, computed from the hidden states through the head module.

    ``shift_labels`` is used as given, else ``labels`` are shifted; ``num_items_in_batch`` gives
    sum / num_items, else the mean over non-ignored tokens (0, still differentiable, when none is valid).
    ``num_valid_tokens``: the count of targets that are not ignored, when known (the op then skips
    the ignored ones without a host sync).
    """
    ignore_index = loss_kwargs.get("ignore_index", options.ignore_index)
    num_items_in_batch = loss_kwargs.get("num_items_in_batch")
    targets, shift = (shift_labels, False) if shift_labels is not None else (labels, True)
    head_config = spec.head_config(model.config)

    def loss_fn(weight: torch.Tensor, bias: torch.Tensor | None, hidden_states: torch.Tensor) -> torch.Tensor:
        if _is_dtensor(weight):
            # Inside the head's call FSDP has unsharded its weight; a DTensor here is a vocab-sharded
            # (tensor-parallel) head, which needs a vocab-parallel cross-entropy.
            raise NotImplementedError(
                "lce_patch: the LM head weight is a DTensor inside the head's call (tensor parallelism, "
                f"placements {getattr(weight, 'placements', '?')}); the fused loss does not support a vocab-sharded "
                "head yet. Train without tensor parallelism on lm_head, or revert_fused_lce(model)."
            )
        return fused_linear_cross_entropy(
            hidden_states,
            weight,
            targets.to(hidden_states.device),
            bias=bias,
            ignore_index=ignore_index,
            softcap=head_config.softcap,
            logit_scale=head_config.logit_scale,
            shift=shift,
            num_items_in_batch=num_items_in_batch,
            label_smoothing=options.label_smoothing,
            z_loss=options.z_loss,
            backend=options.backend,
            chunk_size=options.chunk_size,
            deterministic=options.deterministic,
            skip_ignored=options.skip_ignored and num_valid_tokens is None,
            num_valid_tokens=num_valid_tokens,
        )

    return head_call(getattr(model, spec.head), loss_fn, hidden)


def _moe_aux_loss(model, spec: ArchSpec, router_logits, attention_mask) -> torch.Tensor:
    module = importlib.import_module(spec.module_name)
    loss_func = getattr(module, spec.moe.loss_func, None)
    if loss_func is None:
        raise RuntimeError(
            f"lce_patch: {spec.module_name} has no {spec.moe.loss_func}; this transformers version is not supported "
            f"for {spec.model_type} (revert_fused_lce(model) to train without the fused loss)"
        )
    return loss_func(
        router_logits, getattr(model, spec.moe.num_experts), getattr(model, spec.moe.top_k), attention_mask
    )


def make_forward(original: Any, spec: ArchSpec) -> Any:
    """A patched ``forward`` for the unbound ``original`` (the class's own forward), keeping its signature."""
    signature = inspect.signature(original)
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if var_kw is None:
        raise TypeError(f"lce_patch: {original.__qualname__} takes no **kwargs; cannot patch it")
    var_pos = next((p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    output_class = _output_class(original, spec)
    output_fields = [f.name for f in dataclasses.fields(output_class)]

    @functools.wraps(original)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        skip_logits = kwargs.pop("skip_logits", None)
        options: LCEOptions | None = getattr(self, OPTIONS_ATTR, None)
        arguments = signature.bind(self, *args, **kwargs).arguments
        # One flat name -> value view of the call, whether a name is a parameter or went into **kwargs.
        call = {k: v for k, v in arguments.items() if k not in ("self", var_kw, var_pos)}
        call.update(arguments.get(var_kw, {}))
        logits_to_keep = call.get("logits_to_keep", 0)
        if skip_logits is None:
            skip_logits = self.training or (options is not None and not options.return_logits_in_eval)
        fuse = (
            options is not None
            and (call.get("labels") is not None or call.get("shift_labels") is not None)
            and isinstance(logits_to_keep, int)
            and logits_to_keep == 0
            and not arguments.get(var_pos)  # positional extras cannot be mapped onto the decoder's parameters
        )
        if not fuse:
            previous = self.__dict__.get(PREVIOUS_FORWARD_ATTR)
            return previous(*args, **kwargs) if previous is not None else original(self, *args, **kwargs)
        return _fused_forward(self, spec, options, output_class, output_fields, call, not skip_logits)

    setattr(forward, ORIGINAL_ATTR, original)
    return forward


def _fused_forward(
    model,
    spec: ArchSpec,
    options: LCEOptions,
    output_class: type,
    output_fields: list[str],
    call: dict[str, Any],
    want_logits: bool,
):
    return_dict = call.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    labels = call.pop("labels", None)
    call.pop("logits_to_keep", None)
    decoder_kwargs = dict(call)  # like Hugging Face's forwards, loss kwargs reach the decoder too
    output_router_logits = False
    if spec.moe is not None:
        output_router_logits = call.get("output_router_logits")
        if output_router_logits is None:
            output_router_logits = getattr(model.config, "output_router_logits", False)
        decoder_kwargs["output_router_logits"] = output_router_logits
    if spec.decoder_gets_labels:
        decoder_kwargs["labels"] = labels
    decoder_kwargs.update(spec.decoder_extra_kwargs)

    shift_labels = call.get("shift_labels")
    read_valid_count = None
    if options.skip_ignored and not torch.compiler.is_compiling():
        # Counted before the decoder is queued, read after: the loss then skips ignored tokens
        # without waiting for the forward to finish (see start_valid_token_count). Under
        # torch.compile reading the count would break the graph: the op counts inside its operator.
        targets = shift_labels if shift_labels is not None else labels
        ignore_index = call.get("ignore_index", options.ignore_index)
        read_valid_count = start_valid_token_count(targets, ignore_index, shift=shift_labels is None)

    outputs = getattr(model, spec.decoder)(**decoder_kwargs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    num_valid_tokens = read_valid_count() if read_valid_count is not None else None
    loss = fused_causal_lm_loss(model, spec, hidden, labels, shift_labels, call, options, num_valid_tokens)

    logits = None
    if want_logits:
        logits = spec.transform_logits(getattr(model, spec.head)(hidden), model.config)

    aux_loss = None
    if output_router_logits:
        aux_loss = _moe_aux_loss(model, spec, outputs.router_logits, call.get("attention_mask"))
        # As Hugging Face: the aux term joins the loss whenever a loss is computed.
        loss = loss + getattr(model, spec.moe.coef) * aux_loss.to(loss.device)

    values = {"loss": loss, "logits": logits, "aux_loss": aux_loss}
    fields = {}
    for name in output_fields:
        fields[name] = values[name] if name in values else getattr(outputs, name, None)
    result = output_class(**fields)
    return result if return_dict else result.to_tuple()
