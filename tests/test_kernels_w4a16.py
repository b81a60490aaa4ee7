"""W4A16 GEMM: the Triton kernels against the PyTorch reference (Triton interpreter on CPU), the reference
against ``salaquant.formats.gptq_v1.packing``, and the GPU paths at SALA shapes (CUDA only)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from error_bounds import assert_within

from salaquant.formats.gptq_v1.packing import dequantize_gptq_v1, pack_gptq_v1
from salaquant.kernels.counters import arrival_counters
from salaquant.kernels.w4a16 import dequantize, w4a16_matmul, w4a16_matmul_reference

pytestmark = pytest.mark.random_inputs

GROUP_SIZES = (-1, 32, 64, 128)


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _operands(seed: int, m: int, k: int, n: int, bits: int, group_size: int, dtype: torch.dtype, device: str = "cpu"):
    """Random activations, packed words (every bit pattern) and positive fp16 scales."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else -(-k // group_size)
    qweight = torch.randint(-(2**31), 2**31, (k * bits // 32, n), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.002).to(torch.float16)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x.to(device), qweight.to(device), scales.to(device)


def _assert_close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, tol: float, what: str) -> None:
    """``|y - ref| <= tol * (|x| @ |W|^T)`` elementwise (``w`` is the fp32 ``[N, K]`` weight); NaN fails."""
    assert y.shape == ref.shape and y.dtype == ref.dtype, f"{what}: {y.shape} {y.dtype} vs {ref.shape} {ref.dtype}"
    bound = tol * (x.double().abs() @ w.double().abs().t())
    assert_within(y, ref.double(), bound, what)


TOL = {torch.float16: 3e-3, torch.float32: 1e-4}


def _poisoned(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("d", range(2), ids=["fp16", "fp32"])
@pytest.mark.parametrize("g", range(len(GROUP_SIZES)), ids=[str(gs) for gs in GROUP_SIZES])
@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_triton_matches_reference(m: int, g: int, d: int) -> None:
    """Each row count on every group size and dtype; the two shapes alternate with them, so that every pair of
    group size, dtype and shape is run at every row count."""
    from salaquant.kernels.w4a16 import triton_kernels as tk

    group_size, dtype = GROUP_SIZES[g], (torch.float16, torch.float32)[d]
    k, n = ((256, 64), (384, 192))[(g + d) % 2]
    seed = _seed()
    x, qweight, scales = _operands(seed, m, k, n, 4, group_size, dtype)
    y = tk.matmul(x, qweight, scales, 4, group_size, out=_poisoned(m, n, dtype))
    ref = w4a16_matmul_reference(x, qweight, scales, 4, group_size)
    w = dequantize(qweight, scales, 4, group_size)
    _assert_close(y, ref, x, w, TOL[dtype], f"seed={seed} M={m} K={k} N={n} gs={group_size} {dtype}")
    if m > 16:  # the tiled kernel too, whichever path the dispatch took
        y = tk.matmul_tiled(x, qweight, scales, 4, group_size, out=_poisoned(m, n, dtype))
        _assert_close(y, ref, x, w, TOL[dtype], f"seed={seed} M={m} K={k} N={n} gs={group_size} {dtype} tiled")


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 5, 33])
def test_triton_8bit(m: int) -> None:
    from salaquant.kernels.w4a16 import triton_kernels as tk

    for group_size in (-1, 64):
        seed = _seed()
        x, qweight, scales = _operands(seed, m, 384, 192, 8, group_size, torch.float16)
        y = tk.matmul(x, qweight, scales, 8, group_size, out=_poisoned(m, 192, torch.float16))
        ref = w4a16_matmul_reference(x, qweight, scales, 8, group_size)
        w = dequantize(qweight, scales, 8, group_size)
        _assert_close(y, ref, x, w, TOL[torch.float16], f"seed={seed} M={m} gs={group_size} 8-bit")
        if m > 16:
            y = tk.matmul_tiled(x, qweight, scales, 8, group_size, out=_poisoned(m, 192, torch.float16))
            _assert_close(y, ref, x, w, TOL[torch.float16], f"seed={seed} M={m} gs={group_size} 8-bit tiled")


@pytest.mark.parametrize(
    ("m", "n", "sms", "path"),
    [
        (1, 64, 4, "paired"),  # 4-bit codes, an fp16 row
        (16, 64, 4, "mma_rows"),  # 4-bit codes, fp16 activations, one group of K = 128
        (2, 64, 4, "mma_rows"),
        (17, 64, 4, "mma_rows"),  # two column tiles a warp from 17 rows
        (32, 64, 4, "mma_rows"),  # MMA_ROWS_MAX_M
        (33, 512, 4, "tiled"),
        (33, 384, 4, "tiled"),  # fewer output tiles than SMs: split along K, still the tiled kernel
        (128, 128, 4, "tiled"),  # TILED_MAX_M
        (129, 64, 4, "dequantize"),
    ],
)
def test_matmul_picks_the_path(monkeypatch: pytest.MonkeyPatch, m: int, n: int, sms: int, path: str) -> None:
    from salaquant.kernels.w4a16 import triton_kernels as tk

    class Taken(Exception):
        pass

    launches: list[dict] = []

    def spy(name: str) -> Callable[..., None]:
        def called(*args: object, **kwargs: object) -> None:
            launches.append(kwargs)
            raise Taken(name)

        return called

    monkeypatch.setattr(tk, "_sm_count", lambda device: sms)
    paths = ("paired", "gemv", "mma_rows", "flat", "tiled")
    for name in (*(f"matmul_{p}" for p in paths), "dequantize"):
        monkeypatch.setattr(tk, name, spy(name))
    x = torch.zeros(m, 128, dtype=torch.float16)
    qweight, scales = torch.zeros(16, n, dtype=torch.int32), torch.ones(1, n, dtype=torch.float16)
    with pytest.raises(Taken) as taken:
        tk.matmul(x, qweight, scales, 4, -1)
    assert str(taken.value) == (path if path == "dequantize" else f"matmul_{path}")
    if path == "paired":  # an fp32 row or 8-bit codes go to the fp32 GEMV
        q8 = torch.zeros(32, n, dtype=torch.int32)
        for xx, qw in ((x.float(), qweight), (x, q8)):
            with pytest.raises(Taken) as taken:
                tk.matmul(xx, qw, scales, 8 if qw is q8 else 4, -1)
            assert str(taken.value) == "matmul_gemv"
    if path == "mma_rows":  # groups of a multiple of 32 dividing K, or one group of K a multiple of 128
        for group in (32, 64, 128):
            with pytest.raises(Taken) as taken:
                tk.matmul(x, qweight, scales.expand(128 // group, n), 4, group)
            assert str(taken.value) == "matmul_mma_rows"
            assert (launches[-1]["tiles"], launches[-1]["num_warps"]) == ((1, 4) if m <= 16 else (2, 4))
        # one group of K = 64, fp32 rows, groups of 16 and 48, 8-bit codes: the flat kernel (tiled past 16 rows)
        other = "flat" if m <= 16 else "tiled"
        cases = [(x[:, :64], qweight[:8], -1, other), (x.float(), qweight, -1, other)]
        cases += [(x, qweight, 16, other), (x[:, :96], qweight[:12], 48, other)]
        for xx, qw, group, want in cases:
            with pytest.raises(Taken) as taken:
                tk.matmul(xx, qw, scales.expand(1 if group < 0 else xx.shape[1] // group, n), 4, group)
            assert str(taken.value) == f"matmul_{want}"
        with pytest.raises(Taken) as taken:
            tk.matmul(x, torch.zeros(32, n, dtype=torch.int32), scales, 8, -1)
        assert str(taken.value) == f"matmul_{other}"


def _variants():
    """(kernel, launch config, split_k): every scale mode and both weight-tile loaders, even and uneven splits."""
    import triton

    cfg = triton.Config
    return [
        ("gemv", cfg({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4), 1),
        ("gemv", cfg({"BLOCK_N": 128, "BLOCK_K": 128}, num_warps=4), 2),
        ("gemv", cfg({"BLOCK_N": 32, "BLOCK_K": 256}, num_warps=4), 2),
        ("tiled", cfg({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "EXPAND": False}, num_warps=4), 1),
        ("tiled", cfg({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "EXPAND": True}, num_warps=4), 5),  # 4 of 3 tiles
        ("tiled", cfg({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 256, "EXPAND": True}, num_warps=4), 2),  # K % 256
        ("tiled", cfg({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 256, "EXPAND": False}, num_warps=4), None),
    ]


@pytest.mark.interpreter
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("variant", range(7))
def test_kernel_variants(variant: int, group_size: int) -> None:
    from salaquant.kernels.w4a16 import triton_kernels as tk

    name, config, split_k = _variants()[variant]
    m = {"gemv": 1, "tiled": 21}[name]
    k, n = 384, 192
    seed = _seed()
    x, qweight, scales = _operands(seed, m, k, n, 4, group_size, torch.float16)
    out = _poisoned(m, n, torch.float16)
    if name == "tiled":
        y = tk.matmul_tiled(x, qweight, scales, 4, group_size, out=out, config=config, split_k=split_k)
    else:
        y = tk.matmul_gemv(x, qweight, scales, 4, group_size, out=out, split_k=split_k, config=config)
    ref = w4a16_matmul_reference(x, qweight, scales, 4, group_size)
    w = dequantize(qweight, scales, 4, group_size)
    _assert_close(y, ref, x, w, TOL[torch.float16], f"seed={seed} {name} {config} split_k={split_k} gs={group_size}")
    assert not bool(arrival_counters(x.device, 1).any()), "split-K counters were not reset"


@pytest.mark.interpreter
@pytest.mark.parametrize("bits", [4, 8])
def test_triton_dequantize(bits: int) -> None:
    from salaquant.kernels.w4a16 import triton_kernels as tk

    for group_size in GROUP_SIZES:
        seed = _seed()
        _, qweight, scales = _operands(seed, 1, 384, 192, bits, group_size, torch.float16)
        w = dequantize(qweight, scales, bits, group_size)
        got = tk.dequantize(qweight, scales, bits, group_size, dtype=torch.float32)
        assert torch.equal(got, w), f"seed={seed} gs={group_size}"
        got16 = tk.dequantize(qweight, scales, bits, group_size, dtype=torch.float16)
        assert torch.equal(got16, w.half()), f"seed={seed} gs={group_size} fp16"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_reference_matches_gptq_packing(bits: int, group_size: int) -> None:
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    k, n = 384, 64
    groups = 1 if group_size == -1 else k // group_size
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.05 + 1e-3).half()
    g_idx = torch.zeros(k, dtype=torch.int32) if group_size == -1 else torch.arange(k, dtype=torch.int32) // group_size
    tensors = pack_gptq_v1(codes, scales, g_idx, bits, zero=2 ** (bits - 1))
    w_gptq = dequantize_gptq_v1(tensors, bits)

    w = dequantize(tensors["qweight"], tensors["scales"], bits, group_size)
    assert torch.equal(w, w_gptq), f"seed={seed}"
    x = torch.randn(5, k, generator=gen).half()
    got = w4a16_matmul_reference(x, tensors["qweight"], tensors["scales"], bits, group_size)
    # The product in float64 against the reference's fp32 sum rounded to fp16: the error can be at most
    # the fp32 summation bound k * 2^-24 * (|x| @ |W|^T) plus half an fp16 ulp of the result (2^-11 relative,
    # 2^-25 absolute below the normal range). Any fixed tolerance is too tight where the sum cancels.
    exact = x.double() @ w_gptq.double().T
    bound = k * 2.0**-24 * (x.double().abs() @ w_gptq.double().abs().T) + exact.abs() * 2.0**-11 + 2.0**-25
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"seed={seed}: worst excess {(err - bound).max().item():.3g}"


@pytest.mark.interpreter
def test_dispatch() -> None:
    seed = _seed()
    x, qweight, scales = _operands(seed, 6, 256, 64, 4, 128, torch.float16)
    x3 = x.reshape(2, 3, 256)
    ref = w4a16_matmul_reference(x, qweight, scales).reshape(2, 3, 64)
    assert torch.equal(w4a16_matmul(x3, qweight, scales), ref)  # auto on CPU: the reference
    assert torch.equal(w4a16_matmul(x3, qweight, scales, backend="reference"), ref)
    qzeros = torch.full((2, 64 // 8), 0x77777777, dtype=torch.int32)
    g_idx = torch.arange(256, dtype=torch.int32) // 128
    y = w4a16_matmul(x3, qweight, scales, backend="triton", qzeros=qzeros, g_idx=g_idx)
    assert y.shape == (2, 3, 64)
    _assert_close(y.reshape(6, 64), ref.reshape(6, 64), x, dequantize(qweight, scales), 3e-3, f"seed={seed}")


def test_invalid_arguments() -> None:
    x, qweight, scales = _operands(0, 2, 256, 64, 4, 128, torch.float16)
    with pytest.raises(ValueError, match="backend must be one of"):
        w4a16_matmul(x, qweight, scales, backend="cuda")
    with pytest.raises(ValueError, match="bits"):
        w4a16_matmul(x, qweight, scales, bits=3)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_matmul(x, qweight, scales, group_size=12)
    with pytest.raises(ValueError, match="scales"):
        w4a16_matmul(x, qweight, scales, group_size=64)
    with pytest.raises(ValueError, match="input features"):
        w4a16_matmul(x[:, :128], qweight, scales)
    with pytest.raises(ValueError, match="g_idx"):
        w4a16_matmul(x, qweight, scales, g_idx=torch.zeros(128, dtype=torch.int32))
    with pytest.raises(ValueError, match="qweight"):
        w4a16_matmul(x, qweight.float(), scales)


# ----------------------------------------------------------------------------------------------------------------
# GPU, real SALA shapes (bf16)

SALA_SHAPES = {"gate_up": (4096, 32768), "down": (16384, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 4096])
@pytest.mark.parametrize("shape", sorted(SALA_SHAPES))
def test_gpu_sala_shapes(shape: str, m: int) -> None:
    from salaquant.kernels.w4a16 import triton_kernels as tk

    k, n = SALA_SHAPES[shape]
    seed = _seed()
    x, qweight, scales = _operands(seed, m, k, n, 4, 128, torch.bfloat16, device="cuda")
    ref = w4a16_matmul_reference(x, qweight, scales).float()
    paths = {"auto": lambda out: tk.matmul(x, qweight, scales, out=out)}
    if m > 16:
        paths["tiled"] = lambda out: tk.matmul_tiled(x, qweight, scales, out=out)
    elif m == 1:  # the fp32 GEMV beside the paired one the dispatch takes
        paths["gemv"] = lambda out: tk.matmul_gemv(x, qweight, scales, out=out)
    else:  # the flat kernel beside the row kernel the dispatch takes
        paths["flat"] = lambda out: tk.matmul_flat(x, qweight, scales, out=out)
    for name, run in paths.items():
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = run(out).float()
        assert bool(torch.isfinite(y).all()), f"seed={seed} {shape} M={m} {name}: non-finite outputs"
        rel = float((y - ref).norm() / ref.norm())
        worst = float((y - ref).abs().max() / ref.abs().max())
        assert rel < 1e-2 and worst < 3e-2, f"seed={seed} {shape} M={m} {name}: rel={rel:.3g} worst={worst:.3g}"


# ----------------------------------------------------------------------------------------------------------------
# The flat split-K kernel (``matmul_flat``): every scale mode and tail case against the reference


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [2, 7, 16])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_flat_matches_reference(m: int, group_size: int) -> None:
    from salaquant.kernels.w4a16 import triton_kernels as tk

    # K = 416 is 3.25 tiles of 128 and 6.5 of 64: partial last tile and a last split with fewer tiles.
    for k, n, block_k, tiles in [(416, 80, 64, 2), (256, 64, 128, 1), (416, 96, 128, 3)]:
        if group_size > 0 and k % group_size:
            continue
        seed = _seed()
        x, qweight, scales = _operands(seed, m, k, n, 4, group_size, torch.float16)
        y = tk.matmul_flat(
            x,
            qweight,
            scales,
            4,
            group_size,
            out=_poisoned(m, n, torch.float16),
            block_n=32,
            block_k=block_k,
            tiles=tiles,
        )
        ref = w4a16_matmul_reference(x, qweight, scales, 4, group_size)
        w = dequantize(qweight, scales, 4, group_size)
        what = f"seed={seed} M={m} K={k} N={n} gs={group_size} bk={block_k} tiles={tiles}"
        _assert_close(y, ref, x, w, TOL[torch.float16], what)


@pytest.mark.interpreter
def test_flat_8bit_and_bad_arguments() -> None:
    from salaquant.kernels.w4a16 import triton_kernels as tk

    for m in (3, 16):
        seed = _seed()
        x, qweight, scales = _operands(seed, m, 256, 64, 8, 64, torch.float16)
        y = tk.matmul_flat(x, qweight, scales, 8, 64, block_n=32, block_k=64, tiles=2)
        ref = w4a16_matmul_reference(x, qweight, scales, 8, 64)
        _assert_close(y, ref, x, dequantize(qweight, scales, 8, 64), TOL[torch.float16], f"seed={seed} 8-bit M={m}")
    x, qweight, scales = _operands(0, 2, 256, 64, 4, 128, torch.float16)
    with pytest.raises(ValueError, match="block_k"):
        tk.matmul_flat(x, qweight, scales, block_k=12)
    x17, qweight, scales = _operands(0, 17, 256, 64, 4, 128, torch.float16)
    with pytest.raises(ValueError, match="1 to 16"):
        tk.matmul_flat(x17, qweight, scales)


@pytest.mark.parametrize(
    ("tiles", "k_tiles", "sms", "split_k", "want"),
    [
        (32, 64, 132, None, 4),  # SALA o_proj at 64 rows: 32 tiles of 64 x 128, K 4096 in tiles of 64
        (256, 64, 132, None, 1),  # gate_up: the output tiles alone fill the SMs
        (1, 100, 132, None, 15),  # 16 wanted, 4+ K tiles each; 16 splits of 7 leave 15 non-empty
        (2, 6, 4, None, 1),  # fewer than 2 x 4 K tiles: not split
        (1, 8, 4, None, 2),
        (3, 12, 132, 5, 4),  # an explicit split, realised as 4 splits of 3 tiles
        (3, 2, 132, 8, 2),  # never more splits than K tiles
    ],
)
def test_tiled_split(tiles: int, k_tiles: int, sms: int, split_k: int | None, want: int) -> None:
    from salaquant.kernels.w4a16.triton_kernels import _tiled_split

    assert _tiled_split(tiles, k_tiles, sms, split_k) == want
