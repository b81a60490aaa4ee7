"""Split-K device helpers shared by the W4A16 kernels whose programs each own a column tile and a run of K tiles.

Axis 0 of the grid enumerates the column tiles, axis 1 the splits of K. Each program stores its fp32 partial tile
into a workspace, then increments a per-column-tile counter; the program that completes the count sums the
partials in split order, writes the output in the output's dtype and resets the counter: one launch, no atomics on
data, run-to-run identical results.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["finish_split_k", "k_slice", "lead", "load_words", "split_k_store", "tile_scales"]


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
def lead(v, cols):
    """1-D ``v`` (one value per word row) as the leading axis of a tile of ``cols``' rank."""
    for _ in tl.static_range(len(cols.shape) - 1):
        v = tl.expand_dims(v, -1)
    return v


@triton.jit
def load_words(w_ptr, t, t_end, offs_r, cols, N, K, ROWS: tl.constexpr, PACK: tl.constexpr):
    """Word tile ``t`` (int32, word rows leading, then the axes of ``cols``: ``[1, BLOCK_N]``, or
    ``[1, SUBS, SUB]`` for a column tile laid out as sub-tiles), zeros outside the matrix or past ``t_end``."""
    rows = t * ROWS + offs_r
    mask = lead(rows < tl.minimum(K // PACK, t_end * ROWS), cols) & (cols < N)
    return tl.load(w_ptr + lead(rows, cols) * N + cols, mask=mask, other=0)


@triton.jit
def tile_scales(
    s_ptr, t, rows, mask_r, out_cols, cols, N, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, PACK: tl.constexpr
):
    """fp32 group scales of K tile ``t`` (groups of ``GROUP_SIZE > 0``) for the words of ``load_words(..., cols,
    ...)`` (``out_cols``: ``cols`` without its leading axis). When the groups cover whole tiles, one scale row: for
    ``[1, BLOCK_N]`` columns loaded once and broadcast over the word rows; for sub-tiles loaded at the words' shape
    in 4-wide runs, so that it takes their layout (no conversion in the loop). Otherwise one row per word row
    ``rows`` (a word's ``PACK`` values share a group)."""
    if GROUP_SIZE % BLOCK_K == 0:
        row_s = s_ptr + (t * BLOCK_K // GROUP_SIZE) * N
        if len(cols.shape) == 3:
            s = tl.load(row_s + tl.max_contiguous(cols + 0 * lead(rows, cols), [1, 1, 4]), mask=cols < N, other=0.0)
        else:
            s = tl.load(row_s + out_cols, mask=out_cols < N, other=0.0)[None, :]
        return s.to(tl.float32)
    else:
        g = lead(rows * PACK // GROUP_SIZE, cols)
        return tl.load(s_ptr + g * N + cols, mask=lead(mask_r, cols) & (cols < N), other=0.0).to(tl.float32)
