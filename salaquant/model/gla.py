"""Simple GLA (decayed linear attention) reference in plain PyTorch.

Layout follows fla: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, state ``[B, H, K, V]``.
``g_gamma: [H]`` is a per-head log decay (``<= 0``). Per head, with ``S_0`` the initial state
(zeros if not given)::

    S_t = exp(g) * S_{t-1} + k_t v_t^T
    o_t = scale * q_t^T S_t

All math runs in fp32. Outputs ``o: [B, T, H, V]`` and the final state are fp32. ``simple_gla`` runs this
reference or, by its ``backend``, the Triton kernels of ``salaquant.kernels.gla`` (imported only then).
"""

import math

import torch
from torch import Tensor

from ..kernels.backend import use_triton

__all__ = [
    "CHUNK_SIZE",
    "FORMS",
    "RECURRENT_MAX_LEN",
    "alibi_slopes",
    "check_inputs",
    "simple_gla",
]

RECURRENT_MAX_LEN = 64
"""``simple_gla`` uses the recurrent form for ``T < RECURRENT_MAX_LEN`` and the chunk form otherwise."""
CHUNK_SIZE = 64
"""The chunk of SALA's chunked form (and of the Triton kernels)."""
FORMS = ("auto", "recurrent", "chunk")
"""``simple_gla``'s ``form``: SALA's rule by length, or one form at any length."""


def _slopes_power_of_two(n: int) -> list[float]:
    # start = 2 ** (-(2 ** -(log2(n) - 3))); slope_i = start ** (i + 1)
    log2_start = -(2.0 ** -(math.log2(n) - 3))
    return [2.0 ** (log2_start * (i + 1)) for i in range(n)]


def _slopes(n: int) -> list[float]:
    if math.log2(n).is_integer():
        return _slopes_power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    extra = _slopes(2 * closest)[0::2][: n - closest]
    return _slopes_power_of_two(closest) + extra


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi slopes ``[H]`` (fp32, positive); SALA uses ``g_gamma = -alibi_slopes(H)``.

    Power-of-two ``H``: ``slope_h = start ** (h + 1)`` with ``start = 2 ** (-(2 ** -(log2(H) - 3)))``.
    Otherwise the slopes of the closest lower power of two ``P`` are followed by the first ``H - P``
    even-indexed slopes of ``2P``.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    return torch.tensor(_slopes(num_heads), dtype=torch.float32)


def check_inputs(q: Tensor, k: Tensor, v: Tensor, g_gamma: Tensor, initial_state: Tensor | None) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k [B, T, H, K] and v [B, T, H, V]; got {q.shape}, {k.shape}, {v.shape}")
    b, _, h, dk = q.shape
    if g_gamma.shape != (h,):
        raise ValueError(f"g_gamma must have shape [{h}], got {tuple(g_gamma.shape)}")
    if initial_state is not None and initial_state.shape != (b, h, dk, v.shape[-1]):
        raise ValueError(
            f"initial_state must have shape [{b}, {h}, {dk}, {v.shape[-1]}], got {tuple(initial_state.shape)}"
        )


def _first_state(q: Tensor, v: Tensor, initial_state: Tensor | None) -> Tensor:
    """The fp32 state ``[B, H, K, V]`` before the first token: a fresh copy of ``initial_state`` (so that the
    caller's tensor is never the returned final state), zeros when it is not given."""
    if initial_state is not None:
        return initial_state.float().clone()
    b_size, _, h_size, dk = q.shape
    return torch.zeros(b_size, h_size, dk, v.shape[-1], dtype=torch.float32, device=q.device)


def _recurrent(q: Tensor, k: Tensor, v: Tensor, g_gamma: Tensor, scale: float, state: Tensor) -> tuple[Tensor, Tensor]:
    """Recurrent (decode) form from ``state``: loop over T, vectorised over batch and heads."""
    b_size, t_size, h_size, _ = q.shape
    qf, kf, vf = q.float(), k.float(), v.float()
    decay = torch.exp(g_gamma.float().to(q.device)).view(1, h_size, 1, 1)
    o = torch.empty(b_size, t_size, h_size, v.shape[-1], dtype=torch.float32, device=q.device)
    for t in range(t_size):
        state = decay * state + kf[:, t, :, :, None] * vf[:, t, :, None, :]
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", qf[:, t], state)
    return o, state


def _chunked(
    q: Tensor, k: Tensor, v: Tensor, g_gamma: Tensor, scale: float, state: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Chunked (prefill) form from ``state``.

    Within a chunk of length ``L`` (the last one may be shorter), with ``h`` the state at the chunk
    start and ``i, j`` chunk-local positions::

        o_i    = scale * sum_{j <= i} exp(g (i - j)) (q_i . k_j) v_j + scale * exp(g (i + 1)) q_i^T h
        h_next = exp(g L) h + sum_j exp(g (L - 1 - j)) k_j v_j^T

    Every decay factor is ``exp`` of a non-positive number, so nothing overflows.
    """
    b_size, t_size, h_size, _ = q.shape
    device = q.device
    # [B, H, T, D] in fp32
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2)
    vf = v.float().transpose(1, 2)
    g = g_gamma.float().to(device).view(h_size, 1, 1)
    o = torch.empty(b_size, h_size, t_size, v.shape[-1], dtype=torch.float32, device=device)
    for start in range(0, t_size, chunk_size):
        length = min(chunk_size, t_size - start)
        pos = torch.arange(length, dtype=torch.float32, device=device)
        diff = pos[:, None] - pos[None, :]  # i - j
        causal = diff >= 0
        # [H, L, L]: exp(g (i - j)) for j <= i, else 0
        intra_decay = torch.where(causal, torch.exp(g * diff.clamp(min=0.0)), 0.0)
        q_decay = torch.exp(g * (pos + 1.0).view(1, length, 1))  # [H, L, 1]
        k_decay = torch.exp(g * (length - 1.0 - pos).view(1, length, 1))  # [H, L, 1]
        chunk_decay = torch.exp(g * float(length)).view(1, h_size, 1, 1)

        qc = qf[:, :, start : start + length]
        kc = kf[:, :, start : start + length]
        vc = vf[:, :, start : start + length]
        attn = (qc @ kc.transpose(-1, -2)) * intra_decay
        o[:, :, start : start + length] = scale * (attn @ vc + (qc * q_decay) @ state)
        state = chunk_decay * state + (kc * k_decay).transpose(-1, -2) @ vc

    return o.transpose(1, 2).contiguous(), state


def simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_gamma: Tensor,
    scale: float,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    out_dtype: torch.dtype = torch.float32,
    backend: str = "reference",
    in_place: bool = False,
    form: str = "auto",
    chunk_size: int = CHUNK_SIZE,
) -> tuple[Tensor, Tensor | None]:
    """Dispatch as SALA does: recurrent for ``T < 64``, chunked (chunk 64) otherwise, in fp32 from inputs of any
    dtype. The chunked form's output is cast to ``out_dtype`` (the kernels store it in that dtype directly).

    ``form``: ``"auto"`` is that rule; ``"recurrent"`` or ``"chunk"`` runs the one form at any length (the
    reference's chunk is ``chunk_size``; the kernels' is fixed at 64). Both forms compute the same recurrence.

    ``in_place``: ``initial_state`` (a static cache's fp32 buffer) receives the final state, which is returned as
    it. The Triton decode kernel writes it directly, also inside a compiled function (``kernels.ops.gla_recurrent_op``),
    where otherwise the recurrent form is traced from this module's code; every other path copies the result in.

    ``backend`` (``salaquant.kernels.backend.use_triton``): ``"reference"`` runs this module's code, ``"triton"``
    the Triton kernels, ``"auto"`` the kernels on CUDA tensors and the reference elsewhere. The kernels compute
    16-bit inputs in fp32 as they load them (``upcast``), so both give the same numbers up to the order of fp32
    operations and TF32 dots."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    short = q.shape[1] < RECURRENT_MAX_LEN if form == "auto" else form == "recurrent"
    triton = use_triton(backend, q, k, v)
    if triton and not short and chunk_size != CHUNK_SIZE:
        raise ValueError(f"the Triton chunk form runs chunks of {CHUNK_SIZE}, not {chunk_size}")
    if in_place:
        if initial_state is None:
            raise ValueError("in_place updates initial_state, which was not given")
        if not (triton and short):
            again = {"out_dtype": out_dtype, "backend": backend, "form": form, "chunk_size": chunk_size}
            o, final = simple_gla(q, k, v, g_gamma, scale, initial_state, True, **again)
            assert final is not None
            return o, initial_state.copy_(final)
        check_inputs(q, k, v, g_gamma, initial_state)
        if torch.compiler.is_compiling():
            from ..kernels.ops import gla_recurrent_op

            return gla_recurrent_op(q, k, v, g_gamma, scale, initial_state), initial_state
        from ..kernels import gla

        return gla.recurrent_fwd(q, k, v, g_gamma, scale, initial_state, state_out=initial_state)
    if triton and not (torch.compiler.is_compiling() and short):
        check_inputs(q, k, v, g_gamma, initial_state)
        from ..kernels import gla

        if short:
            return gla.recurrent_fwd(q, k, v, g_gamma, scale, initial_state, output_final_state)
        return gla.chunk_fwd(
            q, k, v, g_gamma, scale, initial_state, output_final_state, out_dtype=out_dtype, upcast=True
        )
    check_inputs(q, k, v, g_gamma, initial_state)
    state = _first_state(q, v, initial_state)
    if short:
        o, state = _recurrent(q, k, v, g_gamma, scale, state)
    else:
        o, state = _chunked(q, k, v, g_gamma, scale, state, chunk_size)
        o = o.to(out_dtype)
    return o, (state if output_final_state else None)
