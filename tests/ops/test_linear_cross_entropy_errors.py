"""Bad input to the cross-entropy ops gets a clear error naming the problem, never a kernel crash or a
silently wrong number; second-order gradients are refused by name. The errors every op gives (a non-tensor,
an integer dtype, a hidden size, a device, a reduction, a chunk size) are in test_every_op.py.
"""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_cross_entropy, fused_linear_log_probs

from .devices import BACKENDS, device_of, on
from .helpers import leaf, make_inputs


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(hidden=a["hidden"][0]), "hidden must be"),
        (lambda a: a.update(labels=a["labels"][:-1]), "labels must have shape"),
        (lambda a: a.update(labels=a["labels"].float()), "integer"),
        (lambda a: a.update(bias=torch.zeros(3)), "bias must have shape"),
        (lambda a: a.update(weight=a["weight"].double()), "share one dtype"),
        (lambda a: a.update(backend="cuda"), "unknown backend"),
        (lambda a: a.update(reduction="none", num_items_in_batch=3), "needs a scalar reduction"),
        (lambda a: a.update(num_items_in_batch=0), "num_items_in_batch"),
        (lambda a: a.update(softcap=-1.0), "softcap"),
        (lambda a: a.update(label_smoothing=1.5), "label_smoothing"),
        (lambda a: a.update(z_loss=-1.0), "z_loss"),
        (lambda a: a["labels"].__setitem__(4, 101), "outside"),
        (lambda a: a["labels"].__setitem__(4, -2), "outside"),
        (lambda a: a.update(num_valid_tokens=28), "num_valid_tokens=28 but 29"),
        (lambda a: a.update(num_valid_tokens=38), "exceeds the number of tokens"),
        (lambda a: a.update(num_valid_tokens=-1), "num_valid_tokens must be >= 0"),
        (lambda a: a.update(num_valid_tokens=torch.tensor(29)), "num_valid_tokens must be a Python int"),
        (lambda a: a.update(num_items_in_batch=torch.tensor(0)), "num_items_in_batch must be finite and > 0"),
        (lambda a: a.update(num_items_in_batch=torch.tensor(-3.0)), "num_items_in_batch must be finite and > 0"),
        (lambda a: a.update(num_items_in_batch=torch.tensor(float("inf"))), "num_items_in_batch must be finite"),
        (lambda a: a.update(num_items_in_batch=torch.tensor([3, 4])), "one-element tensor"),
        (lambda a: a.update(num_items_in_batch=torch.tensor(True)), "real number"),
        (lambda a: a.update(num_items_in_batch=float("nan")), "num_items_in_batch must be a finite number"),
        (lambda a: a.update(num_items_in_batch=-2), "num_items_in_batch must be >= 0"),
        (lambda a: a.update(num_items_in_batch="7"), "num_items_in_batch must be a finite number"),
        (lambda a: a.update(softcap=float("inf")), "softcap must be a finite number or None"),
        (lambda a: a.update(softcap=0.0), "softcap must be > 0"),
        (lambda a: a.update(z_loss=float("nan")), "z_loss must be a finite number"),
        (lambda a: a.update(label_smoothing="0.1"), "label_smoothing must be a finite number"),
        (lambda a: a.update(logit_scale=float("nan")), "logit_scale must be a finite number"),
        (lambda a: a.update(ignore_index=None), "ignore_index must be a Python int"),
        (lambda a: a.update(ignore_index=-100.0), "ignore_index must be a Python int"),
        (lambda a: a.update(chunk_size=True), "chunk_size must be a Python int"),
        (lambda a: a.update(chunk_size=8.0), "chunk_size must be a Python int"),
        (lambda a: a.update(bias=[0.0] * 101), "bias must be a torch.Tensor or None"),
        (lambda a: a.update(labels=None), "labels must be a torch.Tensor"),
        (lambda a: a.update(shift="yes"), "shift must be a bool"),
        (lambda a: a.update(skip_ignored=1), "skip_ignored must be a bool"),
        (lambda a: a.update(backend="triton", hidden=a["hidden"].double(), weight=a["weight"].double()), "float64"),
    ],
)
def test_bad_input_gives_a_clear_error(mutate, message):
    hidden, weight, labels, _ = make_inputs()
    args = {"hidden": hidden.float(), "weight": weight.float(), "labels": labels.clone(), "backend": "torch"}
    mutate(args)
    with pytest.raises(ValueError, match=message):
        fused_linear_cross_entropy(**args)


def test_triton_backend_without_a_usable_device_is_refused(monkeypatch):
    from lce_patch.ops.core import backend

    monkeypatch.setattr(backend, "triton_usable", lambda device: False)
    hidden, weight, labels, _ = make_inputs()
    with pytest.raises(ValueError, match="backend='triton' needs"):
        fused_linear_cross_entropy(hidden.float(), weight.float(), labels, backend="triton")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(temperature=0.0), "temperature must be > 0"),
        (lambda a: a.update(temperature=float("inf")), "temperature must be a finite number"),
        (lambda a: a.update(precompute_grad=None), "precompute_grad must be a bool"),
    ],
)
def test_bad_input_to_log_probs_gives_a_clear_error(mutate, message):
    hidden, weight, labels, _ = make_inputs()
    args = {"hidden": hidden.float(), "weight": weight.float(), "labels": labels, "backend": "torch"}
    mutate(args)
    with pytest.raises(ValueError, match=message):
        fused_linear_log_probs(**args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_token", [False, True])
def test_second_order_gradients_are_refused_clearly(backend, per_token):
    hidden, weight, labels, _ = make_inputs()
    h, w = (leaf(t, torch.float32, device=device_of(backend)) for t in (hidden, weight))
    labels = on(backend, labels)
    if per_token:
        loss = fused_linear_log_probs(h, w, labels, backend=backend, return_entropy=True).entropy.sum()
    else:
        loss = fused_linear_cross_entropy(h, w, labels, backend=backend)
    with pytest.raises(RuntimeError, match="fused_linear_cross_entropy: second-order gradients"):
        torch.autograd.grad(loss, h, create_graph=True)
    # First-order gradients of a fresh call are unaffected
    loss = fused_linear_cross_entropy(h, w, labels, backend=backend)
    (grad,) = torch.autograd.grad(loss, h)
    assert torch.isfinite(grad).all()
