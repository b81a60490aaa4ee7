"""The fixed summation tree of the calibration statistics: eight token-balanced leaves of samples.

Floating-point sums depend on the order of their additions, so statistics summed sample by sample in one process
and summed per process then across processes would differ in their last bits, and so would the exported weights.
Instead the samples are split into ``LEAVES`` leaves by their lengths alone (recursive halving by tokens: the same
leaves for any number of processes), each leaf's statistics are summed in sample order, and the leaves are added
in one balanced binary tree, ``((0+1)+(2+3))+((4+5)+(6+7))``. With N processes (N a power of two up to
``LEAVES``) each owns ``LEAVES / N`` adjacent leaves, a subtree, and the subtrees' sums are added in the upper
levels of the same tree: every N gives the same bits. Floating-point addition is commutative, so only the tree's
shape matters. The halving balances every level: any N gets a token share as even as whole samples allow (a
sample runs in one process, its chunks carrying the layer's state from one to the next).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

LEAVES = 8
"""Leaves of the tree; the process counts it serves are its divisors (1, 2, 4, 8)."""

T = TypeVar("T")


def split_leaves(lengths: Sequence[int], leaves: int = LEAVES) -> list[list[int]]:
    """Sample indices (ascending) of each of ``leaves`` leaves. Each halving takes the samples longest first (ties
    by index) and gives each to the half with fewer tokens so far (ties to the first half): the greedy split,
    applied to both halves again until there are ``leaves`` parts."""
    if leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"leaves must be a power of two, got {leaves}")

    def halve(indices: list[int], parts: int) -> list[list[int]]:
        if parts == 1:
            return [sorted(indices)]
        halves: tuple[list[int], list[int]] = ([], [])
        tokens = [0, 0]
        for i in sorted(indices, key=lambda i: (-lengths[i], i)):
            side = 0 if tokens[0] <= tokens[1] else 1
            halves[side].append(i)
            tokens[side] += lengths[i]
        return halve(halves[0], parts // 2) + halve(halves[1], parts // 2)

    return halve(list(range(len(lengths))), leaves)


def owned_leaves(rank: int, world: int, leaves: int = LEAVES) -> range:
    """The adjacent leaves (a subtree) process ``rank`` of ``world`` owns."""
    if world < 1 or leaves % world or world & (world - 1):
        raise ValueError(f"{world} processes: the statistics tree serves 1, 2, 4 or 8 (a power of two up to {leaves})")
    per = leaves // world
    return range(rank * per, (rank + 1) * per)


class TreeSum(Generic[T]):
    """Adds a run of equal-sized subtrees' sums, pushed left to right, in the balanced binary tree over them (a
    binary counter: at most log2(n) + 1 partial sums are alive). ``merge(left, right)`` adds ``right`` into
    ``left`` and returns it."""

    def __init__(self, merge: Callable[[T, T], T]) -> None:
        self._merge = merge
        self._stack: list[tuple[int, T]] = []

    def push(self, item: T) -> None:
        level = 0
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            item = self._merge(left, item)
            level += 1
        self._stack.append((level, item))

    def root(self) -> T:
        """The sum of everything pushed; the count pushed must be a power of two (a complete tree)."""
        if len(self._stack) != 1:
            raise ValueError(f"{len(self._stack)} partial sums left: the number of items pushed is not a power of two")
        return self._stack[0][1]
