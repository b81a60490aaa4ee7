"""One program per row: fp32 mean of squares, ``x * rsqrt(mean + eps)`` rounded to the input dtype, times the weight
in fp32, rounded to the output dtype (the reference's ``(xf * rsqrt(var + eps)).to(dtype) * weight``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., n]`` with ``weight [n]``; output in ``promote_types(x.dtype, weight.dtype)``."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight must have shape [{n}], got {list(weight.shape)}")
    flat = x.reshape(-1, n).contiguous()
    out = torch.empty(flat.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if flat.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(flat.shape[0],)](flat, weight.contiguous(), out, n, eps, BLOCK=block, num_warps=4)
    return out.reshape(*x.shape[:-1], n)
