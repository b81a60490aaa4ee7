"""The NVFP4 GPTQ sweep with the block-scale search in the same launch (``salaquant.kernels.gptq.nvfp4_sweep``):
its FP8 rounding against torch's float8_e4m3fn conversion, and the whole solver on it against the PyTorch path
(search, then sweep, 16 columns at a time) byte for byte."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from salaquant.formats.modelopt_nvfp4.numerics import round_block_scales
from salaquant.kernels.gptq.nvfp4_sweep import _e4m3_bits, _e4m3_value
from salaquant.nvfp4.gptq import gptq_nvfp4
from salaquant.nvfp4.search import searched_global_scale


@triton.jit
def _e4m3_probe(X, BITS, VALUES, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    bits = _e4m3_bits(tl.load(X + offs, mask=mask, other=1.0))
    tl.store(BITS + offs, bits, mask=mask)
    tl.store(VALUES + offs, _e4m3_value(bits), mask=mask)


@pytest.mark.interpreter
def test_fp8_rounding_is_torchs() -> None:
    """Every positive E4M3 value, the midpoints between neighbours (ties go to the even pattern), values a hair
    either side of them, zero (which the format's scales take as 1.0) and values outside [2**-9, 448] (clamped):
    the kernel's bit patterns and values are those of ``round_block_scales``, i.e. torch's conversion."""
    grid = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([
        grid, mid, torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, torch.full_like(mid, 1e9)),
        torch.tensor([0.0, 1e-6, 2.0**-10, 449.0, 500.0, 1e6]),
    ]).contiguous()  # fmt: skip
    n = x.numel()
    bits = torch.empty(n, dtype=torch.int32)
    values = torch.empty(n, dtype=torch.float32)
    _e4m3_probe[(1,)](x, bits, values, n, BLOCK=triton.next_power_of_2(n))
    want = round_block_scales(x)
    assert torch.equal(bits, want.view(torch.uint8).to(torch.int32))
    assert torch.equal(values, want.float())


def _weight(g: torch.Generator, out: int, n: int) -> torch.Tensor:
    return torch.randn(out, n, generator=g) * torch.exp(0.5 * torch.randn(out, n, generator=g)) * 0.02


def _hessian(g: torch.Generator, n: int) -> torch.Tensor:
    x = torch.randn(512, n, generator=g) @ (torch.eye(n) + 0.4 * torch.randn(n, n, generator=g) / n**0.5)
    return x.T @ x / 512


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("out", "n", "block_size", "mse_iters", "max_grow"),
    [
        (20, 64, 32, 80, 1.5),  # the default search: FP8 values from 1.5 x the plain scale down to 0.4 x (fine)
        (20, 64, 32, 80, 1.0),  # shrunk scales only
        (37, 96, 48, 5, 1.5),  # coarse factors, tried one by one; a block of 48 columns in a 64-wide tile
        (16, 64, 64, 0, 1.5),  # no search: the plain scales
    ],
)
def test_fused_search_writes_the_reference_bytes(
    out: int, n: int, block_size: int, mse_iters: int, max_grow: float
) -> None:
    """Scales chosen during the sweep, on the fused kernel (interpreted) and on the PyTorch path: the same codes,
    block scales and loss. Inputs with tiny importance and one dead input column are included; a scale chosen on
    the columns before the earlier errors reached them, or swept with another block's scale, changes bytes."""
    g = torch.Generator().manual_seed(out + n)
    w = _weight(g, out, n)
    h = _hessian(g, n)
    h[5, :] = 0  # a dead input: H[5, 5] == 0
    h[:, 5] = 0
    imp = torch.diag(h).clone()
    imp[7] = 1e-12
    ws2 = searched_global_scale(w.abs().amax(), max_grow)
    runs = [
        gptq_nvfp4(w, h, ws2, imp, mse_iters=mse_iters, mse_max_grow=max_grow, block_size=block_size, backend=be)
        for be in ("triton", "reference")
    ]
    a, b = (r.weight for r in runs)
    assert torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8))
    assert torch.equal(a.weight, b.weight)
    assert runs[0].loss == runs[1].loss


@pytest.mark.gpu
def test_gpu_fused_search_matches_the_pytorch_path() -> None:
    """At a SALA width on the GPU (one block of 128 columns per launch, 1,024 rows), scales grown up to 1.5x too:
    the fused kernel and the PyTorch path choose the same block scales and write the same codes. The 16-term error
    sums run in other orders on the two, so a row whose two best candidates tie to the last bit may differ: allowed
    for a few scales in ten thousand, with the Hessian loss within 1e-4."""
    g = torch.Generator().manual_seed(9)
    w = _weight(g, 1024, 2048).cuda()
    h = _hessian(g, 2048).cuda()
    ws2 = searched_global_scale(w.abs().amax(), 1.5)
    a, b = (gptq_nvfp4(w, h, ws2, torch.diag(h), mse_max_grow=1.5, backend=be) for be in ("triton", "reference"))
    same = a.weight.weight_scale.view(torch.uint8) == b.weight.weight_scale.view(torch.uint8)
    assert float(same.float().mean()) > 0.9995
    assert a.loss == pytest.approx(b.loss, rel=1e-4)
