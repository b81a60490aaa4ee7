"""What the InfLLM-v2 kernels' launchers share: programmatic dependent launch, tile sizes, head checks."""

from __future__ import annotations

import torch

from ..device import pdl_launch
from ..host import next_power_of_2

__all__ = ["LOG2E", "check_heads", "pdl_args", "pow2"]

LOG2E = 1.4426950408889634


def pdl_args(device: torch.device) -> dict[str, bool]:
    """``PDL`` and ``launch_pdl`` launch arguments (``pdl_launch``): every kernel that reads an earlier one's output
    starts by programmatic dependent launch where the GPU has it (Hopper and newer). It is scheduled while its
    predecessor runs (which signals at its start) and waits (``griddepcontrol.wait``) before its first global access,
    so the launch latency between the kernels of a decode step overlaps."""
    return pdl_launch(device, True)


def pow2(x: int, floor: int = 16) -> int:
    return max(floor, next_power_of_2(max(1, x)))


def check_heads(hq: int, hkv: int) -> int:
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    return hq // hkv
