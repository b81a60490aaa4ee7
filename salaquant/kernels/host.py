"""Host-side helpers for the kernel launchers.

``triton.cdiv`` and ``triton.next_power_of_2`` are wrapped as Triton functions in recent releases, and a call
from Python costs microseconds; launchers run these several times per call, so they use the plain versions.
"""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (0 for 0, as ``triton.next_power_of_2``)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def pair_aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` (2-D activations) if its rows are contiguous and, for 16-bit dtypes, every row starts on a 4-byte
    boundary, so that kernels may read it as int32 pairs; otherwise a fresh contiguous copy (a view at an odd element
    offset, or with an odd row stride, would make those loads misaligned on a GPU)."""
    if x.stride(-1) != 1:
        return x.contiguous()
    if x.element_size() == 2 and (x.data_ptr() % 4 or (x.shape[0] > 1 and x.stride(0) % 2)):
        return x.clone(memory_format=torch.contiguous_format)
    return x


def wave_split(n_tiles: int, k_tiles: int, resident: int, min_tiles: int = 1) -> int:
    """K splits for ``n_tiles`` column tiles over ``k_tiles`` K tiles so that every program runs in the first wave of
    a device that holds ``resident`` programs at once: the most that fit with at least ``min_tiles`` K tiles each
    (1 when the column tiles alone fill the wave), as the kernels realise it (whole tiles per split, none empty)."""
    split = max(1, min(resident // max(n_tiles, 1), k_tiles // max(min_tiles, 1)))
    return cdiv(k_tiles, cdiv(k_tiles, split))
