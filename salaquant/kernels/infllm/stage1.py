"""InfLLM-v2 stage 1 in Triton: each query's scores over the K1 windows (``stage1_scores``).

- ``stage1_scores``: one program per (query tile, batch * KV head). The tile's rows are
  ``BLOCK_M`` tokens times the G heads. Pass 1 is an online log-sum-exp over the visible K2 windows of
  each row; pass 2 streams the K1 windows, computes ``exp(scale * q . K1_i - LSE)``, masks invisible
  windows and sums the G rows of each token. Every output element is written (zeros where invisible).
  With few query tiles (decode) the K1 windows are split over several programs and pass 1 runs first as
  its own split kernel; the scoring programs merge its partial LSEs. The dot products run in the
  compressed keys' dtype (``compress_keys`` keeps the keys' dtype: bf16 dots for a bf16 model, TF32 for
  fp32 keys on GPUs).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..host import cdiv
from .launch import LOG2E, check_heads, pdl_args, pow2

__all__ = ["BLOCK_ROWS", "LSE_PARTS_PER_LOAD", "stage1_scores"]

LSE_PARTS_PER_LOAD = 64
"""Most partial K2 log-sum-exps the stage-1 scoring kernel loads in one round (a ``[parts, rows]`` fp32 tile)."""
BLOCK_ROWS = 128
"""(token, head) rows of a query tile (whole tokens; fewer when there are fewer queries), 8 warps a program."""


@triton.jit
def _visible_count(t, size: tl.constexpr, stride: tl.constexpr, n):
    """Number of windows ``i < n`` with ``stride * i + size - 1 <= t``."""
    return tl.minimum(tl.maximum(t + 1 - size + stride, 0) // stride, n)


@triton.jit
def _load_q_rows(
    q_ptr,
    pid_m,
    pid_bh,
    tq,
    q_start,
    n_kv_heads,
    head_dim,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows ``(token, head)`` of a query tile: ``(q [ROWS, BLOCK_D], pos [ROWS], row_ok [ROWS])``."""
    ROWS: tl.constexpr = BLOCK_M * BLOCK_G
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = pid_bh % n_kv_heads
    rows = tl.arange(0, ROWS)
    tok = (pid_m * BLOCK_M + rows // BLOCK_G).to(tl.int64)
    head = rows % BLOCK_G
    row_ok = (tok < tq) & (head < G)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = q_ptr + b * stride_qb + tok[:, None] * stride_qt + (h * G + head)[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & (offs_d < head_dim)[None, :], other=0.0)
    return q, q_start + tok, row_ok


@triton.jit
def _k2_partial_lse(
    q,
    pos,
    k2_base,
    stride_k2n,
    stride_k2d,
    head_dim,
    j_lo,
    j_hi,
    n2,
    qk_scale,
    KERNEL2: tl.constexpr,
    STRIDE2: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Online (max, sum) in the log2 domain over visible K2 windows ``[j_lo, j_hi)`` for every row."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kd_off = offs_d[:, None] * stride_k2d
    d_ok = (offs_d < head_dim)[:, None]
    m_i = tl.zeros([ROWS], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        cols = j0 + offs_n
        kt = tl.load(k2_base + (cols[None, :] * stride_k2n + kd_off), mask=(cols < n2)[None, :] & d_ok, other=0.0)
        s = tl.dot(q, kt) * qk_scale
        vis = ((cols * STRIDE2 + KERNEL2 - 1)[None, :] <= pos[:, None]) & (cols < n2)[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    return m_i, l_i


@triton.jit
def _stage1_lse_kernel(
    q_ptr,
    k2_ptr,
    lse_ptr,
    tq,
    n2,
    q_start,
    n_kv_heads,
    head_dim,
    split_len,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_k2b,
    stride_k2n,
    stride_k2h,
    stride_k2d,
    qk_scale,
    G: tl.constexpr,
    KERNEL2: tl.constexpr,
    STRIDE2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Partial log2-domain LSE over one ``split_len`` range of K2 windows (``-inf`` where none is visible)."""
    if PDL:
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    ROWS: tl.constexpr = BLOCK_M * BLOCK_G
    q, pos, _ = _load_q_rows(
        q_ptr, pid_m, pid_bh, tq, q_start, n_kv_heads, head_dim, stride_qb, stride_qt, stride_qh, stride_qd,
        G, BLOCK_M, BLOCK_G, BLOCK_D,
    )  # fmt: skip
    q = q.to(k2_ptr.dtype.element_ty)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = pid_bh % n_kv_heads
    t_last = q_start + tl.minimum(pid_m * BLOCK_M + BLOCK_M, tq) - 1
    j_lo = pid_s * split_len
    j_hi = tl.minimum(j_lo + split_len, _visible_count(t_last, KERNEL2, STRIDE2, n2))
    m_i, l_i = _k2_partial_lse(
        q, pos, k2_ptr + b * stride_k2b + h * stride_k2h, stride_k2n, stride_k2d, head_dim, j_lo, j_hi, n2,
        qk_scale, KERNEL2, STRIDE2, ROWS, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    row = (pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m) * tl.num_programs(2) + pid_s
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    tl.store(lse_ptr + row * ROWS + tl.arange(0, ROWS), lse)


@triton.jit
def _stage1_kernel(
    q_ptr,
    k1_ptr,
    k2_ptr,
    lse_ptr,
    out_ptr,
    tq,
    n1,
    n2,
    q_start,
    n_kv_heads,
    head_dim,
    split_len,
    n_lse_parts,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_k1b,
    stride_k1n,
    stride_k1h,
    stride_k1d,
    stride_k2b,
    stride_k2n,
    stride_k2h,
    stride_k2d,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_on,
    qk_scale,
    G: tl.constexpr,
    KERNEL1: tl.constexpr,
    STRIDE1: tl.constexpr,
    KERNEL2: tl.constexpr,
    STRIDE2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LSE_IN: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    """Scores of one query tile over one ``split_len`` range of K1 windows.

    With ``LSE_IN`` the per-row LSE is merged from ``n_lse_parts`` partials written by ``_stage1_lse_kernel``;
    otherwise it is computed here over all visible K2 windows.
    """
    if PDL:  # launched behind _stage1_lse_kernel: reads only its partials after the wait
        gdc_launch_dependents()
    # heavy (late) tiles first: their work grows with the position
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    ROWS: tl.constexpr = BLOCK_M * BLOCK_G
    q, pos, row_ok = _load_q_rows(
        q_ptr, pid_m, pid_bh, tq, q_start, n_kv_heads, head_dim, stride_qb, stride_qt, stride_qh, stride_qd,
        G, BLOCK_M, BLOCK_G, BLOCK_D,
    )  # fmt: skip
    q = q.to(k1_ptr.dtype.element_ty)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = pid_bh % n_kv_heads
    t_last = q_start + tl.minimum(pid_m * BLOCK_M + BLOCK_M, tq) - 1

    if LSE_IN:
        m_i = tl.zeros([ROWS], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        if PDL:
            gdc_wait()
        # the partials come BLOCK_P at a time as one [BLOCK_P, ROWS] tile: one round of loads, not one per partial
        offs_p = tl.arange(0, BLOCK_P)
        part_base = lse_ptr + (pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m) * n_lse_parts * ROWS
        for p0 in range(0, n_lse_parts, BLOCK_P):
            parts = p0 + offs_p
            tile = tl.load(
                part_base + parts[:, None] * ROWS + tl.arange(0, ROWS)[None, :],
                mask=(parts < n_lse_parts)[:, None],
                other=float("-inf"),
            )
            m_new = tl.maximum(m_i, tl.max(tile, 0))  # finite: m_i starts at -1e30
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(tile - m_new[None, :]), 0)
            m_i = m_new
    else:
        m_i, l_i = _k2_partial_lse(
            q, pos, k2_ptr + b * stride_k2b + h * stride_k2h, stride_k2n, stride_k2d, head_dim, 0,
            _visible_count(t_last, KERNEL2, STRIDE2, n2), n2, qk_scale, KERNEL2, STRIDE2, ROWS, BLOCK_N, BLOCK_D,
        )  # fmt: skip
    keep = row_ok & (l_i > 0.0)  # rows without a visible K2 window score 0
    lse = tl.where(keep, m_i + tl.log2(tl.maximum(l_i, 1e-30)), 0.0)

    # sum over the group's heads of exp(scale * q . K1_i - LSE) for visible K1 windows of this split
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k1_base = k1_ptr + b * stride_k1b + h * stride_k1h
    kd_off = offs_d[:, None] * stride_k1d
    d_ok = (offs_d < head_dim)[:, None]
    tok_out = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    out_ptrs = out_ptr + b * stride_ob + h * stride_oh + tok_out[:, None] * stride_ot
    tok_ok = (tok_out < tq)[:, None]
    i_lo = pid_s * split_len
    i_end = tl.minimum(i_lo + split_len, n1)
    i_hi = tl.minimum(i_end, _visible_count(t_last, KERNEL1, STRIDE1, n1))
    for i0 in range(i_lo, i_hi, BLOCK_N):
        cols = i0 + offs_n
        kt = tl.load(k1_base + (cols[None, :] * stride_k1n + kd_off), mask=(cols < n1)[None, :] & d_ok, other=0.0)
        s = tl.dot(q, kt) * qk_scale
        vis = ((cols * STRIDE1 + KERNEL1 - 1)[None, :] <= pos[:, None]) & keep[:, None]
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        score = tl.sum(tl.reshape(p, (BLOCK_M, BLOCK_G, BLOCK_N)), 1)
        tl.store(out_ptrs + cols[None, :] * stride_on, score, mask=tok_ok & (cols < n1)[None, :])
    # windows of this split that no token of the tile can see
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i0 in range(i_lo + tl.cdiv(tl.maximum(i_hi - i_lo, 0), BLOCK_N) * BLOCK_N, i_end, BLOCK_N):
        cols = i0 + offs_n
        tl.store(out_ptrs + cols[None, :] * stride_on, zeros, mask=tok_ok & (cols < n1)[None, :])


def stage1_scores(
    q: Tensor,
    k1: Tensor,
    k2: Tensor,
    q_start: int,
    kernel_size: int,
    kernel_stride: int,
    kernel_size2: int,
    kernel_stride2: int,
    *,
    out: Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
) -> Tensor:
    """Stage-1 scores ``[B, Hkv, Tq, n1]`` (fp32) of the queries at ``q_start ..`` over the K1 windows
    ``(kernel_size, kernel_stride)``, normalised over the K2 windows ``(kernel_size2, kernel_stride2)``: the
    definition of the reference ``stage1_scores`` (the model package's ``sparse_attention.py``).

    ``out`` (fp32, that shape) receives the result when given. ``num_splits`` splits the K1 windows of every query
    tile over that many programs (default: more than one only when there are few query tiles, as in decode); the K2
    log-sum-exp then runs as a separate split kernel whose partials the scoring kernel merges. ``block_n``: K1 / K2
    windows per step.
    """
    b, tq, hq, d = q.shape
    hkv, n1, n2 = k1.shape[2], k1.shape[1], k2.shape[1]
    g = check_heads(hq, hkv)
    if k1.shape[0] != b or k2.shape[0] != b or k2.shape[2] != hkv or k1.shape[3] != d or k2.shape[3] != d:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k1 {tuple(k1.shape)}, k2 {tuple(k2.shape)}")
    if k2.dtype != k1.dtype:
        k2 = k2.to(k1.dtype)
    if out is None:
        out = torch.empty(b, hkv, tq, n1, dtype=torch.float32, device=q.device)
    elif out.shape != (b, hkv, tq, n1) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 {(b, hkv, tq, n1)}, got {out.dtype} {tuple(out.shape)}")
    if tq == 0 or n1 == 0 or b == 0:
        return out
    block_g = pow2(g, floor=1)
    min_m = pow2(16 // block_g, floor=1)  # >= 16 rows for tl.dot
    # no more token rows than there are queries (decode: one token, its G heads), else the tile computes padding
    block_m = max(min(BLOCK_ROWS // block_g, pow2(tq, floor=1)), min_m)
    block_n = pow2(block_n)
    block_d = pow2(d)
    n_tiles = cdiv(tq, block_m)
    programs = n_tiles * b * hkv
    if num_splits is None:
        num_splits = 1 if programs >= 128 else cdiv(256, programs)
    split1 = cdiv(cdiv(n1, max(1, num_splits)), block_n) * block_n
    splits1 = cdiv(n1, split1)
    consts = {
        "G": g,
        "KERNEL2": kernel_size2,
        "STRIDE2": kernel_stride2,
        "BLOCK_M": block_m,
        "BLOCK_G": block_g,
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
        "num_warps": 8,
        "num_stages": 2,
    }
    qk_scale = LOG2E / math.sqrt(d)
    lse_in = splits1 > 1 and n2 > 0
    if lse_in:
        split2 = cdiv(cdiv(n2, num_splits), block_n) * block_n
        splits2 = cdiv(n2, split2)
        lse = torch.empty(b * hkv * n_tiles * splits2 * block_m * block_g, dtype=torch.float32, device=q.device)
        pdl = pdl_args(q.device)
        _stage1_lse_kernel[(n_tiles, b * hkv, splits2)](
            q, k2, lse, tq, n2, q_start, hkv, d, split2, *q.stride(), *k2.stride(), qk_scale, PDL=pdl["PDL"], **consts
        )
    else:
        splits2, lse, pdl = 0, out, {"PDL": False}  # lse unused
    _stage1_kernel[(n_tiles, b * hkv, splits1)](
        q,
        k1,
        k2,
        lse,
        out,
        tq,
        n1,
        n2,
        q_start,
        hkv,
        d,
        split1,
        splits2,
        *q.stride(),
        *k1.stride(),
        *k2.stride(),
        *out.stride(),
        qk_scale,
        KERNEL1=kernel_size,
        STRIDE1=kernel_stride,
        LSE_IN=lse_in,
        BLOCK_P=min(pow2(splits2, floor=1), LSE_PARTS_PER_LOAD),
        **pdl,
        **consts,
    )
    return out
