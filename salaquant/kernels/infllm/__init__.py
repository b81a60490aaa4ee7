"""InfLLM-v2 block-sparse attention in Triton: stage-1 scoring (``stage1``), block pooling, forcing and top-k in one
kernel (``select``) and stage-2 attention over the selected blocks (``stage2``), each module with its launcher.

Shapes and semantics follow the reference, the model package's ``sparse_attention.py``, whose
``infllm_v2_attention(..., backend=...)`` composes these launchers on its Triton path; they take the sparse
settings as plain integers. ``q: [B, Tq, Hq, D]``, ``k, v: [B, Tk, Hkv, D]``, compressed keys ``k1: [B, n1, Hkv,
D]`` and ``k2: [B, n2, Hkv, D]``; query ``i`` sits at position ``q_start + i``; the ``G = Hq // Hkv`` query heads of
a KV group are consecutive. Block indices must be unique per row, as the selection produces them. Running maxima
start at a finite ``-1e30`` so that fully masked tiles stay NaN-free. Base offsets are int64; offsets inside one
(batch, KV head) slice are int32.
"""

from __future__ import annotations

from .select import pool_select
from .stage1 import stage1_scores
from .stage2 import block_sparse_attention

__all__ = ["LOCAL_DENSE_MIN_QUERIES", "SELECT_CHUNK", "block_sparse_attention", "pool_select", "stage1_scores"]

SELECT_CHUNK = 8192
"""Queries scored and selected per step of the Triton pipeline (bounds its ``[.., chunk, n1]`` score buffers)."""
LOCAL_DENSE_MIN_QUERIES = 64
"""Fewest queries for which the Triton pipeline attends the forced blocks with the sliding-window kernel
(``block_sparse_attention(forced=...)``): tiles of queries then share their keys; decode keeps the split block
kernel."""
