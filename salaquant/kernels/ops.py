"""The Triton matrix products and decode attention as ``torch.library`` custom ops, for code that ``torch.compile``
traces.

Inside a compiled function (``torch.compiler.is_compiling()``) ``w4a16_matmul``, ``nvfp4_matmul``,
``masked_decode_attention`` and the static cache's GLA step call these ops instead of their Python launchers: the
compiler then sees one opaque call with a known output shape (the ``register_fake`` functions) and fuses the
element-wise work around it, while the op itself runs the same Triton kernels as in eager code (the launchers pick
the path by the number of rows, as they do there). The GLA op declares the state it updates in place, so that the
compiled step writes the cache's buffer directly instead of a new state and a copy.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("salaquant::w4a16_matmul", mutates_args=())
def w4a16_matmul_op(x: Tensor, qweight: Tensor, scales: Tensor, bits: int, group_size: int) -> Tensor:
    """``x [M, K] @ W^T`` for GPTQ v1 tensors on the Triton kernels (``w4a16.triton_kernels.matmul``)."""
    from .w4a16.triton_kernels import matmul

    return matmul(x, qweight, scales, bits, group_size)


@w4a16_matmul_op.register_fake
def _(x: Tensor, qweight: Tensor, scales: Tensor, bits: int, group_size: int) -> Tensor:
    return x.new_empty(x.shape[0], qweight.shape[1])


@torch.library.custom_op("salaquant::nvfp4_matmul", mutates_args=())
def nvfp4_matmul_op(x: Tensor, weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor) -> Tensor:
    """``x [M, K] @ W^T`` for an NVFP4 weight on the Triton kernels (``nvfp4.triton_kernels.matmul``)."""
    from .nvfp4.triton_kernels import matmul

    return matmul(x, weight, weight_scale, weight_scale_2)


@nvfp4_matmul_op.register_fake
def _(x: Tensor, weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("salaquant::decode_attention", mutates_args=())
def decode_attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Split-key masked decode attention on the Triton kernels (``decode_attention.triton_kernels``)."""
    from .decode_attention.triton_kernels import masked_decode_attention_triton

    return masked_decode_attention_triton(q, k, v, mask, scale)


@decode_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("salaquant::gla_recurrent", mutates_args=("state",))
def gla_recurrent_op(q: Tensor, k: Tensor, v: Tensor, g_gamma: Tensor, scale: float, state: Tensor) -> Tensor:
    """Short-input Simple GLA (``gla.triton_kernels.recurrent_fwd``) from ``state``, which receives the final state
    in place; returns ``o [B, T, H, V]`` fp32."""
    from .gla.triton_kernels import recurrent_fwd

    return recurrent_fwd(q, k, v, g_gamma, scale, state, state_out=state)[0]


@gla_recurrent_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, g_gamma: Tensor, scale: float, state: Tensor) -> Tensor:
    return q.new_empty(*q.shape[:3], v.shape[-1], dtype=torch.float32)
