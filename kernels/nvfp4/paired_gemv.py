"""NVFP4 weight-only GEMV (one activation row) on paired fp16 arithmetic (``salaquant.kernels.paired_f16``).

The weight is read as int32 words along K (``[N, K/8]``, code ``i`` of a word in bits ``4 i .. 4 i + 3``, input
``8 w + i``). Codes ``i`` and ``i + 4`` sit 16 bits apart, so shifts and masks move both into one fp16 pair at
once: the three magnitude bits ``e1 e0 m`` to fp16 bits 9-11 (the low exponent bits and the top mantissa bit) and
the sign to bit 15, which reads exactly as ``e2m1 * 2**-14`` (the code 0.5 as a subnormal). One paired multiply
by the block's FP8 scale (as an fp16 pair, exact) gives ``e2m1 * scale * 2**-14``, at most 0.17 in magnitude,
and four paired multiply-adds against the fp16 activation pairs ``(x[8 w + i], x[8 w + i + 4])`` the word's two
4-term sums, widened to fp32 and accumulated there; the global scale and ``2**14`` are applied at the end: 27
instructions per word for the math, about 4.5 per weight for the whole sm_90 main loop at the default tile.

Layout: a program owns ``BLOCK_N`` output rows and a run of K tiles of ``BLOCK_W`` words; each thread holds
several rows of the same words, so that the activation pairs it builds serve all of them. The tile's words are
split into the even and odd word of each 16-input block (two words per FP8 scale).

Numerics: the activation is rounded to fp16 (exact for bf16 values between 2**-14 and 65504 in magnitude); each
word's two 4-term sums round to fp16 (relative 2**-11 per operation); products below fp16's normal range lose
bits (weights under 2**-14 of their block's scale times ``2**-14``: blocks whose FP8 scale is subnormal). Every
4-term sum stays below the largest activation, so any activation that fits fp16 is safe; a split whose bf16
activations reach 32768 runs on them times a power of two and scales its sum back, as the W4A16 GEMV does
(``salaquant.kernels.w4a16.paired_gemv``). A NaN scale byte (0x7F,
0xFF) gives NaN outputs, as the reference does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..paired_f16 import DOT4_PTX, RANGE_CHUNK, emulated_fma2, f16_pair_shifted, half, halves, i32, pow2, range_shift
from .split_k import finish, k_range

__all__ = ["E2M1_PAIRS_PTX", "OUT_SHIFT", "e2m1_pair", "nvfp4_paired_gemv_kernel", "scale_pair"]

OUT_SHIFT = tl.constexpr(2.0**14)
"""The weights are used as ``e2m1 * scale * 2**-14``: the accumulated sum is multiplied by this (and the global
scale) at the end."""
_MAG = i32(0x0E000E00)  # fp16 bits 9-11 of both halves
_SIGN = i32(0x80008000)
_F16_256 = i32(0x5C005C00)  # a pair of fp16 256.0
_F16_NAN = i32(0x7E007E00)

E2M1_PAIRS_PTX = """shl.b32 t, {w}, 9;
shl.b32 u, {w}, 12;
and.b32 t, t, 0x0E000E00;
lop3.b32 {a}0, u, 0x80008000, t, 0xEA;
shl.b32 t, {w}, 5;
shl.b32 u, {w}, 8;
and.b32 t, t, 0x0E000E00;
lop3.b32 {a}1, u, 0x80008000, t, 0xEA;
shl.b32 t, {w}, 1;
shl.b32 u, {w}, 4;
and.b32 t, t, 0x0E000E00;
lop3.b32 {a}2, u, 0x80008000, t, 0xEA;
shr.u32 t, {w}, 3;
and.b32 t, t, 0x0E000E00;
lop3.b32 {a}3, {w}, 0x80008000, t, 0xEA;
mul.rn.f16x2 {a}0, {a}0, {s};
mul.rn.f16x2 {a}1, {a}1, {s};
mul.rn.f16x2 {a}2, {a}2, {s};
mul.rn.f16x2 {a}3, {a}3, {s};
"""
"""PTX (a ``str.format`` template) turning int32 word ``{w}`` into the fp16 pairs ``{a}0..3`` = codes ``(i, i + 4)``
as ``e2m1 * 2**-14`` times the block scale pair ``{s}``; the caller's block declares ``.reg .b32 t, u``."""

_WORD_PTX = tl.constexpr(
    """{
.reg .b32 t, u, a0, a1, a2, a3, p;
.reg .b16 l16, h16;
.reg .f32 lf, hf;
"""
    + E2M1_PAIRS_PTX.format(w="$1", a="a", s="$6")
    + DOT4_PTX
    + """add.f32 $0, lf, $7;
}"""
)
_MUL2_PTX = tl.constexpr("mul.rn.f16x2 $0, $1, $2;")


@triton.jit
def e2m1_pair(w, I: tl.constexpr):
    """Codes ``I`` and ``I + 4`` of int32 words ``w`` as an fp16 pair ``e2m1 * 2**-14`` (emulation path)."""
    u = w.to(tl.uint32, bitcast=True)
    mag = ((u << (9 - 4 * I)) if I < 3 else (u >> 3)).to(tl.int32, bitcast=True)
    sign = (u << (12 - 4 * I)).to(tl.int32, bitcast=True)
    return (mag & _MAG) | (sign & _SIGN)


@triton.jit
def _word_dot(words, x0, x1, x2, x3, scale, acc, ASM: tl.constexpr):
    """``acc + sum_i x[i] * e2m1_i * scale * 2**-14`` (fp32) for int32 words of eight E2M1 codes; ``x0..x3`` the fp16
    activation pairs ``(x[i], x[i + 4])``, ``scale`` the block scale as an fp16 pair."""
    if ASM:
        return tl.inline_asm_elementwise(
            _WORD_PTX, "=f,r,r,r,r,r,r,f", [words, x0, x1, x2, x3, scale, acc], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        zero = tl.zeros(words.shape, tl.int32)
        a0 = emulated_fma2(e2m1_pair(words, 0), scale, zero)
        a1 = emulated_fma2(e2m1_pair(words, 1), scale, zero)
        a2 = emulated_fma2(e2m1_pair(words, 2), scale, zero)
        a3 = emulated_fma2(e2m1_pair(words, 3), scale, zero)
        p = emulated_fma2(a0, x0, zero)
        p = emulated_fma2(a1, x1, p)
        p = emulated_fma2(a2, x2, p)
        p = emulated_fma2(a3, x3, p)
        return (half(p, False) + half(p, True)) + acc


@triton.jit
def scale_pair(s, ASM: tl.constexpr):
    """FP8 E4M3 bytes ``s`` (uint8) as fp16 pairs ``(scale, scale)``, exact; 0x7F / 0xFF give NaN pairs."""
    v = s.to(tl.int32)
    bits = ((v << 8) & 0x8000) | ((v << 7) & 0x3F80)  # fp16 pattern of scale * 2**-8 (subnormal scales included)
    pair = bits | (bits << 16)
    big = tl.full(pair.shape, _F16_256, tl.int32)
    if ASM:
        pair = tl.inline_asm_elementwise(_MUL2_PTX, "=r,r,r", [pair, big], dtype=tl.int32, is_pure=True, pack=1)
    else:
        pair = emulated_fma2(pair, big, tl.zeros(pair.shape, tl.int32))
    return tl.where((v & 0x7F) == 0x7F, _F16_NAN, pair)


@triton.jit
def _x_pairs(
    x_ptr,
    blocks,
    mask,
    shift,
    shape: tl.constexpr,
    HALF: tl.constexpr,
    BF16: tl.constexpr,
    ASM: tl.constexpr,
    SCALED: tl.constexpr,
):
    """The four fp16 activation pairs ``(x[8 w + i], x[8 w + i + 4])`` of word ``w = 2 * block + HALF`` (``mask``:
    the blocks inside K, or None), broadcast over the rows to ``shape``."""
    xb = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + blocks * 8 + HALF * 4
    v01 = f16_pair_shifted(tl.load(xb + 0, mask=mask, other=0 if mask is not None else None), shift, BF16, ASM, SCALED)
    v23 = f16_pair_shifted(tl.load(xb + 1, mask=mask, other=0 if mask is not None else None), shift, BF16, ASM, SCALED)
    v45 = f16_pair_shifted(tl.load(xb + 2, mask=mask, other=0 if mask is not None else None), shift, BF16, ASM, SCALED)
    v67 = f16_pair_shifted(tl.load(xb + 3, mask=mask, other=0 if mask is not None else None), shift, BF16, ASM, SCALED)
    return (
        tl.broadcast_to(halves(v01, v45, False)[None, :], shape),
        tl.broadcast_to(halves(v01, v45, True)[None, :], shape),
        tl.broadcast_to(halves(v23, v67, False)[None, :], shape),
        tl.broadcast_to(halves(v23, v67, True)[None, :], shape),
    )


@triton.jit
def _tiles(
    x_ptr, w_ptr, s_ptr, offs_n, n_ok, K, k_first, k_last, shift,
    BLOCK_B: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """The fp32 ``[BLOCK_N, BLOCK_B]`` partial sums of K tiles ``k_first .. k_last`` (activations times
    ``2**-shift`` when ``SCALED``; the caller picks one of the two loops with a uniform branch)."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    offs_b = tl.arange(0, BLOCK_B)
    nb = K // 16
    shape: tl.constexpr = (BLOCK_N, BLOCK_B)
    acc = tl.zeros(shape, tl.float32)
    for kt in range(k_first, k_last):
        blocks = kt * BLOCK_B + offs_b
        words = 2 * kt * BLOCK_B + tl.arange(0, 2 * BLOCK_B)
        w_ptrs = w_ptr + offs_n[:, None] * (K // 8) + words[None, :]
        s_ptrs = s_ptr + offs_n[:, None] * nb + blocks[None, :]
        if EVEN:
            b_ok = None
            w = tl.load(w_ptrs)
            s = tl.load(s_ptrs)
        else:
            b_ok = blocks < nb
            w = tl.load(w_ptrs, mask=n_ok[:, None] & (words < 2 * nb)[None, :], other=0)
            s = tl.load(s_ptrs, mask=n_ok[:, None] & b_ok[None, :], other=0)
        w_even, w_odd = tl.split(tl.reshape(w, (BLOCK_N, BLOCK_B, 2)))
        sc = scale_pair(s, ASM)
        e0, e1, e2, e3 = _x_pairs(x_ptr, blocks, b_ok, shift, shape, 0, BF16, ASM, SCALED)
        o0, o1, o2, o3 = _x_pairs(x_ptr, blocks, b_ok, shift, shape, 1, BF16, ASM, SCALED)
        acc = _word_dot(w_even, e0, e1, e2, e3, sc, acc, ASM)
        acc = _word_dot(w_odd, o0, o1, o2, o3, sc, acc, ASM)
    return acc


@triton.jit
def nvfp4_paired_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SPLIT: tl.constexpr,
    BF16: tl.constexpr,
    ASM: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), split_k)``, SPLIT when split_k > 1; K tiles of ``BLOCK_B`` 16-input blocks (two
        words each). ``w_ptr``: int32 words ``[N, K/8]``; ``s_ptr``: scale bytes ``[N, K/16]``. EVEN: the tiles divide N
    and K (no masks)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    split_k = tl.num_programs(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_first, k_last = k_range(pid_k, split_k, K, BLOCK_B * 16)
    args = (x_ptr, w_ptr, s_ptr, offs_n, n_ok, K, k_first, k_last)
    if BF16:  # activations beyond fp16's range are scaled by 2**-shift, this split's sum by 2**shift
        shift = range_shift(x_ptr, k_first * BLOCK_B * 16, tl.minimum(k_last * BLOCK_B * 16, K), RANGE_CHUNK)
        if shift == 0:
            acc = _tiles(*args, shift, BLOCK_B, BF16, ASM, EVEN, False)
        else:
            acc = _tiles(*args, shift, BLOCK_B, BF16, ASM, EVEN, True)
        y = tl.sum(acc, axis=1) * pow2(shift)
    else:
        y = tl.sum(_tiles(*args, 0, BLOCK_B, BF16, ASM, EVEN, False), axis=1)
    gscale = tl.load(gs_ptr) * OUT_SHIFT
    finish(y, gscale, out_ptr + offs_n, ws_ptr + offs_n, n_ok, cnt_ptr, pid_n, pid_k, N, split_k, SPLIT)
