"""4-bit weights (GPTQ int4 or NVFP4) for 1 to 64 activation rows on ``mma.sync`` tensor-core instructions fed
straight from registers.

Tensor cores take their operands in fixed per-lane fragments. Triton chooses where tensor elements live, so this
kernel keeps every tensor one element per thread (``[32 * WARPS]``) and asks each thread which it is
(``%tid.x``); each thread then loads exactly the words and activations its fragments need, and one inline-PTX
block per step dequantizes and multiplies. No shared memory and no layout conversion.

One ``mma.sync.m16n8k16`` multiplies a 16 x 16 weight tile (16 output columns by 16 K slots) by 16 K slots of 8
activation rows. Lane ``4 g + q`` of a warp holds, in its A registers, slots ``2q, 2q+1, 2q+8, 2q+9`` of
columns ``g`` and ``g + 8`` and, in its B registers, the same slots of activation row ``g``. The slots may stand
for any K indices as long as the A and B sides agree, so lane ``4 g + q`` takes word row ``w + q`` of the round
(four words of eight codes along K, 32 K values) and the two columns. Both formats' paired dequantizations
(``int4_pairs``, ``e2m1_pairs``) turn a word into the fp16 pairs ``(c_j, c_{j+4})`` for
``j = 0..3``, exactly the activation pairs ``(x[8 r + j], x[8 r + j + 4])`` of the one-row kernels, so slot pair
``(2q, 2q+1)`` of step ``s`` is ``(c_{2s}, c_{2s+4})`` and ``(2q+8, 2q+9)`` is ``(c_{2s+1}, c_{2s+5})``. Two steps
use a word's eight codes. The rows come in groups of 8 (``ROW_GROUPS``: 1, 2, 4 or 8 of them, up to 64 rows): the
words are dequantized once per round (``_dequant_block_ptx``) and each row group's pair of MMAs
(``_mma_pair_ptx``) takes the same A registers with its own activations and accumulators.

A warp owns ``16 * TILES`` columns. GPTQ (``[K / 8, N]`` words): each MMA accumulates one group's products (fp32,
C chained), which are then scaled by the group's column scales into the output accumulators. With bf16 activations
the MMA is the ``.bf16`` one: the codes enter as bf16 ``code - 8`` (masked into the mantissa of 128.0, then 136
subtracted; a shift per pair of codes) and the activations as they are, exactly, whatever their magnitude. With fp16
activations the codes enter as ``(code - 8) / 32``, exact in fp16. NVFP4 (``FP4``: ``[N, K / 8]`` words, FP8
scales per 16 inputs): the block scale multiplies each pair before the MMA (``e2m1 * scale * 2**-14``, exact
unless below fp16's normal range; the one-row kernel instead applies it once per block in fp32, which the MMA's
mixing of four words per step does not allow) and the global scale applies at the end. The next group's
(or 128 inputs') words are loaded while this one's are multiplied (2 tiles: 16 words per thread in flight).

Products and sums are fp32 in the tensor core. NVFP4 with bf16 activations rounds them to fp16: each program reads
its K slice's largest activation (over all rows) first and converts the activations times ``2**-e``, the smallest
power of two that brings them below 32768, scaling its sums back (``e = 0`` for activations in fp16's range, whose
conversion is then exact for magnitudes from 2**-14 on), so activations of any magnitude are safe. Split-K as the
other kernels (``split_k.py``).

Under the Triton interpreter the PTX does not run: each thread is the tensor element of its index and the MMA is
emulated on the same registers (``emulated_mma``: the fragments of the PTX ISA, gathered per warp and multiplied in
fp32), so the CPU tests check the fragment mapping, the loads and the split-K; a GPU test holds the PTX to the
emulation and both to the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .e2m1_pairs import E2M1_PAIRS_PTX, OUT_SHIFT, e2m1_pair, scale_pair
from .int4_pairs import OUT_SCALE, dequant_constants, emulated_pairs
from .paired_f16 import (
    RANGE_CHUNK,
    emulated_fma2,
    f16_pair_shifted,
    fp16_shift,
    half,
    halves,
    i32,
    max_exponent,
    pow2,
)
from .split_k import finish_split_k

__all__ = ["MAX_ROWS", "check_launch", "emulated_mma", "mma_rows_kernel", "row_groups"]

MAX_ROWS = 64
"""The most activation rows one launch takes (8 groups of 8)."""


def row_groups(m: int) -> int:
    """``ROW_GROUPS`` for ``m`` rows: the groups of 8 they fill, rounded up to a power of two (1, 2, 4 or 8)."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the mma kernel takes 1 to {MAX_ROWS} rows, got {m}")
    groups = 1
    while 8 * groups < m:
        groups *= 2
    return groups


def check_launch(tiles: int, num_warps: int) -> int:
    """``ValueError`` unless both are powers of two; returns the columns one program covers (``16 * tiles * warps``)."""
    for name, value in (("tiles", tiles), ("num_warps", num_warps)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    return 16 * tiles * num_warps


def _dequant_ptx(word: str, out: str, k: list[str]) -> str:
    """PTX turning int32 ``word`` into the fp16 pairs ``{out}0..3`` = ``((c_j - 8) / 32, (c_{j+4} - 8) / 32)``;
    ``k`` names the operands holding the low mask, the magic pair, the high mask and the two multiply-adds."""
    lomask, magic, himask, lomul, loadd, himul, hiadd = k
    return f"""shr.u32 q8, {word}, 8;
lop3.b32 {out}0, {word}, {lomask}, {magic}, 0xEA;
lop3.b32 {out}1, {word}, {himask}, {magic}, 0xEA;
lop3.b32 {out}2, q8, {lomask}, {magic}, 0xEA;
lop3.b32 {out}3, q8, {himask}, {magic}, 0xEA;
fma.rn.f16x2 {out}0, {out}0, {lomul}, {loadd};
fma.rn.f16x2 {out}1, {out}1, {himul}, {hiadd};
fma.rn.f16x2 {out}2, {out}2, {lomul}, {loadd};
fma.rn.f16x2 {out}3, {out}3, {himul}, {hiadd};
"""


def _dequant_bf16_ptx(word: str, out: str, k: list[str]) -> str:
    """PTX turning int32 ``word`` into the bf16 pairs ``{out}0..3`` = ``(c_j - 8, c_{j+4} - 8)`` (exact): each pair's
    two codes are shifted to bit 0 of their halves, masked into the mantissas of bf16 128.0 and 136 is subtracted
    (``k``: the mask, the magic pair, a pair of 1.0 and a pair of -136; operands 3 and 5-7 of the seven unused)."""
    mask, magic, _, one, minus136, _, _ = k
    lines = [f"lop3.b32 {out}0, {word}, {mask}, {magic}, 0xEA;"]
    for j in (1, 2, 3):
        lines += [f"shr.u32 q8, {word}, {4 * j};", f"lop3.b32 {out}{j}, q8, {mask}, {magic}, 0xEA;"]
    lines += [f"fma.rn.bf16x2 {out}{j}, {out}{j}, {one}, {minus136};" for j in range(4)]
    return "\n".join(lines) + "\n"


_A_REGS = ("g0", "g1", "g2", "g3", "h0", "h1", "h2", "h3")


def _dequant_block_ptx(fp4: bool, bf16: bool) -> str:
    """One dequantization: the words ``$8`` (column g) and ``$9`` (column g + 8) to the eight A fragment pairs
    ``$0..$7`` = ``g0..g3, h0..h3`` (``g_j``: pair ``j`` of column g's word), which every activation row group's MMAs
    then share. Operands after the words: the seven GPTQ dequantization constants or, with ``fp4``, the block scale
    pairs of columns g and g + 8. With ``bf16`` (GPTQ only) the codes become bf16 ``c - 8``. The outputs are
    written last, from registers of the block's own, so none can overwrite an input still unread."""
    k = [f"${10 + i}" for i in range(2 if fp4 else 7)]
    lines = ["{", ".reg .b32 q8, t, u, " + ", ".join(_A_REGS) + ";"]
    if fp4:
        lines.append(E2M1_PAIRS_PTX.format(w="$8", a="g", s=k[0]) + E2M1_PAIRS_PTX.format(w="$9", a="h", s=k[1]))
    elif bf16:
        lines.append(_dequant_bf16_ptx("$8", "g", k) + _dequant_bf16_ptx("$9", "h", k))
    else:
        lines.append(_dequant_ptx("$8", "g", k) + _dequant_ptx("$9", "h", k))
    lines += [f"mov.b32 ${i}, {r};" for i, r in enumerate(_A_REGS)]
    lines.append("}")
    return "\n".join(lines)


def _mma_pair_ptx(bf16: bool) -> str:
    """Two MMAs (a word row round's two K steps) for one group of 8 activation rows: outputs ``$0..$3`` (fp32 C
    fragment), then the A pairs ``$4..$11`` (``g0..g3, h0..h3`` of ``_dequant_block_ptx``), the activation pairs
    ``$12..$15`` and the accumulators ``$16..$19``. With ``bf16`` the ``.bf16`` MMA."""
    kind = "bf16" if bf16 else "f16"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    e = "{e0, e1, e2, e3}"
    lines = ["{", ".reg .f32 e<4>;"]
    lines += [f"mov.f32 e{i}, ${16 + i};" for i in range(4)]
    lines.append(f"{mma} {e}, {{$4, $8, $5, $9}}, {{$12, $13}}, {e};")
    lines.append(f"{mma} {e}, {{$6, $10, $7, $11}}, {{$14, $15}}, {e};")
    lines += [f"mov.f32 ${i}, e{i};" for i in range(4)]
    lines.append("}")
    return "\n".join(lines)


# the PTX blocks and their constraint strings: GPTQ's dequantization (fp16 or bf16 pairs), NVFP4's, the MMA pair
PTX_DEQUANT, PTX_DEQUANT_BF16 = (
    tl.constexpr(_dequant_block_ptx(False, False)),
    tl.constexpr(_dequant_block_ptx(False, True)),
)
PTX_DEQUANT_FP4 = tl.constexpr(_dequant_block_ptx(True, False))
CON_DEQUANT, CON_DEQUANT_FP4 = (
    tl.constexpr(",".join(["=r"] * 8 + ["r"] * 9)),
    tl.constexpr(",".join(["=r"] * 8 + ["r"] * 4)),
)
PTX_MMA, PTX_MMA_BF16 = tl.constexpr(_mma_pair_ptx(False)), tl.constexpr(_mma_pair_ptx(True))
CON_MMA = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 12 + ["f"] * 4))
_I32_8, _F32_4 = tl.constexpr((tl.int32,) * 8), tl.constexpr((tl.float32,) * 4)  # the blocks' output types
_BF16_MASK, _BF16_MAGIC = i32(0x000F000F), i32(0x43004300)  # codes at bit 0 of each half; a pair of bf16 128.0
_BF16_ONE, _BF16_MINUS136 = i32(0x3F803F80), i32(0xC308C308)  # pairs of bf16 1.0 and -136.0


@triton.jit
def _bf16_constants(shape: tl.constexpr):
    """The seven operands of ``_dequant_bf16_ptx``, in the order of the fp16 dequantization's (unused ones zero)."""
    zero = tl.zeros(shape, tl.int32)
    return (
        tl.full(shape, _BF16_MASK, tl.int32),
        tl.full(shape, _BF16_MAGIC, tl.int32),
        zero,
        tl.full(shape, _BF16_ONE, tl.int32),
        tl.full(shape, _BF16_MINUS136, tl.int32),
        zero,
        zero,
    )


@triton.jit
def _bf16_codes(words):
    """The interpreter's ``_dequant_bf16_ptx``: the bf16 pairs ``(c_j - 8, c_{j+4} - 8)`` of each word (int32)."""
    u = words.to(tl.uint32, bitcast=True)
    out = ()
    for j in tl.static_range(4):
        lo = (((u >> (4 * j)) & 0xF).to(tl.int32) - 8).to(tl.float32).to(tl.int32, bitcast=True)
        hi = (((u >> (4 * j + 16)) & 0xF).to(tl.int32) - 8).to(tl.float32).to(tl.int32, bitcast=True)
        out = out + (((lo >> 16) & 0xFFFF) | (hi & -65536),)  # noqa: RUF005 (exact: small integers)
    return out


@triton.jit
def _thread_index(WARPS: tl.constexpr, ASM: tl.constexpr):
    """Each element's thread (``%tid.x``) on a GPU; under the interpreter element ``i`` stands for thread ``i``."""
    i = tl.arange(0, 32 * WARPS)
    if ASM:
        return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [i], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return i


@triton.jit
def _by_lane(v, WARPS: tl.constexpr):
    """fp32 ``[32 * WARPS]`` per-thread values as ``[WARPS, 8 (g), 4 (q)]``, lane ``4 g + q``."""
    return tl.reshape(v, (WARPS, 8, 4))


@triton.jit
def _halves32(v, WARPS: tl.constexpr, BF16: tl.constexpr):
    """The two 16-bit halves of int32 ``v`` (fp16, or bf16 with ``BF16``) as fp32, by lane."""
    if BF16:
        lo = (v << 16).to(tl.float32, bitcast=True)
        hi = (v & -65536).to(tl.float32, bitcast=True)
        return _by_lane(lo, WARPS), _by_lane(hi, WARPS)
    else:
        return _by_lane(half(v, False), WARPS), _by_lane(half(v, True), WARPS)


@triton.jit
def _pick(tile, PAIR: tl.constexpr, WARPS: tl.constexpr):
    """From ``tile [WARPS, 8 (row g), 8 (column n)]``, each lane's ``n = 2 q + PAIR`` entry of its row, per thread."""
    n = tl.arange(0, 8)
    q = tl.arange(0, 4)
    take = n[None, :] == 2 * q[:, None] + PAIR  # [4 (q), 8 (n)]
    picked = tl.sum(tl.where(take[None, None, :, :], tile[:, :, None, :], 0.0), axis=3)  # [WARPS, 8, 4]
    return tl.reshape(picked, (32 * WARPS,))


@triton.jit
def emulated_mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, WARPS: tl.constexpr, BF16: tl.constexpr = False):
    """``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` on per-thread registers (element ``i`` of each
    ``[32 * WARPS]`` tensor is thread ``i``): fp16 pairs ``a0..a3`` and ``b0, b1`` as int32, fp32 ``c0..c3``.

    Fragments (PTX ISA), lane ``4 g + q``: ``a0`` = A[g][2q, 2q+1], ``a1`` = A[g+8][2q, 2q+1], ``a2`` =
    A[g][2q+8, 2q+9], ``a3`` = A[g+8][2q+8, 2q+9]; ``b0`` = B[2q, 2q+1][g], ``b1`` = B[2q+8, 2q+9][g]; ``c0, c1`` =
    C[g][2q, 2q+1], ``c2, c3`` = C[g+8][2q, 2q+1]. Returns ``d0..d3`` = (A B + C) in the C fragment (fp32). ``BF16``:
    the ``.bf16`` form (bf16 pairs)."""
    a0l, a0h = _halves32(a0, WARPS, BF16)
    a1l, a1h = _halves32(a1, WARPS, BF16)
    a2l, a2h = _halves32(a2, WARPS, BF16)
    a3l, a3h = _halves32(a3, WARPS, BF16)
    b0l, b0h = _halves32(b0, WARPS, BF16)
    b1l, b1h = _halves32(b1, WARPS, BF16)
    # D[r][n] = sum over lanes q of the four slots lane (r, q) holds of A times those lane (n, q) holds of B
    top = tl.sum(
        a0l[:, :, None, :] * b0l[:, None, :, :]
        + a0h[:, :, None, :] * b0h[:, None, :, :]
        + a2l[:, :, None, :] * b1l[:, None, :, :]
        + a2h[:, :, None, :] * b1h[:, None, :, :],
        axis=3,
    )  # [WARPS, 8 (row g), 8 (column n)]
    bottom = tl.sum(
        a1l[:, :, None, :] * b0l[:, None, :, :]
        + a1h[:, :, None, :] * b0h[:, None, :, :]
        + a3l[:, :, None, :] * b1l[:, None, :, :]
        + a3h[:, :, None, :] * b1h[:, None, :, :],
        axis=3,
    )  # rows g + 8
    return (
        c0 + _pick(top, 0, WARPS),
        c1 + _pick(top, 1, WARPS),
        c2 + _pick(bottom, 0, WARPS),
        c3 + _pick(bottom, 1, WARPS),
    )


@triton.jit
def _fp4_pairs(words, scale):
    """The interpreter's NVFP4 dequantization: the pairs ``(c_i, c_{i+4})`` as ``e2m1 * 2**-14`` times ``scale``."""
    zero = tl.zeros(words.shape, tl.int32)
    return (
        emulated_fma2(e2m1_pair(words, 0), scale, zero),
        emulated_fma2(e2m1_pair(words, 1), scale, zero),
        emulated_fma2(e2m1_pair(words, 2), scale, zero),
        emulated_fma2(e2m1_pair(words, 3), scale, zero),
    )


@triton.jit
def _dequant(wg, wh, sg, sh, FP4: tl.constexpr, MMA_BF16: tl.constexpr, ASM: tl.constexpr):
    """The A fragment pairs ``g0..g3, h0..h3`` of the words ``wg`` and ``wh`` (columns g and g + 8; NVFP4 block
    scale pairs ``sg``, ``sh``), as ``_dequant_block_ptx`` computes them."""
    if ASM:
        if FP4:
            return tl.inline_asm_elementwise(PTX_DEQUANT_FP4, CON_DEQUANT_FP4, (wg, wh, sg, sh), _I32_8, True, 1)
        elif MMA_BF16:
            consts = _bf16_constants(wg.shape)
            return tl.inline_asm_elementwise(PTX_DEQUANT_BF16, CON_DEQUANT, (wg, wh) + consts, _I32_8, True, 1)  # noqa: RUF005
        else:
            consts = dequant_constants(wg.shape)
            return tl.inline_asm_elementwise(PTX_DEQUANT, CON_DEQUANT, (wg, wh) + consts, _I32_8, True, 1)  # noqa: RUF005
    else:
        if FP4:
            return _fp4_pairs(wg, sg) + _fp4_pairs(wh, sh)
        elif MMA_BF16:
            return _bf16_codes(wg) + _bf16_codes(wh)
        else:
            return emulated_pairs(wg) + emulated_pairs(wh)


@triton.jit
def _mma_pair(a, p, acc, MMA_BF16: tl.constexpr, WARPS: tl.constexpr, ASM: tl.constexpr):
    """``acc`` (the 4 fp32 of one 8-row group's C fragment) plus the products of the A pairs ``a`` (``_dequant``)
    with the activation pairs ``p`` of that row group (``_pairs``): a round's two MMAs."""
    if ASM:
        ptx: tl.constexpr = PTX_MMA_BF16 if MMA_BF16 else PTX_MMA
        return tl.inline_asm_elementwise(ptx, CON_MMA, a + p + acc, _F32_4, True, 1)
    else:
        d = emulated_mma(a[0], a[4], a[1], a[5], p[0], p[1], acc[0], acc[1], acc[2], acc[3], WARPS, MMA_BF16)
        return emulated_mma(a[2], a[6], a[3], a[7], p[2], p[3], d[0], d[1], d[2], d[3], WARPS, MMA_BF16)


@triton.jit
def _pairs(
    x_ptr, row, wrow, M, stride_xm, shift, BF16: tl.constexpr, RAW: tl.constexpr, ASM: tl.constexpr,
    SCALED: tl.constexpr,
):  # fmt: skip
    """The pairs ``(x[8 w + j], x[8 w + j + 4])``, ``j = 0..3``, of activation row ``row`` at word row ``wrow`` (per
    thread; zeros for rows past ``M``): fp16 (times ``2**-shift`` when ``SCALED``), or with ``RAW`` in the
    activations' own 16-bit type."""
    ok = row < M
    xb = (x_ptr + row.to(tl.int64) * stride_xm).to(tl.pointer_type(tl.int32), bitcast=True) + wrow * 4
    # the word row's eight activations as one 16-byte load per thread ([threads, 4] int32, a row per thread)
    v = tl.load(xb[:, None] + tl.arange(0, 4)[None, :], mask=ok[:, None], other=0)
    even, odd = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))  # int32 pairs 0 and 2, 1 and 3
    v01, v45 = tl.split(even)
    v23, v67 = tl.split(odd)
    if not RAW:
        v01, v23 = f16_pair_shifted(v01, shift, BF16, ASM, SCALED), f16_pair_shifted(v23, shift, BF16, ASM, SCALED)
        v45, v67 = f16_pair_shifted(v45, shift, BF16, ASM, SCALED), f16_pair_shifted(v67, shift, BF16, ASM, SCALED)
    return halves(v01, v45, False), halves(v01, v45, True), halves(v23, v67, False), halves(v23, v67, True)


@triton.jit
def _zeros(n: tl.constexpr, WARPS: tl.constexpr):
    z = ()
    for _ in tl.static_range(n):
        z = z + (tl.zeros((32 * WARPS,), tl.float32),)  # noqa: RUF005 (Triton has no tuple unpacking)
    return z


@triton.jit
def _load_group(
    w_ptr, s_ptr, grp, q, col, N, K, ROUNDS: tl.constexpr, TILES: tl.constexpr, FP4: tl.constexpr, row_end,
):  # fmt: skip
    """Group ``grp``'s words of this thread: for each round ``r`` and tile ``t``, word row ``4 (ROUNDS grp + r) + q``
    at columns ``col + 16 t`` and ``col + 16 t + 8`` (zeros from word row ``row_end`` on or past ``N``), and with
    ``FP4`` the scale bytes of their 16-input blocks after them (words ``[N, K / 8]``, bytes ``[N, K / 16]``; GPTQ
    words are ``[K / 8, N]``)."""
    words = ()
    scales = ()
    for r in tl.static_range(ROUNDS):
        wrow = (grp * ROUNDS + r) * 4 + q
        for t in tl.static_range(TILES):
            c = col + 16 * t
            ok_g = (c < N) & (wrow < row_end)
            ok_h = (c + 8 < N) & (wrow < row_end)
            if FP4:
                at_g = w_ptr + c.to(tl.int64) * (K // 8) + wrow
                s_g = s_ptr + c.to(tl.int64) * (K // 16) + wrow // 2
                words = words + (  # noqa: RUF005
                    tl.load(at_g, mask=ok_g, other=0),
                    tl.load(at_g + 8 * (K // 8), mask=ok_h, other=0),
                )
                scales = scales + (  # noqa: RUF005
                    tl.load(s_g, mask=ok_g, other=0),
                    tl.load(s_g + 8 * (K // 16), mask=ok_h, other=0),
                )
            else:
                at_g = w_ptr + wrow.to(tl.int64) * N + c
                words = words + (  # noqa: RUF005
                    tl.load(at_g, mask=ok_g, other=0),
                    tl.load(at_g + 8, mask=ok_h, other=0),
                )
    return words + scales


@triton.jit
def mma_rows_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    GROUP_SIZE: tl.constexpr,
    TILES: tl.constexpr,
    WARPS: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
    FP4: tl.constexpr,
    BF16: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``y [M <= 8 ROW_GROUPS, N] = x @ W^T`` for 4-bit GPTQ words or, with ``FP4``, NVFP4 words (see the module
    docstring); grid ``(cdiv(N, 16 * TILES * WARPS), splits)``, splits over whole groups. GPTQ: ``GROUP_SIZE`` a
    multiple of 32 (or -1: one group, K a multiple of 128). NVFP4: ``GROUP_SIZE`` 128 (the unit of the loop; K a
    multiple of it), ``s_ptr`` the scale bytes, ``gs_ptr`` the global scale. ``ROW_GROUPS``: groups of 8 rows (a
    power of two up to 8). With ``PDL`` (programmatic dependent launch) the program loads its first group's words
    while the kernel before it still runs, waits for that kernel before reading the activations or writing anything,
    and lets the next kernel launch after its main loop."""
    ONE_GROUP: tl.constexpr = GROUP_SIZE <= 0
    GS: tl.constexpr = 128 if ONE_GROUP else GROUP_SIZE
    ROUNDS: tl.constexpr = GS // 32  # rounds of four word rows per group
    NACC: tl.constexpr = 4 * ROW_GROUPS
    MMA_BF16: tl.constexpr = BF16 and not FP4  # GPTQ with bf16 activations: bf16 MMA, codes as c - 8
    NW: tl.constexpr = 2 * TILES * ROUNDS  # words per thread and group (the scale bytes follow them with FP4)
    BLOCK_N: tl.constexpr = 16 * TILES * WARPS
    tid = _thread_index(WARPS, ASM)
    lane = tid % 32
    g = lane // 4
    q = lane % 4
    col = tl.program_id(0) * BLOCK_N + (tid // 32) * (16 * TILES) + g  # this thread's column of tile 0
    n_groups = K // GS
    per = tl.cdiv(n_groups, tl.num_programs(1))
    g_start = tl.program_id(1) * per
    g_end = tl.minimum(g_start + per, n_groups)

    row_end = g_end * ROUNDS * 4  # this split's last word row + 1
    if PDL:  # the weights are no earlier kernel's output; the activations and the workspace may be
        loaded = _load_group(w_ptr, s_ptr, g_start, q, col, N, K, ROUNDS, TILES, FP4, row_end)
        gdc_wait()

    SCALED: tl.constexpr = FP4 and BF16  # bf16 rounded to fp16: scaled into its range first
    shift = 0
    if SCALED:  # the smallest 2**shift that brings the split's activations (all rows) below 32768
        top = max_exponent(x_ptr, g_start * GS, g_end * GS, RANGE_CHUNK)
        for m in range(1, M):
            top = tl.maximum(top, max_exponent(x_ptr + m * stride_xm, g_start * GS, g_end * GS, RANGE_CHUNK))
        shift = fp16_shift(top)

    acc = _zeros(NACC * TILES, WARPS)
    if not PDL:  # after the range read
        loaded = _load_group(w_ptr, s_ptr, g_start, q, col, N, K, ROUNDS, TILES, FP4, row_end)
    for grp in range(g_start, g_end):
        # the next group's words are loaded before this group's math: ROUNDS * 2 * TILES words per thread in flight
        nxt = _load_group(w_ptr, s_ptr, grp + 1, q, col, N, K, ROUNDS, TILES, FP4, row_end)
        if FP4:  # noqa: SIM108 (a constexpr branch): scaled per block before the MMA, so straight into acc
            part = acc
        else:
            part = _zeros(NACC * TILES, WARPS)
        for r in tl.static_range(ROUNDS):
            wrow = (grp * ROUNDS + r) * 4 + q
            xs = ()  # the activation pairs of rows g, g + 8, ...: four per row group
            for j in tl.static_range(ROW_GROUPS):
                xs = xs + _pairs(x_ptr, g + 8 * j, wrow, M, stride_xm, shift, BF16, MMA_BF16, ASM, SCALED)
            new = ()
            for t in tl.static_range(TILES):
                wg = loaded[2 * (TILES * r + t)]
                wh = loaded[2 * (TILES * r + t) + 1]
                if FP4:
                    sg = scale_pair(loaded[NW + 2 * (TILES * r + t)], ASM)
                    sh = scale_pair(loaded[NW + 2 * (TILES * r + t) + 1], ASM)
                else:  # unused
                    sg = wg
                    sh = wh
                a = _dequant(wg, wh, sg, sh, FP4, MMA_BF16, ASM)
                for j in tl.static_range(ROW_GROUPS):
                    p = (xs[4 * j], xs[4 * j + 1], xs[4 * j + 2], xs[4 * j + 3])
                    sub = (part[NACC * t + 4 * j], part[NACC * t + 4 * j + 1], part[NACC * t + 4 * j + 2],
                           part[NACC * t + 4 * j + 3])  # fmt: skip
                    new = new + _mma_pair(a, p, sub, MMA_BF16, WARPS, ASM)
            part = new
        loaded = nxt
        if FP4:
            acc = part
        else:
            # this group's products, scaled per column: accumulators i with i % 4 < 2 are column g, the rest g + 8
            scaled = ()
            for t in tl.static_range(TILES):
                c = col + 16 * t
                if ONE_GROUP:
                    s_g = tl.full(c.shape, 1.0, tl.float32)
                    s_h = s_g
                else:
                    s_g = tl.load(s_ptr + grp * N + c, mask=c < N, other=0.0).to(tl.float32)
                    s_h = tl.load(s_ptr + grp * N + c + 8, mask=c + 8 < N, other=0.0).to(tl.float32)
                for i in tl.static_range(NACC):
                    if (i % 4) < 2:
                        scaled = scaled + (acc[NACC * t + i] + part[NACC * t + i] * s_g,)  # noqa: RUF005
                    else:
                        scaled = scaled + (acc[NACC * t + i] + part[NACC * t + i] * s_h,)  # noqa: RUF005
            acc = scaled

    if PDL:  # the main loop is done: the next kernel may launch
        gdc_launch_dependents()
    # accumulator i of tile t: row 8 (i // 4) + 2 q + i % 2 (row group i // 4), column col + 16 t + 8 ((i % 4) // 2)
    n_split = tl.num_programs(1)
    if SCALED:
        out_scale = tl.load(gs_ptr) * OUT_SHIFT * pow2(shift)
    elif FP4:
        out_scale = tl.load(gs_ptr) * OUT_SHIFT
    elif MMA_BF16:
        out_scale = 1.0
    else:
        out_scale = OUT_SCALE
    for t in tl.static_range(TILES):
        for i in tl.static_range(NACC):
            row = 8 * (i // 4) + 2 * q + (i % 2)
            c = col + 16 * t + 8 * ((i % 4) // 2)
            v = acc[NACC * t + i] * out_scale
            if ONE_GROUP and not FP4:
                v = v * tl.load(s_ptr + c, mask=c < N, other=0.0).to(tl.float32)
            ok = (row < M) & (c < N)
            if n_split == 1:
                tl.store(y_ptr + row * stride_ym + c, v.to(y_ptr.dtype.element_ty), mask=ok)
            else:
                tl.store(part_ptr + (tl.program_id(1) * M + row) * N + c, v, mask=ok)
    if n_split > 1:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, 8 * ROW_GROUPS)[:, None]
        finish_split_k(y_ptr, part_ptr, cnt_ptr, rows, offs_n[None, :], M, N, stride_ym, tl.program_id(0), 1.0)
