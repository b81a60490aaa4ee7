"""GroupStats against sums computed in float64 from the same inputs."""

from __future__ import annotations

import pytest
import torch

from salaquant.calibration.stats import GroupStats


def _reference(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    xs = [s.double() for s in samples]
    full = torch.cat(xs)
    return {
        "xtx": full.T @ full,
        "xtx_per_sample": sum(x.T @ x / x.shape[0] for x in xs),
        "absmax": full.abs().amax(0),
        "sumsq": full.pow(2).sum(0),
    }


def _collect(samples: list[torch.Tensor], device: str, chunk: int) -> GroupStats:
    st = GroupStats(samples[0].shape[1], device=device)
    for s in samples:
        for i in range(0, s.shape[0], chunk):
            st.update(s[i : i + chunk].to(device))
        st.end_sample()
    return st


def _check(st: GroupStats, samples: list[torch.Tensor], tol: float) -> None:
    ref = _reference(samples)
    got = st.to_tensors()
    for key in ("xtx", "xtx_per_sample", "sumsq"):
        err = float((got[key].double() - ref[key]).norm() / ref[key].norm())
        assert err < tol, f"{key}: relative error {err:.3g}"
    assert torch.equal(got["absmax"].double(), ref["absmax"])
    assert got["counts"].tolist() == [sum(s.shape[0] for s in samples), len(samples)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sums_match_float64(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    samples = [(torch.randn(n, 48, generator=gen) * 3).to(dtype) for n in (37, 64, 5)]
    _check(_collect(samples, "cpu", chunk=16), samples, tol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("half_product", [True, False])
def test_gpu_bf16_hessian_on_tensor_cores_is_exact_to_fp32_rounding(
    half_product: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both tensor-core paths: bf16 operands with a float32 result, and the TF32 product of the float32 copy."""
    from salaquant.calibration import stats

    monkeypatch.setattr(stats, "_HALF_MM_FP32_OUT", [half_product])
    gen = torch.Generator().manual_seed(1)
    samples = [(torch.randn(n, 1024, generator=gen) * 4).to(torch.bfloat16) for n in (3000, 1111)]
    torch.backends.cuda.matmul.allow_tf32 = False
    st = _collect(samples, "cuda", chunk=1024)
    assert stats._HALF_MM_FP32_OUT[0] is half_product, "the bf16 product with a float32 result must run on this torch"
    # TF32 would truncate fp32 inputs to 10 mantissa bits (~1e-4 error here); bf16 inputs lose nothing, and what
    # remains is fp32 summation (measured 2.5e-6 on the H200).
    _check(st, samples, tol=1e-5)
    assert torch.backends.cuda.matmul.allow_tf32 is False, "the global TF32 setting must be restored"


def test_only_the_kept_hessian_sum_is_collected() -> None:
    """A quantizer that reads one weighting keeps only that d x d sum, equal to the one collected beside the other."""
    g = torch.Generator().manual_seed(3)
    samples = [torch.randn(n, 8, generator=g) for n in (12, 30)]
    both, one = _collect(samples, "cpu", 7), GroupStats(8, sums=("samples",))
    for s in samples:
        for i in range(0, s.shape[0], 7):
            one.update(s[i : i + 7])
        one.end_sample()
    assert one.xtx is None and "xtx" not in one.to_tensors()
    assert torch.equal(one.hessian_per_sample(), both.hessian_per_sample())
    assert len(one.tensors()) == len(both.tensors()) - 1
    with pytest.raises(AssertionError, match="token-weighted"):
        one.hessian_mean()
    with pytest.raises(ValueError, match="Hessian sums"):
        GroupStats(8, sums=("rows",))
