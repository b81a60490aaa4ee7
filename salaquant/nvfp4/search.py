"""The NVFP4 block-scale search: per 16-weight block, the FP8 scale between ``1 - max_shrink`` and ``max_grow`` times
the plain one that minimises the importance-weighted squared error of the dequantized weights (the importance is
the Hessian diagonal of the calibration inputs). It produces scales; the bytes they are stored as are
``salaquant.formats.modelopt_nvfp4``'s.

A scale above the plain one maps the block's largest weight below E2M1's 6, e.g. onto 4 at 1.5 times it, where the
grid is twice as fine (4 is followed by 6): for a block whose other weights fall between grid points that can cost
the largest weight nothing and the rest less. The caller leaves room for it under FP8's 448 by a global scale
``max_grow`` times ModelOpt's (``searched_global_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.modelopt_nvfp4.numerics import (
    BLOCK,
    as_fp32,
    block_round,
    check_weight,
    global_scale,
    raw_block_scales,
    round_block_scales,
    scalar_scale,
    weight_blocks,
)
from ..settings import defaults

__all__ = ["SearchResult", "fine_search", "search_block_scales", "searched_global_scale", "shrink_factors"]

_DEFAULTS = defaults("nvfp4")


@dataclass
class SearchResult:
    """Searched block scales and the importance-weighted squared error before and after the search."""

    scales: torch.Tensor
    """float8_e4m3fn ``[out, in / 16]`` block scales."""
    error_plain: float
    """``sum (w - w_hat)^2 * importance`` with the plain ``block_scales``."""
    error_searched: float
    """The same with ``scales``; never larger than ``error_plain``."""


def shrink_factors(iters: int, max_shrink: float) -> list[float]:
    """The ``iters`` shrink factors ``1 - max_shrink * t / (iters - 1)``, from 1.0 down to ``1 - max_shrink``."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if not 0.0 <= max_shrink < 1.0:
        raise ValueError(f"max_shrink must be in [0, 1), got {max_shrink}")
    if iters == 1:
        return [1.0]
    return [1.0 - max_shrink * t / (iters - 1) for t in range(iters)]


def searched_global_scale(amax: torch.Tensor, max_grow: float) -> torch.Tensor:
    """The global scale the search works under: ModelOpt's ``amax / (6 * 448)`` times ``max_grow``, so that the
    tensor's largest block can take ``max_grow`` times its plain scale before FP8's 448 clamps it."""
    if not max_grow >= 1.0:
        raise ValueError(f"max_grow must be >= 1, got {max_grow}")
    return global_scale(amax) if max_grow == 1.0 else global_scale(amax) * max_grow


def fine_search(factors: list[float], max_shrink: float) -> bool:
    """Whether ``factors`` are fine enough that trying every FP8 value from the plain scale down to the smallest
    factor's finds what trying every factor would (see ``search_block_scales``)."""
    return len(factors) > 1 and max_shrink / (len(factors) - 1) <= (1.0 - max_shrink) / 16


def search_block_scales(
    w: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    importance: torch.Tensor,
    iters: int = _DEFAULTS.nvfp4.mse_iters,
    max_shrink: float = _DEFAULTS.nvfp4.mse_max_shrink,
    max_grow: float = _DEFAULTS.nvfp4.mse_max_grow,
) -> SearchResult:
    """Per-block search of the scale minimising ``sum_j (w_j - w_hat_j)^2 * importance_j``.

    Each candidate scale is ``block_scales(w, weight_scale_2, shrink=f)`` for ``f`` in
    ``shrink_factors(iters, max_shrink)``; a block keeps the first (largest) factor reaching its least error, so
    ``f = 1`` (the plain scale) wins ties. ``importance [in]`` (e.g. the Hessian diagonal) must be ``>= 0``.

    Many factors round to the same FP8 scale (E4M3 has 8 steps per octave; 80 factors over 1.0-0.4 reach about
    12 distinct scales per block). When the factors are fine enough to reach every FP8 value between the plain
    scale and the smallest factor's (``max_shrink / (iters - 1) <= (1 - max_shrink) / 16``: the factor step is
    below the narrowest rounding interval there), those values are tried directly, largest first, one pass each:
    the same scales and errors as trying every factor, in a fraction of the passes. Otherwise every factor is
    tried, one pass each.

    Then every FP8 value above the plain scale up to ``max_grow`` times it, smallest first (``max_grow = 1``: none);
    a block takes one only where it is strictly better than the best below, so the plain scale and then the
    shrunk ones win ties.
    """
    check_weight(w)
    factors = shrink_factors(iters, max_shrink)
    if not max_grow >= 1.0:
        raise ValueError(f"max_grow must be >= 1, got {max_grow}")
    n = w.shape[1]
    imp = as_fp32(importance, w.device)
    if tuple(imp.shape) != (n,):
        raise ValueError(f"importance must have shape ({n},), got {tuple(imp.shape)}")
    if bool((imp < 0).any()) or not bool(torch.isfinite(imp).all()):
        raise ValueError("importance must be finite and >= 0")
    imp = imp.reshape(1, n // BLOCK, BLOCK)
    s2 = scalar_scale(weight_scale_2, w.device)
    wb = weight_blocks(w)
    raw = raw_block_scales(wb.abs().amax(dim=-1), s2)
    if fine_search(factors, max_shrink):
        best_bits, best_err, plain_err = _search_fp8_values(wb, raw, imp, s2, factors[-1])
    else:
        best_bits, best_err, plain_err = _search_factors(wb, raw, imp, s2, factors)
    if max_grow > 1.0:
        best_bits, best_err = _search_grown(wb, raw, imp, s2, max_grow, best_bits, best_err)
    return SearchResult(
        scales=best_bits.view(torch.float8_e4m3fn),
        error_plain=float(plain_err.double().sum()),
        error_searched=float(best_err.double().sum()),
    )


def _scale_error(wb: torch.Tensor, scale: torch.Tensor, imp: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """Importance-weighted squared error ``[out, nb]`` of each block under its FP8 ``scale``."""
    w_hat = block_round(wb, scale.float(), s2)
    return ((wb - w_hat) ** 2 * imp).sum(dim=-1)


def _search_factors(
    wb: torch.Tensor, raw: torch.Tensor, imp: torch.Tensor, s2: torch.Tensor, factors: list[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every factor in order, one pass each: (best scale bits, best error, plain error) per block."""
    best_bits = best_err = plain_err = torch.empty(0)
    for t, f in enumerate(factors):
        scale = round_block_scales(raw * f)
        err = _scale_error(wb, scale, imp, s2)
        bits = scale.view(torch.uint8)
        if t == 0:
            best_bits, best_err, plain_err = bits, err, err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_bits = torch.where(better, bits, best_bits)
    return best_bits, best_err, plain_err


def _search_fp8_values(
    wb: torch.Tensor, raw: torch.Tensor, imp: torch.Tensor, s2: torch.Tensor, smallest_factor: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every FP8 value from each block's plain scale down to its smallest factor's, largest first.

    Positive E4M3 values are ordered as their bit patterns, so step ``t`` tries ``plain bits - t`` in every
    block where that is still at or above the smallest factor's bits.
    """
    hi = round_block_scales(raw).view(torch.uint8).to(torch.int16)
    lo = round_block_scales(raw * smallest_factor).view(torch.uint8).to(torch.int16)
    steps = int((hi - lo).max()) + 1 if hi.numel() else 1
    best_bits = hi.to(torch.uint8)
    best_err = plain_err = _scale_error(wb, best_bits.view(torch.float8_e4m3fn), imp, s2)
    for t in range(1, steps):
        cand = hi - t
        valid = cand >= lo  # lo >= 1 (the smallest scale is 2**-9): valid candidates are positive, never NaN
        bits = cand.clamp(min=0).to(torch.uint8)
        err = _scale_error(wb, bits.view(torch.float8_e4m3fn), imp, s2)
        better = valid & (err < best_err)
        best_err = torch.where(better, err, best_err)
        best_bits = torch.where(better, bits, best_bits)
    return best_bits, best_err, plain_err


def _search_grown(
    wb: torch.Tensor,
    raw: torch.Tensor,
    imp: torch.Tensor,
    s2: torch.Tensor,
    max_grow: float,
    best_bits: torch.Tensor,
    best_err: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every FP8 value above each block's plain scale up to ``max_grow`` times it, smallest first, against the best
    so far: step ``t`` tries ``plain bits + t`` where that is still at or below the largest's bits (448 at most)."""
    hi = round_block_scales(raw).view(torch.uint8).to(torch.int16)
    top = round_block_scales(raw * max_grow).view(torch.uint8).to(torch.int16)
    steps = int((top - hi).max()) if hi.numel() else 0
    for t in range(1, steps + 1):
        cand = hi + t
        valid = cand <= top  # top <= 0x7E (448): candidates stay finite
        bits = torch.where(valid, cand, hi).to(torch.uint8)
        err = _scale_error(wb, bits.view(torch.float8_e4m3fn), imp, s2)
        better = valid & (err < best_err)
        best_err = torch.where(better, err, best_err)
        best_bits = torch.where(better, bits, best_bits)
    return best_bits, best_err
