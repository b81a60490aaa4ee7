"""Launchers of the Triton NVFP4 weight-only GEMM ``y = x @ W^T`` (x fp16 / bf16 / fp32, fp32 accumulation,
output ``x.dtype``); `tuning` picks the kernel and its launch.

Kernels:

* ``nvfp4_dot_kernel`` (``dot_kernel``): tensor-core tiles computed as ``y^T = W @ x^T`` (the dequantized
  weight is the left operand, the activations the right one), with split-K. With ``BLOCK_M = 16`` it is the decode path
  (M <= 16); with larger tiles the prefill path.
* ``nvfp4_paired_gemv_kernel`` (``paired_gemv``): split-K GEMV on paired fp16 arithmetic, the default for one
  fp16/bf16 activation row (``PAIRED_TILE``, ``PAIRED_TUNED``).
* ``mma_rows_kernel`` (``../mma_rows.py``, ``NVFP4Config("rows")``): ``mma.sync`` from registers for 1 to 8
  fp16/bf16 rows, the default for 2 to ``ROWS_MAX_M`` rows of weights with ``ROWS_MIN_N`` outputs or more.
* ``nvfp4_dequant_kernel`` (``dot_kernel``): the ``[N, K]`` weight in the activation dtype, for ``F.linear`` from
  ``DEQUANT_MIN_M`` rows on (``matmul``).

Split-K without a reduction launch (``../split_k.py``): the split that arrives last sums the partials in split
order and applies the global scale. The counters live in a cached, zero-initialised int32 buffer per device and
stream; call once before CUDA-graph capture so that it exists.

Offsets are 32-bit: each of ``x``, ``weight``, the output and the split-K workspace must have fewer than
2**31 elements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import DEQUANT_MIN_M
from ..counters import arrival_counters
from ..device import INTERPRET as _INTERPRET
from ..device import pdl_launch
from ..host import cdiv, pair_aligned
from ..mma_rows import MAX_ROWS, check_launch, mma_rows_kernel, row_groups
from . import tuning
from .dot_kernel import nvfp4_dequant_kernel, nvfp4_dot_kernel
from .paired_gemv import nvfp4_paired_gemv_kernel
from .reference import check_operands
from .tuning import NVFP4Config, default_config

__all__ = ["matmul", "nvfp4_dequantize_triton", "nvfp4_matmul_triton"]

_POISON_WORKSPACE = False
"""Fill the split-K workspace with NaN before each launch (for tests)."""


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
        _launch_rows(x2, w, s, gs, out2, n, k, cfg.split_k, tiles, cfg.num_warps, tuning._EMULATE_PAIRED, pdl)
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
    asm = not (_INTERPRET or tuning._EMULATE_PAIRED)
    if cfg.kernel == "paired":
        if m != 1 or x.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the paired GEMV takes one fp16/bf16 activation row, got {m} rows of {x.dtype}")
        cnt = arrival_counters(x.device, cdiv(n, cfg.block_n)) if split > 1 else gs
        nvfp4_paired_gemv_kernel[(cdiv(n, cfg.block_n), split)](
            x2, w, s, gs, out2, ws, cnt, n, k, BLOCK_N=cfg.block_n, BLOCK_B=cfg.block_k // 16, SPLIT=split > 1,
            BF16=bf16, ASM=asm, EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0,
            PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device, pdl),
        )  # fmt: skip
    else:
        tiles = cdiv(n, cfg.block_n) * cdiv(m, cfg.block_m)
        cnt = arrival_counters(x.device, tiles) if split > 1 else gs
        nvfp4_dot_kernel[(tiles, split)](
            x2, w, s, gs, out2, ws, cnt, m, n, k, x2.stride(0), out2.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1, GROUP_N=cfg.group_n,
            BF16=bf16, X_F32=x.dtype == torch.float32, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out


def _check_rows(x: torch.Tensor, k: int) -> None:
    """``ValueError`` unless ``x [M, K]`` is 1 to ``MAX_ROWS`` fp16/bf16 rows and K a multiple of 128 (the row
    kernel's operands for NVFP4)."""
    if x.shape[-1] != k or not 1 <= x.shape[0] <= MAX_ROWS or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"the mma kernel takes 1 to {MAX_ROWS} fp16/bf16 rows of {k} inputs, got {x.dtype} {list(x.shape)}"
        )
    if k % 128:
        raise ValueError(f"the mma kernel takes K a multiple of 128, got {k}")


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
        GROUP_SIZE=128, TILES=tiles, WARPS=num_warps, ROW_GROUPS=row_groups(m), FP4=True,
        BF16=x.dtype == torch.bfloat16, ASM=not (_INTERPRET or emulate), num_warps=num_warps, num_stages=1,
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
    nvfp4_dequant_kernel[grid](
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
