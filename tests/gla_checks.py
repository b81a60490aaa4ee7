"""What the Simple GLA tests share (``test_gla.py`` on the PyTorch references, ``test_kernels_gla.py`` on the Triton
kernels): the random inputs in the model's layout and one closeness check, so both files hold their results to the
same bound."""

from __future__ import annotations

import torch


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
