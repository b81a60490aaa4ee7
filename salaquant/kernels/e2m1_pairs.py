"""E2M1 (FP4) codes and E4M3 block scales as fp16 pairs, for the paired-fp16 NVFP4 kernels (the one-row GEMV in
``nvfp4.paired_gemv`` and the ``mma.sync`` row kernel in ``mma_rows``).

An int32 word holds eight codes along K (code ``i`` in bits ``4 i .. 4 i + 3``). Codes ``i`` and ``i + 4`` sit 16
bits apart, so shifts and masks move both into one fp16 pair at once: the three magnitude bits ``e1 e0 m`` to fp16
bits 9-11 and the sign to bit 15, which reads exactly as ``e2m1 * 2**-14`` (the code 0.5 as a subnormal). A leaf
module: both kernels import it, it imports neither.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .paired_f16 import emulated_fma2, i32

__all__ = ["E2M1_CODES_PTX", "E2M1_PAIRS_PTX", "OUT_SHIFT", "e2m1_pair", "scale_pair"]

OUT_SHIFT = tl.constexpr(2.0**14)
"""The weights are used as ``e2m1 * scale * 2**-14``: the accumulated sum is multiplied by this (and the global
scale) at the end."""
_MAG = i32(0x0E000E00)  # fp16 bits 9-11 of both halves
_SIGN = i32(0x80008000)
_F16_256 = i32(0x5C005C00)  # a pair of fp16 256.0
_F16_NAN = i32(0x7E007E00)

E2M1_CODES_PTX = """shl.b32 t, {w}, 9;
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
"""
"""PTX (a ``str.format`` template) turning int32 word ``{w}`` into the fp16 pairs ``{a}0..3`` = codes ``(i, i + 4)``
as ``e2m1 * 2**-14``; the caller's block declares ``.reg .b32 t, u``."""

E2M1_PAIRS_PTX = (
    E2M1_CODES_PTX
    + """mul.rn.f16x2 {a}0, {a}0, {s};
mul.rn.f16x2 {a}1, {a}1, {s};
mul.rn.f16x2 {a}2, {a}2, {s};
mul.rn.f16x2 {a}3, {a}3, {s};
"""
)
"""``E2M1_CODES_PTX`` with each pair multiplied by the block scale pair ``{s}`` (``scale_pair``)."""

_MUL2_PTX = tl.constexpr("mul.rn.f16x2 $0, $1, $2;")


@triton.jit
def e2m1_pair(w, I: tl.constexpr):
    """Codes ``I`` and ``I + 4`` of int32 words ``w`` as an fp16 pair ``e2m1 * 2**-14`` (emulation path)."""
    u = w.to(tl.uint32, bitcast=True)
    mag = ((u << (9 - 4 * I)) if I < 3 else (u >> 3)).to(tl.int32, bitcast=True)
    sign = (u << (12 - 4 * I)).to(tl.int32, bitcast=True)
    return (mag & _MAG) | (sign & _SIGN)


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
