"""The chunked autograd Function shared by both backends.

Tokens are processed ``chunk_rows`` at a time. For each chunk the projection
``raw = hidden_c @ W.T (+ bias)`` is one GEMM into a reused ``[chunk_rows, V]`` buffer; a row
operation (Triton kernel or torch, see ``rows.py``) turns it into per-token statistics and, when
gradients are needed, into the logits gradient in place; two more GEMMs give ``dh_c = G @ W`` and
``dW += G.T @ h_c``. Each GEMM reduces over D or V in full, with fp32 accumulation inside the GEMM.
With a softcap and a frozen W the Triton kernel writes G in one pass as ``U`` and a per-row factor
(G = U * factor, see kernels.py), which goes onto the fp32 output of ``U @ W`` (a ``[C, D]`` fp32
temporary) before dh's one rounding.

Two gradient schedules:

* scalar loss (reduction "mean"/"sum"/num_items_in_batch): the gradient is computed during the
  forward (6*N*V*D FLOPs instead of 8 for a recompute), already scaled by the reduction factor,
  and the backward only multiplies dh, dW and dbias by ``grad_output`` (exact, so no second
  rounding, when it is 1 or a power of two as under loss scaling).
* per-token outputs (reduction "none", log-probabilities, differentiable entropy): the forward
  keeps the log-sum-exp and entropy per token; the backward recomputes each chunk's logits and
  applies the per-token upstream gradients. With ``precompute_grad`` the forward also computes the
  gradient of the mean over valid tokens, and the backward only rescales it when the upstream
  gradient is the same for every valid token (checked with one host sync), else it recomputes.

Rows whose label is ignored can be left out (``row_index``: the rows to process): each chunk then
gathers its rows of hidden (into a stretch of dh that holds no finished row yet, when dh is
computed), dh is scattered back, and per-row outputs are placed among zeros.

With ``ChunkedOptions.shard`` the weight is one rank's shard of a vocabulary split across a process
group: the row pass becomes vocab_parallel.py's (statistics exchanged per chunk, the gradient formed
with the whole vocabulary's log-sum-exp), labels become shard ids, and dh is summed over the group.

A low-rank term (:class:`LowRank`, a LoRA adapter on the head) adds ``L_c @ B.T`` to each chunk's
logits (one more GEMM into the buffer, K = r) and takes its gradients from the same G:
``dL_c = G @ B`` and ``dB += G.T @ L_c`` (fp32). The adapter's own input projection
(``L = scale * dropout(h) @ A.T``) stays outside the op, in autograd, so W is never copied or summed
with ``B @ A``.

Memory above inputs and gradients: the one logits buffer plus O(N) fp32 vectors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .checks import check_labels, check_num_items, selected_rows
from .rows import (
    LogitTransform,
    RowOutputs,
    chunk_grad,
    chunk_stats,
    scale_inplace,
    stats_dtype,
    target_logits,
    unnormalized_grad_applies,
)
from .vocab_parallel import ShardRowPass, VocabShard, all_reduce_sum, shard_labels

# Default size of the logits buffer: 256 MiB, but never fewer than 1024 token rows. cuBLAS runs
# the three GEMM shapes near its full-size rate from about 1024 rows (K of the dW GEMM, M of the
# dh GEMM); smaller chunks cost 10-15% on the H100 (Gemma-2: 56.7 ms at 512 rows vs 51.7 ms at
# 1024). See benchmarks/NOTES.md.
DEFAULT_LOGITS_BUDGET_BYTES = 256 * 1024 * 1024
MIN_DEFAULT_CHUNK_ROWS = 1024
# Thin hidden sizes need more rows: a chunk's dh GEMM writes a [C, D] output, which cuBLAS's Hopper
# kernels cover in tiles of about 128 x 256, one per SM at a time; below (SMs x 128 x 256) / D rows
# SMs idle. On the H100 Gemma-2 (D = 2304) ran 86% of its floor at 1024-row chunks and 91-92% at
# 1760-1792 rows (NOTES v12). The default is at least that many rows, rounded down to a multiple of
# 128 (H100: 1792 for D = 2304; 1152 for D = 3584; 1024 for D = 4096), also when N rows would split
# into more even chunks of fewer rows.
GEMM_TILE_ELEMENTS = 128 * 256
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
# Whether a chunk's dW GEMM runs on a second CUDA stream beside its dh GEMM (_GradAccumulator;
# on the H100 1.1 ms faster per Llama-3-8B step, 0.2-0.4 ms on Qwen2.5 and Gemma-2, NOTES v19).
OVERLAP_WEIGHT_GRADS = True
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


def default_chunk_rows(
    num_rows: int,
    vocab_size: int,
    dtype: torch.dtype,
    use_triton: bool,
    hidden_size: int | None = None,
    num_sms: int | None = None,
    spare_bytes: int = 0,
) -> int:
    """Token rows per chunk for ``num_rows`` processed rows: the logits budget, at least 1024 rows on
    the Triton path and, given ``hidden_size`` and the GPU's ``num_sms``, enough rows for the dh GEMM
    to fill the GPU, and few enough chunks that a bf16 dW is rounded at most ``MAX_BF16_DW_CHUNKS``
    times; plus as many rows as ``spare_bytes`` hold (a forward without gradients passes the bytes of
    the dW it does not allocate); then the fewest chunks of that size, made as even as multiples of
    128 rows allow (256 for chunks of more than ``LARGE_CHUNK_ROWS`` rows in training)."""
    tile = CHUNK_ROW_MULTIPLE
    element_size = torch.finfo(dtype).bits // 8
    bytes_per_row = vocab_size * (element_size if use_triton else element_size + _TORCH_TEMPORARIES_PER_LOGIT)
    budget = DEFAULT_LOGITS_BUDGET_BYTES if use_triton else TORCH_LOGITS_BUDGET_BYTES
    rows = budget // max(bytes_per_row, 1)
    if rows >= 2 * tile:
        rows = rows // tile * tile
    fill_rows = 0
    if use_triton:
        rows = max(rows, MIN_DEFAULT_CHUNK_ROWS)
        if hidden_size and num_sms:
            fill_rows = num_sms * GEMM_TILE_ELEMENTS // hidden_size // tile * tile
            rows = max(rows, fill_rows)
            if fill_rows <= MIN_DEFAULT_CHUNK_ROWS:  # not a thin hidden size: even chunks below it are fine
                fill_rows = 0
    if dtype == torch.bfloat16:
        rows = max(rows, _round_up(-(-num_rows // MAX_BF16_DW_CHUNKS), tile))
    spare_rows = spare_bytes // max(bytes_per_row, 1)
    if spare_rows >= tile:
        rows += spare_rows // tile * tile
    rows = int(max(1, min(rows, max(num_rows, 1))))
    chunks = -(-num_rows // rows)
    if chunks > 1:  # the fewest chunks of at most ``rows``, as even as whole tiles (16 rows on torch) allow,
        # but not below the rows that fill the GPU: a shorter last chunk costs less than every chunk's dh
        # GEMM leaving SMs idle (NOTES v17: Qwen2.5 at N = 8192, 7 x 1152 + 128 rows ran 1.2 ms faster
        # than 8 x 1024; Gemma-2 4 x 1792 + 1024 1.1 ms faster than 5 x 1664).
        rows = min(rows, max(_round_up(-(-num_rows // chunks), tile if use_triton else 16), fill_rows))
    if use_triton and not spare_bytes and LARGE_CHUNK_ROWS < rows < num_rows:  # rounded up: never more chunks
        rows = min(_round_up(rows, LARGE_CHUNK_ROW_MULTIPLE), num_rows)
    return rows


def chunk_spans(num_rows: int, chunk_rows: int, fold_tail: bool = False) -> tuple[tuple[int, int], ...]:
    """(start, stop) of each chunk of ``num_rows`` rows: ``chunk_rows`` rows each, the last one shorter;
    with ``fold_tail``, a last chunk of fewer than ``CHUNK_ROW_MULTIPLE`` rows and at most
    ``chunk_rows // TAIL_FOLD_FRACTION`` joins the one before it."""
    starts = list(range(0, num_rows, chunk_rows))
    tail_limit = min(chunk_rows // TAIL_FOLD_FRACTION, CHUNK_ROW_MULTIPLE - 1)
    if fold_tail and len(starts) > 1 and num_rows - starts[-1] <= tail_limit:
        starts.pop()
    return tuple(zip(starts, [*starts[1:], num_rows]))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _matmul_into(out: torch.Tensor, hidden_chunk: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    if bias is None:
        torch.mm(hidden_chunk, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden_chunk, weight.t(), out=out)


class LowRank(NamedTuple):
    """A low-rank term of the logits, ``hidden @ weight.T``: hidden [N, r] (the op's rows), weight [V, r],
    in the op's compute dtype. A LoRA adapter on the head is ``hidden = scale * dropout(h) @ A.T``,
    ``weight = B``."""

    hidden: torch.Tensor
    weight: torch.Tensor

    def rows(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """The term's hidden rows of a chunk (a view for a slice, a gathered [C, r] copy otherwise)."""
        return self.hidden[rows] if isinstance(rows, slice) else self.hidden.index_select(0, rows)


def _logits_into(
    out: torch.Tensor,
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    low_rank: LowRank | None,
    rows: slice | torch.Tensor,
) -> None:
    """A chunk's raw logits: ``hidden_chunk @ W.T (+ bias) (+ the low-rank term's rows)``, the low-rank
    product added by the GEMM itself (fp32 accumulation, one rounding)."""
    _matmul_into(out, hidden_chunk, weight, bias)
    if low_rank is not None:
        out.addmm_(low_rank.rows(rows), low_rank.weight.t())


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into an fp32 (or, for fp64 inputs, fp64) ``acc`` without rounding the product to the
    inputs' dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.device.type == "cuda" and a.dtype != torch.float32:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except TypeError:  # torch without out_dtype
            pass
    acc.addmm_(a.float(), b.float())


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as fp32, accumulated in fp32 and not rounded to the inputs' dtype."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())  # the CPU interpreter's tests: no fp32-output GEMM there


# torch's fp32-output GEMM (``mm(..., out_dtype=)``, CUDA) exists from torch 2.8 on; the package allows older.
_HAS_FP32_OUTPUT_MM = "dtype" in torch.ops.aten.mm.overloads()


def fp32_output_gemm_available(device: torch.device) -> bool:
    """Whether :func:`_mm_fp32` runs on ``device`` (CUDA needs torch's ``mm(..., out_dtype=)``)."""
    return device.type != "cuda" or _HAS_FP32_OUTPUT_MM


class _GradAccumulator:
    """dh rows, dW and dbias from chunk gradients ``G`` [C, V] (fp32 accumulation in each GEMM).

    With ``row_index`` (the M of the N rows of hidden that are processed) dh starts at zero and each
    chunk's rows are written to their places; the chunk's rows of hidden are gathered into dh itself
    (:meth:`gather_rows`), so no separate [C, D] buffer is needed."""

    def __init__(
        self,
        hidden,
        weight,
        bias,
        needs_hidden,
        needs_weight,
        needs_bias,
        row_index=None,
        low_rank: LowRank | None = None,
        needs_low_rank: tuple[bool, bool] = (False, False),
    ):
        self.weight = weight
        self.low_rank = low_rank
        # The low-rank term's gradients: d(its hidden) rows [N, r] (zero where a row is skipped) and
        # d(its weight) [V, r], accumulated in fp32 (fp64 for fp64; it is small: V * r).
        self.d_low_rank_hidden = self.d_low_rank_weight = None
        if low_rank is not None and needs_low_rank[0]:
            self.d_low_rank_hidden = torch.zeros_like(low_rank.hidden)
        if low_rank is not None and needs_low_rank[1]:
            self.d_low_rank_weight = torch.zeros(
                low_rank.weight.shape, dtype=stats_dtype(weight.dtype), device=weight.device
            )
        self.dh = None
        self.rows_skipped = None if row_index is None else hidden.shape[0] - row_index.shape[0]
        if needs_hidden:
            make = torch.empty if row_index is None else torch.zeros
            self.dh = make(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        # fp16 lacks the range to hold a sum over many tokens: accumulate its dW in fp32.
        # bf16 and fp32 add each chunk's GEMM result into dW in place (one rounding per chunk).
        self.dw_fp32 = weight.dtype == torch.float16
        dw_dtype = torch.float32 if self.dw_fp32 else weight.dtype
        self.dw = torch.empty(weight.shape, dtype=dw_dtype, device=weight.device) if needs_weight else None
        db_dtype = stats_dtype(bias.dtype) if needs_bias else None
        self.db = torch.zeros(bias.shape, dtype=db_dtype, device=bias.device) if needs_bias else None
        self._dw_written = False
        # With both dh and dW to compute on a GPU, each chunk's weight-gradient GEMMs run on a second
        # stream beside its dh GEMM: both only read the chunk's G, and cuBLAS's dW ``addmm_`` spends
        # part of its time reading the old dW, which dh's compute then covers (NOTES v19). Not with a
        # row selection (``skip_ignored``): there dh is written over the gathered rows the dW GEMM
        # reads, and the A/B showed no gain worth a scratch copy.
        self._side_stream = None
        if (
            OVERLAP_WEIGHT_GRADS
            and hidden.is_cuda
            and row_index is None
            and self.dh is not None
            and self.dw is not None
        ):
            self._side_stream = _side_stream(hidden.device)

    @property
    def takes_row_factor(self) -> bool:
        """Whether chunks may come as rows to be scaled (:meth:`add`): when dh is the only gradient.
        A dW GEMM cannot scale its K rows, and scaling hidden's rows for it rounds them a second
        time (dW error 1.28x the unfused path's on flat data on the H100, NOTES v15)."""
        return (
            self.dh is not None
            and self.dw is None
            and self.db is None
            and self.d_low_rank_hidden is None
            and self.d_low_rank_weight is None
        )

    @property
    def gathers_into_dh(self) -> bool:
        """Whether the chunks' selected rows of hidden go into dh (:meth:`gather_rows`)."""
        return self.rows_skipped is not None and self.dh is not None

    def gather_rows(self, hidden: torch.Tensor, rows: torch.Tensor, start: int) -> torch.Tensor:
        """``hidden[rows]`` gathered into dh's rows ``[start + skipped, start + skipped + C)`` and
        returned as that view; ``rows`` are the processed rows ``start .. start + C - 1`` (ascending).

        Those dh rows hold no finished row yet: the j-th processed row lies at index
        ``rows[j] <= j + skipped`` (at most ``skipped`` rows are left out before it), so every row
        finished by an earlier chunk lies below ``start + skipped``. :meth:`add` then uses the same
        rows for the chunk's dh and clears them before placing it."""
        first = start + self.rows_skipped
        return torch.index_select(hidden, 0, rows, out=self.dh[first : first + rows.shape[0]])

    def add(
        self,
        grad_chunk: torch.Tensor,
        hidden_chunk: torch.Tensor,
        rows: slice | torch.Tensor,
        row_factor: torch.Tensor | None = None,
    ) -> None:
        """``rows``: the chunk's rows of hidden, a slice, or an index tensor (``hidden_chunk`` is then
        the op's own gathered copy, from :meth:`gather_rows` when dh is kept, which this overwrites).
        ``grad_chunk`` is used up: with an index tensor its memory stages the chunk's dh rows.

        With ``row_factor`` (fp32 [C]) the chunk's gradient is ``grad_chunk * row_factor[:, None]``
        (the one-pass kernel's output, see kernels.py), applied to the fp32 output of the dh GEMM
        before its one rounding; only for dh alone (:attr:`takes_row_factor`)."""
        if row_factor is not None and not self.takes_row_factor:
            raise ValueError("_GradAccumulator: a row_factor is only taken when dh is the only gradient")
        if self._side_stream is not None:  # rows is a slice: no row selection
            # The side stream starts after everything queued so far (G written) and is joined before
            # anything else runs, so G's buffer and dW are reused or freed only after it.
            main = torch.cuda.current_stream(grad_chunk.device)
            self._side_stream.wait_stream(main)
            with torch.cuda.stream(self._side_stream):
                self._add_weight_grads(grad_chunk, hidden_chunk, rows)
            self._dh_product(grad_chunk, row_factor, self.dh[rows])
            main.wait_stream(self._side_stream)
            return
        self._add_weight_grads(grad_chunk, hidden_chunk, rows)
        if self.dh is None:
            return
        if isinstance(rows, slice):
            self._dh_product(grad_chunk, row_factor, self.dh[rows])
            return
        # hidden_chunk is a stretch of dh (gather_rows): it takes the chunk's dh rows, which then move
        # to their places through G's memory (the GEMMs are done with G), and the stretch is cleared:
        # the rows of it that no processed row lands on are skipped rows (zero) or later chunks'.
        dh_rows = self._dh_product(grad_chunk, row_factor, hidden_chunk)
        staging = _reuse_as(grad_chunk, dh_rows.shape)
        staging.copy_(dh_rows)
        dh_rows.zero_()
        self.dh.index_copy_(0, rows, staging)

    def _dh_product(self, grad_chunk: torch.Tensor, row_factor: torch.Tensor | None, out: torch.Tensor):
        if row_factor is None:
            return torch.mm(grad_chunk, self.weight, out=out)
        return torch.mul(_mm_fp32(grad_chunk, self.weight), row_factor[:, None], out=out)

    def _add_weight_grads(self, grad_chunk: torch.Tensor, hidden_chunk: torch.Tensor, rows) -> None:
        # The low-rank term's gradients first: with a row selection G's memory is reused after the GEMMs.
        if self.d_low_rank_weight is not None:
            _addmm_fp32(self.d_low_rank_weight, grad_chunk.t(), self.low_rank.rows(rows))
        if self.d_low_rank_hidden is not None:
            if isinstance(rows, slice):
                torch.mm(grad_chunk, self.low_rank.weight, out=self.d_low_rank_hidden[rows])
            else:
                self.d_low_rank_hidden.index_copy_(0, rows, torch.mm(grad_chunk, self.low_rank.weight))
        if self.dw is not None:
            if not self._dw_written:
                self.dw.zero_() if self.dw_fp32 else torch.mm(grad_chunk.t(), hidden_chunk, out=self.dw)
            if self.dw_fp32:
                _addmm_fp32(self.dw, grad_chunk.t(), hidden_chunk)
            elif self._dw_written:
                self.dw.addmm_(grad_chunk.t(), hidden_chunk)
            self._dw_written = True
        if self.db is not None:
            self.db += grad_chunk.sum(dim=0, dtype=self.db.dtype)

    def results(self, weight_dtype, bias_dtype):
        if self.dw is not None and not self._dw_written:
            self.dw.zero_()
        dw = self.dw.to(weight_dtype) if self.dw is not None else None
        db = self.db.to(bias_dtype) if self.db is not None else None
        return self.dh, dw, db

    def low_rank_results(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(d of the low-rank term's hidden, d of its weight), in their dtypes; None where not needed."""
        d_weight = self.d_low_rank_weight
        if d_weight is not None:
            d_weight = d_weight.to(self.low_rank.weight.dtype)
        return self.d_low_rank_hidden, d_weight


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One extra stream per GPU for the weight-gradient GEMMs (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _reuse_as(buffer: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A ``shape`` view of the front of a contiguous ``buffer`` whose values are no longer needed
    (a new tensor when it is too small: a vocabulary smaller than the hidden size)."""
    numel = shape.numel()
    if buffer.is_contiguous() and buffer.numel() >= numel:
        return buffer.view(-1)[:numel].view(shape)
    return buffer.new_empty(shape)


def _gather_buffer(
    hidden: torch.Tensor, row_index: torch.Tensor | None, rows: int, grads: _GradAccumulator | None
) -> torch.Tensor | None:
    """One ``[rows, D]`` buffer that every chunk's selected rows of hidden are gathered into (None:
    no selection, or dh is kept and the rows are gathered into it)."""
    if row_index is None or (grads is not None and grads.gathers_into_dh):
        return None
    return torch.empty(rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)


def _chunk_rows_of(
    hidden: torch.Tensor,
    rows: slice | torch.Tensor,
    start: int,
    grads: _GradAccumulator | None,
    gathered: torch.Tensor | None,
) -> torch.Tensor:
    """The chunk's rows of hidden: a view for a slice, else gathered into dh or (the front of) ``gathered``."""
    if isinstance(rows, slice):
        return hidden[rows]
    if grads is not None and grads.gathers_into_dh:
        return grads.gather_rows(hidden, rows, start)
    return torch.index_select(hidden, 0, rows, out=gathered[: rows.shape[0]])


def _scatter_rows(out: RowOutputs, row_index: torch.Tensor, total_rows: int) -> RowOutputs:
    """Per-row outputs of the selected rows placed among ``total_rows`` zeros (the ignored rows' values)."""

    def place(values):
        if values is None:
            return None
        full = torch.zeros(total_rows, dtype=values.dtype, device=values.device)
        return full.index_copy_(0, row_index, values)

    return RowOutputs(*(place(t) for t in vars(out).values()))


def _uniform_factor(
    grad_loss: torch.Tensor, labels: torch.Tensor, ignore_index: int, precompute_scale: torch.Tensor
) -> torch.Tensor | None:
    """``g / precompute_scale`` (0-d) when every non-ignored row got the same upstream gradient ``g``, else None.

    ``grad_loss`` and ``labels`` are of the same rows. One host sync: whether the precomputed
    gradients apply decides which kernels to launch (none while a CUDA graph is captured: None).
    """
    grad_loss = grad_loss.reshape(-1)
    if grad_loss.numel() == 0:
        return torch.zeros((), dtype=precompute_scale.dtype, device=grad_loss.device)
    if grad_loss.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    valid = labels != ignore_index
    first = grad_loss.index_select(0, valid.int().argmax().view(1))  # the first valid row's (row 0 if none)
    if not bool(((grad_loss == first) | ~valid).all()):
        return None
    return torch.where(valid.any(), first[0].to(precompute_scale.dtype) / precompute_scale, 0.0)


def _rescaled(grad: torch.Tensor | None, factor: torch.Tensor, in_place: bool) -> torch.Tensor | None:
    if grad is None:
        return None
    if in_place:  # free when the factor is exactly 1; the Triton kernel leaves autograd's version alone
        scale_inplace(grad, factor, True)
        return grad
    return grad * factor  # a saved tensor scaled in place would fail a second backward's version check


def resolve_chunks(
    chunk_size: int | None,
    processed_rows: int,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    use_triton: bool,
    any_grad: bool,
) -> tuple[tuple[int, int], ...]:
    """The (start, stop) row spans of the chunks over ``processed_rows`` rows: ``chunk_size`` rows
    each, or :func:`default_chunk_rows`'s with a short remainder folded into the last chunk."""
    if chunk_size is not None:
        return chunk_spans(processed_rows, chunk_size)
    num_sms = torch.cuda.get_device_properties(hidden.device).multi_processor_count if hidden.is_cuda else None
    # Evaluation of a trainable W: the buffer may take the bytes its dW would have taken.
    spare = weight.numel() * weight.element_size() if weight.requires_grad and not any_grad else 0
    rows = default_chunk_rows(
        processed_rows,
        weight.shape[0],
        hidden.dtype,
        use_triton,
        hidden_size=hidden.shape[-1],
        num_sms=num_sms,
        spare_bytes=spare,
    )
    return chunk_spans(processed_rows, rows, fold_tail=True)


def _buffer_rows(chunks: tuple[tuple[int, int], ...]) -> int:
    return max((stop - start for start, stop in chunks), default=1)


@dataclass(frozen=True)
class ChunkedOptions:
    """Everything about one call of the chunked op that is not a tensor.

    reduction: "mean" (over valid labels), "sum", "items" (sum / num_items_in_batch) for a scalar loss,
    or None for per-token outputs. needs_grad: whether (hidden, weight, bias) get gradients. want:
    whether to compute (entropy, is_top1, mean_logit, log_sum_sq). chunk_size: rows per chunk, None for the default.
    skip_ignored / num_valid_tokens: process the valid rows only (see :func:`checks.selected_rows`).
    shard: the weight is this rank's shard of a vocabulary split across a process group (vocab_parallel.py;
    ``transform.vocab_size`` is then the whole vocabulary's size, and ``want`` all False).
    needs_low_rank_grad: whether the low-rank term's (hidden, weight) get gradients (:class:`LowRank`).
    """

    transform: LogitTransform
    reduction: str | None
    use_triton: bool
    needs_grad: tuple[bool, bool, bool]
    want: tuple[bool, bool, bool, bool] = (False, False, False, False)
    chunk_size: int | None = None
    skip_ignored: bool = False
    num_valid_tokens: int | None = None
    precompute_grad: bool = False
    shard: VocabShard | None = None
    needs_low_rank_grad: tuple[bool, bool] = (False, False)


class ForwardOutputs(NamedTuple):
    """What :func:`chunked_forward` computes.

    loss: 0-d for a scalar loss, else [N] (0 where ignored); entropy, is_top1 (bool), mean_logit,
    log_sum_sq: [N] (0 / False where ignored) or None when not wanted. For the backward: ``row_index`` (the processed rows, None for all), their
    ``row_labels`` [M], ``lse`` [M] and ``processed_entropy`` [M] (None without entropy); ``grads``
    (dh, dw, db, d_low_rank_hidden, d_low_rank_weight, each None when not needed) when the gradient
    was computed in the forward, and
    ``grad_scale`` (the factor precomputed gradients carry, per-token outputs only); ``chunks``, the (start, stop) row spans used.
    """

    loss: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None
    mean_logit: torch.Tensor | None
    log_sum_sq: torch.Tensor | None
    lse: torch.Tensor
    processed_entropy: torch.Tensor | None
    row_index: torch.Tensor | None
    row_labels: torch.Tensor
    grads: tuple | None
    grad_scale: torch.Tensor | None
    chunks: tuple[tuple[int, int], ...]


def _reduce_scale(
    reduction: str | None, num_valid: torch.Tensor, num_items: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor | None:
    """The factor a scalar loss applies to the sum of token losses (0-d), None for per-token outputs."""
    if reduction is None:
        return None
    if reduction == "mean":
        return 1.0 / num_valid.clamp(min=1).to(dtype)
    if reduction == "sum":
        return torch.ones((), dtype=dtype, device=num_valid.device)
    num_items = num_items.to(device=num_valid.device, dtype=dtype).reshape(())
    check_num_items(num_items, num_valid)
    return torch.where(num_items > 0, 1.0 / num_items, 0.0)  # 0 only when no label is valid: a 0 loss


def chunked_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    num_items: torch.Tensor | None,
    options: ChunkedOptions,
    low_rank: LowRank | None = None,
) -> ForwardOutputs:
    """The chunked forward (see the module docstring), with the checks that read tensor values.

    hidden [N, D], weight [V, D], bias [V] or None, ``low_rank``'s tensors: one float dtype, any strides.
    labels [N] integer. num_items: 0-d tensor for ``reduction="items"``. Runs with autocast off (the
    caller casts).
    """
    with torch.autocast(hidden.device.type, enabled=False):
        return _chunked_forward(hidden, weight, bias, labels, num_items, options, low_rank)


def _chunked_forward(hidden, weight, bias, labels, num_items, options: ChunkedOptions, low_rank) -> ForwardOutputs:
    transform, use_triton, shard = options.transform, options.use_triton, options.shard
    labels = labels.contiguous()  # the row kernels index labels by row
    vocab_size = weight.shape[0]
    check_labels(labels, vocab_size if shard is None else shard.total, transform.ignore_index)
    valid = labels != transform.ignore_index
    row_index = None
    if options.skip_ignored or options.num_valid_tokens is not None:
        row_index = selected_rows(valid, options.num_valid_tokens)
    acc_dtype = stats_dtype(hidden.dtype)
    reduce_scale = _reduce_scale(options.reduction, valid.sum(), num_items, acc_dtype)
    if shard is not None:  # from here on, labels are ids of the local shard (vocab_parallel.py)
        labels = shard_labels(labels, shard, vocab_size, transform.ignore_index)

    total_rows = hidden.shape[0]
    num_rows = total_rows if row_index is None else row_index.shape[0]
    row_labels = labels if row_index is None else labels.index_select(0, row_index)
    device = hidden.device
    want_entropy, want_top1, want_mean_logit, want_log_sum_sq = options.want
    needs_hidden, needs_weight, needs_bias = options.needs_grad
    any_grad = needs_hidden or needs_weight or needs_bias or any(options.needs_low_rank_grad)
    chunks = resolve_chunks(options.chunk_size, num_rows, hidden, weight, use_triton, any_grad)
    scalar_loss = reduce_scale is not None
    # Per-token outputs with precompute_grad: the gradient of sum(loss) / n_valid is computed now
    # (6*N*V*D FLOPs), and the backward uses it when the upstream gradient turns out uniform.
    precompute = options.precompute_grad and any_grad and not scalar_loss
    grad_scale = reduce_scale
    if precompute:
        grad_scale = 1.0 / (row_labels != transform.ignore_index).sum().clamp(min=1).to(acc_dtype)
    grad_in_forward = (scalar_loss and any_grad) or precompute

    def stat_rows():
        return torch.empty(num_rows, dtype=acc_dtype, device=device)

    out = RowOutputs(
        loss=stat_rows(),
        lse=stat_rows(),
        entropy=stat_rows() if want_entropy else None,
        is_top1=torch.empty(num_rows, dtype=torch.int8, device=device) if want_top1 else None,
        mean_logit=stat_rows() if want_mean_logit else None,
        log_sum_sq=stat_rows() if want_log_sum_sq else None,
    )
    grads = (
        _GradAccumulator(hidden, weight, bias, *options.needs_grad, row_index, low_rank, options.needs_low_rank_grad)
        if grad_in_forward
        else None
    )
    # The buffer holds logits rounded to the compute dtype; the loss reads the target logit once
    # more in fp32 so that rounding does not reach it (fp32 and fp64 buffers need no second look).
    # A vocabulary shard needs the target logit of the labels it owns in every dtype (vocab_parallel.py).
    target_raw = None
    if hidden.dtype in (torch.float16, torch.bfloat16) or shard is not None:
        target_raw = target_logits(hidden, weight, bias, labels, use_triton, row_index)
        if low_rank is not None:
            target_raw += target_logits(low_rank.hidden, low_rank.weight, None, labels, use_triton, row_index)
    buffer = torch.empty(_buffer_rows(chunks), vocab_size, dtype=hidden.dtype, device=device)
    shard_pass = None
    if shard is not None:
        shard_pass = ShardRowPass(shard, transform, buffer.shape[0], use_triton, hidden.dtype, device)
    gathered = _gather_buffer(hidden, row_index, buffer.shape[0], grads)
    # The one-pass gradient (rows to be scaled by row_factor) where the kernel has it (softcap)
    # and only dh is computed (a frozen W, as under LoRA); log_sum_sq needs the two-pass kernel.
    row_factor = None
    if (
        shard is None
        and not want_log_sum_sq
        and grads is not None
        and grads.takes_row_factor
        and unnormalized_grad_applies(transform, hidden.dtype, use_triton)
        and fp32_output_gemm_available(device)
    ):
        row_factor = torch.empty(buffer.shape[0], dtype=torch.float32, device=device)
    for start, stop in chunks:
        raw = buffer[: stop - start]
        rows = slice(start, stop) if row_index is None else row_index[start:stop]
        hidden_chunk = _chunk_rows_of(hidden, rows, start, grads, gathered)
        _logits_into(raw, hidden_chunk, weight, bias, low_rank, rows)
        chunk_out = RowOutputs(*(None if t is None else t[start:stop] for t in vars(out).values()))
        chunk_target = target_raw[start:stop] if target_raw is not None else None
        chunk_factor = row_factor[: stop - start] if row_factor is not None else None
        chunk_scale = grad_scale if grad_in_forward else None
        if shard_pass is not None:
            shard_pass.run(raw, row_labels[start:stop], chunk_out, chunk_target, chunk_scale)
        else:
            chunk_stats(
                raw, row_labels[start:stop], transform, chunk_out, chunk_scale, use_triton, chunk_target, chunk_factor
            )
        if grads is not None:
            grads.add(raw, hidden_chunk, rows, chunk_factor)
    del buffer, gathered, row_factor
    processed = out  # the processed rows' outputs, which a recompute in backward needs
    if row_index is not None and not scalar_loss:
        out = _scatter_rows(out, row_index, total_rows)
    computed = None
    if grads is not None:
        computed = (
            *grads.results(weight.dtype, bias.dtype if bias is not None else None),
            *grads.low_rank_results(),
        )
        if shard is not None and computed[0] is not None:
            all_reduce_sum(computed[0], shard)  # dh: the sum of every shard's G_r @ W_r
    return ForwardOutputs(
        loss=out.loss.sum() * reduce_scale if scalar_loss else out.loss,
        entropy=out.entropy,
        is_top1=out.is_top1.bool() if want_top1 else None,
        mean_logit=out.mean_logit,
        log_sum_sq=out.log_sum_sq,
        lse=processed.lse,
        processed_entropy=processed.entropy,
        row_index=row_index,
        row_labels=row_labels,
        grads=computed,
        grad_scale=grad_scale if precompute else None,
        chunks=chunks,
    )


def chunked_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    row_labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    row_index: torch.Tensor | None,
    grad_loss: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    needs_grad: tuple[bool, bool, bool],
    transform: LogitTransform,
    chunks: tuple[tuple[int, int], ...],
    use_triton: bool,
    shard: VocabShard | None = None,
    low_rank: LowRank | None = None,
    needs_low_rank: tuple[bool, bool] = (False, False),
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of per-token outputs by recomputing each chunk's logits (8*N*V*D FLOPs in all), over
    the (start, stop) row spans ``chunks`` (:func:`resolve_chunks`).

    ``row_labels``, ``lse`` and ``entropy`` are of the processed rows (``row_index``, or all);
    ``grad_loss`` and ``grad_entropy`` (None: no gradient) are of all N rows. Returns (dh, dw, db,
    d of the low-rank term's hidden, d of its weight), None where not needed. With ``shard``,
    ``row_labels`` are shard ids, ``lse`` the whole vocabulary's, and dh is summed over the shard's group.
    """
    with torch.autocast(hidden.device.type, enabled=False):
        if row_index is not None:  # only the processed rows have gradients
            if grad_loss is not None:
                grad_loss = grad_loss.reshape(-1).index_select(0, row_index)
            if grad_entropy is not None:
                grad_entropy = grad_entropy.reshape(-1).index_select(0, row_index)
        vocab_size = weight.shape[0]
        grads = _GradAccumulator(hidden, weight, bias, *needs_grad, row_index, low_rank, needs_low_rank)
        acc_dtype = stats_dtype(hidden.dtype)
        grad_loss = grad_loss.reshape(-1).to(acc_dtype).contiguous() if grad_loss is not None else None
        grad_entropy = grad_entropy.reshape(-1).to(acc_dtype).contiguous() if grad_entropy is not None else None
        num_rows = row_labels.shape[0]
        if (grad_loss is not None or grad_entropy is not None) and num_rows > 0:
            buffer = torch.empty(_buffer_rows(chunks), vocab_size, dtype=hidden.dtype, device=hidden.device)
            gathered = _gather_buffer(hidden, row_index, buffer.shape[0], grads)
            for start, stop in chunks:
                raw = buffer[: stop - start]
                rows = slice(start, stop) if row_index is None else row_index[start:stop]
                hidden_chunk = _chunk_rows_of(hidden, rows, start, grads, gathered)
                _logits_into(raw, hidden_chunk, weight, bias, low_rank, rows)
                chunk_grad(
                    raw,
                    row_labels[start:stop],
                    transform,
                    lse[start:stop],
                    entropy[start:stop] if grad_entropy is not None else None,
                    grad_loss[start:stop] if grad_loss is not None else None,
                    grad_entropy[start:stop] if grad_entropy is not None else None,
                    use_triton,
                )
                grads.add(raw, hidden_chunk, rows)
        elif grads.dh is not None:
            grads.dh.zero_()
        dh, dw, db = grads.results(weight.dtype, bias.dtype if bias is not None else None)
        if shard is not None and dh is not None:
            all_reduce_sum(dh, shard)
        return dh, dw, db, *grads.low_rank_results()


def _refuse_double_backward() -> None:
    """Backward runs with grad mode on only under ``create_graph=True``: the gradients computed here
    carry no graph of their own, so a second-order use would silently get a wrong result."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "fused_linear_cross_entropy: second-order gradients (backward with create_graph=True, e.g. a "
            "gradient penalty) are not supported: the op's gradients are computed without a graph. Use "
            "lce_patch.ops.linear_cross_entropy.naive_linear_cross_entropy for that term."
        )


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Chunked fused projection + cross-entropy (eager mode); see the module docstring.

    Inputs: hidden [N, D], weight [V, D], bias [V] or None (all one float dtype, any strides), labels
    [N] integer, num_items (0-d tensor for ``reduction="items"``, else None), ``ChunkedOptions``, and
    optionally a low-rank term's hidden [N, r] and weight [V, r] (:class:`LowRank`, same dtype).
    Outputs: loss (0-d, or [N]), entropy [N] (or empty), is_top1 [N] bool (or empty), mean_logit [N]
    (or empty), log_sum_sq [N] (or empty); fp32, or fp64 for fp64 inputs. mean_logit and log_sum_sq
    carry no gradient.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        labels,
        num_items,
        options: ChunkedOptions,
        low_rank_hidden=None,
        low_rank_weight=None,
    ):
        low_rank = None if low_rank_hidden is None else LowRank(low_rank_hidden, low_rank_weight)
        result = chunked_forward(hidden, weight, bias, labels, num_items, options, low_rank)
        # Outputs that get no gradient (entropy logged as a metric, say) arrive as None, not as
        # zeros, so the backward can skip their terms.
        ctx.set_materialize_grads(False)
        ctx.transform = options.transform
        ctx.chunks = result.chunks
        ctx.use_triton = options.use_triton
        ctx.shard = options.shard
        scalar_loss = ctx.scalar_loss = options.reduction is not None
        ctx.backward_done = False

        def given(value: torch.Tensor | None, dtype: torch.dtype = result.loss.dtype) -> torch.Tensor:
            return value if value is not None else result.loss.new_empty(0, dtype=dtype)  # one tensor per output

        entropy, is_top1 = given(result.entropy), given(result.is_top1, torch.bool)
        mean_logit, log_sum_sq = given(result.mean_logit), given(result.log_sum_sq)
        ctx.mark_non_differentiable(is_top1, mean_logit, log_sum_sq)
        outputs = (result.loss, entropy, is_top1, mean_logit, log_sum_sq)
        if scalar_loss:
            ctx.mark_non_differentiable(entropy)
            ctx.save_for_backward(*(result.grads or (None,) * 5))
            return outputs
        if any(options.needs_grad) or any(options.needs_low_rank_grad):
            precomputed = (None,) * 6
            if result.grad_scale is not None:
                precomputed = (*result.grads, result.grad_scale)
            saved_entropy = result.processed_entropy if result.processed_entropy is not None else result.lse
            ctx.save_for_backward(
                hidden,
                weight,
                bias,
                low_rank_hidden,
                low_rank_weight,
                result.row_labels,
                result.lse,
                saved_entropy,
                result.row_index,
                *precomputed,
            )
            ctx.has_entropy = result.processed_entropy is not None
            ctx.precomputed = result.grad_scale is not None
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, grad_entropy, _grad_top1, _grad_mean_logit, _grad_log_sum_sq):
        _refuse_double_backward()
        if ctx.scalar_loss:
            grads = LinearCrossEntropyFunction._scalar_backward(ctx, grad_loss)
        else:
            grads = LinearCrossEntropyFunction._recompute_backward(ctx, grad_loss, grad_entropy)
        dh, dw, db, d_low_rank_hidden, d_low_rank_weight = grads
        all_grads = (dh, dw, db, None, None, None, d_low_rank_hidden, d_low_rank_weight)
        return all_grads[: len(ctx.needs_input_grad)]  # the low-rank term's only when it was given

    @staticmethod
    def _scalar_backward(ctx, grad_loss):
        if ctx.backward_done:
            raise RuntimeError(
                "fused_linear_cross_entropy: backward through the same scalar loss twice is not supported "
                "(its gradients were computed in the forward and are scaled in place)."
            )
        ctx.backward_done = True
        if grad_loss is None:
            return (None,) * 5
        grads = ctx.saved_tensors
        for grad in grads:
            if grad is not None:
                scale_inplace(grad, grad_loss, ctx.use_triton)
        return grads

    @staticmethod
    def _recompute_backward(ctx, grad_loss, grad_entropy):
        hidden, weight, bias, low_rank_hidden, low_rank_weight, labels, lse, entropy, row_index, *precomputed = (
            ctx.saved_tensors
        )
        if not ctx.has_entropy:
            grad_entropy = None
        if ctx.precomputed and grad_entropy is None and grad_loss is not None:
            ctx.precomputed = False  # scaled in place below: a second backward recomputes instead
            rows_grad = grad_loss.reshape(-1) if row_index is None else grad_loss.reshape(-1).index_select(0, row_index)
            factor = _uniform_factor(rows_grad, labels, ctx.transform.ignore_index, precomputed[-1])
            if factor is not None:
                return tuple(_rescaled(grad, factor, ctx.use_triton) for grad in precomputed[:-1])
        low_rank = None if low_rank_hidden is None else LowRank(low_rank_hidden, low_rank_weight)
        grads = chunked_backward(
            hidden,
            weight,
            bias,
            labels,
            lse,
            entropy,
            row_index,
            grad_loss,
            grad_entropy,
            tuple(ctx.needs_input_grad[:3]),
            ctx.transform,
            ctx.chunks,
            ctx.use_triton,
            ctx.shard,
            low_rank,
            tuple(ctx.needs_input_grad[6:8]),
        )
        return grads
