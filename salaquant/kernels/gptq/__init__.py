"""GPTQ on the GPU: the column sweep of one block of columns (one Triton launch per block; for NVFP4 also with
each 16-column block's scale searched in the same launch, ``nvfp4_sweep``) and the clipped-scale search of one
group (every candidate scored in registers, the weights read once).

``gptq_columns`` and ``best_scale`` dispatch between the Triton kernels (``triton_kernels``, imported on first
use) and the PyTorch references (``reference``) by ``backend`` as ``salaquant.kernels.backend.use_triton`` decides
it, ``"auto"`` taking Triton for float32 CUDA blocks up to 256 columns wide. The sweep computes the same bits on
both; the search sums the squared errors in another order, so rows whose best candidates tie to the last bits may
pick a neighbour.
"""

from __future__ import annotations

import torch

from ..backend import BACKENDS, use_triton
from .block import ColumnBlock
from .reference import best_scale_reference, gptq_columns_reference

__all__ = [
    "BACKENDS",
    "ColumnBlock",
    "best_scale",
    "best_scale_reference",
    "gptq_columns",
    "gptq_columns_reference",
    "sweep_on_triton",
]

MAX_COLUMNS = 256
"""Widest block the column-sweep kernel takes (its tile lives in registers); ``auto`` uses the reference beyond."""
MAX_SEARCH_COLUMNS = 256
"""Widest group the scale-search kernel takes; ``auto`` uses the reference beyond."""


def _use_triton(backend: str, w: torch.Tensor, max_columns: int) -> bool:
    """Whether the Triton kernel runs on ``w [R, n]``: ``auto`` takes it for float32 tensors at most ``max_columns``
    wide; an explicit ``triton`` must get float32."""
    triton = use_triton(backend, w, fits=w.dtype == torch.float32 and w.shape[1] <= max_columns)
    if triton and w.dtype != torch.float32:
        raise ValueError(f"the Triton backend computes in float32, got {w.dtype}")
    return triton


def sweep_on_triton(backend: str, w1: torch.Tensor) -> bool:
    """Whether the column sweep of ``w1`` runs the Triton kernels under ``backend`` (``gptq_columns``'s rule)."""
    return _use_triton(backend, w1, MAX_COLUMNS)


def gptq_columns(block: ColumnBlock, scale: torch.Tensor, start: int, stop: int, backend: str = "auto") -> None:
    """Quantize columns ``start .. stop - 1`` of ``block`` in order, in place, with the steps ``scale`` (see
    ``reference.gptq_columns_reference`` for the exact arithmetic)."""
    block.check_scale(scale)
    if not _use_triton(backend, block.w1, MAX_COLUMNS):
        gptq_columns_reference(block, scale, start, stop)
        return
    for t in (block.w1, block.codes, block.err, block.hinv1, scale):
        if t.stride(-1) != 1:
            raise ValueError("every operand needs unit stride along its last dimension")
    from .triton_kernels import gptq_columns_triton

    gptq_columns_triton(block, scale, start, stop)


SEARCH_BATCH_ELEMENTS = 1 << 20
"""Elements of ``w`` times candidates the reference scores at once: its one temporary (4 MiB in fp32) stays in a
CPU's cache between the element-wise passes instead of streaming through memory on each."""


def best_scale(w: torch.Tensor, candidates: torch.Tensor, zero: int, maxq: int, backend: str = "auto") -> torch.Tensor:
    """Index (int64 ``[R]``) of the candidate scale (``candidates [k, R]``) with the least squared rounding error
    on each row of ``w [R, n]``; ties go to the lowest index (see ``reference.best_scale_reference``)."""
    if w.dim() != 2 or candidates.dim() != 2 or candidates.shape[1] != w.shape[0] or candidates.dtype != w.dtype:
        raise ValueError(
            f"w {tuple(w.shape)} and candidates {tuple(candidates.shape)} {candidates.dtype}: expected [R, n] and "
            f"[k, R] of w's dtype {w.dtype}"
        )
    if not _use_triton(backend, w, MAX_SEARCH_COLUMNS):
        return best_scale_reference(w, candidates, zero, maxq, SEARCH_BATCH_ELEMENTS)
    from .triton_kernels import best_scale_triton

    return best_scale_triton(w.contiguous(), candidates.contiguous(), zero, maxq)
