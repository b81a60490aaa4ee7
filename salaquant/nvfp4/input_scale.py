"""The activation global scale (``input_scale``) of an NVFP4 export: ModelOpt's max rule, or the MSE search.

On Blackwell the FP4 GEMM quantizes every linear's input with the export's ``input_scale`` as its global scale
(``formats.modelopt_nvfp4.numerics.quantize_activations``). ``"max"`` is ModelOpt's rule, ``calibrated amax / (6
* 448)``: nothing on the calibration tokens saturates. ``"mse"`` tries ``FACTORS`` times that and keeps the one
whose FP4 activations have the least squared error summed over every calibration token: below 1 the largest
blocks saturate in exchange for finer steps elsewhere, and at any factor the FP8 rounding of every block's scale
moves with the global scale, so some factors above 1 fit a tensor's blocks better than the max does. Ties keep
the factor nearest 1 (an all-zero input keeps the max rule). One scale per input tensor: every linear that reads
it shares the value, as the serving engines require of fused q/k/v and gate/up.

The error is summed over at most about ``SEARCH_TOKENS`` tokens per input plus every token that could saturate:
a token whose absolute maximum is at most ``FACTORS[0]`` times the calibrated one saturates at no candidate, so
its error only depends on how the block scales round, and those tokens are taken at a fixed stride, each standing
for ``stride`` tokens; every larger token is always counted once. Below ``SEARCH_TOKENS`` calibration tokens the
stride is 1 and the sum is exact. The cost is then bounded by the budget (one quantization per candidate), not by
the calibration set's size.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..formats.modelopt_nvfp4.numerics import quantize_activations

INPUT_SCALE_RULES = ("max", "mse")
FACTORS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0)
"""Multiples of the max rule's scale the search tries (the grid the rule was chosen with: docs/nvfp4.md)."""
SEARCH_TOKENS = 65536
"""Tokens per input whose error is computed when none of them can saturate (see the module docstring)."""


def search_stride(calibration_tokens: int) -> int:
    """Every how many small tokens one is measured, for a calibration set of ``calibration_tokens`` tokens."""
    return max(1, math.ceil(calibration_tokens / SEARCH_TOKENS))


class InputScaleSearch:
    """Squared error of one input's FP4 activations at each candidate scale, accumulated over chunks of tokens."""

    def __init__(self, max_scale: torch.Tensor, stride: int = 1) -> None:
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.max_scale = max_scale.detach().float().reshape(())
        self.stride = stride
        self.err2 = torch.zeros(len(FACTORS), dtype=torch.float64, device=self.max_scale.device)
        self.sum_sq = torch.zeros((), dtype=torch.float64, device=self.max_scale.device)
        self.counts = torch.zeros(2, dtype=torch.int64, device=self.max_scale.device)  # tokens seen, measured
        self._small_seen = 0  # small tokens passed so far: the stride runs across chunks (and samples)

    def fresh(self) -> InputScaleSearch:
        """An empty search over the same candidates (another leaf of samples: its stride starts again)."""
        return InputScaleSearch(self.max_scale, self.stride)

    def merge(self, other: InputScaleSearch) -> InputScaleSearch:
        """Add ``other``'s sums (the same candidates) into this one; returns it."""
        self.err2 += other.err2.to(self.err2.device)
        self.sum_sq += other.sum_sq.to(self.sum_sq.device)
        self.counts += other.counts.to(self.counts.device)
        return self

    def tensors(self) -> list[torch.Tensor]:
        """Every sum, in a fixed order, for another process to receive in place."""
        return [self.err2, self.sum_sq, self.counts]

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1]).float()
        if flat.shape[0] == 0:
            return
        self.counts[0] += flat.shape[0]
        if self.stride == 1:
            self._add(flat, 1.0)
            return
        # A token saturates at a candidate only above FACTORS[0] x the calibrated amax (= 6 * 448 * max_scale).
        large = flat.abs().amax(-1) > self.max_scale * (FACTORS[0] * 6.0 * 448.0)
        self._add(flat[large], 1.0)
        small = flat[~large]
        first = (-self._small_seen) % self.stride
        self._small_seen += small.shape[0]
        self._add(small[first :: self.stride], float(self.stride))

    def _add(self, rows: torch.Tensor, weight: float) -> None:
        if rows.shape[0] == 0:
            return
        self.counts[1] += rows.shape[0]
        self.sum_sq += rows.double().pow(2).sum() * weight
        for k, f in enumerate(FACTORS):
            diff = quantize_activations(rows, self.max_scale * f) - rows
            self.err2[k] += diff.double().pow(2).sum() * weight

    def best_factor(self) -> float:
        """The factor with the least error; among equal errors the one nearest 1."""
        err = self.err2.tolist()
        order = sorted(range(len(FACTORS)), key=lambda k: abs(math.log(FACTORS[k])))
        best = order[0]
        for k in order[1:]:
            if err[k] < err[best]:
                best = k
        return FACTORS[best]

    def scale(self) -> torch.Tensor:
        return self.max_scale * self.best_factor()

    def report(self) -> dict[str, Any]:
        """The chosen factor, the relative error (error / signal energy) at it and at the max rule, the tokens seen and
        the tokens whose error was computed."""
        total = float(self.sum_sq)
        err = self.err2.tolist()
        rel = [e / total if total > 0 else 0.0 for e in err]
        best = self.best_factor()
        tokens, measured = self.counts.tolist()
        return {
            "factor": best,
            "rel_err": rel[FACTORS.index(best)],
            "rel_err_max_rule": rel[FACTORS.index(1.0)],
            "tokens": tokens,
            "tokens_measured": measured,
        }
