"""Triton kernels for InfLLM-v2 block-sparse attention (stage-1 scoring and stage-2 attention).

Shapes and semantics follow ``salaquant.model.sparse_attention``: ``q: [B, Tq, Hq, D]``,
``k, v: [B, Tk, Hkv, D]``, compressed keys ``k1: [B, n1, Hkv, D]`` and ``k2: [B, n2, Hkv, D]``; query ``i``
sits at position ``q_start + i``; the ``G = Hq // Hkv`` query heads of a KV group are consecutive.

- ``stage1_scores``: one program per (query tile, batch * KV head). The tile's rows are
  ``BLOCK_M`` tokens times the G heads. Pass 1 is an online log-sum-exp over the visible K2 windows of
  each row; pass 2 streams the K1 windows, computes ``exp(scale * q . K1_i - LSE)``, masks invisible
  windows and sums the G rows of each token. Every output element is written (zeros where invisible).
  With few query tiles (decode) the K1 windows are split over several programs and pass 1 runs first as
  its own split kernel; the scoring programs merge its partial LSEs. The dot products run in the
  compressed keys' dtype (``compress_keys`` keeps the keys' dtype: bf16 dots for a bf16 model, TF32 for
  fp32 keys on GPUs).
- ``block_sparse_attention``: one program per (query token, batch * KV head[, split]). The G heads are
  the rows of a ``[G, D]`` tile; the program loops over the selected blocks (``-1``, future and
  out-of-range entries contribute nothing), masks keys after the query inside a block, and keeps an fp32
  online softmax. Key rows are clamped into ``[0, t]`` instead of masking the loads (the masked scores
  make the clamped rows harmless), so the loads pipeline. When there are few (token, head) rows (decode)
  the selected blocks are split over several programs whose partial results a second kernel merges.

Block indices must be unique per row, as ``select_blocks`` produces them. Running maxima start at a
finite ``-1e30`` so that fully masked tiles stay NaN-free. Base offsets are int64; offsets inside one
(batch, KV head) slice are int32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from salaquant.model.sparse_attention import SparseParams, forced_blocks

from ..device import INTERPRET as _INTERPRET
from ..device import cuda_facts
from ..host import cdiv, next_power_of_2

__all__ = ["block_sparse_attention", "pool_select", "stage1_scores"]

_LOG2E = 1.4426950408889634
MERGE_SPLITS_PER_LOAD = 64
"""Most partial results the split-merge kernel loads in one round (a ``[splits, head_dim]`` fp32 tile)."""
USE_PDL = True
"""Launch each kernel that reads an earlier one's output with programmatic dependent launch on Hopper and newer
GPUs: it is scheduled while its predecessor runs (which signals at its start) and waits (``griddepcontrol.wait``)
before its first global access, so the launch latency between the kernels of a decode step overlaps."""
LSE_PARTS_PER_LOAD = 64
"""Most partial K2 log-sum-exps the stage-1 scoring kernel loads in one round (a ``[parts, rows]`` fp32 tile)."""
FEW_ROWS = 128
"""Below this many (batch * KV head, query) rows, ``pool_select`` runs 8 warps per row instead of 4: decode's two
rows at 128K context took 15.7 against 19.2 us per replay of a CUDA graph of the launch on an H200 (16 warps:
15.5)."""


def _pdl(device: torch.device) -> dict[str, bool]:
    """``PDL`` and ``launch_pdl`` launch arguments: on where ``USE_PDL`` is set and the GPU is sm_90 or newer."""
    on = USE_PDL and device.type == "cuda" and not _INTERPRET
    on = on and cuda_facts(device)[1] >= 9
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, next_power_of_2(max(1, x)))


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


@triton.jit
def _local_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    tq,
    q_start,
    n_q_heads,
    head_dim,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    qk_scale,
    G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INIT_BLOCKS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Attention of ``BLOCK_M`` consecutive queries of one query head over their forced blocks only: the init
    blocks and the local window ``qb - LOCAL_BLOCKS .. qb`` (causal). Neighbouring queries share these keys, so
    a tile reads each key once for all its rows, as dense sliding-window attention does. Writes the normalized
    fp32 output ``[B, Tq, Hq, D]`` and the log2-domain LSE ``[B, Hq, Tq]`` that the block kernel starts from.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_q_heads).to(tl.int64)
    hq = pid_bh % n_q_heads
    h = hq // G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tq
    pos = q_start + rows  # absolute query positions
    win_lo = (pos // BLOCK_SIZE - LOCAL_BLOCKS) * BLOCK_SIZE  # first key of each row's local window
    init_hi: tl.constexpr = INIT_BLOCKS * BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < head_dim

    q_base = q_ptr + b * stride_qb + hq * stride_qh
    q = tl.load(
        q_base + rows.to(tl.int64)[:, None] * stride_qt + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh

    first = q_start + pid_m * BLOCK_M
    last = tl.minimum(first + BLOCK_M, q_start + tq) - 1
    lo = tl.maximum((first // BLOCK_SIZE - LOCAL_BLOCKS) * BLOCK_SIZE, 0)  # the tile's lowest window key
    # init keys below lo first (tiles of them, keys >= lo masked), then every key from lo to the last query
    n_init = tl.cdiv(tl.minimum(init_hi, lo), BLOCK_N)
    n_main = tl.cdiv(last + 1 - lo, BLOCK_N)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i in range(0, n_init + n_main):
        in_init = i < n_init
        start = tl.where(in_init, i * BLOCK_N, lo + (i - n_init) * BLOCK_N)
        keys = start + offs_n
        key_ok = (keys <= last) & ((keys < lo) | (i >= n_init))
        koff = tl.minimum(keys, last).to(tl.int64)  # in bounds; masked rows are never used
        kt = tl.load(k_base + koff[None, :] * stride_kt + offs_d[:, None] * stride_kd, mask=d_ok[:, None], other=0.0)
        s = tl.dot(q, kt) * qk_scale
        allowed = (
            key_ok[None, :]
            & (keys[None, :] <= pos[:, None])
            & ((keys[None, :] < init_hi) | (keys[None, :] >= win_lo[:, None]))
        )
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(v_base + koff[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m_i = m_new

    o = acc / tl.maximum(l_i, 1e-30)[:, None]  # every query sees its own key: l > 0
    o_rows = (b * tq + rows.to(tl.int64)) * n_q_heads + hq
    tl.store(o_ptr + o_rows[:, None] * BLOCK_D + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(lse_ptr + (b * n_q_heads + hq) * tq + rows, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=row_ok)


@triton.jit
def _stage2_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    local_o_ptr,
    local_lse_ptr,
    tq,
    q_start,
    n_kv_heads,
    n_sel,
    blocks_per_split,
    n_splits,
    head_dim,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ib,
    stride_ih,
    stride_it,
    stride_is,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_od,
    qk_scale,
    G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    SPLIT: tl.constexpr,
    LOCAL_DONE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One query token and KV group over its selected blocks (or one ``blocks_per_split`` slice of them).

    With ``SPLIT`` the normalized partial output and its log2-domain LSE go to the fp32 scratch buffers. With
    ``LOCAL_DONE`` the forced blocks were attended by ``_local_attention_kernel`` and the list holds the other
    blocks only: the online softmax starts from the local output and LSE.
    """
    if PDL:  # may start before the kernel that wrote block_idx (or anything else it reads) has finished
        gdc_launch_dependents()
        gdc_wait()
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = pid_bh % n_kv_heads
    t_idx = pid_t.to(tl.int64)
    pos = q_start + t_idx

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    g_ok = offs_g < G
    d_ok = offs_d < head_dim
    q_ptrs = (
        q_ptr + b * stride_qb + t_idx * stride_qt + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)

    # scalar 64-bit bases, 32-bit offsets inside one (batch, KV head) slice
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    kd_off = offs_d[:, None] * stride_kd
    vd_off = offs_d[None, :] * stride_vd
    s_begin = pid_s * blocks_per_split
    s_end = tl.minimum(s_begin + blocks_per_split, n_sel)
    idx_p = idx_ptr + b * stride_ib + h * stride_ih + t_idx * stride_it + s_begin.to(tl.int64) * stride_is

    if LOCAL_DONE:
        # (m, l, acc) = (lse, 1, o) is the normalized local result as an online-softmax state
        hq_rows = h * G + offs_g
        n_q_heads = n_kv_heads * G
        m_i = tl.load(local_lse_ptr + (b * n_q_heads + hq_rows) * tq + t_idx, mask=g_ok, other=-1.0e30)
        l_i = tl.where(g_ok, 1.0, 0.0)
        local_rows = (b * tq + t_idx) * n_q_heads + hq_rows
        acc = tl.load(local_o_ptr + local_rows[:, None] * BLOCK_D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    else:
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    SUBS: tl.constexpr = (BLOCK_SIZE + BLOCK_N - 1) // BLOCK_N  # key tiles per block
    nxt = tl.load(idx_p, mask=s_begin < s_end, other=-1)
    for si in range(s_begin, s_end):
        blk = nxt.to(tl.int64)
        idx_p += stride_is
        nxt = tl.load(idx_p, mask=si + 1 < s_end, other=-1)  # prefetch the next block index
        for j in tl.static_range(SUBS):
            keys = blk * BLOCK_SIZE + (j * BLOCK_N) + offs_n
            # 0 <= key <= pos < Tk: drops -1 entries, future and out-of-range blocks, keeps loads in bounds
            key_ok = (offs_n < BLOCK_SIZE - j * BLOCK_N) & (keys >= 0) & (keys <= pos)
            # clamped rows are always in bounds and their scores are masked: the loads need no mask, which
            # lets the compiler pipeline them
            koff = tl.minimum(tl.maximum(keys, 0), pos).to(tl.int32)
            if EVEN_D:
                kt = tl.load(k_base + (koff[None, :] * stride_kt + kd_off))
            else:
                kt = tl.load(k_base + (koff[None, :] * stride_kt + kd_off), mask=d_ok[:, None], other=0.0)
            s = tl.dot(q, kt) * qk_scale
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if EVEN_D:
                vb = tl.load(v_base + (koff[:, None] * stride_vt + vd_off))
            else:
                vb = tl.load(v_base + (koff[:, None] * stride_vt + vd_off), mask=d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m_i = m_new

    has = l_i > 0.0
    o = tl.where(has[:, None], acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    if SPLIT:
        row = (pid_bh.to(tl.int64) * tq + t_idx) * n_splits + pid_s
        tl.store(
            part_o_ptr + (row * BLOCK_G + offs_g)[:, None] * BLOCK_D + offs_d[None, :],
            o,
        )
        tl.store(
            part_lse_ptr + row * BLOCK_G + offs_g, tl.where(has, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        )
    else:
        o_ptrs = (
            out_ptr
            + b * stride_ob
            + t_idx * stride_ot
            + (h * G + offs_g)[:, None] * stride_oh
            + offs_d[None, :] * stride_od
        )
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    tq,
    n_kv_heads,
    n_splits,
    head_dim,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_od,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """Combine the ``n_splits`` partial outputs of one (token, KV group, query head) by their LSE weights.

    ``BLOCK_S`` splits are loaded at once (one round of loads for up to ``BLOCK_S`` splits, instead of one
    dependent step per split); more splits than that are folded in chunk by chunk.
    """
    if PDL:
        gdc_wait()
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_g = tl.program_id(2)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = pid_bh % n_kv_heads
    t_idx = pid_t.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)

    m_i = tl.full([], -1.0e30, dtype=tl.float32)
    den = tl.full([], 0.0, dtype=tl.float32)
    num = tl.zeros([BLOCK_D], dtype=tl.float32)
    row0 = (pid_bh.to(tl.int64) * tq + t_idx) * n_splits
    for s0 in range(0, n_splits, BLOCK_S):
        sp = s0 + offs_s
        ok = sp < n_splits
        slot = (row0 + sp) * BLOCK_G + pid_g  # [BLOCK_S]: this head's entry of each split
        lse = tl.load(part_lse_ptr + slot, mask=ok, other=float("-inf"))
        o = tl.load(part_o_ptr + slot[:, None] * BLOCK_D + offs_d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(lse, 0))  # finite: m_i starts at -1e30
        w = tl.exp2(lse - m_new)  # 0 for empty splits (lse = -inf) and padding
        alpha = tl.exp2(m_i - m_new)
        den = den * alpha + tl.sum(w, 0)
        num = num * alpha + tl.sum(w[:, None] * o, 0)
        m_i = m_new
    out = tl.where(den > 0.0, num / tl.maximum(den, 1e-30), 0.0)
    o_ptrs = out_ptr + b * stride_ob + t_idx * stride_ot + (h * G + pid_g) * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


@triton.jit
def _pool_select_kernel(
    scores_ptr,
    idx_ptr,
    tq,
    n1,
    n_blocks,
    k_sel,
    q_start,
    stride_sb,
    stride_st,
    stride_sn,
    stride_ib,
    stride_it,
    stride_is,
    R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INIT_BLOCKS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Block max-pooling, forced blocks and top-k of one (batch * KV head, query) row, in one program.

    Each pooled score becomes its order-preserving int32 image. A search over that integer range finds ``v``,
    the ``k``-th largest image, one bit per step in up to 32 dependent counts over the row (int32 throughout); the
    blocks above ``v`` are chosen, then blocks equal to ``v`` in ascending order until there are ``k`` (equal scores:
    lower block first). No sort. On an H200 a decode row at 128K context took 9.6 us with all 32 counts (5.9 of
    it, about 0.19 us each; ``benchmarks/infllm_select_anatomy.py``) and 8.9 us ending early after 25 on uniform
    random scores. Slower or no faster there: 2 or 4 bits per step from 3 or 15 counts made as separate sums (16.9
    and 19.1 against 14.8 us per row, one launch replayed from a graph), 2 bits from 3 counts packed into one sum
    of two int32 (11.8 against 11.6 us, back-to-back replays), 4 bits from 16 counts in 16-bit fields of four int64
    sums (15.3 against 9.8 us in the decode step), ``tl.topk``'s bitonic network (16.4 against 11.7 us, back-to-back
    replays), and a ternary search making two counts per sum in 16-bit fields of one int32 (21 steps of 0.27 us:
    9.4 against 9.6 us for the row).
    The chosen blocks are written in ascending order (future ones as -1).
    """
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    t_idx = pid_t.to(tl.int64)
    blocks = tl.arange(0, BLOCK_NB)
    in_range = blocks < n_blocks
    row = scores_ptr + pid_bh * stride_sb + t_idx * stride_st
    pooled = tl.full([BLOCK_NB], float("-inf"), dtype=tl.float32)
    for j in tl.static_range(R + 1):
        w = blocks * R - 1 + j  # K1 windows [R*b - 1, R*b + R - 1]
        ok = in_range & (w >= 0) & (w < n1)
        pooled = tl.maximum(pooled, tl.load(row + w * stride_sn, mask=ok, other=float("-inf")))
    pooled = tl.where(pooled == float("-inf"), 0.0, pooled)  # no window: score 0
    qb = (q_start + t_idx) // BLOCK_SIZE
    forced = (blocks < INIT_BLOCKS) | ((blocks >= qb - LOCAL_BLOCKS) & (blocks <= qb))
    pooled = tl.where(forced, float("inf"), pooled)

    bits = pooled.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # float order as signed integers
    # blocks past n_blocks take INT32_MIN (no float's image), below every candidate tried: never counted
    ordered = tl.where(in_range, ordered, -2147483648)
    # v = the largest image with count(ordered >= v) >= k, built from its top bit down: a step tries v + 2^(31-step)
    # (the lower bits of v are still zero, so the sum never carries; int32 wraps at step 0, INT32_MIN + 2^31 = 0)
    # and keeps it while its count is >= k. The count at v = INT32_MIN is n_blocks >= k. A count of exactly k ends
    # the search early: the images >= v are then the top k, ties and all.
    v = tl.full([], -2147483648, tl.int32)
    one = tl.full([], 1, tl.int32)
    step = 0
    count = n_blocks
    while (step < 32) & (count != k_sel):
        cand = v + (one << (31 - step))
        n_ge = tl.sum((ordered >= cand).to(tl.int32), 0)
        v = tl.where(n_ge >= k_sel, cand, v)
        count = tl.where(n_ge >= k_sel, n_ge, count)
        step += 1
    above = (ordered > v) & in_range
    tied = (ordered == v) & in_range
    if count == k_sel:  # every block equal to v is chosen: no tie to break
        chosen = above | tied
    else:
        need = k_sel - tl.sum(above.to(tl.int32), 0)
        chosen = above | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= need))
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    out = tl.where(blocks > qb, -1, blocks)
    tl.store(idx_ptr + pid_bh * stride_ib + t_idx * stride_it + slot.to(tl.int64) * stride_is, out, mask=chosen)


def pool_select(
    scores: Tensor,
    q_start: int,
    tk: int,
    params: SparseParams,
    *,
    out: Tensor | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """Chosen blocks ``[B, Hkv, Tq, min(total_topk, n_blocks)]`` int32 from stage-1 scores ``[B, Hkv, Tq, n1]``.

    Same result as the reference ``select_blocks(block_scores(scores, q_start, tk, params), q_start, params)``,
    one program per (query, batch * KV head); a row costs up to 32 dependent counts over
    ``next_power_of_2(n_blocks)`` pooled scores (fewer when a count lands on ``k`` exactly). ``num_warps`` defaults
    to 8 when the rows are too few to fill the GPU (decode), else 4. ``out`` (int32, that shape; a slice along
    ``Tq`` of a contiguous selection will do) receives the result.
    """
    b, hkv, tq, n1 = scores.shape
    n_blocks = cdiv(tk, params.block_size)
    k_sel = min(params.total_topk, n_blocks)
    shape = (b, hkv, tq, k_sel)
    if out is None:
        idx = torch.empty(shape, dtype=torch.int32, device=scores.device)
    elif out.shape != shape or out.dtype != torch.int32 or out.stride(0) != hkv * out.stride(1):
        raise ValueError(
            f"out must be int32 {shape} with mergeable batch and head strides, got {out.dtype} {tuple(out.shape)} "
            f"strides {out.stride()}"
        )
    else:
        idx = out
    if b * hkv * tq == 0 or k_sel == 0:
        return idx
    flat = scores.reshape(b * hkv, tq, n1)
    rows = idx.view(b * hkv, tq, k_sel)
    _pool_select_kernel[(tq, b * hkv)](
        flat,
        rows,
        tq,
        n1,
        n_blocks,
        k_sel,
        q_start,
        *flat.stride(),
        *rows.stride(),
        R=params.pool_ratio,
        BLOCK_SIZE=params.block_size,
        INIT_BLOCKS=params.init_blocks,
        LOCAL_BLOCKS=params.local_blocks,
        BLOCK_NB=_pow2(n_blocks),
        num_warps=num_warps if num_warps is not None else (8 if b * hkv * tq < FEW_ROWS else 4),
        **_pdl(scores.device),
    )
    return idx


def _check_heads(hq: int, hkv: int) -> int:
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    return hq // hkv


def stage1_scores(
    q: Tensor,
    k1: Tensor,
    k2: Tensor,
    q_start: int,
    params: SparseParams,
    query_chunk: int = 512,
    *,
    out: Tensor | None = None,
    num_splits: int | None = None,
    block_rows: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
) -> Tensor:
    """Stage-1 scores ``[B, Hkv, Tq, n1]`` (fp32), same definition as the reference ``stage1_scores``.

    ``query_chunk`` is accepted for signature parity and unused. ``out`` (fp32, that shape) receives the
    result when given. ``block_rows`` is the number of (token, head) rows per program (whole tokens).
    ``num_splits`` splits the K1 windows of every query tile over that many programs (default: more than
    one only when there are few query tiles, as in decode); the K2 log-sum-exp then runs as a separate
    split kernel whose partials the scoring kernel merges.
    """
    del query_chunk
    b, tq, hq, d = q.shape
    hkv, n1, n2 = k1.shape[2], k1.shape[1], k2.shape[1]
    g = _check_heads(hq, hkv)
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
    block_g = _pow2(g, floor=1)
    min_m = _pow2(16 // block_g, floor=1)  # >= 16 rows for tl.dot
    # no more token rows than there are queries (decode: one token, its G heads), else the tile computes padding
    block_m = max(min(_pow2(block_rows, floor=1) // block_g, _pow2(tq, floor=1)), min_m)
    block_n = _pow2(block_n)
    block_d = _pow2(d)
    n_tiles = cdiv(tq, block_m)
    programs = n_tiles * b * hkv
    if num_splits is None:
        num_splits = 1 if programs >= 128 else cdiv(256, programs)
    split1 = cdiv(cdiv(n1, max(1, num_splits)), block_n) * block_n
    splits1 = cdiv(n1, split1)
    consts = {
        "G": g,
        "KERNEL2": params.kernel_size2,
        "STRIDE2": params.kernel_stride2,
        "BLOCK_M": block_m,
        "BLOCK_G": block_g,
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }
    qk_scale = _LOG2E / math.sqrt(d)
    lse_in = splits1 > 1 and n2 > 0
    if lse_in:
        split2 = cdiv(cdiv(n2, num_splits), block_n) * block_n
        splits2 = cdiv(n2, split2)
        lse = torch.empty(b * hkv * n_tiles * splits2 * block_m * block_g, dtype=torch.float32, device=q.device)
        pdl = _pdl(q.device)
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
        KERNEL1=params.kernel_size,
        STRIDE1=params.kernel_stride,
        LSE_IN=lse_in,
        BLOCK_P=min(_pow2(splits2, floor=1), LSE_PARTS_PER_LOAD),
        **pdl,
        **consts,
    )
    return out


def _default_splits(rows: int, n_sel: int) -> int:
    """Enough programs to fill a large GPU when there are few (token, KV head) rows."""
    if rows >= 256 or n_sel <= 2:
        return 1
    return max(1, min(cdiv(512, rows), cdiv(n_sel, 2)))


def _without_forced(block_idx: Tensor, q_start: int, params: SparseParams) -> Tensor:
    """``block_idx`` without each row's forced blocks, the rest first (descending), trimmed to the longest row;
    rows with nothing left keep one -1."""
    tq = block_idx.shape[2]
    qb = ((q_start + torch.arange(tq, device=block_idx.device)) // params.block_size).view(1, 1, tq, 1)
    blk = block_idx.long()
    rest = torch.where(forced_blocks(blk, qb, params), -1, blk).sort(dim=-1, descending=True).values
    keep = max(1, int((rest >= 0).sum(dim=-1).max())) if rest.numel() else 1
    return rest[..., :keep].to(torch.int32).contiguous()


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_idx: Tensor,
    q_start: int,
    params: SparseParams,
    query_chunk: int = 256,
    *,
    out: Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    local_dense: bool = False,
    local_block_m: int = 64,
) -> Tensor:
    """Attention over the selected key blocks, ``[B, Tq, Hq, D]`` in ``q.dtype``.

    Same definition as the reference ``block_sparse_attention``; ``block_idx: [B, Hkv, Tq, S]`` (any
    integer dtype) must hold unique indices per row. ``query_chunk`` is accepted for signature parity and
    unused. ``num_splits`` splits the ``S`` selected blocks over that many programs per row (default:
    chosen from the number of rows). Each block is read in key tiles of ``min(block_n, block_size)``
    (rounded up to a power of two, at least 16).

    ``local_dense`` attends each row's forced blocks (init blocks and local window, which every row of
    ``select_blocks`` holds whenever ``params.keeps_forced_blocks``) with a sliding-window
    kernel over tiles of ``local_block_m`` queries, which read those keys once per tile instead of once per
    query, then the remaining selected blocks per row as usual. ``block_idx`` must then contain every forced
    block of its row, as the selection produces; the result is the same attention. Not with splits.
    """
    del query_chunk
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = _check_heads(hq, hkv)
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if block_idx.shape[:3] != (b, hkv, tq):
        raise ValueError(f"block_idx must be [B, Hkv, Tq, S] = [{b}, {hkv}, {tq}, S], got {tuple(block_idx.shape)}")
    if tq + q_start > tk or q_start < 0:
        raise ValueError(f"queries at positions [{q_start}, {q_start + tq}) exceed the {tk} keys")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    if b * tq * hq == 0:
        return out
    block_g, block_d = _pow2(g), _pow2(d)
    local_o = local_lse = out  # unused unless local_dense
    if local_dense:
        if num_splits not in (None, 1):
            raise ValueError("local_dense runs without splits")
        num_splits = 1
        block_idx = _without_forced(block_idx, q_start, params)
        local_o = torch.empty(b, tq, hq, block_d, dtype=torch.float32, device=q.device)
        local_lse = torch.empty(b, hq, tq, dtype=torch.float32, device=q.device)
        block_m = _pow2(local_block_m)
        _local_attention_kernel[(cdiv(tq, block_m), b * hq)](
            q,
            k,
            v,
            local_o,
            local_lse,
            tq,
            q_start,
            hq,
            d,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            _LOG2E / math.sqrt(d),
            G=g,
            BLOCK_SIZE=params.block_size,
            INIT_BLOCKS=params.init_blocks,
            LOCAL_BLOCKS=params.local_blocks,
            BLOCK_M=block_m,
            BLOCK_N=min(_pow2(block_n), _pow2(params.block_size)),
            BLOCK_D=block_d,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    n_sel = block_idx.shape[3]
    splits = _default_splits(b * hkv * tq, n_sel) if num_splits is None else max(1, num_splits)
    per_split = max(1, cdiv(n_sel, splits)) if n_sel else 1
    splits = max(1, cdiv(n_sel, per_split))
    split = splits > 1
    if split:
        part_o = torch.empty(b * hkv * tq * splits * block_g * block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b * hkv * tq * splits * block_g, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    _stage2_kernel[(tq, b * hkv, splits)](
        q,
        k,
        v,
        block_idx,
        out,
        part_o,
        part_lse,
        local_o,
        local_lse,
        tq,
        q_start,
        hkv,
        n_sel,
        per_split,
        splits,
        d,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *block_idx.stride(),
        *out.stride(),
        _LOG2E / math.sqrt(d),
        G=g,
        BLOCK_SIZE=params.block_size,
        BLOCK_G=block_g,
        BLOCK_N=min(_pow2(block_n), _pow2(params.block_size)),
        BLOCK_D=block_d,
        EVEN_D=block_d == d,
        SPLIT=split,
        LOCAL_DONE=local_dense,
        num_warps=num_warps,
        num_stages=num_stages,
        **_pdl(q.device),
    )
    if split:
        _merge_splits_kernel[(tq, b * hkv, g)](
            part_o,
            part_lse,
            out,
            tq,
            hkv,
            splits,
            d,
            *out.stride(),
            G=g,
            BLOCK_G=block_g,
            BLOCK_D=block_d,
            BLOCK_S=min(_pow2(splits), MERGE_SPLITS_PER_LOAD),
            num_warps=4,
            **_pdl(q.device),
        )
    return out
