"""Split-K device helpers of the NVFP4 kernels: each program's run of K tiles, and the fixup in which the last of a
tile's splits to arrive sums every partial in split order and writes the output (see ``triton_kernels``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["finish", "k_range"]


@triton.jit
def k_range(pid_k, split_k, K, BLOCK_K: tl.constexpr):
    """First and one-past-last K tile of split ``pid_k`` of ``split_k``."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    k_first = pid_k * per_split
    k_last = tl.minimum(k_first + per_split, k_tiles)
    return k_first, k_last


@triton.jit
def finish(
    acc,
    gscale,
    out_ptrs,
    ws_ptrs,
    out_mask,
    cnt_ptr,
    tile,
    pid_k,
    ws_split_stride,
    split_k,
    SPLIT: tl.constexpr,
):
    """Write ``acc * gscale`` (not SPLIT) or do the split-K fixup: store the partial, count arrivals, and let the
    last of the ``split_k`` splits sum all partials in split order and write the output."""
    if not SPLIT:
        tl.store(out_ptrs, (acc * gscale).to(out_ptrs.dtype.element_ty), mask=out_mask)
    else:
        tl.store(ws_ptrs + pid_k * ws_split_stride, acc, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros_like(acc)
            for s in range(split_k):
                total += tl.load(ws_ptrs + s * ws_split_stride, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, (total * gscale).to(out_ptrs.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)
