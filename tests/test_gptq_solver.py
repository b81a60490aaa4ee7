"""Tests for salaquant.gptq.solver: grid, RTN, GPTQ against a column-by-column reference, damping, MSE."""

from __future__ import annotations

import pytest
import torch

from salaquant.gptq.solver import (
    GPTQConfig,
    gptq,
    mse_scales,
    quantize_codes,
    relative_output_error,
    rtn,
    symmetric_scales,
    weighted_error,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _correlated_hessian(n: int, seed: int, tokens: int = 512) -> torch.Tensor:
    """X^T X for X = Z @ A: inputs with strongly correlated columns and uneven channel scales."""
    g = _gen(seed)
    z = torch.randn(tokens, n, generator=g)
    a = torch.randn(n, n, generator=g) / n**0.5 + 0.5 * torch.eye(n)
    x = (z @ a) * torch.rand(n, generator=g).add(0.2)
    return x.T @ x


def _reference_gptq(
    w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int, act_order: bool, damp: float = 0.01
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow float64 GPTQ: one column at a time, full inverse downdated after each elimination (OBS update)."""
    w = w.double().clone()
    h = h.double().clone()
    n = w.shape[1]
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    gs = n if group_size == -1 else group_size
    zero, maxq = 2 ** (bits - 1), 2**bits - 1

    def scale_of(cols: torch.Tensor) -> torch.Tensor:
        # exact in bfloat16 and float16: round to bfloat16 (8 significant bits), then store as float16
        return (2 * cols.abs().amax(1) / maxq).clamp(min=2**-14).bfloat16().half().double()

    static = [scale_of(w[:, g : g + gs]) for g in range(0, n, gs)]
    order = torch.argsort(torch.diag(h), descending=True, stable=True).tolist() if act_order else list(range(n))
    hinv = torch.linalg.inv(h + damp * torch.diag(h).mean() * torch.eye(n, dtype=torch.float64))
    codes = torch.zeros(w.shape, dtype=torch.int32)
    w_hat = torch.zeros_like(w)
    s = static[0]
    for col in order:
        if act_order:
            s = static[col // gs]
        elif col % gs == 0:
            s = scale_of(w[:, col : col + gs])
        q = torch.clamp(torch.round(w[:, col] / s) + zero, 0, maxq)
        codes[:, col] = q.int()
        w_hat[:, col] = (q - zero) * s
        err = w[:, col] - w_hat[:, col]
        w -= torch.outer(err / hinv[col, col], hinv[col])
        hinv -= torch.outer(hinv[:, col], hinv[col]) / hinv[col, col]
    return codes, w_hat


# --- grid ---------------------------------------------------------------------------------------------------------


def test_symmetric_grid_by_hand() -> None:
    w = torch.tensor([[-1.0, 0.5, 0.25, 1.0]])
    scale = symmetric_scales(w, 4)
    assert scale.dtype == torch.float16
    # 2/15 = 0.13333 = 1.0667 * 2**-3 -> 8 significant bits: 137/128 * 2**-3 = 137/1024
    assert scale.item() == 137 / 1024
    # -7.47 -> -7 -> 1;  3.74 -> 4 -> 12;  1.87 -> 2 -> 10;  7.47 -> 7 -> 15
    assert quantize_codes(w, scale, 8, 4).tolist() == [[1, 12, 10, 15]]

    # scale exactly 1/8; 1.5 -> 2 and 2.5 -> 2 (half to even), -0.5 -> -0
    w = torch.tensor([[0.9375, 0.1875, 0.3125, -0.0625]])
    scale = symmetric_scales(w, 4)
    assert scale.item() == 0.125
    assert quantize_codes(w, scale, 8, 4).tolist() == [[15, 10, 10, 8]]

    w8 = torch.tensor([[-2.55, 1.0]])
    s8 = symmetric_scales(w8, 8)
    # 2 * 2.55 / 255 = 0.02 = 1.28 * 2**-6 -> 164/128 * 2**-6 = 41/2048: -2.55 / s = -127.38 -> -127 -> 1;
    # 1 / s = 49.95 -> 50 -> 178
    assert s8.item() == 41 / 2048
    assert quantize_codes(w8, s8, 128, 8).tolist() == [[1, 178]]


def test_zero_row_gets_positive_scale() -> None:
    w = torch.zeros(2, 8)
    w[1, 3] = 1e-9  # fp16 underflow territory
    scale = symmetric_scales(w, 4)
    assert (scale > 0).all()
    q = rtn(w, GPTQConfig(group_size=-1, mse=False))
    assert torch.equal(q.dequantize(), torch.zeros(2, 8))


def test_rtn_error_bounded_by_half_scale() -> None:
    w = torch.randn(16, 96, generator=_gen(1))
    for bits in (4, 8):
        q = rtn(w, GPTQConfig(bits=bits, group_size=32, mse=False))
        s = q.scales.float()[q.g_idx.long()].T
        err = (w - q.dequantize()).abs()
        unclipped = w / s <= 2 ** (bits - 1) - 1
        assert (err[unclipped] <= s[unclipped] / 2 * (1 + 1e-6)).all()
        # the clipped top code: max|w| = (2**(bits-1) - 0.5) * exact scale, and the 8-significant-bit rounding
        # of the scale is at most 2**-8 relative
        assert (err <= s * (0.5 + 2 ** (bits - 1) * 2**-8)).all()
        assert int(q.codes.min()) >= 0 and int(q.codes.max()) <= 2**bits - 1


def test_dequantize_matches_manual() -> None:
    w = torch.randn(6, 40, generator=_gen(2))
    q = rtn(w, GPTQConfig(group_size=16, mse=False))  # 3 groups, the last partial
    assert q.scales.shape == (3, 6) and q.scales.dtype == torch.float16
    assert q.g_idx.tolist() == [i // 16 for i in range(40)]
    manual = torch.empty(6, 40)
    for r in range(6):
        for c in range(40):
            manual[r, c] = (int(q.codes[r, c]) - 8) * float(q.scales[c // 16, r])
    assert torch.equal(q.dequantize(), manual)
    assert q.dequantize(torch.float16).dtype == torch.float16


def test_config_validation() -> None:
    for bad in ({"bits": 3}, {"group_size": 0}, {"group_size": -2}, {"block_size": 0}, {"max_damp": 0.001}):
        with pytest.raises(ValueError):
            GPTQConfig(**bad)


# --- GPTQ ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp64", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [-1, 32, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_beats_rtn(bits: int, group_size: int, act_order: bool, fp64: bool) -> None:
    w = torch.randn(64, 256, generator=_gen(3))
    h = _correlated_hessian(256, seed=4)
    cfg = GPTQConfig(bits=bits, group_size=group_size, act_order=act_order, fp64=fp64, mse=False)
    res = gptq(w, h, cfg)
    q_rtn = rtn(w, cfg)
    err_rtn = weighted_error(w, q_rtn.dequantize(), h)
    assert res.loss == pytest.approx(weighted_error(w, res.weight.dequantize(), h))
    assert res.loss < 0.8 * err_rtn
    assert res.damp == cfg.damp
    n_groups = 1 if group_size == -1 else 256 // group_size
    assert res.weight.scales.shape == (n_groups, 64) and res.weight.scales.dtype == torch.float16
    assert res.weight.codes.dtype == torch.int32 and res.weight.g_idx.dtype == torch.int32
    assert int(res.weight.codes.min()) >= 0 and int(res.weight.codes.max()) <= 2**bits - 1
    assert 0 < relative_output_error(w, res.weight.dequantize(), h) < relative_output_error(w, q_rtn.dequantize(), h)


@pytest.mark.parametrize("mse", [False, True])
@pytest.mark.parametrize(("bits", "group_size"), [(4, -1), (4, 32), (8, 32), (4, 20)])
def test_identity_hessian_equals_rtn(bits: int, group_size: int, mse: bool) -> None:
    w = torch.randn(16, 96, generator=_gen(5))
    cfg = GPTQConfig(bits=bits, group_size=group_size, mse=mse, block_size=40)
    res = gptq(w, 3.0 * torch.eye(96), cfg)
    q = rtn(w, cfg)
    assert torch.equal(res.weight.codes, q.codes)
    assert torch.equal(res.weight.scales, q.scales)


@pytest.mark.parametrize("group_size", [32, 64])
def test_act_order_static_groups(group_size: int) -> None:
    w = torch.randn(32, 128, generator=_gen(6))
    h = _correlated_hessian(128, seed=7)
    res = gptq(w, h, GPTQConfig(group_size=group_size, act_order=True, mse=False))
    assert res.weight.g_idx.tolist() == (torch.arange(128) // group_size).tolist()
    assert res.loss < weighted_error(w, rtn(w, GPTQConfig(group_size=group_size, mse=False)).dequantize(), h)
    # static groups: the scales are the plain RTN scales of the original weight
    assert torch.equal(res.weight.scales, rtn(w, GPTQConfig(group_size=group_size, mse=False)).scales)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize(("group_size", "block_size"), [(-1, 128), (-1, 7), (8, 128), (8, 8), (8, 5), (12, 5)])
def test_matches_column_by_column_reference(group_size: int, block_size: int, act_order: bool) -> None:
    w = torch.randn(8, 32, generator=_gen(8))
    h = _correlated_hessian(32, seed=9, tokens=64)
    h[3, :] = 0  # a dead input
    h[:, 3] = 0
    res = gptq(
        w, h, GPTQConfig(group_size=group_size, block_size=block_size, act_order=act_order, fp64=True, mse=False)
    )
    ref_codes, ref_w_hat = _reference_gptq(w, h, 4, group_size, act_order)
    d = w.double() - ref_w_hat
    ref_loss = float(torch.trace(d @ h.double() @ d.T))
    assert (res.weight.codes == ref_codes).float().mean() >= 0.99
    assert res.loss == pytest.approx(ref_loss, rel=1e-6)


def test_scale_invariant_in_hessian() -> None:
    w = torch.randn(16, 64, generator=_gen(10))
    h = _correlated_hessian(64, seed=11)
    cfg = GPTQConfig(group_size=16, fp64=True, mse=False)
    a, b = gptq(w, h, cfg), gptq(w, 1e3 * h, cfg)
    assert (a.weight.codes == b.weight.codes).float().mean() >= 0.99


def test_dead_columns() -> None:
    g = _gen(12)
    x = torch.randn(200, 32, generator=g)
    x[:, [5, 17]] = 0
    w = torch.randn(12, 32, generator=g)
    for act_order in (False, True):
        res = gptq(w, x.T @ x, GPTQConfig(group_size=8, act_order=act_order, mse=False))
        w_hat = res.weight.dequantize()
        assert torch.isfinite(w_hat).all() and torch.isfinite(res.weight.scales.float()).all()
        assert (w_hat[:, [5, 17]] == 0).all()
        assert (res.weight.codes[:, [5, 17]] == 8).all()
    # every input dead
    res = gptq(w, torch.zeros(32, 32), GPTQConfig(group_size=8, mse=False))
    assert (res.weight.dequantize() == 0).all() and res.loss == 0.0


def test_damping_retry_and_failure() -> None:
    n = 16
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(13), dtype=torch.float64))
    eig = torch.ones(n, dtype=torch.float64)
    eig[-1] = 0.0
    h0 = q @ torch.diag(eig) @ q.T
    m0 = float(torch.diag(h0).mean())
    # smallest eigenvalue -0.015 * m0, about -0.0152 * mean(diag H): damp 0.01 fails, 0.02 succeeds
    h = (h0 - 0.015 * m0 * torch.eye(n, dtype=torch.float64)).float()
    w = torch.randn(4, n, generator=_gen(14))
    res = gptq(w, h, GPTQConfig(group_size=-1, mse=False))
    assert res.damp == pytest.approx(0.02)
    assert torch.isfinite(res.weight.dequantize()).all()

    eig[-1] = -5.0  # mean(diag) = 10/16; even damp 1.0 leaves a negative eigenvalue
    hopeless = (q @ torch.diag(eig) @ q.T).float()
    with pytest.raises(ValueError, match="damping"):
        gptq(w, hopeless, GPTQConfig(group_size=-1, mse=False))


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError):
        gptq(torch.randn(4, 8), torch.eye(7))
    h = torch.eye(8)
    h[0, 0] = float("nan")
    with pytest.raises(ValueError):
        gptq(torch.randn(4, 8), h)


# --- MSE scale search ---------------------------------------------------------------------------------------------


def _student_t(df: int, shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    chi2 = torch.randn(df, *shape, generator=g).pow(2).sum(0)
    return torch.randn(*shape, generator=g) / (chi2 / df).sqrt()


def _group_errors(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    zero = 2 ** (bits - 1)
    s = scale.float()[:, None]
    return ((quantize_codes(w, scale, zero, bits) - zero).float() * s - w).pow(2).sum(1)


@pytest.mark.parametrize("bits", [4, 8])
def test_mse_search_never_worse(bits: int) -> None:
    g = _gen(15)
    heavy = _student_t(2, (64, 128), g)
    for w in (torch.randn(64, 128, generator=g), heavy):
        plain_total = mse_total = 0.0
        for c in range(0, 128, 32):
            block = w[:, c : c + 32]
            plain = _group_errors(block, symmetric_scales(block, bits), bits)
            searched = _group_errors(block, mse_scales(block, bits), bits)
            assert (searched <= plain).all()
            plain_total += float(plain.sum())
            mse_total += float(searched.sum())
        if w is heavy:
            assert mse_total < (0.9 if bits == 4 else 1.0) * plain_total
    cfg = GPTQConfig(bits=bits, group_size=32, mse=False)
    plain_q, mse_q = rtn(heavy, cfg), rtn(heavy, GPTQConfig(bits=bits, group_size=32, mse=True))
    assert (heavy - mse_q.dequantize()).pow(2).sum() < (heavy - plain_q.dequantize()).pow(2).sum()


def test_gptq_with_mse() -> None:
    w = _student_t(3, (32, 128), _gen(19))
    h = _correlated_hessian(128, seed=16)
    cfg = GPTQConfig(group_size=32, mse=True)
    res = gptq(w, h, cfg)
    assert res.loss < weighted_error(w, rtn(w, cfg).dequantize(), h)
    assert res.loss < gptq(w, h, GPTQConfig(group_size=32, mse=False)).loss * 1.05


def test_relative_output_error() -> None:
    w = torch.randn(4, 8, generator=_gen(17))
    h = _correlated_hessian(8, seed=18, tokens=32)
    assert relative_output_error(w, w, h) == 0.0
    assert relative_output_error(w, torch.zeros_like(w), h) == pytest.approx(1.0)
    assert relative_output_error(torch.zeros(4, 8), torch.zeros(4, 8), h) == 0.0
