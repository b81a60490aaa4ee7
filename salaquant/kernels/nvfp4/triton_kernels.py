"""Triton NVFP4 weight-only GEMM ``y = x @ W^T`` (x fp16 / bf16 / fp32, fp32 accumulation, output ``x.dtype``).

Kernels:

* ``_nvfp4_dot_kernel``: tensor-core tiles computed as ``y^T = W @ x^T`` (the dequantized weight is the left
  operand, the activations the right one), with split-K. With ``BLOCK_M = 16`` it is the decode path
  (M <= 16); with larger tiles the prefill path.
* ``nvfp4_paired_gemv_kernel`` (``paired_gemv``): split-K GEMV on paired fp16 arithmetic, the default for one
  fp16/bf16 activation row (``PAIRED_TILE``, ``PAIRED_TUNED``).
* ``mma_rows_kernel`` (``../mma_rows.py``, ``NVFP4Config("rows")``): ``mma.sync`` from registers for 1 to 8
  fp16/bf16 rows, the default for 2 to ``ROWS_MAX_M`` rows of weights with ``ROWS_MIN_N`` outputs or more.
* ``_nvfp4_dequant_kernel``: the ``[N, K]`` weight in the activation dtype, for ``F.linear`` from
  ``DEQUANT_MIN_M`` rows on (``matmul``).

Decoding (in registers, integer ops only, no lookup table):

* the packed weight is read as 32-bit words, eight E2M1 codes each (code ``i`` at bits ``4i``, i.e. input
  ``k0 + i``). Codes ``i`` and ``i + 4`` sit 16 bits apart, so two shifts and two masks build one word that
  holds both as 16-bit patterns: sign to bit 15, the three magnitude bits ``e1 e0 m`` to the low two exponent
  bits and the top mantissa bit. As fp16 (``m`` at bit 9) a pattern is exactly ``e2m1 * 2**-14``, as bf16
  (``m`` at bit 6) exactly ``e2m1 * 2**-126``; the code 0.5 becomes a subnormal, which is exact.
  ``tl.join`` / ``tl.reshape`` put the values back in K order.
* an E4M3 byte's seven magnitude bits are moved to fp16 bits 7-13, which is exactly ``value * 2**-8``
  (subnormal scales included); 0x7F / 0xFF are mapped to NaN. The fp8 bytes are read as uint8 because
  Triton's interpreter decodes ``float8e4nv`` 0x7F / 0xFF as +-480 instead of NaN (checked with triton 3.9);
  the integer decode is exact for all 256 bytes everywhere.
* each block scale is brought to the half type as ``scale * 2**7`` (fp16) or ``scale * 2**119`` (bf16), so
  the dequantized tile ``e2m1 * scale * 2**-7`` is exact in fp16 and bf16 (at most 6 significant bits, between
  2**-17 and 21). The global scale is applied once to the fp32 accumulator as ``weight_scale_2 * 2**7``.

The tensor-core kernel makes the dequantized weight the left ``tl.dot`` operand: on Hopper that is wgmma's
register operand, and ``x^T`` is the shared-memory operand whose width (wgmma's N, 16 to 256) is BLOCK_M, so
M = 1 pads to 16 columns rather than to a 64-row tile. Tiles that divide N and K are compiled without masks
(EVEN_N / EVEN_K).

Split-K without a reduction launch (``../split_k.py``): the split that arrives last sums the partials in split
order and applies the global scale. The counters live in a cached, zero-initialised int32 buffer per device and
stream; call once before CUDA-graph capture so that it exists.

Offsets are 32-bit: each of ``x``, ``weight``, the output and the split-K workspace must have fewer than
2**31 elements.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..backend import DEQUANT_MIN_M
from ..counters import arrival_counters
from ..device import INTERPRET as _INTERPRET
from ..device import cuda_facts as _cuda_facts
from ..device import pdl_launch, resident_programs
from ..host import cdiv, pair_aligned
from ..mma_rows import check_launch, mma_rows_kernel
from ..split_k import finish_split_k, k_slice
from .paired_gemv import nvfp4_paired_gemv_kernel
from .reference import check_operands

__all__ = [
    "ROWS_MAX_M",
    "ROWS_MIN_N",
    "NVFP4Config",
    "default_config",
    "matmul",
    "nvfp4_dequantize_triton",
    "nvfp4_matmul_triton",
]

ROWS_MAX_M = 2
"""Largest M (from 2) for which ``default_config`` picks the ``mma.sync`` row kernel (``"rows"``) for at
least ``ROWS_MIN_N`` outputs: at more rows its range read of the activations makes one pass per row, and the
tensor-core kernel is as fast."""
ROWS_MIN_N = 8192
"""Fewest outputs for which ``default_config`` picks the row kernel (down and o_proj, 4096, gain nothing)."""

PAIRED_TILE = (32, 512)
"""``(block_n, block_k)`` of the paired GEMV that ``default_config`` picks for one fp16/bf16 activation row, with 4
warps and the next K tile prefetched (``PAIRED_PREFETCH``): small tiles keep the registers (and so the programs per
SM) that the prefetch costs."""
PAIRED_PREFETCH = True
PAIRED_PROGRAMS_PER_SM = 4
"""``default_config`` splits K into the most pieces (a power of two) whose programs number at most this many per SM
(and fit in one wave)."""
PAIRED_TUNED: dict[tuple[int, int, int], tuple[int, int, int, int, bool]] = {
    (9, 16384, 4096): (64, 512, 4, 8, False),
    (9, 4096, 4096): (32, 1024, 4, 1, True),
}
"""``(block_n, block_k, warps, split_k, prefetch)`` of the paired GEMV keyed by ``(compute capability major, K, N)``,
measured on an NVIDIA H200: SALA's down and o_proj, where a sweep found a faster launch than the default."""

_TILE_SHIFT: tl.constexpr = tl.constexpr(2.0**7)
"""The half tile holds ``W / (weight_scale_2 * _TILE_SHIFT)``."""
_FP16_SCALE_UP: tl.constexpr = tl.constexpr(2.0**7)
_BF16_SCALE_UP: tl.constexpr = tl.constexpr(2.0**119)
_POISON_WORKSPACE = False
"""Fill the split-K workspace with NaN before each launch (for tests)."""
_EMULATE_PAIRED = False
"""Run the interpreter's emulation of the paired GEMV's fp16 pair operations (and of the row kernel's PTX, when a
config picks it) on the GPU too (for tests)."""


# ---------------------------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _e4m3_to_f32(s):
    """fp32 value of float8_e4m3fn bytes ``s`` (uint8), exact; 0x7F and 0xFF give NaN."""
    v = s.to(tl.uint16)
    bits = ((v << 8) & 0x8000) | ((v << 7) & 0x3F80)
    f = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((v & 0x7F) == 0x7F, float("nan"), f)


@triton.jit
def _e2m1_pair(w, I: tl.constexpr, BF16: tl.constexpr):
    """Codes ``I`` and ``I + 4`` of uint32 words ``w`` (eight codes each) as two half tensors, fp16
    ``e2m1 * 2**-14`` or bf16 ``e2m1 * 2**-126``, joined along a new last axis."""
    SH: tl.constexpr = 4 * I
    if BF16:
        MAG: tl.constexpr = 6
        mag_mask = 0x01C001C0
    else:
        MAG: tl.constexpr = 9
        mag_mask = 0x0E000E00
    if MAG >= SH:  # noqa: SIM108 (a constexpr branch)
        mag = (w << (MAG - SH)) & mag_mask
    else:
        mag = (w >> (SH - MAG)) & mag_mask
    if SH <= 12:  # noqa: SIM108 (a constexpr branch)
        sign = (w << (12 - SH)) & 0x80008000
    else:
        sign = (w >> (SH - 12)) & 0x80008000
    bits = mag | sign
    lo = bits.to(tl.uint16)
    hi = (bits >> 16).to(tl.uint16)
    if BF16:
        return tl.join(lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True))
    else:
        return tl.join(lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True))


@triton.jit
def _weight_tile(
    w_ptr,
    s_ptr,
    offs_n,
    k0,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BF16: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """``[BLOCK_N, BLOCK_K]`` tile of ``W[offs_n, k0:k0 + BLOCK_K] / (weight_scale_2 * 2**7)``, exact, in bf16 (BF16)
    or fp16, from int32 words ``w_ptr`` (``[N, K/8]``) and FP8 bytes ``s_ptr`` (``[N, K/16]``); rows >= N and
    columns >= K are zero."""
    NW: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 16
    offs_w = k0 // 8 + tl.arange(0, NW)
    offs_g = k0 // 16 + tl.arange(0, G)
    w_ptrs = w_ptr + offs_n[:, None] * (K // 8) + offs_w[None, :]
    s_ptrs = s_ptr + offs_n[:, None] * (K // 16) + offs_g[None, :]
    if EVEN_N and EVEN_K:
        w = tl.load(w_ptrs)
        s = tl.load(s_ptrs)
    else:
        n_ok = offs_n[:, None] < N
        w = tl.load(w_ptrs, mask=n_ok & (offs_w[None, :] < K // 8), other=0)
        s = tl.load(s_ptrs, mask=n_ok & (offs_g[None, :] < K // 16), other=0)
    sf = _e4m3_to_f32(s)
    if BF16:  # noqa: SIM108 (a constexpr branch)
        sh = (sf * _BF16_SCALE_UP).to(tl.bfloat16)
    else:
        sh = (sf * _FP16_SCALE_UP).to(tl.float16)
    w = w.to(tl.uint32, bitcast=True)
    # [BLOCK_N, NW, 2 (code i or i + 4), 2 (i // 2), 2 (i % 2)] flattens to the word's K order 4 h + 2 a + b.
    t = tl.join(
        tl.join(_e2m1_pair(w, 0, BF16), _e2m1_pair(w, 2, BF16)),
        tl.join(_e2m1_pair(w, 1, BF16), _e2m1_pair(w, 3, BF16)),
    )
    t = tl.reshape(t, (BLOCK_N, G, 16)) * sh[:, :, None]
    return tl.reshape(t, (BLOCK_N, BLOCK_K))


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _nvfp4_dot_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    GROUP_N: tl.constexpr,
    BF16: tl.constexpr,
    X_F32: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M), split_k)``, SPLIT when split_k > 1. Each program accumulates a
    ``[BLOCK_N, BLOCK_M]`` tile of ``y^T`` over its share of K; output tiles are visited GROUP_N weight tiles at a
    time across all of M."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_N * num_m
    first_n = (pid // per_group) * GROUP_N
    group_size = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_size
    pid_m = (pid % per_group) // group_size

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    k_first, k_last = k_slice(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(k_first, k_last):
        k0 = kt * BLOCK_K
        w = _weight_tile(w_ptr, s_ptr, offs_n, k0, N, K, BLOCK_N, BLOCK_K, BF16, EVEN_N, EVEN_K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & (offs_k[:, None] < K), other=0.0)
        if X_F32:  # noqa: SIM108 (a constexpr branch)
            acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)

    gscale = tl.load(gs_ptr) * _TILE_SHIFT
    out_mask = (offs_n[:, None] < N) & m_ok[None, :]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT:  # y^T tiles: the rows of y along axis 1, its columns along axis 0
        tl.store(ws_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=out_mask)
        finish_split_k(out_ptr, ws_ptr, cnt_ptr, offs_m[None, :], offs_n[:, None], M, N, stride_om, pid, gscale)
    else:
        tl.store(out_ptrs, (acc * gscale).to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def _nvfp4_dequant_kernel(
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BF16: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))``; writes ``W`` tiles in the output dtype."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w = _weight_tile(w_ptr, s_ptr, offs_n, k0, N, K, BLOCK_N, BLOCK_K, BF16, EVEN_N, EVEN_K)
    w = (w.to(tl.float32) * (tl.load(gs_ptr) * _TILE_SHIFT)).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + offs_n[:, None] * K + offs_k[None, :]
    if EVEN_N and EVEN_K:
        tl.store(out_ptrs, w)
    else:
        tl.store(out_ptrs, w, mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


# ---------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NVFP4Config:
    """Launch configuration of ``nvfp4_matmul_triton``."""

    kernel: str = "dot"
    """``"dot"`` (tensor cores, any M), ``"paired"`` (paired fp16 arithmetic, ``paired_gemv``: one fp16/bf16
    activation row) or ``"rows"`` (``mma.sync`` from registers, ``../mma_rows.py``: 1 to 8 fp16/bf16 rows, bf16 of
    any magnitude scaled into fp16's range per split where needed, K a multiple of 128; ``block_n`` = 16 x column
    tiles per warp x ``num_warps``, ``split_k`` in splits of 128 inputs)."""
    block_m: int = 16
    """Activation rows per tile (``"dot"`` only; >= 16)."""
    block_n: int = 64
    """Output features per tile."""
    block_k: int = 128
    """Inputs per K step (a multiple of 16; >= 16)."""
    split_k: int = 1
    """Programs sharing one output tile along K."""
    group_n: int = 8
    """Weight tiles swept together across M (``"dot"`` only)."""
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = False
    """``"paired"`` only: request the next K tile's words and scales before this one's math."""

    def __post_init__(self) -> None:
        if self.kernel not in ("dot", "paired", "rows"):
            raise ValueError(f"kernel must be 'dot', 'paired' or 'rows', got {self.kernel!r}")
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1 or self.group_n < 1:
            raise ValueError("split_k and group_n must be >= 1")


def _programs_target(device: torch.device) -> int:
    """Programs that fill the device once (the SM count; 8 on the CPU interpreter)."""
    if device.type != "cuda":
        return 8
    return _cuda_facts(device)[0]


def _pick_split(tiles: int, k_tiles: int, target: int, min_k_tiles: int) -> int:
    """Largest power-of-two split with at most ``target`` programs, each split keeping ``min_k_tiles`` K tiles."""
    split = 1
    while tiles * split * 2 <= target and k_tiles >= 2 * split * min_k_tiles and split < 64:
        split *= 2
    return split


def _paired_wave(n: int, k: int, bn: int, bk: int, dev: torch.device, dtype: torch.dtype) -> int:
    """Programs of the default paired GEMV launch the device runs at once (4 per SM off the GPU): a split whose
    programs outnumber them would run a second, mostly empty wave."""
    if dev.type != "cuda" or _INTERPRET:
        return 4 * _programs_target(dev)
    return _paired_resident(n, k, bn, bk, dev, dtype, not _EMULATE_PAIRED)


@functools.cache
def _paired_resident(n: int, k: int, bn: int, bk: int, dev: torch.device, dtype: torch.dtype, asm: bool) -> int:
    """``resident_programs`` of the default paired GEMV launch, once per shape, tile, device and dtype (its meta is
    built and sorted once, not on every call of ``default_config``)."""
    meta = {
        "BLOCK_N": bn,
        "BLOCK_B": bk // 16,
        "SPLIT": True,
        "BF16": dtype == torch.bfloat16,
        "ASM": asm,
        "EVEN": n % bn == 0 and k % bk == 0,
        "PREFETCH": PAIRED_PREFETCH,
        "num_warps": 4,
        "num_stages": 1,
    }
    args = (dtype, torch.int32, torch.uint8, torch.float32, dtype, torch.float32, torch.int32, n, k)
    return resident_programs(nvfp4_paired_gemv_kernel, args, meta, dev)


def _paired_config(n: int, k: int, dev: torch.device, dtype: torch.dtype) -> NVFP4Config:
    """The paired GEMV's launch for one row: ``PAIRED_TUNED`` where the GPU and shape have an entry, else
    ``PAIRED_TILE`` split to at most ``PAIRED_PROGRAMS_PER_SM`` programs per SM within one wave."""
    if dev.type == "cuda":
        tuned = PAIRED_TUNED.get((_cuda_facts(dev)[1], k, n))
        if tuned is not None:
            bn, bk, warps, split, prefetch = tuned
            return NVFP4Config("paired", block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=1,
                               prefetch=prefetch)  # fmt: skip
    bn, bk = PAIRED_TILE
    target = min(PAIRED_PROGRAMS_PER_SM * _programs_target(dev), _paired_wave(n, k, bn, bk, dev, dtype))
    split = _pick_split(cdiv(n, bn), cdiv(k, bk), target, 1)
    return NVFP4Config("paired", block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=1,
                       prefetch=PAIRED_PREFETCH)  # fmt: skip


def default_config(
    m: int, n: int, k: int, device: torch.device | str = "cuda", dtype: torch.dtype | None = None
) -> NVFP4Config:
    """Launch configuration used when none is given (``dtype``: the activations').

    One fp16 or bf16 row: the paired-fp16 GEMV, ``PAIRED_TILE`` (32 rows x 512 inputs), 4 warps, the next tile
    prefetched, split-K up to 4 programs per SM in one wave (``PAIRED_TUNED`` where tuned).

    2 to ``ROWS_MAX_M`` fp16/bf16 rows of a weight with at least ``ROWS_MIN_N`` outputs (K a multiple of 128): the
    ``mma.sync`` row kernel, ``MMA_ROWS_CONFIG``, split to at most 4 programs per SM.

    Other decode (M <= 16): 16 x 64 x 128 tiles, 4 warps, no software pipelining, so that several programs share
    an SM and their loads overlap; split-K up to 4 programs per SM. Prefill: 64-, 128- or 256-row tiles (more rows
    per dequantized weight tile), 8 warps, 3 stages, split-K up to one program per SM (``benchmarks/kernels_nvfp4.py
    --sweep`` times the alternatives).
    """
    dev = torch.device(device)
    sms = _programs_target(dev)
    if m == 1 and dtype in (torch.float16, torch.bfloat16):
        return _paired_config(n, k, dev, dtype)
    if 2 <= m <= ROWS_MAX_M and dtype in (torch.float16, torch.bfloat16) and k % 128 == 0 and n >= ROWS_MIN_N:
        bn = 16 * MMA_ROWS_CONFIG["tiles"] * MMA_ROWS_CONFIG["num_warps"]
        split = _rows_split(n, k, bn, dev)
        return NVFP4Config("rows", block_n=bn, split_k=split, num_warps=MMA_ROWS_CONFIG["num_warps"], num_stages=1)
    if m <= 16:
        bm, bn, bk, warps, stages, target, min_k = 16, 64, 128, 4, 1, 4 * sms, 2
    elif m <= 64:
        bm, bn, bk, warps, stages, target, min_k = 64, 128, 128, 8, 3, sms, 4
    elif m <= 512:
        bm, bn, bk, warps, stages, target, min_k = 128, 128, 64, 8, 3, sms, 4
    else:
        bm, bn, bk, warps, stages, target, min_k = 256, 128, 64, 8, 3, sms, 4
    tiles = cdiv(m, bm) * cdiv(n, bn)
    split = _pick_split(tiles, cdiv(k, bk), target, min_k)
    return NVFP4Config("dot", block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages)


def _check_device(t: torch.Tensor) -> None:
    """RuntimeError unless ``t`` is a CUDA tensor or the Triton interpreter is on."""
    if not t.is_cuda and not _INTERPRET:
        raise RuntimeError("the Triton NVFP4 kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")


def _prepare(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | float, device: torch.device
) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(N, K, weight as int32 words [N, K/8], scale bytes, global scale [1] fp32)``, contiguous, on ``device``."""
    n, k = check_operands(weight, weight_scale, weight_scale_2)
    if weight.device != device:
        raise ValueError(f"weight is on {weight.device}, activations on {device}")
    if weight.numel() >= 2**31 or n * k >= 2**31:
        raise ValueError("the NVFP4 kernels use 32-bit offsets; the weight is too large")
    scale_bytes = weight_scale.view(torch.uint8) if weight_scale.dtype != torch.uint8 else weight_scale
    gs = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=device).reshape(1)
    weight = weight.contiguous()
    try:
        words = weight.view(torch.int32)
    except RuntimeError:  # storage offset not a multiple of 4 bytes
        words = weight.clone().view(torch.int32)
    return n, k, words, scale_bytes.contiguous(), gs


def nvfp4_matmul_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    config: NVFP4Config | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``y [..., N] = x [..., K] @ W^T`` with fused NVFP4 dequantization; ``out`` (contiguous, ``y``'s shape and
    dtype) receives the result when given. ``pdl`` turns on programmatic dependent launch for the one-row and row
    kernels (``pdl_launch``)."""
    _check_device(x)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    n, k, w, s, gs = _prepare(weight, weight_scale, weight_scale_2, x.device)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    x2 = pair_aligned(x.reshape(-1, k))
    m = x2.shape[0]
    out_shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != out_shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {out_shape}")
    if m == 0:
        return out
    if m * k >= 2**31 or m * n >= 2**31:
        raise ValueError("the NVFP4 kernels use 32-bit offsets; the activations are too large")
    cfg = config or default_config(m, n, k, x.device, x.dtype)
    out2 = out.view(m, n)
    if cfg.kernel == "rows":
        _check_rows(x2, k)
        tiles = cfg.block_n // (16 * cfg.num_warps)
        _launch_rows(x2, w, s, gs, out2, n, k, cfg.split_k, tiles, cfg.num_warps, _EMULATE_PAIRED, pdl)
        return out
    split = cfg.split_k
    if split > 1:
        if split * m * n >= 2**31:
            raise ValueError("split-K workspace too large for 32-bit offsets; lower split_k")
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        if _POISON_WORKSPACE:
            ws.fill_(float("nan"))
    else:
        ws = out2
    bf16 = x.dtype == torch.bfloat16
    if cfg.kernel == "paired":
        if m != 1 or x.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the paired GEMV takes one fp16/bf16 activation row, got {m} rows of {x.dtype}")
        cnt = arrival_counters(x.device, cdiv(n, cfg.block_n)) if split > 1 else gs
        nvfp4_paired_gemv_kernel[(cdiv(n, cfg.block_n), split)](
            x2, w, s, gs, out2, ws, cnt, n, k, BLOCK_N=cfg.block_n, BLOCK_B=cfg.block_k // 16, SPLIT=split > 1,
            BF16=bf16, ASM=not (_INTERPRET or _EMULATE_PAIRED), EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0,
            PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device, pdl),
        )  # fmt: skip
    else:
        tiles = cdiv(n, cfg.block_n) * cdiv(m, cfg.block_m)
        cnt = arrival_counters(x.device, tiles) if split > 1 else gs
        _nvfp4_dot_kernel[(tiles, split)](
            x2, w, s, gs, out2, ws, cnt, m, n, k, x2.stride(0), out2.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1, GROUP_N=cfg.group_n,
            BF16=bf16, X_F32=x.dtype == torch.float32, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out


MMA_ROWS_CONFIG = {"tiles": 2, "num_warps": 4}
"""The row kernel's default launch: 4 warps of 2 column tiles of 16 (128 columns per program)."""


def _check_rows(x: torch.Tensor, k: int) -> None:
    """``ValueError`` unless ``x [M, K]`` is 1 to 8 fp16/bf16 rows and K a multiple of 128 (the row kernel's
    operands for NVFP4)."""
    if x.shape[-1] != k or not 1 <= x.shape[0] <= 8 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the mma kernel takes 1 to 8 fp16/bf16 rows of {k} inputs, got {x.dtype} {list(x.shape)}")
    if k % 128:
        raise ValueError(f"the mma kernel takes K a multiple of 128, got {k}")


def _rows_split(n: int, k: int, block_n: int, device: torch.device) -> int:
    """The row kernel's default split: the largest power of two with at most 4 programs per SM."""
    return _pick_split(cdiv(n, block_n), k // 128, _programs_target(device) * 4, 1)


def _launch_rows(
    x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, gs: torch.Tensor, out: torch.Tensor, n: int, k: int,
    split_k: int, tiles: int, num_warps: int, emulate: bool, pdl: bool,
) -> None:  # fmt: skip
    """Run ``mma_rows_kernel`` on prepared operands (``_prepare``; ``x [M, K]`` and ``out [M, N]`` checked)."""
    m = x.shape[0]
    n_tiles = cdiv(n, check_launch(tiles, num_warps))
    split = max(1, min(int(split_k), k // 128))
    split = cdiv(k // 128, cdiv(k // 128, split))  # no empty split
    ws = torch.empty((split, m, n) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    if x.device.type != "cuda" or _POISON_WORKSPACE:
        ws.fill_(float("nan"))  # a read of an unwritten partial shows in the result
    mma_rows_kernel[(n_tiles, split)](
        x, w, s, gs, out, ws, arrival_counters(x.device, n_tiles), m, n, k, x.stride(0), out.stride(0),
        GROUP_SIZE=128, TILES=tiles, WARPS=num_warps, TWO=False, FP4=True, BF16=x.dtype == torch.bfloat16,
        ASM=not (_INTERPRET or emulate), num_warps=num_warps, num_stages=1,
        **pdl_launch(x.device, pdl),
    )  # fmt: skip


def nvfp4_dequantize_triton(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    block_k: int = 128,
) -> torch.Tensor:
    """``[N, K]`` weight ``e2m1 * scale * weight_scale_2`` in ``dtype`` (fp16, bf16 or fp32; one fp32 rounding of
    ``e2m1 * scale * weight_scale_2``, then the cast)."""
    _check_device(weight)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be fp16, bf16 or fp32, got {dtype}")
    n, k, w, s, gs = _prepare(weight, weight_scale, weight_scale_2, weight.device)
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=weight.device)
    elif tuple(out.shape) != (n, k) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {(n, k)}")
    grid = (cdiv(n, block_n), cdiv(k, block_k))
    _nvfp4_dequant_kernel[grid](
        w, s, gs, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k, BF16=dtype == torch.bfloat16,
        EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0,
    )  # fmt: skip
    return out


def matmul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | float
) -> torch.Tensor:
    """``y [..., N] = x [..., K] @ W^T`` on the path that suits the rows ``M``: the fused kernels
    (``nvfp4_matmul_triton``) below ``DEQUANT_MIN_M``, the weight dequantized in ``x.dtype`` once and ``F.linear``
    from there on (compute-bound prefill)."""
    if x.numel() // max(x.shape[-1], 1) < DEQUANT_MIN_M:
        return nvfp4_matmul_triton(x, weight, weight_scale, weight_scale_2)
    k = check_operands(weight, weight_scale, weight_scale_2)[1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    return F.linear(x, nvfp4_dequantize_triton(weight, weight_scale, weight_scale_2, dtype=x.dtype))
