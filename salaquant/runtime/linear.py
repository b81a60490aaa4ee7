"""Linear layers that compute from packed quantized weights.

Both dispatch to ``salaquant.kernels``: Triton on CUDA tensors, the PyTorch reference elsewhere. GPTQ is
weight-only (activations stay bf16/fp16); NVFP4 is weight-only too unless asked for FP4 activations, which are
then quantized as the Blackwell FP4 GEMM quantizes them (``formats.modelopt_nvfp4.quantize_activations``).
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
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        backend: str = "auto",
        input_scale: torch.Tensor | None = None,
    ) -> None:
        """``input_scale`` (the export's static activation scale) makes the layer W4A4: its inputs are quantized
        to NVFP4 before the product, as the FP4 GEMM does; without it the layer is weight-only."""
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_scale_2", weight_scale_2.reshape(()).float())
        if input_scale is not None:
            from ..formats.modelopt_nvfp4.numerics import check_input_scale

            check_input_scale(input_scale)  # once here, not per call
        self.register_buffer("input_scale", None if input_scale is None else input_scale.reshape(()).float())
        self.backend = backend
        self.in_features = weight.shape[1] * 2
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.nvfp4 import nvfp4_matmul

        if self.input_scale is not None:
            from ..formats.modelopt_nvfp4.numerics import quantize_activations

            x = quantize_activations(x, self.input_scale)
        shape = x.shape
        y = nvfp4_matmul(
            x.reshape(-1, shape[-1]), self.weight, self.weight_scale, self.weight_scale_2, backend=self.backend
        )
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        acts = "fp4" if self.input_scale is not None else "16-bit"
        return f"in={self.in_features}, out={self.out_features}, nvfp4, activations {acts}"
