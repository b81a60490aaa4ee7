"""Triton kernels for the W4A16 GEMM on GPTQ v1 tensors (see ``reference.py`` for the layout).

Paths, chosen by ``matmul`` from the number of activation rows ``M``:

* ``M == 1`` with 4-bit codes and an fp16/bf16 activation, ``paired`` (``matmul_paired``, kernel in
  ``paired_gemv``): split-K GEMV on paired fp16 arithmetic, two weights per instruction; the rounding of each
  word's two 4-term sums to fp16 is its only departure from fp32 accumulation.
* ``M == 1`` otherwise (8-bit codes, fp32 activations), ``gemv``: CUDA-core GEMV with split-K. A program owns a
  ``BLOCK_N`` column tile and a run of K tiles; it loads each ``[BLOCK_K / p, BLOCK_N]`` tile of int32 words once
  (the next tile's load is issued before this tile's math) and takes the ``p`` values out of every word with masks
  (``_word_value``: one logic op and one FMA per value, exact), multiplies them by the activation into a 2-D fp32
  accumulator and applies the group scale once per word row.
* ``2 <= M <= 16``, ``wleft`` (``matmul_wleft``): ``Y^T = W x^T``, the weight tile the MMA's left operand and the
  16 activation rows its N side. Each program loops over a run of K tiles (splits as the GEMV's, so the fp32
  partials stay small against the weights); a word tile loaded with N along the fast axis expands, through
  16-bit magic numbers, straight into a ``[BLOCK_N, BLOCK_K]`` tile in K order. This is the structure of the
  NVFP4 decode kernel (``salaquant.kernels.nvfp4``), in fewer instructions per weight (4.0 against 5.0 in the
  sm_90 SASS of the main loop, read with ``benchmarks/sass_report.py``). Used for 4-bit codes, fp16/bf16
  activations and groups of 32, 64 or a multiple of 128 (or one group); other cases take ``flat``.
* ``flat`` (``matmul_flat`` with ``FLAT_DOT_CONFIG``): split-K where each program runs a short, fully unrolled
  run of K tiles, loads each word once, repeats it in registers into a ``[BLOCK_K, BLOCK_N]`` tile in natural K
  order and feeds ``tl.dot`` with a 16-row activation tile. ``matmul_flat`` also has a CUDA-core reduction for
  one row (``cuda_cores=True``), within a few percent of ``gemv`` at SALA shapes.
* ``16 < M < DEQUANT_MIN_M``, ``tiled``: output tiles ``[BLOCK_M, BLOCK_N]`` over the whole K, grouped launch
  order; each ``[BLOCK_K, BLOCK_N]`` weight tile is dequantized to the activation dtype and fed to one ``tl.dot``.
  Only where its output tiles, counted at 128 x 128, are at least as many as the GPU's SMs (``_tiled_fills``):
  each tile runs the whole K in one program, so with fewer tiles most SMs idle and the next path is faster.
* ``M >= DEQUANT_MIN_M``, or fewer tiles than SMs: the weight is dequantized once to the activation dtype
  (``dequantize``) and the product runs in ``torch.matmul``; at ``M >= DEQUANT_MIN_M`` the GEMM is compute-bound
  and the dequantization costs a few percent.

Split-K reduction (``paired``, ``gemv``, ``wleft``, ``flat``; ``split_k.py``): every program stores its fp32
partial tile into a workspace, then increments a per-column-tile counter; the program that completes the count
sums the partials in split order, writes the output in the activation dtype and resets the counter. One launch, no
atomics on data, and run-to-run identical results. Counters live in a per-(device, stream) buffer that every launch
leaves zeroed.

The ``gemv`` and ``tiled`` launch configurations are autotuned per shape on first use (a few hundred ms per
shape): run each shape once before capturing a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..counters import arrival_counters
from ..device import INTERPRET as _INTERPRET
from ..device import cuda_facts as _cuda_facts
from ..host import cdiv, next_power_of_2
from .paired_gemv import paired_gemv_kernel
from .reference import check_operands
from .split_k import k_slice, load_words, split_k_store, tile_scales

__all__ = [
    "DEQUANT_MIN_M",
    "FLAT_DOT_CONFIG",
    "WLEFT_TUNED",
    "dequantize",
    "matmul",
    "matmul_flat",
    "matmul_gemv",
    "matmul_paired",
    "matmul_tiled",
    "matmul_wleft",
]

DEQUANT_MIN_M = 1024
"""From this many activation rows on, ``matmul`` dequantizes the weight and calls ``torch.matmul``."""

FLAT_DOT_CONFIG = {"block_n": 64, "block_k": 128, "tiles": 2, "num_warps": 4, "cuda_cores": False, "expand": True}
"""``matmul_flat`` settings ``matmul`` uses for 2..16 rows: the fastest at every SALA shape in
``benchmarks/w4a16_sweep.py --m 16`` on an H200 (1.01-1.12x faster than the split-K kernel it replaced)."""

WLEFT_TUNED: dict[tuple[int, int, int], dict[str, int]] = {
    (9, 4096, 32768): {"split_k": 1, "ahead": 2},  # gate_up: 67.6 us at M=16 against 71.1 with the defaults
    (9, 4096, 12288): {"split_k": 2, "ahead": 2},  # lightning qkv: 29.0 against 32.1
    (9, 16384, 4096): {"ahead": 2},  # down: 39.7 against 39.9
}
"""``matmul_wleft`` settings ``matmul`` uses for 2..16 rows, keyed by ``(compute capability major, K, N)``: the
fastest of ``benchmarks/w4a16_sweep.py --m 16 --kinds wleft`` on an H200 (group 128, bf16) where they beat the
defaults (one K tile loaded ahead, splits from ``_split_count``), which every other case keeps (o_proj's best)."""

PAIRED_CONFIG = {"block_n": 256, "block_k": 64, "num_warps": 4}
"""``matmul_paired`` launch: within 0.1 us of the fastest of 20 launches x 3 split counts at every SALA shape (one
bf16 row, group 128) in ``benchmarks/w4a16_paired.py --sweep`` on an H200, with ``_PAIRED_MIN_TILES``."""
_PAIRED_MIN_TILES = 4  # o_proj (K = 4096): 16 splits of 4 tiles, 6.8 us, against 32 of 2

_DECODE_WAVES = 4  # split-K aims at this many programs per SM
_MIN_TILES_PER_SPLIT = 2  # and gives every program at least this many K tiles when it can
_CPU_SMS = 4  # stands in for the SM count under the interpreter
_MAGIC = 0x4B000000  # fp32 bits of 2**23 (see _word_value)


def _bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def _cfg(num_warps: int, num_stages: int, **meta: int) -> triton.Config:
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)


if _INTERPRET:
    _GEMV_CONFIGS = [_cfg(4, 1, BLOCK_N=128, BLOCK_K=64)]
    _TILED_CONFIGS = [_cfg(4, 1, BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, EXPAND=True)]
else:
    # The GEMV prefetches the next word tile by hand; num_stages plays no part there.
    _GEMV_CONFIGS = [
        _cfg(4, 1, BLOCK_N=128, BLOCK_K=128),
        _cfg(4, 1, BLOCK_N=64, BLOCK_K=256),
        _cfg(4, 1, BLOCK_N=256, BLOCK_K=64),
        _cfg(4, 1, BLOCK_N=128, BLOCK_K=64),
        _cfg(8, 1, BLOCK_N=256, BLOCK_K=128),
        _cfg(8, 1, BLOCK_N=128, BLOCK_K=256),
        _cfg(8, 1, BLOCK_N=512, BLOCK_K=64),
    ]
    _TILED_CONFIGS = [
        _cfg(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EXPAND=True),
        _cfg(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EXPAND=False),
        _cfg(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, EXPAND=True),
        _cfg(8, 2, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, EXPAND=True),
        _cfg(8, 3, BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, EXPAND=True),
        _cfg(4, 3, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, EXPAND=True),
        _cfg(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, EXPAND=False),
        _cfg(4, 3, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, EXPAND=True),
    ]


def _prune_tiled(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop tiles much taller than the activation (``M_BUCKET`` is M rounded up to a power of two)."""
    cap = max(32, named_args["M_BUCKET"])
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= cap]
    return kept or configs[:1]


# ----------------------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _word_value(words, hi, MAGIC, J: tl.constexpr, BITS: tl.constexpr):
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


# ----------------------------------------------------------------------------------------------------------------
# Kernels. Scale modes, fixed at compile time: GROUP_SIZE <= 0 means one group (scaled once at the end); a
# multiple of BLOCK_K means one scale row per K tile; otherwise one scale row per word row (GROUP_SIZE is a
# multiple of 32 / BITS, so the values of one word share a group).


@triton.jit
def _load_words_nk(w_ptr, t, t_end, offs_r, offs_n, N, K, ROWS: tl.constexpr):
    """Word tile ``t`` of 4-bit codes as ``[BLOCK_N, ROWS]`` (N along the fast axis; zeros outside the matrix or
    past ``t_end``)."""
    rows = t * ROWS + offs_r
    mask = (offs_n < N)[:, None] & (rows < tl.minimum(K // 8, t_end * ROWS))[None, :]
    # any code where masked: the activations past K are zero
    return tl.load(w_ptr + rows[None, :] * N + offs_n[:, None], mask=mask, other=0, eviction_policy="evict_first")


@triton.autotune(configs=_GEMV_CONFIGS, key=["N", "K", "BITS", "GROUP_SIZE"], do_bench=_bench)
@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    N,
    K,
    MAGIC,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PACK
    ONE_GROUP: tl.constexpr = GROUP_SIZE <= 0

    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, ROWS)
    t_start, t_end = k_slice(K, BLOCK_K)
    acc = tl.zeros((ROWS, BLOCK_N), tl.float32)
    words = load_words(w_ptr, t_start, t_end, offs_r, offs_n, N, K, ROWS, PACK)
    for t in range(t_start, t_end):
        # Issue the next tile's loads before this tile's math.
        nxt = load_words(w_ptr, t + 1, t_end, offs_r, offs_n, N, K, ROWS, PACK)
        rows = t * ROWS + offs_r
        mask_r = rows < K // PACK
        hi = words >> 16
        part = acc if ONE_GROUP else tl.zeros((ROWS, BLOCK_N), tl.float32)
        for j in tl.static_range(PACK):
            xj = tl.load(x_ptr + rows * PACK + j, mask=mask_r, other=0.0).to(tl.float32)
            part += xj[:, None] * _word_value(words, hi, MAGIC, j, BITS)
        if ONE_GROUP:
            acc = part
        else:
            acc += part * tile_scales(s_ptr, t, rows, mask_r, offs_n, mask_n, N, GROUP_SIZE, BLOCK_K, PACK)
        words = nxt
    y = tl.sum(acc, axis=0)
    if ONE_GROUP:
        y = y * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    split_k_store(y[None, :], y_ptr, part_ptr, cnt_ptr, tl.arange(0, 1), offs_n, 1, N, N)


@triton.autotune(
    configs=_TILED_CONFIGS,
    key=["M_BUCKET", "N", "K", "BITS", "GROUP_SIZE"],
    prune_configs_by={"early_config_prune": _prune_tiled},
    do_bench=_bench,
)
@triton.jit
def _tiled_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    MAGIC,
    M_BUCKET,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXPAND: tl.constexpr,
    GROUP_M: tl.constexpr = 8,
):
    """One ``tl.dot`` per K tile on the dequantized ``[BLOCK_K, BLOCK_N]`` weight tile in natural K order.

    The tile's word of K row ``k`` is word row ``k // PACK``: with ``EXPAND`` the packed ``[BLOCK_K / PACK,
    BLOCK_N]`` words are loaded once and each row repeated ``PACK`` times in registers; without it every K row
    loads its word (repeated addresses, fewer register shuffles, ``PACK`` times the shared-memory staging).
    """
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PACK
    ONE_GROUP: tl.constexpr = GROUP_SIZE <= 0
    TILE_SCALE: tl.constexpr = (not ONE_GROUP) and (GROUP_SIZE % BLOCK_K == 0)
    dtype = x_ptr.dtype.element_ty

    # Grouped launch order: GROUP_M row tiles sweep the column tiles together, so weight tiles stay in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_here
    pid_n = (pid % width) // rows_here

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows_m = offs_m.to(tl.int64)[:, None]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, ROWS)
    shifts = ((offs_k % PACK) * BITS)[:, None]
    if ONE_GROUP:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        a = tl.load(x_ptr + rows_m * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if EXPAND:
            rows = k0 // PACK + offs_r
            w_mask = (rows < K // PACK)[:, None] & mask_n[None, :]
            packed = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=w_mask, other=0)
            words = tl.reshape(tl.broadcast_to(packed[:, None, :], (ROWS, PACK, BLOCK_N)), (BLOCK_K, BLOCK_N))
        else:
            w_mask = mask_k[:, None] & mask_n[None, :]
            words = tl.load(w_ptr + (kk // PACK)[:, None] * N + offs_n[None, :], mask=w_mask, other=0)
        code = (words >> shifts) & ((1 << BITS) - 1)
        w = (code | MAGIC).to(tl.float32, bitcast=True) - (8388608.0 + (1 << (BITS - 1)))
        if TILE_SCALE:
            s = tl.load(s_ptr + (k0 // GROUP_SIZE) * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        elif not ONE_GROUP:
            s_mask = mask_k[:, None] & mask_n[None, :]
            s = tl.load(s_ptr + (kk // GROUP_SIZE)[:, None] * N + offs_n[None, :], mask=s_mask, other=0.0)
            s = s.to(tl.float32)
        acc = tl.dot(a, (w * s).to(dtype), acc, input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + rows_m * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _flat_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    MAGIC,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
    GEMV3D: tl.constexpr = False,
    EXPAND: tl.constexpr = False,
):
    """Split-K over short, fully unrolled runs of ``TILES`` K tiles: every load of a program is independent of its
    math, so all of them are in flight at once (the grid, not a loop, supplies the memory parallelism).

    The ``[BLOCK_K, BLOCK_N]`` weight tile is read in natural K order straight from the packed words (the
    ``PACK`` rows of one word load the same address, which the L1 serves once); ``BLOCK_M == 1`` reduces on the
    CUDA cores, larger ``BLOCK_M`` feeds ``tl.dot``. A scale row multiplies the tile sum when the tile lies in
    one group, else every weight.
    """
    PACK: tl.constexpr = 32 // BITS
    ONE_GROUP: tl.constexpr = GROUP_SIZE <= 0
    TILE_SCALE: tl.constexpr = (not ONE_GROUP) and (GROUP_SIZE % BLOCK_K == 0)
    ZERO: tl.constexpr = 1 << (BITS - 1)
    dtype = x_ptr.dtype.element_ty

    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    ROWS: tl.constexpr = BLOCK_K // PACK
    offs_r = tl.arange(0, ROWS)
    shifts = ((offs_k % PACK) * BITS)[:, None]
    k_first = tl.program_id(1) * (TILES * BLOCK_K)
    if BLOCK_M == 1:  # noqa: SIM108 (constexpr branches)
        acc = tl.zeros((BLOCK_N,), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in tl.static_range(TILES):
        kk = k_first + i * BLOCK_K + offs_k
        mask_k = kk < K
        # A tile past K (the last split may hold fewer tiles) loads nothing: zeros, never the scale row after the end.
        tile_live = (k_first + i * BLOCK_K + 0 * offs_n) < K  # as a vector: the interpreter masks only with tensors
        tile_group = (k_first + i * BLOCK_K) // GROUP_SIZE
        if GEMV3D:
            # CUDA-core path: each word loaded once, its PACK values taken out in place (_word_value) and summed
            # into a [ROWS, BLOCK_N] tile with the matching activations.
            rows = (k_first + i * BLOCK_K) // PACK + offs_r
            mask_r = rows < K // PACK
            words = tl.load(
                w_ptr + rows[:, None] * N + offs_n[None, :],
                mask=mask_r[:, None] & mask_n[None, :],
                other=0,
                eviction_policy="evict_first",
            )
            hi = words >> 16
            part2 = tl.zeros((ROWS, BLOCK_N), tl.float32)
            for j in tl.static_range(PACK):
                xj = tl.load(x_ptr + rows * PACK + j, mask=mask_r, other=0.0).to(tl.float32)
                part2 += xj[:, None] * _word_value(words, hi, MAGIC, j, BITS)
            if ONE_GROUP:
                acc += tl.sum(part2, axis=0)
            elif TILE_SCALE:
                s3 = tl.load(s_ptr + tile_group * N + offs_n, mask=mask_n & tile_live, other=0.0)
                acc += tl.sum(part2, axis=0) * s3.to(tl.float32)
            else:
                s_rows = s_ptr + (rows * PACK // GROUP_SIZE)[:, None] * N + offs_n[None, :]
                s2 = tl.load(s_rows, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
                acc += tl.sum(part2 * s2.to(tl.float32), axis=0)
        else:
            if EXPAND:
                rows = (k_first + i * BLOCK_K) // PACK + offs_r
                packed = tl.load(
                    w_ptr + rows[:, None] * N + offs_n[None, :],
                    mask=(rows < K // PACK)[:, None] & mask_n[None, :],
                    other=0,
                    eviction_policy="evict_first",
                )
                words = tl.reshape(tl.broadcast_to(packed[:, None, :], (ROWS, PACK, BLOCK_N)), (BLOCK_K, BLOCK_N))
            else:
                words = tl.load(
                    w_ptr + (kk // PACK)[:, None] * N + offs_n[None, :],
                    mask=mask_k[:, None] & mask_n[None, :],
                    other=ZERO,
                    eviction_policy="evict_first",
                )
            w = (((words >> shifts) & ((1 << BITS) - 1)) - ZERO).to(tl.float32)
            if TILE_SCALE:
                s = tl.load(s_ptr + tile_group * N + offs_n, mask=mask_n & tile_live, other=0.0)
                s = s.to(tl.float32)
            elif not ONE_GROUP:
                s_ptrs = s_ptr + (kk // GROUP_SIZE)[:, None] * N + offs_n[None, :]
                w = w * tl.load(s_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
            if BLOCK_M == 1:
                xk = tl.load(x_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
                part = tl.sum(w * xk[:, None], axis=0)
                if TILE_SCALE:
                    acc += part * s
                else:
                    acc += part
            else:
                a_ptrs = x_ptr + offs_m[:, None] * stride_xm + kk[None, :]
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                if TILE_SCALE:
                    part = tl.dot(a, w.to(dtype), input_precision=DOT_PRECISION)
                    acc += part * s[None, :]
                else:
                    acc = tl.dot(a, w.to(dtype), acc, input_precision=DOT_PRECISION)
    if ONE_GROUP:
        s1 = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if BLOCK_M == 1:  # noqa: SIM108 (constexpr branches)
            acc = acc * s1
        else:
            acc = acc * s1[None, :]
    if BLOCK_M == 1:
        split_k_store(acc[None, :], y_ptr, part_ptr, cnt_ptr, tl.arange(0, 1), offs_n, 1, N, N)
    else:
        split_k_store(acc, y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym)


@triton.jit
def _nibble_pair(w, J: tl.constexpr, FP16: tl.constexpr):
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


@triton.jit
def _wleft_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP16: tl.constexpr,
    AHEAD: tl.constexpr,
):
    """``matmul_wleft``: ``Y^T = W x^T`` for up to 16 activation rows, the weight tile the MMA's left operand.

    Grid ``(cdiv(N, BLOCK_N), splits)``; each program loops over its split's K tiles. A ``[BLOCK_N, BLOCK_K / 8]``
    word tile is loaded with N along the fast axis (coalesced), each word expanded into its eight codes in K order
    (``_nibble_pair``), so the ``[BLOCK_N, BLOCK_K]`` weight tile needs no transposition; the 16 activation rows
    are the MMA's N side. 4-bit codes, fp16/bf16 activations, one group or groups of a multiple of ``BLOCK_K``
    (one scale per column and K tile, applied to the tile's product). ``AHEAD`` (1 or 2): how many tiles' words
    are in flight while the current one is computed."""
    ONE_GROUP: tl.constexpr = GROUP_SIZE <= 0
    ROWS: tl.constexpr = BLOCK_K // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, 16)
    mask_m = offs_m < M
    offs_r = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    start, end = k_slice(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    words = _load_words_nk(w_ptr, start, end, offs_r, offs_n, N, K, ROWS)
    nxt = _load_words_nk(w_ptr, start + 1, end, offs_r, offs_n, N, K, ROWS) if AHEAD == 2 else words
    for t in range(start, end):
        # Issue the loads of the tile AHEAD tiles on before this tile's math, as the GEMV does.
        if AHEAD == 2:
            after = _load_words_nk(w_ptr, t + 2, end, offs_r, offs_n, N, K, ROWS)
        else:
            nxt = _load_words_nk(w_ptr, t + 1, end, offs_r, offs_n, N, K, ROWS)
            after = nxt
        # [BLOCK_N, ROWS, 2 (code j or j + 4), 2 (j // 2 % 2), 2 (j % 2)] flattens to K order 8 r + 4c + 2d + e
        t_codes = tl.join(
            tl.join(_nibble_pair(words, 0, FP16), _nibble_pair(words, 2, FP16)),
            tl.join(_nibble_pair(words, 1, FP16), _nibble_pair(words, 3, FP16)),
        )
        wt = tl.reshape(t_codes, (BLOCK_N, BLOCK_K))
        kk = t * BLOCK_K + offs_k
        xt = tl.load(
            x_ptr + offs_m[None, :] * stride_xm + kk[:, None], mask=(kk < K)[:, None] & mask_m[None, :], other=0.0
        )
        if ONE_GROUP:
            acc = tl.dot(wt, xt, acc)
        else:
            s = tl.load(s_ptr + (t * BLOCK_K // GROUP_SIZE) * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += tl.dot(wt, xt) * s[:, None]
        words = nxt
        nxt = after
    if ONE_GROUP:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    split_k_store(tl.trans(acc), y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym)


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    MAGIC,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out [K, N] = (code - zero) * scale`` in ``out``'s dtype."""
    PACK: tl.constexpr = 32 // BITS
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < K // PACK)[:, None] & (offs_n < N)[None, :]
    words = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0)
    if GROUP_SIZE <= 0:
        s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    else:
        s = tl.load(s_ptr + (rows * PACK // GROUP_SIZE)[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
        s = s.to(tl.float32)
    hi = words >> 16
    for j in tl.static_range(PACK):
        w = _word_value(words, hi, MAGIC, j, BITS) * s
        tl.store(out_ptr + (rows * PACK + j)[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Host side


def _tiled_fills(m: int, n: int, device: torch.device) -> bool:
    """Whether the tiled kernel has at least one 128 x 128 output tile per SM. On an H200 (132 SMs) at M = 128
    it has 256 on gate_up (4096 -> 32768) and runs it in 103 us against 164 for dequantize + ``torch.matmul``;
    96 on lightning qkv (70 against 65 us), 32 on down and o_proj (220 against 90, 49 against 24 us)."""
    return cdiv(m, 128) * cdiv(n, 128) >= _sm_count(device)


def _sm_count(device: torch.device) -> int:
    return _cuda_facts(device)[0] if device.type == "cuda" else _CPU_SMS


def _wleft_tuned(device: torch.device, k: int, n: int) -> dict[str, int]:
    """The ``WLEFT_TUNED`` settings of this GPU and shape; none (the defaults) elsewhere."""
    if device.type != "cuda" or _INTERPRET:
        return {}
    return WLEFT_TUNED.get((_cuda_facts(device)[1], k, n), {})


def _split_count(
    n_tiles: int, k_tiles: int, sms: int, split_k: int | None, min_tiles: int = _MIN_TILES_PER_SPLIT
) -> int:
    """Number of K splits with no empty split (the kernel recomputes the tiles per split from it); by default
    ``_DECODE_WAVES`` programs per SM where every split keeps at least ``min_tiles`` K tiles."""
    if split_k is None:
        split_k = min(k_tiles // min_tiles, cdiv(_DECODE_WAVES * sms, n_tiles))
    split_k = max(1, min(int(split_k), k_tiles))
    return cdiv(k_tiles, cdiv(k_tiles, split_k))


def _wleft_block_k(gs: int) -> int:
    """The weights-left kernel's default K tile for kernel group ``gs``: the group when it is 32 or 64, else 128."""
    return gs if gs in (32, 64) else 128


def _wleft_runs(dtype: torch.dtype, bits: int, gs: int, block_k: int) -> bool:
    """4-bit codes, fp16/bf16 activations, and one group or groups of a multiple of ``block_k``."""
    return bits == 4 and dtype in (torch.float16, torch.bfloat16) and (gs <= 0 or gs % block_k == 0)


def _wleft_takes(x: Tensor, bits: int, group_size: int, k: int) -> bool:
    """Whether ``matmul_wleft`` runs this case with its default K tile (groups of 32, 64 or a multiple of 128)."""
    gs = _kernel_group(group_size, k)
    return _wleft_runs(x.dtype, bits, gs, _wleft_block_k(gs))


def _kernel_group(group_size: int, k: int) -> int:
    """``GROUP_SIZE`` constexpr: ``-1`` when the whole K is one group (also ``group_size >= K``)."""
    return -1 if group_size >= k else group_size


def _prepare(x: Tensor, qweight: Tensor, scales: Tensor, bits: int, group_size: int):
    k, n, gs = check_operands(qweight, scales, bits, group_size)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, K={k}], got {list(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if x.device != qweight.device:
        raise ValueError(f"x is on {x.device} but qweight is on {qweight.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, qweight.contiguous(), scales.contiguous(), k, n, _kernel_group(gs, k)


def _output(out: Tensor | None, m: int, n: int, x: Tensor) -> Tensor:
    if out is None:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.device != x.device or out.stride(1) != 1:
        raise ValueError(f"out must be a row-major {x.dtype} tensor [{m}, {n}] on {x.device}")
    return out


def _dot_precision(x: Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _run(kernel, config: triton.Config | None, grid, *args, **meta) -> None:
    """Launch an autotuned ``kernel``, or its plain JIT function with the fixed ``config``."""
    if config is None:
        kernel[grid](*args, **meta)
    else:
        kernel.fn[grid](*args, **meta, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def _partials(x: Tensor, splits: int, m: int, n: int) -> Tensor:
    """fp32 split-K workspace ``[splits, M, N]`` (a placeholder when not split); NaN-filled off the GPU, so that a
    read of an unwritten partial shows up in the result."""
    part = torch.empty((splits, m, n) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
    if x.device.type != "cuda":
        part.fill_(float("nan"))
    return part


def _fixed_split_k(x: Tensor, m: int, n: int, k: int, block_n: int, block_k: int, split_k: int | None, min_tiles: int):
    """Grid ``(column tiles, splits)``, fp32 partials and counters of a split-K launch with fixed tiles."""
    n_tiles = cdiv(n, block_n)
    splits = _split_count(n_tiles, cdiv(k, block_k), _sm_count(x.device), split_k, min_tiles)
    return (n_tiles, splits), _partials(x, splits, m, n), arrival_counters(x.device, n_tiles)


def _split_k_run(kernel, config, x, qweight, scales, y, split_k, *args, **meta) -> None:
    """Launch a split-K kernel, with workspace and counters sized for the largest split any config picks."""
    m, n = y.shape
    k = x.shape[1]
    sms = _sm_count(x.device)
    configs = kernel.configs if config is None else [config]

    def splits(c: dict) -> int:
        return _split_count(cdiv(n, c["BLOCK_N"]), cdiv(k, c["BLOCK_K"]), sms, split_k)

    part = _partials(x, max(splits(c.kwargs) for c in configs), m, n)
    cnt = arrival_counters(x.device, max(cdiv(n, c.kwargs["BLOCK_N"]) for c in configs))
    grid = lambda meta: (cdiv(n, meta["BLOCK_N"]), splits(meta))  # noqa: E731
    _run(kernel, config, grid, x, qweight, scales, y, part, cnt, *args, **meta)


def matmul_gemv(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    out: Tensor | None = None,
    split_k: int | None = None,
    config: triton.Config | None = None,
) -> Tensor:
    """``x [1, K] @ W^T`` with the CUDA-core split-K GEMV.

    ``split_k`` overrides the split heuristic and ``config`` the autotuned launch configuration.
    """
    x, qweight, scales, k, n, gs = _prepare(x, qweight, scales, bits, group_size)
    if x.shape[0] != 1:
        raise ValueError(f"the GEMV takes one activation row, got {x.shape[0]}")
    y = _output(out, 1, n, x)
    _split_k_run(_gemv_kernel, config, x, qweight, scales, y, split_k, n, k, _MAGIC, BITS=bits, GROUP_SIZE=gs)
    return y


def _paired_takes(x: Tensor, bits: int) -> bool:
    """One fp16 or bf16 activation row and 4-bit codes: the cases ``matmul_paired`` runs."""
    return bits == 4 and x.dtype in (torch.float16, torch.bfloat16) and x.dim() == 2 and x.shape[0] == 1


def matmul_paired(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    out: Tensor | None = None,
    split_k: int | None = None,
    block_n: int = PAIRED_CONFIG["block_n"],
    block_k: int = PAIRED_CONFIG["block_k"],
    num_warps: int = PAIRED_CONFIG["num_warps"],
    emulate: bool = False,
) -> Tensor:
    """``x [1, K] @ W^T`` with the paired-fp16 GEMV (``paired_gemv``): 4-bit codes, an fp16 or bf16 activation
    whose magnitude fits fp16.

    ``split_k`` overrides the split heuristic (at least ``_PAIRED_MIN_TILES`` K tiles per split); ``emulate`` runs
    the interpreter's emulation of the paired operations on a GPU too, to check the PTX against it.
    """
    x, qweight, scales, k, n, gs = _prepare(x, qweight, scales, bits, group_size)
    if not _paired_takes(x, bits):
        raise ValueError(f"the paired GEMV takes one fp16/bf16 row and 4-bit codes, got {x.dtype} {list(x.shape)}")
    if block_k not in (16, 32, 64, 128, 256):
        raise ValueError(f"block_k must be 16, 32, 64, 128 or 256, got {block_k}")
    y = _output(out, 1, n, x)
    grid, part, cnt = _fixed_split_k(x, 1, n, k, block_n, block_k, split_k, _PAIRED_MIN_TILES)
    paired_gemv_kernel[grid](
        x,
        qweight,
        scales,
        y,
        part,
        cnt,
        n,
        k,
        GROUP_SIZE=gs,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BF16=x.dtype == torch.bfloat16,
        ASM=not (_INTERPRET or emulate),
        num_warps=num_warps,
        num_stages=1,
    )
    return y


def matmul_flat(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    out: Tensor | None = None,
    block_n: int = 128,
    block_k: int = 128,
    tiles: int = 2,
    num_warps: int = 4,
    cuda_cores: bool | None = None,
    expand: bool = False,
) -> Tensor:
    """``x [M <= 16, K] @ W^T`` with the flat split-K kernel: ``tiles`` K tiles per program, K split over the grid.

    ``cuda_cores`` (default: ``M == 1``) reduces on the CUDA cores; otherwise ``tl.dot`` on a 16-row activation
    tile, with ``expand`` loading each word once and repeating it in registers instead of once per K row.
    """
    x, qweight, scales, k, n, gs = _prepare(x, qweight, scales, bits, group_size)
    m = x.shape[0]
    if not 1 <= m <= 16:
        raise ValueError(f"the flat split-K kernel takes 1 to 16 activation rows, got {m}")
    pack = 32 // bits
    if block_k % pack or block_k < pack or (gs > 0 and gs % pack):
        raise ValueError(f"block_k={block_k} must be a multiple of {pack}")
    cuda_cores = (m == 1) if cuda_cores is None else cuda_cores
    if cuda_cores and m != 1:
        raise ValueError("the CUDA-core reduction takes one activation row")
    y = _output(out, m, n, x)
    n_tiles = cdiv(n, block_n)
    splits = cdiv(cdiv(k, block_k), tiles)
    part = _partials(x, splits, m, n)
    cnt = arrival_counters(x.device, n_tiles)
    _flat_kernel[(n_tiles, splits)](
        x,
        qweight,
        scales,
        y,
        part,
        cnt,
        m,
        n,
        k,
        x.stride(0),
        y.stride(0),
        _MAGIC,
        BITS=bits,
        GROUP_SIZE=gs,
        DOT_PRECISION=_dot_precision(x),
        BLOCK_M=1 if cuda_cores else 16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        TILES=tiles,
        GEMV3D=cuda_cores,
        EXPAND=expand,
        num_warps=num_warps,
        num_stages=1,
    )
    return y


def matmul_wleft(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    out: Tensor | None = None,
    block_n: int = 64,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    ahead: int = 1,
) -> Tensor:
    """``x [M <= 16, K] @ W^T`` with the weights as the MMA's left operand (``_wleft_kernel``), each program
    looping over a run of K tiles; splits as the GEMV's (``split_k`` overrides). 4-bit codes, fp16/bf16
    activations; ``block_k`` (a power of two, default 128 or the group size when that is 32 or 64) must divide
    the group size unless the whole K is one group. ``ahead`` (1 or 2) tiles of words load ahead of the math.
    """
    if ahead not in (1, 2):
        raise ValueError(f"ahead must be 1 or 2, got {ahead}")
    x, qweight, scales, k, n, gs = _prepare(x, qweight, scales, bits, group_size)
    m = x.shape[0]
    if not 1 <= m <= 16:
        raise ValueError(f"the weights-left kernel takes 1 to 16 activation rows, got {m}")
    if block_k is None:
        block_k = _wleft_block_k(gs)
    if not _wleft_runs(x.dtype, bits, gs, block_k):
        raise ValueError(
            f"the weights-left kernel takes 4-bit codes, fp16/bf16 activations and groups of a multiple of "
            f"block_k ({block_k}); got bits={bits}, {x.dtype}, group_size={gs}"
        )
    if block_n < 16 or block_n & (block_n - 1) or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"tiles must be powers of two of at least 16, got block_n={block_n}, block_k={block_k}")
    y = _output(out, m, n, x)
    grid, part, cnt = _fixed_split_k(x, m, n, k, block_n, block_k, split_k, _MIN_TILES_PER_SPLIT)
    _wleft_kernel[grid](
        x,
        qweight,
        scales,
        y,
        part,
        cnt,
        m,
        n,
        k,
        x.stride(0),
        y.stride(0),
        GROUP_SIZE=gs,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FP16=x.dtype == torch.float16,
        AHEAD=ahead,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y


def matmul_tiled(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    out: Tensor | None = None,
    config: triton.Config | None = None,
) -> Tensor:
    """``x [M, K] @ W^T`` with the tiled kernel (weight tiles dequantized to ``x.dtype``, ``tl.dot``)."""
    x, qweight, scales, k, n, gs = _prepare(x, qweight, scales, bits, group_size)
    m = x.shape[0]
    y = _output(out, m, n, x)
    if m == 0:
        return y
    bucket = min(next_power_of_2(m), 4096)
    grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _run(
        _tiled_kernel,
        config,
        grid,
        x,
        qweight,
        scales,
        y,
        m,
        n,
        k,
        x.stride(0),
        y.stride(0),
        _MAGIC,
        bucket,
        BITS=bits,
        GROUP_SIZE=gs,
        DOT_PRECISION=_dot_precision(x),
    )
    return y


def dequantize(
    qweight: Tensor, scales: Tensor, bits: int = 4, group_size: int = 128, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Weight ``[N, K]`` in ``dtype``: the transposed view of a row-major ``[K, N]`` buffer."""
    k, n, gs = check_operands(qweight, scales, bits, group_size)
    qweight, scales = qweight.contiguous(), scales.contiguous()
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    block_r, block_n = (16, 128) if _INTERPRET else (8, 256)
    grid = (cdiv(qweight.shape[0], block_r), cdiv(n, block_n))
    _dequant_kernel[grid](
        qweight,
        scales,
        out,
        n,
        k,
        _MAGIC,
        BITS=bits,
        GROUP_SIZE=_kernel_group(gs, k),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return out.t()


def matmul(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """``x [M, K] @ W^T`` on the path that suits ``M`` (see the module docstring)."""
    m = x.shape[0]
    if m == 1:
        if _paired_takes(x, bits):
            return matmul_paired(x, qweight, scales, bits, group_size, out=out)
        return matmul_gemv(x, qweight, scales, bits, group_size, out=out)
    if 1 < m <= 16:
        k = qweight.shape[0] * (32 // bits)
        if _wleft_takes(x, bits, group_size, k):
            tuned = _wleft_tuned(x.device, k, qweight.shape[1])
            return matmul_wleft(x, qweight, scales, bits, group_size, out=out, **tuned)
        return matmul_flat(x, qweight, scales, bits, group_size, out=out, **FLAT_DOT_CONFIG)
    if m < DEQUANT_MIN_M and _tiled_fills(m, qweight.shape[1], x.device):
        return matmul_tiled(x, qweight, scales, bits, group_size, out=out)
    x, qweight, scales, _, n, _ = _prepare(x, qweight, scales, bits, group_size)
    w = dequantize(qweight, scales, bits, group_size, dtype=x.dtype)
    return torch.matmul(x, w.t(), out=_output(out, m, n, x))
