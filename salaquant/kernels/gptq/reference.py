"""The GPTQ column sweep in plain PyTorch: the definition the Triton kernel is tested against.

Within one block of columns ``w1 [R, C]`` (rows are output features, columns input features), with ``hinv1``
the block's part of the upper Cholesky factor of the inverse Hessian, each column ``j`` in turn is rounded on
its scale grid, and its error, divided by ``hinv1[j, j]``, is subtracted from every later column of the block
along row ``j`` of ``hinv1``::

    q_j   = clamp(round_half_even(w_j / s_j) + zero, 0, maxq)
    e_j   = (w_j - (q_j - zero) * s_j) / hinv1[j, j]
    w_k  -= e_j * hinv1[j, k]        for k >= j

The scaled errors ``e_j`` are what the caller applies to the columns after the block in one matrix product.

With ``e2m1`` the grid is NVFP4's instead: ``q_j`` is the E2M1 code of ``w_j / s_j`` (nearest magnitude of
0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to even, saturating; ``sign << 3 | index``) and its value times ``s_j`` replaces
``(q_j - zero) * s_j``; ``s_j`` is then the block scale times the global scale.
"""

from __future__ import annotations

import torch

from ...formats.modelopt_nvfp4.numerics import e2m1_codes, e2m1_round
from .block import ColumnBlock


def gptq_columns_reference(block: ColumnBlock, scale: torch.Tensor, start: int, stop: int) -> None:
    """Columns ``start .. stop - 1`` of the block, in place: ``codes`` and ``err`` receive those columns; ``w1`` is
    updated on columns ``>= start``. ``scale`` is ``[R]`` (one scale per row for every column of the range) or
    ``[R, C]`` (a scale per row and column)."""
    w1, codes, err, hinv1, zero = block.w1, block.codes, block.err, block.hinv1, block.zero
    scaled = torch.empty_like(w1[:, start:stop]) if block.e2m1 else None
    for j in range(start, stop):
        s = scale if scale.dim() == 1 else scale[:, j]
        if scaled is not None:
            x = w1[:, j] / s
            scaled[:, j - start] = x
            e = (w1[:, j] - e2m1_round(x).to(w1.dtype) * s) / hinv1[j, j]
        else:
            q = (torch.round(w1[:, j] / s) + zero).clamp(0, block.maxq)
            e = (w1[:, j] - (q - zero) * s) / hinv1[j, j]
            codes[:, j] = q.to(torch.int32)
        w1[:, j:] -= e[:, None] * hinv1[j, j:][None, :]
        err[:, j] = e
    if scaled is not None:  # the codes of the values rounded above, for every column of the range at once
        codes[:, start:stop] = e2m1_codes(scaled).to(torch.int32)


def best_scale_reference(
    w: torch.Tensor, candidates: torch.Tensor, zero: int, maxq: int, batch_elements: int
) -> torch.Tensor:
    """Index (int64 ``[R]``) of the candidate scale with the least squared rounding error per row of ``w [R, n]``.

    ``candidates [k, R]`` holds ``k`` scales per row (same dtype as ``w``); the error of candidate ``c`` on row ``r``
    is ``sum_i ((clamp(round(w_ri / s) + zero, 0, maxq) - zero) * s - w_ri)^2`` with ``s = candidates[c, r]``.
    Ties go to the lowest index. Candidates are scored ``batch_elements // w.numel()`` at a time.
    """
    batch = max(1, batch_elements // max(1, w.numel()))
    errs = []
    for b in range(0, candidates.shape[0], batch):
        sc = candidates[b : b + batch][:, :, None]
        q = torch.div(w[None], sc).round_().add_(zero).clamp_(0, maxq)  # one temporary, updated in place
        errs.append(q.sub_(zero).mul_(sc).sub_(w[None]).square_().sum(-1))
    return torch.cat(errs).argmin(dim=0)
