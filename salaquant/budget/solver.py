"""The least total damage under a size budget, one option per unit: an exact multiple-choice knapsack.

With costs that add over units (the damage of each option is measured with that unit alone changed), the best
choice is found exactly by dynamic programming over the Pareto frontier of (bytes, cost): after each unit only
the partial choices that no other partial choice beats on both bytes and cost are kept, and those that cannot
fit the budget even with the smallest options of the units still to come are dropped. Bytes are kept exactly
(no rounding of sizes), so the answer fits the budget to the byte. The frontier's length is bounded by the
number of distinct byte totals, which repeated layer shapes keep small.
"""

from __future__ import annotations

from collections.abc import Sequence


def solve(sizes: Sequence[Sequence[int]], costs: Sequence[Sequence[float]], budget: int) -> list[int] | None:
    """The option index of every unit with the least summed cost whose summed size is at most ``budget``; None
    when even the smallest options exceed it. Ties in cost go to the fewer bytes, then to the earlier options."""
    if len(sizes) != len(costs) or any(len(s) != len(c) or not s for s, c in zip(sizes, costs, strict=True)):
        raise ValueError("every unit needs one cost per size and at least one option")
    smallest_rest = [0] * (len(sizes) + 1)
    for u in range(len(sizes) - 1, -1, -1):
        smallest_rest[u] = smallest_rest[u + 1] + min(sizes[u])
    if smallest_rest[0] > budget:
        return None
    # a state: (bytes, cost, trail); trail = (option, previous trail) keeps the choices without copying them
    frontier: list[tuple[int, float, tuple | None]] = [(0, 0.0, None)]
    for u, (unit_sizes, unit_costs) in enumerate(zip(sizes, costs, strict=True)):
        room = budget - smallest_rest[u + 1]
        grown = [
            (b + size, c + cost, (k, trail))
            for b, c, trail in frontier
            for k, (size, cost) in enumerate(zip(unit_sizes, unit_costs, strict=True))
            if b + size <= room
        ]
        grown.sort(key=lambda state: (state[0], state[1]))  # stable: earlier options first among equals
        frontier = []
        for state in grown:
            if not frontier or state[1] < frontier[-1][1]:
                frontier.append(state)
    best = min(frontier, key=lambda state: (state[1], state[0]))
    choice: list[int] = []
    trail = best[2]
    while trail is not None:
        choice.append(trail[0])
        trail = trail[1]
    return choice[::-1]
