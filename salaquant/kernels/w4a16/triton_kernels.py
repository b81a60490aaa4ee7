"""Launching the Triton kernels of the W4A16 GEMM on GPTQ v1 tensors (see ``reference.py`` for the layout).

Each path's kernel lives in the module of its name (``paired_gemv``, ``gemv``, ``wleft``, ``mma_rows``, ``flat``,
``tiled``, ``dequant_kernel``; code extraction in ``codes``, the split-K reduction in ``split_k``); this module sizes
the grids and workspaces and picks the path. Paths, chosen by ``matmul`` from the number of activation rows ``M``:

* ``M == 1`` with 4-bit codes and an fp16/bf16 activation, ``paired`` (``matmul_paired``, kernel in
  ``paired_gemv``): split-K GEMV on paired fp16 arithmetic, two weights per instruction; the rounding of each
  word's two 4-term sums to fp16 is its only departure from fp32 accumulation.
* ``M == 1`` otherwise (8-bit codes, fp32 activations), ``gemv``: CUDA-core GEMV with split-K. A program owns a
  ``BLOCK_N`` column tile and a run of K tiles; it loads each ``[BLOCK_K / p, BLOCK_N]`` tile of int32 words once
  (the next tile's load is issued before this tile's math) and takes the ``p`` values out of every word with masks
  (``codes.word_value``: one logic op and one FMA per value, exact), multiplies them by the activation into a 2-D fp32
  accumulator and applies the group scale once per word row.
* ``2 <= M <= 16`` with 4-bit codes, fp16/bf16 activations and groups of a multiple of 32 dividing K (or one group,
  K a multiple of 128), ``mma_rows`` (``matmul_mma_rows``, kernel in ``../mma_rows.py``): ``mma.sync`` fed from
  registers, every tensor one element per thread so that each thread loads its own fragments; the paired
  dequantization of ``paired`` (bf16 activations take the bf16 MMA, so no fp16 range limit), fp32 products and
  sums, split-K over whole groups. On an H200 1.6-2.0x cuBLAS bf16 at 2-8 rows and 1.2-1.5x at 16
  (``benchmarks/mma_rows.py``), against 0.92-1.06x for ``wleft``.
* ``2 <= M <= 16`` otherwise, ``wleft`` (``matmul_wleft``): ``Y^T = W x^T``, the weight tile the MMA's left operand
  and the 16 activation rows its N side. Each program loops over a run of K tiles (splits as the GEMV's, so the fp32
  partials stay small against the weights); a word tile loaded with N along the fast axis expands, through
  16-bit magic numbers, straight into a ``[BLOCK_N, BLOCK_K]`` tile in K order. Used for 4-bit codes, fp16/bf16
  activations and groups of 32, 64 or a multiple of 128 (or one group) that ``mma_rows`` does not take; other
  cases take ``flat``.
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

Split-K reduction (``paired``, ``gemv``, ``mma_rows``, ``wleft``, ``flat``; ``split_k.py``): every program stores
its fp32 partial tile into a workspace, then increments a per-column-tile counter; the program that completes the
count sums the partials in split order, writes the output in the activation dtype and resets the counter. One
launch, no atomics on data, and run-to-run identical results. Counters live in a per-(device, stream) buffer that
every launch leaves zeroed.

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
from ..mma_rows import check_launch, mma_rows_kernel
from .codes import MAGIC
from .dequant_kernel import dequant_kernel
from .flat import flat_kernel
from .gemv import gemv_kernel
from .paired_gemv import paired_gemv_kernel
from .reference import check_operands
from .tiled import tiled_kernel
from .wleft import wleft_kernel

__all__ = [
    "DEQUANT_MIN_M",
    "FLAT_DOT_CONFIG",
    "WLEFT_TUNED",
    "dequantize",
    "matmul",
    "matmul_flat",
    "matmul_gemv",
    "matmul_mma_rows",
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

PAIRED_SUB: dict[tuple[int, int, int], int] = {(9, 4096, 32768): 64}
"""``matmul_paired``'s sub-tile width (``paired_gemv_kernel``'s ``SUB``) keyed by ``(compute capability major, K,
N)`` where it beat the plain tile on an H200 (``benchmarks/w4a16_paired.py --sweep``, bf16, group 128, two runs):
gate_up 24.1 us against 25.5; down 17.1-17.2 against 17.2, lightning qkv 13.5 against 13.2-13.3 and o_proj 7.5-7.6
against 7.1 keep the plain tile (0)."""

_DECODE_WAVES = 4  # split-K aims at this many programs per SM
_MIN_TILES_PER_SPLIT = 2  # and gives every program at least this many K tiles when it can
_CPU_SMS = 4  # stands in for the SM count under the interpreter


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
    maxnreg: int | None = None,
    emulate: bool = False,
    pdl: bool = False,
) -> Tensor:
    """``x [1, K] @ W^T`` with the paired-fp16 GEMV (``paired_gemv``): 4-bit codes, an fp16 or bf16 activation
    (bf16 of any magnitude: a K slice holding values past fp16's range is scaled by a power of two).

    ``split_k`` overrides the split heuristic (at least ``_PAIRED_MIN_TILES`` K tiles per split); ``sub`` the
    column sub-tile width (0: the plain tile; default ``PAIRED_SUB`` of this GPU and shape); ``maxnreg`` caps the
    registers per thread (ptxas); ``emulate`` runs the interpreter's emulation of the paired operations on a GPU
    too, to check the PTX against it; ``pdl`` turns on programmatic dependent launch (``pdl_launch``).
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
        maxnreg=maxnreg,
        **pdl_launch(x.device, pdl),
    )
    return y


MMA_ROWS_CONFIG = {"tiles": 1, "num_warps": 4}
"""``matmul_mma_rows`` launch: 4 warps of one column tile of 16 (64 columns per program), split by ``_mma_rows_wave``.
Timed on an H200 (``benchmarks/mma_rows.py``, bf16, SALA shapes, 2-16 rows) against 2 tiles, 4 tiles and 8 warps:
fastest or within 5% of the fastest launch at every shape and row count up to 8 (gate_up 32-33 us, down 21-23 us,
o_proj 7.5-7.8 us); at 16 rows 2 warps were no faster once the split fills one wave (``benchmarks/rows_waves.py``)."""


MMA_ROWS_CAP = 64
"""Registers per thread ``matmul_mma_rows`` may cap its 9-16-row build at (70 uncapped on sm_90 with triton 3.6,
7 programs of 4 warps per SM; 64: 8, with an 8-byte spill) where that lets its split hold half as many programs again
in one wave (H200, ``benchmarks/rows_waves.py``: gate_up at 16 rows 45.3 us capped at 2 splits, 60.9 uncapped, whose
1024 programs ran as 924 and then 100; uncapped at 1 split 56.3; down, whose wave it does not change, 34.9 against
30.6)."""


MMA_ROWS_MIN_GROUPS = 4
"""Groups each split of ``matmul_mma_rows`` keeps at least (where K has them): o_proj (32 groups) at 2-16 rows took
8.7-9.6 us at 16 splits of 2 groups, the most one wave holds, against 7.2-8.9 at 8 of 4 (H200)."""


def _mma_rows_wave(args: tuple, meta: dict, n_tiles: int, groups: int, device: torch.device) -> tuple[int, int | None]:
    """``(split, maxnreg)`` of a ``matmul_mma_rows`` launch: the most splits (of ``MMA_ROWS_MIN_GROUPS`` groups or
    more) whose programs the GPU holds at once (``wave_split``), and ``MMA_ROWS_CAP`` for more than 8 rows where
    it makes that split half as large again."""
    split = wave_split(n_tiles, groups, resident_programs(mma_rows_kernel, args, meta, device), MMA_ROWS_MIN_GROUPS)
    if meta["TWO"] and meta["maxnreg"] is None:
        capped_wave = resident_programs(mma_rows_kernel, args, {**meta, "maxnreg": MMA_ROWS_CAP}, device)
        capped = wave_split(n_tiles, groups, capped_wave, MMA_ROWS_MIN_GROUPS)
        if 2 * capped >= 3 * split:
            return capped, MMA_ROWS_CAP
    return split, meta["maxnreg"]


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
    maxnreg: int | None = None,
    weight_cache: str = "",
    x_evict: str = "",
    emulate: bool = False,
    pdl: bool = False,
) -> Tensor:
    """``x [M <= 16, K] @ W^T`` on ``mma.sync`` fed from registers (``mma_rows``): 4-bit codes, bf16 activations
    (any magnitude: bf16 MMA) or fp16 ones, groups of a multiple of 32 dividing K (or one group, K a multiple of
    128). ``split_k`` overrides the split heuristic (splits of whole groups); ``maxnreg`` caps the registers per
    thread (ptxas); ``weight_cache`` is the weight loads' cache modifier (``".cg"``: not kept in L1) and ``x_evict``
    the activation loads' eviction policy; ``emulate`` runs the interpreter's emulation of the PTX on a GPU too, to
    check the PTX against it; ``pdl`` the programmatic dependent launch (``pdl_launch``)."""
    x, qweight, scales, k, n, gs = _prepare(x, qweight, scales, bits, group_size)
    m = x.shape[0]
    kernel_gs = _mma_rows_group(k, gs)
    if not (1 <= m <= 16 and _mma_rows_takes(x, bits, gs, k)):
        raise ValueError(
            f"the mma kernel takes 1 to 16 fp16/bf16 rows, 4-bit codes and groups of a multiple of 32 dividing K; "
            f"got {m} {x.dtype} rows, bits={bits}, group_size={gs}, K={k}"
        )
    block_n = check_launch(tiles, num_warps)
    y = _output(out, m, n, x)
    group = 128 if kernel_gs < 0 else kernel_gs
    meta = {
        "GROUP_SIZE": kernel_gs,
        "TILES": tiles,
        "WARPS": num_warps,
        "TWO": m > 8,
        "FP4": False,
        "BF16": x.dtype == torch.bfloat16,
        "ASM": not (_INTERPRET or emulate),
        "num_warps": num_warps,
        "num_stages": 1,
        "maxnreg": maxnreg,
        "W_CACHE": weight_cache,
        "X_EVICT": x_evict,
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
    flat_kernel[(n_tiles, splits)](
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
    """``x [M <= 16, K] @ W^T`` with the weights as the MMA's left operand (``wleft_kernel``), each program
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
    wleft_kernel[grid](
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
        tiled_kernel,
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
    if 1 < m <= 16:
        k = qweight.shape[0] * (32 // bits)
        if _mma_rows_takes(x, bits, group_size, k):
            return matmul_mma_rows(x, qweight, scales, bits, group_size, out=out)
        if _wleft_takes(x, bits, group_size, k):
            tuned = _wleft_tuned(x.device, k, qweight.shape[1])
            return matmul_wleft(x, qweight, scales, bits, group_size, out=out, **tuned)
        return matmul_flat(x, qweight, scales, bits, group_size, out=out, **FLAT_DOT_CONFIG)
    if m < DEQUANT_MIN_M and _tiled_fills(m, qweight.shape[1], x.device):
        return matmul_tiled(x, qweight, scales, bits, group_size, out=out)
    x, qweight, scales, _, n, _ = _prepare(x, qweight, scales, bits, group_size)
    w = dequantize(qweight, scales, bits, group_size, dtype=x.dtype)
    return torch.matmul(x, w.t(), out=_output(out, m, n, x))
