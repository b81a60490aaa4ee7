"""Simple GLA (Lightning attention) with Triton kernels and the PyTorch reference as fallback.

Same math and layout as ``salaquant.model.gla``: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, state
``[B, H, K, V]`` fp32, ``g_gamma: [H]`` log decay ``<= 0``; outputs are fp32 unless the chunked form is asked
for another dtype (``out_dtype``); final states are fp32.

``backend``: ``"auto"`` runs Triton for CUDA tensors and the reference otherwise, ``"triton"`` always runs
Triton (on CPU only under ``TRITON_INTERPRET=1``), ``"reference"`` always runs ``salaquant.model.gla``.
Triton is imported only when a Triton path runs.

``precision`` sets the ``tl.dot`` input precision of the chunk kernels for fp32 inputs: ``"tf32"`` (as fla,
the default), ``"tf32x3"`` or ``"ieee"``. The recurrent kernel does its math in fp32 FMAs and ignores it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...model import gla as _ref
from ...model.gla import RECURRENT_MAX_LEN

__all__ = ["BACKENDS", "RECURRENT_MAX_LEN", "chunk_gla", "recurrent_gla", "simple_gla"]

BACKENDS = ("auto", "triton", "reference")


def _use_triton(backend: str, q: Tensor) -> bool:
    if backend == "auto":
        return q.is_cuda
    if backend == "triton":
        return True
    if backend == "reference":
        return False
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def chunk_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_gamma: Tensor,
    scale: float,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    *,
    precision: str = "tf32",
    out_dtype: torch.dtype = torch.float32,
    upcast: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Chunked (prefill) form, chunk 64. Returns ``o`` (accumulated in fp32, stored as ``out_dtype``) and the
    final state (``None`` unless asked). ``upcast``: 16-bit inputs are computed in fp32 on the Triton path too,
    as the reference always computes them (``chunk_fwd``)."""
    if _use_triton(backend, q):
        from .triton_kernels import chunk_fwd

        return chunk_fwd(
            q,
            k,
            v,
            g_gamma,
            scale,
            initial_state,
            output_final_state,
            precision=precision,
            out_dtype=out_dtype,
            upcast=upcast,
        )
    o, final = _ref.chunk_gla(q, k, v, g_gamma, scale, initial_state, output_final_state)
    return o.to(out_dtype), final


def recurrent_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_gamma: Tensor,
    scale: float,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    *,
    inplace: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Recurrent (decode) form for short inputs. Returns ``o`` and the final state (``None`` unless asked).

    With ``inplace`` the final state is written into ``initial_state`` (contiguous fp32) and returned.
    """
    if _use_triton(backend, q):
        from .triton_kernels import recurrent_fwd

        return recurrent_fwd(q, k, v, g_gamma, scale, initial_state, output_final_state, inplace=inplace)
    if inplace and initial_state is None:
        raise ValueError("inplace needs an initial_state to update")
    o, final = _ref.recurrent_gla(q, k, v, g_gamma, scale, initial_state, output_final_state or inplace)
    if inplace:
        assert initial_state is not None and final is not None
        initial_state.copy_(final)
        final = initial_state
    return o, final


def simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_gamma: Tensor,
    scale: float,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    *,
    precision: str = "tf32",
    out_dtype: torch.dtype = torch.float32,
    upcast: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Dispatch as SALA does: recurrent for ``T < 64``, chunked otherwise. ``out_dtype`` is the dtype of the
    chunked form's output, stored by the kernel (the recurrent form's output stays fp32: a few tokens).
    ``upcast`` computes 16-bit inputs in fp32 in the chunked form (the recurrent form always does)."""
    if q.shape[1] < RECURRENT_MAX_LEN:
        return recurrent_gla(q, k, v, g_gamma, scale, initial_state, output_final_state, backend)
    return chunk_gla(
        q,
        k,
        v,
        g_gamma,
        scale,
        initial_state,
        output_final_state,
        backend,
        precision=precision,
        out_dtype=out_dtype,
        upcast=upcast,
    )
