"""bf16 linear layers on CPUs without bf16 arithmetic, computed through float32.

PyTorch's CPU ``F.linear`` on bfloat16 operands is several times slower than on float32 where the processor has no
bf16 dot-product instructions (AVX2 machines, AVX-512 without ``avx512_bf16``; docs/testing.md has the figures).
Both accumulate in float32 and round the output to bf16 once, so upcasting the operands, multiplying in float32 and
rounding the result back gives the same values up to the order of the sums (a few outputs in 100,000 differ by one
bf16 step, neither closer to the exact product). `bf16_linears_in_fp32` does that for the commands while a
CPU-only process runs on such a processor; every other operation stays in the model's dtype, so activations are
rounded to bf16 between operations as before.
"""

from __future__ import annotations

import contextlib
import functools
import platform
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

# /proc/cpuinfo flags of processors with bf16 dot products (x86: AVX-512 BF16, AMX; Arm: the BF16 extension)
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
_CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def native_bf16() -> bool:
    """Whether this processor multiplies bf16 natively: read from the flags Linux lists in ``/proc/cpuinfo``; True
    (no change of behaviour) where that file is missing or unreadable, or on a processor the flags do not cover."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return True
    try:
        text = _CPUINFO.read_text(errors="replace")
    except OSError:
        return True
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return not _BF16_FLAGS.isdisjoint(value.split())
    return True


_TORCH_LINEAR = F.linear
"""torch's own ``F.linear``, restored when the context ends."""


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with bf16 CPU operands computed in float32 and rounded back to bf16; any other call as torch's."""
    if _bf16_cpu(input) and _bf16_cpu(weight) and (bias is None or _bf16_cpu(bias)):
        b = None if bias is None else bias.float()
        return _TORCH_LINEAR(input.float(), weight.float(), b).to(torch.bfloat16)
    return _TORCH_LINEAR(input, weight, bias)


def _bf16_cpu(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.device.type == "cpu"


@contextlib.contextmanager
def bf16_linears_in_fp32() -> Iterator[bool]:
    """Inside: ``torch.nn.functional.linear`` (which ``nn.Linear`` calls) computes bf16 CPU operands in float32,
    when this process sees no CUDA GPU and the processor has no bf16 arithmetic; yields whether it does so. The
    function is replaced for the process, every thread, and restored at the end (a nested context leaves it to the
    outer one). A function mode would do the same per thread, but costs a Python call on every torch operation,
    which outweighs the gain in the solver's many small ones; a process with a GPU is left alone."""
    if torch.cuda.is_available() or native_bf16() or F.linear is _linear:
        yield F.linear is _linear
        return
    F.linear = _linear
    try:
        yield True
    finally:
        F.linear = _TORCH_LINEAR
