"""Hidden-state chunks moved between host memory and the compute device beside the compute.

A pass runs every sample's token chunks through one layer, in an order known before it starts. On a GPU the next
chunk's copy to the device is issued on a side stream when this chunk is taken, and each output chunk's copy back
on a second side stream once the compute that produced it is queued, so the copy engines work while the kernels
run instead of holding the kernels behind them on one stream. Stream waits order each copy after what it reads,
and the allocator is told which stream still uses a tensor (``record_stream``), so no memory is reused before its
copy ends. The values moved are the same either way: only when the copies run changes.

On a CPU (or any device without streams) a chunk is copied when taken and put back at once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["ChunkStream"]


class ChunkStream:
    """The inputs of one pass, chunk by chunk, one copy ahead; and the outputs' copies back.

    ``chunks``: the host tensors (views of the hidden-state buffers) in the order the pass takes them. An output
    may be written over the input it came from: its copy back is ordered after the compute, which is ordered after
    that input's copy in; the copy ahead reads the next chunk, never one already written."""

    def __init__(self, device: torch.device, chunks: Iterable[torch.Tensor]) -> None:
        self.device = device
        self._source = iter(chunks)
        self._streams = device.type == "cuda"
        if self._streams:
            self._compute = torch.cuda.current_stream(device)
            self._in = torch.cuda.Stream(device)
            self._out = torch.cuda.Stream(device)
        self._ahead = self._issue()

    def _issue(self) -> torch.Tensor | None:
        host = next(self._source, None)
        if host is None:
            return None
        if not self._streams:
            return host.to(self.device)
        with torch.cuda.stream(self._in):
            return host.to(self.device, non_blocking=True)

    def take(self) -> torch.Tensor:
        """The next chunk on the device, ready for the compute stream; the one after it starts copying."""
        x = self._ahead
        if x is None:
            raise RuntimeError("the pass took more chunks than it listed")
        if self._streams:
            self._compute.wait_stream(self._in)  # only this chunk's copy is queued there yet
            x.record_stream(self._compute)
        self._ahead = self._issue()
        return x

    def put(self, y: torch.Tensor, host: torch.Tensor) -> None:
        """Copy output ``y`` (just queued on the compute stream) into ``host``."""
        if not self._streams:
            host.copy_(y)
            return
        self._out.wait_stream(self._compute)
        with torch.cuda.stream(self._out):
            host.copy_(y, non_blocking=True)
        y.record_stream(self._out)

    def done(self) -> None:
        """``RuntimeError`` unless the pass took every chunk it listed (a mismatch would mean shifted inputs)."""
        if self._ahead is not None:
            raise RuntimeError("the pass ended with chunks left untaken")
