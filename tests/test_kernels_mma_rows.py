"""The 4-bit kernel for few rows on ``mma.sync`` (``salaquant/kernels/mma_rows.py``; ``matmul_mma_rows`` for GPTQ,
``NVFP4Config("rows")`` for NVFP4, 1-64 rows): its MMA emulation against the fragment layout of the PTX ISA,
the kernel against the PyTorch references under the Triton interpreter, and on a GPU the PTX against the emulation
and the references at SALA shapes (CUDA only)."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl
from error_bounds import assert_within

from salaquant.formats.modelopt_nvfp4.numerics import quantize_nvfp4
from salaquant.kernels import mma_rows
from salaquant.kernels.counters import arrival_counters
from salaquant.kernels.nvfp4 import dequantize as nvfp4_dequantize
from salaquant.kernels.w4a16 import dequantize, w4a16_matmul_reference

pytestmark = pytest.mark.random_inputs

# Products of an fp16 code value and an fp16 activation are exact in fp32 and the tensor core sums them in fp32;
# what remains is the output's rounding to nearest (2**-11 fp16, 2**-8 bf16), with room for the fp32 sums.
TOL = {torch.float16: 2**-10, torch.bfloat16: 2**-8}


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _operands(seed: int, m: int, k: int, n: int, gs: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if gs == -1 else k // gs
    qweight = torch.randint(-(2**31), 2**31, (k // 8, n), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.002).to(torch.float16)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x.to(device), qweight.to(device), scales.to(device)


def _bound_check(y: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, gs: int, what: str):
    """``|y - x W^T| <= TOL * (|x| @ |W|^T)`` elementwise against the fp32 product; NaN fails."""
    ref = w4a16_matmul_reference(x.float(), qweight, scales.float(), 4, gs).double()
    w = dequantize(qweight, scales.float(), 4, gs).double()
    bound = TOL[x.dtype] * (x.double().abs() @ w.abs().t())
    assert_within(y, ref, bound, what)


def _pair(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """16-bit values ``lo``, ``hi`` (fp16 or bf16) packed into int32 registers, ``lo`` in the low half."""
    return torch.stack([lo, hi], dim=-1).view(torch.int32).squeeze(-1)


@triton.jit
def _mma_probe(a_ptr, b_ptr, c_ptr, d_ptr, WARPS: tl.constexpr, BF16: tl.constexpr):
    """``emulated_mma`` on registers loaded per thread: a 4, b 2, c 4 values per thread, d 4 out."""
    i = tl.arange(0, 32 * WARPS)
    d = mma_rows.emulated_mma(
        tl.load(a_ptr + 4 * i),
        tl.load(a_ptr + 4 * i + 1),
        tl.load(a_ptr + 4 * i + 2),
        tl.load(a_ptr + 4 * i + 3),
        tl.load(b_ptr + 2 * i),
        tl.load(b_ptr + 2 * i + 1),
        tl.load(c_ptr + 4 * i),
        tl.load(c_ptr + 4 * i + 1),
        tl.load(c_ptr + 4 * i + 2),
        tl.load(c_ptr + 4 * i + 3),
        WARPS,
        BF16,
    )
    for j in tl.static_range(4):
        tl.store(d_ptr + 4 * i + j, d[j])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_emulated_mma_follows_the_ptx_fragments(dtype: torch.dtype) -> None:
    """``emulated_mma`` computes D = A B + C for 16x16 A, 16x8 B and 16x8 C scattered over a warp's registers as the
    PTX ISA lays out ``mma.m16n8k16`` (fp16 or bf16 A/B, fp32 C/D), for two warps with different matrices."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    warps = 2
    a = torch.randn(warps, 16, 16, generator=gen).to(dtype)
    b = torch.randn(warps, 16, 8, generator=gen).to(dtype)
    c = torch.randn(warps, 16, 8, generator=gen)
    lane = torch.arange(32)
    g, q = lane // 4, lane % 4
    regs_a, regs_b, regs_c = [], [], []
    for w in range(warps):
        A, B, C = a[w], b[w], c[w]
        regs_a.append(
            torch.stack(
                [
                    _pair(A[g, 2 * q], A[g, 2 * q + 1]),
                    _pair(A[g + 8, 2 * q], A[g + 8, 2 * q + 1]),
                    _pair(A[g, 2 * q + 8], A[g, 2 * q + 9]),
                    _pair(A[g + 8, 2 * q + 8], A[g + 8, 2 * q + 9]),
                ],
                dim=1,
            )
        )
        regs_b.append(torch.stack([_pair(B[2 * q, g], B[2 * q + 1, g]), _pair(B[2 * q + 8, g], B[2 * q + 9, g])], 1))
        regs_c.append(torch.stack([C[g, 2 * q], C[g, 2 * q + 1], C[g + 8, 2 * q], C[g + 8, 2 * q + 1]], dim=1))
    d = torch.full((32 * warps, 4), float("nan"))
    _mma_probe[(1,)](
        torch.cat(regs_a), torch.cat(regs_b), torch.cat(regs_c).float(), d, WARPS=warps, BF16=dtype == torch.bfloat16
    )
    expected = a.double() @ b.double() + c.double()
    for w in range(warps):
        got = torch.full((16, 8), float("nan"), dtype=torch.float64)
        dw = d[32 * w : 32 * (w + 1)].double()
        got[g, 2 * q], got[g, 2 * q + 1], got[g + 8, 2 * q], got[g + 8, 2 * q + 1] = dw.unbind(1)
        msg = f"seed={seed} warp {w}"
        torch.testing.assert_close(got, expected[w], rtol=1e-6, atol=1e-6, msg=lambda s, msg=msg: f"{msg}: {s}")


# (M, K, N, group, dtype, tiles, warps, splits): 1, 2, 4 and 8 row groups (partly filled ones too), every group
# kind, partial column tiles, groups split unevenly (5 groups of 64 over 3 splits), and the default launch (4 tiles,
# 4 warps)
CASES = [
    (1, 256, 48, 128, torch.bfloat16, 1, 1, 2),
    (5, 320, 80, 64, torch.float16, 2, 2, 3),
    (9, 256, 40, 32, torch.bfloat16, 1, 2, 1),
    (16, 256, 72, -1, torch.float16, 2, 1, 2),
    (16, 256, 256, 128, torch.bfloat16, 4, 4, 1),
    (27, 256, 40, 128, torch.bfloat16, 1, 2, 2),
    (64, 128, 48, 32, torch.float16, 1, 1, 1),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES, ids=[f"m{c[0]}-gs{c[3]}" for c in CASES])
def test_mma_rows_matches_reference(case: tuple) -> None:
    """The kernel within the bound of the fp32 product; the output buffer is poisoned first."""
    from salaquant.kernels.w4a16 import triton_kernels as tk

    m, k, n, group_size, dtype, tiles, warps, split = case
    seed = _seed()
    x, qweight, scales = _operands(seed, m, k, n, group_size, dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = tk.matmul_mma_rows(x, qweight, scales, 4, group_size, out=out, split_k=split, tiles=tiles, num_warps=warps)
    assert y is out
    what = f"seed={seed} M={m} K={k} N={n} gs={group_size} {dtype} tiles={tiles} warps={warps} split={split}"
    _bound_check(y, x, qweight, scales, group_size, what)
    assert not bool(arrival_counters(torch.device("cpu"), 1).any()), "a split left its arrival counter set"


@pytest.mark.interpreter
def test_mma_rows_takes_bf16_activations_past_fp16_range() -> None:
    """bf16 activations go to the tensor cores as bf16 (codes as ``c - 8``), so values beyond fp16's 65504 (and
    below its normal range) keep their precision; a conversion to fp16 would turn them into infinities."""
    from salaquant.kernels.w4a16 import triton_kernels as tk

    seed = _seed()
    x, qweight, scales = _operands(seed, 9, 256, 48, 128, torch.bfloat16)
    x = (x.float() * torch.tensor([3e5, 1e-6]).repeat(128)).to(torch.bfloat16)  # alternately huge and tiny
    y = tk.matmul_mma_rows(x, qweight, scales, 4, 128, split_k=2, tiles=1, num_warps=2)
    assert bool(torch.isfinite(y).all()), f"seed={seed}: non-finite outputs"
    _bound_check(y, x, qweight, scales, 128, f"seed={seed}")


def test_mma_rows_refuses_what_it_cannot_run() -> None:
    from salaquant.kernels.w4a16 import triton_kernels as tk

    x, qweight, scales = _operands(0, 4, 256, 64, 128, torch.float16)
    with pytest.raises(ValueError, match="1 to 64 fp16/bf16 rows"):
        tk.matmul_mma_rows(x.float(), qweight, scales)
    with pytest.raises(ValueError, match="1 to 64 fp16/bf16 rows"):
        tk.matmul_mma_rows(torch.zeros(65, 256, dtype=torch.float16), qweight, scales)
    x16, qweight16, scales16 = _operands(0, 4, 256, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="groups of a multiple of 32"):
        tk.matmul_mma_rows(x16, qweight16, scales16, 4, 16)
    with pytest.raises(ValueError, match="1 to 64 fp16/bf16 rows"):
        tk.matmul_mma_rows(x, torch.zeros(64, 64, dtype=torch.int32), scales, 8, 128)
    with pytest.raises(ValueError, match="power of two"):
        tk.matmul_mma_rows(x, qweight, scales, tiles=3)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("shape", [(4096, 32768), (16384, 4096)], ids=["gate_up", "down"])
def test_gpu_mma_rows_ptx_matches_emulation(shape: tuple[int, int], m: int) -> None:
    """The PTX on the tensor cores against the emulation of the same fragments on the same GPU (equal up to the
    order of fp32 sums), and both within the bound of the fp32 reference, at SALA shapes."""
    from salaquant.kernels.w4a16 import triton_kernels as tk

    k, n = shape
    seed = _seed()
    x, qweight, scales = _operands(seed, m, k, n, 128, torch.bfloat16, "cuda")
    got = tk.matmul_mma_rows(x, qweight, scales, 4, 128)
    emulated = tk.matmul_mma_rows(x, qweight, scales, 4, 128, emulate=True)
    what = f"seed={seed} M={m} K={k} N={n}"
    _bound_check(got.cpu(), x.cpu(), qweight.cpu(), scales.cpu(), 128, what + " PTX")
    _bound_check(emulated.cpu(), x.cpu(), qweight.cpu(), scales.cpu(), 128, what + " emulation")
    torch.testing.assert_close(got.float(), emulated.float(), rtol=2**-7, atol=1e-3, msg=lambda s: f"{what}: {s}")
    if m > 16:  # the launch `matmul` takes for 17 to 32 rows: two tiles a warp
        two = tk.matmul_mma_rows(x, qweight, scales, 4, 128, tiles=2)
        _bound_check(two.cpu(), x.cpu(), qweight.cpu(), scales.cpu(), 128, what + " PTX, 2 tiles")
        torch.testing.assert_close(two.float(), emulated.float(), rtol=2**-7, atol=1e-3, msg=lambda s: f"{what}: {s}")


def _nvfp4_operands(seed: int, m: int, k: int, n: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = quantize_nvfp4(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x.to(device), q.weight.to(device), q.weight_scale.to(device), q.weight_scale_2.to(device)


def _rows(n: int, k: int, split: int | None = None, tiles: int = 2, warps: int = 4, device: str = "cpu"):
    """The NVFP4 row kernel's launch configuration (``split`` None: its default split)."""
    from salaquant.kernels.nvfp4 import tuning as nk

    split = nk._rows_split(n, k, 16 * tiles * warps, torch.device(device)) if split is None else split
    return nk.NVFP4Config("rows", block_n=16 * tiles * warps, split_k=split, num_warps=warps, num_stages=1)


def _nvfp4_bound_check(y: torch.Tensor, x: torch.Tensor, weight, scale, s2, what: str) -> None:
    """``|y - x W^T| <= TOL * (|x| @ |W|^T)`` elementwise against the float64 product of the dequantized weight."""
    w = nvfp4_dequantize(weight.cpu(), scale.cpu(), s2.cpu()).double()
    xd = x.cpu().double()
    bound = TOL[x.dtype] * (xd.abs() @ w.abs().t())
    assert_within(y.cpu(), xd @ w.t(), bound, what)


# (M, K, N, dtype, tiles, warps, splits)
NVFP4_CASES = [
    (1, 256, 48, torch.bfloat16, 1, 1, 2),
    (7, 384, 80, torch.float16, 2, 2, 3),
    (8, 256, 64, torch.bfloat16, 2, 2, 1),
    (20, 256, 48, torch.float16, 1, 2, 2),
    (64, 128, 32, torch.bfloat16, 1, 2, 1),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", NVFP4_CASES, ids=[f"m{c[0]}-k{c[1]}" for c in NVFP4_CASES])
def test_nvfp4_mma_rows_matches_reference(case: tuple) -> None:
    """NVFP4 words ``[N, K/8]``, each pair scaled by its block's FP8 scale before the MMA and the global scale at the
    end; partial column tiles and uneven splits, the output poisoned first."""
    from salaquant.kernels.nvfp4 import triton_kernels as nk

    m, k, n, dtype, tiles, warps, split = case
    seed = _seed()
    x, weight, scale, s2 = _nvfp4_operands(seed, m, k, n, dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = nk.nvfp4_matmul_triton(x, weight, scale, s2, config=_rows(n, k, split, tiles, warps), out=out)
    assert y is out
    _nvfp4_bound_check(y, x, weight, scale, s2, f"seed={seed} M={m} K={k} N={n} {dtype} split={split}")
    assert not bool(arrival_counters(torch.device("cpu"), 1).any()), "a split left its arrival counter set"


@pytest.mark.interpreter  # CPU operands
def test_nvfp4_mma_rows_refuses_what_it_cannot_run() -> None:
    from salaquant.kernels.nvfp4 import triton_kernels as nk

    x, weight, scale, s2 = _nvfp4_operands(0, 2, 256, 32, torch.float16)
    cfg = _rows(32, 256)
    with pytest.raises(ValueError, match="1 to 64 fp16/bf16 rows"):
        nk.nvfp4_matmul_triton(x.float(), weight, scale, s2, config=cfg)
    with pytest.raises(ValueError, match="1 to 64 fp16/bf16 rows"):
        nk.nvfp4_matmul_triton(torch.zeros(65, 256, dtype=torch.float16), weight, scale, s2, config=cfg)
    x96, weight96, scale96, s296 = _nvfp4_operands(0, 2, 96, 32, torch.float16)
    with pytest.raises(ValueError, match="multiple of 128"):
        nk.nvfp4_matmul_triton(x96, weight96, scale96, s296, config=cfg)
    with pytest.raises(ValueError, match="tiles must be a power of two"):  # 64 columns cannot hold 8 warps
        nk.nvfp4_matmul_triton(x, weight, scale, s2, config=nk.NVFP4Config("rows", block_n=64, num_warps=8))


@pytest.mark.interpreter
def test_nvfp4_mma_rows_scales_bf16_activations_past_fp16_range() -> None:
    """NVFP4 rounds bf16 activations to fp16 for the MMA: a split whose activations (any row) reach 32768 converts
    them times a power of two and scales its sums back, so values of 3e5 next to 1e-6 in some rows give finite
    outputs within the bound; the other split, in range, is converted as it is."""
    from salaquant.kernels.nvfp4 import triton_kernels as nk

    seed = _seed()
    x, weight, scale, s2 = _nvfp4_operands(seed, 5, 256, 48, torch.bfloat16)
    x = x.float()
    x[1:3, :128] *= torch.tensor([3e5, 1e-6]).repeat(64)  # alternately huge and tiny, rows 1-2, first split only
    x = x.to(torch.bfloat16)
    y = nk.nvfp4_matmul_triton(x, weight, scale, s2, config=_rows(48, 256, split=2, tiles=1, warps=2))
    assert bool(torch.isfinite(y).all()), f"seed={seed}: non-finite outputs"
    _nvfp4_bound_check(y, x, weight, scale, s2, f"seed={seed} huge bf16 activations")


@pytest.mark.interpreter
def test_nvfp4_matmul_runs_the_row_kernel_by_config_and_default() -> None:
    """``NVFP4Config("rows")`` runs the row kernel through ``nvfp4_matmul_triton`` (within the bound, the split-K
    workspace poisoned); ``default_config`` picks it for 2 to ``ROWS_MAX_M`` fp16/bf16 rows of weights with at
    least ``ROWS_MIN_N`` outputs only."""
    from salaquant.kernels.nvfp4 import triton_kernels as nk

    seed = _seed()
    x, weight, scale, s2 = _nvfp4_operands(seed, 3, 384, 80, torch.float16)
    cfg = nk.NVFP4Config("rows", block_n=64, split_k=2, num_warps=2, num_stages=1)
    out = torch.full((3, 80), float("nan"), dtype=torch.float16)
    y = nk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg, out=out)
    assert y is out
    _nvfp4_bound_check(y, x, weight, scale, s2, f"seed={seed} rows config")
    with pytest.raises(ValueError, match="1 to 64 fp16/bf16 rows"):
        nk.nvfp4_matmul_triton(x.float(), weight, scale, s2, config=cfg)
    for m, n, k, dtype, kernel in (
        (2, 32768, 4096, torch.bfloat16, "rows"),  # gate_up
        (2, 12288, 4096, torch.float16, "rows"),  # lightning qkv
        (3, 32768, 4096, torch.bfloat16, "dot"),  # past ROWS_MAX_M
        (2, 4096, 16384, torch.bfloat16, "dot"),  # down: below ROWS_MIN_N
        (2, 32768, 4096, torch.float32, "dot"),
        (1, 32768, 4096, torch.bfloat16, "paired"),
    ):
        assert nk.default_config(m, n, k, "cpu", dtype).kernel == kernel, (m, n, k, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 32, 64])
@pytest.mark.parametrize("shape", [(4096, 32768), (16384, 4096)], ids=["gate_up", "down"])
def test_gpu_nvfp4_mma_rows_ptx_matches_emulation(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int], m: int):
    """NVFP4: the PTX against its emulation on the same GPU and both within the bound of the reference, at the
    default launch and split."""
    from salaquant.kernels.nvfp4 import triton_kernels as nk
    from salaquant.kernels.nvfp4 import tuning

    k, n = shape
    seed = _seed()
    x, weight, scale, s2 = _nvfp4_operands(seed, m, k, n, torch.bfloat16, "cuda")
    cfg = _rows(n, k, device="cuda")
    got = nk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg)
    monkeypatch.setattr(tuning, "_EMULATE_PAIRED", True)
    emulated = nk.nvfp4_matmul_triton(x, weight, scale, s2, config=cfg)
    what = f"seed={seed} M={m} K={k} N={n}"
    _nvfp4_bound_check(got, x, weight, scale, s2, what + " PTX")
    _nvfp4_bound_check(emulated, x, weight, scale, s2, what + " emulation")
    torch.testing.assert_close(got.float(), emulated.float(), rtol=2**-7, atol=1e-3, msg=lambda s: f"{what}: {s}")
