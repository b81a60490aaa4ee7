"""Triton kernels of the GPTQ column sweep (on the integer grid or NVFP4's E2M1 grid) and of the clipped-scale
search (see ``reference.py`` for the definitions).

One program owns ``BLOCK_R`` rows of the block and keeps their ``[BLOCK_R, BLOCK_C]`` weights, codes and errors
in registers while it walks the columns in order, so a block costs one launch instead of several per column.
Every operation rounds as the PyTorch reference does: correctly rounded divisions, round half to even built
from ``floor``, and no fused multiply-add (the launcher disables fp fusion), so both agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..host import cdiv, next_power_of_2
from .block import ColumnBlock

BLOCK_R = 16


@triton.jit
def _round_half_even(x):
    r = tl.floor(x)
    frac = x - r  # exact: r and x share the binade or r is 0
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _e2m1(x):
    """E2M1 code (``sign << 3 | index``) and value of ``x``: the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 in
    magnitude, ties to the even index, saturating at 6 (``numerics.e2m1_codes``); a negative ``x`` keeps its sign
    even when it rounds to zero."""
    m = tl.abs(x)
    idx = (
        (m > 0.25).to(tl.int32)
        + (m >= 0.75).to(tl.int32)
        + (m > 1.25).to(tl.int32)
        + (m >= 1.75).to(tl.int32)
        + (m > 2.5).to(tl.int32)
        + (m >= 3.5).to(tl.int32)
        + (m > 5.0).to(tl.int32)
    )
    value = tl.where(idx < 4, idx.to(tl.float32) * 0.5, tl.where(idx == 4, 2.0, tl.where(idx == 5, 3.0, 4.0)))
    value = tl.where(idx == 7, 6.0, value)
    negative = x < 0.0
    return tl.where(negative, idx + 8, idx), tl.where(negative, -value, value)


@triton.jit
def _gptq_columns_kernel(
    W,
    Q,
    E,
    S,
    H,
    R,
    C,
    start,
    stop,
    stride_w,
    stride_q,
    stride_e,
    stride_s,
    stride_h,
    zero,
    maxq,
    PER_COLUMN: tl.constexpr,
    E2M1: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < R
    tile = rmask[:, None] & (cols < C)[None, :]
    w = tl.load(W + rows[:, None] * stride_w + cols[None, :], mask=tile, other=0.0)
    if PER_COLUMN:
        s_tile = tl.load(S + rows[:, None] * stride_s + cols[None, :], mask=tile, other=1.0)
    else:
        s_row = tl.load(S + rows, mask=rmask, other=1.0)
    q_tile = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    e_tile = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for j in range(start, stop):
        sel = cols[None, :] == j
        wj = tl.sum(tl.where(sel, w, 0.0), axis=1)
        if PER_COLUMN:  # noqa: SIM108 (constexpr branch: s_tile exists only here)
            sj = tl.sum(tl.where(sel, s_tile, 0.0), axis=1)
        else:
            sj = s_row
        d = tl.load(H + j * stride_h + j)
        if E2M1:
            code, value = _e2m1(tl.math.div_rn(wj, sj))
            e = tl.math.div_rn(wj - value * sj, d)
        else:
            q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(wj, sj)) + zero, 0.0), maxq)
            code = q.to(tl.int32)
            e = tl.math.div_rn(wj - (q - zero) * sj, d)
        hrow = tl.load(H + j * stride_h + cols, mask=(cols >= j) & (cols < C), other=0.0)
        w = w - e[:, None] * hrow[None, :]
        q_tile = tl.where(sel, code[:, None], q_tile)
        e_tile = tl.where(sel, e[:, None], e_tile)
    done = tile & (cols[None, :] >= start) & (cols[None, :] < stop)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], q_tile, mask=done)
    tl.store(E + rows[:, None] * stride_e + cols[None, :], e_tile, mask=done)
    tl.store(W + rows[:, None] * stride_w + cols[None, :], w, mask=tile & (cols[None, :] >= start))


def gptq_columns_triton(block: ColumnBlock, scale: torch.Tensor, start: int, stop: int) -> None:
    w1, codes, err, hinv1 = block.w1, block.codes, block.err, block.hinv1
    r, c = w1.shape
    if stop <= start or r == 0:
        return
    grid = (cdiv(r, BLOCK_R),)
    _gptq_columns_kernel[grid](
        w1,
        codes,
        err,
        scale,
        hinv1,
        r,
        c,
        start,
        stop,
        w1.stride(0),
        codes.stride(0),
        err.stride(0),
        scale.stride(0),
        hinv1.stride(0),
        float(block.zero),
        float(block.maxq),
        PER_COLUMN=scale.dim() == 2,
        E2M1=block.e2m1,
        BLOCK_R=BLOCK_R,
        BLOCK_C=max(16, next_power_of_2(c)),
        num_warps=4,
        enable_fp_fusion=False,
    )


SEARCH_BLOCK_R = 32


@triton.jit
def _best_scale_kernel(
    W, S, OUT, R, N, K, stride_w, stride_s, zero, maxq, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < R
    tile = rmask[:, None] & (cols < N)[None, :]
    w = tl.load(W + rows[:, None] * stride_w + cols[None, :], mask=tile, other=0.0)
    best_err = tl.full([BLOCK_R], float("inf"), dtype=tl.float32)
    best = tl.zeros([BLOCK_R], dtype=tl.int32)
    for c in range(K):
        s = tl.load(S + c * stride_s + rows, mask=rmask, other=1.0)
        q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(w, s[:, None])) + zero, 0.0), maxq)
        d = (q - zero) * s[:, None] - w
        err = tl.sum(tl.where(tile, d * d, 0.0), axis=1)
        better = err < best_err
        best_err = tl.where(better, err, best_err)
        best = tl.where(better, c, best)
    tl.store(OUT + rows, best, mask=rmask)


def best_scale_triton(w: torch.Tensor, candidates: torch.Tensor, zero: int, maxq: int) -> torch.Tensor:
    r, n = w.shape
    out = torch.empty(r, dtype=torch.int32, device=w.device)
    if r == 0:
        return out.long()
    _best_scale_kernel[(cdiv(r, SEARCH_BLOCK_R),)](
        w,
        candidates,
        out,
        r,
        n,
        candidates.shape[0],
        w.stride(0),
        candidates.stride(0),
        float(zero),
        float(maxq),
        BLOCK_R=SEARCH_BLOCK_R,
        BLOCK_N=max(16, next_power_of_2(n)),
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out.long()
