"""GPTQ int4 codes as fp16 pairs, for the paired-fp16 W4A16 kernels (the one-row GEMV in ``w4a16.paired_gemv`` and
the ``mma.sync`` row kernel in ``mma_rows``).

GPTQ v1 packs input rows ``8 r .. 8 r + 7`` of a column into one int32 word, code ``j`` in bits ``4 j .. 4 j + 3``.
Codes ``j`` and ``j + 4`` sit at the same offset in the two 16-bit halves, so one three-input logic op masks both
into the mantissas of a pair of fp16 magic numbers (1024, whose mantissa step is 1), and one paired fused
multiply-add turns each pair into ``(code - 8) / 32`` (exact in fp16). A leaf module: both kernels import it, it
imports neither.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .paired_f16 import emulated_fma2, i32

__all__ = ["OUT_SCALE", "dequant_constants", "emulated_pairs"]

_MAGIC16 = 0x64006400  # a pair of fp16 1024.0
_LO_MASK = 0x000F000F  # codes j and j + 4 (j = 0, or 2 after >> 8), each at bit 0 of its half
_HI_MASK = 0x00F000F0  # codes j and j + 4 (j = 1, or 3 after >> 8), each at bit 4 of its half
_LO_MUL, _LO_ADD = 0x28002800, 0xD008D008  # (1024 + c) / 32 - 32.25 = (c - 8) / 32
_HI_MUL, _HI_ADD = 0x18001800, 0xC080C080  # (1024 + 16 c) / 512 - 2.25 = (c - 8) / 32


C_MAGIC, C_LO_MASK, C_HI_MASK = i32(_MAGIC16), i32(_LO_MASK), i32(_HI_MASK)
C_LO_MUL, C_LO_ADD, C_HI_MUL, C_HI_ADD = i32(_LO_MUL), i32(_LO_ADD), i32(_HI_MUL), i32(_HI_ADD)
OUT_SCALE = tl.constexpr(32.0)
"""The codes are used as ``(code - 8) / 32``: the accumulated sum is multiplied by this at the end."""


@triton.jit
def dequant_constants(shape: tl.constexpr):
    """The seven int32 operands the dequantization PTX takes, in its order: low mask, magic pair, high mask, then
    the low and high codes' paired multiply and add."""
    return (
        tl.full(shape, C_LO_MASK, tl.int32),
        tl.full(shape, C_MAGIC, tl.int32),
        tl.full(shape, C_HI_MASK, tl.int32),
        tl.full(shape, C_LO_MUL, tl.int32),
        tl.full(shape, C_LO_ADD, tl.int32),
        tl.full(shape, C_HI_MUL, tl.int32),
        tl.full(shape, C_HI_ADD, tl.int32),
    )


@triton.jit
def emulated_pairs(words):
    """The interpreter's dequantization: the fp16 pairs ``((c_j - 8) / 32, (c_{j+4} - 8) / 32)``, ``j = 0..3``, of
    each int32 word (the PTX's operations, emulated per half)."""
    q8 = (words.to(tl.uint32, bitcast=True) >> 8).to(tl.int32, bitcast=True)
    lo_mul = tl.full(words.shape, C_LO_MUL, tl.int32)
    lo_add = tl.full(words.shape, C_LO_ADD, tl.int32)
    hi_mul = tl.full(words.shape, C_HI_MUL, tl.int32)
    hi_add = tl.full(words.shape, C_HI_ADD, tl.int32)
    return (
        emulated_fma2((words & C_LO_MASK) | C_MAGIC, lo_mul, lo_add),
        emulated_fma2((words & C_HI_MASK) | C_MAGIC, hi_mul, hi_add),
        emulated_fma2((q8 & C_LO_MASK) | C_MAGIC, lo_mul, lo_add),
        emulated_fma2((q8 & C_HI_MASK) | C_MAGIC, hi_mul, hi_add),
    )
