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

Evaluation gets the head's real output as the logits, beside the fused loss, as the unpatched model
returns them, unless the caller says it needs the loss only (``return_logits_in_eval=False``,
``skip_logits=True``, or :func:`loss_only`, which ``FusedLCECallback`` uses around the Trainer's
loss-only evaluation steps). A call with ``logits_to_keep`` and labels of the kept positions (as ms-swift makes)
fuses the loss over those positions; a call without ``labels`` is the original forward.

The loss options Hugging Face's loss lacks (``loss_options.py``): a call's ``token_weights`` (taken out of the
call here, so the model never sees them) and the model's ``class_weights`` reach the op; ``return_lse`` and
``return_token_accuracy`` and ``return_predicted_tokens`` add the op's ``lse``, ``token_accuracy`` and
``predicted_tokens`` to the output. A call with labels that
runs unfused while any of them is in effect computes that same loss from the logits (``LogitsLoss``).

Where the fused loss cannot stand in for what the user set up on the model, a call runs the original,
unfused forward and warns once per model, saying why (``fallback.py``'s :func:`unfused_reason`): a custom
``loss_function``, a forward hook on the LM head or on the model's output, or, under a class patch, a
subclass that overrides ``forward``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ..ops.linear_cross_entropy import fused_linear_cross_entropy, is_dtensor, start_valid_token_count
from .adapters import resolve_head_module
from .fallback import unfused_reason, warn_unfused
from .head import SLOT_ATTR, JobSlot, install_interceptor
from .loss_options import LogitsLoss, check_token_weights, op_class_weights, op_token_weights, with_loss_outputs
from .options import OPTIONS_ATTR, LCEOptions
from .registry import HeadConfig

# Marks a patched forward; holds the forward it replaced.
ORIGINAL_ATTR = "__lce_patch_original__"
# Instance attributes written by apply_fused_lce (OPTIONS_ATTR, in options.py, holds its LCEOptions).
SPEC_ATTR = "_lce_patch_spec"
PREVIOUS_FORWARD_ATTR = "_lce_patch_previous_forward"


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


def _config_vocab_size(model: torch.nn.Module) -> int | None:
    """The vocabulary size the model's (decoder text) config names, or None."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return size if isinstance(size, int) else None


def _check_whole_head(weight: torch.Tensor, vocab_size: int | None, model_name: str) -> None:
    """Refuse a head weight that is a plain local shard of the vocabulary (tensor parallelism outside DTensor).

    A weight with at most half the config's vocabulary rows is one rank's part of the head: the loss over it
    would drop every label the rank does not hold. (Some models' heads are slightly smaller than their
    config's vocabulary; none is half of it.) A DTensor's shape is the whole head's; the op shards it itself.
    Shapes only: no device work.
    """
    if vocab_size is None or is_dtensor(weight):
        return
    rows = weight.shape[0]
    if 0 < rows <= -(-vocab_size // 2):
        raise RuntimeError(
            f"lce_patch: {model_name}'s LM head weight has {rows} rows for a vocabulary of {vocab_size}: a plain "
            "local shard of the head (tensor parallelism outside DTensor, e.g. DeepSpeed AutoTP), over which the "
            "fused loss would cover one rank's part of the vocabulary. Use transformers' tensor parallelism "
            "(from_pretrained(..., distributed_config=DistributedConfig(tp_size=N)): the head becomes a "
            "vocab-sharded DTensor, which the fused loss reads), keep the head whole on every rank, or call "
            "fused_linear_cross_entropy(..., vocab_shard=VocabShard(start, total, group)) on your own shard."
        )


class LossJob:
    """One fused forward: what the head computes when called, and what ``loss_function`` returns."""

    def __init__(
        self,
        model: torch.nn.Module,
        head_config: HeadConfig,
        options: LCEOptions,
        call: dict[str, Any],
        want_logits: bool = False,
        token_weights: torch.Tensor | None = None,
    ) -> None:
        self.model_name = type(model).__name__
        self.vocab_size = _config_vocab_size(model)
        self.head_config = head_config
        self.options = options
        self.want_logits = want_logits
        self.token_weights = token_weights  # the labels' (or shift_labels') shape, checked by the forward
        self.labels = call.get("labels")
        self.shift_labels = call.get("shift_labels")
        self.ignore_index = call.get("ignore_index", options.ignore_index)
        self.num_items_in_batch = call.get("num_items_in_batch")
        self.loss: torch.Tensor | None = None
        self.extras: dict[str, torch.Tensor] = {}  # the extra outputs the options ask for, by name
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

    def run_head(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        hidden: torch.Tensor,
        low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The head's output while armed: the fused loss, behind a zero-width stand-in for the logits.
        ``low_rank``: a LoRA adapter's term on the head (``head.head_operands``)."""
        if self.loss is not None:
            raise RuntimeError(
                f"lce_patch: {self.model_name}'s LM head was called twice in one forward; the fused loss supports "
                "a forward that projects the hidden states once (revert_fused_lce(model) to train this model)"
            )
        _check_whole_head(weight, self.vocab_size, self.model_name)
        targets, shift = self._targets()
        if tuple(targets.shape) != tuple(hidden.shape[:-1]):
            name = "shift_labels" if self.shift_labels is not None else "labels"
            raise ValueError(
                f"lce_patch: {self.model_name}'s LM head scores {tuple(hidden.shape[:-1])} positions but the call's "
                f"{name} are {tuple(targets.shape)}: a call with logits_to_keep must pass the labels of the kept "
                "positions only (the unpatched model's loss fails on these shapes too)"
            )
        num_valid_tokens = self.read_valid_count() if self.read_valid_count is not None else None
        options = self.options
        token_weights = None
        if self.token_weights is not None:
            token_weights = op_token_weights(self.token_weights, shift, hidden.device)
        # the model's options and the call's, as the op's one options object: a call's ignore_index wins, a count
        # taken already skips
        op_options = options.op_options(
            ignore_index=self.ignore_index,
            skip_ignored=options.skip_ignored and num_valid_tokens is None,
            softcap=self.head_config.softcap,
            logit_scale=self.head_config.logit_scale,
            shift=shift,
            num_valid_tokens=num_valid_tokens,
        )
        loss = fused_linear_cross_entropy(
            hidden,
            weight,
            targets.to(hidden.device),
            options=op_options,
            bias=bias,
            num_items_in_batch=self.num_items_in_batch,
            low_rank_hidden=low_rank[0] if low_rank is not None else None,
            low_rank_weight=low_rank[1] if low_rank is not None else None,
            class_weights=op_class_weights(options, hidden),
            token_weights=token_weights,
        )
        if options.returns_extras:
            self.extras = {name: getattr(loss, name) for name in options.extra_outputs}
            if "predicted_tokens" in self.extras:  # an ignored position's argmax only where the op computed it
                valid = targets[..., 1:] if shift else targets
                valid = torch.nn.functional.pad(valid, (0, 1), value=self.ignore_index) if shift else valid
                predicted = self.extras["predicted_tokens"]
                self.extras["predicted_tokens"] = torch.where(valid != self.ignore_index, predicted, self.ignore_index)
            loss = loss.loss
        self.loss = self._as_hugging_face(loss, targets, shift, num_valid_tokens)
        if self.want_logits:  # evaluation that keeps the logits: the head's real output, the loss still fused
            logits = _head_logits(hidden, weight, bias)
            if low_rank is not None:  # as PEFT adds it: in the adapter's dtype, then back to the head's
                logits = (logits + low_rank[0] @ low_rank[1].t()).to(logits.dtype)
            return logits
        return self.loss.expand(*hidden.shape[:-1], 0)

    def _as_hugging_face(
        self, loss: torch.Tensor, targets: torch.Tensor, shift: bool, num_valid_tokens: int | None
    ) -> torch.Tensor:
        """The op's loss as Hugging Face's loss returns it: float32 (its loss upcasts the logits with
        ``.float()``, also a float64 model's), and NaN for a batch whose labels are all ignored, its mean
        over no token, or ``0 / num_items_in_batch`` for a count of 0 (the Trainer's evaluation passes
        the batch's own count); the op gives 0 for both. Gradients stay the op's zeros, so no NaN reaches
        the weights through this term."""
        loss = loss.float()
        num_items = self.num_items_in_batch
        if isinstance(num_items, torch.Tensor):
            return _nan_where(loss, num_items.reshape(()) == 0)
        if num_items is not None:
            return loss if num_items != 0 else loss + torch.nan  # the gradient passes through unchanged
        if num_valid_tokens is not None:  # counted on the host already: no device work
            return loss if num_valid_tokens > 0 else loss + torch.nan
        valid = (targets[..., 1:] if shift else targets) != self.ignore_index
        return _nan_where(loss, valid.sum() == 0)

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


def _nan_where(loss: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    return torch.where(condition.to(loss.device), torch.nan, loss)


_SLOT_LOCK = threading.Lock()


class LossFunctionStandIn:
    """A patched model's ``loss_function``: the fused loss while a job is armed in this thread, else the
    function it replaced (``previous``; None: ``default``, Hugging Face's for the model). Picklable."""

    def __init__(self, slot: JobSlot, previous: Any, default: Any) -> None:
        self.slot = slot
        self.previous = previous
        self.default = default

    @property
    def __signature__(self) -> inspect.Signature:
        # the replaced function's: trainers read it (axolotl checks it for num_items_in_batch to decide how the
        # loss is averaged under gradient accumulation), and the fused loss takes what that function takes
        return inspect.signature(self.previous or self.default)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        slot = self.slot
        job = slot.job
        if job is not None:
            return job.loss_function(*args, **kwargs)
        function = self.previous or self.default
        logits_loss = slot.logits_loss
        if logits_loss is not None:  # an unfused call with loss options the model's own loss lacks
            return logits_loss(function, *args, **kwargs)
        return function(*args, **kwargs)


def ensure_slot(model: torch.nn.Module) -> JobSlot:
    """The model's job slot, installing the head interceptor and the ``loss_function`` stand-in where they
    are missing (first use, a head replaced by FSDP, PEFT or ``resize_token_embeddings``, a
    ``loss_function`` set after patching). Safe to call from several threads."""
    head = model.get_output_embeddings()
    # an adapter the op cannot compute (DoRA, ...), put on the head after patching, is refused here
    resolve_head_module(head)
    slot = model.__dict__.get(SLOT_ATTR)
    if slot is None:
        with _SLOT_LOCK:
            slot = model.__dict__.get(SLOT_ATTR)
            if slot is None:
                slot = JobSlot()
                model.__dict__[SLOT_ATTR] = slot
    install_interceptor(head, slot)  # idempotent; writes nothing once installed
    current = model.__dict__.get("_loss_function")
    if not (isinstance(current, LossFunctionStandIn) and current.slot is slot):
        model.__dict__["_loss_function"] = LossFunctionStandIn(slot, current, _default_loss_function(model))
    return slot


def _user_loss_function(model: torch.nn.Module) -> Any:
    """The ``loss_function`` the user gave the model (before or after patching), or None for the default."""
    current = model.__dict__.get("_loss_function")
    return current.previous if isinstance(current, LossFunctionStandIn) else current


# --- Whether an evaluation call returns the logits --------------------------------------------------------

_EVAL_STATE = threading.local()


@contextlib.contextmanager
def loss_only(enabled: bool = True) -> Iterator[None]:
    """Within this context (in this thread), patched models in evaluation return the fused loss without the
    logits, unless their ``return_logits_in_eval`` is True or a call passes ``skip_logits=False``.
    ``FusedLCECallback`` uses it around the Trainer's evaluation steps that need the loss only."""
    previous = getattr(_EVAL_STATE, "loss_only", False)
    _EVAL_STATE.loss_only = enabled
    try:
        yield
    finally:
        _EVAL_STATE.loss_only = previous


def _wants_logits(model: torch.nn.Module, options: LCEOptions, skip_logits: bool | None) -> bool:
    if skip_logits is not None:
        return not skip_logits
    if model.training:
        return False
    if options.return_logits_in_eval is not None:
        return options.return_logits_in_eval
    return not getattr(_EVAL_STATE, "loss_only", False)


# --- The patched forward ----------------------------------------------------------------------------------


def make_forward(original: Any, head_config_of: Any) -> Any:
    """A patched ``forward`` for the unbound ``original`` (the class's own forward), keeping its signature.

    ``head_config_of(model)`` gives the head's :class:`HeadConfig`. The result carries the original's
    name and ``__signature__`` but no ``__wrapped__``: wrappers that unwind ``__wrapped__`` chains
    (accelerate's ``unwrap_model``) stop at it instead of at the unpatched forward.
    """
    signature = inspect.signature(original)
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if var_kw is None:
        raise TypeError(f"lce_patch: {original.__qualname__} takes no **kwargs; cannot patch it")

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
        token_weights = call.pop("token_weights", None)
        kwargs.pop("token_weights", None)  # ours: the model's forward never sees it
        # Hugging Face computes a loss only when ``labels`` are given (``shift_labels`` alone: logits, no loss).
        # A call with ``logits_to_keep`` (or ``num_logits_to_keep``) scores the kept positions only, against
        # labels of their length: the head sees those positions' hidden states, so the fused loss covers
        # exactly them (``LossJob.run_head`` refuses labels of another length, as the unpatched loss fails).
        if token_weights is not None:
            _check_call_token_weights(token_weights, call)
        if call.get("labels") is None:
            return call_original(**kwargs)
        from_logits = _needs_logits_loss(options, token_weights)
        want_logits = _wants_logits(self, options, skip_logits)
        reason = unfused_reason(self, forward, want_logits, _user_loss_function(self))
        if reason is not None:
            if from_logits:
                _refuse_custom_loss_with_weights(self, options, token_weights, reason)
            warn_unfused(self, ensure_slot(self), reason)
            if from_logits:  # the loss options, from the logits its loss_function receives
                return _run_unfused(self, call_original, kwargs, options, call, token_weights)
            return call_original(**kwargs)
        slot = ensure_slot(self)
        if slot.job is not None:
            raise RuntimeError(f"lce_patch: {type(self).__name__}'s forward re-entered itself; not supported")
        job = LossJob(self, head_config_of(self), options, call, want_logits=want_logits, token_weights=token_weights)
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
        outputs = outputs if job.want_logits else _without_stand_in(outputs)
        if options.returns_extras:
            outputs = with_loss_outputs(outputs, job.extras)
        return outputs

    functools.update_wrapper(forward, original, updated=())
    del forward.__wrapped__
    forward.__signature__ = signature
    setattr(forward, ORIGINAL_ATTR, original)
    return forward


class BoundForward:
    """``model.forward`` after an instance patch: the patched forward bound to the model.

    It behaves like the bound method it stands for (``__func__``, ``__self__``, the bound signature,
    which ``generate()``, PEFT and the Trainer inspect) and, unlike a bound method, survives pickling
    (``torch.save`` of the whole model, multiprocessing) and deep copies: it is rebuilt around the new
    model from the model's class.
    """

    def __init__(self, model: torch.nn.Module, function: Any, head_config_of: Any) -> None:
        self.__self__ = model
        self.__func__ = function
        self._head_config_of = head_config_of
        functools.update_wrapper(
            self, function, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=()
        )

    @classmethod
    def of(cls, model: torch.nn.Module, head_config_of: Any) -> BoundForward:
        return cls(model, make_forward(unpatched(type(model).forward), head_config_of), head_config_of)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        parameters = list(self.__func__.__signature__.parameters.values())[1:]
        return self.__func__.__signature__.replace(parameters=parameters)

    def __reduce__(self) -> tuple:
        return (BoundForward.of, (self.__self__, self._head_config_of))


def _check_call_token_weights(token_weights: Any, call: dict[str, Any]) -> None:
    """A call's token weights: only with labels, and of the shape of the labels the loss reads."""
    if call.get("labels") is None:
        raise ValueError(
            "lce_patch: token_weights weigh the loss, which a call computes only when it is given labels; this "
            "call has none"
        )
    shift_labels = call.get("shift_labels")
    targets, name = (shift_labels, "shift_labels") if shift_labels is not None else (call["labels"], "labels")
    check_token_weights(token_weights, targets, name)


def _needs_logits_loss(options: LCEOptions, token_weights: torch.Tensor | None) -> bool:
    """Whether an unfused call's loss (or output) needs more than the model's own loss function."""
    return options.class_weights is not None or token_weights is not None or options.returns_extras


def _refuse_custom_loss_with_weights(
    model: torch.nn.Module, options: LCEOptions, token_weights: torch.Tensor | None, reason: str
) -> None:
    """An unfused call's loss is its ``loss_function``'s: a custom one cannot apply the weights."""
    user_loss = _user_loss_function(model)
    if (options.class_weights is None and token_weights is None) or user_loss is None:
        return
    from transformers.loss.loss_utils import LOSS_MAPPING

    if user_loss is not LOSS_MAPPING["ForCausalLM"]:
        raise ValueError(
            f"lce_patch: this call cannot run fused ({reason}), and its loss would then be the custom "
            "loss_function's, which cannot apply class_weights or token_weights; remove the custom "
            "loss_function (or the weights)"
        )


def _run_unfused(
    model: torch.nn.Module,
    call_original: Any,
    kwargs: dict[str, Any],
    options: LCEOptions,
    call: dict[str, Any],
    token_weights: torch.Tensor | None,
) -> Any:
    """The model's own forward, its ``loss_function`` computing the loss options from the logits (``LogitsLoss``)."""
    slot = ensure_slot(model)
    loss = LogitsLoss(options, call.get("ignore_index", options.ignore_index), token_weights)
    previous = slot.logits_loss
    slot.logits_loss = loss
    try:
        outputs = call_original(**kwargs)
    finally:
        slot.logits_loss = previous
    if not loss.called:
        raise _loss_outside_loss_function(model)
    if options.returns_extras:
        outputs = with_loss_outputs(outputs, loss.extras)
    return outputs


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
