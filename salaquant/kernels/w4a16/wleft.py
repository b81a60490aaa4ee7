"""The weights-left W4A16 kernel for 2..16 activation rows (``matmul_wleft``): ``Y^T = W x^T``, the weight
tile the MMA's left operand."""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import nibble_pair
from .split_k import k_slice, split_k_store

__all__ = ["load_words_nk", "wleft_kernel"]


@triton.jit
def load_words_nk(w_ptr, t, t_end, offs_r, offs_n, N, K, ROWS: tl.constexpr):
    """Word tile ``t`` of 4-bit codes as ``[BLOCK_N, ROWS]`` (N along the fast axis; zeros outside the matrix or
    past ``t_end``)."""
    rows = t * ROWS + offs_r
    mask = (offs_n < N)[:, None] & (rows < tl.minimum(K // 8, t_end * ROWS))[None, :]
    # any code where masked: the activations past K are zero
    return tl.load(w_ptr + rows[None, :] * N + offs_n[:, None], mask=mask, other=0, eviction_policy="evict_first")


@triton.jit
def wleft_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP16: tl.constexpr,
    AHEAD: tl.constexpr,
):
    """``matmul_wleft``: ``Y^T = W x^T`` for up to 16 activation rows, the weight tile the MMA's left operand.

    Grid ``(cdiv(N, BLOCK_N), splits)``; each program loops over its split's K tiles. A ``[BLOCK_N, BLOCK_K / 8]``
    word tile is loaded with N along the fast axis (coalesced), each word expanded into its eight codes in K order
    (``nibble_pair``), so the ``[BLOCK_N, BLOCK_K]`` weight tile needs no transposition; the 16 activation rows
    are the MMA's N side. 4-bit codes, fp16/bf16 activations, one group or groups of a multiple of ``BLOCK_K``
    (one scale per column and K tile, applied to the tile's product). ``AHEAD`` (1 or 2): how many tiles' words
    are in flight while the current one is computed."""
    ONE_GROUP: tl.constexpr = GROUP_SIZE <= 0
    ROWS: tl.constexpr = BLOCK_K // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, 16)
    mask_m = offs_m < M
    offs_r = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    start, end = k_slice(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    words = load_words_nk(w_ptr, start, end, offs_r, offs_n, N, K, ROWS)
    nxt = load_words_nk(w_ptr, start + 1, end, offs_r, offs_n, N, K, ROWS) if AHEAD == 2 else words
    for t in range(start, end):
        # Issue the loads of the tile AHEAD tiles on before this tile's math, as the GEMV does.
        if AHEAD == 2:
            after = load_words_nk(w_ptr, t + 2, end, offs_r, offs_n, N, K, ROWS)
        else:
            nxt = load_words_nk(w_ptr, t + 1, end, offs_r, offs_n, N, K, ROWS)
            after = nxt
        # [BLOCK_N, ROWS, 2 (code j or j + 4), 2 (j // 2 % 2), 2 (j % 2)] flattens to K order 8 r + 4c + 2d + e
        t_codes = tl.join(
            tl.join(nibble_pair(words, 0, FP16), nibble_pair(words, 2, FP16)),
            tl.join(nibble_pair(words, 1, FP16), nibble_pair(words, 3, FP16)),
        )
        wt = tl.reshape(t_codes, (BLOCK_N, BLOCK_K))
        kk = t * BLOCK_K + offs_k
        xt = tl.load(
            x_ptr + offs_m[None, :] * stride_xm + kk[:, None], mask=(kk < K)[:, None] & mask_m[None, :], other=0.0
        )
        if ONE_GROUP:
            acc = tl.dot(wt, xt, acc)
        else:
            s = tl.load(s_ptr + (t * BLOCK_K // GROUP_SIZE) * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += tl.dot(wt, xt) * s[:, None]
        words = nxt
        nxt = after
    if ONE_GROUP:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    split_k_store(tl.trans(acc), y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym)
