from functools import partial

import pytest
import torch
from gla_checks import assert_close_scaled as _close
from gla_checks import gla_inputs, naive_recurrent_gla

from salaquant.model.gla import alibi_slopes, simple_gla

B, H, DK, DV = 2, 3, 8, 6
SCALE = DK**-0.5
G_GAMMA = torch.tensor([-0.84, -0.1, -0.004])
recurrent_gla = partial(simple_gla, form="recurrent")
chunk_gla = partial(simple_gla, form="chunk")


def _inputs(t: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return gla_inputs(B, t, H, DK, DV, dtype=dtype, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("t", [1, 5, 64, 100, 200])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunk_matches_naive(t: int, with_state: bool, chunk_size: int) -> None:
    q, k, v, s0 = _inputs(t)
    init = s0 if with_state else None
    o_ref, s_ref = naive_recurrent_gla(q, k, v, G_GAMMA, SCALE, init)
    o, s = chunk_gla(q, k, v, G_GAMMA, SCALE, init, output_final_state=True, chunk_size=chunk_size)
    assert s is not None and s_ref is not None
    _close(o, o_ref)
    _close(s, s_ref)
    o2, s2 = chunk_gla(q, k, v, G_GAMMA, SCALE, init, chunk_size=chunk_size)
    assert s2 is None
    _close(o2, o_ref)


@pytest.mark.parametrize("t", [1, 5, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_matches_naive(t: int, with_state: bool) -> None:
    q, k, v, s0 = _inputs(t, seed=1)
    init = s0 if with_state else None
    o_ref, s_ref = naive_recurrent_gla(q, k, v, G_GAMMA, SCALE, init)
    o, s = recurrent_gla(q, k, v, G_GAMMA, SCALE, init, output_final_state=True)
    assert s is not None and s_ref is not None
    _close(o, o_ref)
    _close(s, s_ref)
    assert recurrent_gla(q, k, v, G_GAMMA, SCALE, init)[1] is None


@pytest.mark.parametrize("t", [63, 64, 130])
def test_simple_gla_matches_naive(t: int) -> None:
    q, k, v, s0 = _inputs(t, seed=2)
    o_ref, s_ref = naive_recurrent_gla(q, k, v, G_GAMMA, SCALE, s0)
    o, s = simple_gla(q, k, v, G_GAMMA, SCALE, s0, output_final_state=True)
    assert s is not None and s_ref is not None
    _close(o, o_ref)
    _close(s, s_ref)


@pytest.mark.parametrize(("split", "t"), [(100, 103), (64, 200), (3, 70), (37, 37 + 64)])
def test_split_sequence_equals_single_call(split: int, t: int) -> None:
    q, k, v, s0 = _inputs(t, seed=3)
    o_full, s_full = simple_gla(q, k, v, G_GAMMA, SCALE, s0, output_final_state=True)
    o_a, s_a = simple_gla(q[:, :split], k[:, :split], v[:, :split], G_GAMMA, SCALE, s0, True)
    o_b, s_b = simple_gla(q[:, split:], k[:, split:], v[:, split:], G_GAMMA, SCALE, s_a, True)
    assert s_full is not None and s_b is not None
    _close(torch.cat([o_a, o_b], dim=1), o_full)
    _close(s_b, s_full)


@pytest.mark.parametrize("with_state", [False, True])
def test_closed_form(with_state: bool) -> None:
    t = 20
    q, k, v, s0 = _inputs(t, seed=4)
    pos = torch.arange(t, dtype=torch.float64)
    diff = pos[:, None] - pos[None, :]
    g = G_GAMMA.double()
    # decay[h, t, s] = exp(g_h (t - s)) for s <= t
    decay = torch.exp(g[:, None, None] * diff.clamp(min=0)) * (diff >= 0)
    qd, kd, vd = q.double(), k.double(), v.double()
    scores = torch.einsum("bthk,bshk->bhts", qd, kd) * decay
    expected = SCALE * torch.einsum("bhts,bshv->bthv", scores, vd)
    init = None
    if with_state:
        init = s0
        state_decay = torch.exp(g[None, :] * (pos[:, None] + 1))  # [T, H]
        expected = expected + SCALE * state_decay[None, :, :, None] * torch.einsum("bthk,bhkv->bthv", qd, s0.double())
    expected = expected.float()
    for fn in (naive_recurrent_gla, recurrent_gla, chunk_gla):
        o, _ = fn(q, k, v, G_GAMMA, SCALE, init)
        _close(o, expected)
    o, _ = chunk_gla(q, k, v, G_GAMMA, SCALE, init, chunk_size=8)
    _close(o, expected)


def test_alibi_slopes_power_of_two() -> None:
    slopes = alibi_slopes(32)
    assert slopes.dtype == torch.float32
    expected = torch.tensor([2.0 ** (-(h + 1) / 4) for h in range(32)], dtype=torch.float32)
    torch.testing.assert_close(slopes, expected, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))


def test_alibi_slopes_non_power_of_two() -> None:
    # 12 heads: the 8-head slopes 2^-1..2^-8, then every other 16-head slope (2^-0.5, 2^-1.5, ...)
    # for the remaining 4 heads.
    expected = [2.0**-i for i in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected), rtol=1e-6, atol=0.0)
    # 6 heads: 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then 8-head slopes 2^-1, 2^-3.
    expected6 = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    torch.testing.assert_close(alibi_slopes(6), torch.tensor(expected6), rtol=1e-6, atol=0.0)
    assert (alibi_slopes(40) > 0).all()


def test_fast_decay_long_sequence_is_finite() -> None:
    t = 200
    q, k, v, s0 = _inputs(t, seed=5)
    g = torch.tensor([-0.84, -0.84, -30.0])
    o, s = chunk_gla(q, k, v, g, SCALE, s0, output_final_state=True)
    assert s is not None
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o_ref, s_ref = naive_recurrent_gla(q, k, v, g, SCALE, s0)
    assert s_ref is not None
    _close(o, o_ref)
    _close(s, s_ref)


def test_low_precision_inputs_compute_in_fp32() -> None:
    t = 70
    q, k, v, s0 = _inputs(t, seed=6, dtype=torch.bfloat16)
    o_ref, s_ref = naive_recurrent_gla(q.float(), k.float(), v.float(), G_GAMMA, SCALE, s0)
    for fn in (recurrent_gla, chunk_gla, simple_gla):
        o, s = fn(q, k, v, G_GAMMA, SCALE, s0, True)
        assert s is not None and s_ref is not None
        assert o.dtype == torch.float32 and s.dtype == torch.float32
        _close(o, o_ref)
        _close(s, s_ref)


def test_form_choice() -> None:
    # "auto" is SALA's rule (recurrent below 64 tokens); a forced form runs at any length and agrees with the oracle.
    q, k, v, s0 = _inputs(70, seed=7)
    o_ref, _ = naive_recurrent_gla(q, k, v, G_GAMMA, SCALE, s0)
    for form in ("recurrent", "chunk"):
        o, _ = simple_gla(q, k, v, G_GAMMA, SCALE, s0, form=form)
        _close(o, o_ref)
    with pytest.raises(ValueError, match="form must be one of"):
        simple_gla(q, k, v, G_GAMMA, SCALE, s0, form="scan")
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        simple_gla(q, k, v, G_GAMMA, SCALE, s0, form="chunk", chunk_size=0)
    with pytest.raises(ValueError, match="chunks of 64, not 32"):
        simple_gla(q, k, v, G_GAMMA, SCALE, s0, backend="triton", chunk_size=32)
    # the forced form decides the path, not the length: 5 tokens forced to the chunk form meet the Triton chunk rule
    short = [t[:, :5] for t in (q, k, v)]
    with pytest.raises(ValueError, match="chunks of 64, not 32"):
        simple_gla(*short, G_GAMMA, SCALE, s0, backend="triton", chunk_size=32, form="chunk")
