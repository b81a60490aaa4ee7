"""NVFP4 weight-only GEMM ``y = x @ W^T`` on ModelOpt-exported weights (activations stay in fp16 / bf16).

``nvfp4_matmul`` dispatches between the Triton kernels (``triton_kernels``, imported on first use; its ``matmul``
picks the kernel by the number of rows) and the plain-PyTorch reference (``reference``), by ``backend`` as
``salaquant.kernels.backend.use_triton`` decides it.
"""

from __future__ import annotations

import torch

from ..backend import use_triton
from .reference import E2M1_TABLE, check_operands, dequantize, nvfp4_matmul_reference

__all__ = ["E2M1_TABLE", "check_operands", "dequantize", "nvfp4_matmul", "nvfp4_matmul_reference"]


def nvfp4_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    backend: str = "auto",
) -> torch.Tensor:
    """``y [..., N] = x [..., K] @ W^T`` for an NVFP4 weight (``weight`` uint8 ``[N, K/2]``, ``weight_scale``
    float8_e4m3fn ``[N, K/16]``, ``weight_scale_2`` fp32 scalar); fp32 accumulation, output ``x.dtype``."""
    if not use_triton(backend, x):
        return nvfp4_matmul_reference(x, weight, weight_scale, weight_scale_2)
    if torch.compiler.is_compiling() and isinstance(weight_scale_2, torch.Tensor):  # opaque (``kernels.ops``)
        from ..ops import nvfp4_matmul_op

        flat = nvfp4_matmul_op(x.reshape(-1, x.shape[-1]), weight, weight_scale, weight_scale_2)
        return flat.reshape(*x.shape[:-1], weight.shape[0])
    from . import triton_kernels

    return triton_kernels.matmul(x, weight, weight_scale, weight_scale_2)
