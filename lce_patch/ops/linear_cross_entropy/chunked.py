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

Memory above inputs and gradients: the one logits buffer plus O(N) fp32 vectors.
"""

from __future__ import annotations

import torch

from .rows import (
    LogitTransform,
    RowOutputs,
    chunk_grad,
    chunk_stats,
    scale_inplace,
    target_logits,
    unnormalized_grad_applies,
)

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
# 128 (H100: 1792 for D = 2304; 1152 for D = 3584; 1024 for D = 4096).
GEMM_TILE_ELEMENTS = 128 * 256
# Chunk sizes are multiples of 128 rows (cuBLAS's tile height): 1008-row chunks ran 2-3% slower than
# 1024-row ones forward+backward and 6-8% slower forward-only on the Llama-3 and Qwen2.5 shapes.
CHUNK_ROW_MULTIPLE = 128
# A bf16 dW is rounded once per chunk as the chunks' products are added into it. Past ~16 chunks
# those roundings exceed the unfused path's own gradient error (measured on the H100: N=70001
# in 69 chunks gave a dW error of 1.2e-2 vs 2.1e-3 in one chunk), so the default chunk grows with
# N instead: at most 16 bf16 roundings, at the cost of N*V*2/16 bytes of logits buffer.
MAX_BF16_DW_CHUNKS = 16
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
    128 rows allow."""
    tile = CHUNK_ROW_MULTIPLE
    element_size = torch.finfo(dtype).bits // 8
    bytes_per_row = vocab_size * (element_size if use_triton else element_size + _TORCH_TEMPORARIES_PER_LOGIT)
    budget = DEFAULT_LOGITS_BUDGET_BYTES if use_triton else TORCH_LOGITS_BUDGET_BYTES
    rows = budget // max(bytes_per_row, 1)
    if rows >= 2 * tile:
        rows = rows // tile * tile
    if use_triton:
        rows = max(rows, MIN_DEFAULT_CHUNK_ROWS)
        if hidden_size and num_sms:
            rows = max(rows, num_sms * GEMM_TILE_ELEMENTS // hidden_size // tile * tile)
    if dtype == torch.bfloat16:
        rows = max(rows, _round_up(-(-num_rows // MAX_BF16_DW_CHUNKS), tile))
    spare_rows = spare_bytes // max(bytes_per_row, 1)
    if spare_rows >= tile:
        rows += spare_rows // tile * tile
    rows = int(max(1, min(rows, max(num_rows, 1))))
    chunks = -(-num_rows // rows)
    if chunks > 1:  # the fewest chunks of at most ``rows``, as even as whole tiles (16 rows on torch) allow
        rows = min(rows, _round_up(-(-num_rows // chunks), tile if use_triton else 16))
    return rows


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _matmul_into(out: torch.Tensor, hidden_chunk: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    if bias is None:
        torch.mm(hidden_chunk, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden_chunk, weight.t(), out=out)


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into an fp32 ``acc`` without rounding the product to the inputs' dtype."""
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

    def __init__(self, hidden, weight, bias, needs_hidden, needs_weight, needs_bias, row_index=None):
        self.weight = weight
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
        self.db = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs_bias else None
        self._dw_written = False

    @property
    def takes_row_factor(self) -> bool:
        """Whether chunks may come as rows to be scaled (:meth:`add`): when dh is the only gradient.
        A dW GEMM cannot scale its K rows, and scaling hidden's rows for it rounds them a second
        time (dW error 1.28x the unfused path's on flat data on the H100, NOTES v15)."""
        return self.dh is not None and self.dw is None and self.db is None

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
        self._add_weight_grads(grad_chunk, hidden_chunk)
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

    def _add_weight_grads(self, grad_chunk: torch.Tensor, hidden_chunk: torch.Tensor) -> None:
        if self.dw is not None:
            if not self._dw_written:
                self.dw.zero_() if self.dw_fp32 else torch.mm(grad_chunk.t(), hidden_chunk, out=self.dw)
            if self.dw_fp32:
                _addmm_fp32(self.dw, grad_chunk.t(), hidden_chunk)
            elif self._dw_written:
                self.dw.addmm_(grad_chunk.t(), hidden_chunk)
            self._dw_written = True
        if self.db is not None:
            self.db += grad_chunk.sum(dim=0, dtype=torch.float32)

    def results(self, weight_dtype, bias_dtype):
        if self.dw is not None and not self._dw_written:
            self.dw.zero_()
        dw = self.dw.to(weight_dtype) if self.dw is not None else None
        db = self.db.to(bias_dtype) if self.db is not None else None
        return self.dh, dw, db


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
    gradients apply decides which kernels to launch.
    """
    grad_loss = grad_loss.reshape(-1)
    if grad_loss.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=grad_loss.device)
    valid = labels != ignore_index
    first = grad_loss.index_select(0, valid.int().argmax().view(1))  # the first valid row's (row 0 if none)
    if not bool(((grad_loss == first) | ~valid).all()):
        return None
    return torch.where(valid.any(), first[0].float() / precompute_scale, 0.0)


def _rescaled(grad: torch.Tensor | None, factor: torch.Tensor, use_triton: bool) -> torch.Tensor | None:
    if grad is None:
        return None
    if use_triton:  # in place, free when the factor is exactly 1; the kernel leaves autograd's version alone
        scale_inplace(grad, factor, True)
        return grad
    return grad * factor  # a saved tensor scaled in place would fail a second backward's version check


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Chunked fused projection + cross-entropy; see the module docstring.

    Inputs: hidden [N, D], weight [V, D], bias [V] or None (all one float dtype), labels [N] int64,
    reduce_scale: fp32 0-d tensor for a scalar loss (the factor applied to the sum) or None for
    per-token outputs; row_index: int64 [M] rows to process (every other row is ignored: zero loss
    and gradient), or None for all. Outputs: loss (0-d, or [N] fp32), entropy [N] fp32 (or empty),
    is_top1 [N] bool (or empty), mean_logit [N] fp32 (or empty).
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        reduce_scale: torch.Tensor | None,
        transform: LogitTransform,
        chunk_rows: int,
        use_triton: bool,
        needs_grad: tuple[bool, bool, bool],
        want: tuple[bool, bool, bool],
        row_index: torch.Tensor | None = None,
        precompute_grad: bool = False,
    ):
        total_rows = hidden.shape[0]
        num_rows = total_rows if row_index is None else row_index.shape[0]
        row_labels = labels if row_index is None else labels.index_select(0, row_index)
        vocab_size = weight.shape[0]
        device = hidden.device
        want_entropy, want_top1, want_mean_logit = want
        needs_hidden, needs_weight, needs_bias = needs_grad
        any_grad = needs_hidden or needs_weight or needs_bias
        scalar_loss = reduce_scale is not None
        # Per-token outputs with precompute_grad: the gradient of sum(loss) / n_valid is computed now
        # (6*N*V*D FLOPs), and the backward uses it when the upstream gradient turns out uniform.
        precompute = precompute_grad and any_grad and not scalar_loss
        grad_scale = reduce_scale
        if precompute:
            grad_scale = 1.0 / (row_labels != transform.ignore_index).sum().clamp(min=1).float()
        grad_in_forward = (scalar_loss and any_grad) or precompute

        def fp32_rows():
            return torch.empty(num_rows, dtype=torch.float32, device=device)

        out = RowOutputs(
            loss=fp32_rows(),
            lse=fp32_rows(),
            entropy=fp32_rows() if want_entropy else None,
            is_top1=torch.empty(num_rows, dtype=torch.int8, device=device) if want_top1 else None,
            mean_logit=fp32_rows() if want_mean_logit else None,
        )
        grads = (
            _GradAccumulator(hidden, weight, bias, needs_hidden, needs_weight, needs_bias, row_index)
            if grad_in_forward
            else None
        )
        # The buffer holds logits rounded to the compute dtype; the loss reads the target logit once
        # more in fp32 so that rounding does not reach it (fp32 buffers need no second look).
        target_raw = None
        if hidden.dtype != torch.float32:
            target_raw = target_logits(hidden, weight, bias, labels, use_triton, row_index)
        buffer = torch.empty(min(chunk_rows, max(num_rows, 1)), vocab_size, dtype=hidden.dtype, device=device)
        gathered = _gather_buffer(hidden, row_index, buffer.shape[0], grads)
        # The one-pass gradient (rows to be scaled by row_factor) where the kernel has it (softcap)
        # and only dh is computed (a frozen W, as under LoRA).
        row_factor = None
        if (
            grads is not None
            and grads.takes_row_factor
            and unnormalized_grad_applies(transform, hidden.dtype, use_triton)
            and fp32_output_gemm_available(device)
        ):
            row_factor = torch.empty(buffer.shape[0], dtype=torch.float32, device=device)
        for start in range(0, num_rows, chunk_rows):
            stop = min(start + chunk_rows, num_rows)
            raw = buffer[: stop - start]
            rows = slice(start, stop) if row_index is None else row_index[start:stop]
            hidden_chunk = _chunk_rows_of(hidden, rows, start, grads, gathered)
            _matmul_into(raw, hidden_chunk, weight, bias)
            chunk_out = RowOutputs(*(None if t is None else t[start:stop] for t in vars(out).values()))
            chunk_target = target_raw[start:stop] if target_raw is not None else None
            chunk_factor = row_factor[: stop - start] if row_factor is not None else None
            chunk_stats(
                raw,
                row_labels[start:stop],
                transform,
                chunk_out,
                grad_scale if grad_in_forward else None,
                use_triton,
                chunk_target,
                chunk_factor,
            )
            if grads is not None:
                grads.add(raw, hidden_chunk, rows, chunk_factor)
        del buffer, gathered, row_factor
        processed = out  # the processed rows' outputs, which a recompute in backward needs
        if row_index is not None and not scalar_loss:
            out = _scatter_rows(out, row_index, total_rows)

        # Outputs that get no gradient (entropy logged as a metric, say) arrive as None, not as
        # zeros, so the backward can skip their terms.
        ctx.set_materialize_grads(False)
        ctx.transform = transform
        ctx.chunk_rows = chunk_rows
        ctx.use_triton = use_triton
        ctx.scalar_loss = scalar_loss
        ctx.needs_grad = needs_grad
        ctx.backward_done = False
        empty = out.loss.new_empty(0)
        entropy = out.entropy if want_entropy else empty
        is_top1 = out.is_top1.bool() if want_top1 else empty.bool()
        mean_logit = out.mean_logit if want_mean_logit else empty
        ctx.mark_non_differentiable(is_top1, mean_logit)

        if scalar_loss:
            loss = out.loss.sum() * reduce_scale
            ctx.mark_non_differentiable(entropy)
            if grads is not None:
                dh, dw, db = grads.results(weight.dtype, bias.dtype if bias is not None else None)
                ctx.save_for_backward(dh, dw, db)
            return loss, entropy, is_top1, mean_logit

        if any_grad:
            precomputed = (None, None, None, None)
            if precompute:
                precomputed = (*grads.results(weight.dtype, bias.dtype if bias is not None else None), grad_scale)
            saved_entropy = processed.entropy if want_entropy else processed.lse  # a placeholder without entropy
            ctx.save_for_backward(
                hidden, weight, bias, row_labels, processed.lse, saved_entropy, row_index, *precomputed
            )
            ctx.has_entropy = want_entropy
            ctx.precomputed = precompute
        return out.loss, entropy, is_top1, mean_logit

    @staticmethod
    def backward(ctx, grad_loss, grad_entropy, _grad_top1, _grad_mean_logit):
        if ctx.scalar_loss:
            return LinearCrossEntropyFunction._scalar_backward(ctx, grad_loss)
        return LinearCrossEntropyFunction._recompute_backward(ctx, grad_loss, grad_entropy)

    @staticmethod
    def _scalar_backward(ctx, grad_loss):
        if ctx.backward_done:
            raise RuntimeError(
                "fused_linear_cross_entropy: backward through the same scalar loss twice is not supported "
                "(its gradients were computed in the forward and are scaled in place)."
            )
        ctx.backward_done = True
        if grad_loss is None:
            return (None,) * 12
        dh, dw, db = ctx.saved_tensors
        for grad in (dh, dw, db):
            if grad is not None:
                scale_inplace(grad, grad_loss, ctx.use_triton)
        return dh, dw, db, *(None,) * 9

    @staticmethod
    def _recompute_backward(ctx, grad_loss, grad_entropy):
        # labels, lse and entropy are of the processed rows (row_index, or all)
        hidden, weight, bias, labels, lse, entropy, row_index, *precomputed = ctx.saved_tensors
        if not ctx.has_entropy:
            grad_entropy = None
        if row_index is not None:  # only the processed rows have gradients
            if grad_loss is not None:
                grad_loss = grad_loss.reshape(-1).index_select(0, row_index)
            if grad_entropy is not None:
                grad_entropy = grad_entropy.reshape(-1).index_select(0, row_index)
        if ctx.precomputed and grad_entropy is None and grad_loss is not None:
            ctx.precomputed = False  # scaled in place below: a second backward recomputes instead
            factor = _uniform_factor(grad_loss, labels, ctx.transform.ignore_index, precomputed[3])
            if factor is not None:
                return (*(_rescaled(grad, factor, ctx.use_triton) for grad in precomputed[:3]), *(None,) * 9)
        vocab_size = weight.shape[0]
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grads = _GradAccumulator(hidden, weight, bias, needs_hidden, needs_weight, needs_bias, row_index)
        grad_loss = grad_loss.float().contiguous() if grad_loss is not None else None
        grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
        num_rows = labels.shape[0]
        if (grad_loss is not None or grad_entropy is not None) and num_rows > 0:
            chunk_rows = ctx.chunk_rows
            buffer = torch.empty(min(chunk_rows, num_rows), vocab_size, dtype=hidden.dtype, device=hidden.device)
            gathered = _gather_buffer(hidden, row_index, buffer.shape[0], grads)
            for start in range(0, num_rows, chunk_rows):
                stop = min(start + chunk_rows, num_rows)
                raw = buffer[: stop - start]
                rows = slice(start, stop) if row_index is None else row_index[start:stop]
                hidden_chunk = _chunk_rows_of(hidden, rows, start, grads, gathered)
                _matmul_into(raw, hidden_chunk, weight, bias)
                chunk_grad(
                    raw,
                    labels[start:stop],
                    ctx.transform,
                    lse[start:stop],
                    entropy[start:stop] if grad_entropy is not None else None,
                    grad_loss[start:stop] if grad_loss is not None else None,
                    grad_entropy[start:stop] if grad_entropy is not None else None,
                    ctx.use_triton,
                )
                grads.add(raw, hidden_chunk, rows)
        elif grads.dh is not None:
            grads.dh.zero_()
        dh, dw, db = grads.results(weight.dtype, bias.dtype if bias is not None else None)
        return dh, dw, db, *(None,) * 9
