"""GPTQ column sweep: the Triton kernel (interpreter on CPU) against the PyTorch reference, bit for bit, and the
whole solver on either backend."""

from __future__ import annotations

import pytest
import torch

from salaquant.gptq.solver import GPTQConfig, gptq, mse_scales
from salaquant.kernels.gptq import ColumnBlock, best_scale, gptq_columns, gptq_columns_reference

pytestmark = pytest.mark.random_inputs


def _hinv(c: int, g: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """Upper Cholesky factor of the inverse of a random well-conditioned SPD matrix, as the solver builds it."""
    x = torch.randn(4 * c, c, generator=g)
    h = (x.T @ x / (4 * c) + 0.1 * torch.eye(c)).to(device)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).contiguous()


def _operands(r: int, c: int, per_column: bool, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(torch.initial_seed() + seed)
    w = (torch.randn(r, c, generator=g) * 0.02).to(device)
    amax = w.abs().amax(1)
    scale = (2 * amax / 15).to(torch.float16).float()
    if per_column:  # scales that change from column to column, some of them too small (clipping to the grid ends)
        scale = scale[:, None] * torch.linspace(0.3, 1.2, c, device=device)[None, :]
        scale = scale.to(torch.float16).float().contiguous()
    return w, scale, _hinv(c, g, device)


def _sweep(backend: str, w: torch.Tensor, scale: torch.Tensor, hinv: torch.Tensor, start: int, stop: int):
    w1 = w.clone()
    codes = torch.full(w.shape, -7, dtype=torch.int32, device=w.device)
    err = torch.full_like(w, 123.0)
    gptq_columns(ColumnBlock(w1, codes, err, hinv, 8, 15), scale, start, stop, backend=backend)
    return w1, codes, err


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("r", "c", "start", "stop", "per_column"),
    [(37, 40, 0, 40, False), (37, 40, 5, 29, False), (16, 128, 0, 128, True), (50, 24, 3, 24, True)],
)
def test_kernel_equals_reference(r: int, c: int, start: int, stop: int, per_column: bool) -> None:
    w, scale, hinv = _operands(r, c, per_column, seed=r + c)
    got = _sweep("triton", w, scale, hinv, start, stop)
    want = _sweep("reference", w, scale, hinv, start, stop)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    w1, codes, _ = got
    assert torch.equal(codes[:, :start], torch.full_like(codes[:, :start], -7))  # columns outside the range untouched
    assert torch.equal(codes[:, stop:], torch.full_like(codes[:, stop:], -7))
    assert torch.equal(w1[:, :start], w[:, :start])
    assert int(codes[:, start:stop].min()) >= 0 and int(codes[:, start:stop].max()) <= 15


@pytest.mark.interpreter
def test_kernel_rounds_half_to_even() -> None:
    """Columns whose ratios to the scale sit exactly on .5 (and just below it) round as torch.round does."""
    c = 16
    ratios = torch.tensor(
        [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5, 0.49999997, -0.49999997, 7.5, -8.5, 6.5, 0.0, 1.0, 2.0]
    )
    w = ratios[None, :].repeat(3, 1) * 0.25
    scale = torch.full((3,), 0.25)
    hinv = torch.eye(c)  # no error propagation: each code is round(w / s) alone
    _, codes, _ = _sweep("triton", w, scale, hinv, 0, c)
    want = (torch.round(ratios) + 8).clamp(0, 15).to(torch.int32)
    assert torch.equal(codes[0], want)
    assert torch.equal(codes, _sweep("reference", w, scale, hinv, 0, c)[1])


@pytest.mark.interpreter
@pytest.mark.parametrize(("r", "c", "start", "stop"), [(37, 48, 0, 48), (20, 64, 16, 48)])
def test_e2m1_kernel_equals_reference(r: int, c: int, start: int, stop: int) -> None:
    """NVFP4's grid: the kernel writes the reference's codes, errors and updated weights bit for bit, with per-column
    steps as the NVFP4 solver passes them (block scale times global scale, 16 columns each)."""
    g = torch.Generator().manual_seed(torch.initial_seed() + r + c)
    w = torch.randn(r, c, generator=g) * torch.exp(torch.randn(r, c, generator=g)) * 0.02
    steps = (w.abs().reshape(r, c // 16, 16).amax(-1) / 6).repeat_interleave(16, dim=1).contiguous()
    hinv = _hinv(c, g)
    outs = []
    for backend in ("triton", "reference"):
        w1, codes, err = w.clone(), torch.full(w.shape, -7, dtype=torch.int32), torch.full_like(w, 123.0)
        gptq_columns(ColumnBlock(w1, codes, err, hinv, e2m1=True), steps, start, stop, backend=backend)
        outs.append((w1, codes, err))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    codes = outs[0][1]
    assert int(codes[:, start:stop].min()) >= 0 and int(codes[:, start:stop].max()) <= 15
    assert torch.equal(codes[:, :start], torch.full_like(codes[:, :start], -7))


@pytest.mark.interpreter
def test_e2m1_kernel_rounds_as_the_format() -> None:
    """Ratios on every E2M1 midpoint (ties go to the even index: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 ->
    2, 3.5 -> 4, 5 -> 4), just off them, negative ones rounding to zero (code 8) and saturation at 6 give the codes
    of ``numerics.e2m1_codes``, which is tested bit for bit against ModelOpt."""
    from salaquant.formats.modelopt_nvfp4.numerics import e2m1_codes

    ratios = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2500001, 0.7499999, -0.25, -0.1, -5.0, 7.0, -100.0, 0.0, 6.0]
    )
    w = ratios[None, :].repeat(3, 1) * 0.125
    steps = torch.full((3, 16), 0.125)
    codes = torch.zeros(3, 16, dtype=torch.int32)
    gptq_columns(ColumnBlock(w.clone(), codes, torch.zeros_like(w), torch.eye(16), e2m1=True), steps, 0, 16, "triton")
    assert torch.equal(codes[0], e2m1_codes(ratios).to(torch.int32))
    assert codes[0].tolist()[:7] == [0, 2, 2, 4, 4, 6, 6]


def test_reference_is_the_column_recursion() -> None:
    """The reference against the recursion written out by hand for a 2 x 3 block."""
    w = torch.tensor([[0.30, -0.11, 0.52], [0.05, 0.21, -0.40]])
    hinv = torch.tensor([[2.0, 0.5, -0.25], [0.0, 1.0, 0.5], [0.0, 0.0, 4.0]])
    s = torch.tensor([0.1, 0.05])
    codes = torch.zeros(2, 3, dtype=torch.int32)
    err = torch.zeros(2, 3)
    w1 = w.clone()
    gptq_columns_reference(ColumnBlock(w1, codes, err, hinv, 8, 15), s, 0, 3)
    ww = w.clone()
    for j in range(3):
        q = torch.clamp(torch.round(ww[:, j] / s) + 8, 0, 15)
        e = (ww[:, j] - (q - 8) * s) / hinv[j, j]
        for k in range(j, 3):
            ww[:, k] = ww[:, k] - e * hinv[j, k]
        assert torch.equal(codes[:, j], q.to(torch.int32))
        assert torch.allclose(err[:, j], e)
    # row 0, column 0: 0.30 / 0.1 = 3 -> code 11, no error; row 1: 0.05 / 0.05 = 1 -> code 9
    assert codes[:, 0].tolist() == [11, 9]


def test_bad_operands() -> None:
    w, scale, hinv = _operands(8, 16, False, seed=0)
    codes = torch.zeros(8, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend must be one of"):
        gptq_columns(ColumnBlock(w, codes, w.clone(), hinv, 8, 15), scale, 0, 16, backend="cuda")
    with pytest.raises(ValueError, match="scale"):
        gptq_columns(ColumnBlock(w, codes, w.clone(), hinv, 8, 15), scale[:4], 0, 16)
    with pytest.raises(ValueError, match="int32"):
        ColumnBlock(w, codes.long(), w.clone(), hinv, 8, 15)
    with pytest.raises(ValueError, match="backend"):
        GPTQConfig(backend="fast")


def _hessian(n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(torch.initial_seed() + seed)
    x = torch.randn(2 * n, n, generator=g) * torch.linspace(0.2, 3.0, n)
    return (x.T @ x).to(device)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("group_size", "block_size", "act_order", "mse"),
    [
        (128, 128, False, False),
        (32, 64, False, False),
        (128, 64, False, True),
        (64, 128, True, False),
        (-1, 96, False, False),
    ],
)
def test_solver_same_bits_on_both_backends(group_size: int, block_size: int, act_order: bool, mse: bool) -> None:
    """Whole GPTQ solves (groups inside blocks, groups spanning blocks, act-order, MSE scales) are identical."""
    n, out = 256, 24
    w = torch.randn(out, n, generator=torch.Generator().manual_seed(torch.initial_seed() + 3)) * 0.03
    h = _hessian(n, seed=4)
    kw = {"group_size": group_size, "block_size": block_size, "act_order": act_order, "mse": mse, "mse_grid": 20}
    a = gptq(w, h, GPTQConfig(backend="triton", **kw))
    b = gptq(w, h, GPTQConfig(backend="reference", **kw))
    assert torch.equal(a.weight.codes, b.weight.codes)
    assert torch.equal(a.weight.scales, b.weight.scales)
    assert a.loss == b.loss


@pytest.mark.gpu
def test_gpu_gptq_kernel_matches_reference() -> None:
    """At a SALA shape on the GPU: the kernel and the PyTorch reference give the same codes and scales."""
    n, out = 2048, 1024
    w = (torch.randn(out, n, generator=torch.Generator().manual_seed(torch.initial_seed() + 5)) * 0.02).cuda()
    h = _hessian(n, seed=6, device="cuda")
    for act_order in (False, True):
        a = gptq(w, h, GPTQConfig(backend="triton", act_order=act_order))
        b = gptq(w, h, GPTQConfig(backend="reference", act_order=act_order))
        assert torch.equal(a.weight.codes, b.weight.codes)
        assert torch.equal(a.weight.scales, b.weight.scales)


def _scale_errors(w: torch.Tensor, cands: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Squared rounding error of each row under its chosen candidate, in float64 (independent of both backends)."""
    s = cands.gather(0, idx[None]).squeeze(0).double()[:, None]
    q = (torch.round(w.double() / s) + 8).clamp(0, 15)
    return ((q - 8) * s - w.double()).pow(2).sum(1)


@pytest.mark.interpreter
@pytest.mark.parametrize(("r", "n"), [(45, 128), (33, 40)])
def test_scale_search_kernel_picks_the_reference_choice(r: int, n: int) -> None:
    g = torch.Generator().manual_seed(torch.initial_seed() + r)
    w = torch.randn(r, n, generator=g) * torch.rand(r, 1, generator=g)
    # Row 0: evenly spread values and one outlier at -3. At the max-abs scale (0.4) the spread values cost about
    # 127 * 0.4^2 / 12 = 1.7; at 0.8 of it the outlier (on the longer negative side, -8 steps) costs (3 - 2.56)^2
    # = 0.19 and the rest about 1.1, so the search must clip.
    w[0] = torch.linspace(-1, 1, n)
    w[0, 0] = -3.0
    shrink = torch.linspace(1.0, 0.2, 41)
    cands = ((2 * w.abs().amax(1))[None, :] * shrink[:, None] / 15).to(torch.float16).float()
    got = best_scale(w, cands, 8, 15, backend="triton")
    want = best_scale(w, cands, 8, 15, backend="reference")
    # Same choice wherever the best two candidates are not tied to rounding; never a worse error.
    assert (got == want).float().mean() >= 0.95
    e_got, e_want = _scale_errors(w, cands, got), _scale_errors(w, cands, want)
    assert torch.all(e_got <= e_want * (1 + 1e-5) + 1e-12)
    assert int(got[0]) > 0  # the outlier row clips
    # Every candidate's error against the chosen one: the choice is a minimum of the independent float64 errors.
    all_err = torch.stack([_scale_errors(w, cands, torch.full((r,), c)) for c in range(cands.shape[0])])
    assert torch.all(e_got <= all_err.min(0).values * (1 + 1e-5) + 1e-12)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_scale_search_prefers_the_larger_scale_on_ties(backend: str) -> None:
    """A row on the integer grid of the max-abs scale: every smaller candidate that gives the same zero error
    (none here) or more loses, so index 0 wins; an all-zero row ties everywhere and also takes index 0. A
    duplicated candidate ties exactly with its first copy, which wins."""
    w = torch.tensor([[0.0, 1.0, -2.0, 3.0, 7.0, -8.0] + [0.0] * 10, [0.0] * 16, [0.3, -0.7, 1.1] + [0.2] * 13])
    cands = torch.tensor([[1.0, 1.0, 0.5], [0.9, 0.9, 0.2], [0.5, 0.5, 0.2]])
    idx = best_scale(w, cands, 8, 15, backend=backend)
    assert idx.tolist() == [0, 0, 1]


def _exact_errors(w: torch.Tensor, cands: torch.Tensor, zero: int, maxq: int) -> torch.Tensor:
    """Each candidate's error per row, ``[k, R]``: the elements as both backends compute them (fp32, division
    correctly rounded, round half to even), summed in float64, so only the summation order is taken out."""
    s = cands[:, :, None]
    q = torch.div(w[None], s).round().add(zero).clamp(0, maxq)
    d = (q - zero) * s - w[None]
    return (d * d).double().sum(-1)


@pytest.mark.interpreter
def test_scale_search_backends_differ_only_by_summation_order() -> None:
    """Both backends compute every element's error with the same fp32 operations and differ only in the order
    of the row sum (a tree in Triton). So wherever the best candidate leads the runner-up by more than the
    sum's rounding bound (2 n 2^-24 of the error), both pick it; elsewhere each picks a candidate within that
    bound of the best. The tie rule beyond it: exact ties go to the lowest index (the test above)."""
    g = torch.Generator().manual_seed(torch.initial_seed() + 2)
    w = torch.randn(64, 128, generator=g) * 0.05
    shrink = torch.tensor([1 - i / 100 for i in range(81)])
    cands = (2 * shrink[:, None] * w.abs().amax(1)[None, :] / 15).half().float()  # mse_scales' candidates
    got = {b: best_scale(w, cands, 8, 15, backend=b) for b in ("triton", "reference")}
    err = _exact_errors(w, cands, 8, 15)
    tol = 2 * w.shape[1] * 2.0**-24 * err.max(0).values
    ranked = err.sort(0).values
    clear = ranked[1] - ranked[0] > 2 * tol
    assert clear.float().mean() >= 0.5  # most rows are decided: the comparison below has teeth
    for backend, idx in got.items():
        assert torch.equal(idx[clear], err.argmin(0)[clear]), backend
        assert bool((err.gather(0, idx[None])[0] <= ranked[0] + tol).all()), backend
    a = mse_scales(w, 4, backend="triton")
    b = mse_scales(w, 4, backend="reference")
    assert a.dtype == torch.float16 and torch.equal(a[clear], b[clear])


@pytest.mark.gpu
def test_gpu_mse_solve_close_to_reference() -> None:
    """GPTQ with MSE scales at a SALA shape: the kernels' search agrees with the PyTorch one on nearly every
    (row, group), and the solution's loss is the same to 0.1%."""
    n, out = 2048, 1024
    w = (torch.randn(out, n, generator=torch.Generator().manual_seed(torch.initial_seed() + 7)) * 0.02).cuda()
    h = _hessian(n, seed=8, device="cuda")
    a = gptq(w, h, GPTQConfig(backend="triton", mse=True))
    b = gptq(w, h, GPTQConfig(backend="reference", mse=True))
    assert (a.weight.scales == b.weight.scales).float().mean() >= 0.99
    assert abs(a.loss - b.loss) <= 1e-3 * b.loss
