"""What the op tests share: float64 problems of each op, the leaves built from them, and the comparisons with
the float64 references (``rel_err`` brings its operands back to the CPU itself)."""

from __future__ import annotations

import torch

from lce_patch import fused_linear_cross_entropy
from lce_patch.ops.linear_cross_entropy import naive_linear_cross_entropy

from .devices import CPU, device_of

# The divergence ops' problems: rows, the student's and the teacher's hidden sizes, the vocabulary, and the sparse
# op's candidates per row
N, D, D_TEACHER, V, K = 13, 16, 24, 37, 5


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    denom = expected.norm()
    return float((actual - expected).norm() / denom) if denom > 0 else float((actual - expected).norm())


def make_inputs(n=37, d=19, v=101, *, batch=None, bias=False, ignore_every=5, seed=None):
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    shape = (batch, n) if batch else (n,)
    hidden = torch.randn(*shape, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5 * 2
    labels = torch.randint(0, v, shape, generator=gen)
    if ignore_every:
        labels.view(-1)[::ignore_every] = -100
    b = torch.randn(v, generator=gen, dtype=torch.float64) if bias else None
    return hidden, weight, labels, b


def cross_entropy_problem(seed: int, *, bias: bool = False, leading=(16,), ignore_index: int = -100) -> dict:
    """Float64 keyword inputs of the suite of every op (test_every_op.py): hidden [*leading, 16], weight
    [48, 16], labels shaped ``leading`` with every 4th row's ``ignore_index`` (12 of 16 valid by default), and
    bias [48] with ``bias``."""
    rows = int(torch.tensor(leading).prod())
    hidden, weight, labels, b = make_inputs(rows, 16, 48, bias=bias, ignore_every=4, seed=seed)
    labels[labels == -100] = ignore_index
    problem = dict(hidden=hidden.reshape(*leading, -1), weight=weight, labels=labels.reshape(leading))
    if bias:
        problem["bias"] = b
    return problem


def leaf(t, dtype, requires_grad=True, device=CPU):
    return None if t is None else t.to(device, dtype).detach().requires_grad_(requires_grad)


def check_against_reference(
    options, *, backend, dtype=torch.float32, tol=1e-5, bias=False, batch=None, chunk_size=8, device=None, size=None
):
    device = device_of(backend) if device is None else device
    hidden, weight, labels, b = make_inputs(bias=bias, batch=batch, **(size or {}))
    labels[labels == -100] = options.get("ignore_index", -100)
    reduction = options.get("reduction", "mean")
    ref_options = {k: v for k, v in options.items() if k not in ("skip_ignored", "num_valid_tokens")}
    ref = naive_linear_cross_entropy(
        hidden.requires_grad_(),
        weight.requires_grad_(),
        labels,
        bias=b.requires_grad_() if bias else None,
        **ref_options,
    )
    upstream = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    ref_inputs = [hidden, weight] + ([b] if bias else [])
    ref_grads = torch.autograd.grad(ref, ref_inputs, upstream)

    h, w, bb = (leaf(t, dtype, device=device) for t in (hidden, weight, b))
    if isinstance(options.get("num_items_in_batch"), torch.Tensor):
        options = {**options, "num_items_in_batch": options["num_items_in_batch"].to(device)}
    out = fused_linear_cross_entropy(
        h, w, labels.to(device), bias=bb, backend=backend, chunk_size=chunk_size, **options
    )
    assert out.dtype == torch.float32 and out.shape == ref.shape
    out.backward(upstream.to(device, torch.float32))
    assert rel_err(out, ref) < tol
    for name, got, want in zip(("hidden", "weight", "bias"), (h, w, bb), ref_grads):
        assert got.grad is not None and got.grad.shape == want.shape, name
        assert got.grad.dtype == dtype, name
        assert rel_err(got.grad, want) < tol, (name, rel_err(got.grad, want))


OPTION_SETS = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"num_items_in_batch": 41},
    {"softcap": 2.5},
    {"logit_scale": 0.37},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-2},
    {"ignore_index": 3},
    {"softcap": 3.0, "logit_scale": 1.7, "label_smoothing": 0.2, "z_loss": 1e-3, "reduction": "none"},
    {"softcap": 3.0, "label_smoothing": 0.05, "z_loss": 1e-3, "num_items_in_batch": 17},
]


def record_row_factors(monkeypatch) -> list:
    """Whether each chunk_stats call of the op got a ``row_factor`` (the one-pass gradient)."""
    from lce_patch.ops.linear_cross_entropy import chunked

    seen = []
    original = chunked.chunk_stats

    def spy(raw, labels, transform, out, grad_scale, use_triton, target_raw=None, row_factor=None, **rest):
        seen.append(row_factor is not None)
        return original(raw, labels, transform, out, grad_scale, use_triton, target_raw, row_factor, **rest)

    monkeypatch.setattr(chunked, "chunk_stats", spy)
    return seen


# The low-rank term of a LoRA adapter on the head: LoRA's alpha / r
LORA_SCALE = 2.0  # LoRA's alpha / r


def make_lora_inputs(n=37, d=19, v=101, rank=4, *, batch=None, seed=None, bias=False):
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    shape = (batch, n) if batch else (n,)
    hidden = torch.randn(*shape, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5 * 2
    lora_a = torch.randn(rank, d, generator=gen, dtype=torch.float64) / d**0.5
    lora_b = torch.randn(v, rank, generator=gen, dtype=torch.float64) / rank**0.5
    labels = torch.randint(0, v, shape, generator=gen)
    labels.view(-1)[::5] = -100
    b = torch.randn(v, generator=gen, dtype=torch.float64) if bias else None
    return hidden, weight, lora_a, lora_b, labels, b


def lora_leaves(tensors, dtype, trainable, device=CPU):
    return [
        None if t is None else t.to(device, dtype).detach().requires_grad_(wants)
        for t, wants in zip(tensors, trainable)
    ]


def lora_reference_loss(hidden, weight, lora_a, lora_b, labels, bias, options):
    """The plain float64 op on the concatenated operands: the same logits, every gradient by autograd."""
    low = LORA_SCALE * hidden @ lora_a.t()
    return naive_linear_cross_entropy(
        torch.cat([hidden, low], -1), torch.cat([weight, lora_b], 1), labels, bias=bias, **options
    )


LOW_RANK_OPTION_SETS = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"num_items_in_batch": 41},
    {"softcap": 2.5, "logit_scale": 0.7},
    {"label_smoothing": 0.1, "z_loss": 1e-2},
    {"skip_ignored": True},
    {"skip_ignored": True, "reduction": "none", "softcap": 3.0},
]


def check_low_rank(options, *, backend, weight_trainable, device=None, dtype=torch.float32, tol=1e-5, size=None):
    """The op with a LoRA-built low-rank term against the float64 concatenation, every gradient."""
    device = device_of(backend) if device is None else device
    hidden, weight, lora_a, lora_b, labels, bias = make_lora_inputs(bias=True, **(size or {}))
    trainable = (True, weight_trainable, True, True, True)
    ref_leaves = lora_leaves((hidden, weight, lora_a, lora_b, bias), torch.float64, trainable)
    ref_options = {k: v for k, v in options.items() if k != "skip_ignored"}
    ref = lora_reference_loss(*ref_leaves[:4], labels, ref_leaves[4], ref_options)
    upstream = torch.randn_like(ref) if ref.dim() else torch.tensor(1.7, dtype=torch.float64)
    wanted = [t for t in ref_leaves if t is not None and t.requires_grad]
    ref_grads = torch.autograd.grad(ref, wanted, upstream)

    h, w, b = (t.to(device, dtype).detach() for t in (hidden, weight, bias))
    h.requires_grad_(), w.requires_grad_(weight_trainable), b.requires_grad_()
    a, b_up = (t.to(device, torch.float32).detach().requires_grad_() for t in (lora_a, lora_b))  # PEFT's fp32
    out = fused_linear_cross_entropy(
        h,
        w,
        labels.to(device),
        bias=b,
        low_rank_hidden=LORA_SCALE * h.float() @ a.t(),
        low_rank_weight=b_up,
        backend=backend,
        chunk_size=8 if size is None else 128,
        **options,
    )
    assert out.dtype == torch.float32 and out.shape == ref.shape
    out.backward(upstream.to(device, torch.float32))
    assert rel_err(out, ref) < tol
    got = [t for t in (h, w, a, b_up, b) if t.requires_grad]
    for name, tensor, want in zip(("hidden", "weight", "A", "B", "bias"), got, ref_grads):
        assert tensor.grad is not None, name
        assert rel_err(tensor.grad, want) < tol, (name, rel_err(tensor.grad, want))
    if not weight_trainable:
        assert w.grad is None


def divergence_problem(seed: int, *, vocab_teacher: int = V, bias: bool = False, leading=(N,)):
    gen = torch.Generator().manual_seed(seed)
    rows = int(torch.tensor(leading).prod())
    problem = dict(
        hidden=torch.randn(*leading, D, generator=gen, dtype=torch.float64),
        weight=torch.randn(V, D, generator=gen, dtype=torch.float64) / 2,
        teacher_hidden=torch.randn(*leading, D_TEACHER, generator=gen, dtype=torch.float64),
        teacher_weight=torch.randn(vocab_teacher, D_TEACHER, generator=gen, dtype=torch.float64) / 2,
    )
    if bias:
        problem["bias"] = torch.randn(V, generator=gen, dtype=torch.float64)
        problem["teacher_bias"] = torch.randn(vocab_teacher, generator=gen, dtype=torch.float64)
    mask = torch.rand(rows, generator=gen) > 0.3
    mask[0] = True
    problem["mask"] = mask.reshape(leading)
    return problem


def sparse_divergence_problem(seed: int, *, bias: bool = False, leading=(N,), padded: bool = True) -> dict:
    """Float64 inputs: teacher log-probabilities of K candidates drawn from a wider softmax (so they do not sum
    to 1), candidates close to the student's likely tokens; with ``padded``, padded slots (id -1, garbage
    log-probability), a position with no candidate, and a repeated id."""
    gen = torch.Generator().manual_seed(seed)
    rows = int(torch.tensor(leading).prod())
    hidden = torch.randn(rows, D, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64) / 2
    ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(rows)])
    logprobs = torch.log_softmax(torch.randn(rows, K + 3, generator=gen, dtype=torch.float64) * 2, -1)[:, :K]
    mask = torch.ones(rows, K, dtype=torch.bool)
    if padded:
        mask = torch.rand(rows, K, generator=gen) > 0.25
        mask[:, 0] = True
        mask[1] = False  # a position without any candidate
        ids[3, 2] = ids[3, 1]  # a repeated candidate
        mask[3, 1:3] = True
        ids[~mask] = -1
        logprobs = logprobs.masked_fill(~mask, float("nan"))
    problem = dict(
        hidden=hidden.reshape(*leading, D),
        weight=weight,
        candidate_ids=ids.reshape(*leading, K),
        teacher_logprobs=logprobs.reshape(*leading, K),
        candidate_mask=mask.reshape(*leading, K),
    )
    if bias:
        problem["bias"] = torch.randn(V, generator=gen, dtype=torch.float64)
    return problem
