"""The paired-fp16 W4A16 GEMV (one activation row): against the PyTorch reference under the Triton interpreter
(which runs the emulation of the paired operations), exactly where every fp16 step is exact, at activations near
the fp16 limit, and on a GPU its PTX against that emulation at SALA shapes (CUDA only)."""

from __future__ import annotations

import random

import pytest
import torch
from error_bounds import assert_within

from salaquant.kernels.counters import arrival_counters
from salaquant.kernels.w4a16 import dequantize, w4a16_matmul_reference

pytestmark = pytest.mark.random_inputs

GROUP_SIZES = (-1, 32, 64, 128)
# Each word's two 4-term sums take four fp16 roundings of at most 2**-11 of the running absolute sum (2**-9 in
# all), plus the output's rounding to nearest (2**-11 fp16; 2**-8 bf16, whose significand is 8 bits): bounds
# relative to |x| @ |W|^T.
TOL = {torch.float16: 2**-9 + 2**-11, torch.bfloat16: 2**-9 + 2**-8}


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _words(gen: torch.Generator, k: int, n: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, (k // 8, n), generator=gen, dtype=torch.int64).to(torch.int32)


def _bound_check(y: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, gs: int, what: str):
    ref = w4a16_matmul_reference(x.float(), qweight, scales.float(), 4, gs).double()
    w = dequantize(qweight, scales.float(), 4, gs).double()
    bound = TOL[x.dtype] * (x.double().abs() @ w.abs().t())
    assert_within(y, ref, bound, what)


# (K, N, block_n, block_k, split_k): K = 416 is 6.5 tiles of 64 (a partial last tile, splits of 3, 3 and 1
# tiles), N = 80 and 96 partial column tiles; groups of 32 below a tile of 64 take one scale per word row
PAIRED_CASES = ((416, 80, 64, 64, 3), (256, 64, 64, 16, None), (512, 96, 32, 32, 2), (384, 192, 256, 64, 1))
# (dtype, sub-tile width): with the four group sizes, a 4 x 4 Latin square picks the shape case, so that every
# pair of group size, shape case and (dtype, sub-tiles) is run once (16 runs instead of all 64 combinations)
PAIRED_VARIANTS = ((torch.float16, 0), (torch.float16, 16), (torch.bfloat16, 0), (torch.bfloat16, 16))


@pytest.mark.interpreter
@pytest.mark.parametrize("variant", range(4), ids=["fp16-tile", "fp16-subtiles", "bf16-tile", "bf16-subtiles"])
@pytest.mark.parametrize("g", range(4), ids=[str(gs) for gs in GROUP_SIZES])
def test_paired_matches_reference(g: int, variant: int) -> None:
    from salaquant.kernels.w4a16 import triton_kernels as tk

    group_size, (dtype, sub) = GROUP_SIZES[g], PAIRED_VARIANTS[variant]
    k, n, block_n, block_k, split_k = PAIRED_CASES[(g + variant) % len(PAIRED_CASES)]
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else -(-k // group_size)
    qweight = _words(gen, k, n)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.002).to(torch.float16)
    x = torch.randn(1, k, generator=gen).to(dtype)
    out = torch.full((1, n), float("nan"), dtype=dtype)
    y = tk.matmul_paired(
        x, qweight, scales, 4, group_size, out=out, block_n=block_n, block_k=block_k, split_k=split_k, sub=sub
    )
    assert y is out
    _bound_check(y, x, qweight, scales, group_size, f"seed={seed} K={k} N={n} gs={group_size} {dtype}")
    assert not bool(arrival_counters(x.device, 1).any()), "split-K counters were not reset"


@pytest.mark.interpreter
@pytest.mark.parametrize("sub", [0, 8], ids=["tile", "subtiles"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_paired_exact_where_fp16_is_exact(dtype: torch.dtype, sub: int) -> None:
    """16 activations of +-1 at random places (the rest 0) and scales of 1 or 2: every fp16 product and 4-term
    sum and the fp32 accumulation are exact and the outputs are integers of magnitude <= 16 * 8 * 2 = 256, which
    both output dtypes hold, so the output must equal the reference exactly; a code paired with the wrong
    activation, a wrong half or a wrong constant shows up as a mismatch."""
    from salaquant.kernels.w4a16 import triton_kernels as tk

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    k, n, gs = 256, 96, 64
    qweight = _words(gen, k, n)
    scales = (2.0 ** torch.randint(0, 2, (k // gs, n), generator=gen)).to(torch.float16)
    x = torch.zeros(1, k)
    x[0, torch.randperm(k, generator=gen)[:16]] = torch.randint(0, 2, (16,), generator=gen).float() * 2 - 1
    x = x.to(dtype)
    for block_k, split_k in ((32, 2), (64, None)):
        y = tk.matmul_paired(x, qweight, scales, 4, gs, block_n=32, block_k=block_k, split_k=split_k, sub=sub)
        ref = w4a16_matmul_reference(x.float(), qweight, scales.float(), 4, gs)
        assert torch.equal(y.float(), ref), f"seed={seed}: {int((y.float() != ref).sum())} outputs differ"


@pytest.mark.interpreter
def test_paired_activations_near_the_fp16_limit() -> None:
    """The codes are scaled by 1/32, so each 4-term sum stays within the largest activation: fp16 activations up
    to 60000 give finite results within the bound."""
    from salaquant.kernels.w4a16 import triton_kernels as tk

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    k, n = 256, 64
    qweight = torch.full((k // 8, n), 0, dtype=torch.int32)  # every code 0: weight -8 * scale, the largest magnitude
    scales = torch.full((2, n), 2.0**-13, dtype=torch.float16)  # outputs about -12300, inside fp16
    x = (torch.rand(1, k, generator=gen) * 1000 + 59000).to(torch.float16)  # one sign: no cancellation
    y = tk.matmul_paired(x, qweight, scales, 4, 128, block_n=64, block_k=64)
    assert bool(torch.isfinite(y).all())
    _bound_check(y, x, qweight, scales, 128, f"seed={seed} large activations")


@pytest.mark.interpreter
@pytest.mark.parametrize("sub", [0, 16], ids=["tile", "subtiles"])
def test_paired_scales_bf16_activations_past_fp16_range(sub: int) -> None:
    """bf16 activations beyond fp16's 65504 are scaled by a power of two per program before the fp16 conversion
    and the result scaled back: finite and within the bound. Split 0 holds the huge values (scaled), split 1
    values in range (unscaled); without the scaling the first would be infinite, without scaling back 16x small."""
    from salaquant.kernels.w4a16 import triton_kernels as tk

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    k, n = 256, 64
    qweight, scales = _words(gen, k, n), (torch.rand(2, n, generator=gen) * 0.02 + 0.002).half()
    x = torch.randn(1, k, generator=gen)
    x[0, :128] *= torch.tensor([3e5, 1e-6]).repeat(64)  # alternately huge and tiny in the first split's inputs
    x = x.to(torch.bfloat16)
    y = tk.matmul_paired(x, qweight, scales, 4, 128, split_k=2, block_n=64, block_k=128, sub=sub)
    assert bool(torch.isfinite(y).all()), f"seed={seed}: non-finite outputs"
    _bound_check(y, x, qweight, scales, 128, f"seed={seed} huge bf16 activations")
    y_in_range = tk.matmul_paired(x[:, 128:], qweight[16:], scales[1:], 4, 128, block_n=64, block_k=128, sub=sub)
    _bound_check(y_in_range, x[:, 128:], qweight[16:], scales[1:], 128, f"seed={seed} the second split alone")


def test_paired_refuses_what_it_cannot_run() -> None:
    from salaquant.kernels.w4a16 import triton_kernels as tk

    gen = torch.Generator().manual_seed(0)
    qweight, scales = _words(gen, 256, 64), torch.ones(2, 64, dtype=torch.float16)
    x = torch.zeros(1, 256, dtype=torch.float16)
    with pytest.raises(ValueError, match="one fp16/bf16 row and 4-bit codes"):
        tk.matmul_paired(x.float(), qweight, scales)
    with pytest.raises(ValueError, match="one fp16/bf16 row and 4-bit codes"):
        tk.matmul_paired(torch.zeros(2, 256, dtype=torch.float16), qweight, scales)
    q8, s8 = torch.zeros(64, 64, dtype=torch.int32), torch.ones(2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="one fp16/bf16 row and 4-bit codes"):
        tk.matmul_paired(x, q8, s8, 8, 128)
    with pytest.raises(ValueError, match="block_k must be"):
        tk.matmul_paired(x, qweight, scales, block_k=48)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, "huge_bf16"], ids=["fp16", "bf16", "huge_bf16"])
@pytest.mark.parametrize(("k", "n"), [(4096, 32768), (16384, 4096), (4096, 4096)], ids=["gate_up", "down", "o_proj"])
def test_gpu_paired_ptx_equals_emulation(k: int, n: int, dtype: torch.dtype | str) -> None:
    """The PTX path against the emulation of the same operations on the same GPU (bit-identical), and both within
    the bound of the fp32 reference; ``huge_bf16``: bf16 activations up to 3e5 in the first quarter of K (the
    scaled conversion there, the plain one in the splits after)."""
    from salaquant.kernels.w4a16 import triton_kernels as tk

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    qweight = _words(gen, k, n).cuda()
    scales = (torch.rand(k // 128, n, generator=gen) * 0.02 + 0.002).to(torch.float16).cuda()
    x = torch.randn(1, k, generator=gen)
    if dtype == "huge_bf16":
        x[0, : k // 4] *= 3e5
    x = x.to(torch.bfloat16 if dtype == "huge_bf16" else dtype).cuda()
    got = tk.matmul(x, qweight, scales, 4, 128)
    emulated = tk.matmul_paired(x, qweight, scales, 4, 128, emulate=True)
    assert torch.equal(got, emulated), f"seed={seed}: max diff {float((got.float() - emulated.float()).abs().max())}"
    assert bool(torch.isfinite(got).all()), f"seed={seed}: non-finite outputs"
    _bound_check(got.cpu(), x.cpu(), qweight.cpu(), scales.cpu(), 128, f"seed={seed} K={k} N={n} {dtype}")


def test_paired_sub_tiles_by_device_and_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sub-tile layout is chosen on a Hopper GPU at gate_up (K 4096 -> N 32768) only, and only where its width
    divides the column tile; everything else runs the plain tile; a width the kernel cannot run is refused."""
    from salaquant.kernels.w4a16 import triton_kernels as tk

    cuda = torch.device("cuda")
    monkeypatch.setattr(tk, "_INTERPRET", False)
    monkeypatch.setattr(tk, "_cuda_facts", lambda device: (132, 9))
    assert tk._paired_sub(cuda, 4096, 32768, 256) == 64
    assert tk._paired_sub(cuda, 4096, 32768, 32) == 0  # 64 does not divide a 32-column tile
    assert tk._paired_sub(cuda, 16384, 4096, 256) == 0
    assert tk._paired_sub(torch.device("cpu"), 4096, 32768, 256) == 0
    monkeypatch.setattr(tk, "_cuda_facts", lambda device: (132, 8))
    assert tk._paired_sub(cuda, 4096, 32768, 256) == 0
    gen = torch.Generator().manual_seed(0)
    qweight, scales = _words(gen, 256, 64), torch.ones(2, 64, dtype=torch.float16)
    x = torch.zeros(1, 256, dtype=torch.float16)
    for bad in (2, 48, 128):  # below 4, not a power of two, wider than the 64-column tile
        with pytest.raises(ValueError, match="sub must be"):
            tk.matmul_paired(x, qweight, scales, block_n=64, sub=bad)
