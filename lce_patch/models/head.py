"""Reaching the LM head the way distributed wrappers expect: through the module call.

FSDP1, FSDP2 and DeepSpeed ZeRO-3 gather a module's parameters in its forward hooks and arm their
backward hooks on its outputs. :func:`head_call` therefore runs the fused loss *inside*
``lm_head(...)``, by redirecting the head module's ``forward`` for the duration of one call, instead
of reading ``lm_head.weight`` behind the wrappers' back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .adapters import fsdp1_inner, head_leaves, head_operands, resolve_head_module


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
    inner = fsdp1_inner(module)

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


class _ThreadState(threading.local):
    def __init__(self) -> None:  # run in each thread at its first use
        # Both present from the start: a first call that added them would fail, once, the guard torch.compile
        # put on their absence when it traced that call (one more compile of the whole model).
        self.job: Any = None
        self.logits_loss: Any = None


class JobSlot:
    """The armed job of one patched model, per thread (None when idle). Shared, not copied, by ``deepcopy``.

    A job lives for the length of one forward, in the thread that runs it: a model called from several
    threads at once (serving, threaded evaluation, ``nn.DataParallel``'s replicas, which share their
    modules' attributes) arms one job per thread. Deep copies of a patched model (a TRL reference model,
    PEFT's ``modules_to_save`` copies of the head) keep one slot with the original, which keeps every
    copy of the head reachable from the forward that arms it. A pickled slot comes back empty.
    """

    def __init__(self) -> None:
        self._local = _ThreadState()
        self.warned: set[str] = set()  # one-time warnings already given for this model

    @property
    def job(self) -> Any:
        return self._local.job

    @job.setter
    def job(self, job: Any) -> None:
        self._local.job = job

    @property
    def logits_loss(self) -> Any:
        """The loss the model's ``loss_function`` computes from the logits during an unfused call that has loss
        options the model's own loss lacks (``forward.LogitsLoss``), in this thread; None otherwise."""
        return self._local.logits_loss

    @logits_loss.setter
    def logits_loss(self, loss: Any) -> None:
        self._local.logits_loss = loss

    def __deepcopy__(self, memo: dict) -> JobSlot:
        return self

    def __reduce__(self) -> tuple:
        return (JobSlot, ())


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
