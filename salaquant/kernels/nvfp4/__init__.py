"""NVFP4 weight-only GEMM ``y = x @ W^T`` on ModelOpt-exported weights (activations stay in fp16 / bf16).

``nvfp4_matmul`` dispatches between the Triton kernels (``triton_kernels``, imported on first use) and the
plain-PyTorch reference (``reference``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .reference import E2M1_TABLE, check_operands, dequantize, nvfp4_matmul_reference

__all__ = [
    "BACKENDS",
    "DEQUANT_MIN_M",
    "E2M1_TABLE",
    "check_operands",
    "dequantize",
    "nvfp4_matmul",
    "nvfp4_matmul_reference",
]

BACKENDS = ("auto", "triton", "dequant", "reference")
"""``auto``: on CUDA ``dequant`` for M >= DEQUANT_MIN_M, else ``triton``; off CUDA ``reference``.
``triton``: the fused kernels at every M (CPU only under TRITON_INTERPRET=1). ``dequant``: the Triton
dequantization kernel writes the weight in ``x.dtype``, then ``F.linear``. ``reference``: plain PyTorch."""

DEQUANT_MIN_M = 1024
"""Rows from which ``auto`` prefers dequantize + cuBLAS over the fused kernel (compute-bound prefill)."""


def _rows(x: torch.Tensor) -> int:
    """Number of activation rows ``M`` of ``x [..., K]``."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def nvfp4_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    backend: str = "auto",
) -> torch.Tensor:
    """``y [..., N] = x [..., K] @ W^T`` for an NVFP4 weight (``weight`` uint8 ``[N, K/2]``, ``weight_scale``
    float8_e4m3fn ``[N, K/16]``, ``weight_scale_2`` fp32 scalar); fp32 accumulation, output ``x.dtype``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if not x.is_cuda:
            backend = "reference"
        elif _rows(x) >= DEQUANT_MIN_M:
            backend = "dequant"
        else:
            backend = "triton"
    if backend == "reference":
        return nvfp4_matmul_reference(x, weight, weight_scale, weight_scale_2)
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(f"backend {backend!r} needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    from . import triton_kernels

    if backend == "triton":
        return triton_kernels.nvfp4_matmul_triton(x, weight, weight_scale, weight_scale_2)
    k = check_operands(weight, weight_scale, weight_scale_2)[1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    w = triton_kernels.nvfp4_dequantize_triton(weight, weight_scale, weight_scale_2, dtype=x.dtype)
    return F.linear(x, w)
