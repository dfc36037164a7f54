"""The op's label preparation (core/labels.py): the one-launch Triton kernel against the torch form, value for
value, on fresh random labels of sizes around the kernel's block, with and without a row selection, a shard, the
causal shift and each reduction; and bad labels, counts and ``num_items_in_batch`` refused by name on both."""

from __future__ import annotations

import pytest
import torch

from lce_patch.ops.core.labels import LabelShard, prepare_labels
from lce_patch.ops.linear_cross_entropy import shift_labels

from .devices import BACKENDS, GPU, on

TRITON = "triton" in BACKENDS
VOCAB = 97


def _labels(n: int, ignore_index: int, seed: int, ignored: float = 0.3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignored] = ignore_index
    return labels


def _prepare(backend: str, labels: torch.Tensor, **kwargs):
    num_items = kwargs.pop("num_items", None)
    options = dict(
        vocab_size=VOCAB, ignore_index=-100, select=False, num_valid_tokens=None, reduction="mean",
        scale_dtype=torch.float32, shard=None, op_name="test",
    )  # fmt: skip
    options.update(kwargs)
    result = prepare_labels(
        on(backend, labels), num_items=on(backend, num_items), use_triton=backend == "triton", **options
    )
    return [None if t is None else t.cpu() for t in result]


def _reference(labels: torch.Tensor, ignore_index: int, shard: LabelShard | None, select: bool):
    valid = labels != ignore_index
    ids = labels.clone()
    if shard is not None:
        local = labels - shard.start
        owned = (local >= 0) & (local < shard.rows)
        ids = torch.where(owned, local, -1 if ignore_index != -1 else -2)
        ids[~valid] = ignore_index
    rows = torch.nonzero(valid).flatten() if select and not valid.all() else None
    return ids, rows, ids if rows is None else ids[rows], valid.sum()


def _row_length(n: int) -> int:
    """The longest row of at most 50 labels that tiles ``n`` (rows of 23 for 2047, 3 for 2049, 1 for 1)."""
    return max((k for k in range(1, 51) if n % k == 0), default=1)


@pytest.mark.skipif(not TRITON, reason="Triton is not usable here")
@pytest.mark.parametrize("n", [0, 1, 7, 2047, 2048, 2049, 4500])
@pytest.mark.parametrize("shard", [None, LabelShard(30, 41)], ids=["whole", "shard"])
@pytest.mark.parametrize("select", ["none", "count_given", "counted"])
@pytest.mark.parametrize("ignore_index", [-100, -1])
@pytest.mark.parametrize("shift", [False, True], ids=["as_given", "shifted"])
def test_kernel_equals_torch_form(n, shard, select, ignore_index, shift):
    labels = _labels(n, ignore_index, seed=n + 3)
    shift_rows = _row_length(n) if shift and n else 0
    # what the op's labels are once shifted: each row's targets move one position left (Hugging Face's shift)
    targets = shift_labels(labels.view(-1, shift_rows), ignore_index).view(-1) if shift_rows else labels
    count = int((targets != ignore_index).sum())
    kwargs = dict(
        ignore_index=ignore_index, shard=shard, select=select != "none",
        num_valid_tokens=count if select == "count_given" else None, shift_rows=shift_rows,
    )  # fmt: skip
    fused = _prepare("triton", labels, **kwargs)
    plain = _prepare("torch", labels, **kwargs)
    for got, want in zip(fused, plain, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.dtype == want.dtype and torch.equal(got, want)
    ids, rows, row_labels, num_valid = _reference(targets, ignore_index, shard, select != "none")
    assert torch.equal(fused[0], ids) and torch.equal(fused[2], row_labels) and int(fused[3]) == num_valid
    assert (fused[1] is None) == (rows is None) and (rows is None or torch.equal(fused[1], rows))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "reduction, num_items, expected",
    [
        ("mean", None, lambda count: 1.0 / count),
        ("sum", None, lambda count: 1.0),
        (None, None, None),
        ("mean", torch.tensor(61.0, dtype=torch.float64), lambda count: 1.0 / 61.0),
        ("sum", torch.tensor(7), lambda count: 1.0 / 7.0),
        ("mean", torch.tensor(3.0, dtype=torch.bfloat16), lambda count: 1.0 / 3.0),
    ],
)
def test_the_reduction_factor(backend, reduction, num_items, expected):
    labels = _labels(300, -100, seed=5)
    count = int((labels != -100).sum())
    scale = _prepare(backend, labels, reduction=reduction, num_items=num_items)[4]
    if expected is None:
        assert scale is None
        return
    want = torch.tensor(expected(count), dtype=torch.float32)
    assert scale.dtype == torch.float32 and torch.equal(scale, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_to_count_gives_a_zero_factor(backend):
    labels = torch.full((50,), -100)
    for reduction, num_items in (("mean", None), ("mean", torch.tensor(0.0))):
        scale = _prepare(backend, labels, reduction=reduction, num_items=num_items, select=True)[4]
        assert float(scale) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "labels_change, kwargs, message",
    [
        (lambda y: y.__setitem__(3, VOCAB), {}, f"label {VOCAB} is outside \\[0, {VOCAB}\\)"),
        (lambda y: y.__setitem__(3, -5), {}, "label -5 is outside"),
        (None, {"select": True, "num_valid_tokens": "count-1"}, "num_valid_tokens=.* but .* labels"),
        (None, {"select": True, "num_valid_tokens": "count+1"}, "num_valid_tokens=.* but .* labels"),
        (None, {"num_items": torch.tensor(-2.0)}, "num_items_in_batch must be finite and > 0"),
        (None, {"num_items": torch.tensor(float("nan"))}, "num_items_in_batch must be finite and > 0"),
        (None, {"num_items": torch.tensor(0)}, "num_items_in_batch must be finite and > 0"),
    ],
)
def test_bad_values_are_refused_by_name(backend, labels_change, kwargs, message):
    if backend == "triton" and GPU:
        pytest.skip("on CUDA the checks are asynchronous device asserts (test_cuda.py runs one in a subprocess)")
    labels = _labels(2100, -100, seed=9)
    if labels_change is not None:
        labels_change(labels)
    count = int((labels != -100).sum())
    if isinstance(kwargs.get("num_valid_tokens"), str):
        kwargs = {**kwargs, "num_valid_tokens": count + (1 if kwargs["num_valid_tokens"].endswith("+1") else -1)}
    with pytest.raises(ValueError, match=message):
        _prepare(backend, labels, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_shift_checks_the_labels_it_keeps(backend):
    """Shifted, each row's first label is never a target (Hugging Face drops it unchecked), every other one is."""
    labels = _labels(2100, -100, seed=11)
    labels[30] = VOCAB  # the first label of the second row of 30: dropped by the shift
    result = _prepare(backend, labels, shift_rows=30, reduction="sum", select=True)
    targets = shift_labels(labels.view(-1, 30), -100).view(-1)
    assert torch.equal(result[2], targets[targets != -100]) and int(result[3]) == int((targets != -100).sum())
    if backend == "triton" and GPU:
        return  # a bad label is a device assert there (test_cuda.py)
    labels[31] = VOCAB  # the target of position 30
    with pytest.raises(ValueError, match=f"label {VOCAB} is outside"):
        _prepare(backend, labels, shift_rows=30)
