"""The cross-entropy op's chunking: any chunk size gives the same result, and the default chunk policy
(folded tails, rows that fill the GPU, forward-only buffers) chooses what its measurements say.
"""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_cross_entropy

from .devices import BACKENDS, device_of
from .helpers import check_against_reference, leaf, make_inputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_size", [1, 5, 37, 1000])
def test_chunk_size_does_not_change_the_result(backend, chunk_size):
    check_against_reference({"softcap": 4.0}, backend=backend, chunk_size=chunk_size)


def test_chunk_spans_fold_a_short_tail_only_at_the_default():
    from lce_patch.ops.core.chunking import chunk_spans

    assert chunk_spans(8200, 1024, fold_tail=True)[-2:] == ((6144, 7168), (7168, 8200))  # 8 chunks, not 9
    assert len(chunk_spans(8200, 1024)) == 9 and chunk_spans(8200, 1024)[-1] == (8192, 8200)  # a cap as given
    assert len(chunk_spans(8319, 1024, fold_tail=True)) == 8  # 127 rows: less than one 128-row tile
    assert len(chunk_spans(8320, 1024, fold_tail=True)) == 9  # a whole tile: a chunk of its own
    assert len(chunk_spans(8192, 1152, fold_tail=True)) == 8  # Qwen2.5's 7 x 1152 + 128 (its memory target)
    assert len(chunk_spans(260, 64, fold_tail=True)) == 4  # 4 rows <= 64 / 8 (the torch backend's small chunks)
    assert len(chunk_spans(265, 64, fold_tail=True)) == 5  # 9 rows > 64 / 8
    assert chunk_spans(100, 1024, fold_tail=True) == ((0, 100),)
    assert chunk_spans(0, 1024, fold_tail=True) == ()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [{"softcap": 4.0}, {"reduction": "none"}])
def test_default_chunks_with_a_folded_tail_give_the_reference_result(backend, options, monkeypatch):
    from lce_patch.ops.core import chunking
    from lce_patch.ops.linear_cross_entropy import chunked

    seen = []
    real = chunking.resolve_chunks
    monkeypatch.setattr(chunking, "default_chunk_rows", lambda *args, **kwargs: 16)
    monkeypatch.setattr(chunked, "resolve_chunks", lambda *args: seen.append(real(*args)) or seen[-1])
    check_against_reference(options, backend=backend, chunk_size=None, size={"n": 33})
    assert seen and all(chunks == ((0, 16), (16, 33)) for chunks in seen)  # 1 row folded into the last chunk


def test_a_vocabulary_shard_takes_the_budget_once_per_rank():
    from lce_patch.ops.core.chunking import default_chunk_rows

    def rows(num_rows, vocab_rows, hidden_size, ranks):
        return default_chunk_rows(num_rows, vocab_rows, torch.bfloat16, True, hidden_size, 132, budget_scale=ranks)

    # Gemma-2-2B's head over 4 ranks (64,000 rows each), 3070 of 4096 rows with a label: two chunks of the plain
    # budget (256 MiB: 2048 rows, evened to 1792 + 1278), one of four budgets; at 8192 tokens three, then one.
    assert rows(3070, 64000, 2304, 1) == 1792 and rows(3070, 64000, 2304, 4) == 3070
    assert rows(6142, 64000, 2304, 4) == 6142 and rows(6142, 64000, 2304, 1) < 6142 / 2
    # Llama-3.2-1B's (32,064 rows a rank): one chunk at 4096 tokens either way, one at 16384 only with the scale
    assert rows(3070, 32064, 2048, 1) == rows(3070, 32064, 2048, 4) == 3070
    assert rows(12286, 32064, 2048, 4) == 12286 and rows(12286, 32064, 2048, 1) < 12286
    # the buffer stays within the scaled budget, so past it the chunks come back
    assert rows(30000, 64000, 2304, 4) * 64000 * 2 <= 4 * 256 * 2**20


def _shard_chunk_plans(rank, world_size, backend):
    import torch.distributed as dist

    from lce_patch import VocabShard
    from lce_patch.ops.core import chunking
    from lce_patch.ops.linear_cross_entropy import chunked

    seen = []
    real = chunking.resolve_chunks
    chunked.resolve_chunks = lambda *args: seen.append(args[-1]) or real(*args)
    try:
        total = 40
        bounds = [round(total * r / world_size) for r in range(world_size + 1)]  # 3 ranks: 13, 14, 13 rows
        start, stop = bounds[rank], bounds[rank + 1]
        device = device_of(backend)
        hidden = leaf(torch.randn(6, 8), torch.float32, device=device)
        weight = leaf(torch.randn(stop - start, 8), torch.float32, device=device)
        labels = torch.tensor([0, 23, 39, -100, 25, 1], device=device)
        shard = VocabShard(start=start, total=total, group=None)
        fused_linear_cross_entropy(hidden, weight, labels, vocab_shard=shard, backend=backend).backward()
        with torch.no_grad():  # evaluation of a trainable weight plans with its spare bytes: the same on every rank
            fused_linear_cross_entropy(hidden, weight, labels, vocab_shard=shard, backend=backend)
    finally:
        chunked.resolve_chunks = real
    largest = -(-total // world_size)
    assert seen == [(largest, world_size)] * 2, seen
    plans = [None] * world_size
    dist.all_gather_object(plans, seen)
    assert all(plan == seen for plan in plans)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_rank_of_a_vocabulary_shard_plans_the_same_chunks(backend, world_size):
    """The op plans a shard's chunks for the group's largest shard (uneven shards included: each chunk exchanges
    statistics, so the ranks' chunks must agree) with the budget once per rank."""
    from tests.multiprocess import run_ranks

    run_ranks(_shard_chunk_plans, world_size, backend)


def test_default_chunk_rows_fill_the_gpu_for_thin_hidden_sizes():
    from lce_patch.ops.core.chunking import default_chunk_rows

    def rows(num_rows, hidden_size, vocab_size, num_sms=132):
        return default_chunk_rows(num_rows, vocab_size, torch.bfloat16, True, hidden_size, num_sms)

    # H100 (132 SMs): Gemma-2 (D = 2304) gets 1792-row chunks (7022 rows: 4 chunks), Qwen2.5 (D = 3584)
    # 1152, Llama-3 the 1024-row floor; chunks are whole multiples of 128 rows.
    assert rows(7022, 2304, 256000) == 1792
    assert rows(8192, 2304, 256000) == 1792  # not 5 x 1664 (even, but 117 dh tiles for 132 SMs)
    assert rows(8192, 3584, 152064) == 1152  # 7 x 1152 + 128, not 8 x 1024
    assert rows(7022, 3584, 152064) == 1152
    assert rows(7022, 4096, 128256) == 1024
    assert rows(8192, 4096, 128256) == 1024
    # A hidden size that is not a multiple of 256 takes a whole tile for its last columns: Qwen2.5-0.5B (D = 896,
    # 4 column tiles) fills one wave of 132 SMs at 33 x 128 rows, rounded down to 4096 (a multiple of 256: not
    # the 4864 that (SMs x 128 x 256) / D rounded up gave, 152 tiles); Gemma-3-1B (D = 1152, 5 tiles) 3328.
    assert rows(16384, 896, 151936) == 4096
    assert rows(16384, 1024, 151936) == 4096
    assert rows(16384, 1152, 262144) == 3328
    assert rows(16384, 2048, 151936) == 2048
    assert rows(2100, 3584, 152064) == 1152  # above the fill rows chunks are still made even (2 x 1152)
    assert rows(2100, 4096, 128256) == 768  # D >= 4096: 3 even chunks, as before (no thin-D fill rows)
    assert rows(1000, 2304, 256000) == 1000  # never more rows than there are
    assert rows(7022, 2304, 256000, num_sms=None) == 1024  # unknown GPU: the 1024-row floor only
    assert rows(70001, 4096, 128256) == 4608  # at most 16 bf16 roundings of dW: 16 chunks, of 256-row multiples
    assert rows(112347, 2304, 256000) == 7168  # not 7040 (55 x 128), which cuBLAS runs slowly on Gemma-2's head
    assert rows(131072, 4096, 128256) == 8192
    assert default_chunk_rows(7022, 256000, torch.bfloat16, False, 2304, 132) < 1024  # torch backend: budget


@pytest.mark.parametrize(
    ("num_rows", "hidden_size", "vocab_size"),
    [(7022, 4096, 128256), (7022, 2304, 256000), (3511, 4096, 128256), (14043, 3584, 152064), (500, 64, 1000)],
)
def test_forward_only_chunks_use_the_bytes_of_the_missing_dw_and_no_more(num_rows, hidden_size, vocab_size):
    from lce_patch.ops.core.chunking import default_chunk_rows

    weight_bytes = vocab_size * hidden_size * 2
    train = default_chunk_rows(num_rows, vocab_size, torch.bfloat16, True, hidden_size, 132)
    evaluate = default_chunk_rows(num_rows, vocab_size, torch.bfloat16, True, hidden_size, 132, weight_bytes)
    bytes_per_row = vocab_size * 2
    assert evaluate >= train
    assert evaluate * bytes_per_row <= train * bytes_per_row + weight_bytes  # never above a training step
    assert evaluate == num_rows or -(-num_rows // evaluate) < -(-num_rows // train)  # fewer chunks
    assert evaluate == num_rows or evaluate % 128 == 0


def test_forward_only_default_chunk_counts_the_dw_only_of_a_trainable_weight(monkeypatch):
    from lce_patch.ops.core import chunking

    seen = []
    real = chunking.default_chunk_rows
    monkeypatch.setattr(chunking, "default_chunk_rows", lambda *a, **k: seen.append(k["spare_bytes"]) or real(*a, **k))
    hidden, weight, labels, _ = make_inputs()
    h = leaf(hidden, torch.float32)
    for trainable in (True, False):
        w = leaf(weight, torch.float32, requires_grad=trainable)
        with torch.no_grad():
            fused_linear_cross_entropy(h, w, labels, backend="torch")
        fused_linear_cross_entropy(h, w, labels, backend="torch").backward()
    assert seen == [weight.numel() * 4, 0, 0, 0]
