"""GPTQ for NVFP4: the column sweep of ``salaquant.gptq.solver`` with E2M1 values under FP8 block scales.

Each input column is rounded to the nearest E2M1 value of its 16-input block's scale (``block scale *
weight_scale_2``, exactly the format's rounding), and its error, weighted by the inverse Hessian's Cholesky row, is
carried into the columns not yet rounded (Frantar et al.'s update, in blocks of ``block_size`` columns). The global
scale is the caller's (shared across fused projections). Block scales are either given (chosen before the sweep,
e.g. the block-scale search on the weight as it is: the same scales as round-to-nearest) or chosen per block as the
sweep reaches it, from the columns as the earlier errors left them (on the GPU the search and the sweep of a block
of columns share one launch, ``salaquant.kernels.gptq.nvfp4_sweep``).

With a diagonal Hessian no error is carried and the result is round-to-nearest under the same scales, byte for byte.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..formats.modelopt_nvfp4.numerics import (
    BLOCK,
    NVFP4Weight,
    block_scales,
    check_weight,
    pack_nibbles,
    scalar_scale,
)
from ..gptq.solver import GPTQConfig, inverse_cholesky, row_weighted_errors
from ..kernels.gptq import ColumnBlock, gptq_columns, sweep_on_triton
from ..settings import defaults
from .search import fine_search, search_block_scales, shrink_factors

__all__ = ["NVFP4GPTQResult", "gptq_nvfp4"]

_DEFAULTS = defaults("nvfp4")


@dataclass
class NVFP4GPTQResult:
    weight: NVFP4Weight
    loss: float
    """``tr((W - W_hat) H (W - W_hat)^T)`` with the caller's undamped ``H``."""
    damp: float
    seconds: float


def _steps(scale: torch.Tensor, s2: torch.Tensor, i1: int, i2: int, dtype: torch.dtype) -> torch.Tensor:
    """``[out, i2 - i1]``: each column's quantization step, its block scale times the global scale (one fp32
    product, as ``dequant_blocks`` computes it)."""
    per_block = scale[:, i1 // BLOCK : (i2 + BLOCK - 1) // BLOCK].float() * s2
    return per_block.repeat_interleave(BLOCK, dim=1)[:, : i2 - i1].to(dtype).contiguous()


def _scales(
    w: torch.Tensor, s2: torch.Tensor, importance: torch.Tensor, iters: int, max_shrink: float, max_grow: float
) -> torch.Tensor:
    """float8_e4m3fn block scales of ``w [out, k * 16]``: searched when ``iters > 0``, else the plain ones."""
    if iters > 0:
        return search_block_scales(w, s2, importance, iters, max_shrink, max_grow).scales
    return block_scales(w, s2)


@torch.no_grad()
def gptq_nvfp4(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    importance: torch.Tensor,
    *,
    block_scale: torch.Tensor | None = None,
    mse_iters: int = _DEFAULTS.nvfp4.mse_iters,
    mse_max_shrink: float = _DEFAULTS.nvfp4.mse_max_shrink,
    mse_max_grow: float = _DEFAULTS.nvfp4.mse_max_grow,
    damp: float = GPTQConfig.damp,
    block_size: int = GPTQConfig.block_size,
    fp64: bool = False,
    backend: str = "auto",
) -> NVFP4GPTQResult:
    """Quantize ``weight [out, in]`` to NVFP4 minimising ``tr((W - W_hat) H (W - W_hat)^T)`` column by column.

    ``block_scale`` (float8_e4m3fn ``[out, in / 16]``) fixes the block scales before the sweep; without it each
    block's scales are chosen as the sweep reaches the block, by the search weighted by ``importance [in]`` (the
    Hessian diagonal, or the mean square of the inputs; ``mse_iters = 0``: the plain block scales). Dead inputs
    (``H[i, i] == 0``) get ``H[i, i] = 1`` and a zero weight column, as in GPTQ. ``block_size`` (a multiple of 16)
    is the lazy-update width; ``backend`` the column sweep's (``salaquant.kernels.gptq``).
    """
    start = time.perf_counter()
    check_weight(weight)
    if hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(
            f"weight {tuple(weight.shape)} and hessian {tuple(hessian.shape)}: expected [out, in] and [in, in]"
        )
    if block_size <= 0 or block_size % BLOCK:
        raise ValueError(f"block_size={block_size}: expected a positive multiple of {BLOCK}")
    dtype = torch.float64 if fp64 else torch.float32
    w = weight.detach().to(dtype=dtype, copy=True)
    h = hessian.detach().to(device=w.device, dtype=dtype, copy=True)
    if not (torch.isfinite(w).all() and torch.isfinite(h).all()):
        raise ValueError("weight and hessian must be finite")
    n_out, n = w.shape
    s2 = scalar_scale(weight_scale_2, w.device)
    imp = importance.detach().to(device=w.device, dtype=torch.float32)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0

    scale = torch.empty(n_out, n // BLOCK, dtype=torch.float8_e4m3fn, device=w.device)
    if block_scale is not None:
        if block_scale.dtype != torch.float8_e4m3fn or tuple(block_scale.shape) != tuple(scale.shape):
            raise ValueError(f"block_scale: expected float8_e4m3fn {tuple(scale.shape)}, got {block_scale.dtype} "
                             f"{tuple(block_scale.shape)}")  # fmt: skip
        scale.copy_(block_scale)
    elif tuple(imp.shape) != (n,) or not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
        raise ValueError(f"importance: expected finite values >= 0 of shape ({n},), got {tuple(imp.shape)}")
    factors = shrink_factors(mse_iters, mse_max_shrink) if mse_iters > 0 else [1.0]
    fine = mse_iters > 0 and fine_search(factors, mse_max_shrink)
    fused_ok = block_scale is None and float(s2) > 0  # the fused search divides by the global scale
    factors_t = torch.tensor(factors, dtype=torch.float32, device=w.device)
    grow = mse_max_grow if mse_iters > 0 else 1.0  # the plain scales alone without a search
    hinv, used_damp = inverse_cholesky(h, GPTQConfig(damp=damp, fp64=fp64))
    hinv = hinv.contiguous()  # row-major: the column sweep reads rows of it
    codes = torch.empty(n_out, n, dtype=torch.int32, device=w.device)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros_like(w1)
        block = ColumnBlock(w1, codes[:, i1:i2], err1, hinv1, e2m1=True)
        if block_scale is not None:  # every column's step is known: one sweep over the block
            gptq_columns(block, _steps(scale, s2, i1, i2, dtype), 0, i2 - i1, backend)
        elif fused_ok and sweep_on_triton(backend, w1):  # the search and the sweep in one launch
            from ..kernels.gptq.nvfp4_sweep import gptq_nvfp4_search_triton

            bits = scale[:, i1 // BLOCK : i2 // BLOCK].view(torch.uint8)
            gptq_nvfp4_search_triton(block, bits, s2, imp[i1:i2], factors_t, fine, grow)
        else:
            for b0 in range(0, i2 - i1, BLOCK):  # the block's columns as every earlier column's error left them
                col = i1 + b0
                b = col // BLOCK
                scale[:, b : b + 1] = _scales(
                    w1[:, b0 : b0 + BLOCK].float(), s2, imp[col : col + BLOCK], mse_iters, mse_max_shrink, mse_max_grow
                )
                steps = _steps(scale, s2, i1, i2, dtype)
                gptq_columns(block, steps, b0, b0 + BLOCK, backend)
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    result = NVFP4Weight(weight=pack_nibbles(codes.to(torch.uint8)), weight_scale=scale, weight_scale_2=s2)
    loss = float(row_weighted_errors(weight, result.dequantize(), hessian).sum())
    return NVFP4GPTQResult(result, loss, used_damp, time.perf_counter() - start)
