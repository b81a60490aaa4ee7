"""The NVFP4 paired-fp16 GEMV (one activation row): against the PyTorch reference under the Triton interpreter
(which runs the emulation of the paired operations), exactly where every fp16 step is exact, NaN scales, the
choice of kernel, and on a GPU its PTX against that emulation at SALA shapes (CUDA only)."""

from __future__ import annotations

import random

import pytest
import torch
from error_bounds import assert_within

from salaquant.formats.modelopt_nvfp4.numerics import quantize_nvfp4
from salaquant.kernels.nvfp4 import dequantize, nvfp4_matmul_reference

pytestmark = pytest.mark.random_inputs

# Each block's two 8-term sums take eight fp16 roundings of at most 2**-11 of the running absolute sum (2**-8 in
# all), plus the output's rounding to nearest (2**-11 fp16; 2**-8 bf16, whose significand is 8 bits): bounds
# relative to |x| @ |W|^T.
TOL = {torch.float16: 2**-8 + 2**-11, torch.bfloat16: 2**-8 + 2**-8}


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _quantized(gen: torch.Generator, n: int, k: int):
    q = quantize_nvfp4(torch.randn(n, k, generator=gen) * 0.05)
    return q.weight, q.weight_scale, q.weight_scale_2


def _bound_check(y: torch.Tensor, x: torch.Tensor, weight, scale, s2, slack: float, what: str) -> None:
    """``|y - ref| <= TOL * (|x| @ |W|^T) + slack`` elementwise; NaN fails."""
    w = dequantize(weight, scale, s2).double()
    ref = x.double() @ w.t()
    bound = TOL[x.dtype] * (x.double().abs() @ w.abs().t()) + slack
    assert_within(y, ref, bound, what)


@pytest.fixture
def tk(monkeypatch: pytest.MonkeyPatch):
    """The Triton kernel module with the split-K workspace poisoned with NaN before every launch."""
    from salaquant.kernels.nvfp4 import triton_kernels

    monkeypatch.setattr(triton_kernels, "_POISON_WORKSPACE", True)
    return triton_kernels


@pytest.mark.interpreter
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_paired_matches_reference(tk, dtype: torch.dtype, prefetch: bool) -> None:
    # (N, K, block_n, block_k, split_k): K = 416 is 6.5 tiles of 64 (a partial last tile, splits of 3, 3 and 1
    # tiles), N = 80 a partial row tile, 256 x 512 even tiles (the unmasked loads)
    cases = [(80, 416, 64, 64, 3), (96, 256, 32, 32, 1), (256, 512, 128, 64, 2), (64, 128, 64, 16, 4)]
    for n, k, block_n, block_k, split_k in cases:
        seed = _seed()
        gen = torch.Generator().manual_seed(seed)
        weight, scale, s2 = _quantized(gen, n, k)
        x = torch.randn(1, k, generator=gen).to(dtype)
        cfg = tk.NVFP4Config(
            "paired", block_n=block_n, block_k=block_k, split_k=split_k, num_stages=1, prefetch=prefetch
        )
        out = torch.full((1, n), float("nan"), dtype=dtype)
        y = tk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg, out=out)
        assert y is out
        _bound_check(y, x, weight, scale, s2, 0.0, f"seed={seed} N={n} K={k} {cfg}")


@pytest.mark.interpreter
def test_paired_scales_bf16_activations_past_fp16_range(tk) -> None:
    """Each program scales its activations by the power of two that brings its slice's largest into [2**14, 2**15)
    before the fp16 conversion, and its sum back: bf16 activations past fp16's 65504 (one split holding 3e5 next
    to 1e-6, the other ordinary ones) give finite outputs within the bound."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    n, k = 64, 256
    weight, scale, s2 = _quantized(gen, n, k)
    x = torch.randn(1, k, generator=gen)
    x[0, :128] *= torch.tensor([3e5, 1e-6]).repeat(64)  # alternately huge and tiny in the first split's inputs
    x = x.to(torch.bfloat16)
    cfg = tk.NVFP4Config("paired", block_n=64, block_k=128, split_k=2, num_stages=1)
    y = tk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg)
    assert bool(torch.isfinite(y).all()), f"seed={seed}: non-finite outputs"
    _bound_check(y, x, weight, scale, s2, 0.0, f"seed={seed} huge bf16 activations")


@pytest.mark.interpreter
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_paired_scales_small_activations_up(tk, prefetch: bool) -> None:
    """Activations of order 2**-40 (bf16): unscaled, every fp16 product of a code ``e2m1 * 2**-14`` with them would
    be zero; scaled up per split they keep the bound. fp16 ones of order 2**-10 (scaled up too; smaller ones would
    make outputs below fp16's normal range, whose rounding the relative bound does not cover). Splits of two, two and
    no K tiles, in both launch variants."""
    for dtype, size in ((torch.bfloat16, 2.0**-40), (torch.float16, 2.0**-10)):
        seed = _seed()
        gen = torch.Generator().manual_seed(seed)
        n, k = 32, 256
        weight, scale, s2 = _quantized(gen, n, k)
        x = (torch.randn(1, k, generator=gen) * size).to(dtype)
        cfg = tk.NVFP4Config("paired", block_n=32, block_k=64, split_k=3, num_stages=1, prefetch=prefetch)
        y = tk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg)
        _bound_check(y, x, weight, scale, s2, 0.0, f"seed={seed} {dtype} activations of {size}")


@pytest.mark.interpreter
def test_paired_every_code_and_scale(tk) -> None:
    """Uniformly random bytes: every code, subnormal and negative scales. Products below fp16's normal range
    keep an absolute error of at most 2**-25 per operation in units of the scaled activations times ``2**-14``,
    at most ``2**-25 * max|x| * |scale| * global scale`` in the output's: the bound gets that slack for each of
    the K operations (eight per half of each 16-input block)."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    n, k = 48, 96
    weight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    scale = torch.randint(0, 256, (n, k // 16), generator=gen, dtype=torch.int64).to(torch.uint8)
    scale = torch.where((scale & 0x7F) == 0x7F, scale - 1, scale).view(torch.float8_e4m3fn)
    s2 = torch.tensor(0.01)
    x = torch.randn(1, k, generator=gen).to(torch.float16)
    cfg = tk.NVFP4Config("paired", block_n=16, block_k=32, split_k=2, num_stages=1)
    y = tk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg)
    slack = k * 2**-25 * float(x.float().abs().max()) * float(scale.float().abs().max()) * 0.01
    _bound_check(y, x, weight, scale, s2, slack, f"seed={seed}")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_paired_exact_where_fp16_is_exact(tk, dtype: torch.dtype) -> None:
    """8 activations of +-1 (the rest 0), scales 1 or 2, global scale 1: every fp16 product (a multiple of 2**-15)
    and 4-term sum is exact, the outputs are multiples of 1/2 below 96 that both dtypes hold, so the output must
    equal the reference exactly; a code paired with the wrong activation or scale, or a wrong sign or magnitude
    bit, shows up as a mismatch."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    n, k = 64, 256
    weight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    scale = torch.where(torch.rand(n, k // 16, generator=gen) < 0.5, 0x38, 0x40).to(torch.uint8)  # E4M3 1.0 / 2.0
    x = torch.zeros(1, k)
    x[0, torch.randperm(k, generator=gen)[:8]] = torch.randint(0, 2, (8,), generator=gen).float() * 2 - 1
    x = x.to(dtype)
    for block_k, split_k in ((32, 2), (64, 1), (128, 3)):
        cfg = tk.NVFP4Config("paired", block_n=32, block_k=block_k, split_k=split_k, num_stages=1)
        y = tk.nvfp4_matmul_triton(x, weight, scale, 1.0, config=cfg)
        ref = nvfp4_matmul_reference(x.float(), weight, scale, 1.0)
        assert torch.equal(y.float(), ref), f"seed={seed} {cfg}: {int((y.float() != ref).sum())} outputs differ"


@pytest.mark.interpreter
def test_paired_nan_scale_gives_nan(tk) -> None:
    gen = torch.Generator().manual_seed(0)
    weight, scale, s2 = _quantized(gen, 32, 64)
    scale = scale.view(torch.uint8).clone()
    scale[5, 2] = 0x7F
    scale[9, 0] = 0xFF
    x = torch.randn(1, 64, generator=gen).to(torch.float16)
    cfg = tk.NVFP4Config("paired", block_n=32, block_k=32, split_k=1, num_stages=1)
    y = tk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg)
    nan = torch.isnan(y[0])
    assert bool(nan[5]) and bool(nan[9]) and int(nan.sum()) == 2


def test_default_config_takes_the_paired_gemv_for_one_half_row() -> None:
    from salaquant.kernels.nvfp4 import tuning as tk

    for dtype in (torch.float16, torch.bfloat16):
        cfg = tk.default_config(1, 4096, 4096, "cpu", dtype)
        assert cfg.kernel == "paired" and (cfg.block_n, cfg.block_k) == tk.PAIRED_TILE
    assert tk.default_config(1, 4096, 4096, "cpu", torch.float32).kernel == "dot"
    assert tk.default_config(1, 4096, 4096, "cpu").kernel == "dot"
    assert tk.default_config(2, 4096, 4096, "cpu", torch.bfloat16).kernel == "dot"


def test_paired_splits_by_gpu_and_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuned launches apply on a Hopper GPU at down (K 16384 -> N 4096) and o_proj (4096 -> 4096) only; elsewhere
    ``PAIRED_TILE`` split into the largest power of two whose programs number at most 4 per SM (528 of 132 SMs), fit
    in one wave of what the GPU holds and keep a K tile each: gate_up and qkv have 1024 and 384 row tiles, so 1;
    4096 -> 2048 has 64 tiles and 8 K tiles, so 4 in a wave of 396 and 8 in one of 660; off Hopper down and o_proj
    have 128 tiles, so 2 in a wave of 396."""
    from salaquant.kernels.nvfp4 import tuning as tk

    wave = {"programs": 396}
    monkeypatch.setattr(tk, "_paired_wave", lambda *args: wave["programs"])
    monkeypatch.setattr(tk, "_cuda_facts", lambda device: (132, 9))
    down = tk.default_config(1, 4096, 16384, "cuda", torch.bfloat16)
    assert (down.block_n, down.block_k, down.split_k, down.prefetch) == (64, 512, 8, False)
    o_proj = tk.default_config(1, 4096, 4096, "cuda", torch.bfloat16)
    assert (o_proj.block_n, o_proj.block_k, o_proj.split_k, o_proj.prefetch) == (32, 1024, 1, True)
    for n, k, split in ((32768, 4096, 1), (12288, 4096, 1), (2048, 4096, 4)):
        cfg = tk.default_config(1, n, k, "cuda", torch.bfloat16)
        assert ((cfg.block_n, cfg.block_k), cfg.split_k, cfg.prefetch) == (tk.PAIRED_TILE, split, True), (n, k)
    wave["programs"] = 660
    assert tk.default_config(1, 2048, 4096, "cuda", torch.bfloat16).split_k == 8
    wave["programs"] = 396
    monkeypatch.setattr(tk, "_cuda_facts", lambda device: (132, 8))
    for n, k in ((4096, 16384), (4096, 4096)):
        cfg = tk.default_config(1, n, k, "cuda", torch.bfloat16)
        assert ((cfg.block_n, cfg.block_k), cfg.split_k) == (tk.PAIRED_TILE, 2), (n, k)


@pytest.mark.interpreter
def test_paired_refuses_what_it_cannot_run(tk) -> None:
    gen = torch.Generator().manual_seed(0)
    weight, scale, s2 = _quantized(gen, 32, 64)
    cfg = tk.NVFP4Config("paired", block_n=32, block_k=32, num_stages=1)
    with pytest.raises(ValueError, match="one fp16/bf16 activation row"):
        tk.nvfp4_matmul_triton(torch.zeros(2, 64, dtype=torch.float16), weight, scale, s2, config=cfg)
    with pytest.raises(ValueError, match="one fp16/bf16 activation row"):
        tk.nvfp4_matmul_triton(torch.zeros(1, 64), weight, scale, s2, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["bf16", "huge_bf16", "fp16"])
@pytest.mark.parametrize(("k", "n"), [(4096, 32768), (16384, 4096), (4096, 4096)], ids=["gate_up", "down", "o_proj"])
def test_gpu_paired_ptx_equals_emulation(monkeypatch: pytest.MonkeyPatch, k: int, n: int, case: str) -> None:
    """The PTX path against the emulation of the same operations on the same GPU (bit-identical), both within the
    bound of the fp32 reference, at SALA shapes with the default launch; ``huge_bf16``: activations up to 3e5 in
    the first quarter of K."""
    from salaquant.kernels.nvfp4 import triton_kernels as tk
    from salaquant.kernels.nvfp4 import tuning

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    weight, scale, s2 = _quantized(gen, n, k)
    weight, scale, s2 = weight.cuda(), scale.cuda(), s2.cuda()
    x = torch.randn(1, k, generator=gen)
    if case == "huge_bf16":
        x[0, : k // 4] *= 3e5
    x = x.to(torch.float16 if case == "fp16" else torch.bfloat16).cuda()
    assert tk.default_config(1, n, k, "cuda", x.dtype).kernel == "paired"
    got = tk.nvfp4_matmul_triton(x, weight, scale, s2)
    monkeypatch.setattr(tuning, "_EMULATE_PAIRED", True)
    emulated = tk.nvfp4_matmul_triton(x, weight, scale, s2)
    assert torch.equal(got, emulated), f"seed={seed}: max diff {float((got.float() - emulated.float()).abs().max())}"
    _bound_check(got.cpu(), x.cpu(), weight.cpu(), scale.cpu(), s2.cpu(), 0.0, f"seed={seed} {case}")
