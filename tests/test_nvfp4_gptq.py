"""GPTQ rounding for NVFP4 (``salaquant.nvfp4.gptq``): against round-to-nearest where no error can be carried, a
hand-sized case whose optimal rounding is known, ModelOpt's decoding of the bytes, and the ``nvfp4 --rounding gptq``
command end to end."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from rich.console import Console
from shipped import CALIB, SHIPPED

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.formats.modelopt_nvfp4.numerics import (
    E2M1_GRID,
    block_scales,
    global_scale,
    quantize_nvfp4,
    unpack_nibbles,
)
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.gptq import gptq_nvfp4
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.nvfp4.search import search_block_scales


def _weight(g: torch.Generator, out: int = 48, n: int = 128) -> torch.Tensor:
    """Heavy-tailed weights (log-normal magnitudes), as trained linears have."""
    return torch.randn(out, n, generator=g) * torch.exp(0.5 * torch.randn(out, n, generator=g)) * 0.02


def _correlated_hessian(g: torch.Generator, n: int, tokens: int = 1024) -> torch.Tensor:
    mix = torch.eye(n) + 0.4 * torch.randn(n, n, generator=g) / n**0.5
    x = torch.randn(tokens, n, generator=g) @ mix
    return x.T @ x / tokens


def _loss(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    d = (w - w_hat).double()
    return float(((d @ h.double()) * d).sum())


@pytest.mark.parametrize("static", [True, False], ids=["scales-before", "scales-during"])
def test_diagonal_hessian_is_round_to_nearest_byte_for_byte(static: bool) -> None:
    """A diagonal H carries no error between columns: GPTQ must write the bytes of rounding to nearest under the
    same (searched) block scales; a sweep that picks each block's scales on reaching it sees the original columns,
    so it finds the same scales as the search over the whole weight."""
    g = torch.Generator().manual_seed(0)
    w = _weight(g)
    importance = torch.rand(w.shape[1], generator=g) + 0.1
    ws2 = global_scale(w.abs().amax())
    scales = search_block_scales(w, ws2, importance).scales
    nearest = quantize_nvfp4(w, ws2, scales)
    got = gptq_nvfp4(
        w, torch.diag(importance), ws2, importance, block_scale=scales if static else None, block_size=32
    ).weight
    assert torch.equal(got.weight_scale.view(torch.uint8), nearest.weight_scale.view(torch.uint8))
    assert torch.equal(got.weight, nearest.weight)
    assert torch.equal(got.weight_scale_2, nearest.weight_scale_2)


def test_rank_one_hessian_reaches_the_known_optimum() -> None:
    """One row of 16 inputs of 0.3 under a block step of 1 (E2M1 values 0, 0.5, 1, ...) and ``H = 1 1^T + d I``:
    the loss is ``(sum e)^2 + d sum e^2``. Every sum of E2M1 values is a multiple of 0.5, so the best is a sum of
    5.0 against 4.8 (ten 0.5s, six 0s): loss ``0.04 + d (10 * 0.04 + 6 * 0.09)``. Rounding to nearest takes every
    0.3 to 0.5 (sum error 3.2, loss above 10); the column sweep must carry the errors forward to the optimum."""
    d = 1e-3
    w = torch.full((1, 16), 0.3)
    h = torch.ones(16, 16) + d * torch.eye(16)
    one = torch.ones(1, 1, dtype=torch.float8_e4m3fn)
    got = gptq_nvfp4(w, h, 1.0, torch.ones(16), block_scale=one, damp=0.0).weight
    values = got.dequantize()
    optimum = 0.2**2 + d * (10 * 0.2**2 + 6 * 0.3**2)
    assert _loss(w, values, h) == pytest.approx(optimum, rel=1e-6)
    assert float(values.sum()) == 5.0 and sorted(values.reshape(-1).tolist()) == [0.0] * 6 + [0.5] * 10
    nearest = quantize_nvfp4(w, 1.0, one).dequantize()
    assert _loss(w, nearest, h) > 10.0


@pytest.mark.parametrize("static", [True, False], ids=["scales-before", "scales-during"])
def test_lower_hessian_loss_than_nearest_and_exact_bookkeeping(static: bool) -> None:
    """On correlated inputs the sweep lowers ``tr(E H E^T)`` well below rounding to nearest (a broken update, e.g.
    one that skips the error carried across 128-column blocks, loses it); the loss it reports is that of the
    weight it returns, and every value it returns is an E2M1 value times its block scale."""
    g = torch.Generator().manual_seed(1)
    w = _weight(g, 64, 256)
    h = _correlated_hessian(g, 256)
    imp = torch.diag(h)
    ws2 = global_scale(w.abs().amax())
    scales = search_block_scales(w, ws2, imp).scales
    nearest = _loss(w, quantize_nvfp4(w, ws2, scales).dequantize(), h)
    res = gptq_nvfp4(w, h, ws2, imp, block_scale=scales if static else None, block_size=128)
    assert res.loss == pytest.approx(_loss(w, res.weight.dequantize(), h), rel=1e-9)
    assert res.loss < 0.9 * nearest, (res.loss, nearest)
    codes = unpack_nibbles(res.weight.weight).long()
    magnitude = torch.tensor(E2M1_GRID)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    step = res.weight.weight_scale.float().repeat_interleave(16, dim=1) * res.weight.weight_scale_2
    assert torch.equal(res.weight.dequantize(), magnitude * step)


def test_block_size_does_not_change_the_result() -> None:
    """The lazy block update is an evaluation order: 16-, 64- and 256-column blocks give the same codes (fp64)."""
    g = torch.Generator().manual_seed(2)
    w = _weight(g, 32, 256)
    h = _correlated_hessian(g, 256)
    ws2 = global_scale(w.abs().amax())
    scales = block_scales(w, ws2)
    runs = [gptq_nvfp4(w, h, ws2, torch.diag(h), block_scale=scales, block_size=b, fp64=True) for b in (16, 64, 256)]
    assert all(torch.equal(r.weight.weight, runs[0].weight.weight) for r in runs[1:])


def test_modelopt_decodes_the_bytes_to_our_values() -> None:
    """ModelOpt's ``NVFP4QTensor`` dequantizes the packed codes, block scales and global scale GPTQ writes to
    exactly the values salaquant's loader computes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    g = torch.Generator().manual_seed(3)
    w = _weight(g, 32, 128)
    h = _correlated_hessian(g, 128)
    q = gptq_nvfp4(w, h, global_scale(w.abs().amax()), torch.diag(h)).weight
    qt = NVFP4QTensor(torch.Size(w.shape), torch.float32, q.weight)
    theirs = qt.dequantize(
        dtype=torch.float32, scale=q.weight_scale, double_scale=q.weight_scale_2, block_sizes={-1: 16}
    )
    assert torch.equal(theirs, q.dequantize())


def test_bad_arguments_are_refused() -> None:
    w = torch.randn(4, 32)
    h = torch.eye(32)
    with pytest.raises(ValueError, match="expected \\[out, in\\] and \\[in, in\\]"):
        gptq_nvfp4(w, torch.eye(16), 1.0, torch.ones(32))
    with pytest.raises(ValueError, match="multiple of 16"):
        gptq_nvfp4(w, h, 1.0, torch.ones(32), block_size=24)
    with pytest.raises(ValueError, match="block_scale: expected float8_e4m3fn \\(4, 2\\)"):
        gptq_nvfp4(w, h, 1.0, torch.ones(32), block_scale=torch.ones(4, 2))
    with pytest.raises(ValueError, match="--rounding 'best'"):
        from salaquant.model.config import SalaConfig
        from salaquant.nvfp4.layer import NVFP4LayerQuantizer
        from salaquant.nvfp4.plan import build_nvfp4_plan

        cfg = SalaConfig.from_dict(json.loads((SHIPPED / "config.json").read_text()))
        NVFP4LayerQuantizer(cfg, build_nvfp4_plan(cfg, False, ()), NVFP4LayerOptions(rounding="best"))


@pytest.mark.parametrize("static", [True, False], ids=["scales-before", "scales-during"])
def test_command_lowers_every_linears_hessian_error(tmp_path: Path, static: bool) -> None:
    """``salaquant nvfp4 --rounding gptq`` on the shipped model: the engine collects the input Hessians, the export
    passes the ModelOpt-format check, records its rounding, and every NVFP4 linear's output error under its
    calibration Hessian is below rounding to nearest under the same scales (scales before the sweep) or at most
    a tenth above it (scales during: they differ from the searched ones)."""
    opts = NVFP4LayerOptions(mse_iters=8, rounding="gptq", static_scales=static)
    run = NVFP4RunOptions(device="cpu", show_progress=False, dense_all=True)
    out = run_method(
        SHIPPED,
        tmp_path / "out",
        [CALIB],
        CalibOptions(max_samples=4, max_len=512),
        NVFP4Method(opts, run),
        Console(quiet=True),
    )
    settings = json.loads((out / "salaquant_settings.json").read_text())
    assert settings["nvfp4"]["rounding"] == "gptq" and settings["nvfp4"]["static_scales"] is static
    linears = [e for r in json.loads((out / "quant_report.json").read_text())["layers"] for e in r["linears"].values()]
    nvfp4 = [e for e in linears if e["format"] == "nvfp4"]
    assert len(nvfp4) == 64
    ratios = [e["hessian_rel_err"] / e["hessian_rel_err_nearest"] for e in nvfp4]
    if static:
        assert max(ratios) < 1.0, ratios
    else:
        assert max(ratios) < 1.1 and sum(ratios) / len(ratios) < 1.0, ratios


@pytest.mark.interpreter
@pytest.mark.parametrize("static", [True, False], ids=["scales-before", "scales-during"])
def test_triton_sweep_writes_the_reference_bytes(static: bool) -> None:
    """The solver on the Triton column sweep (interpreted here; on the H200 too, at 4096 x 4096 and 4096 x 16384)
    writes the bytes of the PyTorch sweep, the operands laid out as the kernel reads them."""
    g = torch.Generator().manual_seed(4)
    w = _weight(g, 20, 64)
    h = _correlated_hessian(g, 64)
    ws2 = global_scale(w.abs().amax())
    scales = search_block_scales(w, ws2, torch.diag(h)).scales if static else None
    a, b = (gptq_nvfp4(w, h, ws2, torch.diag(h), block_scale=scales, block_size=32, backend=be).weight
            for be in ("triton", "reference"))  # fmt: skip
    assert torch.equal(a.weight, b.weight)
    assert torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8))
