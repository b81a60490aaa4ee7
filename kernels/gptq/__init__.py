"""The GPTQ column sweep of one block of columns, on the GPU as one Triton launch per block.

``gptq_columns`` dispatches between the Triton kernel (``triton_kernels``, imported on first use) and the
PyTorch reference (``reference``); both compute the same bits.
"""

from __future__ import annotations

import os

import torch

from .reference import gptq_columns_reference

__all__ = ["BACKENDS", "gptq_columns", "gptq_columns_reference"]

BACKENDS = ("auto", "triton", "reference")
"""``auto``: Triton for float32 CUDA blocks up to 256 columns wide, the reference otherwise. ``triton``: always
the kernel (CPU tensors only under TRITON_INTERPRET=1). ``reference``: plain PyTorch."""


def _check(w1: torch.Tensor, codes: torch.Tensor, err: torch.Tensor, scale: torch.Tensor, hinv1: torch.Tensor) -> None:
    r, c = w1.shape
    if codes.shape != (r, c) or err.shape != (r, c) or hinv1.shape != (c, c):
        raise ValueError(
            f"w1 {tuple(w1.shape)}, codes {tuple(codes.shape)}, err {tuple(err.shape)}, hinv1 {tuple(hinv1.shape)}: "
            "expected [R, C], [R, C], [R, C], [C, C]"
        )
    if scale.shape not in ((r,), (r, c)):
        raise ValueError(f"scale {tuple(scale.shape)}: expected [{r}] or [{r}, {c}]")
    if codes.dtype != torch.int32 or err.dtype != w1.dtype or scale.dtype != w1.dtype or hinv1.dtype != w1.dtype:
        raise ValueError("codes must be int32 and err, scale, hinv1 of w1's dtype")


def gptq_columns(
    w1: torch.Tensor,
    codes: torch.Tensor,
    err: torch.Tensor,
    scale: torch.Tensor,
    hinv1: torch.Tensor,
    start: int,
    stop: int,
    zero: int,
    maxq: int,
    backend: str = "auto",
) -> None:
    """Quantize columns ``start .. stop - 1`` of the block ``w1 [R, C]`` in order, in place (see
    ``reference.gptq_columns_reference`` for the exact arithmetic)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check(w1, codes, err, scale, hinv1)
    if backend == "auto":
        from .triton_kernels import MAX_COLUMNS

        fits = w1.is_cuda and w1.dtype == torch.float32 and w1.shape[1] <= MAX_COLUMNS
        backend = "triton" if fits else "reference"
    if backend == "reference":
        gptq_columns_reference(w1, codes, err, scale, hinv1, start, stop, zero, maxq)
        return
    if not w1.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError("the Triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    if w1.dtype != torch.float32:
        raise ValueError(f"the Triton backend computes in float32, got {w1.dtype}")
    for t in (w1, codes, err, hinv1, scale):
        if t.stride(-1) != 1:
            raise ValueError("every operand needs unit stride along its last dimension")
    from .triton_kernels import gptq_columns_triton

    gptq_columns_triton(w1, codes, err, scale, hinv1, start, stop, zero, maxq)
