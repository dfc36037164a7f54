"""TRL's fused-LM-head protocol (TRL >= 1.15), served by this package's op: SFT, DPO, KTO, GRPO, RLOO and the
trainers built on them.

Since TRL 1.15 every TRL trainer (SFT, DPO, GRPO, KTO, RLOO) calls ``trl.trainer.utils.add_fused_lm_head`` on the
policy, which rebinds the *instance* ``model.forward`` with TRL's ``_fused_forward``, and then calls
``model(..., fused_lm_head=True)``, reading per-token ``log_probs`` (with gradient), ``entropy``, ``is_top1`` and
``label_mask`` from a ``FusedCausalLMOutput``. A forward patch under it is bypassed on that path.

:func:`maybe_install_trl_head` finds that forward (on the model, or on the model under a PEFT wrapper, where TRL puts
it), checks that the protocol is the one this module implements, and rebinds it, on that instance only, with a
forward that answers the same calls through :func:`lce_patch.fused_linear_log_probs`. The TRL forward is kept, and
:func:`remove_trl_head` puts it back. Nothing in TRL is patched at module level.

Detection is by feature, not by version: the forward's code object is named ``_fused_forward`` and lives in a
``trl.`` module; its closure holds the variables ``add_fused_lm_head`` captures (the wrapped forward, the requested
``outputs``, ``temperature``, ...); its signature and TRL's ``FusedCausalLMOutput`` fields are the known ones. Anything
else TRL installed on the forward raises :class:`TRLProtocolError`, naming the TRL version and what is unrecognised.

As a serving module (``lce_patch.integrations.serving``, the rows served at ``"train"``), :func:`serve` serves the
fused heads on a trainer's policy and reference model, and :func:`unserve` puts TRL's back. ``FusedLCECallback``
serves them at ``on_train_begin`` (TRL installs its head after ``Trainer.__init__``); :func:`prepare`, at the end of
``Trainer.__init__``, has the reference-log-prob precompute that DPO and KTO run inside their ``__init__`` serve
them first.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from ... import ops as _ops
from ...models import LCEOptions, get_head_config, head_call, unwrap_causal_lm
from ..serving import SERVED, Row
from ..shared import IGNORE_INDEX, is_served, load_balancing_loss, log_prob_options, replace_method, restore_method
from .protocol import TRLProtocolError, trl_version

__all__ = [
    "find_trl_head",
    "install_heads",
    "is_head_served",
    "maybe_install_trl_head",
    "prepare",
    "remove_trl_head",
    "serve",
    "unserve",
]

# What `add_fused_lm_head` (TRL 1.15-1.16) closes over, and the shape of the forward it installs
_REQUIRED_FREEVARS = frozenset(
    {"original_forward", "text_config", "backbone_attr", "cast_lm_head_to_fp32", "temperature", "outputs"}
)
_KNOWN_FREEVARS = _REQUIRED_FREEVARS | {"final_logit_softcapping", "logit_scale"}
_FORWARD_PARAMS = (
    ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ("args", inspect.Parameter.VAR_POSITIONAL),
    ("fused_lm_head", inspect.Parameter.KEYWORD_ONLY),
    ("labels", inspect.Parameter.KEYWORD_ONLY),
    ("shift_labels", inspect.Parameter.KEYWORD_ONLY),
    ("num_items_in_batch", inspect.Parameter.KEYWORD_ONLY),
    ("kwargs", inspect.Parameter.VAR_KEYWORD),
)
_INSTALLER_PARAMS = ("model", "temperature", "cast_lm_head_to_fp32", "outputs")
_OUTPUT_FIELDS = (
    "loss",
    "log_probs",
    "entropy",
    "log_sum_sq_probs",
    "mean_logits",
    "is_top1",
    "label_mask",
    "aux_loss",
)
# Per-token outputs TRL can request (this module computes each of them)
_TRL_OUTPUTS = frozenset({"log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"})
_MAX_WRAPPER_DEPTH = 16
_PRECOMPUTE = "_precompute_ref_logps"  # TRL's trainer method that scores the reference model inside __init__


def _fail(what: str) -> NoReturn:
    raise TRLProtocolError(
        f"lce_patch does not recognise the fused LM head installed by TRL {trl_version()}: {what}. "
        "lce_patch implements the protocol of TRL 1.15-1.16 (`add_fused_lm_head`, `model(..., fused_lm_head=True)` "
        "-> `FusedCausalLMOutput`). Upgrade lce_patch, pin a TRL it supports, or train without FusedLCECallback "
        "(TRL's own fused head then computes the loss)."
    )


# --------------------------------------------------------------------------------------------------------------------
# Finding the forward TRL installed


def _is_trl_callable(fn: Any) -> bool:
    """Whether ``fn`` (a function or callable object) is defined in a ``trl`` module."""
    module = fn.__globals__.get("__name__", "") if inspect.isfunction(fn) else type(fn).__module__
    return module == "trl" or module.startswith("trl.")


def _is_trl_fused_forward(fn: Any) -> bool:
    return inspect.isfunction(fn) and fn.__code__.co_name == "_fused_forward" and _is_trl_callable(fn)


def _looks_like_a_trl_head(fn: Any) -> bool:
    """A TRL callable on a model's forward that speaks some fused-head protocol (named so, or taking the kwarg)."""
    if not _is_trl_callable(fn):
        return False
    name = getattr(getattr(fn, "__code__", None), "co_name", None) or getattr(fn, "__name__", type(fn).__name__)
    try:
        params = inspect.signature(fn, follow_wrapped=False).parameters
    except (TypeError, ValueError):
        params = {}
    return "fused" in name or "lm_head" in name or "fused_lm_head" in params


def _is_ours(fn: Any) -> bool:
    return inspect.isfunction(fn) and isinstance(getattr(fn, SERVED, None), _Install)


def _target(node: Any) -> Any:
    return node.__func__ if inspect.ismethod(node) else node


def _head_path(owner: torch.nn.Module) -> list[Any] | None:
    """The wrapper chain from the instance ``forward`` down to TRL's ``_fused_forward`` (or ours in its place).

    The chain follows ``__wrapped__``: when the Trainer prepared the model with mixed precision (before
    ``on_train_begin``), accelerate's fp32-output and autocast wrappers sit above TRL's forward. None when the
    instance has no such forward; raises for a TRL head this module does not recognise.
    """
    node = owner.__dict__.get("forward")
    path: list[Any] = []
    while node is not None and len(path) < _MAX_WRAPPER_DEPTH:
        path.append(node)
        target = _target(node)
        if _is_trl_fused_forward(target) or _is_ours(target):
            return path  # their own `__wrapped__` is the class forward
        if _looks_like_a_trl_head(target):
            name = getattr(getattr(target, "__code__", None), "co_name", None) or type(target).__qualname__
            module = target.__globals__.get("__name__") if inspect.isfunction(target) else type(target).__module__
            _fail(f"{type(owner).__name__}.forward is TRL's `{module}.{name}`, not the `_fused_forward` it knows")
        if _is_trl_callable(target):
            return None  # some other TRL forward (a TRL model class), not a fused head
        node = getattr(target, "__wrapped__", None)
    return None


def _candidates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model and the causal LM under it: TRL installs its head on ``peft_model.get_base_model()``."""
    seen: dict[int, torch.nn.Module] = {}

    def add(m: Any) -> None:
        if isinstance(m, torch.nn.Module):
            seen.setdefault(id(m), m)

    add(model)
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        add(get_base())
    add(getattr(model, "module", None))  # DDP / DeepSpeed engine
    add(unwrap_causal_lm(model))
    return list(seen.values())


def find_trl_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module (``model`` or the causal LM under its PEFT wrapper) whose forward is TRL's fused head, or ours in
    its place; None if there is none. Raises :class:`TRLProtocolError` for a TRL forward it does not recognise."""
    for owner in _candidates(model):
        if _head_path(owner) is not None:
            return owner
    return None


# --------------------------------------------------------------------------------------------------------------------
# Reading TRL's protocol


@dataclass(frozen=True)
class _Protocol:
    trl_function: Callable[..., Any]
    original_forward: Callable[..., Any]
    output_class: type
    text_config: Any
    backbone_attr: str
    temperature: float
    cast_lm_head_to_fp32: bool
    outputs: tuple[str, ...]
    trl_softcap: float | None
    trl_logit_scale: float | None


def _read_protocol(fn: Callable[..., Any]) -> _Protocol:
    code = fn.__code__
    freevars = dict(zip(code.co_freevars, (c.cell_contents for c in (fn.__closure__ or ())), strict=True))
    missing = sorted(_REQUIRED_FREEVARS - freevars.keys())
    unknown = sorted(freevars.keys() - _KNOWN_FREEVARS)
    if missing or unknown:
        _fail(f"its `_fused_forward` closes over {sorted(freevars)} (missing: {missing}, unrecognised: {unknown})")

    params = tuple((p.name, p.kind) for p in inspect.signature(fn, follow_wrapped=False).parameters.values())
    if params != _FORWARD_PARAMS:
        _fail(f"`_fused_forward` has signature {[n for n, _ in params]}, expected {[n for n, _ in _FORWARD_PARAMS]}")

    module_globals = fn.__globals__
    output_class = module_globals.get("FusedCausalLMOutput")
    if not (isinstance(output_class, type) and dataclasses.is_dataclass(output_class)):
        _fail(f"no `FusedCausalLMOutput` dataclass in {module_globals.get('__name__')}")
    fields = tuple(f.name for f in dataclasses.fields(output_class))
    if fields != _OUTPUT_FIELDS:
        _fail(f"`FusedCausalLMOutput` has fields {list(fields)}, expected {list(_OUTPUT_FIELDS)}")
    installer = module_globals.get("add_fused_lm_head")
    if not callable(installer):
        _fail(f"no `add_fused_lm_head` in {module_globals.get('__name__')}")
    installer_params = tuple(inspect.signature(installer).parameters)
    if installer_params != _INSTALLER_PARAMS:
        _fail(f"`add_fused_lm_head` takes {list(installer_params)}, expected {list(_INSTALLER_PARAMS)}")

    outputs = freevars["outputs"]
    if isinstance(outputs, str) or not all(isinstance(o, str) for o in outputs):
        _fail(f"requested outputs {outputs!r} are not a tuple of names")
    outputs = tuple(outputs)
    unknown_outputs = sorted(set(outputs) - _TRL_OUTPUTS)
    if unknown_outputs:
        _fail(
            f"it requests per-token outputs {unknown_outputs}, unknown to this lce_patch (known: {sorted(_TRL_OUTPUTS)})"
        )
    temperature = freevars["temperature"]
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not temperature > 0:
        _fail(f"temperature {temperature!r} is not a positive number")
    backbone_attr = freevars["backbone_attr"]
    if not isinstance(backbone_attr, str):
        _fail(f"backbone attribute {backbone_attr!r} is not a name")
    if not callable(freevars["original_forward"]):
        _fail("the forward it wrapped is not callable")
    return _Protocol(
        trl_function=fn,
        original_forward=freevars["original_forward"],
        output_class=output_class,
        text_config=freevars["text_config"],
        backbone_attr=backbone_attr,
        temperature=float(temperature),
        cast_lm_head_to_fp32=bool(freevars["cast_lm_head_to_fp32"]),
        outputs=outputs,
        trl_softcap=freevars.get("final_logit_softcapping"),
        trl_logit_scale=freevars.get("logit_scale"),
    )


# --------------------------------------------------------------------------------------------------------------------
# Our forward


@dataclass
class _Install:
    """Attached to our forward: what it replaced, to put it back."""

    protocol: _Protocol
    trl_node: Any  # TRL's forward as the chain referenced it (bound method or function)
    previous_forward: Any  # the instance forward before the install
    installed_forward: Any = None  # the instance forward the install set


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(a)))


def _make_forward(
    owner: torch.nn.Module, protocol: _Protocol, options: dict[str, Any], precompute_grad: bool = False
) -> Callable[..., Any]:
    head = get_head_config(owner)
    softcap = head.softcap
    logit_scale = 1.0 if head.logit_scale is None else float(head.logit_scale)
    trl_scale = 1.0 if protocol.trl_logit_scale is None else protocol.trl_logit_scale
    if not (_same(softcap, protocol.trl_softcap) and _same(logit_scale, trl_scale)):
        warnings.warn(
            f"lce_patch: for {type(owner).__name__}, TRL's fused head would use softcap={protocol.trl_softcap} and "
            f"logit_scale={trl_scale}, lce_patch uses softcap={softcap} and logit_scale={logit_scale} (the model's "
            "own forward); the losses will differ from TRL's.",
            stacklevel=3,
        )
    op_kwargs = log_prob_options(options)
    wanted = {
        "return_entropy": "entropy" in protocol.outputs,
        "return_is_top1": "is_top1" in protocol.outputs,
        "return_mean_logits": "mean_logits" in protocol.outputs,
        "return_log_sum_sq_probs": "log_sum_sq_probs" in protocol.outputs,
    }
    text_config = protocol.text_config
    original_forward = protocol.original_forward
    output_class = protocol.output_class
    temperature = protocol.temperature
    cast_fp32 = protocol.cast_lm_head_to_fp32

    skip_ignored = options.get("skip_ignored", LCEOptions.skip_ignored)

    def score(weight, bias, hidden, labels, num_valid_tokens=None, low_rank=None):
        # Runs inside the lm_head module call (`head_call`), where FSDP / ZeRO-3 have gathered the weight
        autocast_ctx = nullcontext()
        if cast_fp32:
            hidden, weight = hidden.float(), weight.float()
            bias = None if bias is None else bias.float()
            autocast_ctx = torch.autocast(hidden.device.type, enabled=False)
        elif not torch.is_autocast_enabled(hidden.device.type) and weight.dtype != hidden.dtype:
            # Like TRL: without autocast the projection runs in the hidden states' dtype
            weight = weight.to(hidden.dtype)
            bias = None if bias is None else bias.to(hidden.dtype)
        with autocast_ctx:
            return _ops.fused_linear_log_probs(
                hidden,
                weight,
                labels,
                bias=bias,
                ignore_index=IGNORE_INDEX,
                softcap=softcap,
                logit_scale=logit_scale,
                temperature=temperature,
                **wanted,
                skip_ignored=skip_ignored and num_valid_tokens is None,
                num_valid_tokens=num_valid_tokens,
                precompute_grad=precompute_grad,
                low_rank_hidden=low_rank[0] if low_rank is not None else None,
                low_rank_weight=low_rank[1] if low_rank is not None else None,
                **op_kwargs,
            )

    @functools.wraps(type(owner).forward)  # keeps the signature `generate` validates its kwargs against
    def _lce_fused_forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
    ):
        if not fused_lm_head:
            if labels is not None:
                kwargs["labels"] = labels
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return original_forward(*args, **kwargs)
        if labels is None and shift_labels is None:
            raise ValueError("lce_patch: model(..., fused_lm_head=True) needs `labels` or `shift_labels`")

        read_valid_count = None
        # Counted before the backbone is queued, read after it (no pipeline stall); under torch.compile
        # the op counts inside its operator instead (reading the count here would break the graph).
        if skip_ignored and not torch.compiler.is_compiling():
            targets = labels if shift_labels is None else shift_labels
            read_valid_count = _ops.start_valid_token_count(targets, IGNORE_INDEX, shift=shift_labels is None)
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone_outputs = getattr(self, protocol.backbone_attr)(*args, **kwargs)
        hidden = backbone_outputs.last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        lm_head = self.get_output_embeddings()  # looked up per call: FSDP and PEFT replace it after patching
        device = lm_head.weight.device
        num_valid_tokens = read_valid_count() if read_valid_count is not None else None
        per_token = head_call(lm_head, score, hidden.to(device), labels.to(device), num_valid_tokens, low_rank=True)
        log_probs, mask = per_token.log_probs, per_token.label_mask
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / denominator

        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = load_balancing_loss(self, text_config, backbone_outputs, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return output_class(
            loss=loss,
            log_probs=log_probs,
            entropy=per_token.entropy,
            log_sum_sq_probs=per_token.log_sum_sq_probs,
            mean_logits=per_token.mean_logits,
            is_top1=per_token.is_top1,
            label_mask=mask,
            aux_loss=aux_loss,
        )

    return _lce_fused_forward


# --------------------------------------------------------------------------------------------------------------------
# Installing and removing


def _clone_replacing(node: Any, old: Any, new: Any) -> Any:
    """A copy of the wrapper ``node`` that calls ``new`` where it called ``old`` (``node`` itself is untouched, since
    wrappers can be shared, e.g. by a deep copy of the model)."""
    if inspect.ismethod(node):
        return types.MethodType(_clone_replacing(node.__func__, old, new), node.__self__)
    replaced = False
    if inspect.isfunction(node):
        cells = []
        for cell in node.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                contents = None
            if contents is old:
                cells.append(types.CellType(new))
                replaced = True
            else:
                cells.append(cell)
        clone = types.FunctionType(
            node.__code__, node.__globals__, node.__name__, node.__defaults__, tuple(cells) if cells else None
        )
        clone.__kwdefaults__ = node.__kwdefaults__
        clone.__qualname__ = node.__qualname__
        clone.__doc__ = node.__doc__
        clone.__module__ = node.__module__
    else:
        try:
            clone = object.__new__(type(node))
        except TypeError:
            clone = None
        if clone is None or not hasattr(node, "__dict__") or not hasattr(clone, "__dict__"):
            _fail(f"its forward sits under a wrapper ({type(node).__qualname__}) that lce_patch cannot copy")
    clone.__dict__.update(node.__dict__)
    for name, value in list(clone.__dict__.items()):
        if value is old and name != "__wrapped__":
            setattr(clone, name, new)
            replaced = True
    if not replaced:
        what = getattr(node, "__qualname__", type(node).__qualname__)
        _fail(f"its forward sits under a wrapper ({what}) that does not hold it where lce_patch can see it")
    if clone.__dict__.get("__wrapped__") is old:
        clone.__wrapped__ = new
    return clone


def _rebuilt(path: list[Any], function: Callable[..., Any]) -> Any:
    """The instance forward of ``path`` with its last node's function replaced by ``function``."""
    last = path[-1]
    new = types.MethodType(function, last.__self__) if inspect.ismethod(last) else function
    for node, old in zip(reversed(path[:-1]), reversed(path[1:]), strict=True):
        new = _clone_replacing(node, old, new)
    return new


def _set_forward(owner: torch.nn.Module, new_top: Any, old_last: Any, new_last: Any) -> None:
    owner.forward = new_top
    # accelerate keeps the pre-autocast forward, restored by `unwrap_model(keep_fp32_wrapper=False)`
    if "_original_forward" in owner.__dict__ and owner.__dict__["_original_forward"] == old_last:
        owner._original_forward = new_last


def maybe_install_trl_head(
    model: torch.nn.Module, options: dict[str, Any] | None = None, precompute_grad: bool = False
) -> bool:
    """Serve TRL's fused LM head with lce_patch's op, if TRL installed one on ``model``.

    Looks at ``model`` and at the causal LM under a PEFT wrapper. When TRL's ``_fused_forward`` (TRL >= 1.15) is that
    instance's forward, possibly under accelerate's mixed-precision wrappers, it is replaced, on the instance only,
    by a forward with the same protocol: ``fused_lm_head=False`` calls the forward TRL wrapped;
    ``fused_lm_head=True`` runs the backbone and returns TRL's ``FusedCausalLMOutput`` computed by
    :func:`lce_patch.fused_linear_log_probs` inside the ``lm_head`` module call. Idempotent.

    Args:
        model: the trainer's model (a ``PreTrainedModel``, or a PEFT model around one).
        options: ``apply_fused_lce`` options; ``backend``, ``chunk_size`` and ``skip_ignored`` reach the op.
            ``label_smoothing``, ``z_loss`` and ``ignore_index`` must be neutral: TRL's loss is the plain NLL.
        precompute_grad: the trainer reduces ``log_probs`` with one weight per token (SFT's ``loss_type="nll"``):
            compute that gradient in the forward (see :func:`lce_patch.fused_linear_log_probs`).

    Returns:
        True if TRL's head is (now) served by lce_patch, False if TRL has no fused head on this model.

    Raises:
        TRLProtocolError: TRL installed a head whose protocol is not the one implemented here (an unknown TRL
            version, or a per-token output this version does not know).
    """
    options = dict(options or {})
    installed = False
    for owner in _candidates(model):
        path = _head_path(owner)
        if path is None:
            continue
        installed = True
        trl_node = path[-1]
        if _is_ours(_target(trl_node)):
            continue
        protocol = _read_protocol(_target(trl_node))
        ours = _make_forward(owner, protocol, options, precompute_grad)
        record = _Install(protocol, trl_node=trl_node, previous_forward=path[0])
        setattr(ours, SERVED, record)
        new_top = _rebuilt(path, ours)
        record.installed_forward = new_top
        our_node = types.MethodType(ours, trl_node.__self__) if inspect.ismethod(trl_node) else ours
        _set_forward(owner, new_top, trl_node, our_node)
    return installed


def is_head_served(model: torch.nn.Module) -> bool:
    """Whether the fused head on ``model`` (or on the causal LM under its PEFT wrapper) is lce_patch's; False where
    it is TRL's own or there is none."""
    for owner in _candidates(model):
        path = _head_path(owner)
        if path is not None:
            return _is_ours(_target(path[-1]))
    return False


def remove_trl_head(model: torch.nn.Module) -> bool:
    """Put TRL's own fused forward back where :func:`maybe_install_trl_head` replaced it. Returns whether it did."""
    removed = False
    for owner in _candidates(model):
        path = _head_path(owner)
        if path is None or not _is_ours(_target(path[-1])):
            continue
        record: _Install = getattr(_target(path[-1]), SERVED)
        # exactly what was there, unless something wrapped the forward since; then swap the innermost node only
        new_top = record.previous_forward if path[0] is record.installed_forward else _rebuilt(path, record.trl_node)
        _set_forward(owner, new_top, path[-1], record.trl_node)
        removed = True
    return removed


# --------------------------------------------------------------------------------------------------------------------
# The serving protocol


def install_heads(
    model: torch.nn.Module | None,
    ref_model: Any,
    options: dict[str, Any],
    precompute_grad: bool = False,
) -> bool:
    """Serve TRL's fused heads on a trainer's policy ``model`` and reference ``ref_model`` (no gradient: nothing to
    precompute there). Returns whether the policy has such a head (now served)."""
    if model is None:
        return False
    if isinstance(ref_model, torch.nn.Module) and ref_model is not model:
        maybe_install_trl_head(ref_model, dict(options))
    return maybe_install_trl_head(model, dict(options), precompute_grad=precompute_grad)


def serve(trainer: Any, row: Row, options: dict[str, Any]) -> bool:
    """Serve the fused heads TRL installed on ``trainer.model`` and ``trainer.ref_model``; whether the policy has
    one. With SFT's plain NLL (``loss_type="nll"``) the op precomputes that loss's gradient in the forward."""
    del row  # every fused-head row is served alike
    plain_nll = getattr(getattr(trainer, "args", None), "loss_type", None) == "nll"
    return install_heads(getattr(trainer, "model", None), getattr(trainer, "ref_model", None), options, plain_nll)


def prepare(trainer: Any, row: Row, options: dict[str, Any]) -> None:
    """At the end of ``Trainer.__init__``: make the reference-log-prob precompute that TRL's DPO and KTO run inside
    their ``__init__`` (``precompute_ref_log_probs=True``), once they have installed their heads, serve those heads
    first (:func:`serve`), on this trainer instance only."""
    precompute = getattr(trainer, _PRECOMPUTE, None)
    if not callable(precompute) or is_served(precompute):
        return

    @functools.wraps(precompute)
    def precompute_ref_logps(*args: Any, **kwargs: Any) -> Any:
        serve(trainer, row, options)
        return precompute(*args, **kwargs)

    replace_method(trainer, _PRECOMPUTE, precompute_ref_logps)


def unserve(trainer: Any, row: Row) -> bool:
    """Put TRL's fused heads back on ``trainer.model`` and ``trainer.ref_model``, and its reference-log-prob precompute
    (:func:`prepare`); whether one was served."""
    del row
    removed = restore_method(trainer, _PRECOMPUTE)
    for model in (getattr(trainer, "model", None), getattr(trainer, "ref_model", None)):
        if isinstance(model, torch.nn.Module):
            removed = remove_trl_head(model) or removed
    return removed
