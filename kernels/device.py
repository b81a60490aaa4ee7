"""Facts about where the kernels run: whether Triton interprets them on the CPU, and a CUDA device's SM count
and compute capability (read once per device)."""

from __future__ import annotations

import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton runs the kernels in its interpreter (CPU tensors)."""


@functools.cache
def _facts(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major


def cuda_facts(device: torch.device) -> tuple[int, int]:
    """``(SM count, compute capability major)`` of a CUDA device (the current one when it has no index)."""
    return _facts(device.index if device.index is not None else torch.cuda.current_device())
