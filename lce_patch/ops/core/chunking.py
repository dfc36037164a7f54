"""The chunk-size policy: how many token rows each chunk of an op's ``[chunk, V]`` logits buffer holds.

A chunk must be long enough for cuBLAS to run its three GEMMs near full speed (about 1024 rows, more for a
thin hidden size), short enough that the buffer stays within a memory budget (256 MiB of logits on the
Triton path), and, in bf16, the chunks few enough that dW's rounding per chunk stays below the unfused
path's error. The constants below carry the measurements that chose them (benchmarks/NOTES.md).
"""

from __future__ import annotations

import torch

# Default size of the logits buffer: 256 MiB, but never fewer than 1024 token rows. cuBLAS runs
# the three GEMM shapes near its full-size rate from about 1024 rows (K of the dW GEMM, M of the
# dh GEMM); smaller chunks cost 10-15% on the H100 (Gemma-2: 56.7 ms at 512 rows vs 51.7 ms at
# 1024). See benchmarks/NOTES.md.
DEFAULT_LOGITS_BUDGET_BYTES = 256 * 1024 * 1024
MIN_DEFAULT_CHUNK_ROWS = 1024
# Thin hidden sizes need more rows: a chunk's dh GEMM writes a [C, D] output, which cuBLAS's Hopper
# kernels cover in tiles of about 128 x 256, one per SM at a time; with fewer tiles than SMs, SMs idle.
# On the H100 Gemma-2 (D = 2304) ran 86% of its floor at 1024-row chunks and 91-92% at 1760-1792 rows
# (NOTES v12). The default is at least the rows whose tiles fill one wave, (SMs // ceil(D / 256)) x 128
# (H100 and H200, 132 SMs: 1792 for D = 2304; 1152 for D = 3584; 1024 for D = 4096), also when N rows
# would split into more even chunks of fewer rows; above LARGE_CHUNK_ROWS rounded down to a multiple of
# 256 rows, so that the rounding below does not take it past the wave. A hidden size that is not a
# multiple of 256 counts a whole tile for its last columns: D = 896 (Qwen2.5-0.5B) gets 4096 rows, not the
# 4864 that (SMs x 128 x 256) / D gave once rounded up to 256 rows, D = 1024 4096 (not 4352) and D = 1152
# (Gemma-3-1B) 3328 (not 3840). The tile is a proxy (cuBLAS ran these dh GEMMs in 192 x 192 tiles on the
# H200); the sizes stand on measurement: at 16384 tokens, 4 alternating rounds, 23.0 vs 23.7 ms and 1476 vs
# 1698 MiB (D = 896), 25.0 vs 25.9 ms and 1517 vs 1591 MiB (D = 1024), and for D = 1152 no difference
# outside the clock's noise (best rounds 47.7 ms both) at 2276 vs 2532 MiB (NOTES v23).
GEMM_TILE_ROWS = 128
GEMM_TILE_COLUMNS = 256
# Chunk sizes are multiples of 128 rows (cuBLAS's tile height): 1008-row chunks ran 2-3% slower than
# 1024-row ones forward+backward and 6-8% slower forward-only on the Llama-3 and Qwen2.5 shapes.
CHUNK_ROW_MULTIPLE = 128
# Long chunks (the N/16 rule below, at 100k+ tokens) are multiples of 256 rows: on the H100 the Gemma-2
# head (V 256,000, D 2,304) at N = 131,072 ran 7,040-row chunks (55 x 128) at 685.8 ms with skip_ignored and
# 823.3 ms without, against 626.6-641.2 ms and 723.8-747.1 ms for 6,912, 7,168, 7,424, 7,680 and 8,192
# rows (multiples of 256) of the same data: cuBLAS picks a slow kernel for that odd multiple of 128.
LARGE_CHUNK_ROWS = 2048
LARGE_CHUNK_ROW_MULTIPLE = 256
# A bf16 dW is rounded once per chunk as the chunks' products are added into it. Past ~16 chunks
# those roundings exceed the unfused path's own gradient error (measured on the H100: N=70001
# in 69 chunks gave a dW error of 1.2e-2 vs 2.1e-3 in one chunk), so the default chunk grows with
# N instead: at most 16 bf16 roundings, at the cost of N*V*2/16 bytes of logits buffer.
MAX_BF16_DW_CHUNKS = 16
# Every chunk costs a read and write of the whole dW (its product is added into it) and, for a few
# rows, two GEMMs that stream all of W: a last chunk of 8 rows costs as much as ~250 rows of work.
# At the default, a remainder of less than one 128-row tile (and at most 1/8 of the chunk) joins the
# last full chunk instead (N = 8200 on Llama-3-8B: 7 x 1024 + 1032 rows, not 8 x 1024 + 8): the
# GEMMs then run the same number of tiles, and the buffer grows by fewer than 128 rows (longer tails
# would also save time, but their rows would take the Qwen2.5 shape at N = 8192 past its memory
# target). A chunk_size the user gives is kept as a cap.
TAIL_FOLD_FRACTION = 8
# A forward without gradients holds no dW: its buffer may take those bytes too (D more rows when W
# and the buffer share a dtype), so evaluation never needs more memory than a training step of the
# same batch. Fewer, longer chunks run the logits GEMM faster: on the H100, forward only, Llama-3-8B
# 11.98 -> 11.10 ms at 3584-row chunks, Qwen2.5 12.54 -> 11.55, N = 4096 6.29 -> 5.47 (NOTES v14).
# The torch row op keeps about four fp32 [C, V] temporaries beside the buffer; on the CPU a
# smaller budget keeps the fused path leaner than the unfused one even for small models.
_TORCH_TEMPORARIES_PER_LOGIT = 16
TORCH_LOGITS_BUDGET_BYTES = 32 * 1024 * 1024
# A vocabulary shard (tensor parallelism, R ranks) gets the budget R times over, so that its [C, V / R]
# buffer holds as many rows as a [C, V] buffer of R budgets would. (Every rank plans for the group's largest
# shard: each chunk exchanges statistics across the group, so all ranks must run the same chunks.) Each chunk costs the host a fixed ~10
# launches and two collectives whatever its size, and a tensor-parallel step of a small model is bound by
# the host: on four H100s (2026-11-28) the Gemma-2-2B head at 4096 tokens (a 64,000-row shard) ran in two
# chunks of the plain budget and its TP 4 step measured 1.02-1.03x the unfused head's, where the Llama-3.2-1B
# head (32,064 rows, one chunk) was level. The buffer stays a small part of what the unfused tensor-parallel
# head holds: every rank gathers the whole [N, V] logits, and upcasts them to fp32 for its loss.


def default_chunk_rows(
    num_rows: int,
    vocab_size: int,
    dtype: torch.dtype,
    use_triton: bool,
    hidden_size: int | None = None,
    num_sms: int | None = None,
    spare_bytes: int = 0,
    budget_scale: int = 1,
) -> int:
    """Token rows per chunk for ``num_rows`` processed rows: the logits budget (``budget_scale`` times over: the
    ranks of a vocabulary shard's group), at least 1024 rows on
    the Triton path and, given ``hidden_size`` and the GPU's ``num_sms``, enough rows for the dh GEMM
    to fill the GPU, and few enough chunks that a bf16 dW is rounded at most ``MAX_BF16_DW_CHUNKS``
    times; plus as many rows as ``spare_bytes`` hold (a forward without gradients passes the bytes of
    the dW it does not allocate); then the fewest chunks of that size, made as even as multiples of
    128 rows allow (256 for chunks of more than ``LARGE_CHUNK_ROWS`` rows in training)."""
    tile = CHUNK_ROW_MULTIPLE
    element_size = torch.finfo(dtype).bits // 8
    bytes_per_row = vocab_size * (element_size if use_triton else element_size + _TORCH_TEMPORARIES_PER_LOGIT)
    budget = (DEFAULT_LOGITS_BUDGET_BYTES if use_triton else TORCH_LOGITS_BUDGET_BYTES) * max(1, budget_scale)
    rows = budget // max(bytes_per_row, 1)
    if rows >= 2 * tile:
        rows = rows // tile * tile
    fill_rows = 0
    if use_triton:
        rows = max(rows, MIN_DEFAULT_CHUNK_ROWS)
        if hidden_size and num_sms:
            column_tiles = -(-hidden_size // GEMM_TILE_COLUMNS)
            fill_rows = max(num_sms // column_tiles, 1) * GEMM_TILE_ROWS
            if fill_rows > LARGE_CHUNK_ROWS:
                fill_rows = fill_rows // LARGE_CHUNK_ROW_MULTIPLE * LARGE_CHUNK_ROW_MULTIPLE
            rows = max(rows, fill_rows)
            if fill_rows <= MIN_DEFAULT_CHUNK_ROWS:  # not a thin hidden size: even chunks below it are fine
                fill_rows = 0
    if dtype == torch.bfloat16:
        rows = max(rows, round_up(-(-num_rows // MAX_BF16_DW_CHUNKS), tile))
    spare_rows = spare_bytes // max(bytes_per_row, 1)
    if spare_rows >= tile:
        rows += spare_rows // tile * tile
    rows = int(max(1, min(rows, max(num_rows, 1))))
    chunks = -(-num_rows // rows)
    if chunks > 1:  # the fewest chunks of at most ``rows``, as even as whole tiles (16 rows on torch) allow,
        # but not below the rows that fill the GPU: a shorter last chunk costs less than every chunk's dh
        # GEMM leaving SMs idle (NOTES v17: Qwen2.5 at N = 8192, 7 x 1152 + 128 rows ran 1.2 ms faster
        # than 8 x 1024; Gemma-2 4 x 1792 + 1024 1.1 ms faster than 5 x 1664).
        rows = min(rows, max(round_up(-(-num_rows // chunks), tile if use_triton else 16), fill_rows))
    if use_triton and not spare_bytes and LARGE_CHUNK_ROWS < rows < num_rows:  # rounded up: never more chunks
        rows = min(round_up(rows, LARGE_CHUNK_ROW_MULTIPLE), num_rows)
    return rows


def two_head_chunk_rows(
    num_rows: int,
    vocab_size: int,
    dtype: torch.dtype,
    use_triton: bool,
    hidden_size: int | None = None,
    num_sms: int | None = None,
) -> int:
    """Token rows per chunk of an op with two heads' logits per chunk (the divergence op: a student's and a
    teacher's ``[chunk, V]`` buffers). Triton rows: :func:`default_chunk_rows`'s choice for the student's GEMMs
    (at least 1024 rows, enough rows for the dh GEMM to fill the GPU at a thin hidden size, at most 16 bf16
    roundings of dW), which also sizes the teacher's buffer; no spare bytes in evaluation. Torch rows: a
    ``[chunk, V]`` fp32 temporary of ``DEFAULT_LOGITS_BUDGET_BYTES``. (Not :func:`resolve_chunks`: the torch
    rows' budget and the evaluation chunks differ, so the chunks, and the rounding, would change.)"""
    num_rows = max(num_rows, 1)
    if use_triton:
        return default_chunk_rows(num_rows, vocab_size, dtype, True, hidden_size=hidden_size, num_sms=num_sms)
    return max(1, min(num_rows, DEFAULT_LOGITS_BUDGET_BYTES // (4 * vocab_size)))


def chunk_spans(num_rows: int, chunk_rows: int, fold_tail: bool = False) -> tuple[tuple[int, int], ...]:
    """(start, stop) of each chunk of ``num_rows`` rows: ``chunk_rows`` rows each, the last one shorter;
    with ``fold_tail``, a last chunk of fewer than ``CHUNK_ROW_MULTIPLE`` rows and at most
    ``chunk_rows // TAIL_FOLD_FRACTION`` joins the one before it."""
    starts = list(range(0, num_rows, chunk_rows))
    tail_limit = min(chunk_rows // TAIL_FOLD_FRACTION, CHUNK_ROW_MULTIPLE - 1)
    if fold_tail and len(starts) > 1 and num_rows - starts[-1] <= tail_limit:
        starts.pop()
    return tuple(zip(starts, [*starts[1:], num_rows]))


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


def resolve_chunks(
    chunk_size: int | None,
    processed_rows: int,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    use_triton: bool,
    any_grad: bool,
    shard_plan: tuple[int, int] | None = None,
) -> tuple[tuple[int, int], ...]:
    """The (start, stop) row spans of the chunks over ``processed_rows`` rows: ``chunk_size`` rows
    each, or :func:`default_chunk_rows`'s with a short remainder folded into the last chunk.

    ``shard_plan``: for a vocabulary shard, (the group's largest shard's rows, the group's size). Every rank
    then plans for the same rows, so that all ranks run the same chunks (each chunk exchanges statistics across
    the group), and the budget counts once per rank."""
    if chunk_size is not None:
        return chunk_spans(processed_rows, chunk_size)
    num_sms = sm_count(hidden)
    vocab_rows, budget_scale = shard_plan if shard_plan is not None else (weight.shape[0], 1)
    # Evaluation of a trainable W: the buffer may take the bytes its dW would have taken.
    spare = vocab_rows * weight.shape[1] * weight.element_size() if weight.requires_grad and not any_grad else 0
    rows = default_chunk_rows(
        processed_rows,
        vocab_rows,
        hidden.dtype,
        use_triton,
        hidden_size=hidden.shape[-1],
        num_sms=num_sms,
        spare_bytes=spare,
        budget_scale=budget_scale,
    )
    return chunk_spans(processed_rows, rows, fold_tail=True)


def sm_count(tensor: torch.Tensor) -> int | None:
    """The streaming multiprocessors of ``tensor``'s GPU, None off CUDA."""
    return torch.cuda.get_device_properties(tensor.device).multi_processor_count if tensor.is_cuda else None


def buffer_rows(chunks: tuple[tuple[int, int], ...]) -> int:
    """The rows of a buffer that holds the longest chunk."""
    return max((stop - start for start, stop in chunks), default=1)
