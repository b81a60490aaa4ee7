"""Taking 4- and 8-bit codes out of GPTQ v1 int32 words inside the W4A16 kernels, exactly and without an
int-to-float conversion: through the mantissa of the fp32 magic number 2**23 (``word_value``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["MAGIC", "word_value"]

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
