"""Device code of the Triton NVFP4 GEMM (``triton_kernels`` launches it): the tensor-core tile kernel
``nvfp4_dot_kernel`` (``y^T = W @ x^T``, split-K) and the dequantization kernel ``nvfp4_dequant_kernel``, with
the register decoders they share.

Decoding (in registers, integer ops only, no lookup table):

* the packed weight is read as 32-bit words, eight E2M1 codes each (code ``i`` at bits ``4i``, i.e. input
  ``k0 + i``). Codes ``i`` and ``i + 4`` sit 16 bits apart, so two shifts and two masks build one word that
  holds both as 16-bit patterns: sign to bit 15, the three magnitude bits ``e1 e0 m`` to the low two exponent
  bits and the top mantissa bit. As fp16 (``m`` at bit 9) a pattern is exactly ``e2m1 * 2**-14``, as bf16
  (``m`` at bit 6) exactly ``e2m1 * 2**-126``; the code 0.5 becomes a subnormal, which is exact.
  ``tl.join`` / ``tl.reshape`` put the values back in K order.
* an E4M3 byte's seven magnitude bits are moved to fp16 bits 7-13, which is exactly ``value * 2**-8``
  (subnormal scales included); 0x7F / 0xFF are mapped to NaN. The fp8 bytes are read as uint8 because
  Triton's interpreter decodes ``float8e4nv`` 0x7F / 0xFF as +-480 instead of NaN (checked with triton 3.9);
  the integer decode is exact for all 256 bytes everywhere.
* each block scale is brought to the half type as ``scale * 2**7`` (fp16) or ``scale * 2**119`` (bf16), so
  the dequantized tile ``e2m1 * scale * 2**-7`` is exact in fp16 and bf16 (at most 6 significant bits, between
  2**-17 and 21). The global scale is applied once to the fp32 accumulator as ``weight_scale_2 * 2**7``.

The tensor-core kernel makes the dequantized weight the left ``tl.dot`` operand: on Hopper that is wgmma's
register operand, and ``x^T`` is the shared-memory operand whose width (wgmma's N, 16 to 256) is BLOCK_M, so
M = 1 pads to 16 columns rather than to a 64-row tile. Tiles that divide N and K are compiled without masks
(EVEN_N / EVEN_K).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..split_k import finish_split_k, k_slice
from ..tile_order import grouped_tile

__all__ = ["nvfp4_dequant_kernel", "nvfp4_dot_kernel"]

_TILE_SHIFT: tl.constexpr = tl.constexpr(2.0**7)
"""The half tile holds ``W / (weight_scale_2 * _TILE_SHIFT)``."""
_FP16_SCALE_UP: tl.constexpr = tl.constexpr(2.0**7)
_BF16_SCALE_UP: tl.constexpr = tl.constexpr(2.0**119)


@triton.jit
def _e4m3_to_f32(s):
    """fp32 value of float8_e4m3fn bytes ``s`` (uint8), exact; 0x7F and 0xFF give NaN."""
    v = s.to(tl.uint16)
    bits = ((v << 8) & 0x8000) | ((v << 7) & 0x3F80)
    f = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((v & 0x7F) == 0x7F, float("nan"), f)


@triton.jit
def _e2m1_pair(w, I: tl.constexpr, BF16: tl.constexpr):
    """Codes ``I`` and ``I + 4`` of uint32 words ``w`` (eight codes each) as two half tensors, fp16
    ``e2m1 * 2**-14`` or bf16 ``e2m1 * 2**-126``, joined along a new last axis."""
    SH: tl.constexpr = 4 * I
    if BF16:
        MAG: tl.constexpr = 6
        mag_mask = 0x01C001C0
    else:
        MAG: tl.constexpr = 9
        mag_mask = 0x0E000E00
    if MAG >= SH:  # noqa: SIM108 (a constexpr branch)
        mag = (w << (MAG - SH)) & mag_mask
    else:
        mag = (w >> (SH - MAG)) & mag_mask
    if SH <= 12:  # noqa: SIM108 (a constexpr branch)
        sign = (w << (12 - SH)) & 0x80008000
    else:
        sign = (w >> (SH - 12)) & 0x80008000
    bits = mag | sign
    lo = bits.to(tl.uint16)
    hi = (bits >> 16).to(tl.uint16)
    if BF16:
        return tl.join(lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True))
    else:
        return tl.join(lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True))


@triton.jit
def _weight_tile(
    w_ptr,
    s_ptr,
    offs_n,
    k0,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BF16: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """``[BLOCK_N, BLOCK_K]`` tile of ``W[offs_n, k0:k0 + BLOCK_K] / (weight_scale_2 * 2**7)``, exact, in bf16 (BF16)
    or fp16, from int32 words ``w_ptr`` (``[N, K/8]``) and FP8 bytes ``s_ptr`` (``[N, K/16]``); rows >= N and
    columns >= K are zero."""
    NW: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 16
    offs_w = k0 // 8 + tl.arange(0, NW)
    offs_g = k0 // 16 + tl.arange(0, G)
    w_ptrs = w_ptr + offs_n[:, None] * (K // 8) + offs_w[None, :]
    s_ptrs = s_ptr + offs_n[:, None] * (K // 16) + offs_g[None, :]
    if EVEN_N and EVEN_K:
        w = tl.load(w_ptrs)
        s = tl.load(s_ptrs)
    else:
        n_ok = offs_n[:, None] < N
        w = tl.load(w_ptrs, mask=n_ok & (offs_w[None, :] < K // 8), other=0)
        s = tl.load(s_ptrs, mask=n_ok & (offs_g[None, :] < K // 16), other=0)
    sf = _e4m3_to_f32(s)
    if BF16:  # noqa: SIM108 (a constexpr branch)
        sh = (sf * _BF16_SCALE_UP).to(tl.bfloat16)
    else:
        sh = (sf * _FP16_SCALE_UP).to(tl.float16)
    w = w.to(tl.uint32, bitcast=True)
    # [BLOCK_N, NW, 2 (code i or i + 4), 2 (i // 2), 2 (i % 2)] flattens to the word's K order 4 h + 2 a + b.
    t = tl.join(
        tl.join(_e2m1_pair(w, 0, BF16), _e2m1_pair(w, 2, BF16)),
        tl.join(_e2m1_pair(w, 1, BF16), _e2m1_pair(w, 3, BF16)),
    )
    t = tl.reshape(t, (BLOCK_N, G, 16)) * sh[:, :, None]
    return tl.reshape(t, (BLOCK_N, BLOCK_K))


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def nvfp4_dot_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    GROUP_N: tl.constexpr,
    BF16: tl.constexpr,
    X_F32: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M), split_k)``, SPLIT when split_k > 1. Each program accumulates a
    ``[BLOCK_N, BLOCK_M]`` tile of ``y^T`` over its share of K; output tiles are visited GROUP_N weight tiles at a
    time across all of M."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n, pid_m = grouped_tile(pid, tl.cdiv(N, BLOCK_N), tl.cdiv(M, BLOCK_M), GROUP_N)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    k_first, k_last = k_slice(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(k_first, k_last):
        k0 = kt * BLOCK_K
        w = _weight_tile(w_ptr, s_ptr, offs_n, k0, N, K, BLOCK_N, BLOCK_K, BF16, EVEN_N, EVEN_K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & (offs_k[:, None] < K), other=0.0)
        if X_F32:  # noqa: SIM108 (a constexpr branch)
            acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)

    gscale = tl.load(gs_ptr) * _TILE_SHIFT
    out_mask = (offs_n[:, None] < N) & m_ok[None, :]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT:  # y^T tiles: the rows of y along axis 1, its columns along axis 0
        tl.store(ws_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=out_mask)
        finish_split_k(out_ptr, ws_ptr, cnt_ptr, offs_m[None, :], offs_n[:, None], M, N, stride_om, pid, gscale)
    else:
        tl.store(out_ptrs, (acc * gscale).to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def nvfp4_dequant_kernel(
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BF16: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))``; writes ``W`` tiles in the output dtype."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w = _weight_tile(w_ptr, s_ptr, offs_n, k0, N, K, BLOCK_N, BLOCK_K, BF16, EVEN_N, EVEN_K)
    w = (w.to(tl.float32) * (tl.load(gs_ptr) * _TILE_SHIFT)).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + offs_n[:, None] * K + offs_k[None, :]
    if EVEN_N and EVEN_K:
        tl.store(out_ptrs, w)
    else:
        tl.store(out_ptrs, w, mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))
