"""Masked attention of one query token per row over a static KV buffer, split over the keys (flash decoding).

``static_cache.decode_attention`` runs it on its Triton path: each minicpm4 layer's KV head holds G query heads and
up to the whole buffer of keys, so a single program per head (PyTorch's fused attention on this shape) reads all
of its keys alone; here the keys are split over enough programs to fill the GPU and the partial softmaxes merged.
"""

from __future__ import annotations

import torch

__all__ = ["masked_decode_attention"]


def masked_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``softmax(q k^T * scale, masked) v`` for ``q [B, Hkv, G, D]``, ``k, v [B, C, Hkv, D]`` and ``mask [B, Hkv,
    C]`` on the Triton kernels (``triton_kernels.masked_decode_attention_triton``); an opaque op while
    ``torch.compile`` traces (``kernels.ops``)."""
    if torch.compiler.is_compiling():
        from ..ops import decode_attention_op

        return decode_attention_op(q, k, v, mask, scale)
    from .triton_kernels import masked_decode_attention_triton

    return masked_decode_attention_triton(q, k, v, mask, scale)
