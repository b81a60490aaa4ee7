"""The minicpm4 layers' KV cache stored in FP8, as SGLang's ``--kv-cache-dtype`` stores it.

SGLang's KV pool writes ``(k / k_scale).to(fp8)`` (and the same for v) and its attention kernels read the codes back
multiplied by the scale. A SALA export carries no ``k_scale`` / ``v_scale``, so the scale is 1.0 and a stored
key is ``k.to(fp8)`` upcast again: PyTorch's round-to-nearest-even cast, ``float8_e4m3fn`` (3 mantissa bits, at
most 448) or ``float8_e5m2`` (2 mantissa bits, at most 57344), with whatever that cast does beyond the range. Keys
and values of a prefill are stored before the attention reads them, so the round trip applies to every key and
value the attention sees, the current chunk's included. The lightning layers' GLA state stays 16-bit in SGLang
with an FP8 KV cache, and here.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"bf16": None, "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
"""``--kv-cache`` names and the storage dtype of each (None: keys and values kept as computed)."""


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")


def stored(x: torch.Tensor, name: str, scale: float = 1.0) -> torch.Tensor:
    """``x`` as the attention reads it back from a KV cache of dtype ``name`` with per-tensor ``scale``."""
    check_kv_cache_dtype(name)
    fp8 = KV_CACHE_DTYPES[name]
    if fp8 is None:
        return x
    return (x / scale).to(fp8).to(x.dtype) * scale


def use_kv_cache_dtype(model: torch.nn.Module, name: str) -> None:
    """Store the KV cache of every minicpm4 layer of ``model`` as ``name``."""
    check_kv_cache_dtype(name)
    for m in model.modules():
        if hasattr(m, "kv_cache_dtype"):
            m.kv_cache_dtype = name
