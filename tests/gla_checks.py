"""What the Simple GLA tests share (``test_gla.py`` on the PyTorch references, ``test_kernels_gla.py`` on the Triton
kernels): the random inputs in the model's layout and one closeness check, so both files hold their results to the
same bound."""

from __future__ import annotations

import math

import torch

from salaquant.model.gla import check_inputs


def gla_inputs(
    batch: int,
    t: int,
    heads: int,
    dk: int,
    dv: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, ...]:
    """Standard-normal ``q, k [B, T, H, dk]`` and ``v [B, T, H, dv]`` cast to ``dtype``, and an fp32 initial state
    ``[B, H, dk, dv]``, drawn in that order from ``generator`` (torch's global generator when None)."""
    q = torch.randn(batch, t, heads, dk, device=device, generator=generator).to(dtype)
    k = torch.randn(batch, t, heads, dk, device=device, generator=generator).to(dtype)
    v = torch.randn(batch, t, heads, dv, device=device, generator=generator).to(dtype)
    s0 = torch.randn(batch, heads, dk, dv, device=device, generator=generator)
    return q, k, v, s0


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """``actual`` is fp32, finite, of ``expected``'s shape, and within ``rel`` times the larger of 1 and
    ``expected``'s largest magnitude (absolute) or 1e-4 (relative) of it elementwise."""
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    atol = rel * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-4)


def naive_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor,
    scale: float,
    h0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: the recurrence ``s_t = exp(g) s_{t-1} + k_t v_t^T``, ``o_t = scale q_t^T s_t`` written out token
    by token, one (batch, head) pair at a time, in fp32. Returns ``o [B, T, H, V]`` and the final state."""
    check_inputs(q, k, v, g_gamma, h0)
    b_size, t_size, h_size, dk = q.shape
    dv = v.shape[-1]
    o = torch.zeros(b_size, t_size, h_size, dv, dtype=torch.float32, device=q.device)
    final = torch.zeros(b_size, h_size, dk, dv, dtype=torch.float32, device=q.device)
    for b in range(b_size):
        for h in range(h_size):
            decay = math.exp(float(g_gamma[h]))
            s = torch.zeros(dk, dv, device=q.device) if h0 is None else h0[b, h].float().clone()
            for t in range(t_size):
                s = decay * s + torch.outer(k[b, t, h].float(), v[b, t, h].float())
                o[b, t, h] = scale * (q[b, t, h].float() @ s)
            final[b, h] = s
    return o, final
