"""Triton kernels for the softmax statistics and the logits gradient of one chunk.

Design note
-----------
The op works on one chunk of C tokens at a time. The projection ``raw = hidden_c @ W.T (+ bias)``
is a cuBLAS GEMM that writes a ``[C, V]`` buffer in the compute dtype; the kernels here read that
buffer and never see more than it, so the logits of the whole batch never exist.

Per token the final logits are ``z = softcap * tanh(logit_scale * raw / softcap) / temperature``
(no tanh without softcap). The loss of a token with target ``y`` is::

    loss = lse - (1 - eps) * z_y - eps * mean(z) + z_loss * lse**2,    lse = logsumexp(z)

and its gradient with respect to ``raw`` is::

    dloss/draw_j = (p_j * (1 + 2 * z_loss * lse) - (1 - eps) * [j == y] - eps / V)
                   * (1 - tanh_j**2) * logit_scale / temperature,        p = softmax(z)

Class weights ``w`` with label smoothing (``WEIGHTED_SMOOTHING``; ``F.cross_entropy(weight=w,
label_smoothing=eps)``) weigh the smoothing term as well: a row's loss is
``(1 - eps) * w_y * (lse - z_y) + eps / V * sum_v w_v * (lse - z_v) + w_y * z_loss * lse**2``, which is::

    f * (lse - (1 - eps_y) * z_y - eps_y * sum_v q_v z_v + zl_y * lse**2),      q = w / W,  W = sum_v w_v,
    f = (1 - eps) * w_y + eps * W / V,   eps_y = eps * W / V / f,   zl_y = w_y * z_loss / f

(chunked.py's ``_class_smoothing``; eps_y = zl_y = 0 where f = 0, q = 0 where W = 0): the formulas above with
the row's own smoothing ``eps_y`` and z-loss factor ``zl_y`` (two fp32 loads per row, in place of the scalars)
and the smoothing spread as ``q`` instead of ``1 / V``. So the first pass sums ``q_v * z_v`` (one more fp32
load per logit, of a [V] vector that every row shares and L2 holds) instead of the plain sum of the logits, and
the gradient pass subtracts ``eps_y * q_j`` instead of ``eps / V``; the factor ``f`` (times the token weight)
goes through the per-row scale of the gradient like any row weight, and the host multiplies the row's loss by
it. The mean logit keeps its own sum, and the other cases compile without any of this. The passes then read 6
bytes per logit instead of 2 (bf16): on the H200, per 1024-row chunk of the Llama-3 vocabulary, 209 -> 266 us
with the gradient, 82 -> 262 without. Without a softcap ``sum_v q_v z_v`` is linear in the hidden state,
``logit_scale * (h . W^T q + b . q)``, a GEMV that could spare the first pass that load (not done).

``stats_kernel`` (one program per row) makes two passes over the row's V logits. The first is an
online log-sum-exp in fp32, kept per lane and merged once at the end: a running max ``m`` and a
sum ``s`` of ``exp(z - m)``, rescaled when the max grows, plus the target logit, the sum of the logits
(label smoothing, mean logit), the entropy's sums (below), the sum of ``exp(2 (z - m))`` (``log sum
p**2``, for WPO weights) and the argmax (the predicted token, and the argmax check).

The argmax (``WANT_ARGMAX``: the predicted token ids; ``WANT_TOP1``: whether the label is the argmax) follows
``torch.argmax``: the first index on ties, NaN the max. Each lane keeps the column of its max: per block, the
first column that holds the lane's block max (a NaN's when that max is NaN), taken only when it beats the lane's
max so far strictly, or is the lane's first NaN, so that earlier columns win ties; after the loop, the smallest
column among the lanes that hold the row's max. The argmax check is ``argmax == label``, so the token accuracy
and the ids always agree. Costs a compare, a select and a min per logit and one int32 register per lane, only
when asked (constexprs: without them the kernel compiles as before; with them the loss's and the gradient's
arithmetic is unchanged, bit for bit). The bounded-exponent path keeps no max otherwise; with one logit per lane
(its form with the gradient) it keeps the max and its column per ``MAX_REGROUP`` = 8 lanes (an order-preserving
reshape), which took the argmax's cost there from +62% to +16%. On the H200, per 1024-row chunk of the
Llama-3 vocabulary in bf16, the ids cost 80 -> 98 us without the gradient, 209 -> 217 with it, softcapped
(bound 30) 124 -> 150 and 251 -> 291, one-pass 166 -> 177; the check, which used to track the max before the
target instead, went from 105, 217, 177, 400 and 202 us to 98, 219, 150, 277 and 179. It is the argmax of
the final logits: under a softcap, tanh may round distinct raw logits near the cap to one value, and that tie
goes to the first index.

The entropy is a sum of non-negative terms::

    H = log1p(r) + sum_j e_j (m - z_j) / (1 + r),    e_j = exp(z_j - m),  r = s - 1

with ``r`` summed from the logits below the max (its ties counted exactly), never as ``s - 1``. The
textbook ``lse - sum p z`` cancels two numbers of size |z| to leave a tiny entropy on a confident
token: in fp32 it came out negative (-7.6e-6) or 8x off at temperature 0.1. Per lane the kernel keeps
the gap sum, the rest and the tie count against the lane's max, and moves them to the row's max at the
end; the relative error is then the one the fp32 logits carry (tests/ops/test_ranges.py). It costs a
compare and two selects per logit, with entropy only, and the softcapped fixed-max shortcut (below) is
not used then. The target logit is read once per row, by a load masked
off for an ignored or out-of-range label, so the loops compare no column with the label. Full
blocks of the row run without masks; only the last, partial block is masked.
The buffer rounds each logit to the compute dtype (bf16: a relative error of 2^-9, ~0.06 on a
logit of 30), and the loss reads the target logit directly; so with ``HAS_EXACT_TARGET`` the loss
uses the target's raw logit computed in fp32 by ``target_logit_kernel`` (a D-long dot product per
token) and swaps its term inside the sum of exponentials. On the H100 this took the bf16 loss
error from ~6e-5 to ~2e-6 relative to fp32 (benchmarks/NOTES.md, v5). The gradient keeps the
buffer's own softmax, which is what the GEMMs consume.
When ``WRITE_GRAD`` is set, a second pass overwrites the buffer in place with the gradient above
(the target's ``-(1 - eps)`` term in one store after the loop, behind a barrier), times the
reduction factor read from device memory (1/n_valid or 1/num_items_in_batch for a valid row, 0 for
an ignored one; with ``PER_ROW_SCALE`` the row's own, which carries its token and class weights),
exactly where the unfused path applies it: scaling a bf16 dh or dW afterwards would round it a
second time. The second pass re-reads the row from HBM: one program per row keeps more
rows in flight than L2 holds, and fewer programs looping over rows measured slower (NOTES v10).

With a softcap (``FIXED_MAX``: |z| <= softcap / temperature <= 40) and no label smoothing or
z-loss, ``UNNORMALIZED_GRAD`` writes the gradient in the first pass instead, saving the second
read of the buffer and the second tanh and exp per logit (3 special-function ops per logit per pass,
which bound the softcapped passes): each logit is overwritten as it is read with

    U_j = exp(z_j - ref) * (1 - tanh_j**2),        ref = max(z_y, bound - 40) for the row,

which needs no running max since every exponent is bounded, and after the loop the target's
element becomes ``(exp(z_y - ref) - sum_exp) * (1 - tanh_y**2)``. The row's gradient is then
``U * row_factor`` with ``row_factor = reduction factor * logit_scale / temperature / sum_exp``, an
fp32 value per row that the kernel stores and core/grads.py applies to the fp32 rows of ``U @ W``
before dh's one rounding. ``ref`` keeps U in range: at most e^40 per element (the sum stays finite
in fp32 for any V), and the row's largest at least e^-40, also for a row whose logits all sit near
-bound. On the H100 this pass took 675 us per 1792-row chunk of the Gemma-2 vocabulary against 991
for the two passes (NOTES v15). The op uses it only when dh is the only gradient (a frozen W): a
dW GEMM cannot scale its K rows, and putting the factor on hidden's rows rounds them a second time.

``grad_kernel`` (a 2-D grid over rows and vocab blocks) is the backward of per-token outputs:
it takes the saved ``lse`` and entropy and per-row upstream gradients of the loss and of the
entropy, and overwrites the recomputed buffer with their combined gradient::

    dH/dz_j = -p_j * (z_j - lse + H)        (H = entropy)

Memory: the ``[C, V]`` buffer (compute dtype) plus a few fp32 vectors of length C; nothing
proportional to N x V. FLOPs: ~10 per logit per pass (exp; with a softcap, tanh from one more exp
and a division), negligible next to the 2*D FLOPs per logit of each GEMM; both kernels are bound by
memory bandwidth: 2 reads + 1 write of the buffer (stats + gradient), or 1 read + 1 write (grad
kernel, and the one-pass softcapped gradient). On the H100 the stats + gradient pass streams ~2.7 TB/s (NOTES v10).
No atomics, so results are deterministic run to run.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.triton_helpers import lane_argmax, log1p, max_keep_nan, transform_logits

# With UNNORMALIZED_GRAD, a row's exponentials are taken against a reference at most this far below
# the bound of its logits (see stats_kernel).
UNNORMALIZED_REF_SPAN: tl.constexpr = tl.constexpr(40.0)


@triton.jit
def _load_block(row_ptr, cols, vocab_size, MASKED: tl.constexpr):
    """fp32 logits at ``cols`` of a row; with ``MASKED``, columns past its end read as 0."""
    if MASKED:
        raw = tl.load(row_ptr + cols, mask=cols < vocab_size, other=0.0)
    else:
        raw = tl.load(row_ptr + cols)
    return raw.to(tl.float32)


@triton.jit
def _stats_block(
    row_ptr,
    cols,
    vocab_size,
    logit_scale,
    softcap,
    inv_temperature,
    fixed_max,
    lane_max,
    lane_sum,
    lane_sum_z,
    lane_z,
    lane_sum_sq,
    lane_rest,
    lane_ties,
    q_ptr,
    lane_qz,
    lane_arg,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SUM_Z: tl.constexpr,
    WEIGHTED_SMOOTHING: tl.constexpr,
    FIXED_MAX: tl.constexpr,
    WANT_ENTROPY: tl.constexpr,
    WANT_LOG_SUM_SQ: tl.constexpr,
    WANT_ARGMAX: tl.constexpr,
    MAX_REGROUP: tl.constexpr,
    STORE_UNNORMALIZED: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One block of the first pass: fold the logits at ``cols`` [LANES, GROUP] into the per-lane
    accumulators [LANES] (one lane holds GROUP consecutive logits); with ``STORE_UNNORMALIZED``
    (bounded exponents only) also overwrite them with ``exp(z - fixed_max) * (1 - tanh**2)``; with
    ``WEIGHTED_SMOOTHING`` add ``q * z`` (``q``: the normalized class weights at ``cols``) into ``lane_qz``;
    with ``WANT_ARGMAX`` keep in ``lane_arg`` the column of each lane's max (``lane_max``; both per
    ``MAX_REGROUP`` lanes on the bounded-exponent path)."""
    raw = _load_block(row_ptr, cols, vocab_size, MASKED)
    z, t = transform_logits(raw, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
    z_or_0 = z
    if MASKED:
        in_row = cols < vocab_size
        z_or_0 = tl.where(in_row, z, 0.0)
        z = tl.where(in_row, z, float("-inf"))
    if FIXED_MAX:
        # Softcapped logits are bounded, |z| <= fixed_max: exponentials taken against that bound
        # neither overflow nor (bound <= 40) all underflow, so no running max and no rescaling.
        e = tl.exp(z - fixed_max)  # 0 for padding (z = -inf), NaN stays NaN
        lane_sum += tl.sum(e, 1)
        if STORE_UNNORMALIZED:
            unnormalized = (e * (1.0 - t * t)).to(row_ptr.dtype.element_ty)
            if MASKED:
                tl.store(row_ptr + cols, unnormalized, mask=cols < vocab_size)
            else:
                tl.store(row_ptr + cols, unnormalized)
        if WANT_ARGMAX:  # the max is kept for the argmax only
            z_max, max_cols = z, cols
            if MAX_REGROUP > 1:  # one logit per lane: the max (and argmax) kept per MAX_REGROUP lanes
                z_max = tl.reshape(z, [z.shape[0] // MAX_REGROUP, z.shape[1] * MAX_REGROUP])
                max_cols = tl.reshape(cols, [z.shape[0] // MAX_REGROUP, z.shape[1] * MAX_REGROUP])
            block_max = tl.reduce(z_max, 1, max_keep_nan)
            lane_arg = lane_argmax(z_max, max_cols, block_max, lane_max, lane_arg)
            lane_max = max_keep_nan(lane_max, block_max)
    else:
        # One running max per lane, i.e. per GROUP logits: one rescale exp per group, one exp per
        # logit. NaN must win the max (the default max drops it): a NaN logit seen first in its
        # lane would otherwise look like padding below and vanish from the sums.
        block_max = tl.reduce(z, 1, max_keep_nan)
        if WANT_ARGMAX:
            lane_arg = lane_argmax(z, cols, block_max, lane_max, lane_arg)
        new_max = max_keep_nan(lane_max, block_max)
        empty_lane = new_max == float("-inf")  # only padding seen so far: keep zero sums, no inf - inf
        rescale = tl.where(empty_lane, 1.0, tl.exp(lane_max - new_max))
        e = tl.where(empty_lane[:, None], 0.0, tl.exp(z - new_max[:, None]))
        lane_sum = lane_sum * rescale + tl.sum(e, 1)
        if WANT_ENTROPY:
            # Non-negative sums only (see the design note): the gaps below the lane's max, weighted by
            # e, and the exponentials of the logits below it ("rest"); the max's ties are counted.
            # When the max grows, every logit seen so far falls below it.
            grew = new_max > lane_max
            seen = lane_rest + lane_ties
            shift = tl.where(lane_max == float("-inf"), 0.0, new_max - lane_max)
            below = z < new_max[:, None]
            gap = new_max[:, None] - z
            if MASKED:  # padding (z = -inf, e = 0) adds nothing: no 0 * inf
                gap = tl.where(in_row, gap, 0.0)
            lane_sum_z = rescale * (lane_sum_z + shift * seen) + tl.sum(tl.where(below, e * gap, 0.0), 1)
            lane_rest = tl.where(grew, rescale * seen, lane_rest) + tl.sum(tl.where(below, e, 0.0), 1)
            lane_ties = tl.where(grew, 0.0, lane_ties) + tl.sum(tl.where(z == new_max[:, None], 1.0, 0.0), 1)
        if WANT_LOG_SUM_SQ:  # sum of exp(2 (z - max)): the largest term is 1, so it cannot underflow
            lane_sum_sq = lane_sum_sq * (rescale * rescale) + tl.sum(e * e, 1)
        lane_max = new_max
    if HAS_SUM_Z:
        lane_z += tl.sum(z_or_0, 1)
    if WEIGHTED_SMOOTHING:  # q is 0 past the row's end, where z_or_0 is 0 too
        lane_qz += tl.sum(_load_block(q_ptr, cols, vocab_size, MASKED) * z_or_0, 1)
    return lane_max, lane_sum, lane_sum_z, lane_z, lane_sum_sq, lane_rest, lane_ties, lane_qz, lane_arg


@triton.jit
def _grad_block(
    row_ptr,
    cols,
    vocab_size,
    lse,
    p_scale,
    raw_scale,
    logit_scale,
    softcap,
    inv_temperature,
    label_smoothing,
    q_ptr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    WEIGHTED_SMOOTHING: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One block of the second pass: overwrite the logits at ``cols`` with their gradient, leaving out
    the target's ``- (1 - label_smoothing)`` (the kernel writes the target's element after the loop).
    With ``WEIGHTED_SMOOTHING``, ``label_smoothing`` is the row's own (``eps_y``) and spreads as ``eps_y * q_j``."""
    raw = _load_block(row_ptr, cols, vocab_size, MASKED)
    z, t = transform_logits(raw, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
    grad = tl.exp(z - lse) * p_scale
    if WEIGHTED_SMOOTHING:
        grad -= label_smoothing * _load_block(q_ptr, cols, vocab_size, MASKED)
    elif HAS_SMOOTHING:
        grad -= label_smoothing / vocab_size
    grad = grad * raw_scale
    if HAS_SOFTCAP:
        grad = grad * (1.0 - t * t)
    if MASKED:
        tl.store(row_ptr + cols, grad.to(row_ptr.dtype.element_ty), mask=cols < vocab_size)
    else:
        tl.store(row_ptr + cols, grad.to(row_ptr.dtype.element_ty))


@triton.jit
def stats_kernel(
    logits_ptr,
    logits_row_stride,
    labels_ptr,
    loss_ptr,
    lse_ptr,
    entropy_ptr,
    is_top1_ptr,
    mean_logit_ptr,
    log_sum_sq_ptr,
    argmax_ptr,
    grad_scale_ptr,
    target_raw_ptr,
    row_factor_ptr,
    class_q_ptr,
    row_smoothing_ptr,
    row_z_loss_ptr,
    shard_target_ptr,
    vocab_size,
    ignore_index,
    logit_scale,
    softcap,
    inv_temperature,
    label_smoothing,
    z_loss,
    fixed_max,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_EXACT_TARGET: tl.constexpr,
    FIXED_MAX: tl.constexpr,
    WANT_ENTROPY: tl.constexpr,
    WANT_TOP1: tl.constexpr,
    WANT_MEAN_LOGIT: tl.constexpr,
    WANT_LOG_SUM_SQ: tl.constexpr,
    WANT_ARGMAX: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    UNNORMALIZED_GRAD: tl.constexpr,
    PER_ROW_SCALE: tl.constexpr,
    WEIGHTED_SMOOTHING: tl.constexpr,
    SHARD_PACK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LANE_GROUP: tl.constexpr,
    MAX_REGROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    label_in_row = valid & (label >= 0) & (label < vocab_size)
    safe_label = tl.where(label_in_row, label, 0).to(tl.int64)
    logit_scale = tl.cast(logit_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    inv_temperature = tl.cast(inv_temperature, tl.float32)
    fixed_max = tl.cast(fixed_max, tl.float32)
    # The target's logit as the buffer holds it, read once (0 for an ignored row): the loops need no
    # per-logit comparison with the label. Read before the second pass overwrites the row.
    target_raw = tl.load(row_ptr + safe_label, mask=label_in_row, other=0.0).to(tl.float32)
    target_z, target_t = transform_logits(target_raw, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
    if UNNORMALIZED_GRAD:
        # The exponentials' reference for this row: its target logit, but never more than
        # UNNORMALIZED_REF_SPAN below the bound. Every exp(z - ref) is then at most e^40 and the sum
        # at most V * e^40 (finite in fp32 for any V); the row's largest is at least 1 when ref is
        # the target logit, else at least exp(-fixed_max - ref) >= e^-40: the stored values keep
        # their precision even for a row whose logits all sit near -fixed_max.
        fixed_max = tl.maximum(tl.where(label_in_row, target_z, float("-inf")), fixed_max - UNNORMALIZED_REF_SPAN)

    # Per-lane online log-sum-exp: each of the BLOCK_V // LANE_GROUP lanes holds LANE_GROUP consecutive
    # logits and keeps its own running max and sums, merged once after the loop. This costs one rescale
    # exp per lane and block but no block-wide reduction (shared memory + barrier) per iteration,
    # which left the first version latency-bound; lanes of 8 logits took the forward-only pass from
    # ~2.05 to ~2.6 TB/s on the H100 (it is bound by instruction issue, not bytes; NOTES v11).
    # Full blocks run without masks; the last, partial block (if any) with them.
    lanes: tl.constexpr = BLOCK_V // LANE_GROUP
    lane_cols = tl.arange(0, lanes)[:, None] * LANE_GROUP + tl.arange(0, LANE_GROUP)[None, :]
    # The running max is per lane; kept only for the argmax (FIXED_MAX), it may be per MAX_REGROUP lanes.
    lane_max = tl.full([lanes // MAX_REGROUP], float("-inf"), tl.float32)
    lane_sum = tl.zeros([lanes], tl.float32)
    lane_sum_z = tl.zeros([lanes], tl.float32)
    lane_z = tl.zeros([lanes], tl.float32)
    lane_sum_sq = tl.zeros([lanes], tl.float32)
    lane_rest = tl.zeros([lanes], tl.float32)
    lane_ties = tl.zeros([lanes], tl.float32)
    lane_qz = tl.zeros([lanes], tl.float32)
    lane_arg = tl.zeros([lanes // MAX_REGROUP], tl.int32)
    full_end = vocab_size // BLOCK_V * BLOCK_V
    for start in range(0, full_end, BLOCK_V):
        lane_max, lane_sum, lane_sum_z, lane_z, lane_sum_sq, lane_rest, lane_ties, lane_qz, lane_arg = _stats_block(
            row_ptr, start + lane_cols, vocab_size, logit_scale, softcap, inv_temperature, fixed_max,
            lane_max, lane_sum, lane_sum_z, lane_z, lane_sum_sq, lane_rest, lane_ties, class_q_ptr, lane_qz,
            lane_arg, HAS_SOFTCAP, (HAS_SMOOTHING and not WEIGHTED_SMOOTHING) or WANT_MEAN_LOGIT,
            WEIGHTED_SMOOTHING, FIXED_MAX, WANT_ENTROPY, WANT_LOG_SUM_SQ, WANT_ARGMAX or WANT_TOP1, MAX_REGROUP,
            UNNORMALIZED_GRAD, False,
        )  # fmt: skip
    if full_end < vocab_size:
        lane_max, lane_sum, lane_sum_z, lane_z, lane_sum_sq, lane_rest, lane_ties, lane_qz, lane_arg = _stats_block(
            row_ptr, full_end + lane_cols, vocab_size, logit_scale, softcap, inv_temperature, fixed_max,
            lane_max, lane_sum, lane_sum_z, lane_z, lane_sum_sq, lane_rest, lane_ties, class_q_ptr, lane_qz,
            lane_arg, HAS_SOFTCAP, (HAS_SMOOTHING and not WEIGHTED_SMOOTHING) or WANT_MEAN_LOGIT,
            WEIGHTED_SMOOTHING, FIXED_MAX, WANT_ENTROPY, WANT_LOG_SUM_SQ, WANT_ARGMAX or WANT_TOP1, MAX_REGROUP,
            UNNORMALIZED_GRAD, True,
        )  # fmt: skip

    running_max = tl.max(lane_max, 0)  # the row's max logit
    if FIXED_MAX:
        ref_max = fixed_max  # the sums are of exp(z - ref_max)
        sum_exp = tl.sum(lane_sum, 0)
    else:
        ref_max = running_max
        empty_lane = lane_max == float("-inf")
        lane_weight = tl.where(empty_lane, 0.0, tl.exp(lane_max - running_max))
        sum_exp = tl.sum(lane_sum * lane_weight, 0)
        if WANT_ENTROPY:  # the lanes' sums moved to the row's max; still non-negative terms only
            lane_seen = lane_rest + lane_ties
            at_max = lane_max == running_max
            gap_sum = tl.sum(
                tl.where(empty_lane, 0.0, lane_weight * (lane_sum_z + (running_max - lane_max) * lane_seen)), 0
            )
            rest_below = tl.sum(tl.where(at_max, lane_rest, lane_weight * lane_seen), 0)
            rest = rest_below + (tl.sum(tl.where(at_max, lane_ties, 0.0), 0) - 1.0)
            entropy = log1p(rest) + gap_sum / (1.0 + rest) + 0.0 * running_max  # NaN logits: NaN
        if WANT_LOG_SUM_SQ:  # (the launcher never combines it with FIXED_MAX)
            sum_exp_sq = tl.sum(lane_sum_sq * (lane_weight * lane_weight), 0)
    sum_z = tl.sum(lane_z, 0)
    # The row's label smoothing and z-loss factor: the options' scalars, or with class weights the row's own
    # (eps_y and zl_y of the design note; the row's factor f is in its grad_scale and the host's row weight).
    row_smoothing = label_smoothing
    row_z_loss = z_loss
    if WEIGHTED_SMOOTHING:
        row_smoothing = tl.load(row_smoothing_ptr + row)
        if HAS_Z_LOSS:
            row_z_loss = tl.load(row_z_loss_ptr + row)

    lse = ref_max + tl.log(sum_exp)
    # The loss uses the target logit before the buffer's rounding when it is given (fp32 dot product
    # of the row with the target's weight row): swap its term in the sum of exponentials. The
    # gradient keeps ``lse`` of the buffer, so its softmax sums to one over what the GEMMs see.
    loss_lse = lse
    loss_target_z = target_z
    if HAS_EXACT_TARGET:
        exact_z, _ = transform_logits(tl.load(target_raw_ptr + row), logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
        exact_sum = tl.maximum(sum_exp - tl.exp(target_z - ref_max), 0.0) + tl.exp(exact_z - ref_max)
        loss_lse = tl.where(label_in_row, ref_max + tl.log(exact_sum), lse)
        loss_target_z = tl.where(label_in_row, exact_z, target_z)
    loss = loss_lse - loss_target_z
    if WEIGHTED_SMOOTHING:  # sum_v q_v z_v in place of the mean logit
        loss = loss_lse - (1.0 - row_smoothing) * loss_target_z - row_smoothing * tl.sum(lane_qz, 0)
    elif HAS_SMOOTHING:
        loss = loss_lse - (1.0 - label_smoothing) * loss_target_z - label_smoothing * (sum_z / vocab_size)
    if HAS_Z_LOSS:
        loss += row_z_loss * loss_lse * loss_lse
    # Every form of the loss is >= 0 (lse is at least any average of the logits); the exact-target swap can
    # round it to -1e-7, i.e. a log-probability above 0. NaN stays NaN.
    if SHARD_PACK:
        # The rows a vocabulary shard exchanges (vocab_parallel.py): the local lse with the exact target swapped
        # in, in place of the loss, and the target's final logit where the shard owns it (0 elsewhere).
        tl.store(loss_ptr + row, loss_lse)
        tl.store(shard_target_ptr + row, tl.where(label_in_row, loss_target_z, 0.0))
    else:
        tl.store(loss_ptr + row, tl.where(valid, tl.where(loss < 0.0, 0.0, loss), 0.0))
    tl.store(lse_ptr + row, lse)
    if WANT_ENTROPY:
        tl.store(entropy_ptr + row, tl.where(valid, entropy, 0.0))
    if WANT_ARGMAX or WANT_TOP1:
        # The lanes' argmaxes merged: the smallest column among the lanes that hold the row's max (NaN's, if any)
        row_top = tl.reduce(lane_max, 0, max_keep_nan)
        lane_hit = (lane_max == row_top) | (lane_max != lane_max)
        argmax = tl.min(tl.where(lane_hit, lane_arg, 2147483647), 0)
        if WANT_ARGMAX:
            tl.store(argmax_ptr + row, argmax.to(tl.int64))
        if WANT_TOP1:  # the argmax check reads the same argmax, so that the two always agree
            tl.store(is_top1_ptr + row, ((argmax == label) & label_in_row).to(tl.int8))
    if WANT_MEAN_LOGIT:  # a shard's exchanged row holds the sum over the shard
        tl.store(mean_logit_ptr + row, tl.where(valid, sum_z if SHARD_PACK else sum_z / vocab_size, 0.0))
    if WANT_LOG_SUM_SQ:  # log(sum p**2) = log(sum exp(2 (z - max))) - 2 log(sum exp(z - max)), <= 0
        log_sum_sq = tl.minimum(tl.log(sum_exp_sq) - 2.0 * tl.log(sum_exp), 0.0)
        tl.store(log_sum_sq_ptr + row, tl.where(valid, log_sum_sq, 0.0))

    if WRITE_GRAD:
        # one factor for every row (the reduction's), or one per row (token or class weights times it)
        valid_scale = tl.where(valid, tl.load(grad_scale_ptr + row if PER_ROW_SCALE else grad_scale_ptr), 0.0)
        raw_scale = logit_scale * inv_temperature * valid_scale
    if WRITE_GRAD and UNNORMALIZED_GRAD:
        # The loop stored U_j = exp(z_j - ref) * (1 - tanh_j**2); the gradient is U_j * factor with
        # factor = raw_scale / sum_exp, once the target's element holds (exp(z_y - ref) - sum_exp) *
        # (1 - tanh_y**2). The barrier orders that store after every thread's stores of the loop.
        tl.debug_barrier()
        target_unnormalized = (tl.exp(target_z - ref_max) - sum_exp) * (1.0 - target_t * target_t)
        tl.store(row_ptr + safe_label, target_unnormalized.to(logits_ptr.dtype.element_ty), mask=label_in_row)
        tl.store(row_factor_ptr + row, raw_scale / sum_exp)
    elif WRITE_GRAD:
        p_scale = 1.0
        if HAS_Z_LOSS:
            p_scale = 1.0 + 2.0 * row_z_loss * lse
        for start in range(0, full_end, BLOCK_V):
            _grad_block(
                row_ptr, start + tl.arange(0, BLOCK_V), vocab_size, lse, p_scale, raw_scale, logit_scale, softcap,
                inv_temperature, row_smoothing, class_q_ptr, HAS_SOFTCAP, HAS_SMOOTHING, WEIGHTED_SMOOTHING, False,
            )  # fmt: skip
        if full_end < vocab_size:
            _grad_block(
                row_ptr, full_end + tl.arange(0, BLOCK_V), vocab_size, lse, p_scale, raw_scale, logit_scale, softcap,
                inv_temperature, row_smoothing, class_q_ptr, HAS_SOFTCAP, HAS_SMOOTHING, WEIGHTED_SMOOTHING, True,
            )  # fmt: skip
        # The target's element, with its -(1 - label_smoothing), over what the loop wrote there; the
        # barrier orders this store after every thread's stores of the loop.
        tl.debug_barrier()
        target_grad = tl.exp(target_z - lse) * p_scale - (1.0 - row_smoothing)
        if WEIGHTED_SMOOTHING:
            target_grad -= row_smoothing * tl.load(class_q_ptr + safe_label).to(tl.float32)
        elif HAS_SMOOTHING:
            target_grad -= label_smoothing / vocab_size
        target_grad = target_grad * raw_scale
        if HAS_SOFTCAP:
            target_grad = target_grad * (1.0 - target_t * target_t)
        tl.store(row_ptr + safe_label, target_grad.to(logits_ptr.dtype.element_ty), mask=label_in_row)


@triton.jit
def grad_kernel(
    logits_ptr,
    logits_row_stride,
    labels_ptr,
    lse_ptr,
    entropy_ptr,
    grad_loss_ptr,
    grad_loss_stride,
    grad_entropy_ptr,
    vocab_size,
    smoothing_vocab_size,
    ignore_index,
    logit_scale,
    softcap,
    inv_temperature,
    label_smoothing,
    z_loss,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_LOSS_GRAD: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = cols < vocab_size
    row_ptr = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    lse = tl.load(lse_ptr + row)
    logit_scale = tl.cast(logit_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    inv_temperature = tl.cast(inv_temperature, tl.float32)

    raw = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    z, t = transform_logits(raw, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
    p = tl.exp(z - lse)
    grad = tl.zeros([BLOCK_V], dtype=tl.float32)
    if HAS_LOSS_GRAD:
        p_scale = 1.0
        if HAS_Z_LOSS:
            p_scale = 1.0 + 2.0 * z_loss * lse
        grad_loss = p * p_scale - tl.where(cols == label, 1.0 - label_smoothing, 0.0)
        if HAS_SMOOTHING:  # eps spread over the whole vocabulary (more than this buffer's for a shard)
            grad_loss -= label_smoothing / smoothing_vocab_size
        grad += grad_loss * tl.load(grad_loss_ptr + row * grad_loss_stride).to(tl.float32)
    if HAS_ENTROPY_GRAD:
        entropy = tl.load(entropy_ptr + row)
        grad += -p * (z - lse + entropy) * tl.load(grad_entropy_ptr + row).to(tl.float32)
    grad = grad * tl.where(valid, logit_scale * inv_temperature, 0.0)
    if HAS_SOFTCAP:
        grad = grad * (1.0 - t * t)
    tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def target_logit_kernel(
    hidden_ptr,
    hidden_row_stride,
    hidden_col_stride,
    weight_ptr,
    weight_row_stride,
    weight_col_stride,
    bias_ptr,
    bias_stride,
    labels_ptr,
    labels_stride,
    row_index_ptr,
    out_ptr,
    hidden_size,
    vocab_size,
    HAS_BIAS: tl.constexpr,
    GATHER_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``out[row] = hidden[row] . weight[label] (+ bias[label])`` in fp32, 0 for labels outside [0, V).

    The GEMM rounds each logit to the compute dtype (bf16: 8 bits of mantissa, an error of ~0.1
    on a logit of 30); the target logit is the one the loss reads directly, so computing it once
    more in fp32 (2*N*D FLOPs, one weight row per token) removes most of the loss's rounding error.
    With ``GATHER_ROWS`` program ``i`` computes row ``row_index[i]`` (the rows the op processes).
    Every input is read through its strides (Triton specializes a stride of 1, so the contiguous
    case pays nothing for it): a transposed or sliced hidden or weight, a strided bias or labels.
    """
    program = tl.program_id(0).to(tl.int64)
    row = program
    if GATHER_ROWS:
        row = tl.load(row_index_ptr + program).to(tl.int64)
    label = tl.load(labels_ptr + row * labels_stride)
    in_range = (label >= 0) & (label < vocab_size)
    safe_label = tl.where(in_range, label, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, hidden_size, BLOCK_D):
        offsets = start + tl.arange(0, BLOCK_D)
        mask = offsets < hidden_size
        h_ptrs = hidden_ptr + row * hidden_row_stride + offsets * hidden_col_stride
        w_ptrs = weight_ptr + safe_label * weight_row_stride + offsets * weight_col_stride
        h = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        acc += h * w
    value = tl.sum(acc, 0)
    if HAS_BIAS:
        value += tl.load(bias_ptr + safe_label * bias_stride).to(tl.float32)
    tl.store(out_ptr + program, tl.where(in_range, value, 0.0))
