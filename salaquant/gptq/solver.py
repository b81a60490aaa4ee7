"""GPTQ solver: symmetric 4/8-bit group quantization of one weight matrix given its input Hessian.

Grid (GPTQ ``sym=True``): per (row, group) ``scale = 2 * max|w| / (2**bits - 1)`` rounded to a value that is
exact in both bfloat16 and float16 (what engines serving a bf16 model compute with),
``zero = 2**(bits - 1)``, ``code = clamp(round(w / scale) + zero, 0, 2**bits - 1)`` and
``w_hat = (code - zero) * scale``. Codes span ``[0, 2**bits - 1]`` (``+max|w|`` clips to the top code).
Scales are clamped to the float16 normal range ``[2**-14, 65504]`` before rounding, so an all-zero row
gets scale ``2**-14`` and dequantizes to exactly 0. Because codes are computed from the float16 scales,
``QuantizedWeight.dequantize`` reproduces exactly what a checkpoint with float16 scales decodes to.

``H`` is any positive semi-definite ``[in, in]`` matrix proportional to ``X^T X`` of the layer inputs; the
solution does not depend on its scale (damping is relative to ``mean(diag H)``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..kernels.gptq import BACKENDS, ColumnBlock, best_scale, gptq_columns
from ..settings import defaults

_FP16 = torch.finfo(torch.float16)
_DEFAULTS = defaults("gptq")  # the user-facing settings' defaults (the rest are the solver's own)


@dataclass(frozen=True)
class GPTQConfig:
    """Solver settings.

    ``group_size`` is -1 (one group over all inputs) or a positive number of input columns (the last group
    may be partial). ``act_order`` processes columns by descending ``diag(H)`` with static groups (scales
    from the original weight per natural group), so ``g_idx`` stays ``i // group_size``. ``mse`` searches
    shrink factors ``1, 1 - 1/mse_grid, ..., 1 - mse_maxshrink`` per (row, group) for the least squared error.
    """

    bits: int = _DEFAULTS.quantization.bits
    group_size: int = _DEFAULTS.quantization.group_size
    damp: float = _DEFAULTS.gptq.damp
    damp_step: float = 0.01
    max_damp: float = 1.0
    block_size: int = _DEFAULTS.gptq.block_size
    act_order: bool = _DEFAULTS.gptq.act_order
    mse: bool = _DEFAULTS.gptq.mse
    mse_grid: int = 100
    mse_maxshrink: float = 0.8
    fp64: bool = _DEFAULTS.gptq.fp64
    backend: str = "auto"  # column sweep and scale search: "auto", "triton" or "reference" (salaquant.kernels.gptq)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits}: only symmetric 4 or 8 bits are supported")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size={self.group_size}: expected -1 or a positive integer")
        if self.block_size <= 0:
            raise ValueError(f"block_size={self.block_size}: expected a positive integer")
        if self.damp < 0 or self.damp_step < 0 or self.max_damp < self.damp:
            raise ValueError(f"damping: need 0 <= damp <= max_damp and damp_step >= 0, got {self}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {BACKENDS}")
        if self.mse_grid <= 0 or not 0.0 <= self.mse_maxshrink < 1.0:
            raise ValueError(
                f"mse_grid={self.mse_grid}, mse_maxshrink={self.mse_maxshrink}: need grid > 0, 0 <= shrink < 1"
            )


@dataclass
class QuantizedWeight:
    """Codes and scales of a quantized ``[out, in]`` weight; ``w_hat = (codes - zero) * scales[g_idx].T``."""

    codes: torch.Tensor  # int32 [out, in], in [0, 2**bits - 1]
    scales: torch.Tensor  # float16 [n_groups, out]
    zero: int  # 2**(bits - 1)
    g_idx: torch.Tensor  # int32 [in], group of each input column
    bits: int
    group_size: int  # -1: one group

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[out, in]`` reconstruction, computed in float32 and cast to ``dtype``."""
        scales = self.scales.float()[self.g_idx.long()].T
        return ((self.codes - self.zero).float() * scales).to(dtype)


@dataclass
class GPTQResult:
    """Solver output. ``loss`` is ``tr((W - W_hat) H (W - W_hat)^T)`` with the caller's undamped ``H``."""

    weight: QuantizedWeight
    loss: float
    damp: float  # damping fraction of mean(diag H) finally used
    seconds: float  # wall time of the call
    row_loss: torch.Tensor | None = None  # float64 [out]: each row's share of ``loss``


_BF16_BELOW_FP16_MAX = 65280.0  # largest bfloat16 value that float16 can hold


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """Clamp to the float16 normal range and round to a value exact in both bfloat16 and float16: checkpoints
    store float16 scales, and engines serving a bf16 model cast them to bfloat16 before dequantizing."""
    bf = scale.clamp(min=_FP16.tiny, max=_FP16.max).to(torch.bfloat16).float()
    return bf.clamp(max=_BF16_BELOW_FP16_MAX).to(torch.float16)


def _as_float(w: torch.Tensor) -> torch.Tensor:
    return w if w.dtype in (torch.float32, torch.float64) else w.float()


def symmetric_scales(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-row float16 scales ``2 * max|w| / (2**bits - 1)`` of ``w`` [out, n], clamped to the fp16 normal range."""
    w = _as_float(w)
    return _fp16_scale(2 * w.abs().amax(dim=1) / (2**bits - 1))


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: int, bits: int) -> torch.Tensor:
    """int32 ``clamp(round(w / scale) + zero, 0, 2**bits - 1)`` (round half to even).

    A 1-D ``scale`` with a 2-D ``w`` is one scale per row; otherwise ``scale`` must broadcast against ``w``.
    """
    w = _as_float(w)
    scale = scale.to(w.dtype)
    if scale.dim() == 1 and w.dim() == 2:
        scale = scale[:, None]
    return (torch.round(w / scale) + zero).clamp(0, 2**bits - 1).to(torch.int32)


def mse_scales(
    w: torch.Tensor, bits: int, grid: int = 100, maxshrink: float = 0.8, backend: str = "auto"
) -> torch.Tensor:
    """Per-row float16 scales of ``w`` [out, n] minimising the squared quantization error.

    Candidates are ``p * max|w|`` for ``p = 1 - i / grid``, ``i = 0 .. round(maxshrink * grid)`` (each scale
    rounded to float16 before it is scored); ties keep the larger scale, so ``p = 1`` (plain symmetric scales)
    is never beaten by an equal error. Scored by ``salaquant.kernels.gptq.best_scale`` (``backend``).
    """
    w = _as_float(w)
    zero, maxq = 2 ** (bits - 1), 2**bits - 1
    xmax = w.abs().amax(dim=1)
    shrink = torch.tensor([1 - i / grid for i in range(round(maxshrink * grid) + 1)], dtype=w.dtype, device=w.device)
    cands = _fp16_scale(2 * (shrink[:, None] * xmax[None, :]) / maxq)  # [k, out] float16
    best = best_scale(w, cands.to(w.dtype), zero, maxq, backend)
    return cands.gather(0, best[None]).squeeze(0)


def _group_scale(w: torch.Tensor, config: GPTQConfig) -> torch.Tensor:
    if config.mse:
        return mse_scales(w, config.bits, config.mse_grid, config.mse_maxshrink, config.backend)
    return symmetric_scales(w, config.bits)


def _groups(n: int, group_size: int) -> tuple[int, int, torch.Tensor]:
    gs = n if group_size == -1 else group_size
    g_idx = (torch.arange(n) // gs).to(torch.int32)
    return gs, math.ceil(n / gs), g_idx


def rtn(weight: torch.Tensor, config: GPTQConfig | None = None) -> QuantizedWeight:
    """Round-to-nearest on the same grid and groups as ``gptq`` (MSE scale search if ``config.mse``). Every group's
    scales come from one call over all of them (the search is per row, so batching rows changes nothing)."""
    config = config or GPTQConfig()
    dtype = torch.float64 if config.fp64 else torch.float32
    w = weight.detach().to(dtype)
    if w.dim() != 2 or not torch.isfinite(w).all():
        raise ValueError("weight must be a finite 2-D tensor")
    gs, n_groups, g_idx = _groups(w.shape[1], config.group_size)
    zero = 2 ** (config.bits - 1)
    out, n = w.shape
    if n == n_groups * gs:  # whole groups: every (row, group) is one row of a [groups * out, gs] problem
        rows = w.view(out, n_groups, gs).transpose(0, 1).reshape(n_groups * out, gs)
        flat = _group_scale(rows, config)
        codes = quantize_codes(rows, flat, zero, config.bits).view(n_groups, out, gs).transpose(0, 1)
        scales, codes = flat.view(n_groups, out), codes.reshape(out, n)
    else:  # a partial last group
        scales = torch.empty(n_groups, out, dtype=torch.float16, device=w.device)
        codes = torch.empty(w.shape, dtype=torch.int32, device=w.device)
        for g in range(n_groups):
            cols = slice(g * gs, (g + 1) * gs)
            scales[g] = _group_scale(w[:, cols], config)
            codes[:, cols] = quantize_codes(w[:, cols], scales[g], zero, config.bits)
    return QuantizedWeight(codes, scales, zero, g_idx.to(w.device), config.bits, config.group_size)


def inverse_cholesky(h: torch.Tensor, config: GPTQConfig) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``, raising ``damp`` until it succeeds."""
    mean_diag = torch.diag(h).mean()
    step = 0
    while True:
        damp = config.damp + step * config.damp_step
        if damp > config.max_damp + 1e-9 or (step > 0 and config.damp_step == 0):
            raise ValueError(
                f"Cholesky of the damped Hessian failed for every damping fraction from {config.damp} to "
                f"{config.max_damp} (step {config.damp_step}); the Hessian is not positive semi-definite enough"
            )
        hd = h.clone()
        hd.diagonal().add_(damp * mean_diag)
        lower, info = torch.linalg.cholesky_ex(hd)
        if info.item() == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if info.item() == 0 and bool(torch.isfinite(upper).all()):
                return upper, damp
        step += 1


@torch.no_grad()
def gptq(weight: torch.Tensor, hessian: torch.Tensor, config: GPTQConfig | None = None) -> GPTQResult:
    """Quantize ``weight`` [out, in] minimising ``tr((W - W_hat) H (W - W_hat)^T)`` column by column (GPTQ).

    Dead inputs (``H[i, i] == 0``) get ``H[i, i] = 1`` and a zero weight column. Without ``act_order`` the
    scales of a group are computed when its first column is reached, from the columns as updated by all
    earlier columns' errors; with ``act_order`` they are computed up front from the original weight.
    """
    start = time.perf_counter()
    config = config or GPTQConfig()
    dtype = torch.float64 if config.fp64 else torch.float32
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(
            f"weight {tuple(weight.shape)} and hessian {tuple(hessian.shape)}: expected [out, in], [in, in]"
        )
    w = weight.detach().to(dtype=dtype, copy=True)
    h = hessian.detach().to(device=w.device, dtype=dtype, copy=True)
    if not (torch.isfinite(w).all() and torch.isfinite(h).all()):
        raise ValueError("weight and hessian must be finite")
    n_out, n = w.shape
    bits, zero = config.bits, 2 ** (config.bits - 1)
    gs, n_groups, g_idx = _groups(n, config.group_size)

    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0

    scales = torch.empty(n_groups, n_out, dtype=torch.float16, device=w.device)
    col_group: list[int] | None = None
    invperm: torch.Tensor | None = None
    if config.act_order:
        for g in range(n_groups):
            scales[g] = _group_scale(w[:, g * gs : (g + 1) * gs], config)
        perm = torch.argsort(torch.diag(h), descending=True, stable=True)
        w, h = w[:, perm], h[perm][:, perm]
        col_group, invperm = (perm // gs).tolist(), torch.argsort(perm)

    hinv, damp = inverse_cholesky(h, config)
    hinv = hinv.contiguous()  # row-major: the column sweep reads rows of it
    codes = torch.empty(n_out, n, dtype=torch.int32, device=w.device)
    maxq = 2**bits - 1
    group_of = None if col_group is None else torch.tensor(col_group, device=w.device)
    scale = scales[0]
    for i1 in range(0, n, config.block_size):
        i2 = min(i1 + config.block_size, n)
        w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros_like(w1)
        block = ColumnBlock(w1, codes[:, i1:i2], err1, hinv1, zero, maxq)
        if group_of is not None:  # static groups: every column's scale is known
            per_col = scales[group_of[i1:i2]].T.to(dtype).contiguous()
            gptq_columns(block, per_col, 0, i2 - i1, config.backend)
        else:
            i = 0
            while i < i2 - i1:
                col = i1 + i
                if col % gs == 0:
                    # The group's columns with every earlier column's error applied (some may lie past this block).
                    group = w1[:, i : min(col + gs, i2) - i1]
                    if col + gs > i2:
                        rest = w[:, i2 : col + gs] - err1[:, :i] @ hinv[i1:col, i2 : col + gs]
                        group = torch.cat([group, rest], dim=1)
                    scales[col // gs] = scale = _group_scale(group, config)
                stop = min(i2, (col // gs + 1) * gs) - i1  # the rest of this group inside the block
                gptq_columns(block, scale.to(dtype), i, stop, config.backend)
                i = stop
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    if invperm is not None:
        codes = codes[:, invperm]
    qw = QuantizedWeight(codes, scales, zero, g_idx.to(w.device), bits, config.group_size)
    row_loss = row_weighted_errors(weight, qw.dequantize(), hessian)
    return GPTQResult(qw, float(row_loss.sum()), damp, time.perf_counter() - start, row_loss)


def row_weighted_errors(w: torch.Tensor, w_hat: torch.Tensor | None, hessian: torch.Tensor) -> torch.Tensor:
    """Per output row ``(w_r - w_hat_r) H (w_r - w_hat_r)^T`` in float64 (``w_hat=None``: ``w_r H w_r^T``)."""
    d = w.detach().double()
    if w_hat is not None:
        d = d - w_hat.detach().to(device=w.device, dtype=torch.float64)
    h = hessian.detach().to(device=w.device, dtype=torch.float64)
    return ((d @ h) * d).sum(1)


def weighted_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    """``tr((W - W_hat) H (W - W_hat)^T)`` in float64."""
    return float(row_weighted_errors(w, w_hat, hessian).sum())


def error_ratio(num: float, den: float) -> float:
    """``num / den`` for squared errors: 0.0 when both are zero, ``inf`` when only ``den`` is."""
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def relative_output_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    """``weighted_error / tr(W H W^T)``: relative squared output error on inputs with ``X^T X = H``.

    0.0 when both are zero, ``inf`` when only the denominator is.
    """
    return error_ratio(weighted_error(w, w_hat, hessian), float(row_weighted_errors(w, None, hessian).sum()))
