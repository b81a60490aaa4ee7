"""Elementwise error bounds for the kernel tests: a result against a float64 reference, each output against its own
bound (typically a relative tolerance times ``|x| @ |W|^T``)."""

from __future__ import annotations

import torch


def assert_within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """``|y - ref| <= bound`` for every output; NaN fails. The message counts the outputs off and the worst ratio."""
    err = (y.double() - ref.double()).abs()
    bad = ~(err <= bound)
    worst = float((err / bound).nan_to_num(1e9).max())
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {bad.numel()} outputs off, worst err/bound {worst:.3g}"
