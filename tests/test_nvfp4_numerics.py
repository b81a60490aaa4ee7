"""NVFP4 numerics: bit-identity with ModelOpt's NVFP4QTensor, E2M1 rounding, packing, block-scale search."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from salaquant.formats.modelopt_nvfp4.numerics import (
    BLOCK,
    E2M1_GRID,
    FP8_MAX,
    FP8_MIN_SCALE,
    NVFP4Weight,
    block_codes,
    block_round,
    block_scales,
    dequant_blocks,
    e2m1_codes,
    e2m1_round,
    e2m1_values,
    global_scale,
    input_scale,
    pack_nibbles,
    quantize_activations,
    quantize_nvfp4,
    round_block_scales,
    unpack_nibbles,
)
from salaquant.nvfp4.search import search_block_scales, searched_global_scale, shrink_factors


@pytest.fixture(scope="module")
def mo() -> Any:
    """ModelOpt's ``NVFP4QTensor`` class (its pure-torch CPU path)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    return NVFP4QTensor


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a float8 / fp32 tensor, for bitwise comparison (NaN included)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t.float().reshape(-1).view(torch.int32)


def _normal(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g) * 0.02


def _heavy(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Gaussian scale mixture with log-normal scales: many blocks dominated by one large outlier."""
    return torch.randn(shape, generator=g) * torch.exp(2.0 * torch.randn(shape, generator=g)) * 0.01


def _with_specials(w: torch.Tensor) -> torch.Tensor:
    """Add an all-zero block, an all-zero row, a block far below the global amax (scale clamped to 2**-9),
    a block holding the global amax, and a block with exact +-0.0 values."""
    w = w.clone()
    amax = float(w.abs().max())
    w[1, BLOCK : 2 * BLOCK] = 0.0
    w[3, :] = 0.0
    w[5, 0:BLOCK] = torch.linspace(-1.0, 1.0, BLOCK) * amax * 1e-7
    w[6, BLOCK : 2 * BLOCK] = torch.linspace(-1.0, 1.0, BLOCK) * amax * 3.0
    w[7, 0:BLOCK] = torch.tensor([0.0, -0.0] * (BLOCK // 2))
    w[7, 1] = -amax
    return w


Gen = Callable[[tuple[int, int], torch.Generator], torch.Tensor]
CASES: list[tuple[tuple[int, int], torch.dtype, Gen]] = [
    ((64, 128), torch.bfloat16, _normal),
    ((64, 128), torch.float32, _heavy),
    ((48, 256), torch.float32, _normal),
    ((48, 256), torch.bfloat16, _heavy),
]


def _assert_same_as_modelopt(mo: Any, w: torch.Tensor, s2: torch.Tensor | None) -> None:
    ref_q, ref_scale, ref_s2 = mo.quantize(w.clone(), BLOCK, weights_scaling_factor_2=s2)
    ours = quantize_nvfp4(w, weight_scale_2=s2)
    assert ours.weight.dtype == torch.uint8 and ours.weight.shape == (w.shape[0], w.shape[1] // 2)
    assert ours.weight_scale.dtype == torch.float8_e4m3fn and ours.weight_scale.shape == (w.shape[0], w.shape[1] // 16)
    assert ours.weight_scale_2.dtype == torch.float32 and ours.weight_scale_2.dim() == 0
    assert torch.equal(ours.weight, ref_q._quantized_data)
    assert torch.equal(_bits(ours.weight_scale), _bits(ref_scale))
    assert torch.equal(_bits(ours.weight_scale_2), _bits(ref_s2))
    ref_deq = ref_q.dequantize(dtype=torch.float32, scale=ref_scale, double_scale=ref_s2, block_sizes={-1: BLOCK})
    torch.testing.assert_close(ours.dequantize(), ref_deq, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(("shape", "dtype", "gen"), CASES)
def test_bit_identical_to_modelopt_own_global_scale(
    mo: Any, shape: tuple[int, int], dtype: torch.dtype, gen: Gen
) -> None:
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    w = _with_specials(gen(shape, g)).to(dtype)
    _assert_same_as_modelopt(mo, w, None)
    assert int(unpack_nibbles(quantize_nvfp4(w).weight).max()) <= 15


@pytest.mark.parametrize(("shape", "dtype", "gen"), CASES)
@pytest.mark.parametrize("ratio", [3.7, 1.0, 0.4])
def test_bit_identical_to_modelopt_shared_global_scale(
    mo: Any, shape: tuple[int, int], dtype: torch.dtype, gen: Gen, ratio: float
) -> None:
    """A given ``weight_scale_2`` (from a fused group's max amax; ratio < 1 also forces the 448 clamp)."""
    g = torch.Generator().manual_seed(shape[1] * 3 + shape[0])
    w = _with_specials(gen(shape, g)).to(dtype)
    s2 = global_scale(w.abs().amax().float() * ratio)
    _assert_same_as_modelopt(mo, w, s2)
    ours = quantize_nvfp4(w, weight_scale_2=s2)
    assert ours.weight_scale_2 is not s2 and torch.equal(_bits(ours.weight_scale_2), _bits(s2))
    if ratio < 1:
        assert (ours.weight_scale.float() == FP8_MAX).any()


def test_bit_identical_to_modelopt_all_zero_tensor(mo: Any) -> None:
    """amax 0: weight_scale_2 is 0 and the block scales 0/0, exactly as ModelOpt."""
    w = torch.zeros(4, 32)
    _assert_same_as_modelopt(mo, w, None)
    q = quantize_nvfp4(w)
    assert float(q.weight_scale_2) == 0.0
    assert bool(q.weight_scale.float().isnan().all())
    assert float(global_scale(0.0)) == 0.0


def test_scales_and_codes_match_modelopt_helpers(mo: Any) -> None:
    g = torch.Generator().manual_seed(5)
    w = _with_specials(_heavy((16, 64), g))
    s2 = global_scale(w.abs().amax())
    assert torch.equal(_bits(s2), _bits(mo.get_weights_scaling_factor_2(w)))
    ref_scale, _ = mo.get_weights_scaling_factor(w, BLOCK, s2)
    assert torch.equal(_bits(block_scales(w, s2)), _bits(ref_scale))
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([mids, -mids, torch.randn(4096, generator=g) * 4, torch.tensor([0.0, -0.0, 6.0, 7.0, 1e30])])
    x = torch.cat([x, torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 9.0))])
    assert torch.equal(e2m1_codes(x), mo._cast_fp4(x.clone()))


def _modelopt_activations(mo: Any, x: torch.Tensor, s_in: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4 quantization of activations ``x [..., in]`` against the static ``input_scale`` (its
    per-tensor scale), dequantized in fp32."""
    flat = x.reshape(-1, x.shape[-1]).clone()
    q, scale, s2 = mo.quantize(flat, BLOCK, weights_scaling_factor_2=s_in)
    return q.dequantize(dtype=torch.float32, scale=scale, double_scale=s2, block_sizes={-1: BLOCK}).reshape(x.shape)


def _activations(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Heavy-tailed activations with a few outlier channels (what SALA's norms feed the linears), plus an all-zero
    token, an all-zero block, a block far below the rest and exact +-0.0 values."""
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[-1], generator=g))
    x[..., 5] *= 40.0
    x = x.reshape(-1, shape[-1])
    x[0] = 0.0
    x[1, BLOCK : 2 * BLOCK] = 0.0
    x[2, :BLOCK] *= 1e-6
    x[3, :BLOCK:2] = -0.0
    return x.reshape(shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("calibrated", [1.0, 0.25, 3.0])
@pytest.mark.parametrize("shape", [(24, 64), (2, 7, 128)])
def test_activation_quantization_bit_identical_to_modelopt(
    mo: Any, dtype: torch.dtype, calibrated: float, shape: tuple[int, ...]
) -> None:
    """Against ModelOpt with the same global amax: the calibrated amax as measured (1.0), below the tokens'
    (0.25: blocks above the calibrated range saturate the FP8 scale at 448 and their codes at 6) and above it."""
    g = torch.Generator().manual_seed(len(shape) * 100 + int(calibrated * 4))
    x = _activations(shape, g).to(dtype)
    s_in = input_scale(x.abs().amax().float() * calibrated)
    ours = quantize_activations(x, s_in)
    assert ours.dtype == dtype and ours.shape == x.shape
    ref = _modelopt_activations(mo, x, s_in)
    torch.testing.assert_close(ours.float(), ref.to(dtype).float(), rtol=0, atol=0)
    assert torch.equal(quantize_activations(x.float(), s_in), ref)  # in fp32 the values themselves, unrounded
    flat = x.float().reshape(-1, x.shape[-1])
    assert bool((quantize_activations(flat, s_in)[0] == 0).all())  # the all-zero token stays zero
    if calibrated < 1:
        top = flat.abs().amax()
        assert float(quantize_activations(flat, s_in).abs().amax()) == pytest.approx(6 * 448 * float(s_in))
        assert float(top) > 6 * 448 * float(s_in)  # values above the calibrated range clip at 6 * 448 * input_scale


def test_activation_quantization_by_hand() -> None:
    """One block, input_scale 2**-8 (calibrated amax 10.5): block amax 6 -> FP8 scale 256 -> step exactly 1, so
    the midpoints are exact ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4."""
    vals = [6.0, -3.0, 0.25, 0.75, 2.5, -3.5, 0.0, 5.0, 1.25, 1.75, -0.25, 5.5, 0.0, 0.0, 0.0, 0.0]
    want = [6.0, -3.0, 0.0, 1.0, 2.0, -4.0, 0.0, 4.0, 1.0, 2.0, -0.0, 6.0, 0.0, 0.0, 0.0, 0.0]
    got = quantize_activations(torch.tensor([vals]), 2.0**-8)
    assert torch.equal(got, torch.tensor([want]))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_activations(torch.zeros(2, 24), 0.1)
    with pytest.raises(ValueError, match="positive finite"):
        quantize_activations(torch.zeros(2, 16), 0.0)


def test_block_scale_clamps_and_zero_blocks() -> None:
    w = torch.zeros(1, 64)
    w[0, 16:32] = 1e-9
    w[0, 32:48] = 1.0
    w[0, 48:64] = 50.0
    s = block_scales(w, torch.tensor(1.0 / 448 / 6 * 2)).float()  # block scale = amax * 224
    assert s.tolist() == [[1.0, FP8_MIN_SCALE, 224.0, FP8_MAX]]
    half = block_scales(w, torch.tensor(1.0 / 6), shrink=torch.tensor([[1.0, 1.0, 0.5, 0.5]])).float()
    assert half.tolist() == [[1.0, FP8_MIN_SCALE, 0.5, 24.0]]  # 25 ties to even 24 in E4M3


def test_global_and_input_scale() -> None:
    assert global_scale(2688.0).dtype == torch.float32
    assert float(global_scale(2688.0)) == 1.0
    assert float(global_scale(torch.tensor(5.376, dtype=torch.bfloat16))) == pytest.approx(5.376 / 2688, rel=1e-2)
    assert float(input_scale(torch.tensor(13.44))) == pytest.approx(0.005, rel=1e-6)
    assert input_scale(1.0).dtype == torch.float32


def test_e2m1_round_to_nearest_even_by_hand() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, float("inf")])
    assert e2m1_values(e2m1_codes(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]
    assert e2m1_codes(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7]
    assert e2m1_codes(-x).tolist() == [8, 10, 10, 12, 12, 14, 14, 15, 15]
    off = torch.tensor([0.2, 0.3, 0.6, 1.3, 1.6, 2.6, 3.4, 4.9, 5.1, 6.0])
    assert e2m1_values(e2m1_codes(off)).tolist() == [0.0, 0.5, 0.5, 1.5, 1.5, 3.0, 3.0, 4.0, 6.0, 6.0]
    assert e2m1_codes(torch.tensor([0.0, -0.0, -0.1, -0.25, -0.26])).tolist() == [0, 0, 8, 8, 9]
    assert e2m1_codes(torch.tensor([-0.75, -5.0], dtype=torch.bfloat16)).tolist() == [10, 14]
    assert e2m1_codes(torch.tensor([1.0])).dtype == torch.uint8


def _nearest_grid_index(x: torch.Tensor) -> torch.Tensor:
    """Grid index of the nearest E2M1 magnitude of fp32 ``x`` by distance to every grid value in fp64, ties to the
    even index, saturating (NaN to the largest): the format's definition, written independently of numerics."""
    a = x.double().abs().nan_to_num(nan=7.0).clamp(max=7.0)  # past 6 (NaN too) the nearest is 6
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    dist = (a[:, None] - grid[None, :]).abs()
    least = dist.min(dim=1, keepdim=True).values
    tied = dist == least
    even = tied & (torch.arange(8) % 2 == 0)
    return torch.where(even.any(dim=1), even.int().argmax(dim=1), tied.int().argmax(dim=1))


def test_e2m1_codes_and_round_against_the_nearest_grid_value() -> None:
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 2.0, 4.0, 6.0, 0.5])
    up, down = torch.tensor(float("inf")), torch.tensor(-float("inf"))
    special = torch.tensor([0.0, -0.0, 1e-45, 3e38, float("inf"), -float("inf"), float("nan"), 7.0, -7.0])
    x = torch.cat(
        [
            midpoints, -midpoints, torch.nextafter(midpoints, up), torch.nextafter(midpoints, down),
            -torch.nextafter(midpoints, up), special, torch.linspace(-9.0, 9.0, 20_001),
            torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4,
        ]
    )  # fmt: skip
    codes = e2m1_codes(x)
    index = _nearest_grid_index(x)
    negative = (x < 0).to(torch.uint8)
    assert torch.equal(codes & 7, index.to(torch.uint8))
    assert torch.equal(codes >> 3, negative)
    decoded = e2m1_values(codes)
    rounded = e2m1_round(x)
    assert torch.equal(rounded.view(torch.int32), decoded.view(torch.int32))  # every bit, signed zeros included
    assert torch.equal(e2m1_codes(x.double() / 3), e2m1_codes((x.double() / 3).float()))  # rounds as fp32


def test_block_round_is_the_decoded_codes() -> None:
    g = torch.Generator().manual_seed(1)
    wb = torch.randn(6, 5, BLOCK, generator=g) * torch.exp(torch.randn(6, 5, 1, generator=g))
    wb[0, 0] = 0.0
    scale = block_scales(wb.reshape(6, -1), 0.01).float()
    s2 = torch.tensor(0.01)
    got, want = block_round(wb, scale, s2), dequant_blocks(block_codes(wb, scale, s2), scale, s2)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    zero = block_round(torch.zeros(1, 1, BLOCK), torch.ones(1, 1), torch.tensor(0.0))  # 0 / 0 saturates, times 0
    assert torch.equal(zero, torch.zeros(1, 1, BLOCK))


def test_e2m1_grid_values() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    grid = list(E2M1_GRID)
    assert e2m1_values(codes).tolist() == grid + [-v for v in grid]
    assert torch.equal(e2m1_codes(e2m1_values(codes))[:8], codes[:8])


def test_pack_nibble_order_and_round_trip() -> None:
    assert pack_nibbles(torch.tensor([[1, 2]], dtype=torch.uint8)).tolist() == [[0x21]]
    assert pack_nibbles(torch.tensor([15, 0, 0, 15], dtype=torch.uint8)).tolist() == [0x0F, 0xF0]
    assert unpack_nibbles(torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)).tolist() == [[1, 2, 0, 15]]
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32)
    assert torch.equal(unpack_nibbles(packed), codes)
    with pytest.raises(ValueError, match="odd"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


def test_quantize_and_dequantize_by_hand() -> None:
    b0 = [6.0, 3.0, -1.5, 0.0, 0.5, 1.0, 2.0, 4.0, -6.0, -0.5, 1.5, -3.0, -4.0, -2.0, -1.0, 0.0]
    b1 = [1.5, 0.125, 0.3, -0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0]
    w = torch.tensor([b0 + b1])
    q = quantize_nvfp4(w, weight_scale_2=torch.tensor(0.5))
    # block scale = amax / (6 * 0.5): 2.0 and 0.5; divisors scale * 0.5 = 1.0 and 0.25
    assert q.weight_scale.float().tolist() == [[2.0, 0.5]]
    assert float(q.weight_scale_2) == 0.5
    codes = unpack_nibbles(q.weight)[0].tolist()
    assert codes[:16] == [7, 5, 11, 0, 1, 2, 4, 6, 15, 9, 3, 13, 14, 12, 10, 0]
    assert codes[16:20] == [7, 1, 2, 10] and codes[31] == 14
    deq = q.dequantize()[0].tolist()
    assert deq[:16] == b0
    assert deq[16:20] == [1.5, 0.125, 0.25, -0.25] and deq[31] == -1.0
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16

    hand = NVFP4Weight(
        weight=pack_nibbles(torch.tensor([[3, 13] + [0] * 14], dtype=torch.uint8)),
        weight_scale=torch.tensor([[0.375]]).to(torch.float8_e4m3fn),
        weight_scale_2=torch.tensor(0.1),
    )
    f32 = torch.float32
    s = torch.tensor(0.375, dtype=f32) * torch.tensor(0.1, dtype=f32)
    assert hand.shape == (1, 16)
    assert hand.dequantize()[0, :2].tolist() == [float(1.5 * s), float(-3.0 * s)]


def test_quantize_uses_given_block_scale_and_validates() -> None:
    w = torch.randn(4, 32)
    s2 = global_scale(w.abs().amax())
    plain = quantize_nvfp4(w)
    assert torch.equal(quantize_nvfp4(w, s2, plain.weight_scale).weight, plain.weight)
    shrunk = block_scales(w, s2, shrink=torch.full((4, 2), 0.5))
    assert torch.equal(_bits(quantize_nvfp4(w, s2, shrunk).weight_scale), _bits(shrunk))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(4, 40))
    with pytest.raises(ValueError, match="2-D"):
        quantize_nvfp4(torch.randn(32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        quantize_nvfp4(w, s2, plain.weight_scale.float())
    with pytest.raises(ValueError, match="shape"):
        quantize_nvfp4(w, s2, plain.weight_scale[:2])
    with pytest.raises(ValueError, match="scalar"):
        quantize_nvfp4(w, torch.ones(2))


def _weighted_block_err(w: torch.Tensor, q: NVFP4Weight, imp: torch.Tensor) -> torch.Tensor:
    """fp32 ``sum (w - w_hat)^2 * imp`` per 16-element block, ``[out, in / 16]``."""
    out, n = w.shape
    d = (w.float() - q.dequantize()).reshape(out, n // BLOCK, BLOCK)
    return (d**2 * imp.float().reshape(1, n // BLOCK, BLOCK)).sum(dim=-1)


@pytest.mark.parametrize("max_grow", [1.0, 1.5])
def test_search_never_increases_weighted_error(max_grow: float) -> None:
    g = torch.Generator().manual_seed(11)
    for trial in range(24):
        gen = _heavy if trial % 2 else _normal
        w = gen((8, 64), g)
        if trial % 3 == 0:
            w = w.to(torch.bfloat16)
        imp = torch.rand(64, generator=g) ** (1 + trial % 4) * 10
        if trial % 5 == 0:
            imp[::3] = 0.0
        s2 = global_scale(w.abs().amax().float() * (1.0 + trial % 3))
        res = search_block_scales(w, s2, imp, iters=20, max_grow=max_grow)
        assert res.scales.dtype == torch.float8_e4m3fn and res.scales.shape == (8, 4)
        plain = quantize_nvfp4(w, s2)
        searched = quantize_nvfp4(w, s2, res.scales)
        err_plain = _weighted_block_err(w, plain, imp)
        err_searched = _weighted_block_err(w, searched, imp)
        assert bool((err_searched <= err_plain).all())
        assert res.error_searched <= res.error_plain
        assert res.error_plain == pytest.approx(float(err_plain.double().sum()), rel=1e-6)
        assert res.error_searched == pytest.approx(float(err_searched.double().sum()), rel=1e-6)
        raw = w.float().abs().reshape(8, 4, BLOCK).amax(dim=-1) / (6 * s2)
        top = round_block_scales(raw * max_grow)  # the plain scale itself for max_grow 1
        assert bool((res.scales.float() <= top.float()).all())


def test_search_strictly_improves_heavy_tailed() -> None:
    g = torch.Generator().manual_seed(3)
    w = _heavy((32, 128), g)
    imp = torch.exp(2.0 * torch.randn(128, generator=g))
    res = search_block_scales(w, global_scale(w.abs().amax()), imp)
    assert res.error_searched < 0.95 * res.error_plain
    plain = block_scales(w, global_scale(w.abs().amax()))
    assert bool((res.scales.float() < plain.float()).any())


def _search_every_factor(
    w: torch.Tensor, s2: torch.Tensor, imp: torch.Tensor, iters: int, max_shrink: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force through the public API: quantize with every factor's scales, keep each block's first least
    error. Returns (scale bits, per-block error)."""
    best_bits = best_err = torch.empty(0)
    for t, f in enumerate(shrink_factors(iters, max_shrink)):
        scales = block_scales(w, s2, shrink=torch.tensor(f))
        err = _weighted_block_err(w, quantize_nvfp4(w, s2, scales), imp)
        if t == 0:
            best_bits, best_err = _bits(scales).clone(), err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_bits = torch.where(better, _bits(scales), best_bits)
    return best_bits, best_err


@pytest.mark.parametrize(("iters", "max_shrink"), [(80, 0.6), (200, 0.3), (41, 0.5), (9, 0.6)])
def test_search_equals_trying_every_factor(iters: int, max_shrink: float) -> None:
    """The search over FP8 values (fine factor grids) and the factor loop (coarse ones) both give exactly the
    brute-force choice: normal and heavy-tailed weights, zero and tiny blocks (subnormal and clamped scales),
    global scales that make large blocks clamp at 448, zero importances."""
    g = torch.Generator().manual_seed(21 + iters)
    for trial in range(6):
        w = _with_specials((_heavy if trial % 2 else _normal)((12, 96), g))
        if trial % 3 == 2:
            w = w.to(torch.bfloat16)
        imp = torch.rand(96, generator=g) * 5
        imp[:: 4 + trial] = 0.0
        imp[2 * BLOCK : 3 * BLOCK] = 0.0  # a block whose every scale scores 0: the plain one must stay
        s2 = global_scale(w.abs().amax().float()) / (1.0 if trial < 3 else 40.0)  # / 40: scales clamp at 448
        want_bits, want_err = _search_every_factor(w, s2, imp, iters, max_shrink)
        res = search_block_scales(w, s2, imp, iters=iters, max_shrink=max_shrink, max_grow=1.0)
        assert torch.equal(_bits(res.scales), want_bits), trial
        assert res.error_searched == pytest.approx(float(want_err.double().sum()), rel=1e-6, abs=1e-30)


def test_search_tries_each_fp8_value_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """80 factors over 1.0-0.4 reach about 12 FP8 values per block: that many passes, not 80."""
    import salaquant.nvfp4.search as search

    calls = []
    real = search._scale_error
    monkeypatch.setattr(search, "_scale_error", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(5)
    w = _heavy((16, 128), g)
    imp = torch.rand(128, generator=g)
    search_block_scales(w, global_scale(w.abs().amax()), imp, iters=80, max_shrink=0.6, max_grow=1.0)
    assert 10 <= len(calls) <= 14  # 8 E4M3 steps per octave over log2(1 / 0.4) = 1.3 octaves, plus the plain one
    shrunk = len(calls)
    calls.clear()
    search_block_scales(w, searched_global_scale(w.abs().amax(), 1.5), imp, iters=80, max_shrink=0.6, max_grow=1.5)
    assert shrunk + 4 <= len(calls) <= shrunk + 6  # and log2(1.5) = 0.58 octaves above the plain scale
    calls.clear()
    search_block_scales(w, global_scale(w.abs().amax()), imp, iters=9, max_shrink=0.6, max_grow=1.0)
    assert len(calls) == 9  # too coarse to reach every FP8 value: every factor


def test_search_one_iter_is_plain() -> None:
    g = torch.Generator().manual_seed(4)
    w = _with_specials(_heavy((16, 64), g))
    s2 = global_scale(w.abs().amax())
    res = search_block_scales(w, s2, torch.rand(64, generator=g), iters=1, max_grow=1.0)
    assert torch.equal(_bits(res.scales), _bits(block_scales(w, s2)))
    assert res.error_searched == res.error_plain
    zero_shrink = search_block_scales(w, s2, torch.rand(64, generator=g), iters=7, max_shrink=0.0, max_grow=1.0)
    assert torch.equal(_bits(zero_shrink.scales), _bits(block_scales(w, s2)))


def test_shrink_factors_and_validation() -> None:
    assert shrink_factors(1, 0.6) == [1.0]
    f = shrink_factors(4, 0.6)
    assert f[0] == 1.0 and f[-1] == pytest.approx(0.4) and len(f) == 4
    w = torch.randn(2, 32)
    with pytest.raises(ValueError, match="iters"):
        search_block_scales(w, 1.0, torch.ones(32), iters=0)
    with pytest.raises(ValueError, match="max_shrink"):
        search_block_scales(w, 1.0, torch.ones(32), max_shrink=1.0)
    with pytest.raises(ValueError, match="max_grow"):
        search_block_scales(w, 1.0, torch.ones(32), max_grow=0.9)
    with pytest.raises(ValueError, match="max_grow"):
        searched_global_scale(torch.tensor(1.0), 0.5)
    assert float(searched_global_scale(torch.tensor(2688.0), 1.5)) == 1.5  # amax / (6 * 448) * max_grow
    with pytest.raises(ValueError, match="shape"):
        search_block_scales(w, 1.0, torch.ones(16))
    with pytest.raises(ValueError, match=">= 0"):
        search_block_scales(w, 1.0, -torch.ones(32))


def _ref_round(a: float) -> float:
    """Nearest E2M1 magnitude to ``a >= 0``, ties to the even grid index, saturating at 6."""
    if a >= E2M1_GRID[-1]:
        return E2M1_GRID[-1]
    dists = [abs(a - v) for v in E2M1_GRID]
    best = min(dists)
    idx = [i for i, d in enumerate(dists) if d == best]
    return E2M1_GRID[idx[0] if len(idx) == 1 else next(i for i in idx if i % 2 == 0)]


_E4M3_POSITIVE = list(torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn))
"""Every positive finite float8_e4m3fn value, in increasing order."""


def _ref_search(
    w: torch.Tensor, s2: torch.Tensor, imp: torch.Tensor, iters: int, max_shrink: float, max_grow: float = 1.0
) -> torch.Tensor:
    """Per-block, per-factor loop of the block-scale search, then every FP8 value above the plain scale up to
    ``max_grow`` times it, smallest first; float8 scales ``[out, in / 16]``."""
    out, n = w.shape
    w = w.float()
    result = torch.empty(out, n // BLOCK, dtype=torch.float8_e4m3fn)
    for r in range(out):
        for b in range(n // BLOCK):
            blk = w[r, b * BLOCK : (b + 1) * BLOCK]
            ib = imp[b * BLOCK : (b + 1) * BLOCK].float()
            raw = blk.abs().max() / (6.0 * s2)
            best_s, best_e = None, None

            def fp8(c: torch.Tensor) -> torch.Tensor:
                c = torch.ones_like(c) if float(c) == 0.0 else c
                return c.clamp(FP8_MIN_SCALE, FP8_MAX).to(torch.float8_e4m3fn)

            plain, top = fp8(raw), fp8(raw * max_grow)
            grown = [v for v in _E4M3_POSITIVE if float(plain.float()) < float(v.float()) <= float(top.float())]
            shrunk = [fp8(raw * (1.0 - max_shrink * t / (iters - 1) if iters > 1 else 1.0)) for t in range(iters)]
            for s in shrunk + grown:
                div = s.float() * s2
                scaled = blk / div
                w_hat = torch.tensor([_ref_round(abs(float(v))) * (-1 if v < 0 else 1) for v in scaled]) * div
                e = ((blk - w_hat) ** 2 * ib).sum()
                if best_e is None or float(e) < float(best_e):
                    best_s, best_e = s, e
            result[r, b] = best_s
    return result


def test_search_matches_per_block_reference() -> None:
    g = torch.Generator().manual_seed(8)
    w = _with_specials(_heavy((8, 48), g))
    imp = torch.rand(48, generator=g) * torch.exp(torch.randn(48, generator=g))
    s2 = global_scale(w.abs().amax())
    for max_grow in (1.0, 1.5):
        res = search_block_scales(w, s2, imp, iters=12, max_shrink=0.6, max_grow=max_grow)
        assert torch.equal(_bits(res.scales), _bits(_ref_search(w, s2, imp, 12, 0.6, max_grow))), max_grow
        assert res.error_searched < res.error_plain


def test_grown_scale_by_hand() -> None:
    """One block: 6 then fifteen 5s, global scale 1 (plain block scale 1). By hand, importance 1: the plain scale
    puts every 5 on 4 (a tie, to the even index): error 15. Shrunk scales do best at 0.875 (6 -> 6.86 -> 6 x 0.875
    = 5.25, each 5 -> 5.71 -> 5.25): 0.5625 + 15 x 0.0625 = 1.5. Grown ones: 1.25 puts each 5 on 4 exactly and 6
    on 4.8 -> 4 (5.0): error 1.0; 1.5 gives 6 exactly and each 5 at 4.5: 3.75. The search with growth takes 1.25,
    error 1.0; without it 0.875, error 1.5."""
    w = torch.tensor([[6.0] + [5.0] * 15])
    imp = torch.ones(16)
    grown = search_block_scales(w, 1.0, imp, iters=80, max_shrink=0.6, max_grow=1.5)
    assert float(grown.scales.float()) == 1.25
    assert grown.error_searched == pytest.approx(1.0) and grown.error_plain == pytest.approx(15.0)
    shrunk = search_block_scales(w, 1.0, imp, iters=80, max_shrink=0.6, max_grow=1.0)
    assert float(shrunk.scales.float()) == 0.875 and shrunk.error_searched == pytest.approx(1.5)


def test_grown_scale_reaches_its_largest_candidate() -> None:
    """A block that E2M1 fits exactly at 1.5 times its plain scale (global scale 1, plain block scale 1): 1.5 x
    [4, 3, 2, 1.5, 1, 0.5, 0...]. Scale 1.5 gives error 0; the plain 1 puts 4.5 between 4 and 6, and 1.125 to
    1.375 put 6 off the grid, so with ``max_grow`` 1.5 the search must try its last grown value and keep it."""
    w = torch.tensor([[6.0, 4.5, 3.0, 2.25, 1.5, 0.75] + [0.0] * 10])
    found = search_block_scales(w, 1.0, torch.ones(16), iters=80, max_shrink=0.6, max_grow=1.5)
    assert float(found.scales.float()) == 1.5 and found.error_searched == 0.0 and found.error_plain > 0.0


def test_grown_scales_are_the_least_error_in_range() -> None:
    """Against every positive FP8 value scored one by one: the search's scale is one whose error is the least among
    the values from the smallest factor's scale to ``max_grow`` times the plain one (global scales with the
    search's headroom and without it, where the largest blocks' grown scales clamp at 448)."""
    g = torch.Generator().manual_seed(31)
    values = torch.stack(_E4M3_POSITIVE).float()
    for trial in range(4):
        w = (_heavy if trial % 2 else _normal)((6, 64), g)
        imp = torch.rand(64, generator=g) * 3
        s2 = searched_global_scale(w.abs().amax(), 1.5) if trial < 2 else global_scale(w.abs().amax())
        res = search_block_scales(w, s2, imp, iters=80, max_shrink=0.6, max_grow=1.5)
        wb = w.reshape(6, 4, BLOCK)
        raw = wb.abs().amax(dim=-1) / (6 * s2)
        lo, top = round_block_scales(raw * 0.4).float(), round_block_scales(raw * 1.5).float()
        step = values[:, None, None, None] * s2  # [126, out, nb, 1]
        w_hat = (
            torch.tensor(
                [
                    [[_ref_round(abs(v)) for v in row] for row in cand]
                    for cand in (wb[None] / step).reshape(126, 6, 64).tolist()
                ]
            ).reshape(126, 6, 4, BLOCK)
            * wb.sign()[None]
            * step
        )
        err = ((wb[None] - w_hat) ** 2 * imp.reshape(1, 1, 4, BLOCK)).sum(dim=-1)  # [126, out, nb]
        allowed = (values[:, None, None] >= lo[None]) & (values[:, None, None] <= top[None])
        least = torch.where(allowed, err, torch.inf).amin(dim=0)
        chosen = _weighted_block_err(w, quantize_nvfp4(w, s2, res.scales), imp)
        assert bool(((res.scales.float() >= lo) & (res.scales.float() <= top)).all()), trial
        torch.testing.assert_close(chosen, least, rtol=1e-5, atol=1e-12)
