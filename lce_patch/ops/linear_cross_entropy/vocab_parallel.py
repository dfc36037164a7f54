"""The vocabulary-parallel form of the fused loss, for a head split along the vocabulary (tensor parallelism).

Design note
-----------
Under tensor parallelism the LM head's weight ``W`` [V, D] is split along the vocabulary: rank r of a
group of R holds rows ``[start_r, start_r + V_r)`` (and the bias's), and every rank holds the same
hidden states [N, D] and labels [N]. A token's loss needs its whole row of logits only through three
numbers, each a reduction over the vocabulary that splits into per-shard parts:

    lse = logsumexp_r(lse_r),   z_y = sum_r z_y,r (only the shard that owns y has it),
    sum_z = sum_r sum_z,r (label smoothing),
    loss = lse - (1 - eps) * z_y - eps * sum_z / V + z_loss * lse**2.

Each rank runs the single-GPU machinery of ``chunked.py`` over its shard, chunk by chunk: the GEMM into
a ``[C, V_r]`` buffer, then the statistics kernel with the labels mapped into the shard (a label the
shard does not own becomes an out-of-range id that counts as no target, so no column matches it),
plus the target logit in fp32 from its weight row where the shard owns it. One all-gather of a
``[4, C]`` fp32 block per chunk gives every rank every shard's parts, which each rank merges in the
same order: all ranks compute the same loss, bit for bit. With the merged ``lse`` each rank overwrites
its buffer with its columns of the logits gradient (``eps / V`` over the whole vocabulary), computes
its dW (and dbias) shard from them, and its part ``G_r @ W_r`` of dh; one all-reduce over the group
sums dh's parts, so every rank gets the full gradient of its (replicated) hidden states.

On the Triton path the label mapping is part of the op's one label launch (core/label_kernels.py), the
statistics kernel writes the exchanged block itself (its ``SHARD_PACK`` outputs), the merge is one launch
(vocab_parallel_kernels.py) and the exchange one ``all_gather_into_tensor`` into a preallocated buffer:
each rank's GEMMs shrink with the group while this bookkeeping does not, and written as torch operations
it kept the host, not the GPU, busy (about 25 launches per chunk).

No rank holds more than its ``[C, V_r]`` buffer of logits or more than its weight shard; the
unfused tensor-parallel head instead gathers the whole ``[N, V]`` logits on every rank. FLOPs per rank:
6 * N * V_r * D for a scalar loss (the gradient computed in the forward, as on one GPU), 8 for
per-token losses (recomputed in the backward). Communication: 16 * R bytes per token (statistics) and
one all-reduce of dh ([N, D]), which the unfused head's backward performs too.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.backend import stats_dtype
from ..core.schema import replace_checked_fields
from ..core.transform import LogitTransform
from .options import VocabShard, fail
from .rows import RowOutputs, chunk_grad, chunk_stats, final_logits


def is_dtensor(tensor: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def check_shard(shard: VocabShard, local_vocab: int, ignore_index: int) -> None:
    if not isinstance(shard, VocabShard):
        fail(f"vocab_shard must be a VocabShard, got {type(shard).__name__}")
    for name in ("start", "total"):
        value = getattr(shard, name)
        if isinstance(value, bool) or not isinstance(value, int):
            fail(f"vocab_shard.{name} must be an int, got {value!r}")
    if shard.start < 0 or shard.start + local_vocab > shard.total:
        fail(
            f"vocab_shard rows [{shard.start}, {shard.start + local_vocab}) (the weight's {local_vocab} rows from "
            f"start={shard.start}) do not lie inside the vocabulary [0, {shard.total})"
        )
    if 0 <= ignore_index < shard.total:
        # A shard's labels are renumbered from 0: an ignore_index among the vocabulary's ids would
        # collide with a real target id of some shard.
        fail(
            f"with a vocabulary-sharded weight, ignore_index must be negative or at least the vocabulary size "
            f"({shard.total}), got {ignore_index}"
        )
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        fail("a vocabulary-sharded weight needs an initialized torch.distributed process group")


def _vocab_dim_of(placements: tuple, what: str) -> int:
    """The mesh dimension along which a DTensor is sharded on its dim 0; every other one must replicate it."""
    from torch.distributed.tensor import Replicate, Shard

    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    others_replicate = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in shard_dims)
    if len(shard_dims) != 1 or placements[shard_dims[0]].dim != 0 or not others_replicate:
        fail(
            f"the {what} is a DTensor with placements {placements}; the vocabulary-parallel loss supports a weight "
            "sharded along the vocabulary (Shard(0)) on one mesh dimension and replicated on any other"
        )
    return shard_dims[0]


def unwrap_dtensors(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, VocabShard | None]:
    """Local tensors and the :class:`VocabShard` of a vocab-sharded DTensor ``weight`` (the tensor-parallel
    head); ``shard`` is None when ``weight`` is a plain tensor. Differentiable: the local weight's
    gradient returns to the DTensor as its shard. A DTensor ``hidden`` (sharded on the sequence under
    sequence parallelism, or partial) is gathered into the replicated layout the loss needs."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    if not isinstance(weight, DTensor):
        if isinstance(bias, DTensor):
            fail("the bias is a DTensor but the weight is not; shard both along the vocabulary, or neither")
        return hidden, weight, bias, labels, None
    if bias is not None:
        if (
            not isinstance(bias, DTensor)
            or bias.placements != weight.placements
            or bias.device_mesh != weight.device_mesh
        ):
            fail(f"the bias must be sharded like the weight (a DTensor with placements {weight.placements})")
        bias = bias.to_local()
    return hidden, weight.to_local(), bias, labels, _shard_of(weight)


# DTensor spec -> (that spec, its VocabShard). A head's weight keeps one spec object from step to step; the
# spec is held so that its id cannot be reused by another while the entry exists.
_SHARDS: dict[int, tuple[Any, VocabShard]] = {}
_SHARDS_KEPT = 16


def _shard_of(weight: Any) -> VocabShard:
    """The :class:`VocabShard` of a vocab-sharded DTensor, worked out once per spec: DTensor's offset
    computation and the mesh's group lookup, in Python, were a noticeable share of the op's host time."""
    spec = weight._spec
    cached = _SHARDS.get(id(spec))
    if cached is not None and cached[0] is spec:
        return cached[1]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh_dim = _vocab_dim_of(weight.placements, "weight")
    mesh = weight.device_mesh
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    shard = VocabShard(start=int(offset[0]), total=int(weight.shape[0]), group=mesh.get_group(mesh_dim))
    if len(_SHARDS) >= _SHARDS_KEPT:  # specs made per call (not a parameter's): keep the cache small
        _SHARDS.clear()
    _SHARDS[id(spec)] = (spec, shard)
    return shard


def group_size(shard: VocabShard) -> int:
    """The number of ranks the vocabulary is split over."""
    import torch.distributed as dist

    return dist.get_world_size(shard.group)


def all_reduce_sum(tensor: torch.Tensor, shard: VocabShard) -> None:
    import torch.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=shard.group)


# Rows of the exchanged block (fp32; fp64 for fp64 inputs): local lse of the buffer, local lse with the exact
# target swapped in, the target's final logit (0 where not owned), the sum of the final logits (label
# smoothing). vocab_parallel_kernels.py numbers them the same.
LSE_ROW, LOSS_LSE_ROW, TARGET_ROW, SUM_Z_ROW = range(4)


class ShardRowPass:
    """The row pass of one vocabulary shard: local statistics, their exchange, the merged loss and lse,
    and this shard's columns of the gradient (see the module's design note).

    ``transform.vocab_size`` is the whole vocabulary's size. One instance serves every chunk of a call.
    """

    def __init__(
        self, shard: VocabShard, transform: LogitTransform, max_rows: int, use_triton: bool, dtype, device
    ) -> None:
        self.shard = shard
        self.transform = transform
        self.use_triton = use_triton
        # Statistics of the shard alone: no smoothing or z-loss, which need the merged values.
        self.local_transform = replace_checked_fields(transform, label_smoothing=0.0, z_loss=0.0, vocab_size=None)
        self.world = group_size(shard)
        acc_dtype = stats_dtype(dtype)
        # Flat, so that a chunk's [4, C] block and the gathered [R, 4, C] are contiguous for any C. Every row
        # that is read is written first (the smoothing row only with smoothing): no fill needed.
        self.block = torch.empty(4 * max_rows, dtype=acc_dtype, device=device)
        self.gathered = torch.empty(self.world * 4 * max_rows, dtype=acc_dtype, device=device)
        # One launch per step instead of a dozen torch operations (vocab_parallel_kernels.py); fp32 statistics.
        self.fused = use_triton and acc_dtype == torch.float32

    def run(
        self,
        raw: torch.Tensor,
        labels: torch.Tensor,
        out: RowOutputs,
        target_raw: torch.Tensor,
        grad_scale: torch.Tensor | None,
    ) -> None:
        """Fill ``out.loss`` and ``out.lse`` [C] with the whole vocabulary's values for the chunk's rows;
        with ``grad_scale`` (0-d, the reduction factor) overwrite ``raw`` [C, V_r] with this shard's
        columns of the gradient. ``labels``: the chunk's labels as shard ids (``core.labels.prepare_labels``);
        ``target_raw``: their fp32 raw target logits (0 where not owned, from ``target_logits``)."""
        rows, local_vocab = raw.shape
        block = self.block[: 4 * rows].view(4, rows)
        smoothing = self.transform.label_smoothing != 0.0
        part = RowOutputs(
            loss=block[LOSS_LSE_ROW], lse=block[LSE_ROW], mean_logit=block[SUM_Z_ROW] if smoothing else None
        )
        if self.fused:  # the statistics kernel writes the exchanged rows itself
            chunk_stats(raw, labels, self.local_transform, part, None, True, target_raw, shard_target=block[TARGET_ROW])
        else:
            chunk_stats(raw, labels, self.local_transform, part, None, self.use_triton, target_raw)
            pack_block(block, labels, target_raw, local_vocab, self.transform)
        gathered = self.gathered[: self.world * 4 * rows]
        _all_gather_flat(gathered, block.view(-1), self.shard.group)
        merge_blocks(gathered.view(self.world, 4, rows), labels, out.loss, out.lse, self.transform, self.fused)
        if grad_scale is not None:  # the reduction factor, each row's (a 0-d one expanded: no copy)
            grad_rows = grad_scale.expand(rows) if grad_scale.dim() == 0 else grad_scale
            chunk_grad(raw, labels, self.transform, out.lse, None, grad_rows, None, self.use_triton)


def pack_block(
    block: torch.Tensor, labels: torch.Tensor, target_raw: torch.Tensor, local_vocab: int, transform: LogitTransform
) -> None:
    """Turn the local rows of ``block`` [4, C] (see :class:`ShardRowPass`) that :func:`.rows.chunk_stats` filled
    into the rows every rank exchanges, in place. ``labels`` [C]: shard ids; ``target_raw`` [C] fp32: raw
    target logits. The torch form of the Triton statistics kernel's ``shard_target`` output."""
    smoothing = transform.label_smoothing != 0.0
    owned = (labels >= 0) & (labels < local_vocab)
    exact_z = torch.where(owned, final_logits(target_raw, transform)[0].to(block.dtype), 0.0)
    # Without smoothing or z-loss the local loss is (lse with the exact target swapped in) - z_y, and
    # z_y = 0 where the shard does not own the label: adding z_y back gives that lse.
    block[LOSS_LSE_ROW] += exact_z
    block[TARGET_ROW] = exact_z
    if smoothing:
        block[SUM_Z_ROW] *= local_vocab  # the kernel's mean over the shard -> its sum


def merge_blocks(
    merged: torch.Tensor,
    labels: torch.Tensor,
    loss: torch.Tensor,
    lse: torch.Tensor,
    transform: LogitTransform,
    fused: bool,
) -> None:
    """Write the whole vocabulary's ``loss`` and ``lse`` [C] (fp32; loss 0 where ignored) from ``merged``
    [R, 4, C] (contiguous: every rank's block, in rank order). ``fused``: one Triton launch (CUDA, fp32)."""
    smoothing = transform.label_smoothing != 0.0
    world, _, rows = merged.shape
    if fused:
        import triton

        from .vocab_parallel_kernels import shard_merge_kernel

        shard_merge_kernel[(triton.cdiv(rows, _ROW_BLOCK),)](
            merged, labels, loss, lse, rows, world, transform.ignore_index, float(transform.label_smoothing),
            1.0 / transform.vocab_size, float(transform.z_loss), SMOOTHING=smoothing, Z_LOSS=transform.z_loss != 0.0,
            BLOCK=_ROW_BLOCK,
        )  # fmt: skip
        return
    loss_lse = torch.logsumexp(merged[:, LOSS_LSE_ROW], dim=0)
    eps = transform.label_smoothing
    merged_loss = loss_lse - (1.0 - eps) * merged[:, TARGET_ROW].sum(dim=0)
    if smoothing:
        merged_loss = merged_loss - eps * merged[:, SUM_Z_ROW].sum(dim=0) / transform.vocab_size
    if transform.z_loss:
        merged_loss = merged_loss + transform.z_loss * loss_lse * loss_lse
    loss.copy_(torch.where(labels != transform.ignore_index, merged_loss, 0.0))
    lse.copy_(torch.logsumexp(merged[:, LSE_ROW], dim=0))


_ROW_BLOCK = 512


def _all_gather_flat(output: torch.Tensor, block: torch.Tensor, group: Any) -> None:
    """Every rank's ``block`` (flat, contiguous) concatenated in rank order into ``output``: one collective,
    no list of buffers to stack."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(output, block, group=group)
