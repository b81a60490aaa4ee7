"""Host-side integer helpers for the kernel launchers.

``triton.cdiv`` and ``triton.next_power_of_2`` are wrapped as Triton functions in recent releases, and a call
from Python costs microseconds; launchers run these several times per call, so they use the plain versions.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (0 for 0, as ``triton.next_power_of_2``)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()
