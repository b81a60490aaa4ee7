"""The NVFP4 GPTQ column sweep with each 16-column block's FP8 scale searched in the same launch.

``salaquant.nvfp4.gptq`` with scales chosen during the sweep alternates, for every 16 columns, the block-scale
search (``salaquant.nvfp4.search``) on the columns as the earlier errors left them and the column sweep over those
16 columns: dozens of small launches per 16 columns, which left the GPU idle. Here one program owns ``BLOCK_R`` rows
of a whole block of columns in registers, as the plain sweep's kernel does, and on reaching each 16-column block
scores the candidate scales of its rows there before sweeping the block's columns with the best one.

The candidates are the search's: every FP8 (E4M3) value from the plain scale (``amax / (6 * weight_scale_2)``,
rounded) down to that of the smallest shrink factor, largest first (``FINE``, the search's fine mode), or the
rounded scale of each shrink factor in order; then every FP8 value above the plain scale up to ``max_grow`` times it,
smallest first. Each is scored by the importance-weighted squared error of the block's E2M1 rounding under it; a
later candidate must be strictly better. Every operation rounds as the PyTorch
path does (FP8 rounding from the exponent bits and round-half-even, correctly rounded divisions, no fused
multiply-add), so the two differ only in the order of the 16-term error sums: where two candidates' errors tie to
the last bits a row may keep the other one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..host import cdiv, next_power_of_2
from .block import ColumnBlock
from .triton_kernels import BLOCK_R, _e2m1, _round_half_even

__all__ = ["gptq_nvfp4_search_triton"]

SCALE_BLOCK = 16
"""Inputs per NVFP4 block scale."""


@triton.jit
def _e4m3_bits(x):
    """float8_e4m3fn bit pattern (int32) of non-negative fp32 ``x`` as ``round_block_scales`` rounds it: 0 becomes
    1.0, the value is clamped to [2**-9, 448] and rounded to the nearest E4M3 value, ties to even. Below 2**-6 the
    step is the subnormals' 2**-9; above, 2**(exponent - 3); ``(exponent + 7) * 8 + steps - 8`` is then the bit
    pattern, also where the rounding carries into the next binade."""
    x = tl.where(x == 0.0, 1.0, x)
    x = tl.minimum(tl.maximum(x, 0.001953125), 448.0)
    e = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3)
    q = _round_half_even(tl.math.div_rn(x, step))
    return (e + 7) * 8 + q.to(tl.int32) - 8


@triton.jit
def _e4m3_value(bits):
    """fp32 value of positive, finite E4M3 bit patterns (int32), the inverse of ``_e4m3_bits``."""
    e = tl.maximum((bits >> 3) - 7, -6)
    q = bits - (e + 7) * 8 + 8
    return q.to(tl.float32) * ((e + 124) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _keep_better(w, cand, valid, s2, in_block, imp, best_err, best):
    """Score candidate scale bits ``cand [BLOCK_R]`` by the importance-weighted squared error of the block's E2M1
    rounding under them; where ``valid`` and strictly better than ``best_err``, they replace ``best``."""
    step = _e4m3_value(cand) * s2
    _, value = _e2m1(tl.math.div_rn(w, step[:, None]))
    d = w - value * step[:, None]
    err = tl.sum(tl.where(in_block, d * d * imp[None, :], 0.0), axis=1)
    better = valid & (err < best_err)
    return tl.where(better, err, best_err), tl.where(better, cand, best)


@triton.jit
def _nvfp4_sweep_search_kernel(
    W,
    Q,
    E,
    SB,
    H,
    IMP,
    F,
    s2,
    max_grow,
    R,
    C,
    n_factors,
    stride_w,
    stride_q,
    stride_e,
    stride_sb,
    stride_h,
    FINE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < R
    cmask = cols < C
    tile = rmask[:, None] & cmask[None, :]
    w = tl.load(W + rows[:, None] * stride_w + cols[None, :], mask=tile, other=0.0)
    imp = tl.load(IMP + cols, mask=cmask, other=0.0)
    denom = 6.0 * s2
    q_tile = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    e_tile = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    sj = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
    for j in range(0, C):
        if j % 16 == 0:  # a new scale block: score its candidates on the columns as they are now
            in_block = rmask[:, None] & ((cols >= j) & (cols < j + 16))[None, :]
            raw = tl.math.div_rn(tl.max(tl.where(in_block, tl.abs(w), 0.0), axis=1), denom)
            hi = _e4m3_bits(raw)
            lo = hi
            n = n_factors
            if FINE:
                lo = _e4m3_bits(raw * tl.load(F + n_factors - 1))
                n = tl.max(tl.where(rmask, hi - lo, 0), axis=0) + 1
            best_err = tl.full([BLOCK_R], float("inf"), dtype=tl.float32)
            best = hi
            for t in range(0, n):
                if FINE:
                    valid = hi - t >= lo
                    cand = tl.where(valid, hi - t, hi)
                else:
                    valid = rows >= 0
                    cand = _e4m3_bits(raw * tl.load(F + t))
                best_err, best = _keep_better(w, cand, valid, s2, in_block, imp, best_err, best)
            top = _e4m3_bits(raw * max_grow)
            for t in range(1, tl.max(tl.where(rmask, top - hi, 0), axis=0) + 1):  # grown scales, smallest first
                valid = hi + t <= top
                best_err, best = _keep_better(w, tl.where(valid, hi + t, hi), valid, s2, in_block, imp, best_err, best)
            sj = _e4m3_value(best) * s2
            tl.store(SB + rows * stride_sb + j // 16, best.to(tl.uint8), mask=rmask)
        sel = cols[None, :] == j
        wj = tl.sum(tl.where(sel, w, 0.0), axis=1)
        code, value = _e2m1(tl.math.div_rn(wj, sj))
        e = tl.math.div_rn(wj - value * sj, tl.load(H + j * stride_h + j))
        hrow = tl.load(H + j * stride_h + cols, mask=(cols >= j) & cmask, other=0.0)
        w = w - e[:, None] * hrow[None, :]
        q_tile = tl.where(sel, code[:, None], q_tile)
        e_tile = tl.where(sel, e[:, None], e_tile)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], q_tile, mask=tile)
    tl.store(E + rows[:, None] * stride_e + cols[None, :], e_tile, mask=tile)
    tl.store(W + rows[:, None] * stride_w + cols[None, :], w, mask=tile)


def gptq_nvfp4_search_triton(
    block: ColumnBlock,
    scale_bits: torch.Tensor,
    weight_scale_2: torch.Tensor,
    importance: torch.Tensor,
    factors: torch.Tensor,
    fine: bool,
    max_grow: float = 1.0,
) -> None:
    """Sweep every column of the E2M1 ``block`` ``[R, C]`` (``C`` a multiple of 16), choosing each 16-column
    block's scale first: its bit pattern goes to ``scale_bits`` (uint8 ``[R, C / 16]``), the codes, errors and
    updated columns to ``block``. ``weight_scale_2`` is the fp32 global scale (0-d, positive), ``importance [C]``
    the fp32 weights of the error, ``factors`` the fp32 shrink factors (largest first; only the last is read when
    ``fine``), ``max_grow`` the largest grown scale as a multiple of the plain one (1: none)."""
    w1 = block.w1
    r, c = w1.shape
    if not block.e2m1 or w1.dtype != torch.float32 or c % SCALE_BLOCK:
        raise ValueError(
            f"expected an E2M1 float32 block of a multiple of {SCALE_BLOCK} columns, got {tuple(w1.shape)}"
        )
    if scale_bits.dtype != torch.uint8 or tuple(scale_bits.shape) != (r, c // SCALE_BLOCK):
        raise ValueError(f"scale_bits: expected uint8 {(r, c // SCALE_BLOCK)}, got {scale_bits.dtype} "
                         f"{tuple(scale_bits.shape)}")  # fmt: skip
    if tuple(importance.shape) != (c,) or importance.dtype != torch.float32 or factors.dtype != torch.float32:
        raise ValueError("importance must be float32 [C] and factors float32")
    if r == 0:
        return
    _nvfp4_sweep_search_kernel[(cdiv(r, BLOCK_R),)](
        w1,
        block.codes,
        block.err,
        scale_bits,
        block.hinv1,
        importance.contiguous(),
        factors.contiguous(),
        float(weight_scale_2),
        float(max_grow),
        r,
        c,
        factors.numel(),
        w1.stride(0),
        block.codes.stride(0),
        block.err.stride(0),
        scale_bits.stride(0),
        block.hinv1.stride(0),
        FINE=fine,
        BLOCK_R=BLOCK_R,
        BLOCK_C=max(16, next_power_of_2(c)),
        num_warps=4,
        enable_fp_fusion=False,
    )
