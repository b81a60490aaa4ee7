"""InfLLM-v2 block selection in Triton: block max-pooling, forced blocks and top-k in one kernel (``pool_select``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from salaquant.model.sparse_attention import SparseParams

from ..host import cdiv
from .launch import pdl_args, pow2

__all__ = ["FEW_ROWS", "SELECT_INTERPOLATE", "SELECT_RADIX", "interpolated_kth", "pool_select", "radix_kth"]

SELECT_RADIX = 0
"""Bits of the k-th pooled score ``pool_select`` finds per pass when it does not interpolate: 0 for the bit search
(one count per bit, ending once a count lands on k), or a radix select's digit width (a histogram per pass; slower
on an H200 at 4, 8 and 11 bits, ``benchmarks/infllm_select_anatomy.py``)."""

SELECT_INTERPOLATE = True
"""Find the k-th pooled score by a safeguarded interpolation search (``interpolated_kth``) rather than the bit
search (``SELECT_RADIX = 0``); either gives the same blocks. On an H200 the 128K decode step took 30.7 us per
replay of its CUDA graph and 25.3 back to back with it, against 32.6 and 27.1 with the bit search in the same run
(``benchmarks/infllm_decode.py``); the selection alone, 10.4 against 11.5 us back to back."""

FEW_ROWS = 128
"""Below this many (batch * KV head, query) rows, ``pool_select`` runs 8 warps per row instead of 4: decode's two
rows at 128K context took 15.7 against 19.2 us per replay of a CUDA graph of the launch on an H200 (16 warps:
15.5)."""


@triton.jit
def _sum_and_min(a_sum, a_min, b_sum, b_min):
    return a_sum + b_sum, tl.minimum(a_min, b_min)


@triton.jit
def radix_kth(ordered, in_range, k_sel, RADIX: tl.constexpr):
    """The ``k_sel``-th largest of the int32 images ``ordered`` (where ``in_range``), ``RADIX`` bits per pass from
    the top: a histogram of the pass's digit over the images that share the digits found so far, a reverse
    cumulative sum (how many have each digit or a larger one), and one reduction that finds the digit holding the
    k-th and how many of those images lie above it."""
    NBINS: tl.constexpr = 1 << RADIX
    PASSES: tl.constexpr = (32 + RADIX - 1) // RADIX
    u = (ordered ^ -2147483648).to(tl.uint32, bitcast=True)  # unsigned order = signed order of the images
    live = in_range
    need = k_sel  # how many of the live images are still to be taken
    v_u = tl.zeros([], tl.uint32)
    for p in tl.static_range(PASSES):
        shift = 32 - (p + 1) * RADIX if (p + 1) * RADIX < 32 else 0
        width = RADIX if (p + 1) * RADIX <= 32 else 32 - p * RADIX
        digit = ((u >> shift) & ((1 << width) - 1)).to(tl.int32)
        hist = tl.histogram(digit, NBINS, mask=live)
        ge = tl.cumsum(hist, 0, reverse=True)  # live images whose digit is >= d
        sat = ge >= need  # d <= d*, the digit of the k-th
        # count(d <= d*) and, as the images above a digit only shrink with it, count(digit > d*)
        n_sat, gt_star = tl.reduce((sat.to(tl.int32), tl.where(sat, ge - hist, 2147483647)), 0, _sum_and_min)
        d_star = n_sat - 1
        need = need - gt_star  # the live images with a larger digit are all taken
        live = live & (digit == d_star)
        v_u = v_u | (d_star.to(tl.uint32) << shift)
    return v_u.to(tl.int32, bitcast=True) ^ -2147483648


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
    tie at the k-th score ends the search once it is all the bracket holds. (Three plain reductions a step, which
    Triton builds on the warps' own reduce instructions, ran 0.4 us faster per decode step on an H200 than one
    reduction of the four values as a tuple.) It ends when a count lands on ``k`` or the bracket holds one image
    (``lo``, the k-th largest): 6 to 10 steps on decode rows at 128K context against 19 to 32 counts for the bit
    search (``benchmarks/select_steps.py``)."""
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
    RADIX: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Block max-pooling, forced blocks and top-k of one (batch * KV head, query) row, in one program.

    Each pooled score becomes its order-preserving int32 image. A search over that integer range finds ``v``,
    the ``k``-th largest image (or a threshold with exactly ``k`` images at or above it): by interpolation
    (``INTERP``, ``interpolated_kth``), or one bit per step in up to 32 dependent counts over the row (int32
    throughout); the blocks above ``v`` are chosen, then blocks equal to ``v`` in ascending order until there are
    ``k`` (equal scores: lower block first). No sort. On an H200 a decode row at 128K context took 9.6 us with all
    32 counts of the bit search (5.9 of it, about 0.19 us each; ``benchmarks/infllm_select_anatomy.py``) and 8.9 us
    ending early after 25 on uniform random scores. Slower or no faster than the bit search there: 2 or 4 bits per
    step from 3 or 15 counts made as separate sums (16.9 and 19.1 against 14.8 us per row, one launch replayed from
    a graph), 2 bits from 3 counts packed into one sum of two int32 (11.8 against 11.6 us, back-to-back replays), 4
    bits from 16 counts in 16-bit fields of four int64 sums (15.3 against 9.8 us in the decode step), ``tl.topk``'s
    bitonic network (16.4 against 11.7 us, back-to-back replays), and a ternary search making two counts per sum in
    16-bit fields of one int32 (21 steps of 0.27 us: 9.4 against 9.6 us for the row). The chosen blocks are written
    in ascending order (future ones as -1).
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
    # v = the largest image with count(ordered >= v) >= k, built from its top bit down: a step tries v + 2^(31-step)
    # (the lower bits of v are still zero, so the sum never carries; int32 wraps at step 0, INT32_MIN + 2^31 = 0)
    # and keeps it while its count is >= k. The count at v = INT32_MIN is n_blocks >= k. A count of exactly k ends
    # the search early: the images >= v are then the top k, ties and all.
    if INTERP:
        v, count = interpolated_kth(ordered, in_range, forced, n_blocks, k_sel)
    elif RADIX > 0:  # RADIX bits per pass from a histogram (radix_kth); ties then go through the scan below
        v = radix_kth(ordered, in_range, k_sel, RADIX)
        count = -1
    else:
        v = tl.full([], -2147483648, tl.int32)
        one = tl.full([], 1, tl.int32)
        step = 0
        count = n_blocks
        while (step < 32) & (count != k_sel):
            cand = v + (one << (31 - step))
            n_ge = tl.sum((ordered >= cand).to(tl.int32), 0)
            v = tl.where(n_ge >= k_sel, cand, v)
            count = tl.where(n_ge >= k_sel, n_ge, count)
            step += 1
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
    params: SparseParams,
    *,
    out: Tensor | None = None,
    num_warps: int | None = None,
    radix: int | None = None,
    interpolate: bool | None = None,
) -> Tensor:
    """Chosen blocks ``[B, Hkv, Tq, min(total_topk, n_blocks)]`` int32 from stage-1 scores ``[B, Hkv, Tq, n1]``.

    Same result as the reference ``select_blocks(block_scores(scores, q_start, tk, params), q_start, params)``,
    one program per (query, batch * KV head). The k-th pooled score comes from ``interpolated_kth`` (``interpolate``,
    default ``SELECT_INTERPOLATE``, unless a ``radix`` is given): a few dependent counts over
    ``next_power_of_2(n_blocks)`` pooled scores on smooth scores; otherwise from the bit search (``radix`` 0, the
    default ``SELECT_RADIX``: up to 32 counts, fewer when one lands on ``k`` exactly) or a radix select (``radix``
    1 to 16: ``ceil(32 / radix)`` passes of a ``2**radix``-bin histogram each).
    ``num_warps`` defaults to 8 when the rows are too few to fill the GPU (decode), else 4. ``out`` (int32, that
    shape; a slice along ``Tq`` of a contiguous selection will do) receives the result.
    """
    if interpolate is None:
        interpolate = SELECT_INTERPOLATE and radix is None
    radix = SELECT_RADIX if radix is None else radix
    if not 0 <= radix <= 16:
        raise ValueError(f"radix must be 0 (the bit search) or 1 to 16 bits per pass, got {radix}")
    b, hkv, tq, n1 = scores.shape
    n_blocks = cdiv(tk, params.block_size)
    k_sel = min(params.total_topk, n_blocks)
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
        R=params.pool_ratio,
        BLOCK_SIZE=params.block_size,
        INIT_BLOCKS=params.init_blocks,
        LOCAL_BLOCKS=params.local_blocks,
        BLOCK_NB=pow2(n_blocks),
        RADIX=radix,
        INTERP=bool(interpolate),
        num_warps=num_warps if num_warps is not None else (8 if b * hkv * tq < FEW_ROWS else 4),
        **pdl_args(scores.device),
    )
    return idx
