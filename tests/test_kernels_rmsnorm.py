"""The RMSNorm kernel (``salaquant.kernels.rmsnorm``) against the model's reference ``rms_norm``."""

from __future__ import annotations

import pytest
import torch

from salaquant.model.layers import rms_norm

pytestmark = pytest.mark.random_inputs


@pytest.mark.interpreter
@pytest.mark.parametrize("n", [128, 96])  # a power of two, and a masked tail
@pytest.mark.parametrize(("xdt", "wdt"), [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                          (torch.float16, torch.float32)])  # fmt: skip
def test_kernel_matches_reference(n: int, xdt: torch.dtype, wdt: torch.dtype) -> None:
    """Rows of very different scales (and one of zeros): the same values as the reference up to fp32 summation
    order, in the reference's output dtype."""
    x = (torch.randn(3, 5, n) * torch.tensor([1e-3, 1.0, 300.0]).view(3, 1, 1)).to(xdt)
    x[1, 2] = 0
    w = (torch.rand(n) * 2).to(wdt)
    ref = rms_norm(x, w, 1e-6)
    got = rms_norm(x, w, 1e-6, backend="triton")
    assert got.dtype == ref.dtype and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-3 if xdt == torch.float16 else 1e-5, atol=1e-6)
    assert torch.equal(got[1, 2], torch.zeros_like(got[1, 2]))
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, w[:-1], 1e-6, backend="triton")
