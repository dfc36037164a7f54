"""The self-check of unregistered models: the fused loss and every gradient against the model's own forward."""

from __future__ import annotations

import functools
import math
import types
from typing import Any

import torch

from .adapters import resolve_head_module
from .forward import PREVIOUS_FORWARD_ATTR, unpatched
from .refusals import refusal

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
                raise refusal(
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
        raise refusal(
            model,
            f"on a test batch with large logits the fused forward differs from the model's own in: {shown}, so its "
            "forward does something the fused loss does not (e.g. a custom logit transform or a loss term outside "
            "loss_function)",
            self_checked=True,
        )
