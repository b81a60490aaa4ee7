"""Triton kernels for Simple GLA: chunked prefill (chunk 64) and fused recurrent decode.

Layout as in the reference (the model package's ``gla.py``), which checks the shapes before it calls these:
``q, k: [B, T, H, K]``, ``v: [B, T, H, V]`` (last dim contiguous, other strides free), state ``[B, H, K, V]``
fp32, ``g_gamma: [H]`` log decay ``<= 0``. Outputs are fp32 unless ``chunk_fwd`` is asked for another dtype. The
chunk kernels' ``tl.dot`` on fp32 operands runs in TF32, as fla's.

Prefill runs two kernels over chunks of 64 tokens:

* ``_chunk_state_kernel``, grid ``(K tiles, V tiles, B*H)``: walks the chunks in order with an fp32
  state tile, ``h_next = exp(g L) h + sum_j exp(g (L-1-j)) k_j v_j^T``, and stores the state at the start
  of every chunk into ``[B, H, NC, K, V]`` (bf16 for bf16 inputs, fp32 otherwise).
* ``_chunk_output_kernel``, grid ``(V tiles, chunks, B*H)``:
  ``o_i = scale * (exp(g (i+1)) q_i^T h_c + sum_{j<=i} exp(g (i-j)) (q_i . k_j) v_j)`` with ``h_c`` the
  stored state at the start of the chunk.

Decode runs ``_recurrent_kernel``, grid ``(V tiles, B*H)``: one program holds a ``[K, BV]`` fp32 state
tile (the whole K, so no split-K reduction) and steps through the T tokens:
``S = exp(g) S + k v^T``, ``o = scale * q^T S``.

Every decay factor is ``exp`` of a non-positive number computed in fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..device import INTERPRET as _INTERPRET
from ..host import cdiv, next_power_of_2

__all__ = ["CHUNK", "chunk_fwd", "recurrent_fwd"]

CHUNK = 64
"""Chunk length of the prefill kernels."""

Config = tuple[int, int, int, int]
"""A launch configuration ``(BK, BV, num_warps, num_stages)``."""

STATE_CONFIGS: tuple[Config, ...] = (
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 64, 8, 3),
    (64, 64, 8, 4),
    (32, 64, 4, 3),
    (64, 32, 4, 3),
    (32, 32, 4, 3),
    (32, 32, 2, 4),
    (128, 32, 8, 3),
)
"""Autotune space of ``_chunk_state_kernel`` on the GPU."""

OUTPUT_CONFIGS: tuple[Config, ...] = (
    (128, 64, 4, 2),
    (128, 64, 8, 2),
    (64, 64, 4, 3),
    (64, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 128, 8, 3),
    (64, 128, 4, 3),
    (64, 32, 4, 3),
)
"""Autotune space of ``_chunk_output_kernel`` on the GPU (one candidate that miscompiled for a bf16 output is not
among them: ``docs/kernels.md``)."""

TUNED_CONFIGS: dict[tuple[int, int, int, torch.dtype, torch.dtype], tuple[Config, Config]] = {
    # the runtime's and the calibration engine's case: fp32 operands (or 16-bit ones computed in fp32), SALA head
    # dims; the output stored as fp32 or as the activations' bf16 (the same tiles: tuned for the fp32 output)
    (9, 128, 128, torch.float32, torch.float32): ((32, 64, 4, 3), (128, 64, 4, 2)),
    (9, 128, 128, torch.float32, torch.bfloat16): ((32, 64, 4, 3), (128, 64, 4, 2)),
    # bf16 operands with bf16 dots; bf16 in and out is fla's case
    (9, 128, 128, torch.bfloat16, torch.float32): ((64, 64, 8, 4), (128, 64, 4, 2)),
    (9, 128, 128, torch.bfloat16, torch.bfloat16): ((64, 64, 8, 4), (64, 128, 4, 3)),
}
"""State and output configurations chosen by autotuning on an NVIDIA H200 (compute capability 9), keyed by
``(compute capability major, K, V, compute dtype, output dtype)``. A listed case launches them directly instead of
compiling and timing every candidate on its first call (about ten seconds of a quantization run);
``SALAQUANT_GLA_AUTOTUNE=1`` autotunes it anyway."""

_FORCE_AUTOTUNE = os.environ.get("SALAQUANT_GLA_AUTOTUNE", "0") == "1"

_INTERPRET_CONFIG: Config = (32, 32, 4, 1)
"""The one configuration under the interpreter, where autotuning would run every candidate on the CPU."""


def _fit(config: Config, dk: int, dv: int) -> Config:
    """Clamp the tiles to K and V rounded up to a power of two (at least 16, the smallest ``tl.dot`` side)."""
    bk, bv, warps, stages = config
    full_k, full_v = max(16, next_power_of_2(dk)), max(16, next_power_of_2(dv))
    return min(bk, full_k), min(bv, full_v), warps, stages


def _triton_configs(options: tuple[Config, ...]) -> list[triton.Config]:
    if _INTERPRET:
        options = (_INTERPRET_CONFIG,)
    return [triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s) for bk, bv, w, s in options]


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """``early_config_prune`` of both prefill kernels: clamp every candidate's tiles to the head dims and drop
    the duplicates this makes.

    A tile wider than K or V would only add masked lanes, and several such candidates collapse into one.
    """
    dims = {**named_args, **kwargs}
    dk, dv = int(dims["K"]), int(dims["V"])
    seen: dict[Config, triton.Config] = {}
    for c in configs:
        fitted = _fit((c.kwargs["BK"], c.kwargs["BV"], c.num_warps, c.num_stages), dk, dv)
        if fitted not in seen:
            bk, bv, warps, stages = fitted
            seen[fitted] = triton.Config({"BK": bk, "BV": bv}, num_warps=warps, num_stages=stages)
    return list(seen.values())


@triton.jit
def _initial_state(h0_ptrs, mask, BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr):
    """The fp32 ``[BK, BV]`` state tile a program starts from: loaded at ``h0_ptrs`` (``mask``: the tile's part inside
    ``[K, V]``) when there is an initial state, zeros otherwise."""
    if USE_H0:  # noqa: SIM108 (a constexpr branch)
        state = tl.load(h0_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    return state


@triton.autotune(
    configs=_triton_configs(STATE_CONFIGS),
    key=["K", "V", "UPCAST"],
    prune_configs_by={"early_config_prune": _prune_configs},
)
@triton.jit
def _chunk_state_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    h_ptr,
    h0_ptr,
    ht_ptr,
    T,
    H,
    NC,
    s_kb,
    s_kt,
    s_kh,
    s_vb,
    s_vt,
    s_vh,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    i_k = tl.program_id(0)
    i_v = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    g = tl.load(g_ptr + i_h).to(tl.float32)

    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    pos = tl.arange(0, BT)

    state = _initial_state(h0_ptr + i_bh * K * V + off_kv, m_kv, BK, BV, USE_H0)

    k_base = k_ptr + i_b * s_kb + i_h * s_kh
    v_base = v_ptr + i_b * s_vb + i_h * s_vh
    # h holds B*H*NC*K*V elements: its offset is int64 and advances by pointer increments, never i_c * K * V
    p_h = h_ptr + i_bh * NC * K * V + off_kv
    for i_c in range(NC):
        tl.store(p_h, state.to(h_ptr.dtype.element_ty), mask=m_kv)
        p_h += K * V
        t0 = i_c * BT
        rows = (t0 + pos).to(tl.int64)
        m_t = rows < T
        # k^T tile [BK, BT] read transposed from memory, so that no tl.trans feeds tl.dot
        b_kt = tl.load(k_base + o_k[:, None] + rows[None, :] * s_kt, mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_v = tl.load(v_base + rows[:, None] * s_vt + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        if UPCAST:  # 16-bit storage, fp32 math: the same values as fp32 inputs
            b_kt = b_kt.to(tl.float32)
            b_v = b_v.to(tl.float32)
        # tokens of this chunk: BT, fewer in the last one
        length = tl.minimum(T - t0, BT).to(tl.float32)
        # exp(g (L - 1 - j)) for j < L, 0 past the end of the sequence
        k_decay = tl.where(m_t, tl.exp(g * tl.maximum(length - 1.0 - pos.to(tl.float32), 0.0)), 0.0)
        b_kt = (b_kt.to(tl.float32) * k_decay[None, :]).to(b_kt.dtype)
        state = state * tl.exp(g * length) + tl.dot(b_kt, b_v, input_precision="tf32")

    if STORE_HT:
        tl.store(ht_ptr + i_bh * K * V + off_kv, state, mask=m_kv)


@triton.autotune(
    configs=_triton_configs(OUTPUT_CONFIGS),
    key=["K", "V", "UPCAST"],
    prune_configs_by={"early_config_prune": _prune_configs},
)
@triton.jit
def _chunk_output_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    h_ptr,
    o_ptr,
    scale,
    T,
    H,
    NC,
    s_qb,
    s_qt,
    s_qh,
    s_kb,
    s_kt,
    s_kh,
    s_vb,
    s_vt,
    s_vh,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    UPCAST: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    g = tl.load(g_ptr + i_h).to(tl.float32)

    pos = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    q_base = q_ptr + i_b * s_qb + i_h * s_qh
    k_base = k_ptr + i_b * s_kb + i_h * s_kh
    v_base = v_ptr + i_b * s_vb + i_h * s_vh
    h_base = h_ptr + (i_bh * NC + i_c) * K * V

    # exp(g (i + 1)) on the carried state; exp(g (i - j)) for j <= i inside the chunk
    q_decay = tl.exp(g * (pos + 1).to(tl.float32))
    diff = pos[:, None] - pos[None, :]
    causal = diff >= 0
    intra_decay = tl.where(causal, tl.exp(g * tl.where(causal, diff, 0).to(tl.float32)), 0.0)

    rows = i_c.to(tl.int64) * BT + pos
    m_t = rows < T
    b_inter = tl.zeros([BT, BV], dtype=tl.float32)
    b_attn = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(q_base + rows[:, None] * s_qt + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        # k^T tile [BK, BT] read transposed from memory, so that no tl.trans feeds tl.dot
        b_kt = tl.load(k_base + o_k[:, None] + rows[None, :] * s_kt, mask=m_k[:, None] & m_t[None, :], other=0.0)
        if UPCAST:
            b_q = b_q.to(tl.float32)
            b_kt = b_kt.to(tl.float32)
        b_h = tl.load(h_base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_inter += tl.dot(b_q.to(b_h.dtype), b_h, input_precision="tf32")
        b_attn += tl.dot(b_q, b_kt, input_precision="tf32")
    b_v = tl.load(v_base + rows[:, None] * s_vt + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    if UPCAST:
        b_v = b_v.to(tl.float32)
    b_o = b_inter * q_decay[:, None] + tl.dot((b_attn * intra_decay).to(b_v.dtype), b_v, input_precision="tf32")
    o_ptrs = o_ptr + ((i_b * T + rows[:, None]) * H + i_h) * V + o_v[None, :]
    tl.store(o_ptrs, (b_o * scale).to(o_ptr.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    o_ptr,
    h0_ptr,
    ht_ptr,
    scale,
    T,
    H,
    s_qb,
    s_qt,
    s_qh,
    s_kb,
    s_kt,
    s_kh,
    s_vb,
    s_vt,
    s_vh,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    decay = tl.exp(tl.load(g_ptr + i_h).to(tl.float32))

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]

    state = _initial_state(h0_ptr + i_bh * K * V + off_kv, m_kv, BK, BV, USE_H0)

    # per-token pointers advance by increments (64-bit), never t * stride in int32
    p_q = q_ptr + i_b * s_qb + i_h * s_qh + o_k
    p_k = k_ptr + i_b * s_kb + i_h * s_kh + o_k
    p_v = v_ptr + i_b * s_vb + i_h * s_vh + o_v
    p_o = o_ptr + (i_b * T * H + i_h) * V + o_v
    for _ in range(T):
        b_q = tl.load(p_q, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
        state = state * decay + b_k[:, None] * b_v[None, :]
        b_o = tl.sum(state * b_q[:, None], axis=0) * scale
        tl.store(p_o, b_o, mask=m_v)
        p_q += s_qt
        p_k += s_kt
        p_v += s_vt
        p_o += H * V

    if STORE_HT:
        tl.store(ht_ptr + i_bh * K * V + off_kv, state, mask=m_kv)


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, g_gamma: Tensor, initial_state: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """One dtype for q/k/v with unit stride on the last dim; fp32 contiguous g_gamma and state."""
    dtype = q.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or k.dtype != dtype or v.dtype != dtype:
        dtype = torch.float32
    q, k, v = (x.to(dtype) for x in (q, k, v))
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g = g_gamma.to(device=q.device, dtype=torch.float32).contiguous()
    if initial_state is not None:
        initial_state = initial_state.to(device=q.device, dtype=torch.float32).contiguous()
    return q, k, v, g, initial_state


def _output(q: Tensor, v: Tensor, dtype: torch.dtype) -> tuple[tuple[int, int, int, int, int], Tensor]:
    """The sizes ``(B, T, H, K, V)`` of the prepared inputs and the uninitialised output ``o [B, T, H, V]``."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    return (b, t, h, dk, dv), torch.empty(b, t, h, dv, dtype=dtype, device=q.device)


def _tuned(
    device: torch.device, dk: int, dv: int, dtype: torch.dtype, out_dtype: torch.dtype
) -> tuple[Config, Config] | None:
    """The measured configurations of this case, or ``None`` to autotune."""
    if _INTERPRET or _FORCE_AUTOTUNE or device.type != "cuda":
        return None
    major = torch.cuda.get_device_capability(device)[0]
    return TUNED_CONFIGS.get((major, dk, dv, dtype, out_dtype))


def _pinned(kernel: triton.runtime.Autotuner, config: Config | None, dk: int, dv: int) -> tuple[object, dict]:
    """The autotuned kernel, or its plain jit function with the launch meta-parameters of ``config``."""
    if config is None:
        return kernel, {}
    bk, bv, warps, stages = _fit(config, dk, dv)
    return kernel.fn, {"BK": bk, "BV": bv, "num_warps": warps, "num_stages": stages}


def chunk_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_gamma: Tensor,
    scale: float,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    configs: tuple[Config, Config] | None = None,
    out_dtype: torch.dtype = torch.float32,
    upcast: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Chunked prefill (chunk 64). Returns ``o [B, T, H, V]`` (fp32 unless ``out_dtype``) and the fp32 final
    state if asked.

    fp32 inputs run TF32 dots; bf16/fp16 inputs their own tensor-core dots, unless ``upcast`` (the model's fp32
    math): then their tiles become fp32 as they are loaded and everything runs as for fp32 inputs holding the same
    values (the same results up to the order of fp32 operations, half the bytes read, no separate casts).
    ``configs`` pins the state and output kernels to one ``(BK, BV, num_warps, num_stages)`` each (tiles clamped to
    K and V) instead of autotuning them, so that each configuration of ``STATE_CONFIGS`` / ``OUTPUT_CONFIGS`` can be
    run on its own; left ``None``, a case listed in ``TUNED_CONFIGS`` uses its entry and any other case is autotuned.
    """
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    q, k, v, g, h0 = _prepare(q, k, v, g_gamma, initial_state)
    (b, t, h, dk, dv), o = _output(q, v, out_dtype)
    if t == 0:
        if not output_final_state:
            return o, None
        final = h0.clone() if h0 is not None else torch.zeros(b, h, dk, dv, dtype=torch.float32, device=q.device)
        return o, final
    if configs is None and _INTERPRET:
        configs = (_INTERPRET_CONFIG, _INTERPRET_CONFIG)  # fitted below (the autotuner prunes only a choice)
    upcast = upcast and q.dtype != torch.float32
    compute_dtype = torch.float32 if upcast else q.dtype
    if configs is None:
        configs = _tuned(q.device, dk, dv, compute_dtype, out_dtype)
    nc = cdiv(t, CHUNK)
    h_dtype = torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float32
    states = torch.empty(b, h, nc, dk, dv, dtype=h_dtype, device=q.device)
    ht = torch.empty(b, h, dk, dv, dtype=torch.float32, device=q.device) if output_final_state else None

    def state_grid(meta: dict) -> tuple[int, int, int]:
        return (cdiv(dk, meta["BK"]), cdiv(dv, meta["BV"]), b * h)

    state_kernel, state_meta = _pinned(_chunk_state_kernel, configs[0] if configs else None, dk, dv)
    state_kernel[state_grid](
        k,
        v,
        g,
        states,
        h0 if h0 is not None else states,
        ht if ht is not None else states,
        t,
        h,
        nc,
        *k.stride()[:3],
        *v.stride()[:3],
        K=dk,
        V=dv,
        BT=CHUNK,
        USE_H0=h0 is not None,
        STORE_HT=ht is not None,
        UPCAST=upcast,
        **state_meta,
    )

    def output_grid(meta: dict) -> tuple[int, int, int]:
        return (cdiv(dv, meta["BV"]), nc, b * h)

    output_kernel, output_meta = _pinned(_chunk_output_kernel, configs[1] if configs else None, dk, dv)
    output_kernel[output_grid](
        q,
        k,
        v,
        g,
        states,
        o,
        float(scale),
        t,
        h,
        nc,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        K=dk,
        V=dv,
        BT=CHUNK,
        UPCAST=upcast,
        **output_meta,
    )
    return o, ht


def _recurrent_block_v(batch_heads: int, dv: int) -> int:
    """V tile of the decode kernel: 32, or 16 when that leaves too few programs to fill the GPU."""
    bv = min(next_power_of_2(dv), 32)
    if bv > 16 and batch_heads * cdiv(dv, bv) < 512:
        bv = 16
    return bv


def recurrent_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_gamma: Tensor,
    scale: float,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    state_out: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Fused recurrent form for short inputs (decode). Returns ``o [B, T, H, V]`` fp32 and the final state (``None``
    unless asked).

    ``state_out`` (fp32, contiguous ``[B, H, K, V]``) receives the final state, which is then returned; it may be
    ``initial_state`` itself, updated in place (each program reads its state tile before it writes the same tile).
    """
    q, k, v, g, h0 = _prepare(q, k, v, g_gamma, initial_state)
    (b, t, h, dk, dv), o = _output(q, v, torch.float32)
    ht = None
    if state_out is not None:
        if state_out.shape != (b, h, dk, dv) or state_out.dtype != torch.float32 or not state_out.is_contiguous():
            raise ValueError(f"state_out must be contiguous fp32 {(b, h, dk, dv)}, got {state_out.dtype} "
                             f"{tuple(state_out.shape)} strides {state_out.stride()}")  # fmt: skip
        ht = state_out
    elif output_final_state:
        ht = torch.empty(b, h, dk, dv, dtype=torch.float32, device=q.device)
    bk = max(16, next_power_of_2(dk))
    bv = _recurrent_block_v(b * h, dv)
    grid = (cdiv(dv, bv), b * h)
    _recurrent_kernel[grid](
        q,
        k,
        v,
        g,
        o,
        h0 if h0 is not None else o,
        ht if ht is not None else o,
        float(scale),
        t,
        h,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        K=dk,
        V=dv,
        BK=bk,
        BV=bv,
        USE_H0=h0 is not None,
        STORE_HT=ht is not None,
        num_warps=4,
    )
    return o, ht
