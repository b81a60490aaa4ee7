"""NVFP4 weight-only GEMM kernels: the reference against an independent formulation, Triton (interpreter on CPU) against
the reference, the dispatch, and the GPU paths at SALA shapes (CUDA only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from salaquant.formats.modelopt_nvfp4.numerics import E2M1_GRID, quantize_nvfp4
from salaquant.kernels.nvfp4 import E2M1_TABLE, dequantize, nvfp4_matmul, nvfp4_matmul_reference

pytestmark = pytest.mark.random_inputs

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# The interpreter mis-handles bf16 operands, so CPU runs use fp16 / fp32 activations.
HALF = torch.bfloat16 if CUDA else torch.float16
RTOL = 1e-2 if CUDA else 2e-3
"""Relative tolerance of a HALF output (its rounding plus the fp32 summation order)."""


def _quantized(n: int, k: int, device: str = DEV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random ``[n, k]`` weight quantized by salaquant.nvfp4 (ModelOpt export layout) on ``device``."""
    q = quantize_nvfp4(torch.randn(n, k, device=device) * 0.05)
    return q.weight, q.weight_scale, q.weight_scale_2


def _random_bytes(n: int, k: int, device: str = DEV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniformly random codes and random finite FP8 scales (subnormals and negatives included)."""
    weight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scale = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8)
    scale = torch.where((scale & 0x7F) == 0x7F, scale - 1, scale)  # no NaN encodings
    return weight.to(device), scale.view(torch.float8_e4m3fn).to(device), torch.tensor(0.01, device=device)


def _assert_matches(y: torch.Tensor, ref32: torch.Tensor, rtol: float) -> None:
    """``y`` equals the fp32 reference up to ``rtol`` of each value plus ``rtol`` of the largest one; no NaN."""
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y.float(), ref32, rtol=rtol, atol=rtol * float(ref32.abs().max()))


# ---------------------------------------------------------------------------------------------------------------
# Reference vs an independent formulation (salaquant.formats.modelopt_nvfp4.numerics)
# ---------------------------------------------------------------------------------------------------------------


def test_table_matches_numerics_grid() -> None:
    assert E2M1_TABLE[:8] == E2M1_GRID
    assert E2M1_TABLE[8:] == tuple(-v for v in E2M1_GRID)


@pytest.mark.parametrize(("n", "k"), [(32, 64), (96, 160), (7, 48)])
def test_reference_dequantize_matches_numerics(n: int, k: int) -> None:
    q = quantize_nvfp4(torch.randn(n, k))
    assert torch.equal(dequantize(q.weight, q.weight_scale, q.weight_scale_2), q.dequantize())
    # uint8 scale bytes and a Python float global scale are accepted too
    w = dequantize(q.weight, q.weight_scale.view(torch.uint8), float(q.weight_scale_2))
    assert torch.equal(w, q.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matmul_matches_numerics(dtype: torch.dtype) -> None:
    q = quantize_nvfp4(torch.randn(96, 160))
    x = torch.randn(2, 5, 160).to(dtype)
    y = nvfp4_matmul_reference(x, q.weight, q.weight_scale, q.weight_scale_2)
    expect = (x.float() @ q.dequantize().T).to(dtype)
    assert y.shape == (2, 5, 96) and y.dtype == dtype
    torch.testing.assert_close(y, expect, rtol=0, atol=0)


def test_reference_propagates_nan_scales() -> None:
    weight, scale, s2 = _random_bytes(4, 32, "cpu")
    scale = scale.view(torch.uint8).clone()
    scale[1, 0] = 0x7F
    w = dequantize(weight, scale, s2)
    assert torch.isnan(w[1, :16]).all() and not torch.isnan(w[1, 16:]).any()


def test_reference_rejects_bad_operands() -> None:
    weight, scale, s2 = _random_bytes(8, 32, "cpu")
    with pytest.raises(ValueError, match="uint8"):
        dequantize(weight.float(), scale, s2)
    with pytest.raises(ValueError, match="shape"):
        dequantize(weight, scale[:, :1], s2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize(weight, scale.float(), s2)
    with pytest.raises(ValueError, match="scalar"):
        dequantize(weight, scale, torch.ones(2))
    with pytest.raises(ValueError, match="input features"):
        nvfp4_matmul_reference(torch.randn(2, 16), weight, scale, s2)


# ---------------------------------------------------------------------------------------------------------------
# Triton (interpreter on CPU) vs reference
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def tk(monkeypatch: pytest.MonkeyPatch):
    """The Triton kernel module with the split-K workspace poisoned with NaN before every launch."""
    from salaquant.kernels.nvfp4 import triton_kernels

    monkeypatch.setattr(triton_kernels, "_POISON_WORKSPACE", True)
    return triton_kernels


def _configs(tk, m: int) -> list:
    """Default config plus explicit ones that exercise split-K (with an empty split when K is short), partial
    tiles in M and N and weight-tile grouping."""
    del m
    return [
        None,
        tk.NVFP4Config("dot", block_m=16, block_n=32, block_k=32, split_k=3),
        tk.NVFP4Config("dot", block_m=32, block_n=64, block_k=64, split_k=1, group_n=2),
    ]


@pytest.mark.interpreter
@pytest.mark.parametrize("n", [32, 96])
@pytest.mark.parametrize("k", [64, 160])
@pytest.mark.parametrize("m", [1, 5, 16, 33])
def test_triton_matches_reference(tk, m: int, k: int, n: int) -> None:
    weight, scale, s2 = _quantized(n, k)
    x = torch.randn(m, k, device=DEV).to(HALF)
    ref32 = nvfp4_matmul_reference(x.float(), weight, scale, s2)
    for cfg in _configs(tk, m):
        out = torch.full((m, n), float("nan"), dtype=HALF, device=DEV)
        y = tk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg, out=out)
        assert y is out
        _assert_matches(y, ref32, rtol=RTOL)


@pytest.mark.interpreter
def test_triton_all_codes_and_scales_fp32(tk) -> None:
    """Uniformly random bytes (every code, subnormal and negative scales) with fp32 activations: only the fp32
    summation order differs from the reference."""
    weight, scale, s2 = _random_bytes(48, 96)
    x = torch.randn(3, 96, device=DEV)
    ref32 = nvfp4_matmul_reference(x, weight, scale, s2)
    for cfg in (tk.NVFP4Config("dot", block_n=16, block_k=32, split_k=2), tk.NVFP4Config("dot", block_k=64)):
        out = torch.full((3, 48), float("nan"), device=DEV)
        _assert_matches(tk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg, out=out), ref32, rtol=1e-5)


@pytest.mark.interpreter
def test_triton_fp8_decode_every_byte(tk) -> None:
    """Row r of the weight is code 1.0 everywhere under scale byte r: the kernel's FP8 decode of all 256 bytes
    against torch's float8_e4m3fn (0x7F / 0xFF are NaN)."""
    codes = torch.full((256, 8), 0x22, dtype=torch.uint8, device=DEV)
    scale_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(256, 1).to(DEV)
    expect = scale_bytes.view(torch.float8_e4m3fn).float().expand(256, 16)
    dtypes = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
    for dtype in dtypes:
        out = torch.full((256, 16), float("nan"), dtype=dtype, device=DEV)
        got = tk.nvfp4_dequantize_triton(codes, scale_bytes, torch.tensor(1.0, device=DEV), dtype=dtype, out=out)
        torch.testing.assert_close(got.float(), expect, rtol=0, atol=0, equal_nan=True)
        assert torch.isnan(got[0x7F]).all() and torch.isnan(got[0xFF]).all()


@pytest.mark.interpreter
def test_triton_e2m1_decode_every_byte(tk) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 256).to(DEV)
    one = torch.full((1, 32), 0x38, dtype=torch.uint8, device=DEV)  # E4M3 1.0
    expect = dequantize(codes, one, 1.0)
    dtypes = [torch.float32, torch.float16, torch.bfloat16] if CUDA else [torch.float32, torch.float16]
    for dtype in dtypes:
        got = tk.nvfp4_dequantize_triton(codes, one, torch.tensor(1.0, device=DEV), dtype=dtype)
        assert torch.equal(got.float(), expect)


@pytest.mark.interpreter
def test_triton_weight_at_odd_storage_offset(tk) -> None:
    """A packed weight whose storage offset is not a multiple of 4 bytes (it is read as int32 words)."""
    weight, scale, s2 = _quantized(32, 64)
    buf = torch.empty(weight.numel() + 1, dtype=torch.uint8, device=DEV)
    buf[1:] = weight.reshape(-1)
    shifted = buf[1:].view(weight.shape)
    x = torch.randn(3, 64, device=DEV).to(HALF)
    ref32 = nvfp4_matmul_reference(x.float(), weight, scale, s2)
    _assert_matches(tk.nvfp4_matmul_triton(x, shifted, scale, s2), ref32, rtol=RTOL)


@pytest.mark.interpreter
@pytest.mark.parametrize(("n", "k"), [(96, 160), (40, 64)])
def test_triton_dequantize_matches_reference(tk, n: int, k: int) -> None:
    weight, scale, s2 = _random_bytes(n, k)
    ref = dequantize(weight, scale, s2)
    out = torch.full((n, k), float("nan"), device=DEV)
    got = tk.nvfp4_dequantize_triton(weight, scale, s2, dtype=torch.float32, out=out, block_n=32, block_k=64)
    # one fp32 rounding of e2m1 * scale * s2 instead of the reference's two: at most an ulp apart
    torch.testing.assert_close(got, ref, rtol=2.5e-7, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------------------------------------------


def test_auto_on_cpu_is_reference() -> None:
    weight, scale, s2 = _quantized(32, 64, "cpu")
    x = torch.randn(3, 64)
    y = nvfp4_matmul(x, weight, scale, s2)
    assert torch.equal(y, nvfp4_matmul_reference(x, weight, scale, s2))
    assert torch.equal(nvfp4_matmul(x, weight, scale, s2, backend="reference"), y)
    assert nvfp4_matmul(x[:0], weight, scale, s2).shape == (0, 32)


def test_dispatch_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from salaquant.kernels import device

    weight, scale, s2 = _quantized(32, 64, "cpu")
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="backend must be one of"):
        nvfp4_matmul(x, weight, scale, s2, backend="dequant")
    monkeypatch.setattr(device, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="CUDA"):
        nvfp4_matmul(x, weight, scale, s2, backend="triton")


@pytest.mark.interpreter
@pytest.mark.parametrize(("dequant_min_m", "kernel"), [(1024, "fused"), (6, "dequantize")])
def test_dispatch_triton_paths(monkeypatch: pytest.MonkeyPatch, dequant_min_m: int, kernel: str) -> None:
    """The Triton path runs the fused kernels below ``DEQUANT_MIN_M`` rows and dequantize + ``F.linear`` from there."""
    from salaquant.kernels.nvfp4 import triton_kernels

    monkeypatch.setattr(triton_kernels, "DEQUANT_MIN_M", dequant_min_m)
    calls: list[str] = []
    for name in ("nvfp4_matmul_triton", "nvfp4_dequantize_triton"):
        fn = getattr(triton_kernels, name)
        monkeypatch.setattr(
            triton_kernels, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k)
        )
    weight, scale, s2 = _quantized(32, 64)
    x = torch.randn(2, 3, 64, device=DEV).to(HALF)
    y = nvfp4_matmul(x, weight, scale, s2, backend="triton")
    assert calls == ["nvfp4_matmul_triton" if kernel == "fused" else "nvfp4_dequantize_triton"]
    assert y.shape == (2, 3, 32) and y.dtype == HALF
    ref32 = nvfp4_matmul_reference(x.float(), weight, scale, s2)
    _assert_matches(y, ref32, rtol=RTOL)
    assert nvfp4_matmul(x[:, :0], weight, scale, s2, backend="triton").shape == (2, 0, 32)


def test_package_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from salaquant.kernels.nvfp4 import nvfp4_matmul\n"
        "from salaquant.formats.modelopt_nvfp4.numerics import quantize_nvfp4\n"
        "q = quantize_nvfp4(torch.randn(16, 32))\n"
        "y = nvfp4_matmul(torch.randn(2, 32), q.weight, q.weight_scale, q.weight_scale_2)\n"
        "assert y.shape == (2, 16)\n"
        "assert 'salaquant.kernels.nvfp4.triton_kernels' not in sys.modules\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ---------------------------------------------------------------------------------------------------------------
# GPU at MiniCPM-SALA shapes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("k", "n"), [(4096, 4096), (16384, 4096), (4096, 12288)])
@pytest.mark.parametrize("m", [1, 4, 16, 128, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_real_shapes(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    from salaquant.kernels.nvfp4 import triton_kernels as tk

    weight, scale, s2 = _quantized(n, k, "cuda")
    x = torch.randn(m, k, device="cuda").to(dtype)
    ref32 = nvfp4_matmul_reference(x.float(), weight, scale, s2)
    for backend in ("auto", "triton"):
        _assert_matches(nvfp4_matmul(x, weight, scale, s2, backend=backend), ref32, rtol=1e-2)
    # the fused kernels at every M, and the dequantized weight with F.linear
    _assert_matches(tk.nvfp4_matmul_triton(x, weight, scale, s2), ref32, rtol=1e-2)
    w = tk.nvfp4_dequantize_triton(weight, scale, s2, dtype=dtype)
    _assert_matches(torch.nn.functional.linear(x, w), ref32, rtol=1e-2)
    if m <= 16:
        _assert_matches(
            tk.nvfp4_matmul_triton(x, weight, scale, s2, config=tk.NVFP4Config("dot", split_k=8)), ref32, rtol=1e-2
        )


@pytest.mark.gpu
def test_gpu_split_k_is_deterministic_and_graph_safe() -> None:
    from salaquant.kernels.nvfp4 import triton_kernels as tk

    weight, scale, s2 = _quantized(4096, 4096, "cuda")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = tk.NVFP4Config("dot", split_k=8)
    first = tk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg)
    for _ in range(5):
        assert torch.equal(tk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg), first)
    y = nvfp4_matmul(x, weight, scale, s2)  # warm-up: compiles and allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = nvfp4_matmul(x, weight, scale, s2)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    _assert_matches(y, nvfp4_matmul_reference(x.float(), weight, scale, s2), rtol=1e-2)
