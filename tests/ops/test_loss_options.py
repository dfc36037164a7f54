"""fused_linear_cross_entropy's loss options against float64 references built from torch's own cross-entropy:
class weights (``F.cross_entropy(weight=...)``, also with ``label_smoothing``), token weights, the per-token
log-sum-exp, the token accuracy and the predicted ids from the same pass, and fp32 accumulation of a bf16 weight
gradient; on both backends, with and without skipping ignored tokens, through ``torch.compile``, and their bad
inputs.

fp32 against float64: 1e-5 relative, as in test_linear_cross_entropy.py (fp32 sums of at most V or D terms).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lce_patch import fused_linear_cross_entropy
from lce_patch.ops.linear_cross_entropy import CrossEntropyOutputs, VocabShard

from .devices import BACKENDS, device_of, on
from .helpers import leaf, make_inputs, record_row_factors, rel_err


def reference(hidden, weight, labels, *, class_weights=None, token_weights=None, reduction="mean", num_items=None,
              shift=False, z_loss=0.0, label_smoothing=0.0, softcap=None, bias=None):  # fmt: skip
    """The weighted loss in float64 from the full logits and torch's cross-entropy (its "mean" divides the
    smoothing term by the valid labels' class weights too: the same denominator as below)."""
    if shift:
        labels = torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], -1)
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.T
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = labels.reshape(-1)
    valid = flat != -100
    weight_arg = None if class_weights is None else class_weights.double()
    per_token = F.cross_entropy(logits, flat, weight=weight_arg, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        lse = torch.logsumexp(logits, -1)
        label_weight = 1.0 if class_weights is None else class_weights.double()[flat.clamp(min=0)]
        per_token = per_token + torch.where(valid, z_loss * lse * lse * label_weight, 0.0)
    if token_weights is not None:
        per_token = per_token * token_weights.double().reshape(-1)
    total = per_token.sum()
    if num_items is not None:
        return total / num_items
    if reduction == "sum":
        return total
    denominator = valid.sum() if class_weights is None else class_weights.double()[flat[valid]].sum()
    return total / denominator


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("skip_ignored", [False, True])
@pytest.mark.parametrize(
    "case",
    [
        dict(class_weights=True),
        dict(class_weights=True, reduction="sum"),
        dict(class_weights=True, num_items=23.0),
        dict(token_weights=True),
        dict(token_weights=True, num_items=17.0),
        dict(class_weights=True, token_weights=True),
        dict(class_weights=True, token_weights=True, z_loss=1e-2),
        dict(token_weights=True, shift=True, batch=3),
    ],
    ids=lambda case: "-".join(f"{k}={v}" if v is not True else k for k, v in case.items()),
)
def test_weights_match_torch(backend, skip_ignored, case):
    case = dict(case)
    batch = case.pop("batch", None)
    hidden, weight, labels, _ = make_inputs(n=29, d=17, v=67, batch=batch)
    gen = torch.Generator().manual_seed(3)
    class_weights = torch.rand(67, generator=gen, dtype=torch.float64) * 2 if case.pop("class_weights", False) else None
    token_weights = torch.rand(labels.shape, generator=gen, dtype=torch.float64) * 3 if case.pop("token_weights", False) else None  # fmt: skip
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = reference(h_ref, w_ref, labels, class_weights=class_weights, token_weights=token_weights, **case)
    expected.backward()

    device = device_of(backend)
    h, w = leaf(hidden, torch.float32, device=device), leaf(weight, torch.float32, device=device)
    num_items = case.pop("num_items", None)
    loss = fused_linear_cross_entropy(
        h, w, on(backend, labels), backend=backend, chunk_size=8, skip_ignored=skip_ignored,
        class_weights=None if class_weights is None else on(backend, class_weights.float()),
        token_weights=None if token_weights is None else on(backend, token_weights.float()),
        num_items_in_batch=num_items, **case,
    )  # fmt: skip
    loss.backward()
    assert rel_err(loss, expected) < 1e-5
    assert rel_err(h.grad, h_ref.grad) < 1e-5
    assert rel_err(w.grad, w_ref.grad) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("skip_ignored", [False, True])
@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(reduction="sum"),
        dict(num_items=23.0),
        dict(token_weights=True),
        dict(token_weights=True, z_loss=1e-2, num_items=17.0),
        dict(z_loss=1e-2, reduction="sum", label_smoothing=0.6),
        dict(softcap=3.0, bias=True),  # Triton: exponentials against the bound (the fixed-max path)
        dict(softcap=3.0, bias=True, z_loss=1e-2, token_weights=True, reduction="sum"),
        dict(v=64),  # Triton: one full block, no masked one
        dict(label_smoothing=1.0, z_loss=1e-2),
        dict(token_weights=True, shift=True, batch=3),
    ],
    ids=lambda case: "-".join(f"{k}={v}" if v is not True else k for k, v in case.items()) or "plain",
)
def test_class_weights_with_label_smoothing_match_torch(backend, skip_ignored, case):
    """``F.cross_entropy(weight=w, label_smoothing=eps)``: the smoothing term weighted by the class weights inside
    the row pass; some classes weigh 0 (a row whose label weighs 0 keeps only its smoothing term)."""
    case = dict(case)
    batch, v, use_bias = case.pop("batch", None), case.pop("v", 67), case.pop("bias", False)
    case.setdefault("label_smoothing", 0.1)
    hidden, weight, labels, bias = make_inputs(n=29, d=17, v=v, batch=batch, bias=use_bias, seed=41)
    gen = torch.Generator().manual_seed(43)
    class_weights = torch.rand(v, generator=gen, dtype=torch.float64) * 2
    class_weights[::7] = 0.0
    token_weights = torch.rand(labels.shape, generator=gen, dtype=torch.float64) * 3 if case.pop("token_weights", False) else None  # fmt: skip
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b_ref = bias.clone().requires_grad_() if use_bias else None
    expected = reference(
        h_ref, w_ref, labels, class_weights=class_weights, token_weights=token_weights, bias=b_ref, **case
    )
    expected.backward()

    device = device_of(backend)
    h, w, b = (leaf(t, torch.float32, device=device) for t in (hidden, weight, bias))
    num_items = case.pop("num_items", None)
    loss = fused_linear_cross_entropy(
        h, w, on(backend, labels), bias=b, backend=backend, chunk_size=8, skip_ignored=skip_ignored,
        class_weights=on(backend, class_weights.float()),
        token_weights=None if token_weights is None else on(backend, token_weights.float()),
        num_items_in_batch=num_items, **case,
    )  # fmt: skip
    loss.backward()
    assert rel_err(loss, expected) < 1e-5
    assert rel_err(h.grad, h_ref.grad) < 1e-5
    assert rel_err(w.grad, w_ref.grad) < 1e-5
    if use_bias:
        assert rel_err(b.grad, b_ref.grad) < 1e-5


@pytest.mark.parametrize("options", [dict(), dict(softcap=2.0, z_loss=1e-2, reduction="sum")], ids=str)
def test_class_weights_with_label_smoothing_in_float64_on_torch(options):
    hidden, weight, labels, _ = make_inputs(n=23, d=11, v=41, seed=47)
    class_weights, token_weights = torch.rand(41, dtype=torch.float64), torch.rand(23, dtype=torch.float64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(
        h, w, labels, backend="torch", class_weights=class_weights, token_weights=token_weights,
        label_smoothing=0.15, **options,
    )  # fmt: skip
    loss.backward()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = reference(
        h_ref, w_ref, labels, class_weights=class_weights, token_weights=token_weights, label_smoothing=0.15,
        **options,
    )  # fmt: skip
    expected.backward()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [dict(), dict(reduction="sum", z_loss=1e-2), dict(num_items_in_batch=7.0)], ids=str)
def test_all_zero_class_weights_with_label_smoothing(backend, options):
    """Every class weighs 0 (W = 0, no distribution to smooth over): a 0 loss with zero gradients, no NaN (torch's
    "mean" is 0 / 0 there; the op's weighted mean is 0 when the valid labels' weights sum to 0)."""
    hidden, weight, labels, _ = make_inputs(n=19, d=9, v=31, seed=53)
    device = device_of(backend)
    h, w = leaf(hidden, torch.float32, device=device), leaf(weight, torch.float32, device=device)
    loss = fused_linear_cross_entropy(
        h, w, on(backend, labels), backend=backend, chunk_size=8, label_smoothing=0.2,
        class_weights=on(backend, torch.zeros(31)), token_weights=on(backend, torch.rand(19)), **options,
    )  # fmt: skip
    loss.backward()
    assert float(loss) == 0.0
    assert not h.grad.any() and not w.grad.any()
    if options.get("reduction") == "sum":  # torch agrees where it is defined
        logits = hidden @ weight.T
        assert float(F.cross_entropy(logits, labels, weight=torch.zeros(31, dtype=torch.float64), label_smoothing=0.2,
                                     reduction="sum")) == 0.0  # fmt: skip


def test_weights_in_float64_on_torch():
    hidden, weight, labels, _ = make_inputs(n=23, d=11, v=41)
    class_weights, token_weights = torch.rand(41, dtype=torch.float64), torch.rand(23, dtype=torch.float64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(
        h, w, labels, backend="torch", class_weights=class_weights, token_weights=token_weights
    )
    loss.backward()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = reference(h_ref, w_ref, labels, class_weights=class_weights, token_weights=token_weights)
    expected.backward()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-10, atol=1e-12)


def test_unit_weights_are_the_unweighted_loss():
    """Token weights of 1 give the plain loss ("mean" still divides by the count of valid tokens), and class
    weights of 1 too (their sum over the valid labels is that count)."""
    hidden, weight, labels, _ = make_inputs(n=31, d=13, v=47, seed=5)
    h, w = hidden.float(), weight.float()
    plain = fused_linear_cross_entropy(h, w, labels, backend="torch")
    for kwargs in (dict(token_weights=torch.ones(31)), dict(class_weights=torch.ones(47))):
        torch.testing.assert_close(fused_linear_cross_entropy(h, w, labels, backend="torch", **kwargs), plain)
    # with label smoothing: equal class weights (any value) give the smoothed mean
    smoothed = fused_linear_cross_entropy(h, w, labels, backend="torch", label_smoothing=0.2, z_loss=1e-3)
    for value in (1.0, 2.5):
        torch.testing.assert_close(
            fused_linear_cross_entropy(
                h, w, labels, backend="torch", label_smoothing=0.2, z_loss=1e-3, class_weights=torch.full((47,), value)
            ),
            smoothed,
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("skip_ignored", [False, True])
def test_lse_and_token_accuracy_from_the_same_pass(backend, skip_ignored):
    hidden, weight, labels, _ = make_inputs(n=41, d=15, v=59, batch=2, seed=11)
    logits = hidden @ weight.T
    labels = torch.where(torch.rand(labels.shape) < 0.5, logits.argmax(-1), labels)  # about half are the argmax
    labels.view(-1)[::6] = -100
    logits[0, 3, :] = 0.0  # a row of ties: its argmax is index 0
    labels[0, 3] = 0
    hidden[0, 3] = 0.0
    valid = labels != -100
    expected_lse = torch.where(valid, torch.logsumexp(logits, -1), 0.0)
    expected_accuracy = ((logits.argmax(-1) == labels) & valid).sum() / valid.sum()

    device = device_of(backend)
    h, w = leaf(hidden, torch.float32, device=device), leaf(weight, torch.float32, device=device)
    out = fused_linear_cross_entropy(
        h, w, on(backend, labels), backend=backend, chunk_size=16, skip_ignored=skip_ignored,
        return_lse=True, return_token_accuracy=True,
    )  # fmt: skip
    assert isinstance(out, CrossEntropyOutputs)
    assert out.lse.shape == labels.shape and not out.lse.requires_grad and not out.token_accuracy.requires_grad
    assert rel_err(out.lse, expected_lse) < 1e-5
    assert float(out.token_accuracy) == pytest.approx(float(expected_accuracy), abs=1e-7)
    plain = fused_linear_cross_entropy(h, w, on(backend, labels), backend=backend, chunk_size=16)
    torch.testing.assert_close(out.loss, plain)  # the loss is the one without the extra outputs
    out.loss.backward()
    assert h.grad is not None

    only_lse = fused_linear_cross_entropy(h, w, on(backend, labels), backend=backend, return_lse=True)
    assert only_lse.token_accuracy is None and rel_err(only_lse.lse, expected_lse) < 1e-5
    assert only_lse.predicted_tokens is None


def _tie_free(logits: torch.Tensor, rows) -> None:
    """The test's premise: outside ``rows`` (the deliberate ties), each row's two largest logits are far apart
    next to fp32's rounding, so the float64 argmax is the only right answer."""
    top2 = logits.reshape(-1, logits.shape[-1]).topk(2, dim=-1).values
    gap = (top2[:, 0] - top2[:, 1]).clone()
    gap[list(rows)] = float("inf")
    assert float(gap.min()) > 1e-4, float(gap.min())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("skip_ignored", [False, True])
@pytest.mark.parametrize(
    "options",
    [dict(), dict(softcap=3.0), dict(softcap=3.0, frozen_weight=True), dict(label_smoothing=0.1, z_loss=1e-3)],
    ids=lambda options: "-".join(f"{k}={v}" for k, v in options.items()) or "plain",
)
def test_predicted_tokens_are_the_argmax(backend, skip_ignored, options, monkeypatch):
    """Each position's argmax of the final logits against float64's, ties to the first index (two exact ties,
    across lanes and within one, and a row of equal logits); ignored positions get theirs unless skipped
    (``ignore_index`` then). The loss and gradients are bit for bit those without the flag, the token accuracy
    the share of valid labels that are the predicted ids. A softcap with a frozen weight takes the Triton
    kernel's one-pass gradient."""
    options = dict(options)
    frozen = options.pop("frozen_weight", False)
    hidden, weight, labels, bias = make_inputs(n=23, d=11, v=59, batch=2, bias=True, seed=61)
    # exact ties: hidden rows that are unit vectors read one column of the weight (+ the bias) exactly
    weight[:, :3] = 0.5 * torch.tanh(weight[:, :3])
    bias.zero_()
    hidden[0, 4], hidden[0, 9], hidden[1, 2] = torch.eye(11)[0], torch.eye(11)[1], 0.0
    weight[5, 0] = weight[40, 0] = 3.0  # columns 5 and 40: two lanes of the kernel
    weight[17, 1] = weight[19, 1] = 3.0  # columns 17 and 19: one lane
    tie_rows = (4, 9, 23 + 2)
    logits = hidden @ weight.T + bias
    if "softcap" in options:
        logits = options["softcap"] * torch.tanh(logits / options["softcap"])
    _tie_free(logits, tie_rows)
    expected = logits.argmax(-1)
    assert expected[0, 4] == 5 and expected[0, 9] == 17 and expected[1, 2] == 0
    labels[0, 4], labels[0, 9] = 5, 19  # a hit and a miss among the ties
    labels.view(-1)[::3] = torch.where(labels.view(-1)[::3] == -100, -100, expected.view(-1)[::3])  # some hits
    valid = labels != -100
    if skip_ignored:
        expected = torch.where(valid, expected, -100)

    device = device_of(backend)
    one_pass = record_row_factors(monkeypatch)
    results = []
    for flag in (True, False):
        h = leaf(hidden, torch.float32, device=device)
        b, w = (leaf(t, torch.float32, requires_grad=not frozen, device=device) for t in (bias, weight))
        out = fused_linear_cross_entropy(
            h, w, on(backend, labels), bias=b, backend=backend, chunk_size=8, skip_ignored=skip_ignored,
            return_predicted_tokens=flag, return_token_accuracy=flag, **options,
        )  # fmt: skip
        loss = out.loss if flag else out
        loss.backward()
        results.append((loss.detach(), h.grad, b.grad, w.grad))
        if flag:
            predicted = out.predicted_tokens
            assert predicted.dtype == torch.int64 and predicted.shape == labels.shape and not predicted.requires_grad
            assert torch.equal(predicted.cpu(), expected)
            hits = ((predicted.cpu() == labels) & valid).sum() / valid.sum()
            assert float(out.token_accuracy) == pytest.approx(float(hits), abs=1e-7)
            assert out.lse is None
    for with_flag, without in zip(*results, strict=True):
        assert without is None or torch.equal(with_flag, without)
    assert all(one_pass) == (frozen and backend == "triton"), one_pass


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["running max", "softcap", "softcap, gradient"])
def test_predicted_ids_of_hand_made_rows(backend, mode):
    """The row pass alone on a buffer of two vocabulary blocks (one full, one masked): the first index on ties
    within a lane, across lanes and across blocks, the first NaN (as torch.argmax), a max in the masked block,
    a row of -inf; the softcapped rows take the bounded-exponent path, with the gradient one logit per lane. The
    argmax check reads the same argmax."""
    from lce_patch.ops.linear_cross_entropy.rows import LogitTransform, RowOutputs, chunk_stats

    use_triton = backend == "triton"
    vocab = 4096 + 45
    gen = torch.Generator().manual_seed(67)
    raw = torch.randn(10, vocab, generator=gen, dtype=torch.float64).float()
    cases = {1: (5, 40), 2: (17, 19), 3: (100, 4100), 4: (4099,), 5: (4130,)}
    for row, columns in cases.items():
        raw[row, list(columns)] = 8.0
    raw[6, [300, 4101]] = float("nan")
    raw[7, 4110] = float("nan")
    raw[8] = float("-inf")
    raw[9, 4140] = 8.0  # the last column
    expected = raw.double().argmax(1)
    assert expected[:8].tolist()[1:] == [5, 17, 100, 4099, 4130, 300, 4110] and expected[8] == 0
    labels = expected.clone()
    labels[[0, 2, 3]] = torch.tensor([-100, 19, 4100])  # ignored, and two misses among ties
    transform = LogitTransform(softcap=None if mode == "running max" else 30.0)
    device = device_of(backend)
    out = RowOutputs(
        loss=torch.empty(10, device=device),
        lse=torch.empty(10, device=device),
        is_top1=torch.empty(10, dtype=torch.int8, device=device),
        predicted=torch.empty(10, dtype=torch.int64, device=device),
    )
    grad_scale = torch.tensor(0.5, device=device) if mode.endswith("gradient") else None
    chunk_stats(raw.to(device), labels.to(device), transform, out, grad_scale, use_triton)
    assert out.predicted.cpu().tolist() == expected.tolist()
    assert out.is_top1.cpu().bool().tolist() == ((expected == labels) & (labels != -100)).tolist()


def test_fp32_weight_grad_rounds_a_bf16_weight_gradient_once():
    """bf16 on the torch backend with many chunks: the fp32-accumulated dW is the fp32 one rounded once, and
    closer to the float64 reference than the default (each chunk's sum added into a bf16 dW)."""
    hidden, weight, labels, _ = make_inputs(n=512, d=32, v=97, ignore_every=0, seed=13)
    reference_loss = reference(hidden, w_ref := weight.clone().requires_grad_(), labels)
    reference_loss.backward()
    errors = {}
    for fp32_weight_grad in (False, True):
        h, w = leaf(hidden, torch.bfloat16, False), leaf(weight, torch.bfloat16)
        loss = fused_linear_cross_entropy(
            h, w, labels, backend="torch", chunk_size=16, fp32_weight_grad=fp32_weight_grad
        )
        loss.backward()
        assert w.grad.dtype == torch.bfloat16
        errors[fp32_weight_grad] = rel_err(w.grad, w_ref.grad)
    assert errors[True] < errors[False], errors
    assert errors[True] < 8e-3  # bf16 inputs and G: the dW of the unfused bf16 path is ~4e-3 here


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("smoothed", [False, True], ids=["plain", "label_smoothing"])
def test_compiled_options_give_eager_numbers(backend, smoothed):
    hidden, weight, labels, _ = make_inputs(n=33, d=12, v=45, seed=17)
    device = device_of(backend)
    labels = on(backend, labels)
    class_weights, token_weights = on(backend, torch.rand(45), torch.rand(33))

    def step(h, w):
        out = fused_linear_cross_entropy(
            h, w, labels, backend=backend, chunk_size=8, skip_ignored=True, class_weights=class_weights,
            token_weights=token_weights, return_lse=True, return_token_accuracy=True, fp32_weight_grad=True,
            label_smoothing=0.1 if smoothed else 0.0, z_loss=1e-3, return_predicted_tokens=True,
        )  # fmt: skip
        return out.loss, out.lse, out.token_accuracy, out.predicted_tokens

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        h, w = leaf(hidden, torch.float32, device=device), leaf(weight, torch.float32, device=device)
        loss, lse, accuracy, predicted = fn(h, w)
        loss.backward()
        results.append((loss.detach(), lse, accuracy, predicted, h.grad, w.grad))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


def test_bad_weights_are_refused():
    hidden, weight, labels, _ = make_inputs(n=9, d=5, v=11, seed=19)
    h, w = hidden.float(), weight.float()

    def call(**kwargs):
        return fused_linear_cross_entropy(h, w, labels, backend="torch", **kwargs)

    with pytest.raises(ValueError, match=r"class_weights must have shape \(11,\)"):
        call(class_weights=torch.ones(10))
    with pytest.raises(ValueError, match=r"token_weights must have shape \(9,\)"):
        call(token_weights=torch.ones(3, 3))
    with pytest.raises(ValueError, match="token_weights must be a floating-point tensor"):
        call(token_weights=torch.ones(9, dtype=torch.long))
    with pytest.raises(ValueError, match="class_weights must be a torch.Tensor"):
        call(class_weights=[1.0] * 11)
    with pytest.raises(ValueError, match="class_weights must be finite and >= 0, got -1.0"):
        call(class_weights=torch.tensor([1.0] * 10 + [-1.0]))
    with pytest.raises(ValueError, match="token_weights must be finite and >= 0, got nan"):
        call(token_weights=torch.tensor([1.0] * 8 + [float("nan")]))
    with pytest.raises(ValueError, match="weigh a scalar loss"):
        call(token_weights=torch.ones(9), reduction="none")
    with pytest.raises(ValueError, match="return_lse must be a bool"):
        call(return_lse=1)
    with pytest.raises(ValueError, match="return_predicted_tokens must be a bool"):
        call(return_predicted_tokens=1)
    with pytest.raises(ValueError, match="vocabulary-sharded"):
        call(token_weights=torch.ones(9), vocab_shard=VocabShard(start=0, total=11))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="all inputs must be on one device"):
            call(class_weights=torch.ones(11, device="cuda"))


def test_weights_carry_no_gradient():
    hidden, weight, labels, _ = make_inputs(n=9, d=5, v=11, seed=23)
    token_weights = torch.rand(9, requires_grad=True)
    loss = fused_linear_cross_entropy(
        hidden.float().requires_grad_(), weight.float(), labels, backend="torch", token_weights=token_weights
    )
    loss.backward()
    assert token_weights.grad is None


def test_patched_model_passes_fp32_weight_grad_to_the_op(monkeypatch):
    """apply_fused_lce(model, fp32_weight_grad=True) reaches every call of the op; a bad value fails at patch time."""
    transformers = pytest.importorskip("transformers")
    from lce_patch import apply_fused_lce
    from lce_patch.models import forward

    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="lce_patch: fp32_weight_grad must be a bool"):
        apply_fused_lce(model, fp32_weight_grad="yes")
    apply_fused_lce(model, fp32_weight_grad=True)
    seen = []
    real = forward.fused_linear_cross_entropy
    monkeypatch.setattr(forward, "fused_linear_cross_entropy", lambda *a, **k: seen.append(k) or real(*a, **k))
    ids = torch.randint(0, 61, (2, 7))
    model(input_ids=ids, labels=ids).loss.backward()
    assert [call["options"].fp32_weight_grad for call in seen] == [True]  # the forward hands over one options object


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_of_every_input_give_the_contiguous_result(backend):
    """A transposed weight, a column-strided hidden, strided token weights and expanded class weights: the same
    loss and gradients as contiguous copies (the weights are read through their strides or flattened once)."""
    hidden, weight, labels, _ = make_inputs(n=27, d=13, v=43, batch=3, seed=31)
    wide_hidden = on(backend, torch.randn(3, 27, 26, dtype=torch.float64).float())
    wide_hidden[..., ::2] = on(backend, hidden.float())
    weight_t = on(backend, weight.float().t().contiguous())  # [D, V]: its .t() is a [V, D] view
    token_wide = on(backend, torch.rand(3, 54))
    class_weights = on(backend, torch.rand(1)).expand(43)
    labels = on(backend, labels)
    results = []
    for views in (True, False):
        h = (wide_hidden[..., ::2] if views else wide_hidden[..., ::2].contiguous()).detach().requires_grad_()
        w_base = weight_t.clone().requires_grad_()
        w = w_base.t() if views else w_base.t().contiguous()
        tokens = token_wide[:, ::2] if views else token_wide[:, ::2].contiguous()
        classes = class_weights if views else class_weights.contiguous()
        out = fused_linear_cross_entropy(
            h, w, labels, backend=backend, chunk_size=16, skip_ignored=True, token_weights=tokens,
            class_weights=classes, return_lse=True, return_token_accuracy=True, return_predicted_tokens=True,
        )  # fmt: skip
        out.loss.backward()
        results.append((out.loss.detach(), out.lse, out.token_accuracy, out.predicted_tokens, h.grad, w_base.grad))
    for viewed, contiguous in zip(*results, strict=True):
        torch.testing.assert_close(viewed, contiguous, rtol=1e-6, atol=1e-7)
