"""Plain-PyTorch NVFP4 weight-only GEMM: the definition the Triton kernels are tested against.

Weight layout (ModelOpt export): ``weight`` uint8 ``[N, K/2]`` holds two E2M1 codes per byte along K, the even
element in the low nibble; ``weight_scale`` float8_e4m3fn ``[N, K/16]`` holds one scale per 16 inputs;
``weight_scale_2`` is an fp32 scalar. A code is ``sign << 3 | magnitude index`` over the magnitudes
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, and ``W[n, k] = e2m1(code) * (float(weight_scale[n, k // 16]) * weight_scale_2)``
in fp32.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "E2M1_TABLE", "check_operands", "dequantize", "nvfp4_matmul_reference"]

BLOCK = 16
"""Inputs per FP8 block scale."""

E2M1_TABLE: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
"""Value of each 4-bit E2M1 code 0-15."""


def _scale_bytes_as_fp8(weight_scale: torch.Tensor) -> torch.Tensor:
    """``weight_scale`` as float8_e4m3fn (uint8 bytes are reinterpreted, not converted)."""
    if weight_scale.dtype == torch.float8_e4m3fn:
        return weight_scale
    if weight_scale.dtype == torch.uint8:
        return weight_scale.view(torch.float8_e4m3fn)
    raise ValueError(f"weight_scale must be float8_e4m3fn (or its uint8 bytes), got {weight_scale.dtype}")


def check_operands(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | float
) -> tuple[int, int]:
    """``(N, K)`` of an NVFP4 weight; ValueError on a wrong dtype, shape or device."""
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"weight must be uint8 [N, K/2], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], 2 * weight.shape[1]
    if k % BLOCK != 0:
        raise ValueError(f"K = {k} is not a multiple of {BLOCK}")
    _scale_bytes_as_fp8(weight_scale)
    if tuple(weight_scale.shape) != (n, k // BLOCK):
        raise ValueError(f"weight_scale must have shape {(n, k // BLOCK)}, got {tuple(weight_scale.shape)}")
    if weight_scale.device != weight.device:
        raise ValueError(f"weight_scale is on {weight_scale.device}, weight on {weight.device}")
    if isinstance(weight_scale_2, torch.Tensor) and weight_scale_2.numel() != 1:
        raise ValueError(f"weight_scale_2 must be a scalar, got shape {tuple(weight_scale_2.shape)}")
    return n, k


def dequantize(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[N, K]`` weight ``e2m1(code) * (float(weight_scale) * weight_scale_2)`` in fp32, cast to ``dtype``."""
    n, k = check_operands(weight, weight_scale, weight_scale_2)
    table = torch.tensor(E2M1_TABLE, dtype=torch.float32, device=weight.device)
    codes = torch.stack((weight & 0x0F, weight >> 4), dim=-1).reshape(n, k)
    values = table[codes.long()].reshape(n, k // BLOCK, BLOCK)
    s2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device).reshape(())
    block = _scale_bytes_as_fp8(weight_scale).float() * s2
    return (values * block.unsqueeze(-1)).reshape(n, k).to(dtype)


def nvfp4_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
) -> torch.Tensor:
    """``y [..., N] = x [..., K] @ W^T`` with the weight dequantized in fp32, fp32 products, output ``x.dtype``."""
    n, k = check_operands(weight, weight_scale, weight_scale_2)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    w = dequantize(weight, weight_scale, weight_scale_2)
    return (x.reshape(-1, k).float() @ w.t()).reshape(*x.shape[:-1], n).to(x.dtype)
