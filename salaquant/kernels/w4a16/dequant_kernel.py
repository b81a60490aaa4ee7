"""The W4A16 dequantization kernel: GPTQ v1 words and scales to a dense ``[K, N]`` weight (``dequantize``)."""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import word_value

__all__ = ["dequant_kernel"]


@triton.jit
def dequant_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    MAGIC,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out [K, N] = (code - zero) * scale`` in ``out``'s dtype."""
    PACK: tl.constexpr = 32 // BITS
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < K // PACK)[:, None] & (offs_n < N)[None, :]
    words = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0)
    if GROUP_SIZE <= 0:
        s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    else:
        s = tl.load(s_ptr + (rows * PACK // GROUP_SIZE)[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
        s = s.to(tl.float32)
    hi = words >> 16
    for j in tl.static_range(PACK):
        w = word_value(words, hi, MAGIC, j, BITS) * s
        tl.store(out_ptr + (rows * PACK + j)[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)
