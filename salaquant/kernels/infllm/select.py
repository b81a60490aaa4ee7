"""InfLLM-v2 block selection in Triton: block max-pooling, forced blocks and top-k in one kernel (``pool_select``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..host import cdiv
from .launch import pdl_args, pow2

__all__ = ["FEW_ROWS", "interpolated_kth", "pool_select"]

FEW_ROWS = 128
"""Below this many (batch * KV head, query) rows, ``pool_select`` runs 8 warps per row instead of 4, the faster for a
decode step's few rows (``docs/kernels.md``)."""


@triton.jit
def _bounds(lo_a, hi_a, top_a, n_a, lo_b, hi_b, top_b, n_b):
    return tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b), tl.maximum(top_a, top_b), n_a + n_b


@triton.jit
def _count_target(lo, width, c_lo, c_hi, target):
    """``lo`` plus where a straight line through the bracket's counts ``(lo, c_lo)`` and ``(lo + width, c_hi)``
    crosses count ``target`` (fp32: a guess), kept strictly inside the bracket."""
    frac = (c_lo.to(tl.float32) - target) / (c_lo - c_hi).to(tl.float32)
    step = (width.to(tl.float32) * tl.minimum(tl.maximum(frac, 0.0), 1.0)).to(tl.int64)
    return lo + tl.minimum(tl.maximum(step, 1), width - 1)


INTERP_MARGIN = tl.constexpr(0.05)
"""``interpolated_kth`` aims its two counts of a step this fraction of the bracket's count range (at least one
block) either side of ``k``."""


@triton.jit
def interpolated_kth(ordered, in_range, forced, n_blocks, k_sel):
    """``(v, count)``: a threshold image ``v`` with ``count`` of the int32 images ``ordered`` (where ``in_range``)
    at or above it, and either ``count == k_sel`` (they are the top k) or ``v`` the ``k_sel``-th largest image.

    A safeguarded interpolation search on counts. It keeps a bracket ``lo < hi`` with ``count(>= lo) >= k`` and
    ``count(>= hi) < k``, from the smallest image (count ``n_blocks``) to one past the largest unforced image
    (count at most the forced blocks'; one past the largest of all where the forced blocks alone are ``k`` or
    more). A step takes the counts at the two images where a straight line through the bracket's counts crosses
    ``k + 1/2`` plus and minus a margin (``INTERP_MARGIN``), so that the bracket closes in from both sides (at its
    thirds instead after a step that did not halve it), in one sum of 16-bit fields for rows under 65,536 blocks,
    and the smallest and largest image inside the bracket, to which it then shrinks (no count changes), so that a
    tie at the k-th score ends the search once it is all the bracket holds. The four values of a step are three
    plain reductions, which Triton builds on the warps' own reduce instructions. It ends when a count lands on ``k``
    or the bracket holds one image (``lo``, the k-th largest): a few steps on smooth scores, where a bit-by-bit
    search makes up to 32 dependent counts."""
    PACKED: tl.constexpr = ordered.shape[0] < 65536
    big = tl.full(ordered.shape, 2147483647, tl.int32)
    small = tl.full(ordered.shape, -2147483648, tl.int32)
    free = in_range & ~forced
    lo32, hi32, top32, n_forced = tl.reduce(
        (
            tl.where(in_range, ordered, big),
            tl.where(free, ordered, small),
            tl.where(in_range, ordered, small),
            (in_range & forced).to(tl.int32),
        ),
        0,
        _bounds,
    )
    lo = lo32.to(tl.int64)
    c_lo = n_blocks + tl.zeros([], tl.int32)
    if n_forced < k_sel:  # the k-th is below every forced block: the bracket's top is the largest free image
        hi = hi32.to(tl.int64) + 1
        c_hi = n_forced
    else:
        hi = top32.to(tl.int64) + 1
        c_hi = tl.zeros([], tl.int32)
    bisect = tl.zeros([], tl.int1)
    while (hi - lo > 1) & (c_lo != k_sel):
        width = hi - lo
        if bisect:
            a = lo + tl.maximum(width // 3, 1)
            b = lo + tl.minimum(tl.maximum((2 * width) // 3, 1), width - 1)
        else:
            margin = tl.maximum(INTERP_MARGIN * (c_lo - c_hi).to(tl.float32), 1.0)
            a = _count_target(lo, width, c_lo, c_hi, k_sel + 0.5 + margin)
            b = _count_target(lo, width, c_lo, c_hi, k_sel + 0.5 - margin)
        inside = in_range & (ordered >= lo.to(tl.int32)) & (ordered <= (hi - 1).to(tl.int32))
        ge_a = (ordered >= a.to(tl.int32)).to(tl.int32)
        ge_b = (ordered >= b.to(tl.int32)).to(tl.int32)
        if PACKED:  # both counts in one sum, b's in the high half (each count < 2**16)
            both = tl.sum(ge_a + (ge_b << 16), 0)
            n_a = both & 0xFFFF
            n_b = both >> 16
        else:
            n_a = tl.sum(ge_a, 0)
            n_b = tl.sum(ge_b, 0)
        first = tl.min(tl.where(inside, ordered, big), 0)
        last = tl.max(tl.where(inside, ordered, small), 0)
        if n_b >= k_sel:  # a <= b, so n_a >= n_b: both at or below the k-th
            lo = b
            c_lo = n_b
        elif n_a >= k_sel:
            lo = a
            c_lo = n_a
            hi = b
            c_hi = n_b
        else:
            hi = a
            c_hi = n_a
        # no image lies in [old lo, first) or (last, old hi): the same counts at the bracket's images
        lo = tl.maximum(lo, first.to(tl.int64))
        hi = tl.minimum(hi, last.to(tl.int64) + 1)
        bisect = 2 * (hi - lo) > width
    return lo.to(tl.int32), c_lo


@triton.jit
def _pool_select_kernel(
    scores_ptr,
    idx_ptr,
    tq,
    n1,
    n_blocks,
    k_sel,
    q_start,
    stride_sb,
    stride_st,
    stride_sn,
    stride_ib,
    stride_it,
    stride_is,
    R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INIT_BLOCKS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Block max-pooling, forced blocks and top-k of one (batch * KV head, query) row, in one program.

    Each pooled score becomes its order-preserving int32 image. ``interpolated_kth`` finds ``v``, the ``k``-th
    largest image (or a threshold with exactly ``k`` images at or above it); the blocks above ``v`` are chosen, then
    blocks equal to ``v`` in ascending order until there are ``k`` (equal scores: lower block first). No sort: a
    decode row is one program on one SM, so the selection is a chain of reductions whose count decides its time.
    The chosen blocks are written in ascending order (future ones as -1).
    """
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    t_idx = pid_t.to(tl.int64)
    blocks = tl.arange(0, BLOCK_NB)
    in_range = blocks < n_blocks
    row = scores_ptr + pid_bh * stride_sb + t_idx * stride_st
    pooled = tl.full([BLOCK_NB], float("-inf"), dtype=tl.float32)
    for j in tl.static_range(R + 1):
        w = blocks * R - 1 + j  # K1 windows [R*b - 1, R*b + R - 1]
        ok = in_range & (w >= 0) & (w < n1)
        pooled = tl.maximum(pooled, tl.load(row + w * stride_sn, mask=ok, other=float("-inf")))
    pooled = tl.where(pooled == float("-inf"), 0.0, pooled)  # no window: score 0
    qb = (q_start + t_idx) // BLOCK_SIZE
    forced = (blocks < INIT_BLOCKS) | ((blocks >= qb - LOCAL_BLOCKS) & (blocks <= qb))
    pooled = tl.where(forced, float("inf"), pooled)

    bits = pooled.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # float order as signed integers
    # blocks past n_blocks take INT32_MIN (no float's image), below every candidate tried: never counted
    ordered = tl.where(in_range, ordered, -2147483648)
    v, count = interpolated_kth(ordered, in_range, forced, n_blocks, k_sel)
    above = (ordered > v) & in_range
    tied = (ordered == v) & in_range
    if count == k_sel:  # every block equal to v is chosen: no tie to break
        chosen = above | tied
    else:
        need = k_sel - tl.sum(above.to(tl.int32), 0)
        chosen = above | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= need))
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    out = tl.where(blocks > qb, -1, blocks)
    tl.store(idx_ptr + pid_bh * stride_ib + t_idx * stride_it + slot.to(tl.int64) * stride_is, out, mask=chosen)


def pool_select(
    scores: Tensor,
    q_start: int,
    tk: int,
    block_size: int,
    kernel_stride: int,
    init_blocks: int,
    local_blocks: int,
    n_select: int,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """Chosen blocks ``[B, Hkv, Tq, min(n_select, n_blocks)]`` int32 from stage-1 scores ``[B, Hkv, Tq, n1]`` over
    ``tk`` keys in blocks of ``block_size`` (K1 windows of stride ``kernel_stride``: ``block_size // kernel_stride``
    windows per block), the first ``init_blocks`` blocks and the ``local_blocks`` before each query's own forced.

    Same result as the reference ``select_blocks(block_scores(...))`` (the model package's ``sparse_attention.py``), one
    program per (query, batch * KV head), 8 warps when the rows are fewer than ``FEW_ROWS`` (decode), else 4.
    ``out`` (int32, that shape; a slice along ``Tq`` of a contiguous selection will do) receives the result.
    """
    b, hkv, tq, n1 = scores.shape
    n_blocks = cdiv(tk, block_size)
    k_sel = min(n_select, n_blocks)
    shape = (b, hkv, tq, k_sel)
    if out is None:
        idx = torch.empty(shape, dtype=torch.int32, device=scores.device)
    elif out.shape != shape or out.dtype != torch.int32 or out.stride(0) != hkv * out.stride(1):
        raise ValueError(
            f"out must be int32 {shape} with mergeable batch and head strides, got {out.dtype} {tuple(out.shape)} "
            f"strides {out.stride()}"
        )
    else:
        idx = out
    if b * hkv * tq == 0 or k_sel == 0:
        return idx
    flat = scores.reshape(b * hkv, tq, n1)
    rows = idx.view(b * hkv, tq, k_sel)
    _pool_select_kernel[(tq, b * hkv)](
        flat,
        rows,
        tq,
        n1,
        n_blocks,
        k_sel,
        q_start,
        *flat.stride(),
        *rows.stride(),
        R=block_size // kernel_stride,
        BLOCK_SIZE=block_size,
        INIT_BLOCKS=init_blocks,
        LOCAL_BLOCKS=local_blocks,
        BLOCK_NB=pow2(n_blocks),
        num_warps=8 if b * hkv * tq < FEW_ROWS else 4,
        **pdl_args(scores.device),
    )
    return idx
