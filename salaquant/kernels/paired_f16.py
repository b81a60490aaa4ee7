"""Paired fp16 arithmetic for the one-row weight-only GEMVs: two 16-bit values in one int32 register, operated on
by one ``f16x2`` instruction on a GPU.

Triton has no ``f16x2`` type, so the pairs travel as int32 tensors and the paired operations are inline PTX. The
Triton interpreter runs no PTX: there every paired operation is emulated per half (exact fp64 arithmetic on the
two fp16 halves, rounded to fp16 once per operation, as the hardware rounds), on the same int32 pairs, so the CPU
tests exercise the packing, the pairing and the constants, and a GPU test holds the PTX to the emulation bit for
bit. (An fp32 emulation rounds twice where a product and a sum span more than 24 bits, and then differs from the
hardware in the last fp16 bit, now and then.)
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "DOT4_PTX",
    "RANGE_CHUNK",
    "dot_ptx",
    "emulated_fma2",
    "f16_pair",
    "f16_pair_shifted",
    "fp16_shift",
    "half",
    "halves",
    "i32",
    "join",
    "max_exponent",
    "pow2",
    "range_shift",
]


def dot_ptx(weights: list[str], activations: list[str]) -> str:
    """PTX of a dot product on pairs: the paired products of the weight pairs with the activation pairs (register
    names, in order) summed into pair ``p``, then its two halves widened and added into fp32 ``lf``. The caller's
    block declares ``p``, ``.reg .b16 l16, h16`` and ``.reg .f32 lf, hf``."""
    lines = [f"mul.rn.f16x2 p, {weights[0]}, {activations[0]};"]
    lines += [f"fma.rn.f16x2 p, {w}, {x}, p;" for w, x in zip(weights[1:], activations[1:], strict=True)]
    lines += ["mov.b32 {l16, h16}, p;", "cvt.f32.f16 lf, l16;", "cvt.f32.f16 hf, h16;", "add.f32 lf, lf, hf;"]
    return "\n".join(lines) + "\n"


DOT4_PTX = dot_ptx(["a0", "a1", "a2", "a3"], ["$2", "$3", "$4", "$5"])
"""``dot_ptx`` of a word: weight pairs ``a0..a3`` (declared ``.reg .b32 a0, a1, a2, a3, p`` by the caller's block),
activation pairs in operands ``$2..$5``."""


def i32(value: int) -> tl.constexpr:
    """A 32-bit pattern (a pair of fp16 constants, a mask) as the signed int32 constant Triton takes."""
    return tl.constexpr(value - (1 << 32) if value >= 1 << 31 else value)


_BF16_PAIR_PTX = tl.constexpr("""{
.reg .b32 lo, hi;
shl.b32 lo, $1, 16;
and.b32 hi, $1, 0xFFFF0000;
cvt.rn.f16x2.f32 $0, hi, lo;
}""")


_BF16_PAIR_SCALED_PTX = tl.constexpr("""{
.reg .b32 lo, hi;
shl.b32 lo, $1, 16;
and.b32 hi, $1, 0xFFFF0000;
mul.f32 lo, lo, $2;
mul.f32 hi, hi, $2;
cvt.rn.f16x2.f32 $0, hi, lo;
}""")


_F16_PAIR_SCALED_PTX = tl.constexpr("""{
.reg .b16 l16, h16;
.reg .f32 lo, hi;
mov.b32 {l16, h16}, $1;
cvt.f32.f16 lo, l16;
cvt.f32.f16 hi, h16;
mul.f32 lo, lo, $2;
mul.f32 hi, hi, $2;
cvt.rn.f16x2.f32 $0, hi, lo;
}""")


@triton.jit
def half(v, HI: tl.constexpr):
    """One 16-bit half of int32 ``v`` as fp16 (widened to fp32)."""
    bits = (v >> 16) if HI else v
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def join(lo, hi):
    """fp32 (or fp64) ``lo`` and ``hi`` rounded to fp16 and packed into one int32 (``lo`` in the low half)."""
    lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return (hi_bits << 16) | lo_bits


@triton.jit
def f16_pair(v, BF16: tl.constexpr, ASM: tl.constexpr):
    """Two activations packed in int32 ``v`` (bf16 or fp16, the first in the low half) as an fp16 pair."""
    if not BF16:
        return v
    if ASM:
        return tl.inline_asm_elementwise(_BF16_PAIR_PTX, "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
    else:
        lo = (v << 16).to(tl.float32, bitcast=True)
        hi = (v & -65536).to(tl.float32, bitcast=True)
        return join(lo, hi)


@triton.jit
def halves(a, b, HI: tl.constexpr):
    """The low (``HI`` False) or high halves of int32 ``a`` and ``b`` joined: ``a``'s in the low half."""
    if HI:
        return ((a >> 16) & 0xFFFF) | (b & -65536)
    else:
        return (a & 0xFFFF) | (b << 16)


@triton.jit
def emulated_fma2(a, b, c):
    """Emulated paired fp16 multiply-add: per half, ``a * b + c`` rounded to fp16 once, as ``fma.rn.f16x2`` does
    (computed in fp64, where the product of two fp16 values and its sum with a third are exact)."""
    lo = half(a, False).to(tl.float64) * half(b, False).to(tl.float64) + half(c, False).to(tl.float64)
    hi = half(a, True).to(tl.float64) * half(b, True).to(tl.float64) + half(c, True).to(tl.float64)
    return join(lo, hi)


RANGE_CHUNK = tl.constexpr(2048)
"""Activations ``range_shift`` reads per step (16 per thread at 4 warps)."""


@triton.jit
def pow2(e):
    """``2**e`` as an fp32 scalar, exact, for an int32 ``-126 <= e <= 127``."""
    return ((127 + e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def max_exponent(x_ptr, first, last, CHUNK: tl.constexpr):
    """The binary exponent ``e`` of the largest ``|x[i]|``, ``first <= i < last``, with ``2**e <= |x[i]| < 2**(e + 1)``
    (int32 scalar): -127 when they are all zero (or fp32-subnormal), 128 when one is infinite or NaN."""
    m = tl.zeros([CHUNK], tl.float32)
    for start in range(first, last, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        m = tl.maximum(m, tl.abs(tl.load(x_ptr + offs, mask=offs < last, other=0.0).to(tl.float32)))
    return ((tl.max(m, 0).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def range_shift(x_ptr, first, last, CHUNK: tl.constexpr):
    """The smallest ``e >= 0`` with ``|x[i]| * 2**-e < 2**15`` for every ``first <= i < last`` (int32 scalar): the
    power of two that brings a program's bf16 activations into fp16 range, 0 for any activations below 32768 in
    magnitude. An infinite activation gives 114, which leaves it infinite."""
    return fp16_shift(max_exponent(x_ptr, first, last, CHUNK))


@triton.jit
def fp16_shift(top):
    """The smallest ``e >= 0`` that brings values whose largest has binary exponent ``top`` (``max_exponent``)
    below 32768 when multiplied by ``2**-e``."""
    return tl.maximum(top - 14, 0)


@triton.jit
def f16_pair_shifted(v, shift, BF16: tl.constexpr, ASM: tl.constexpr, SCALED: tl.constexpr):
    """``f16_pair`` of activations times ``2**-shift`` when ``SCALED`` (rounded to fp16 once, from fp32); kernels that
    scale only out-of-range slices run their loop unscaled, as ``f16_pair``, when the shift is 0 (a uniform branch
    around two copies of the loop)."""
    if not SCALED:  # (one return at the end: the compiler would build the code after an early one)
        pair = f16_pair(v, BF16, ASM)
    else:
        scale = pow2(-shift)
        operands = [v, scale + tl.zeros(v.shape, tl.float32)]
        if ASM and BF16:
            pair = tl.inline_asm_elementwise(
                _BF16_PAIR_SCALED_PTX, "=r,r,f", operands, dtype=tl.int32, is_pure=True, pack=1
            )
        elif ASM:
            pair = tl.inline_asm_elementwise(
                _F16_PAIR_SCALED_PTX, "=r,r,f", operands, dtype=tl.int32, is_pure=True, pack=1
            )
        elif BF16:
            lo = (v << 16).to(tl.float32, bitcast=True)
            hi = (v & -65536).to(tl.float32, bitcast=True)
            pair = join(lo * scale, hi * scale)
        else:
            pair = join(half(v, False) * scale, half(v, True) * scale)
    return pair
