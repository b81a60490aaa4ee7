"""The CPU memory a calibration run will hold, checked against the machine before any work starts.

The engine keeps every sample's hidden states in CPU memory between layers (one set, or two when the next layer
must see the float layer's outputs), pinned when the compute device is a GPU, where PyTorch's pinned-memory
allocator rounds each request up to a power of two; on top of that it holds one decoder layer as loaded. Pinned
pages cannot be swapped out, so a run that does not fit in physical memory fails, possibly after many minutes
of work: this module says so up front.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

__all__ = [
    "HostMemoryError",
    "HostMemoryPlan",
    "check_host_memory",
    "empty_pinned_cache",
    "meminfo",
    "plan_host_memory",
    "process_memory",
    "second_set_fits",
]

GIB = 2**30


class HostMemoryError(RuntimeError):
    """The run needs more CPU memory than the machine has."""


def _pow2ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


@dataclass(frozen=True)
class HostMemoryPlan:
    hidden_bytes: int
    """``H``: one set of hidden states (tokens x hidden size x element size)."""
    sets: int
    """Sets held at once: 1 (quantized propagation), 2 (float propagation or statistics only)."""
    pinned: bool
    """Pinned buffers (GPU runs): each set's single allocation rounds up to a power of two."""
    layer_bytes: int
    """The largest decoder layer in the checkpoint, as loaded."""

    @property
    def buffer_bytes(self) -> int:
        per_set = _pow2ceil(self.hidden_bytes) if self.pinned else self.hidden_bytes
        return self.sets * per_set

    @property
    def total_bytes(self) -> int:
        return self.buffer_bytes + self.layer_bytes

    def describe(self) -> str:
        kind = "pinned, rounded up to a power of two" if self.pinned else "pageable"
        return (
            f"about {self.total_bytes / GIB:.1f} GiB: {self.sets} set(s) of hidden states of "
            f"{self.hidden_bytes / GIB:.2f} GiB ({kind}: {self.buffer_bytes / GIB:.1f} GiB) and the largest layer "
            f"({self.layer_bytes / GIB:.2f} GiB), besides the process itself"
        )


def plan_host_memory(
    sample_tokens: Sequence[int], hidden_size: int, element_bytes: int, sets: int, pinned: bool, layer_bytes: int
) -> HostMemoryPlan:
    """The plan of a run over samples of ``sample_tokens`` tokens each."""
    if sets not in (1, 2):
        raise ValueError(f"sets must be 1 or 2, got {sets}")
    hidden = sum(int(t) for t in sample_tokens) * hidden_size * element_bytes
    return HostMemoryPlan(hidden, sets, pinned, layer_bytes)


def meminfo(path: Path = Path("/proc/meminfo")) -> tuple[int, int] | None:
    """``(MemAvailable, MemTotal)`` in bytes, or ``None`` where the file does not exist or lacks them."""
    try:
        text = path.read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if name in ("MemAvailable", "MemTotal") and parts and parts[0].isdigit():
            values[name] = int(parts[0]) * 1024  # the file counts kB
    if "MemAvailable" not in values or "MemTotal" not in values:
        return None
    return values["MemAvailable"], values["MemTotal"]


def process_memory(field: str = "VmRSS", path: Path = Path("/proc/self/status")) -> int | None:
    """One memory line of this process's status file in bytes (``VmRSS``, ``RssFile``, ``VmHWM``, ...), or ``None``
    where the file or the line does not exist."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if name == field and parts and parts[0].isdigit():
            return int(parts[0]) * 1024  # the file counts kB
    return None


def check_host_memory(
    plan: HostMemoryPlan, read: Callable[[], tuple[int, int] | None] = meminfo, *, advice: str = ""
) -> str | None:
    """Raise ``HostMemoryError`` when the run cannot fit in physical memory; return a warning when it exceeds what
    is available now (other processes hold the rest), else ``None``. Machines without ``/proc/meminfo`` pass."""
    info = read()
    if info is None:
        return None
    available, total = info
    need = plan.total_bytes
    if need > total:
        raise HostMemoryError(
            f"calibration needs {plan.describe()}, but this machine has {total / GIB:.1f} GiB of memory"
            + (f"; {advice}" if advice else "")
        )
    if need > available:
        return (
            f"calibration needs {plan.describe()}; {available / GIB:.1f} GiB are available now "
            f"(of {total / GIB:.1f} GiB): the run may swap or be killed"
        )
    return None


SECOND_SET_SHARE = 0.5
"""A second set of hidden states is kept only where both sets and the layer take at most this share of the memory
available at the start: the rest stays for the page cache the resume points' files are written through, and for
other processes."""


def second_set_fits(plan: HostMemoryPlan, read: Callable[[], tuple[int, int] | None] = meminfo) -> bool:
    """Whether ``plan`` with two sets of hidden states takes at most ``SECOND_SET_SHARE`` of the memory available
    now (``False`` where that cannot be read)."""
    info = read()
    if info is None:
        return False
    return replace(plan, sets=2).total_bytes <= SECOND_SET_SHARE * info[0]


def empty_pinned_cache() -> bool:
    """Hand the pinned blocks PyTorch keeps for reuse back to the system; ``False`` when this build has no way to.

    Freeing a pinned tensor only returns its block to PyTorch's pinned-memory cache, where it stays resident.
    Newer builds empty that cache through ``torch.accelerator.empty_host_cache``; older ones (2.11 among them)
    only through the private ``torch._C._host_emptyCache``.
    """
    for owner, name in ((torch.accelerator, "empty_host_cache"), (torch._C, "_host_emptyCache")):
        empty = getattr(owner, name, None)
        if empty is not None:
            empty()
            return True
    return False
