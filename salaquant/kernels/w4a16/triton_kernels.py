"""Launching the Triton kernels of the W4A16 GEMM on GPTQ v1 tensors (see ``reference.py`` for the layout).

Each path's kernel lives in the module of its name (``paired_gemv``, ``gemv``, ``flat``, ``tiled``,
``dequant_kernel``, and ``../mma_rows.py``; code extraction in ``codes``, word tiles in ``words``, the split-K
fix-up in ``../split_k.py``); this module sizes the grids and workspaces and picks the path. Paths, chosen by
``matmul`` from the number of activation rows ``M`` (``docs/kernels.md`` has their timings):

* ``M == 1`` with 4-bit codes and an fp16/bf16 activation, ``paired`` (``matmul_paired``): split-K GEMV on paired
  fp16 arithmetic, two weights per instruction; the rounding of each word's two 4-term sums to fp16 is its only
  departure from fp32 accumulation.
* ``M == 1`` otherwise (8-bit codes, fp32 activations), ``gemv`` (``matmul_gemv``): CUDA-core split-K GEMV.
* ``2 <= M <= MMA_ROWS_MAX_M`` (32) with 4-bit codes, fp16/bf16 activations and groups of a multiple of 32
  dividing K (or one group, K a multiple of 128: every GPTQ export of the project), ``mma_rows``
  (``matmul_mma_rows``): ``mma.sync`` fed from registers, the paired dequantization of ``paired``, fp32 products and
  sums, split-K over whole groups so that the programs fill one wave of the GPU; from 17 rows two column tiles a
  warp (``MMA_ROWS_WIDE_CONFIG``). The kernel takes groups of 8 rows, up to 64.
* ``2 <= M <= 16`` otherwise (8-bit codes, fp32 activations), ``flat`` (``matmul_flat``): split-K over short
  unrolled runs of K tiles, ``tl.dot`` on a 16-row activation tile.
* ``16 < M <= TILED_MAX_M`` otherwise, ``tiled`` (``matmul_tiled``): output tiles, each weight tile dequantized to the
  activation dtype for one ``tl.dot``; where the output tiles are fewer than the GPU's SMs, K is split among
  programs (``_tiled_split``) so that the packed weight is still read once, by every SM.
* ``M > TILED_MAX_M``: the weight is dequantized once to the activation dtype (``dequantize``) and the product
  runs in ``torch.matmul`` (from there the tiled kernel's dequantization, repeated for each row tile, costs more
  than one whole-weight pass).

The ``gemv`` and ``tiled`` launch configurations are autotuned per shape on first use (a few hundred ms per
shape): run each shape once before capturing a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ..counters import arrival_counters
from ..device import INTERPRET as _INTERPRET
from ..device import cuda_facts as _cuda_facts
from ..device import pdl_launch, resident_programs
from ..host import cdiv, next_power_of_2, pair_aligned, wave_split
from ..mma_rows import MAX_ROWS, check_launch, mma_rows_kernel, row_groups
from .codes import MAGIC
from .dequant_kernel import dequant_kernel
from .flat import flat_kernel
from .gemv import gemv_kernel
from .paired_gemv import paired_gemv_kernel
from .reference import check_operands
from .tiled import tiled_kernel

__all__ = [
    "FLAT_CONFIG",
    "MMA_ROWS_MAX_M",
    "TILED_MAX_M",
    "dequantize",
    "matmul",
    "matmul_flat",
    "matmul_gemv",
    "matmul_mma_rows",
    "matmul_paired",
    "matmul_tiled",
]

FLAT_CONFIG = {"block_n": 64, "block_k": 128, "tiles": 2, "num_warps": 4}
"""``matmul_flat`` launch: 64-column tiles, two K tiles of 128 per program, 4 warps."""

PAIRED_CONFIG = {"block_n": 256, "block_k": 64, "num_warps": 4}
"""``matmul_paired`` launch: 256 columns x 64 rows of K, 4 warps, at least ``_PAIRED_MIN_TILES`` K tiles per split."""
_PAIRED_MIN_TILES = 4

PAIRED_SUB: dict[tuple[int, int, int], int] = {(9, 4096, 32768): 64}
"""``matmul_paired``'s sub-tile width (``paired_gemv_kernel``'s ``SUB``) keyed by ``(compute capability major, K,
N)``, measured on an NVIDIA H200: the shapes where 64-column sub-tiles beat the plain tile (SALA's gate_up); every
other shape keeps the plain tile (0)."""

_DECODE_WAVES = 4  # split-K aims at this many programs per SM
_MIN_TILES_PER_SPLIT = 2  # and gives every program at least this many K tiles when it can
_CPU_SMS = 4  # stands in for the SM count under the interpreter


def _sm_count(device: torch.device) -> int:
    return _cuda_facts(device)[0] if device.type == "cuda" else _CPU_SMS


def _split_count(
    n_tiles: int, k_tiles: int, sms: int, split_k: int | None, min_tiles: int = _MIN_TILES_PER_SPLIT
) -> int:
    """Number of K splits with no empty split (the kernel recomputes the tiles per split from it); by default
    ``_DECODE_WAVES`` programs per SM where every split keeps at least ``min_tiles`` K tiles."""
    if split_k is None:
        split_k = min(k_tiles // min_tiles, cdiv(_DECODE_WAVES * sms, n_tiles))
    split_k = max(1, min(int(split_k), k_tiles))
    return cdiv(k_tiles, cdiv(k_tiles, split_k))


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
    return pair_aligned(x), qweight.contiguous(), scales.contiguous(), k, n, _kernel_group(gs, k)


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


def _split_k_grid(x: Tensor, m: int, n: int, block_n: int, splits: int):
    """Grid ``(column tiles, splits)``, fp32 partials and counters of a split-K launch of ``block_n``-column
    tiles."""
    n_tiles = cdiv(n, block_n)
    return (n_tiles, splits), _partials(x, splits, m, n), arrival_counters(x.device, n_tiles)


def _fixed_split_k(x: Tensor, m: int, n: int, k: int, block_n: int, block_k: int, split_k: int | None, min_tiles: int):
    """``_split_k_grid`` of a launch with fixed tiles, split by ``_split_count``."""
    splits = _split_count(cdiv(n, block_n), cdiv(k, block_k), _sm_count(x.device), split_k, min_tiles)
    return _split_k_grid(x, m, n, block_n, splits)


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
    _split_k_run(gemv_kernel, config, x, qweight, scales, y, split_k, n, k, MAGIC, BITS=bits, GROUP_SIZE=gs)
    return y


def _paired_takes(x: Tensor, bits: int) -> bool:
    """One fp16 or bf16 activation row and 4-bit codes: the cases ``matmul_paired`` runs."""
    return bits == 4 and x.dtype in (torch.float16, torch.bfloat16) and x.dim() == 2 and x.shape[0] == 1


def _paired_sub(device: torch.device, k: int, n: int, block_n: int) -> int:
    """``PAIRED_SUB``'s width for this GPU and shape where it divides ``block_n``; 0 (the plain tile) elsewhere."""
    if device.type != "cuda" or _INTERPRET:
        return 0
    sub = PAIRED_SUB.get((_cuda_facts(device)[1], k, n), 0)
    return sub if sub and block_n % sub == 0 else 0


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
    sub: int | None = None,
    emulate: bool = False,
    pdl: bool = False,
) -> Tensor:
    """``x [1, K] @ W^T`` with the paired-fp16 GEMV (``paired_gemv``): 4-bit codes, an fp16 or bf16 activation
    (bf16 of any magnitude: a K slice holding values past fp16's range is scaled by a power of two).

    ``split_k`` overrides the split heuristic (at least ``_PAIRED_MIN_TILES`` K tiles per split); ``sub`` the
    column sub-tile width (0: the plain tile; default ``PAIRED_SUB`` of this GPU and shape); ``emulate`` runs the
    interpreter's emulation of the paired operations on a GPU too, to check the PTX against it; ``pdl`` turns on
    programmatic dependent launch (``pdl_launch``).
    """
    x, qweight, scales, k, n, gs = _prepare(x, qweight, scales, bits, group_size)
    if not _paired_takes(x, bits):
        raise ValueError(f"the paired GEMV takes one fp16/bf16 row and 4-bit codes, got {x.dtype} {list(x.shape)}")
    if block_k not in (16, 32, 64, 128, 256):
        raise ValueError(f"block_k must be 16, 32, 64, 128 or 256, got {block_k}")
    sub = _paired_sub(x.device, k, n, block_n) if sub is None else sub
    if sub and (sub < 4 or sub & (sub - 1) or block_n % sub):
        raise ValueError(f"sub must be 0 or a power of two of at least 4 that divides block_n={block_n}, got {sub}")
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
        SUB=sub,
        num_warps=num_warps,
        num_stages=1,
        **pdl_launch(x.device, pdl),
    )
    return y


MMA_ROWS_CONFIG = {"tiles": 1, "num_warps": 4}
"""``matmul_mma_rows`` launch: 4 warps of one column tile of 16 (64 columns per program), split by
``_mma_rows_wave``."""


MMA_ROWS_WIDE_CONFIG = {"tiles": 2, "num_warps": 4}
"""``matmul``'s ``matmul_mma_rows`` launch for 17 to ``MMA_ROWS_MAX_M`` rows: two column tiles a warp, so that each
program's activation fragments (four row groups) serve twice the columns."""


MMA_ROWS_MAX_M = 32
"""``matmul`` gives ``mma_rows`` 2 to this many rows. The kernel takes up to ``mma_rows.MAX_ROWS``; at 64 rows the
tiled kernel measured as fast or faster (``benchmarks/kernels_w4a16.py``, ``docs/kernels.md``)."""


MMA_ROWS_CAP = 64
"""Registers per thread ``matmul_mma_rows`` may cap its 9-16-row build at (ptxas ``maxnreg``) where that lets its
split hold half as many programs again in one wave: a few spilled bytes cost less than a second, mostly empty
wave."""


MMA_ROWS_MIN_GROUPS = 4
"""Groups each split of ``matmul_mma_rows`` keeps at least (where K has them): splits of fewer groups, though more of
them fit one wave, measured slower (``docs/kernels.md``)."""


def _mma_rows_wave(args: tuple, meta: dict, n_tiles: int, groups: int, device: torch.device) -> tuple[int, int | None]:
    """``(split, maxnreg)`` of a ``matmul_mma_rows`` launch: the most splits (of ``MMA_ROWS_MIN_GROUPS`` groups or
    more) whose programs the GPU holds at once (``wave_split``), and ``MMA_ROWS_CAP`` for 9 to 16 rows where it
    makes that split half as large again."""
    split = wave_split(n_tiles, groups, resident_programs(mma_rows_kernel, args, meta, device), MMA_ROWS_MIN_GROUPS)
    if meta["ROW_GROUPS"] == 2:
        capped_wave = resident_programs(mma_rows_kernel, args, {**meta, "maxnreg": MMA_ROWS_CAP}, device)
        capped = wave_split(n_tiles, groups, capped_wave, MMA_ROWS_MIN_GROUPS)
        if 2 * capped >= 3 * split:
            return capped, MMA_ROWS_CAP
    return split, None


def _mma_rows_takes(x: Tensor, bits: int, group_size: int, k: int) -> bool:
    """4-bit codes, fp16/bf16 activations and a group the kernel runs: the cases ``matmul`` gives ``mma_rows``."""
    return bits == 4 and x.dtype in (torch.float16, torch.bfloat16) and _mma_rows_group(k, group_size) != 0


def _mma_rows_group(k: int, gs: int) -> int:
    """The kernel's group (``GROUP_SIZE``, -1 for one group) when ``matmul_mma_rows`` runs this K, else 0."""
    if gs <= 0:
        return -1 if k % 128 == 0 else 0
    return gs if gs % 32 == 0 and k % gs == 0 else 0


def matmul_mma_rows(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    out: Tensor | None = None,
    split_k: int | None = None,
    tiles: int = MMA_ROWS_CONFIG["tiles"],
    num_warps: int = MMA_ROWS_CONFIG["num_warps"],
    emulate: bool = False,
    pdl: bool = False,
) -> Tensor:
    """``x [M <= 64, K] @ W^T`` on ``mma.sync`` fed from registers (``mma_rows``): 4-bit codes, bf16 activations
    (any magnitude: bf16 MMA) or fp16 ones, groups of a multiple of 32 dividing K (or one group, K a multiple of
    128). ``split_k`` overrides the one-wave split (splits of whole groups); ``emulate`` runs the interpreter's
    emulation of the PTX on a GPU too, to check the PTX against it; ``pdl`` the programmatic dependent launch
    (``pdl_launch``)."""
    x, qweight, scales, k, n, gs = _prepare(x, qweight, scales, bits, group_size)
    m = x.shape[0]
    kernel_gs = _mma_rows_group(k, gs)
    if not (1 <= m <= MAX_ROWS and _mma_rows_takes(x, bits, gs, k)):
        raise ValueError(
            f"the mma kernel takes 1 to {MAX_ROWS} fp16/bf16 rows, 4-bit codes and groups of a multiple of 32 "
            "dividing K; "
            f"got {m} {x.dtype} rows, bits={bits}, group_size={gs}, K={k}"
        )
    block_n = check_launch(tiles, num_warps)
    y = _output(out, m, n, x)
    group = 128 if kernel_gs < 0 else kernel_gs
    meta = {
        "GROUP_SIZE": kernel_gs,
        "TILES": tiles,
        "WARPS": num_warps,
        "ROW_GROUPS": row_groups(m),
        "FP4": False,
        "BF16": x.dtype == torch.bfloat16,
        "ASM": not (_INTERPRET or emulate),
        "num_warps": num_warps,
        "num_stages": 1,
        "maxnreg": None,
    }
    if split_k is None and x.is_cuda and not _INTERPRET:
        args = (x, qweight, scales, scales, y, torch.float32, torch.int32, m, n, k, x.stride(0), y.stride(0))
        split_k, meta["maxnreg"] = _mma_rows_wave(args, meta, cdiv(n, block_n), k // group, x.device)
    # splits of whole groups: the group is the K tile
    grid, part, cnt = _fixed_split_k(x, m, n, k, block_n, group, split_k, 1)
    meta.update(pdl_launch(x.device, pdl))
    mma_rows_kernel[grid](x, qweight, scales, scales, y, part, cnt, m, n, k, x.stride(0), y.stride(0), **meta)
    return y


def matmul_flat(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    out: Tensor | None = None,
    block_n: int = FLAT_CONFIG["block_n"],
    block_k: int = FLAT_CONFIG["block_k"],
    tiles: int = FLAT_CONFIG["tiles"],
    num_warps: int = FLAT_CONFIG["num_warps"],
) -> Tensor:
    """``x [M <= 16, K] @ W^T`` with the flat split-K kernel: ``tiles`` K tiles per program, K split over the grid,
    ``tl.dot`` on a 16-row activation tile."""
    x, qweight, scales, k, n, gs = _prepare(x, qweight, scales, bits, group_size)
    m = x.shape[0]
    if not 1 <= m <= 16:
        raise ValueError(f"the flat split-K kernel takes 1 to 16 activation rows, got {m}")
    pack = 32 // bits
    if block_k % pack or block_k < pack or (gs > 0 and gs % pack):
        raise ValueError(f"block_k={block_k} must be a multiple of {pack}")
    y = _output(out, m, n, x)
    grid, part, cnt = _split_k_grid(x, m, n, block_n, cdiv(cdiv(k, block_k), tiles))
    flat_kernel[grid](
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
        BITS=bits,
        GROUP_SIZE=gs,
        DOT_PRECISION=_dot_precision(x),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        TILES=tiles,
        num_warps=num_warps,
        num_stages=1,
    )
    return y


TILED_MAX_M = 128
"""Rows up to which ``matmul`` takes the tiled kernel; above, dequantize + ``torch.matmul`` (``docs/kernels.md``)."""

TILED_MIN_K_TILES = 4
"""K tiles each split of ``matmul_tiled`` keeps at least (where K has them)."""


def _tiled_split(tiles: int, k_tiles: int, sms: int, split_k: int | None) -> int:
    """K splits of a ``matmul_tiled`` launch of ``tiles`` output tiles: ``split_k`` if given, else the largest power
    of two that keeps the programs within one per SM and at least ``TILED_MIN_K_TILES`` K tiles per split (1 when
    the output tiles fill the SMs), as the kernel realises it (whole tiles per split, none empty)."""
    if split_k is None:
        split_k = 1
        while tiles * split_k * 2 <= sms and k_tiles >= 2 * split_k * TILED_MIN_K_TILES:
            split_k *= 2
    split_k = max(1, min(int(split_k), k_tiles))
    return cdiv(k_tiles, cdiv(k_tiles, split_k))


def matmul_tiled(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    out: Tensor | None = None,
    config: triton.Config | None = None,
    split_k: int | None = None,
) -> Tensor:
    """``x [M, K] @ W^T`` with the tiled kernel (weight tiles dequantized to ``x.dtype``, ``tl.dot``), K split
    where the output tiles are fewer than the SMs (``_tiled_split``; ``split_k`` overrides it)."""
    x, qweight, scales, k, n, gs = _prepare(x, qweight, scales, bits, group_size)
    m = x.shape[0]
    y = _output(out, m, n, x)
    if m == 0:
        return y
    if m * n >= 2**31:
        raise ValueError(f"the tiled kernel uses 32-bit output offsets: M x N = {m} x {n} is too large")
    bucket = min(next_power_of_2(m), 4096)
    sms = _sm_count(x.device)
    configs = tiled_kernel.configs if config is None else [config]

    def tiles(meta: dict) -> int:
        return cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"])

    def splits(meta: dict) -> int:
        return _tiled_split(tiles(meta), cdiv(k, meta["BLOCK_K"]), sms, split_k)

    part = _partials(x, max(splits(c.kwargs) for c in configs), m, n)
    cnt = arrival_counters(x.device, max(tiles(c.kwargs) for c in configs))
    grid = lambda meta: (tiles(meta), splits(meta))  # noqa: E731
    _run(
        tiled_kernel,
        config,
        grid,
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
        MAGIC,
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
    dequant_kernel[grid](
        qweight,
        scales,
        out,
        n,
        k,
        MAGIC,
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
    k = qweight.shape[0] * (32 // bits)
    if 1 < m <= MMA_ROWS_MAX_M and _mma_rows_takes(x, bits, group_size, k):
        launch = MMA_ROWS_CONFIG if m <= 16 else MMA_ROWS_WIDE_CONFIG
        return matmul_mma_rows(x, qweight, scales, bits, group_size, out=out, **launch)
    if 1 < m <= 16:
        return matmul_flat(x, qweight, scales, bits, group_size, out=out)
    if m <= TILED_MAX_M:
        return matmul_tiled(x, qweight, scales, bits, group_size, out=out)
    x, qweight, scales, _, n, _ = _prepare(x, qweight, scales, bits, group_size)
    w = dequantize(qweight, scales, bits, group_size, dtype=x.dtype)
    return torch.matmul(x, w.t(), out=_output(out, m, n, x))
