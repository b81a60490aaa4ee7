"""Which implementation a kernel call runs: the Triton kernels or the PyTorch reference beside them.

Every family (``w4a16``, ``nvfp4``, ``gptq``, and GLA and InfLLM-v2 through the model's dispatchers) takes a ``backend``
string and asks ``use_triton``: ``"auto"`` runs Triton where every operand is a CUDA tensor and Triton is installed,
the reference elsewhere; ``"triton"`` always runs Triton (CPU tensors only under the interpreter,
``TRITON_INTERPRET=1``); ``"reference"`` always runs the reference. Triton itself is imported only once a Triton
path runs.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from . import device

__all__ = ["BACKENDS", "DEQUANT_MIN_M", "check_backend", "use_triton"]

BACKENDS = ("auto", "triton", "reference")

DEQUANT_MIN_M = 1024
"""From this many activation rows on, the NVFP4 Triton path dequantizes the weight once into the activation dtype and
multiplies with cuBLAS: the product is compute-bound there, and the dequantization a few percent of it. (W4A16's
tiled kernel hands over sooner, at ``w4a16.TILED_MAX_M``.)"""


_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
"""Read once at import (finding the package does not import it), also so that ``torch.compile`` can trace
``use_triton`` without a graph break."""


def use_triton(backend: str, *tensors: Tensor, fits: bool = True) -> bool:
    """Whether ``backend`` runs the Triton kernels on ``tensors``; ``fits``: the family's own condition for
    ``"auto"`` (a shape or dtype its kernel takes). ``ValueError`` for an unknown backend, ``RuntimeError`` for
    ``"triton"`` on CPU tensors outside the interpreter."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        return on_cuda and fits and _TRITON_INSTALLED
    if not on_cuda and not device.INTERPRET:
        raise RuntimeError("backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    return True


def check_backend(backend: str, where: torch.device) -> None:
    """Refuse, before a model is loaded, a ``--backend`` that `use_triton` would refuse at its first kernel call:
    an unknown name, ``"triton"`` without Triton installed, or ``"triton"`` on a CPU outside the interpreter. The
    ``ValueError`` names the flag and what to pass instead."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend {backend!r}: expected {', '.join(BACKENDS)}")
    if backend != "triton":
        return
    if not _TRITON_INSTALLED:
        raise ValueError("--backend triton: Triton is not installed (pip install 'salaquant[triton]')")
    if where.type != "cuda" and not device.INTERPRET:
        raise ValueError(
            f"--backend triton: the Triton kernels need a CUDA device and this run is on {where}; pass "
            "--backend reference (or auto), or set TRITON_INTERPRET=1 to interpret them on the CPU (slow)"
        )
