"""The flat split-K W4A16 kernel (``matmul_flat``): a short unrolled run of K tiles per program, ``tl.dot`` on
the activation side or a CUDA-core reduction for one row.

Scale modes, fixed at compile time: ``GROUP_SIZE <= 0`` means one group (scaled once at the end); a multiple
of ``BLOCK_K`` means one scale row per K tile; otherwise one scale row per word row (``GROUP_SIZE`` is a
multiple of ``32 / BITS``, so the values of one word share a group).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import word_value
from .split_k import split_k_store

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
    MAGIC,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
    GEMV3D: tl.constexpr = False,
    EXPAND: tl.constexpr = False,
):
    """Split-K over short, fully unrolled runs of ``TILES`` K tiles: every load of a program is independent of its
    math, so all of them are in flight at once (the grid, not a loop, supplies the memory parallelism).

    The ``[BLOCK_K, BLOCK_N]`` weight tile is read in natural K order straight from the packed words (the
    ``PACK`` rows of one word load the same address, which the L1 serves once); ``BLOCK_M == 1`` reduces on the
    CUDA cores, larger ``BLOCK_M`` feeds ``tl.dot``. A scale row multiplies the tile sum when the tile lies in
    one group, else every weight.
    """
    PACK: tl.constexpr = 32 // BITS
    ONE_GROUP: tl.constexpr = GROUP_SIZE <= 0
    TILE_SCALE: tl.constexpr = (not ONE_GROUP) and (GROUP_SIZE % BLOCK_K == 0)
    ZERO: tl.constexpr = 1 << (BITS - 1)
    dtype = x_ptr.dtype.element_ty

    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    ROWS: tl.constexpr = BLOCK_K // PACK
    offs_r = tl.arange(0, ROWS)
    shifts = ((offs_k % PACK) * BITS)[:, None]
    k_first = tl.program_id(1) * (TILES * BLOCK_K)
    if BLOCK_M == 1:  # noqa: SIM108 (constexpr branches)
        acc = tl.zeros((BLOCK_N,), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in tl.static_range(TILES):
        kk = k_first + i * BLOCK_K + offs_k
        mask_k = kk < K
        # A tile past K (the last split may hold fewer tiles) loads nothing: zeros, never the scale row after the end.
        tile_live = (k_first + i * BLOCK_K + 0 * offs_n) < K  # as a vector: the interpreter masks only with tensors
        tile_group = (k_first + i * BLOCK_K) // GROUP_SIZE
        if GEMV3D:
            # CUDA-core path: each word loaded once, its PACK values taken out in place (word_value) and summed
            # into a [ROWS, BLOCK_N] tile with the matching activations.
            rows = (k_first + i * BLOCK_K) // PACK + offs_r
            mask_r = rows < K // PACK
            words = tl.load(
                w_ptr + rows[:, None] * N + offs_n[None, :],
                mask=mask_r[:, None] & mask_n[None, :],
                other=0,
                eviction_policy="evict_first",
            )
            hi = words >> 16
            part2 = tl.zeros((ROWS, BLOCK_N), tl.float32)
            for j in tl.static_range(PACK):
                xj = tl.load(x_ptr + rows * PACK + j, mask=mask_r, other=0.0).to(tl.float32)
                part2 += xj[:, None] * word_value(words, hi, MAGIC, j, BITS)
            if ONE_GROUP:
                acc += tl.sum(part2, axis=0)
            elif TILE_SCALE:
                s3 = tl.load(s_ptr + tile_group * N + offs_n, mask=mask_n & tile_live, other=0.0)
                acc += tl.sum(part2, axis=0) * s3.to(tl.float32)
            else:
                s_rows = s_ptr + (rows * PACK // GROUP_SIZE)[:, None] * N + offs_n[None, :]
                s2 = tl.load(s_rows, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
                acc += tl.sum(part2 * s2.to(tl.float32), axis=0)
        else:
            if EXPAND:
                rows = (k_first + i * BLOCK_K) // PACK + offs_r
                packed = tl.load(
                    w_ptr + rows[:, None] * N + offs_n[None, :],
                    mask=(rows < K // PACK)[:, None] & mask_n[None, :],
                    other=0,
                    eviction_policy="evict_first",
                )
                words = tl.reshape(tl.broadcast_to(packed[:, None, :], (ROWS, PACK, BLOCK_N)), (BLOCK_K, BLOCK_N))
            else:
                words = tl.load(
                    w_ptr + (kk // PACK)[:, None] * N + offs_n[None, :],
                    mask=mask_k[:, None] & mask_n[None, :],
                    other=ZERO,
                    eviction_policy="evict_first",
                )
            w = (((words >> shifts) & ((1 << BITS) - 1)) - ZERO).to(tl.float32)
            if TILE_SCALE:
                s = tl.load(s_ptr + tile_group * N + offs_n, mask=mask_n & tile_live, other=0.0)
                s = s.to(tl.float32)
            elif not ONE_GROUP:
                s_ptrs = s_ptr + (kk // GROUP_SIZE)[:, None] * N + offs_n[None, :]
                w = w * tl.load(s_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
            if BLOCK_M == 1:
                xk = tl.load(x_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
                part = tl.sum(w * xk[:, None], axis=0)
                if TILE_SCALE:
                    acc += part * s
                else:
                    acc += part
            else:
                a_ptrs = x_ptr + offs_m[:, None] * stride_xm + kk[None, :]
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                if TILE_SCALE:
                    part = tl.dot(a, w.to(dtype), input_precision=DOT_PRECISION)
                    acc += part * s[None, :]
                else:
                    acc = tl.dot(a, w.to(dtype), acc, input_precision=DOT_PRECISION)
    if ONE_GROUP:
        s1 = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if BLOCK_M == 1:  # noqa: SIM108 (constexpr branches)
            acc = acc * s1
        else:
            acc = acc * s1[None, :]
    if BLOCK_M == 1:
        split_k_store(acc[None, :], y_ptr, part_ptr, cnt_ptr, tl.arange(0, 1), offs_n, 1, N, N)
    else:
        split_k_store(acc, y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym)
