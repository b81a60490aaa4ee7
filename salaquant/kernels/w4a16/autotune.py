"""Autotuning of the W4A16 kernels that tune per shape (``gemv``, ``tiled``): a short timing per candidate, and
one candidate under the interpreter."""

from __future__ import annotations

import triton

from ..device import INTERPRET

__all__ = ["INTERPRET", "bench", "config"]


def bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def config(num_warps: int, num_stages: int, **meta: int) -> triton.Config:
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)
