"""Building blocks shared by both MiniCPM-SALA layer types: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.backend import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "reference") -> torch.Tensor:
    """RMSNorm as SALA computes it: fp32 variance, normalise, cast back, then multiply by the weight. ``backend``
    (``salaquant.kernels.backend.use_triton``) runs this code or the one-kernel Triton version
    (``salaquant.kernels.rmsnorm``)."""
    if use_triton(backend, x, weight) and not torch.compiler.is_compiling():  # compiled: fused by the compiler
        from ..kernels.rmsnorm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(variance + eps)).to(dtype) * weight


class RMSNorm(nn.Module):
    """``rms_norm`` over the last dimension; the runtime may set ``backend`` (``use_layer_kernels``)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = "reference"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.backend)


class MLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; gate and up from one fused ``gate_up_proj`` where the
    runtime made one (``fused_outputs``)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused_outputs(self, x, ("gate_proj", "up_proj"))
        return self.down_proj(F.silu(gate) * up)


def fused_outputs(parent: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> list[torch.Tensor]:
    """The outputs on ``x`` of the linears ``names`` of ``parent``: where the runtime fused them
    (``runtime.fuse`` sets ``fused_name``, ``fused_members`` and ``fused_sizes``), the one product split back into
    its members' columns (views), each other linear on its own."""
    fused = getattr(parent, "fused_name", None)
    parts: dict[str, torch.Tensor] = {}
    if fused is not None and any(n in parent.fused_members for n in names):
        outs = parent._modules[fused](x).split(parent.fused_sizes, dim=-1)
        parts = dict(zip(parent.fused_members, outs, strict=True))
    return [parts[n] if n in parts else parent._modules[n](x) for n in names]


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, linear_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [..., T, head_dim] for the given positions only (no 524288-long tables).

    NeoX layout: the frequency vector is repeated twice, matching ``rotate_half``.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    t = positions.to(torch.float32) / linear_factor
    freqs = t[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by cos/sin [T, D] (or [B, T, D]) in fp32, cast back to x's dtype."""
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.to(torch.float32)
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
