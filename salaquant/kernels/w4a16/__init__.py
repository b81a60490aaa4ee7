"""W4A16 GEMM on GPTQ v1 tensors: ``y = x @ W^T`` with int4 (or int8) symmetric weights, fp32 accumulation.

``qweight`` int32 ``[K * bits / 32, N]`` packed LSB-first along K, ``scales`` ``[groups, N]``, zero point
``2 ** (bits - 1)``, group of input row ``k`` is ``k // group_size`` (``-1``: one group). See ``reference.py``.

``backend`` as ``salaquant.kernels.backend.use_triton`` decides it (``"auto"``: Triton for CUDA activations, the
reference otherwise); Triton is imported only when a Triton path runs; ``triton_kernels`` documents the paths
chosen by ``M``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import use_triton
from .reference import check_operands, dequantize, w4a16_matmul_reference

__all__ = ["dequantize", "w4a16_matmul", "w4a16_matmul_reference"]


def w4a16_matmul(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    bits: int = 4,
    group_size: int = 128,
    backend: str = "auto",
    *,
    qzeros: Tensor | None = None,
    g_idx: Tensor | None = None,
) -> Tensor:
    """``x [..., K] @ W^T`` in ``x.dtype`` (fp16, bf16 or fp32); returns ``[..., N]``.

    ``qzeros`` and ``g_idx`` are accepted as exported and only shape-checked: the weights are symmetric and
    ``g_idx`` must be ``k // group_size`` (no activation reordering).
    """
    k, n, _ = check_operands(qweight, scales, bits, group_size)
    if g_idx is not None and tuple(g_idx.shape) != (k,):
        raise ValueError(f"g_idx must have shape [{k}], got {list(g_idx.shape)}")
    if qzeros is not None and (qzeros.dim() != 2 or qzeros.shape[1] * (32 // bits) != n):
        raise ValueError(f"qzeros must be [groups, {n} * bits / 32], got {list(qzeros.shape)}")
    if not use_triton(backend, x):
        return w4a16_matmul_reference(x, qweight, scales, bits, group_size)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features but the weight has K={k}")
    if torch.compiler.is_compiling():  # an opaque op to the compiler (``kernels.ops``), the same kernels
        from ..ops import w4a16_matmul_op

        y = w4a16_matmul_op(x.reshape(-1, k), qweight, scales, bits, group_size)
    else:
        from .triton_kernels import matmul

        y = matmul(x.reshape(-1, k), qweight, scales, bits, group_size)
    return y.reshape(*x.shape[:-1], n)
