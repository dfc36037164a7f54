"""The GEMMs of a chunk and the accumulation of its gradients, shared by every op.

A chunk's logits are one GEMM into the op's reused ``[chunk, V]`` buffer (:func:`logits_into`, with an
optional low-rank term added by a second GEMM into the same buffer); once a row pass has overwritten the
buffer with the gradient ``G`` of the chunk's raw logits, :class:`GradAccumulator` turns it into dh rows
(``G @ W``), dW (``+= G.T @ h``) and dbias, each GEMM accumulating in fp32 inside cuBLAS.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .backend import scale_all_inplace, stats_dtype

# Whether a chunk's dW GEMM runs on a second CUDA stream beside its dh GEMM (GradAccumulator;
# on the H100 1.1 ms faster per Llama-3-8B step, 0.2-0.4 ms on Qwen2.5 and Gemma-2, NOTES v19).
OVERLAP_WEIGHT_GRADS = True


def matmul_into(out: torch.Tensor, hidden_chunk: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``out = hidden_chunk @ weight.T (+ bias)``. An ``out`` wider than the inputs (fp32 for bf16/fp16 inputs)
    takes the GEMM's fp32 accumulator unrounded (:func:`mm_fp32_into`), the bias added in ``out``'s dtype."""
    if out.dtype != hidden_chunk.dtype:
        mm_fp32_into(out, hidden_chunk, weight.t())
        if bias is not None:
            out.add_(bias)
        return
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


def logits_into(
    out: torch.Tensor,
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    low_rank: LowRank | None,
    rows: slice | torch.Tensor,
) -> None:
    """A chunk's raw logits: ``hidden_chunk @ W.T (+ bias) (+ the low-rank term's rows)``, the low-rank
    product added by the GEMM itself (fp32 accumulation, one rounding)."""
    matmul_into(out, hidden_chunk, weight, bias)
    if low_rank is not None:
        out.addmm_(low_rank.rows(rows), low_rank.weight.t())


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
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


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as fp32, accumulated in fp32 and not rounded to the inputs' dtype."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    mm_fp32_into(out, a, b)
    return out


def mm_fp32_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` for an fp32 ``out``, accumulated in fp32 and not rounded to the inputs' dtype."""
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out)
    elif a.device.type == "cuda":
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:  # the CPU interpreter's tests: no fp32-output GEMM there
        torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


# torch's fp32-output GEMM (``mm(..., out_dtype=)``, CUDA) exists from torch 2.8 on; the package allows older.
_HAS_FP32_OUTPUT_MM = "dtype" in torch.ops.aten.mm.overloads()


def fp32_output_gemm_available(device: torch.device) -> bool:
    """Whether :func:`mm_fp32` runs on ``device`` (CUDA needs torch's ``mm(..., out_dtype=)``)."""
    return device.type != "cuda" or _HAS_FP32_OUTPUT_MM


class GradAccumulator:
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
        fp32_weight_grad: bool = False,
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
        # fp16 lacks the range to hold a sum over many tokens: accumulate its dW in fp32. bf16 and fp32 add
        # each chunk's GEMM result into dW in place (one rounding per chunk), bf16 in fp32 on request.
        self.dw_fp32 = weight.dtype == torch.float16 or (fp32_weight_grad and weight.dtype == torch.bfloat16)
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
            raise ValueError("GradAccumulator: a row_factor is only taken when dh is the only gradient")
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
        staging = reuse_as(grad_chunk, dh_rows.shape)
        staging.copy_(dh_rows)
        dh_rows.zero_()
        self.dh.index_copy_(0, rows, staging)

    def _dh_product(self, grad_chunk: torch.Tensor, row_factor: torch.Tensor | None, out: torch.Tensor):
        if row_factor is None:
            return torch.mm(grad_chunk, self.weight, out=out)
        return torch.mul(mm_fp32(grad_chunk, self.weight), row_factor[:, None], out=out)

    def _add_weight_grads(self, grad_chunk: torch.Tensor, hidden_chunk: torch.Tensor, rows) -> None:
        # The low-rank term's gradients first: with a row selection G's memory is reused after the GEMMs.
        if self.d_low_rank_weight is not None:
            addmm_fp32(self.d_low_rank_weight, grad_chunk.t(), self.low_rank.rows(rows))
        if self.d_low_rank_hidden is not None:
            if isinstance(rows, slice):
                torch.mm(grad_chunk, self.low_rank.weight, out=self.d_low_rank_hidden[rows])
            else:
                self.d_low_rank_hidden.index_copy_(0, rows, torch.mm(grad_chunk, self.low_rank.weight))
        if self.dw is not None:
            if not self._dw_written:
                self.dw.zero_() if self.dw_fp32 else torch.mm(grad_chunk.t(), hidden_chunk, out=self.dw)
            if self.dw_fp32:
                addmm_fp32(self.dw, grad_chunk.t(), hidden_chunk)
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


def reuse_as(buffer: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A ``shape`` view of the front of a contiguous ``buffer`` whose values are no longer needed
    (a new tensor when it is too small: a vocabulary smaller than the hidden size)."""
    numel = shape.numel()
    if buffer.is_contiguous() and buffer.numel() >= numel:
        return buffer.view(-1)[:numel].view(shape)
    return buffer.new_empty(shape)


def scaled_by_upstream(
    grads: tuple[torch.Tensor | None, ...], grad_out: torch.Tensor | None, *, in_place: bool, use_triton: bool
) -> tuple[torch.Tensor | None, ...]:
    """The gradients a scalar loss computed in its forward, times the upstream gradient ``grad_out`` (0-d):
    the whole backward of a scalar loss, for eager and compiled calls alike. None stays None.

    ``in_place`` (eager calls): scaled where they are, no second copy of dW (free when ``grad_out`` is exactly
    1 on Triton). Otherwise (a graph, which cannot scale a saved tensor in place): a new tensor, the product
    taken in fp32 (fp64 for fp64) and rounded once, as in place.
    """
    if in_place and grad_out is not None:
        scale_all_inplace([grad for grad in grads if grad is not None], grad_out, use_triton)
        return tuple(grads)
    scaled = []
    for grad in grads:
        if grad_out is None or grad is None:
            scaled.append(None)
        else:
            compute = torch.promote_types(grad.dtype, torch.float32)
            scaled.append((grad.to(compute) * grad_out.to(compute)).to(grad.dtype))
    return tuple(scaled)


def claim_scalar_backward(ctx, op_name: str) -> None:
    """An eager scalar loss's backward may run once: its gradients, computed in the forward, are scaled in place."""
    if getattr(ctx, "backward_done", False):
        raise RuntimeError(
            f"{op_name}: backward through the same scalar loss twice is not supported "
            "(its gradients were computed in the forward and are scaled in place)."
        )
    ctx.backward_done = True


def absent_to_none(grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
    """A custom operator's gradient outputs with its "not computed" marker, a tensor of shape (0,), as None.

    (A computed gradient never has that shape: dW, dh and a low-rank factor's are 2-D, dbias has V >= 1 rows.)
    """
    return tuple(None if grad.shape == (0,) else grad for grad in grads)


def none_to_absent(
    grads: tuple[torch.Tensor | None, ...] | None, markers: tuple[tuple[torch.Tensor, torch.dtype | None], ...]
) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`absent_to_none`: each None gradient (all of them when ``grads`` is None) as the
    "not computed" marker, a new empty tensor on ``like``'s device in ``dtype`` (None: ``like``'s), one
    ``(like, dtype)`` per gradient. New each time: a custom operator's outputs may not alias."""
    grads = grads or (None,) * len(markers)
    return tuple(
        grad if grad is not None else like.new_empty(0, dtype=dtype or like.dtype)
        for grad, (like, dtype) in zip(grads, markers, strict=True)
    )
