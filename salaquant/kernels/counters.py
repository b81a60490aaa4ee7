"""Arrival counters for kernels whose last program to finish a piece of work completes it.

A split-K GEMM tile or a split stage-1 row is shared by several programs: each stores its part, then adds one to
the piece's counter; the program that sees the count complete reads the parts back, finishes the piece and
resets the counter to zero. The counters live in zeroed int32 buffers: one per device and stream for eager
launches (launches on one stream take turns with it), and one per device for CUDA-graph capture, made beside the
first eager one so that capturing records no fill kernel (graphs of one device share it: replay them on one
stream at a time).
"""

from __future__ import annotations

import torch
from torch import Tensor

_COUNTERS: dict[tuple[str, int | None, int | str], Tensor] = {}


def _zeros(key: tuple[str, int | None, int | str], n: int, device: torch.device) -> Tensor:
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def arrival_counters(device: torch.device, n: int) -> Tensor:
    """Zeroed int32 counters (at least ``n``) for the current stream of ``device``, or for graph capture when the
    stream is capturing; the kernels reset them."""
    if device.type != "cuda":
        return _zeros((device.type, device.index, 0), n, device)
    graph_key = (device.type, device.index, "graph")
    if torch.cuda.is_current_stream_capturing():
        return _zeros(graph_key, n, device)
    _zeros(graph_key, n, device)  # ready before any capture
    return _zeros((device.type, device.index, torch.cuda.current_stream(device).cuda_stream), n, device)
