"""Plain PyTorch reference for the W4A16 GEMM on GPTQ v1 tensors (the CPU path).

Layout (as ``salaquant.gptq.packing`` writes it), with ``p = 32 / bits`` values per int32 word:

* ``qweight`` int32 ``[K / p, N]``: input row ``p * r + j`` in bits ``[bits * j, bits * (j + 1))`` of word row ``r``;
* ``scales`` ``[groups, N]`` (fp16 on disk), ``groups = ceil(K / group_size)``, one group when ``group_size == -1``;
* symmetric codes: the zero point is ``2 ** (bits - 1)``, so qzeros carry no information.

``W[n, k] = (code[k, n] - 2 ** (bits - 1)) * scales[k // group_size, n]`` and ``y = x @ W^T``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["SUPPORTED_BITS", "check_operands", "dequantize", "w4a16_matmul_reference"]

SUPPORTED_BITS = (4, 8)


def check_operands(qweight: Tensor, scales: Tensor, bits: int, group_size: int) -> tuple[int, int, int]:
    """Validate the packed operands; return ``(K, N, group_size)`` with ``-1`` resolved to ``K``."""
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    pack = 32 // bits
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(
            f"qweight must be a 2-D int32 tensor [K*bits/32, N], got {qweight.dtype} {list(qweight.shape)}"
        )
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    if k == 0 or n == 0:
        raise ValueError(f"qweight shape {list(qweight.shape)} is empty")
    if group_size == -1:
        gs = k
    elif isinstance(group_size, bool) or group_size <= 0 or group_size % pack:
        raise ValueError(f"group_size must be -1 or a positive multiple of {pack} for {bits}-bit, got {group_size!r}")
    else:
        gs = int(group_size)
    groups = -(-k // gs)
    if not scales.dtype.is_floating_point or tuple(scales.shape) != (groups, n):
        raise ValueError(
            f"scales must be a float tensor [{groups}, {n}] (K={k}, group_size={group_size}), "
            f"got {scales.dtype} {list(scales.shape)}"
        )
    if scales.device != qweight.device:
        raise ValueError(f"scales are on {scales.device} but qweight is on {qweight.device}")
    return k, n, gs


def _codes(qweight: Tensor, bits: int) -> Tensor:
    """Unsigned codes ``[K, N]`` (int32) from the packed words ``[K / p, N]``."""
    pack = 32 // bits
    mask = (1 << bits) - 1
    planes = [torch.bitwise_and(torch.bitwise_right_shift(qweight, bits * j), mask) for j in range(pack)]
    # planes[j][r] is input row p * r + j: interleave along a new dim 1, then merge it into the rows.
    return torch.stack(planes, dim=1).reshape(qweight.shape[0] * pack, qweight.shape[1])


def dequantize(qweight: Tensor, scales: Tensor, bits: int = 4, group_size: int = 128) -> Tensor:
    """Float32 weight ``[N, K]`` from the packed codes and the per-group scales."""
    k, _, gs = check_operands(qweight, scales, bits, group_size)
    codes = _codes(qweight, bits).to(torch.float32) - float(1 << (bits - 1))
    rows = torch.arange(k, device=qweight.device) // gs
    return (codes * scales.to(torch.float32).index_select(0, rows)).t()


def w4a16_matmul_reference(x: Tensor, qweight: Tensor, scales: Tensor, bits: int = 4, group_size: int = 128) -> Tensor:
    """``x [..., K] @ W^T`` computed in fp32 from the dequantized weight; returned in ``x.dtype``."""
    w = dequantize(qweight, scales, bits, group_size)
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} input features but the weight has K={w.shape[1]}")
    return (x.to(torch.float32) @ w.t()).to(x.dtype)
