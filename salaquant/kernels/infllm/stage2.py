"""InfLLM-v2 stage 2 in Triton: attention over each query's selected blocks (``block_sparse_attention``).

- ``block_sparse_attention``: one program per (query token, batch * KV head[, split]). The G heads are
  the rows of a ``[G, D]`` tile; the program loops over the selected blocks (``-1``, future and
  out-of-range entries contribute nothing), masks keys after the query inside a block, and keeps an fp32
  online softmax. Key rows are clamped into ``[0, t]`` instead of masking the loads (the masked scores
  make the clamped rows harmless), so the loads pipeline. When there are few (token, head) rows (decode)
  the selected blocks are split over several programs whose partial results a second kernel merges.
- With ``forced``, a sliding-window kernel first attends each row's forced blocks (the init blocks and the local
  window) over tiles of consecutive queries, which share those keys, and the block kernel starts its online softmax
  from that result over the other selected blocks only.
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

__all__ = ["MERGE_SPLITS_PER_LOAD", "block_sparse_attention"]

MERGE_SPLITS_PER_LOAD = 64
"""Most partial results the split-merge kernel loads in one round (a ``[splits, head_dim]`` fp32 tile)."""


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


def _default_splits(rows: int, n_sel: int) -> int:
    """Enough programs to fill a large GPU when there are few (token, KV head) rows."""
    if rows >= 256 or n_sel <= 2:
        return 1
    return max(1, min(cdiv(512, rows), cdiv(n_sel, 2)))


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_idx: Tensor,
    q_start: int,
    block_size: int,
    *,
    out: Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    forced: tuple[int, int] | None = None,
    local_block_m: int = 64,
) -> Tensor:
    """Attention of the queries at ``q_start ..`` over their selected key blocks of ``block_size`` keys,
    ``[B, Tq, Hq, D]`` in ``q.dtype``: the definition of the reference ``block_sparse_attention`` of
    the model package's ``sparse_attention.py``.

    ``block_idx: [B, Hkv, Tq, S]`` (any integer dtype) must hold unique indices per row. ``num_splits`` splits the
    ``S`` selected blocks over that many programs per row (default: chosen from the number of rows). Each block is
    read in key tiles of ``min(block_n, block_size)`` (rounded up to a power of two, at least 16).

    ``forced = (init_blocks, local_blocks)`` attends each row's forced blocks (the first ``init_blocks`` and the
    ``local_blocks`` before the query's own, which it includes) with the sliding-window kernel over tiles of
    ``local_block_m`` queries, which read those keys once per tile instead of once per query; ``block_idx`` then
    holds the row's other selected blocks only (``-1`` padded). Not with splits.
    """
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = check_heads(hq, hkv)
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
    block_g, block_d = pow2(g), pow2(d)
    local_o = local_lse = out  # unused unless forced
    if forced is not None:
        if num_splits not in (None, 1):
            raise ValueError("the forced blocks' kernel runs without splits")
        num_splits = 1
        init_blocks, local_blocks = forced
        local_o = torch.empty(b, tq, hq, block_d, dtype=torch.float32, device=q.device)
        local_lse = torch.empty(b, hq, tq, dtype=torch.float32, device=q.device)
        block_m = pow2(local_block_m)
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
            LOG2E / math.sqrt(d),
            G=g,
            BLOCK_SIZE=block_size,
            INIT_BLOCKS=init_blocks,
            LOCAL_BLOCKS=local_blocks,
            BLOCK_M=block_m,
            BLOCK_N=min(pow2(block_n), pow2(block_size)),
            BLOCK_D=block_d,
            num_warps=4,
            num_stages=2,
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
        LOG2E / math.sqrt(d),
        G=g,
        BLOCK_SIZE=block_size,
        BLOCK_G=block_g,
        BLOCK_N=min(pow2(block_n), pow2(block_size)),
        BLOCK_D=block_d,
        EVEN_D=block_d == d,
        SPLIT=split,
        LOCAL_DONE=forced is not None,
        num_warps=4,
        num_stages=2,
        **pdl_args(q.device),
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
            BLOCK_S=min(pow2(splits), MERGE_SPLITS_PER_LOAD),
            num_warps=4,
            **pdl_args(q.device),
        )
    return out
