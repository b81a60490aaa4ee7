"""Split-K device helpers shared by the W4A16 kernels whose programs each own a column tile and a run of K tiles.

Axis 0 of the grid enumerates the column tiles, axis 1 the splits of K. Each program stores its fp32 partial tile
into a workspace, then increments a per-column-tile counter; the program that completes the count sums the
partials in split order, writes the output in the output's dtype and resets the counter: one launch, no atomics on
data, run-to-run identical results.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["finish_split_k", "k_slice", "load_words", "split_k_store", "tile_scales"]


@triton.jit
def k_slice(K, BLOCK_K: tl.constexpr):
    """K tiles ``[start, end)`` of this program's split (axis 1 of the grid enumerates the splits)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(k_tiles, tl.num_programs(1))
    start = tl.program_id(1) * per
    return start, tl.minimum(start + per, k_tiles)


@triton.jit
def split_k_store(acc, y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym):
    """Write ``acc`` (fp32 ``[BM, BN]``) to ``y``, summing the splits of this column tile first if split."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    n_split = tl.num_programs(1)
    if n_split == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + tl.program_id(1) * M * N + tile, acc, mask=mask)
        finish_split_k(y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym)


@triton.jit
def finish_split_k(y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym):
    """After this program stored its partial (``[splits, M, N]`` fp32, split = axis 1 of the grid) of the
    ``[offs_m, offs_n]`` tile: count it in, and if it is the last of the tile's splits, write their sum to ``y``."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tile = offs_m[:, None] * N + offs_n[None, :]
    n_split = tl.num_programs(1)
    # Every thread's partial is stored before one thread publishes the count (release, GPU scope).
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + tl.program_id(0), 1)
    if done == n_split - 1:
        total = tl.zeros((offs_m.shape[0], offs_n.shape[0]), tl.float32)
        for s in range(0, n_split):
            total += tl.load(part_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0)


@triton.jit
def load_words(w_ptr, t, t_end, offs_r, offs_n, N, K, ROWS: tl.constexpr, PACK: tl.constexpr):
    """Word tile ``t`` (``[ROWS, BLOCK_N]`` int32, zeros outside the matrix or past ``t_end``)."""
    rows = t * ROWS + offs_r
    mask = (rows < tl.minimum(K // PACK, t_end * ROWS))[:, None] & (offs_n < N)[None, :]
    return tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0)


@triton.jit
def tile_scales(
    s_ptr, t, rows, mask_r, offs_n, mask_n, N, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, PACK: tl.constexpr
):
    """fp32 group scales of K tile ``t`` (groups of ``GROUP_SIZE > 0``): ``[1, BLOCK_N]`` when the groups cover
    whole tiles, else one row per word row ``rows`` (``[ROWS, BLOCK_N]``; a word's ``PACK`` values share a
    group)."""
    if GROUP_SIZE % BLOCK_K == 0:
        s = tl.load(s_ptr + (t * BLOCK_K // GROUP_SIZE) * N + offs_n, mask=mask_n, other=0.0)
        return s.to(tl.float32)[None, :]
    else:
        g = rows * PACK // GROUP_SIZE
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        return s.to(tl.float32)
