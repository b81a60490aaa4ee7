"""Linear layers that compute from packed quantized weights (weight-only: activations stay bf16/fp16).

Both dispatch to ``salaquant.kernels``: Triton on CUDA tensors, the PyTorch reference elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn


class GPTQLinear(nn.Module):
    """y = x @ W^T with W in the GPTQ v1 layout (symmetric, monotonic g_idx)."""

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, backend: str = "auto"
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bits = bits
        self.group_size = group_size
        self.backend = backend
        self.in_features = qweight.shape[0] * 32 // bits
        self.out_features = qweight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.w4a16 import w4a16_matmul

        shape = x.shape
        y = w4a16_matmul(
            x.reshape(-1, shape[-1]),
            self.qweight,
            self.scales,
            bits=self.bits,
            group_size=self.group_size,
            backend=self.backend,
        )
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group_size={self.group_size}"


class NVFP4Linear(nn.Module):
    """y = x @ W^T with W in ModelOpt's NVFP4 layout (E2M1 codes, FP8 block scales, fp32 global scale)."""

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, backend: str = "auto"
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_scale_2", weight_scale_2.reshape(()).float())
        self.backend = backend
        self.in_features = weight.shape[1] * 2
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.nvfp4 import nvfp4_matmul

        shape = x.shape
        y = nvfp4_matmul(
            x.reshape(-1, shape[-1]), self.weight, self.weight_scale, self.weight_scale_2, backend=self.backend
        )
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, nvfp4"
