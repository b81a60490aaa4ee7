"""Per-input-group activation statistics collected during calibration.

For the input X [n, d] of a group (every token of every sample), the accumulator keeps ``sum X^T X`` (fp32
by default, on TF32 tensor cores when the inputs are 16-bit floats; fp64 optional), ``sum_s X_s^T X_s / n_s``
(the per-sample-normalised variant), the per-channel absolute maximum, ``sum x^2`` per channel and the token
and sample counts. `merge` adds another accumulator's sums (another leaf of samples, another process's share:
``.shards`` fixes the order) and `tensors` lists every sum as one tensor on the accumulator's device,
for the processes of a data-parallel run to exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

HESSIAN_SUMS = ("tokens", "samples")
"""The two Hessian sums: ``sum X^T X`` (every token weighs the same) and ``sum_s X_s^T X_s / n_s`` (every sample)."""

_HALF_MM_FP32_OUT = [True]
"""Whether this torch multiplies 16-bit CUDA matrices into a float32 result (``out_dtype``); cleared on failure."""


def _tf32_exact(x: torch.Tensor, acc_dtype: torch.dtype) -> bool:
    """True when an fp32 product of ``x`` loses nothing on TF32 tensor cores: 16-bit float inputs on CUDA."""
    return x.is_cuda and acc_dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16)


@dataclass
class GroupStats:
    """Statistics of one input group; update with chunks of a sample, then ``end_sample()``."""

    dim: int
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    hessian: bool = True
    sums: tuple[str, ...] = HESSIAN_SUMS  # which of the two Hessian sums to keep ("tokens": xtx, "samples")
    xtx: torch.Tensor | None = None
    xtx_per_sample: torch.Tensor | None = None
    absmax: torch.Tensor = field(init=False)
    sumsq: torch.Tensor = field(init=False)
    counts: torch.Tensor = field(init=False)  # [tokens, samples], int64 on ``device``
    _sample_xtx: torch.Tensor | None = None  # the open sample's X^T X, allocated by its first chunk
    _sample_tokens: int = 0

    def __post_init__(self) -> None:
        self.absmax = torch.zeros(self.dim, dtype=torch.float32, device=self.device)
        self.sumsq = torch.zeros(self.dim, dtype=torch.float64, device=self.device)
        self.counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        unknown = set(self.sums) - set(HESSIAN_SUMS)
        if unknown or not self.sums:
            raise ValueError(f"Hessian sums {self.sums!r}: expected some of {HESSIAN_SUMS}")
        if self.hessian and "tokens" in self.sums:
            self.xtx = torch.zeros(self.dim, self.dim, dtype=self.dtype, device=self.device)
        if self.hessian and "samples" in self.sums:
            self.xtx_per_sample = torch.zeros(self.dim, self.dim, dtype=self.dtype, device=self.device)

    @property
    def tokens(self) -> int:
        return int(self.counts[0])

    @property
    def samples(self) -> int:
        return int(self.counts[1])

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Add a chunk of inputs [..., dim] of the current sample."""
        x2 = x.reshape(-1, self.dim)
        if x2.shape[0] == 0:
            return
        self.absmax = torch.maximum(self.absmax, x2.abs().amax(0).float())
        xf = x2.to(self.dtype)
        self.sumsq += xf.pow(2).sum(0).to(torch.float64)
        if self.hessian and self._sample_xtx is None:
            self._sample_xtx = torch.zeros(self.dim, self.dim, dtype=self.dtype, device=self.device)
        if self._sample_xtx is not None:
            if not _tf32_exact(x2, self.dtype):
                self._sample_xtx.addmm_(xf.T, xf)
            elif not self._half_product(x2):
                # bf16/fp16 values are exact in TF32 (8 exponent bits, 10 mantissa bits), so the tensor-core product
                # with fp32 accumulation equals the fp32 one up to summation order, at several times its speed.
                prev = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = True
                try:
                    self._sample_xtx.addmm_(xf.T, xf)
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = prev
        self._sample_tokens += x2.shape[0]

    def _half_product(self, x2: torch.Tensor) -> bool:
        """``X^T X`` of 16-bit CUDA inputs straight on the 16-bit tensor cores with a float32 result (products
        exact, sums in fp32, as the TF32 product): no float32 copy of the activations and about half its time.
        False (nothing done) where this torch has no ``out_dtype`` for CUDA matrix products."""
        if not _HALF_MM_FP32_OUT[0]:
            return False
        assert self._sample_xtx is not None
        try:
            self._sample_xtx = torch.addmm(self._sample_xtx, x2.T, x2, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _HALF_MM_FP32_OUT[0] = False
            return False
        return True

    def end_sample(self) -> None:
        """Close the current sample: fold its X^T X into both Hessian sums."""
        if self._sample_tokens == 0:
            return
        if self._sample_xtx is not None:
            if self.xtx is not None:
                self.xtx += self._sample_xtx
            if self.xtx_per_sample is not None:
                self.xtx_per_sample.add_(self._sample_xtx, alpha=1.0 / self._sample_tokens)
            self._sample_xtx.zero_()
        self.counts[0] += self._sample_tokens
        self.counts[1] += 1
        self._sample_tokens = 0

    def close(self) -> None:
        """Free the open-sample buffer: nothing more is added but by `merge`."""
        self._sample_xtx = None

    def merge(self, other: GroupStats) -> GroupStats:
        """Add ``other``'s sums (and take the larger absolute maxima) into this one; returns it."""
        self.absmax = torch.maximum(self.absmax, other.absmax.to(self.absmax.device))
        self.sumsq += other.sumsq.to(self.sumsq.device)
        self.counts += other.counts.to(self.counts.device)
        if self.xtx is not None:
            assert other.xtx is not None, "merging statistics that keep different Hessian sums"
            self.xtx += other.xtx.to(self.xtx.device)
        if self.xtx_per_sample is not None:
            assert other.xtx_per_sample is not None, "merging statistics that keep different Hessian sums"
            self.xtx_per_sample += other.xtx_per_sample.to(self.xtx_per_sample.device)
        return self

    def tensors(self) -> list[torch.Tensor]:
        """Every sum, in a fixed order (received in place by another process: `merge` reads the same fields)."""
        out = [self.absmax, self.sumsq, self.counts]
        out += [t for t in (self.xtx, self.xtx_per_sample) if t is not None]
        return out

    # ------------------------------------------------------------------ derived statistics
    def hessian_mean(self) -> torch.Tensor:
        """``sum X^T X / tokens`` (every token weighs the same)."""
        assert self.xtx is not None, "collected without the token-weighted Hessian sum"
        return self.xtx / max(1, self.tokens)

    def hessian_per_sample(self) -> torch.Tensor:
        """``mean over samples of X_s^T X_s / n_s`` (every sample weighs the same)."""
        assert self.xtx_per_sample is not None, "collected without the per-sample Hessian sum"
        return self.xtx_per_sample / max(1, self.samples)

    def mean_sq(self) -> torch.Tensor:
        """Per-channel mean of x^2 over all tokens (fp32)."""
        return (self.sumsq / max(1, self.tokens)).float()

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "absmax": self.absmax.cpu(),
            "sumsq": self.sumsq.cpu(),
            "counts": self.counts.cpu(),
        }
        if self.xtx is not None:
            out["xtx"] = self.xtx.cpu()
        if self.xtx_per_sample is not None:
            out["xtx_per_sample"] = self.xtx_per_sample.cpu()
        return out


LayerStats = dict[str, GroupStats]
