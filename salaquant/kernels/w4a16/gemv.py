"""The CUDA-core split-K W4A16 GEMV for one activation row (``matmul_gemv``): the cases the paired-fp16 GEMV does
not take, 8-bit codes and fp32 activations.

A program owns a ``BLOCK_N`` column tile and a run of K tiles; it loads each ``[BLOCK_K / p, BLOCK_N]`` tile of int32
words once (the next tile's load is issued before this tile's math), takes the ``p`` values out of every word with
masks (``codes.word_value``: one logic op and one FMA per value, exact), multiplies them by the activation into a 2-D
fp32 accumulator and applies the group scale once per word row.

Scale modes, fixed at compile time: ``GROUP_SIZE <= 0`` means one group (scaled once at the end); a multiple
of ``BLOCK_K`` means one scale row per K tile; otherwise one scale row per word row (``GROUP_SIZE`` is a
multiple of ``32 / BITS``, so the values of one word share a group).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..split_k import k_slice, store_split_k
from .autotune import INTERPRET, bench, config
from .codes import word_value
from .words import load_words, tile_scales

__all__ = ["GEMV_CONFIGS", "gemv_kernel"]

if INTERPRET:
    GEMV_CONFIGS = [config(4, 1, BLOCK_N=128, BLOCK_K=64)]
else:
    # The GEMV prefetches the next word tile by hand; num_stages plays no part there.
    GEMV_CONFIGS = [
        config(4, 1, BLOCK_N=128, BLOCK_K=128),
        config(4, 1, BLOCK_N=64, BLOCK_K=256),
        config(4, 1, BLOCK_N=256, BLOCK_K=64),
        config(4, 1, BLOCK_N=128, BLOCK_K=64),
        config(8, 1, BLOCK_N=256, BLOCK_K=128),
        config(8, 1, BLOCK_N=128, BLOCK_K=256),
        config(8, 1, BLOCK_N=512, BLOCK_K=64),
    ]


@triton.autotune(configs=GEMV_CONFIGS, key=["N", "K", "BITS", "GROUP_SIZE"], do_bench=bench)
@triton.jit
def gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    N,
    K,
    MAGIC,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PACK
    ONE_GROUP: tl.constexpr = GROUP_SIZE <= 0

    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, ROWS)
    t_start, t_end = k_slice(K, BLOCK_K)
    acc = tl.zeros((ROWS, BLOCK_N), tl.float32)
    cols = offs_n[None, :]
    words = load_words(w_ptr, t_start, t_end, offs_r, cols, N, K, ROWS, PACK)
    for t in range(t_start, t_end):
        # Issue the next tile's loads before this tile's math.
        nxt = load_words(w_ptr, t + 1, t_end, offs_r, cols, N, K, ROWS, PACK)
        rows = t * ROWS + offs_r
        mask_r = rows < K // PACK
        hi = words >> 16
        part = acc if ONE_GROUP else tl.zeros((ROWS, BLOCK_N), tl.float32)
        for j in tl.static_range(PACK):
            xj = tl.load(x_ptr + rows * PACK + j, mask=mask_r, other=0.0).to(tl.float32)
            part += xj[:, None] * word_value(words, hi, MAGIC, j, BITS)
        if ONE_GROUP:
            acc = part
        else:
            acc += part * tile_scales(s_ptr, t, rows, mask_r, offs_n, cols, N, GROUP_SIZE, BLOCK_K, PACK)
        words = nxt
    y = tl.sum(acc, axis=0)
    if ONE_GROUP:
        y = y * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    store_split_k(y[None, :], y_ptr, part_ptr, cnt_ptr, tl.arange(0, 1), offs_n, 1, N, N)
