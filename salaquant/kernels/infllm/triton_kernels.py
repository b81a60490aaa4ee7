"""Triton kernels for InfLLM-v2 block-sparse attention: stage-1 scoring (``stage1``), block selection (``select``)
and stage-2 attention (``stage2``), each module with its launcher; this one gathers them.

Shapes and semantics follow ``salaquant.model.sparse_attention``: ``q: [B, Tq, Hq, D]``,
``k, v: [B, Tk, Hkv, D]``, compressed keys ``k1: [B, n1, Hkv, D]`` and ``k2: [B, n2, Hkv, D]``; query ``i``
sits at position ``q_start + i``; the ``G = Hq // Hkv`` query heads of a KV group are consecutive.

Block indices must be unique per row, as ``select_blocks`` produces them. Running maxima start at a
finite ``-1e30`` so that fully masked tiles stay NaN-free. Base offsets are int64; offsets inside one
(batch, KV head) slice are int32.
"""

from __future__ import annotations

from .select import pool_select
from .stage1 import stage1_scores
from .stage2 import block_sparse_attention

__all__ = ["block_sparse_attention", "pool_select", "stage1_scores"]
