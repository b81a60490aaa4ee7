"""Launch configurations of the Triton NVFP4 GEMM: `NVFP4Config` and `default_config`, which picks the kernel
and its tiles and split-K by the rows, the shape, the device and the activation dtype (tuned entries measured on
an NVIDIA H200)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..device import INTERPRET as _INTERPRET
from ..device import cuda_facts as _cuda_facts
from ..device import resident_programs
from ..host import cdiv
from .paired_gemv import nvfp4_paired_gemv_kernel

__all__ = [
    "MMA_ROWS_CONFIG",
    "PAIRED_TILE",
    "PAIRED_TUNED",
    "ROWS_MAX_M",
    "ROWS_MIN_N",
    "NVFP4Config",
    "default_config",
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
MMA_ROWS_CONFIG = {"tiles": 2, "num_warps": 4}
"""The row kernel's default launch: 4 warps of 2 column tiles of 16 (128 columns per program)."""
_EMULATE_PAIRED = False
"""Run the interpreter's emulation of the paired GEMV's fp16 pair operations (and of the row kernel's PTX, when a
config picks it) on the GPU too (for tests; the launchers read it here)."""


@dataclasses.dataclass(frozen=True)
class NVFP4Config:
    """Launch configuration of ``nvfp4_matmul_triton``."""

    kernel: str = "dot"
    """``"dot"`` (tensor cores, any M), ``"paired"`` (paired fp16 arithmetic, ``paired_gemv``: one fp16/bf16
    activation row) or ``"rows"`` (``mma.sync`` from registers, ``../mma_rows.py``: 1 to 64 fp16/bf16 rows, bf16 of
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

    Other decode (M <= 16) and batches up to 64 rows: 16 x 64 x 128 (64 x 64 x 128) tiles, 4 warps, no software
    pipelining, so that several programs share an SM and their loads overlap; split-K up to 4 programs per SM.
    Larger batches and prefill: 128- or 256-row tiles (more rows per dequantized weight tile), 8 warps, 3 stages,
    split-K up to one program per SM (``benchmarks/kernels_nvfp4.py --sweep`` times the alternatives).
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
        bm, bn, bk, warps, stages, target, min_k = 64, 64, 128, 4, 1, 4 * sms, 2
    elif m <= 512:
        bm, bn, bk, warps, stages, target, min_k = 128, 128, 64, 8, 3, sms, 4
    else:
        bm, bn, bk, warps, stages, target, min_k = 256, 128, 64, 8, 3, sms, 4
    tiles = cdiv(m, bm) * cdiv(n, bn)
    split = _pick_split(tiles, cdiv(k, bk), target, min_k)
    return NVFP4Config("dot", block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages)


def _rows_split(n: int, k: int, block_n: int, device: torch.device) -> int:
    """The row kernel's default split: the largest power of two with at most 4 programs per SM."""
    return _pick_split(cdiv(n, block_n), k // 128, _programs_target(device) * 4, 1)
