"""W4A16 GEMV (one activation row) on paired 16-bit math: two weights per instruction.

GPTQ v1 packs input rows ``8 r .. 8 r + 7`` of a column into one int32 word, code ``j`` in bits ``4 j .. 4 j + 3``.
Codes ``j`` and ``j + 4`` sit at the same offset in the two 16-bit halves, so one three-input logic op masks both
into the mantissas of a pair of fp16 magic numbers (1024, whose mantissa step is 1): codes 0/4 read as
``1024 + code``, codes 1/5 (4 bits up) as ``1024 + 16 code``, and codes 2/6 and 3/7 the same after one shift of the
word by 8. One paired fused multiply-add turns each pair into ``(code - 8) / 32`` (exact in fp16), and four paired
multiply-adds against the activation pairs ``(x[8 r + j], x[8 r + j + 4])`` (fp16) form the word's two partial
sums; both are widened to fp32, added, scaled by the group scale and accumulated in fp32: 17 instructions per
word, about 2 per weight, where the fp32 GEMV (``gemv``) spends one logic op and one FMA per weight plus the
multiply-add with the activation. The activation pairs are built once per thread and word row and serve every column
the thread holds.

Numerics: the activation is rounded to fp16 (exact for bf16 values between 2**-14 and 65504 in magnitude, and
for fp16 activations), each word's two 4-term sums round to fp16 (relative 2**-11, below the output's own
rounding), and everything after is fp32. The ``1/32`` keeps every 4-term sum within the activation's magnitude,
so any activation that fits fp16 (|x| <= 65504) is safe; the result is multiplied by 32 at the end (exact). bf16
activations of 32768 or more in a program's K slice are scaled first: the program reads its slice's largest
magnitude (``range_shift``), runs the loop on the activations times ``2**-e`` (the smallest power that brings them
below 32768) and multiplies its sum by ``2**e``; slices in range run the unscaled loop (a uniform branch), so their
numbers are unchanged. In a scaled slice the values below ``2**(e - 14)`` lose relative precision, by at most
``2**(e - 25)`` absolute each, under ``2**-39`` of the slice's largest.

On a GPU the paired operations are PTX (``ASM``); under the Triton interpreter they are emulated on the same
packed words and pairs (``salaquant.kernels.paired_f16``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..int4_pairs import OUT_SCALE, dequant_constants, emulated_pairs
from ..paired_f16 import DOT4_PTX, RANGE_CHUNK, emulated_fma2, f16_pair_shifted, half, halves, pow2, range_shift
from ..split_k import finish_split_k, k_slice
from .words import lead, load_words, tile_scales

__all__ = ["paired_gemv_kernel", "word_dot"]

_WORD_PTX = tl.constexpr(
    """{
.reg .b32 q8, a0, a1, a2, a3, p;
.reg .b16 l16, h16;
.reg .f32 lf, hf;
shr.u32 q8, $1, 8;
lop3.b32 a0, $1, $8, $9, 0xEA;
lop3.b32 a1, $1, $10, $9, 0xEA;
lop3.b32 a2, q8, $8, $9, 0xEA;
lop3.b32 a3, q8, $10, $9, 0xEA;
fma.rn.f16x2 a0, a0, $11, $12;
fma.rn.f16x2 a1, a1, $13, $14;
fma.rn.f16x2 a2, a2, $11, $12;
fma.rn.f16x2 a3, a3, $13, $14;
"""
    + DOT4_PTX
    + """fma.rn.f32 $0, lf, $6, $7;
}"""
)


@triton.jit
def word_dot(words, x0, x1, x2, x3, scale, acc, ASM: tl.constexpr):
    """``acc + scale * sum_j (code_j - 8) / 32 * x[j]`` (fp32) for int32 words of eight 4-bit codes; ``x0..x3``
    are the fp16 pairs ``(x[j], x[j + 4])`` for ``j = 0..3``, all tensors of one shape."""
    if ASM:
        return tl.inline_asm_elementwise(
            _WORD_PTX,
            "=f,r,r,r,r,r,f,f,r,r,r,r,r,r,r",
            (words, x0, x1, x2, x3, scale, acc) + dequant_constants(words.shape),  # noqa: RUF005
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        a0, a1, a2, a3 = emulated_pairs(words)
        p = emulated_fma2(a0, x0, tl.zeros(words.shape, tl.int32))
        p = emulated_fma2(a1, x1, p)
        p = emulated_fma2(a2, x2, p)
        p = emulated_fma2(a3, x3, p)
        return (half(p, False) + half(p, True)) * scale + acc


@triton.jit
def _tiles(
    x_ptr, w_ptr, s_ptr, words, t_start, t_end, out_cols, cols, N, K, shift,
    GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """The fp32 partial sums of K tiles ``t_start .. t_end``, word rows leading: ``[ROWS, BLOCK_N]`` for ``cols``
    ``[1, BLOCK_N]``, ``[ROWS, SUBS, SUB]`` for ``cols [1, SUBS, SUB]`` (``words``: tile ``t_start``'s, loaded by the
    caller; ``out_cols``: ``cols`` without its first axis; activations times ``2**-shift`` when ``SCALED``; the
    caller picks one of the two loops with a uniform branch)."""
    ROWS: tl.constexpr = BLOCK_K // 8
    offs_r = tl.arange(0, ROWS)
    shape: tl.constexpr = words.shape
    acc = tl.zeros(shape, tl.float32)
    for t in range(t_start, t_end):
        nxt = load_words(w_ptr, t + 1, t_end, offs_r, cols, N, K, ROWS, 8)  # issued before this tile's math
        rows = t * ROWS + offs_r
        mask_r = rows < K // 8
        # activations 8 r .. 8 r + 7 as four int32 pairs (2 r, 2 r + 1) .. (8 r + 6, 8 r + 7), then (j, j + 4)
        xb = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rows * 4
        v01 = f16_pair_shifted(tl.load(xb + 0, mask=mask_r, other=0), shift, BF16, ASM, SCALED)
        v23 = f16_pair_shifted(tl.load(xb + 1, mask=mask_r, other=0), shift, BF16, ASM, SCALED)
        v45 = f16_pair_shifted(tl.load(xb + 2, mask=mask_r, other=0), shift, BF16, ASM, SCALED)
        v67 = f16_pair_shifted(tl.load(xb + 3, mask=mask_r, other=0), shift, BF16, ASM, SCALED)
        p0 = tl.broadcast_to(lead(halves(v01, v45, False), cols), shape)
        p1 = tl.broadcast_to(lead(halves(v01, v45, True), cols), shape)
        p2 = tl.broadcast_to(lead(halves(v23, v67, False), cols), shape)
        p3 = tl.broadcast_to(lead(halves(v23, v67, True), cols), shape)
        if GROUP_SIZE <= 0:
            s = tl.full(shape, 1.0, tl.float32)
        else:
            s = tl.broadcast_to(tile_scales(s_ptr, t, rows, mask_r, out_cols, cols, N, GROUP_SIZE, BLOCK_K, 8), shape)
        acc = word_dot(words, p0, p1, p2, p3, s, acc, ASM)
        words = nxt
    return acc


@triton.jit
def paired_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    N,
    K,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BF16: tl.constexpr,
    ASM: tl.constexpr,
    SUB: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """Split-K GEMV on paired fp16 math (see the module docstring); grid ``(cdiv(N, BLOCK_N), splits)``.

    ``SUB`` (a power of two dividing ``BLOCK_N``, or 0 for none) lays the column tile out as ``BLOCK_N / SUB``
    sub-tiles of ``SUB`` columns, the word rows leading: Triton then gives each thread one word row of several
    sub-tiles, whose activation pairs it builds once per K tile, where the plain ``[ROWS, BLOCK_N]`` tile gives it
    several rows of one (fewer instructions and registers per weight).

    ``PDL`` (programmatic dependent launch): the program loads its first K tile's words while the kernel before it
    still runs, waits for that kernel before its first read of the activations or any write, and lets the next
    kernel launch once its main loop is done (at its start was slower, docs/kernels.md).
    """
    ONE_GROUP: tl.constexpr = GROUP_SIZE <= 0
    col0 = tl.program_id(0) * BLOCK_N
    if SUB > 0:
        out_cols = col0 + tl.arange(0, BLOCK_N // SUB)[:, None] * SUB + tl.arange(0, SUB)[None, :]
        cols = out_cols[None, :, :]
    else:
        out_cols = col0 + tl.arange(0, BLOCK_N)
        cols = out_cols[None, :]
    t_start, t_end = k_slice(K, BLOCK_K)
    ROWS: tl.constexpr = BLOCK_K // 8
    if PDL:  # the weights are no earlier kernel's output; the activations and the workspace may be
        words = load_words(w_ptr, t_start, t_end, tl.arange(0, ROWS), cols, N, K, ROWS, 8)
        gdc_wait()
    shift = 0
    if BF16:  # activations beyond fp16's range are scaled by 2**-shift, the result by 2**shift
        shift = range_shift(x_ptr, t_start * BLOCK_K, tl.minimum(t_end * BLOCK_K, K), RANGE_CHUNK)
    if not PDL:  # after the range read: the faster order (docs/kernels.md)
        words = load_words(w_ptr, t_start, t_end, tl.arange(0, ROWS), cols, N, K, ROWS, 8)
    args = (x_ptr, w_ptr, s_ptr, words, t_start, t_end, out_cols, cols, N, K)
    if BF16:
        if shift == 0:
            acc = _tiles(*args, shift, GROUP_SIZE, BLOCK_K, BF16, ASM, False)
        else:
            acc = _tiles(*args, shift, GROUP_SIZE, BLOCK_K, BF16, ASM, True)
        y = tl.sum(acc, axis=0) * OUT_SCALE * pow2(shift)
    else:
        y = tl.sum(_tiles(*args, 0, GROUP_SIZE, BLOCK_K, BF16, ASM, False), axis=0) * OUT_SCALE
    if PDL:  # the main loop is done: the next kernel may start taking the places of programs that finish
        gdc_launch_dependents()
    mask = out_cols < N
    if ONE_GROUP:
        y = y * tl.load(s_ptr + out_cols, mask=mask, other=0.0).to(tl.float32)
    if tl.num_programs(1) == 1:
        tl.store(y_ptr + out_cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + tl.program_id(1) * N + out_cols, y, mask=mask)
        flat = (col0 + tl.arange(0, BLOCK_N))[None, :]  # the column tile as one row, whatever its layout above
        finish_split_k(y_ptr, part_ptr, cnt_ptr, tl.arange(0, 1)[:, None], flat, 1, N, N, tl.program_id(0), 1.0)
