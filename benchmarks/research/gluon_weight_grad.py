"""The weight gradient of one chunk, ``dW += G^T @ h``, as a Hopper Gluon GEMM that reads the old dW early.

Probed on the H100 on 2026-11-24 and not kept in the op (benchmarks/NOTES.md v20; timed by probe_weight_grad.py): correct,
but on the H100 1.08-1.17x cuBLAS's ``mm`` without the old tile, 1.09-1.29x its ``addmm_`` with it, and +3 ms
per Llama-3-8B step in the op.

Design note
-----------
The chunked op adds each chunk's weight gradient into one bf16 ``dW`` [V, D]: ``dW += G^T h`` with
``G`` the chunk's logits gradient [C, V] and ``h`` its hidden rows [C, D], K = C (512-2048 rows).
cuBLAS's ``addmm_`` reads each old dW tile in its epilogue, after the tile's main loop: on the H100
its eight dW GEMMs of a Llama-3-8B step take ~1.3 ms more than the same GEMMs writing a fresh output
(benchmarks/NOTES.md v17, v20). The old tile is known before the main loop starts, so its read can be
issued early.

Algorithm. One persistent program per SM walks output tiles [128 (vocabulary), 256 (hidden)] of
dW, vocabulary-major, so the programs running at once share G's columns in L2 and h ([C, D], a few
MiB) stays in L2. Each tile runs a K loop over the chunk's rows in steps of 64: TMA copies G's
[64, 128] and h's [64, 256] tiles into a three-slot ring; one asynchronous warpgroup MMA is in
flight while the next two slots load, and the ring continues across tiles, so the next tile's first
loads run under this tile's epilogue. Halfway through a tile's K loop a TMA copy brings the old dW
tile into a shared buffer of its own (after waiting for the previous tile's store out of it), so
the epilogue finds it there: it adds it to the fp32 accumulator, rounds once to the dW dtype and
starts a TMA store it waits for only when the buffer is needed again.
G's tile is the MMA's A operand read transposed from shared memory (G is [C, V] row-major).

Memory: no global memory beyond dW; shared memory 3 x (16 + 32) KiB ring + 64 KiB dW tile = 208 KiB.
FLOPs 2 C V D; bytes: G once (L2 reuse across the hidden tiles of a vocabulary tile), dW read and
written once, h from L2.

Only for Hopper (sm_90), bf16 or fp16 operands and dW of the same dtype, 2-D tensors with a
contiguous last dimension and 16-byte aligned rows (TMA's rules); :func:`supports` says whether a
call qualifies.
"""

from __future__ import annotations

import torch

try:  # Gluon ships inside Triton (3.5+); older Triton or none leaves cuBLAS in charge
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.6 names the TMA copies async_copy_*; later releases call them async_load / async_store.
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
    _HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _HAVE_GLUON = False

BLOCK_VOCAB = 128
BLOCK_HIDDEN = 256
BLOCK_ROWS = 64
NUM_BUFFERS = 3
NUM_WARPS = 8

if _HAVE_GLUON:

    @gluon.jit
    def _tile_origin(tile, num_hidden_tiles, BLOCK_V: gl.constexpr, BLOCK_D: gl.constexpr):
        return (tile // num_hidden_tiles) * BLOCK_V, (tile % num_hidden_tiles) * BLOCK_D

    @gluon.jit
    def _load_step(
        step, total_steps, num_k, program, programs, num_hidden_tiles, g_desc, h_desc, g_bufs, h_bufs, ready
    ):
        """Start the TMA copies of ``step``'s G and h tiles into its ring slot (none past the last step).
        Step s is K step s % num_k of this program's (s // num_k)-th tile."""
        BLOCK_K: gl.constexpr = g_desc.block_type.shape[0]
        slot = step % g_bufs.shape[0]
        pred = step < total_steps
        off_v, off_d = _tile_origin(
            program + (step // num_k) * programs,
            num_hidden_tiles,
            g_desc.block_type.shape[1],
            h_desc.block_type.shape[1],
        )
        off_k = (step % num_k) * BLOCK_K
        mbarrier.expect(ready.index(slot), g_desc.block_type.nbytes + h_desc.block_type.nbytes, pred=pred)
        _tma_load(g_desc, [off_k, off_v], ready.index(slot), g_bufs.index(slot), pred)
        _tma_load(h_desc, [off_k, off_d], ready.index(slot), h_bufs.index(slot), pred)

    @gluon.jit
    def _weight_grad_kernel(
        g_desc,
        h_desc,
        dw_desc,
        ACCUMULATE: gl.constexpr,
        NUM_BUFFERS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        BLOCK_K: gl.constexpr = g_desc.block_type.shape[0]
        BLOCK_V: gl.constexpr = g_desc.block_type.shape[1]
        BLOCK_D: gl.constexpr = h_desc.block_type.shape[1]
        dtype: gl.constexpr = g_desc.dtype
        rows = g_desc.shape[0]
        vocab = dw_desc.shape[0]
        hidden = dw_desc.shape[1]

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_D, 16]
        )
        g_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + g_desc.block_type.shape, g_desc.layout)
        h_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + h_desc.block_type.shape, h_desc.layout)
        dw_buf = gl.allocate_shared_memory(dtype, dw_desc.block_type.shape, dw_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        old_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUFFERS):
            mbarrier.init(ready.index(i), count=1)
        mbarrier.init(old_ready, count=1)

        num_hidden_tiles = gl.cdiv(hidden, BLOCK_D)
        num_tiles = gl.cdiv(vocab, BLOCK_V) * num_hidden_tiles
        num_k = gl.cdiv(rows, BLOCK_K)
        program = gl.program_id(0)
        programs = gl.num_programs(0)
        my_tiles = gl.cdiv(num_tiles - program, programs)
        total_steps = my_tiles * num_k
        old_at = num_k // 2
        ring = (total_steps, num_k, program, programs, num_hidden_tiles, g_desc, h_desc, g_bufs, h_bufs, ready)

        for s in gl.static_range(NUM_BUFFERS - 1):  # prologue: the first NUM_BUFFERS - 1 steps
            _load_step(s, *ring)

        acc = gl.zeros((BLOCK_V, BLOCK_D), dtype=gl.float32, layout=mma_layout)
        old_phase = 0
        for step in range(total_steps):
            k = step % num_k
            off_v, off_d = _tile_origin(program + (step // num_k) * programs, num_hidden_tiles, BLOCK_V, BLOCK_D)
            if ACCUMULATE:
                if k == old_at:
                    tma.store_wait(pendings=0)  # the previous tile's store is done with dw_buf
                    mbarrier.expect(old_ready, dw_desc.block_type.nbytes)
                    _tma_load(dw_desc, [off_v, off_d], old_ready, dw_buf)
            slot = step % NUM_BUFFERS
            mbarrier.wait(ready.index(slot), (step // NUM_BUFFERS) & 1)
            acc = warpgroup_mma(
                g_bufs.index(slot).permute((1, 0)), h_bufs.index(slot), acc, use_acc=k > 0, is_async=True
            )
            # At most this MMA stays in flight: the previous one is done, so its slot may be refilled.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))

            _load_step(step + NUM_BUFFERS - 1, *ring)

            if k == num_k - 1:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                if ACCUMULATE:
                    mbarrier.wait(old_ready, old_phase)
                    old_phase ^= 1
                    out = acc + dw_buf.load(mma_layout).to(gl.float32)
                else:
                    tma.store_wait(pendings=0)
                    out = acc
                dw_buf.store(out.to(dtype))
                fence_async_shared()
                _tma_store(dw_desc, [off_v, off_d], dw_buf)

        tma.store_wait(pendings=0)
        for i in gl.static_range(NUM_BUFFERS):
            mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(old_ready)


def _tma_ready(tensor: torch.Tensor) -> bool:
    """TMA's rules for a 2-D operand: contiguous last dimension, 16-byte aligned base and row stride."""
    size = tensor.element_size()
    return (
        tensor.dim() == 2
        and tensor.stride(1) == 1
        and (tensor.stride(0) * size) % 16 == 0
        and tensor.data_ptr() % 16 == 0
        and tensor.shape[0] > 0
        and tensor.shape[1] > 0
    )


def supports(dw: torch.Tensor, grad_chunk: torch.Tensor, hidden_chunk: torch.Tensor) -> bool:
    """Whether :func:`add_weight_grad_` can take this call (Hopper, bf16/fp16, TMA-ready operands)."""
    if not (_HAVE_GLUON and dw.is_cuda and grad_chunk.is_cuda and hidden_chunk.is_cuda):
        return False
    if dw.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not (dw.dtype == grad_chunk.dtype == hidden_chunk.dtype):
        return False
    if torch.cuda.get_device_capability(dw.device)[0] != 9:
        return False
    rows, vocab = grad_chunk.shape
    if hidden_chunk.shape[0] != rows or dw.shape != (vocab, hidden_chunk.shape[1]):
        return False
    return all(_tma_ready(t) for t in (dw, grad_chunk, hidden_chunk))


def add_weight_grad_(dw: torch.Tensor, grad_chunk: torch.Tensor, hidden_chunk: torch.Tensor, accumulate: bool) -> None:
    """``dw = dw + grad_chunk.T @ hidden_chunk`` (or ``=`` without ``accumulate``) in place, fp32
    accumulation and one rounding to dw's dtype.

    dw: [V, D]; grad_chunk: [C, V]; hidden_chunk: [C, D]; one dtype (bf16 or fp16); call only where
    :func:`supports` says so."""
    layout_g = gl.NVMMASharedLayout.get_default_for([BLOCK_ROWS, BLOCK_VOCAB], _gl_dtype(grad_chunk.dtype))
    layout_h = gl.NVMMASharedLayout.get_default_for([BLOCK_ROWS, BLOCK_HIDDEN], _gl_dtype(hidden_chunk.dtype))
    layout_dw = gl.NVMMASharedLayout.get_default_for([BLOCK_VOCAB, BLOCK_HIDDEN], _gl_dtype(dw.dtype))
    g_desc = TensorDescriptor.from_tensor(grad_chunk, [BLOCK_ROWS, BLOCK_VOCAB], layout_g)
    h_desc = TensorDescriptor.from_tensor(hidden_chunk, [BLOCK_ROWS, BLOCK_HIDDEN], layout_h)
    dw_desc = TensorDescriptor.from_tensor(dw, [BLOCK_VOCAB, BLOCK_HIDDEN], layout_dw)
    num_sms = torch.cuda.get_device_properties(dw.device).multi_processor_count  # cached by torch
    tiles = -(-dw.shape[0] // BLOCK_VOCAB) * -(-dw.shape[1] // BLOCK_HIDDEN)
    grid = (min(num_sms, tiles),)
    _weight_grad_kernel[grid](g_desc, h_desc, dw_desc, accumulate, NUM_BUFFERS, num_warps=NUM_WARPS)


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description="The Gluon dW kernel as a module (add_weight_grad_, supports); "
        "probe_weight_grad.py in this folder checks it against float64 and times it beside cuBLAS."
    ).parse_args()
    print("gluon_weight_grad.py is a module: run probe_weight_grad.py to check and time its kernel.")
