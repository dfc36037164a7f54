"""The fused op against the unfused float64 reference, on both backends.

The "triton" backend runs the real kernels on the GPU under LCE_TEST_GPU=1, else under the CPU
interpreter (TRITON_INTERPRET=1, set in conftest); devices.py places each backend's inputs. fp32
results must match the float64 reference to 1e-5 relative: the op reduces in fp32 over at most V or
D terms per element, so its error is a few ulps times sqrt(V) ~ 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_cross_entropy, fused_linear_log_probs
from lce_patch.ops.linear_cross_entropy import (
    naive_linear_cross_entropy,
    naive_token_outputs,
)
from lce_patch.ops.linear_cross_entropy.launchers import _BLOCK_V_STATS as BLOCK

from .devices import BACKENDS, TRITON_BF16, TRITON_DEVICE, device_of, on
from .helpers import OPTION_SETS, check_against_reference, leaf, make_inputs, record_row_factors, rel_err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_matches_float64_reference(backend, options):
    check_against_reference(options, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options",
    [
        {"skip_ignored": True},
        {"skip_ignored": True, "reduction": "none", "softcap": 3.0},
        {"skip_ignored": True, "num_items_in_batch": 41, "label_smoothing": 0.1, "z_loss": 1e-3},
        {"num_valid_tokens": 29},  # make_inputs ignores every 5th of 37 rows: 29 remain
        {"num_valid_tokens": 29, "reduction": "sum", "logit_scale": 0.5},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_skipping_ignored_rows_matches_float64_reference(backend, options):
    check_against_reference(options, backend=backend, bias=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skipping_ignored_rows_of_token_outputs(backend):
    hidden, weight, labels, _ = make_inputs(batch=2, n=11, seed=3)
    labels[:, :4] = -100  # a masked prompt
    log_probs, entropy, is_top1 = naive_token_outputs(hidden.requires_grad_(), weight.requires_grad_(), labels)
    up_lp, up_ent = torch.randn_like(log_probs), torch.randn_like(entropy)
    ref_grads = torch.autograd.grad((log_probs * up_lp + entropy * up_ent).sum(), [hidden, weight])
    device = device_of(backend)
    h, w = leaf(hidden, torch.float32, device=device), leaf(weight, torch.float32, device=device)
    out = fused_linear_log_probs(
        h, w, on(backend, labels), return_entropy=True, return_is_top1=True, backend=backend, chunk_size=4,
        skip_ignored=True,
    )  # fmt: skip
    assert rel_err(out.log_probs, log_probs) < 1e-5 and rel_err(out.entropy, entropy) < 1e-5
    assert torch.equal(out.is_top1.cpu(), is_top1)
    (out.log_probs * on(backend, up_lp.float()) + out.entropy * on(backend, up_ent.float())).sum().backward()
    for got, want in zip((h, w), ref_grads):
        assert rel_err(got.grad, want) < 1e-5
    assert not h.grad[:, :4].any()  # ignored rows get exact zeros


IGNORED_PATTERNS = {
    "long_prompt": lambda n, gen: torch.arange(n) < n - 5,
    "tail": lambda n, gen: torch.arange(n) >= 9,
    "blocks": lambda n, gen: (torch.arange(n) // 4) % 2 == 0,
    "random": lambda n, gen: torch.rand(n, generator=gen) < 0.5,
    "one_kept": lambda n, gen: torch.arange(n) != n // 2,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", sorted(IGNORED_PATTERNS))
@pytest.mark.parametrize("chunk_size", [1, 3, 8])
@pytest.mark.parametrize(("vocab_size", "reduction", "frozen_weight"), [(101, "mean", False), (11, "none", True)])
def test_skipped_rows_are_gathered_into_dh_and_placed_back(
    backend, pattern, chunk_size, vocab_size, reduction, frozen_weight
):
    # The chunk's rows of hidden are gathered into a stretch of dh that holds no finished row (see
    # _GradAccumulator.gather_rows); ignored rows in every position relative to the chunks, and a
    # vocabulary smaller than the hidden size (no room in G to stage dh's rows), must still give
    # exact zeros for the ignored rows and the reference gradient elsewhere.
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    hidden, weight, labels, _ = make_inputs(n=23, d=19, v=vocab_size, ignore_every=0, seed=int(gen.initial_seed()))
    ignored = IGNORED_PATTERNS[pattern](23, gen)
    labels[ignored] = -100
    ref = naive_linear_cross_entropy(hidden.requires_grad_(), weight.requires_grad_(), labels, reduction=reduction)
    upstream = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.3, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, [hidden, weight], upstream)
    device = device_of(backend)
    h = leaf(hidden, torch.float32, device=device)
    w = leaf(weight, torch.float32, requires_grad=not frozen_weight, device=device)
    out = fused_linear_cross_entropy(
        h, w, on(backend, labels), reduction=reduction, backend=backend, chunk_size=chunk_size, skip_ignored=True
    )
    out.backward(on(backend, upstream.float()))
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(h.grad.cpu()[ignored], torch.zeros_like(h.grad.cpu()[ignored]))
    assert rel_err(h.grad, ref_grads[0]) < 1e-5
    if not frozen_weight:
        assert rel_err(w.grad, ref_grads[1]) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab_size", [64, BLOCK, BLOCK + 1, 2 * BLOCK + 100])
@pytest.mark.parametrize("options", [{}, {"softcap": 3.0, "label_smoothing": 0.1}, {"reduction": "none"}], ids=str)
def test_vocab_sizes_at_the_kernel_block_edges(backend, vocab_size, options):
    """The Triton row pass runs full BLOCK-wide blocks unmasked and a masked tail (none when V is a
    multiple of the block); targets in the first, last and tail columns."""
    hidden, weight, labels, _ = make_inputs(n=12, d=8, v=vocab_size, ignore_every=4)
    labels[1], labels[2], labels[3] = 0, vocab_size - 1, min(BLOCK, vocab_size - 1)
    ref = naive_linear_cross_entropy(hidden.requires_grad_(), weight.requires_grad_(), labels, **options)
    upstream = torch.rand_like(ref) + 0.5
    ref_grads = torch.autograd.grad(ref, [hidden, weight], upstream)
    h, w = (leaf(t, torch.float32, device=device_of(backend)) for t in (hidden, weight))
    out = fused_linear_cross_entropy(h, w, on(backend, labels), backend=backend, chunk_size=5, **options)
    out.backward(on(backend, upstream.float()))
    assert rel_err(out, ref) < 1e-5
    assert rel_err(h.grad, ref_grads[0]) < 1e-5 and rel_err(w.grad, ref_grads[1]) < 1e-5


ONE_PASS_CASES = {
    "rows as slices": {"softcap": 2.5},
    "skip_ignored, rows gathered into dh": {"softcap": 2.5, "skip_ignored": True},
    "sum, skip_ignored": {"softcap": 4.0, "reduction": "sum", "skip_ignored": True},
    "num_items_in_batch, logit scale": {"softcap": 6.0, "logit_scale": 1.7, "num_items_in_batch": 41},
}


@pytest.mark.skipif("triton" not in BACKENDS, reason="the one-pass gradient is a path of the Triton kernel")
@pytest.mark.parametrize("case", sorted(ONE_PASS_CASES))
@pytest.mark.parametrize("chunk_size", [3, 8])
def test_one_pass_softcap_gradient_of_a_frozen_weight_matches_float64_reference(case, chunk_size, monkeypatch):
    # With a softcap and a frozen W (LoRA) the kernel writes the gradient in one pass, as rows to be
    # scaled; the factor goes onto dh's fp32 rows. Both layouts of dh's rows (written in place, or
    # gathered into a stretch of dh and placed back) must give the reference gradient.
    options = ONE_PASS_CASES[case]
    seen = record_row_factors(monkeypatch)
    hidden, weight, labels, _ = make_inputs(n=29, d=13, v=71, ignore_every=4)
    labels[:3] = -100
    ref_options = {k: v for k, v in options.items() if k != "skip_ignored"}
    ref = naive_linear_cross_entropy(hidden.requires_grad_(), weight, labels, **ref_options)
    (ref_grad,) = torch.autograd.grad(ref, [hidden], torch.tensor(1.3, dtype=torch.float64))
    h = leaf(hidden, torch.float32, device=TRITON_DEVICE)
    w = leaf(weight, torch.float32, requires_grad=False, device=TRITON_DEVICE)
    out = fused_linear_cross_entropy(h, w, labels.to(TRITON_DEVICE), backend="triton", chunk_size=chunk_size, **options)
    out.backward(torch.tensor(1.3, device=TRITON_DEVICE))
    assert seen and all(seen), seen
    assert rel_err(out, ref) < 1e-5
    assert rel_err(h.grad, ref_grad) < 1e-5
    assert torch.equal(h.grad[:3], torch.zeros_like(h.grad[:3]))


@pytest.mark.skipif("triton" not in BACKENDS, reason="the one-pass gradient is a path of the Triton kernel")
@pytest.mark.parametrize("skip_ignored", [False, True])
def test_one_pass_gradient_of_precomputed_token_log_probs(skip_ignored, monkeypatch):
    # fused_linear_log_probs with precompute_grad (TRL's SFT path) and a frozen W, with a temperature:
    # the precomputed gradient of the mean over valid tokens comes from the one-pass kernel.
    seen = record_row_factors(monkeypatch)
    hidden, weight, labels, _ = make_inputs(batch=2, n=11, d=13, v=71)
    labels[:, :3] = -100
    options = {"softcap": 5.0, "temperature": 0.7, "logit_scale": 1.3}
    log_probs, _, _ = naive_token_outputs(hidden.requires_grad_(), weight, labels, **options)
    (ref_grad,) = torch.autograd.grad(-log_probs.sum() / (labels != -100).sum(), [hidden])
    h = leaf(hidden, torch.float32, device=TRITON_DEVICE)
    w = leaf(weight, torch.float32, requires_grad=False, device=TRITON_DEVICE)
    out = fused_linear_log_probs(
        h, w, labels.to(TRITON_DEVICE), backend="triton", chunk_size=4, skip_ignored=skip_ignored,
        precompute_grad=True, **options,
    )  # fmt: skip
    assert seen and all(seen), seen
    assert rel_err(out.log_probs, log_probs) < 1e-5
    (-out.log_probs.sum() / out.label_mask.sum()).backward()
    assert rel_err(h.grad, ref_grad) < 1e-5


@pytest.mark.skipif("triton" not in BACKENDS, reason="the one-pass gradient is a path of the Triton kernel")
@pytest.mark.parametrize(
    "options",
    [{"softcap": 3.0, "trainable": "both"}, {"softcap": 3.0, "trainable": "weight"}, {}, {"softcap": 50.0},
     {"softcap": 3.0, "label_smoothing": 0.1}, {"softcap": 3.0, "z_loss": 1e-3}, {"softcap": 3.0, "bias": True},
     {"softcap": 3.0, "dtype": torch.float16}],
    ids=str,
)  # fmt: skip
def test_one_pass_gradient_only_where_it_applies(options, monkeypatch):
    # A trainable W (its dW GEMM cannot scale its rows), no softcap (running max), a bound over 40,
    # smoothing or z-loss (sum or lse in every element), a bias gradient, fp16 (no range for e^40): two
    # passes.
    options = dict(options)
    dtype, bias = options.pop("dtype", torch.float32), options.pop("bias", False)
    trainable = options.pop("trainable", "hidden")
    seen = record_row_factors(monkeypatch)
    hidden, weight, labels, b = make_inputs(bias=bias)
    h = leaf(hidden, dtype, requires_grad=trainable in ("hidden", "both"), device=TRITON_DEVICE)
    w = leaf(weight, dtype, requires_grad=trainable in ("weight", "both"), device=TRITON_DEVICE)
    bb = leaf(b, dtype, device=TRITON_DEVICE)  # a trainable bias: its gradient is the sum of G's rows
    labels = labels.to(TRITON_DEVICE)
    fused_linear_cross_entropy(h, w, labels, bias=bb, backend="triton", chunk_size=16, **options).backward()
    assert seen and not any(seen)


@pytest.mark.skipif("triton" not in BACKENDS, reason="the one-pass gradient is a path of the Triton kernel")
def test_one_pass_gradient_rows_agree_with_the_two_pass_kernel_on_extreme_rows():
    # Row by row, the one-pass output times its row factor against the two-pass kernel's gradient
    # (same fp32 tanh, so the same values up to rounding) and the float64 formula: ordinary rows,
    # a row whose logits all sit near -softcap, a target ~60 nats below every other logit, an ignored
    # row, a target at the row's max, and a NaN.
    from lce_patch.ops.linear_cross_entropy.rows import LogitTransform, RowOutputs, chunk_stats

    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    rows, vocab_size, softcap = 8, 300, 30.0
    raw = torch.randn(rows, vocab_size, generator=gen) * 10
    labels = torch.randint(0, vocab_size, (rows,), generator=gen)
    raw[1] = -150 - 100 * torch.rand(vocab_size, generator=gen)
    raw[2] = 200 + torch.randn(vocab_size, generator=gen)
    raw[2, labels[2]] = -200.0
    labels[3] = -100
    raw[4, labels[4]] = raw[4].max() + 3
    raw[6, 17] = float("nan")
    transform = LogitTransform(softcap=softcap)
    grad_scale = torch.tensor(0.25, device=TRITON_DEVICE)

    def run(row_factor):
        out = RowOutputs(loss=torch.empty(rows, device=TRITON_DEVICE), lse=torch.empty(rows, device=TRITON_DEVICE))
        buffer = raw.to(TRITON_DEVICE, copy=True)
        chunk_stats(buffer, labels.to(TRITON_DEVICE), transform, out, grad_scale, True, row_factor=row_factor)
        return buffer.cpu(), RowOutputs(loss=out.loss.cpu(), lse=out.lse.cpu())

    two_pass, two_out = run(None)
    factor = torch.full((rows,), float("nan"), device=TRITON_DEVICE)
    one_pass, one_out = run(factor)
    factor = factor.cpu()
    one_pass = one_pass.double() * factor.double()[:, None]

    tanh = torch.tanh(raw.double() / softcap)
    p = torch.softmax(softcap * tanh, dim=1)
    z = softcap * tanh
    expected_loss = torch.logsumexp(z, dim=1) - z.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    valid = labels != -100
    onehot = torch.zeros_like(p).scatter_(1, labels.clamp(min=0)[:, None], 1.0)
    expected = (p - onehot) * (1 - tanh**2) * 0.25 * valid[:, None]
    for row in range(rows):
        if row == 6:
            assert torch.isnan(one_pass[row]).all() and torch.isnan(two_pass[row]).all()
            assert torch.isnan(one_out.loss[row]) and torch.isnan(two_out.loss[row])
            continue
        assert rel_err(one_pass[row], two_pass[row]) < 1e-5, row
        # Each loss against float64: lse is taken around logits of ~30 in fp32 (ulp 1.9e-6), so either
        # kernel is off by a few ulps of that, and the two from each other by up to twice as much.
        want = 0.0 if row == 3 else float(expected_loss[row])
        for loss in (float(one_out.loss[row]), float(two_out.loss[row])):
            assert abs(loss - want) <= 5e-6 * max(1.0, abs(want)), row
        if row not in (1, 2):  # saturated fp32 tanh there (1 - tanh**2 from t within ulps of +-1), in both
            assert rel_err(one_pass[row], expected[row]) < 1e-5, row
    assert torch.equal(one_pass[3], torch.zeros_like(one_pass[3]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_and_shift_3d(backend):
    check_against_reference({"shift": True}, backend=backend, bias=True, batch=3)
    check_against_reference({"shift": True, "softcap": 5.0, "reduction": "none"}, backend=backend, bias=True, batch=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_items_as_tensor(backend):
    check_against_reference({"num_items_in_batch": torch.tensor(29)}, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision(backend):
    # fp16 operands: logits carry ~2^-11 relative rounding, so loss and gradients agree to ~1e-3.
    check_against_reference({"softcap": 3.0}, backend=backend, dtype=torch.float16, tol=5e-3)
    # bf16 operands round to 2^-8: the same check in bf16 at 8x the fp16 tolerance and more. The interpreter
    # cannot run bf16 dots: the Triton kernels' bf16 runs only on the GPU (and in test_cuda.py).
    if backend == "torch" or TRITON_BF16:
        check_against_reference({}, backend=backend, dtype=torch.bfloat16, tol=3e-2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_bf16_loss_is_not_limited_by_the_rounding_of_the_logits(backend, softcap):
    # A bf16 GEMM rounds each logit to 8 bits of mantissa (~1e-4 relative error in a peaked loss);
    # the op recomputes the target logit in fp32, which takes the loss to ~1e-5 even at this small
    # N (the residue is the rounding of the other logits inside the log-sum-exp, averaged over N).
    fused_errors, bf16_logit_errors = [], []
    for seed in range(2 if backend == "triton" else 4):  # the Triton interpreter takes ~15 s a problem on a CPU
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(3000, 64, generator=gen) / 8
        labels = torch.randint(0, 3000, (96,), generator=gen)
        labels[::7] = -100
        hidden = torch.randn(96, 64, generator=gen) + 6 * weight[labels.clamp(min=0)]  # loss ~1.5-3 nats
        hidden, weight = hidden.bfloat16(), weight.bfloat16()
        ref = naive_linear_cross_entropy(hidden.double(), weight.double(), labels, softcap=softcap).item()
        bf16_logits = naive_linear_cross_entropy(hidden, weight, labels, softcap=softcap).item()
        fused = fused_linear_cross_entropy(*on(backend, hidden, weight, labels), softcap=softcap, backend=backend)
        fused = fused.item()
        fused_errors.append(abs(fused - ref) / ref)
        bf16_logit_errors.append(abs(bf16_logits - ref) / ref)
    assert max(fused_errors) < 3e-5, fused_errors
    assert sum(fused_errors) < sum(bf16_logit_errors) / 4, (fused_errors, bf16_logit_errors)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_fp32_target_logit_of_the_rows_kept_by_skip_ignored(backend):
    # With skip_ignored the fp32 target logits are computed for the kept rows only (gathered by index):
    # the loss must be the one of the full pass.
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(1000, 64, generator=gen) / 8).bfloat16()
    labels = torch.randint(0, 1000, (96,), generator=gen)
    labels[::3] = -100
    hidden = (torch.randn(96, 64, generator=gen) + 6 * weight.float()[labels.clamp(min=0)]).bfloat16()
    hidden, weight, labels = on(backend, hidden, weight, labels)
    full = fused_linear_cross_entropy(hidden, weight, labels, backend=backend, reduction="none")
    kept = fused_linear_cross_entropy(hidden, weight, labels, backend=backend, reduction="none", skip_ignored=True)
    torch.testing.assert_close(kept, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_ignored_gives_zero_and_zero_grads(backend):
    hidden, weight, labels, _ = make_inputs()
    labels = on(backend, labels.fill_(-100))
    for reduction, skip_ignored in (("mean", False), ("sum", False), ("none", False), ("mean", True), ("none", True)):
        h, w = (leaf(t, torch.float32, device=device_of(backend)) for t in (hidden, weight))
        loss = fused_linear_cross_entropy(h, w, labels, backend=backend, reduction=reduction, skip_ignored=skip_ignored)
        loss.sum().backward()
        assert torch.all(loss == 0) and torch.isfinite(loss).all()
        assert torch.all(h.grad == 0) and torch.all(w.grad == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_valid_token(backend):
    hidden, weight, labels, _ = make_inputs()
    labels.fill_(-100)
    labels[11] = 7
    h, w = (leaf(t, torch.float32, device=device_of(backend)) for t in (hidden, weight))
    loss = fused_linear_cross_entropy(h, w, on(backend, labels), backend=backend)
    loss.backward()
    ref = naive_linear_cross_entropy(hidden, weight, labels)
    assert rel_err(loss, ref) < 1e-5
    assert torch.count_nonzero(h.grad.abs().sum(1)) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    device = device_of(backend)
    h = torch.randn(0, 8, device=device, requires_grad=True)
    w = torch.randn(13, 8, device=device, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long, device=device)
    loss = fused_linear_cross_entropy(h, w, labels, backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.shape == (0, 8) and torch.all(w.grad == 0)
    per_token = fused_linear_cross_entropy(h, w, labels, backend=backend, reduction="none")
    assert per_token.shape == (0,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_hidden(backend):
    hidden, weight, labels, _ = make_inputs(d=19)
    wide = torch.randn(hidden.shape[0], 40, dtype=torch.float32)
    wide[:, 3:22] = hidden.float()
    h_view = on(backend, wide).detach().requires_grad_()
    loss = fused_linear_cross_entropy(h_view[:, 3:22], *on(backend, weight.float(), labels), backend=backend)
    loss.backward()
    ref_h = hidden.clone().requires_grad_()
    ref = naive_linear_cross_entropy(ref_h, weight, labels)
    ref.backward()
    assert rel_err(loss, ref) < 1e-5
    assert rel_err(h_view.grad[:, 3:22], ref_h.grad) < 1e-5
    assert torch.all(h_view.grad[:, :3] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weight_does_no_weight_gradient_work(backend, monkeypatch):
    from lce_patch.ops.core.grads import GradAccumulator

    seen = []
    original = GradAccumulator.__init__

    def spy(self, hidden, weight, bias, needs_hidden, needs_weight, needs_bias, *args):
        seen.append(needs_weight)
        original(self, hidden, weight, bias, needs_hidden, needs_weight, needs_bias, *args)

    monkeypatch.setattr(GradAccumulator, "__init__", spy)
    hidden, weight, labels, _ = make_inputs()
    device = device_of(backend)
    h, w = leaf(hidden, torch.float32, device=device), leaf(weight, torch.float32, requires_grad=False, device=device)
    fused_linear_cross_entropy(h, w, on(backend, labels), backend=backend).backward()
    assert w.grad is None and h.grad is not None and seen == [False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_forward_matches(backend):
    hidden, weight, labels, _ = make_inputs()
    device = device_of(backend)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(
            leaf(hidden, torch.float32, device=device), leaf(weight, torch.float32, device=device),
            on(backend, labels), backend=backend,
        )  # fmt: skip
    assert not loss.requires_grad
    assert rel_err(loss, naive_linear_cross_entropy(hidden, weight, labels)) < 1e-5


def test_backends_agree_with_each_other():
    if len(BACKENDS) < 2:
        pytest.skip("Triton unavailable")
    hidden, weight, labels, b = make_inputs(bias=True)
    results = []
    for backend in BACKENDS:
        h, w, bb = (leaf(t, torch.float32, device=device_of(backend)) for t in (hidden, weight, b))
        loss = fused_linear_cross_entropy(h, w, on(backend, labels), bias=bb, softcap=3.0, z_loss=1e-3, backend=backend)
        loss.backward()
        results.append((loss, h.grad, w.grad, bb.grad))
    for a, b_ in zip(*results):
        assert rel_err(a, b_) < 1e-6


def test_autocast_behaves_like_linear_under_autocast():
    hidden, weight, labels, _ = make_inputs()
    h, w = leaf(hidden, torch.float32), leaf(weight, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(h, w, labels, backend="torch")
    loss.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    ref = naive_linear_cross_entropy(hidden.bfloat16().double(), weight.bfloat16().double(), labels)
    # bf16 operands, fp32 accumulation: the logits match the rounded-operand reference to ~1e-3
    assert rel_err(loss, ref) < 1e-2


def test_second_backward_through_scalar_loss_is_refused():
    hidden, weight, labels, _ = make_inputs()
    loss = fused_linear_cross_entropy(leaf(hidden, torch.float32), leaf(weight, torch.float32), labels, backend="torch")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_module_wrapper():
    from lce_patch import FusedLinearCrossEntropy

    hidden, weight, labels, b = make_inputs(bias=True)
    module = FusedLinearCrossEntropy(softcap=4.0, reduction="sum", backend="torch")
    loss = module(hidden.float(), weight.float(), labels, bias=b.float())
    ref = naive_linear_cross_entropy(hidden, weight, labels, bias=b, softcap=4.0, reduction="sum")
    assert rel_err(loss, ref) < 1e-5
    assert "softcap=4.0" in repr(module)
    with pytest.raises(ValueError, match="reduction must be one of"):
        FusedLinearCrossEntropy(reduction="bad")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_items", [0, 0.0, torch.tensor(0), torch.tensor(0.0)], ids=repr)
def test_num_items_in_batch_zero_is_a_zero_loss_when_every_label_is_ignored(backend, num_items):
    """Trainer's count is 0 only for a window with no valid label: then, as for the mean of an
    all-ignored batch, the loss is 0 with zero gradients; a number or a tensor behave the same."""
    hidden, weight, labels, _ = make_inputs()
    labels[:] = -100
    h, w = (leaf(t, torch.float32, device=device_of(backend)) for t in (hidden, weight))
    if isinstance(num_items, torch.Tensor):
        num_items = on(backend, num_items)
    loss = fused_linear_cross_entropy(h, w, on(backend, labels), num_items_in_batch=num_items, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert not h.grad.any() and not w.grad.any()


@pytest.mark.parametrize(
    "options", [{}, {"softcap": 2.5, "label_smoothing": 0.1, "z_loss": 1e-3}, {"reduction": "none"}]
)
def test_float64_computes_in_float64(options):
    """float64 inputs run the torch backend in float64 (statistics too): ~1e-12 of the reference."""
    hidden, weight, labels, bias = make_inputs(bias=True)
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref = naive_linear_cross_entropy(ref_leaves[0], ref_leaves[1], labels, bias=ref_leaves[2], **options)
    upstream = torch.randn_like(ref) if ref.dim() else torch.tensor(1.3, dtype=torch.float64)
    ref.backward(upstream)
    ours = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = fused_linear_cross_entropy(ours[0], ours[1], labels, bias=ours[2], chunk_size=8, **options)
    assert loss.dtype == torch.float64
    loss.backward(upstream)
    assert rel_err(loss, ref) < 1e-12
    for got, want in zip(ours, ref_leaves):
        assert got.grad.dtype == torch.float64 and rel_err(got.grad, want.grad) < 1e-12
    out = fused_linear_log_probs(hidden, weight, labels, return_entropy=True)
    assert out.log_probs.dtype == torch.float64 and out.entropy.dtype == torch.float64
