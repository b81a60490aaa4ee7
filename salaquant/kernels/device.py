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


def _index(device: torch.device) -> int:
    """A CUDA device's index (the current device's when it has none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_facts(device: torch.device) -> tuple[int, int]:
    """``(SM count, compute capability major)`` of a CUDA device (the current one when it has no index)."""
    return _facts(_index(device))


@functools.cache
def _sm_limits(index: int) -> tuple[int, int, int, int]:
    """``(SMs, registers, threads, shared-memory bytes)`` per SM of a CUDA device."""
    props = torch.cuda.get_device_properties(index)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    shared = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    return props.multi_processor_count, regs, threads, shared


def programs_per_sm(regs: int, warps: int, shared: int, limits: tuple[int, int, int, int]) -> int:
    """Programs of ``warps`` warps, ``regs`` registers per thread and ``shared`` bytes of shared memory that one SM
    holds at once (``limits``: ``_sm_limits``): registers go to warps in units of 256, each program also reserves
    1 KiB of shared memory, and an SM holds at most 32 programs."""
    _, sm_regs, sm_threads, sm_shared = limits
    warp_regs = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (sm_regs // warp_regs) // warps
    by_threads = sm_threads // (32 * warps)
    by_shared = sm_shared // (shared + 1024)
    return max(1, min(by_regs, by_threads, by_shared, 32))


_RESIDENT: dict[tuple, int] = {}


def resident_programs(kernel, args: tuple, meta: dict[str, object], device: torch.device) -> int:
    """How many programs of ``kernel`` (a ``@triton.jit`` function) called with ``args`` (tensors, or their torch
    dtypes) and ``meta`` (constexprs and launch options) a CUDA device runs at once: its SMs times what each holds of
    the compiled binary (``programs_per_sm``). Compiles without launching the first time (the launch that follows
    reuses the binary); cached per kernel, ``meta`` and device."""
    index = _index(device)
    key = (kernel, index, tuple(sorted(meta.items())))
    count = _RESIDENT.get(key)
    if count is None:
        compiled = kernel.warmup(*args, grid=(1,), **meta)
        compiled._init_handles()  # loads the binary, which sets n_regs
        limits = _sm_limits(index)
        per_sm = programs_per_sm(compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared, limits)
        count = _RESIDENT[key] = limits[0] * per_sm
    return count


def pdl_capable(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch: a CUDA GPU of compute capability 9
    (Hopper) or newer, outside the interpreter."""
    return device.type == "cuda" and not INTERPRET and cuda_facts(device)[1] >= 9


def pdl_launch(device: torch.device, on: bool) -> dict[str, bool]:
    """The ``PDL`` constexpr and ``launch_pdl`` option of a kernel that can start by programmatic dependent launch:
    on where asked and ``pdl_capable``. Such a kernel is scheduled while the one before it still runs and waits for
    it (``griddepcontrol.wait``) before reading its output, so the launch gap between dependent kernels overlaps;
    that gap is what a decode step replayed from a CUDA graph is made of, and the runtime's decode is to be captured
    in CUDA graphs, where PDL applies. The InfLLM-v2 kernels always take it; the 4-bit matrix kernels (``pdl=True``)
    load their first weights before the wait, so they take it only for weights the kernel just before did not write
    (a decode step's). Run a call once eagerly with the same setting before capturing it, so that the capture
    compiles nothing."""
    return {"PDL": True, "launch_pdl": True} if on and pdl_capable(device) else {"PDL": False}
