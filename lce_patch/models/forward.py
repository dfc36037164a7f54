"""The one forward shared by every architecture: the model's own, with the head and loss intercepted.

``make_forward(original)`` returns a replacement for a CausalLM's ``forward`` that keeps the
original's signature (``generate()`` and PEFT inspect it). A call that carries labels (or
``shift_labels``) and does not want the logits arms a :class:`LossJob` on the model's job slot and
runs the original forward unchanged: the decoder, the vision tower, the MoE router and its
auxiliary loss all stay the model's. Only two things differ while the job is armed:

- the LM head module (``head.py``'s interceptor) computes the fused linear cross-entropy from the
  hidden states it is called with, inside its own call, and returns a zero-width stand-in for the
  logits ``[..., 0]`` that carries the loss's autograd graph through the model's logit transforms;
- the model's ``loss_function`` returns that loss (plus the empty sum of a zero-width slice of its
  logits argument, which ties the head's output, and so the backward hooks FSDP and ZeRO-3 put on
  it, into the loss's graph).

Evaluation that wants the logits (``return_logits_in_eval``) gets the head's real output as the
logits and the fused loss. Every other call (no labels, ``logits_to_keep``) is the original forward.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.linear_cross_entropy.functional import fused_linear_cross_entropy, start_valid_token_count
from ..ops.linear_cross_entropy.vocab_parallel import is_dtensor
from .head import SLOT_ATTR, JobSlot, install_interceptor, resolve_head_module
from .registry import HeadConfig

# Marks a patched forward; holds the forward it replaced.
ORIGINAL_ATTR = "__lce_patch_original__"
# Instance attributes written by apply_fused_lce.
OPTIONS_ATTR = "_lce_patch_options"
SPEC_ATTR = "_lce_patch_spec"
PREVIOUS_FORWARD_ATTR = "_lce_patch_previous_forward"
PREVIOUS_LOSS_ATTR = "_lce_patch_previous_loss_function"

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


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The head's logits; for a vocab-sharded DTensor weight (tensor parallelism) gathered whole on every
    rank, as transformers' ``colwise_gather_output`` head returns them."""
    if not is_dtensor(weight):
        return torch.nn.functional.linear(hidden, weight, bias)
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(
            hidden, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim, run_check=False
        )
    return torch.nn.functional.linear(hidden, weight, bias).full_tensor()


def _default_loss_function(model: torch.nn.Module) -> Any:
    """What ``model.loss_function`` is without an instance override (Hugging Face's property, minus the warning)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) or LOSS_MAPPING["ForCausalLM"]


class LossJob:
    """One fused forward: what the head computes when called, and what ``loss_function`` returns."""

    def __init__(
        self,
        model: torch.nn.Module,
        head_config: HeadConfig,
        options: LCEOptions,
        call: dict[str, Any],
        want_logits: bool = False,
    ) -> None:
        self.model_name = type(model).__name__
        self.head_config = head_config
        self.options = options
        self.want_logits = want_logits
        self.labels = call.get("labels")
        self.shift_labels = call.get("shift_labels")
        self.ignore_index = call.get("ignore_index", options.ignore_index)
        self.num_items_in_batch = call.get("num_items_in_batch")
        self.loss: torch.Tensor | None = None
        self.returned = False
        self.read_valid_count = None
        if options.skip_ignored and not torch.compiler.is_compiling():
            # Counted before the decoder is queued, read in the head's call: the loss then skips
            # ignored tokens without waiting for the forward to finish (see start_valid_token_count).
            # Under torch.compile reading the count would break the graph: the op counts inside.
            targets, shift = self._targets()
            self.read_valid_count = start_valid_token_count(targets, self.ignore_index, shift=shift)

    def _targets(self) -> tuple[torch.Tensor, bool]:
        return (self.shift_labels, False) if self.shift_labels is not None else (self.labels, True)

    def run_head(self, weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
        """The head's output while armed: the fused loss, behind a zero-width stand-in for the logits."""
        if self.loss is not None:
            raise RuntimeError(
                f"lce_patch: {self.model_name}'s LM head was called twice in one forward; the fused loss supports "
                "a forward that projects the hidden states once (revert_fused_lce(model) to train this model)"
            )
        targets, shift = self._targets()
        num_valid_tokens = self.read_valid_count() if self.read_valid_count is not None else None
        self.loss = fused_linear_cross_entropy(
            hidden,
            weight,
            targets.to(hidden.device),
            bias=bias,
            ignore_index=self.ignore_index,
            softcap=self.head_config.softcap,
            logit_scale=self.head_config.logit_scale,
            shift=shift,
            num_items_in_batch=self.num_items_in_batch,
            label_smoothing=self.options.label_smoothing,
            z_loss=self.options.z_loss,
            backend=self.options.backend,
            chunk_size=self.options.chunk_size,
            deterministic=self.options.deterministic,
            skip_ignored=self.options.skip_ignored and num_valid_tokens is None,
            num_valid_tokens=num_valid_tokens,
        )
        if self.want_logits:  # evaluation that keeps the logits: the head's real output, the loss still fused
            return _head_logits(hidden, weight, bias)
        return self.loss.expand(*hidden.shape[:-1], 0)

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor | None = None, *args: Any, **kwargs: Any):
        """Stands in for the model's ``loss_function``: the fused loss, tied to the head's output."""
        if self.loss is None or self.returned:
            raise RuntimeError(
                f"lce_patch: {self.model_name}'s forward computed a loss "
                + ("twice" if self.returned else "without calling its LM head first")
                + "; the fused loss cannot reproduce it (revert_fused_lce(model) to train this model)"
            )
        expected = self.shift_labels if self.shift_labels is not None else self.labels
        given = kwargs.get("shift_labels") if self.shift_labels is not None else labels
        moved = isinstance(given, torch.Tensor) and given.shape == expected.shape and given.device != expected.device
        if given is not expected and not moved:
            raise RuntimeError(
                f"lce_patch: {self.model_name}'s forward passed its loss_function other labels than the ones it was "
                "called with; the fused loss, computed in the LM head's call, cannot know them "
                "(revert_fused_lce(model) to train this model)"
            )
        self.returned = True
        return self.loss + logits.narrow(-1, 0, 0).sum().to(self.loss.dtype)


def ensure_slot(model: torch.nn.Module) -> JobSlot:
    """The model's job slot, installing the head interceptor and the loss_function stand-in on first use."""
    head = model.get_output_embeddings()
    resolve_head_module(head)  # a LoRA layer put on the head after patching is refused, not skipped
    slot = model.__dict__.get(SLOT_ATTR)
    if slot is None:
        slot = JobSlot()
        model.__dict__[SLOT_ATTR] = slot
        install_interceptor(head, slot)
        model.__dict__[PREVIOUS_LOSS_ATTR] = model.__dict__.get("_loss_function")
        default = model.__dict__[PREVIOUS_LOSS_ATTR] or _default_loss_function(model)
        model._loss_function = functools.partial(_slot_loss_function, slot, default)
    else:
        install_interceptor(head, slot)  # FSDP or PEFT may have replaced the head since
    return slot


def _slot_loss_function(slot: JobSlot, default: Any, *args: Any, **kwargs: Any) -> Any:
    job = slot.job
    if job is None:
        return default(*args, **kwargs)
    return job.loss_function(*args, **kwargs)


def make_forward(original: Any, head_config_of: Any) -> Any:
    """A patched ``forward`` for the unbound ``original`` (the class's own forward), keeping its signature.

    ``head_config_of(model)`` gives the head's :class:`HeadConfig`.
    """
    signature = inspect.signature(original)
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if var_kw is None:
        raise TypeError(f"lce_patch: {original.__qualname__} takes no **kwargs; cannot patch it")

    @functools.wraps(original)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        skip_logits = kwargs.pop("skip_logits", None)
        options: LCEOptions | None = getattr(self, OPTIONS_ATTR, None)
        previous = self.__dict__.get(PREVIOUS_FORWARD_ATTR)
        call_original = (
            functools.partial(previous, *args) if previous is not None else functools.partial(original, self, *args)
        )
        if options is None:
            return call_original(**kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        # One flat name -> value view of the call, whether a name is a parameter or went into **kwargs.
        call = {k: v for k, v in arguments.items() if k not in ("self", var_kw)}
        call.update(arguments.get(var_kw, {}))
        if skip_logits is None:
            skip_logits = self.training or not options.return_logits_in_eval
        logits_to_keep = call.get("logits_to_keep", 0)
        fuse = (
            (call.get("labels") is not None or call.get("shift_labels") is not None)
            and isinstance(logits_to_keep, int)
            and logits_to_keep == 0
        )
        if not fuse:
            return call_original(**kwargs)
        slot = ensure_slot(self)
        if slot.job is not None:
            raise RuntimeError(f"lce_patch: {type(self).__name__}'s forward re-entered itself; not supported")
        job = LossJob(self, head_config_of(self), options, call, want_logits=not skip_logits)
        slot.job = job
        try:
            outputs = call_original(**kwargs)
        except Exception as err:
            if job.loss is not None and not job.returned:  # it used the zero-width stand-in as logits
                raise _loss_outside_loss_function(self) from err
            raise
        finally:
            slot.job = None
        if not job.returned:
            raise _loss_outside_loss_function(self)
        return outputs if job.want_logits else _without_stand_in(outputs)

    setattr(forward, ORIGINAL_ATTR, original)
    return forward


def _loss_outside_loss_function(model: torch.nn.Module) -> RuntimeError:
    return RuntimeError(
        f"lce_patch: {type(model).__name__}'s forward did not compute its loss through self.loss_function; the "
        "fused loss cannot stand in for it (revert_fused_lce(model) to train this model)"
    )


def _without_stand_in(outputs: Any) -> Any:
    """The model's outputs with the zero-width logits stand-in dropped (``logits=None``)."""
    if isinstance(outputs, tuple):
        return tuple(v for v in outputs if not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[-1] == 0))
    if "logits" in outputs.keys():
        fields = {k: v for k, v in outputs.items() if k != "logits"}
        return type(outputs)(**fields)
    return outputs
