"""Taking 4- and 8-bit codes out of GPTQ v1 int32 words inside the W4A16 kernels, exactly and without an
int-to-float conversion: through the mantissa of a magic number (fp32 2**23 for ``word_value``, a pair of fp16
or bf16 for ``nibble_pair``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["MAGIC", "nibble_pair", "word_value"]

MAGIC = 0x4B000000  # fp32 bits of 2**23 (see word_value), passed to the kernels as a run-time argument


@triton.jit
def word_value(words, hi, MAGIC, J: tl.constexpr, BITS: tl.constexpr):
    """``code - 2**(BITS-1)`` (fp32, exact) of the ``J``-th value of each word; ``hi`` is ``words >> 16``.

    The value is masked in place (no shift) inside the low 16 bits of ``words`` or ``hi`` and OR-ed into the
    mantissa of 2**23 (``MAGIC`` = 0x4B000000), giving ``2**23 + code * 2**S`` with ``S = BITS * (J % (16 / BITS))``;
    one FMA with ``2**-S`` then removes the offset and the zero point: one logic op and one FMA per value.
    ``MAGIC`` is a run-time argument so that the mask and the OR compile to a single three-input logic op.
    """
    HALF: tl.constexpr = 16 // BITS
    S: tl.constexpr = (J % HALF) * BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << S
    bits = (words if J < HALF else hi) & MASK
    f = (bits | MAGIC).to(tl.float32, bitcast=True)
    return tl.fma(f, 1.0 / (1 << S), -(8388608.0 / (1 << S) + (1 << (BITS - 1))))


@triton.jit
def nibble_pair(w, J: tl.constexpr, FP16: tl.constexpr):
    """Codes ``J`` and ``J + 4`` of int32 words ``w`` (eight 4-bit codes each) as ``code - 8`` in fp16 or bf16,
    joined along a new last axis. Both codes are masked into the mantissas of a pair of 16-bit magic numbers
    (1024 in fp16, 128 in bf16, whose mantissa steps are 1) with one shift and one logic op per word; one 16-bit
    subtraction each removes the magic number and the zero point. Exact, and no int-to-float conversion."""
    bits = ((w.to(tl.uint32, bitcast=True) >> (4 * J)) & 0x000F000F) | (0x64006400 if FP16 else 0x43004300)
    lo = bits.to(tl.uint16)
    hi = (bits >> 16).to(tl.uint16)
    if FP16:
        return tl.join(lo.to(tl.float16, bitcast=True) - 1032.0, hi.to(tl.float16, bitcast=True) - 1032.0)
    else:
        return tl.join(lo.to(tl.bfloat16, bitcast=True) - 136.0, hi.to(tl.bfloat16, bitcast=True) - 136.0)
