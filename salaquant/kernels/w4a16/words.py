"""Loading GPTQ v1 word tiles and their group scales in the W4A16 kernels whose programs each own a column tile and
a run of K tiles (``gemv``, ``paired_gemv``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["lead", "load_words", "tile_scales"]


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
