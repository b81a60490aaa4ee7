"""The flat split-K W4A16 kernel for 2..16 activation rows (``matmul_flat``): the cases the row kernel
(``mma_rows``) does not take, 8-bit codes and fp32 activations among them.

Each program runs a short, fully unrolled run of ``TILES`` K tiles, so every load of a program is independent of
its math and all of them are in flight at once (the grid, not a loop, supplies the memory parallelism). Each word
is loaded once and repeated ``PACK`` times in registers into a ``[BLOCK_K, BLOCK_N]`` weight tile in natural K
order, which feeds ``tl.dot`` with a 16-row activation tile.

Scale modes, fixed at compile time: ``GROUP_SIZE <= 0`` means one group (scaled once at the end); a multiple
of ``BLOCK_K`` means one scale row per K tile, applied to the tile's product; otherwise a scale per weight
(``GROUP_SIZE`` is a multiple of ``32 / BITS``, so the values of one word share a group).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..split_k import store_split_k

__all__ = ["flat_kernel"]


@triton.jit
def flat_kernel(
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
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(cdiv(K, BLOCK_K), TILES))``: ``TILES`` K tiles per program, the activation
    rows padded to the 16 of ``tl.dot``'s smallest tile."""
    PACK: tl.constexpr = 32 // BITS
    ONE_GROUP: tl.constexpr = GROUP_SIZE <= 0
    TILE_SCALE: tl.constexpr = (not ONE_GROUP) and (GROUP_SIZE % BLOCK_K == 0)
    ZERO: tl.constexpr = 1 << (BITS - 1)
    BLOCK_M: tl.constexpr = 16
    ROWS: tl.constexpr = BLOCK_K // PACK
    dtype = x_ptr.dtype.element_ty

    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_r = tl.arange(0, ROWS)
    shifts = ((offs_k % PACK) * BITS)[:, None]
    k_first = tl.program_id(1) * (TILES * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in tl.static_range(TILES):
        kk = k_first + i * BLOCK_K + offs_k
        mask_k = kk < K
        # A tile past K (the last split may hold fewer tiles) loads nothing: zeros, never the scale row after the end.
        tile_live = (k_first + i * BLOCK_K + 0 * offs_n) < K  # as a vector: the interpreter masks only with tensors
        tile_group = (k_first + i * BLOCK_K) // GROUP_SIZE
        rows = (k_first + i * BLOCK_K) // PACK + offs_r
        packed = tl.load(
            w_ptr + rows[:, None] * N + offs_n[None, :],
            mask=(rows < K // PACK)[:, None] & mask_n[None, :],
            other=0,
            eviction_policy="evict_first",
        )
        words = tl.reshape(tl.broadcast_to(packed[:, None, :], (ROWS, PACK, BLOCK_N)), (BLOCK_K, BLOCK_N))
        w = (((words >> shifts) & ((1 << BITS) - 1)) - ZERO).to(tl.float32)
        if TILE_SCALE:
            s = tl.load(s_ptr + tile_group * N + offs_n, mask=mask_n & tile_live, other=0.0)
            s = s.to(tl.float32)
        elif not ONE_GROUP:
            s_ptrs = s_ptr + (kk // GROUP_SIZE)[:, None] * N + offs_n[None, :]
            w = w * tl.load(s_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        a_ptrs = x_ptr + offs_m[:, None] * stride_xm + kk[None, :]
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if TILE_SCALE:
            part = tl.dot(a, w.to(dtype), input_precision=DOT_PRECISION)
            acc += part * s[None, :]
        else:
            acc = tl.dot(a, w.to(dtype), acc, input_precision=DOT_PRECISION)
    if ONE_GROUP:
        s1 = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc * s1[None, :]
    store_split_k(acc, y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym)
