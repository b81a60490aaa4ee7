"""Split-K in one launch, shared by the W4A16, NVFP4 and row kernels.

Axis 0 of the grid enumerates the output tiles, axis 1 the splits of K. Each program of a split launch stores its
fp32 partial tile into a workspace ``[splits, M, N]``, then adds one to its tile's arrival counter
(``counters.arrival_counters``); the program that completes the count sums the partials in split order, writes the
output in the output's dtype and resets the counter: no reduction launch, no atomics on data, and results that do
not depend on which split finishes first.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["finish_split_k", "k_slice", "store_split_k"]


@triton.jit
def k_slice(K, BLOCK_K: tl.constexpr):
    """K tiles ``[start, end)`` of this program's split (axis 1 of the grid enumerates the splits)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(k_tiles, tl.num_programs(1))
    start = tl.program_id(1) * per
    return start, tl.minimum(start + per, k_tiles)


@triton.jit
def finish_split_k(y_ptr, part_ptr, cnt_ptr, rows, cols, M, N, stride_ym, tile, scale):
    """The fix-up, after this program stored its partial of output rows ``rows`` and columns ``cols`` (broadcastable
    index tensors) at ``part_ptr + (program_id(1) * M + rows) * N + cols``: count it in on counter ``tile``, and if it
    is the last of the tile's splits, write ``scale`` times the sum of every split's partial, in split order, to
    ``y_ptr + rows * stride_ym + cols`` and reset the counter."""
    mask = (rows < M) & (cols < N)
    offs = rows * N + cols
    n_split = tl.num_programs(1)
    # Every thread's partial is stored before one thread publishes the count (release, GPU scope).
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    if done == n_split - 1:
        total = tl.zeros(mask.shape, tl.float32)
        for s in range(0, n_split):
            total += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
        y = (total * scale).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows * stride_ym + cols, y, mask=mask)
        tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def store_split_k(acc, y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym):
    """Write ``acc`` (fp32 ``[BM, BN]``) to rows ``offs_m`` and columns ``offs_n`` of the row-major output ``y``:
    directly when K is not split, else as this split's partial, finishing the column tile (counter
    ``program_id(0)``) when it is the last."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if tl.num_programs(1) == 1:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + tl.program_id(1) * M * N + tile, acc, mask=mask)
        finish_split_k(
            y_ptr, part_ptr, cnt_ptr, offs_m[:, None], offs_n[None, :], M, N, stride_ym, tl.program_id(0), 1.0
        )
