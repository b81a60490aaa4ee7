"""NVFP4 weight-only GEMV (one activation row) on paired fp16 arithmetic (``salaquant.kernels.paired_f16``).

The weight is read as int32 words along K (``[N, K/8]``, code ``i`` of a word in bits ``4 i .. 4 i + 3``, input
``8 w + i``); a 16-input block (one FP8 scale) is an even and an odd word. Codes ``i`` and ``i + 4`` sit 16 bits
apart, so shifts and masks move both into one fp16 pair at once: the three magnitude bits ``e1 e0 m`` to fp16 bits
9-11 (the low exponent bits and the top mantissa bit) and the sign to bit 15, which reads exactly as
``e2m1 * 2**-14`` (the code 0.5 as a subnormal). Eight paired multiply-adds against the activation pairs
``(x[8 w + i], x[8 w + i + 4])`` of both words give the block's two 8-term sums in one fp16 pair; its halves are
widened to fp32, added, and multiplied by the block scale in fp32 into the accumulator (one fused multiply-add
per block). The scale enters as its bits: an E4M3 byte's sign to bit 31 and its seven other bits to bits 20-26
read exactly as ``scale * 2**-120`` (subnormal scales as fp32 subnormals, exact), so decoding it takes integer
operations only; ``2**120``, ``2**14`` and the global scale are applied at the end: 42 instructions per block for
the math, the block scale applied once per 16 inputs in fp32 rather than to every weight pair.

Raw ``e2m1 * 2**-14`` codes make fp16 products of activations below 1 subnormal, so every program prescales its
activations: it reads its K slice's largest magnitude first and runs on the activations times ``2**-s``, the
power that brings that largest one into ``[2**14, 2**15)`` (``s`` may be negative: small activations are scaled
up), and multiplies its sum by ``2**s``. Then no 8-term sum can overflow (at most ``8 * 2**15 * 6 * 2**-14 = 96``)
and products stay normal down to activations ``2**-13`` times the slice's largest.

Layout: a program owns ``BLOCK_N`` output rows and a run of K tiles of ``BLOCK_B`` blocks; each thread holds
several rows of the same blocks, so that the activation pairs it builds serve all of them. ``PREFETCH`` requests
the next tile's words and scales before this one's math (more registers, so fewer programs per SM: worth it for
small tiles).

Numerics: the activation times ``2**-s`` is rounded to fp16 once (exact for bf16 and fp16 values between
``2**-14`` and ``2**15`` after scaling, so within ``2**-28`` of the slice's largest); each block's two 8-term sums
round to fp16 after every operation (relative ``2**-11`` of the running sum each); products below fp16's normal
range carry an absolute error of at most ``2**-25`` (in units of the scaled activations times ``2**-14``); all else
is fp32. A NaN scale byte (0x7F, 0xFF) gives NaN outputs, as the reference does; an infinite or NaN activation
gives non-finite outputs in its split.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..e2m1_pairs import E2M1_CODES_PTX, OUT_SHIFT, e2m1_pair
from ..paired_f16 import RANGE_CHUNK, dot_ptx, emulated_fma2, f16_pair_shifted, half, halves, max_exponent, pow2
from ..split_k import finish_split_k, k_slice

__all__ = ["nvfp4_paired_gemv_kernel", "scale_f32"]

_BLOCK_PTX = tl.constexpr(
    """{
.reg .b32 t, u, a0, a1, a2, a3, b0, b1, b2, b3, p;
.reg .b16 l16, h16;
.reg .f32 lf, hf;
"""
    + E2M1_CODES_PTX.format(w="$1", a="a")
    + E2M1_CODES_PTX.format(w="$2", a="b")
    + dot_ptx([f"{r}{i}" for r in "ab" for i in range(4)], [f"${i}" for i in range(3, 11)])
    + """fma.rn.f32 $0, lf, $11, $12;
}"""
)
_SCALE_BIAS = tl.constexpr(2.0**120)
"""``scale_f32`` gives ``scale * 2**-120``: the accumulated sum is multiplied by this at the end."""


@triton.jit
def _block_dot(w_even, w_odd, e0, e1, e2, e3, o0, o1, o2, o3, scale, acc, ASM: tl.constexpr):
    """``acc + scale * sum_i x[i] * e2m1_i * 2**-14`` (fp32) over the 16 codes of each block's two int32 words;
    ``e0..e3`` / ``o0..o3`` the fp16 activation pairs ``(x[i], x[i + 4])`` of the even / odd word, ``scale`` fp32."""
    if ASM:
        return tl.inline_asm_elementwise(
            _BLOCK_PTX,
            "=f,r,r,r,r,r,r,r,r,r,r,f,f",
            [w_even, w_odd, e0, e1, e2, e3, o0, o1, o2, o3, scale, acc],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        p = emulated_fma2(e2m1_pair(w_even, 0), e0, tl.zeros(w_even.shape, tl.int32))
        p = emulated_fma2(e2m1_pair(w_even, 1), e1, p)
        p = emulated_fma2(e2m1_pair(w_even, 2), e2, p)
        p = emulated_fma2(e2m1_pair(w_even, 3), e3, p)
        p = emulated_fma2(e2m1_pair(w_odd, 0), o0, p)
        p = emulated_fma2(e2m1_pair(w_odd, 1), o1, p)
        p = emulated_fma2(e2m1_pair(w_odd, 2), o2, p)
        p = emulated_fma2(e2m1_pair(w_odd, 3), o3, p)
        return tl.fma(half(p, False) + half(p, True), scale, acc)


@triton.jit
def scale_f32(s):
    """FP8 E4M3 bytes ``s`` (uint8) as fp32 ``scale * 2**-120``, exact (subnormal scales as fp32 subnormals);
    0x7F / 0xFF give NaN."""
    v = s.to(tl.int32)
    f = (((v & 0x7F) << 20) | ((v & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where((v & 0x7F) == 0x7F, float("nan"), f)


@triton.jit
def _x_pairs(
    x_ptr, blocks, mask, shift, shape: tl.constexpr, HALF: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr
):
    """The four fp16 activation pairs ``(x[8 w + i], x[8 w + i + 4]) * 2**-shift`` of word ``w = 2 * block + HALF``
    (``mask``: the blocks inside K, or None), broadcast over the rows to ``shape``."""
    xb = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + blocks * 8 + HALF * 4
    other = 0 if mask is not None else None
    v01 = f16_pair_shifted(tl.load(xb + 0, mask=mask, other=other), shift, BF16, ASM, True)
    v23 = f16_pair_shifted(tl.load(xb + 1, mask=mask, other=other), shift, BF16, ASM, True)
    v45 = f16_pair_shifted(tl.load(xb + 2, mask=mask, other=other), shift, BF16, ASM, True)
    v67 = f16_pair_shifted(tl.load(xb + 3, mask=mask, other=other), shift, BF16, ASM, True)
    return (
        tl.broadcast_to(halves(v01, v45, False)[None, :], shape),
        tl.broadcast_to(halves(v01, v45, True)[None, :], shape),
        tl.broadcast_to(halves(v23, v67, False)[None, :], shape),
        tl.broadcast_to(halves(v23, v67, True)[None, :], shape),
    )


@triton.jit
def _load_tile(w_ptr, s_ptr, offs_n, n_ok, kt, K, BLOCK_B: tl.constexpr, EVEN: tl.constexpr):
    """The words ``[BLOCK_N, 2 * BLOCK_B]`` and scale bytes ``[BLOCK_N, BLOCK_B]`` of K tile ``kt`` (zeros outside the
    matrix unless ``EVEN``)."""
    nb = K // 16
    blocks = kt * BLOCK_B + tl.arange(0, BLOCK_B)
    words = 2 * kt * BLOCK_B + tl.arange(0, 2 * BLOCK_B)
    w_ptrs = w_ptr + offs_n[:, None] * (K // 8) + words[None, :]
    s_ptrs = s_ptr + offs_n[:, None] * nb + blocks[None, :]
    if EVEN:
        return tl.load(w_ptrs), tl.load(s_ptrs)
    else:
        w = tl.load(w_ptrs, mask=n_ok[:, None] & (words < 2 * nb)[None, :], other=0)
        return w, tl.load(s_ptrs, mask=n_ok[:, None] & (blocks < nb)[None, :], other=0)


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
    PREFETCH: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid ``(cdiv(N, BLOCK_N), split_k)``, SPLIT when split_k > 1; K tiles of ``BLOCK_B`` 16-input blocks (two
    words each). ``w_ptr``: int32 words ``[N, K/8]``; ``s_ptr``: scale bytes ``[N, K/16]``. EVEN: the tiles divide N
    and K (no masks). PREFETCH: the next tile's loads are issued before this tile's math. PDL (programmatic dependent
    launch): the program waits for the kernel before it before reading the activations (with PREFETCH after
    loading its first tile), and lets the next kernel launch after its main loop."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_first, k_last = k_slice(K, BLOCK_B * 16)
    first = tl.minimum(k_first, k_last - 1)  # (an empty split, k_first >= k_last, loads the last tile, unused)
    if PREFETCH and PDL:  # the weights are no earlier kernel's output; the activations and the workspace may be
        w, s = _load_tile(w_ptr, s_ptr, offs_n, n_ok, first, K, BLOCK_B, EVEN)
    if PDL:
        gdc_wait()
    # the activations times 2**-shift: the slice's largest in [2**14, 2**15)
    top = max_exponent(x_ptr, k_first * BLOCK_B * 16, tl.minimum(k_last * BLOCK_B * 16, K), RANGE_CHUNK)
    shift = tl.minimum(tl.maximum(top - 14, -126), 114)
    offs_b = tl.arange(0, BLOCK_B)
    shape: tl.constexpr = (BLOCK_N, BLOCK_B)
    acc = tl.zeros(shape, tl.float32)
    if PREFETCH and not PDL:  # after the range read
        w, s = _load_tile(w_ptr, s_ptr, offs_n, n_ok, first, K, BLOCK_B, EVEN)
    for kt in range(k_first, k_last):
        if PREFETCH:  # the last iteration reloads its own tile rather than branch
            w_next, s_next = _load_tile(w_ptr, s_ptr, offs_n, n_ok, tl.minimum(kt + 1, k_last - 1), K, BLOCK_B, EVEN)
        else:
            w, s = _load_tile(w_ptr, s_ptr, offs_n, n_ok, kt, K, BLOCK_B, EVEN)
        blocks = kt * BLOCK_B + offs_b
        b_ok = None if EVEN else blocks < K // 16
        w_even, w_odd = tl.split(tl.reshape(w, (BLOCK_N, BLOCK_B, 2)))
        e0, e1, e2, e3 = _x_pairs(x_ptr, blocks, b_ok, shift, shape, 0, BF16, ASM)
        o0, o1, o2, o3 = _x_pairs(x_ptr, blocks, b_ok, shift, shape, 1, BF16, ASM)
        acc = _block_dot(w_even, w_odd, e0, e1, e2, e3, o0, o1, o2, o3, scale_f32(s), acc, ASM)
        if PREFETCH:
            w, s = w_next, s_next
    if PDL:  # the main loop is done: the next kernel may launch
        gdc_launch_dependents()
    y = tl.sum(acc, axis=1) * _SCALE_BIAS * pow2(shift)
    gscale = tl.load(gs_ptr) * OUT_SHIFT
    if SPLIT:
        tl.store(ws_ptr + pid_k * N + offs_n, y, mask=n_ok)
        finish_split_k(out_ptr, ws_ptr, cnt_ptr, 0, offs_n, 1, N, N, pid_n, gscale)
    else:
        tl.store(out_ptr + offs_n, (y * gscale).to(out_ptr.dtype.element_ty), mask=n_ok)
