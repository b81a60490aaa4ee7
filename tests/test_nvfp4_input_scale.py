"""The ``mse`` input-scale rule: its errors against ModelOpt's own NVFP4 quantization, its sampling, and the export."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from rich.console import Console

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.formats.modelopt_nvfp4.numerics import input_scale
from salaquant.io.reader import CheckpointReader
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.input_scale import FACTORS, SEARCH_TOKENS, InputScaleSearch, search_stride
from salaquant.nvfp4.layer import NVFP4LayerOptions

ROOT = Path(__file__).resolve().parents[1]
QUIET = Console(quiet=True)


def _modelopt_err2(x: torch.Tensor, scale: torch.Tensor) -> float:
    """Squared error of x's NVFP4 round trip by ModelOpt's NVFP4QTensor with ``scale`` as the per-tensor scale."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    q, block, s2 = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=scale)
    deq = q.dequantize(dtype=torch.float32, scale=block, double_scale=s2, block_sizes={-1: 16})
    return float((deq.double() - x.double()).pow(2).sum())


def _activations(tokens: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g) * torch.exp(torch.randn(dim, generator=g))  # uneven channels
    x[::37] *= 20.0  # a few outlier tokens, as the massive activations of LLMs
    return x


def test_errors_are_modelopt_round_trips_and_the_least_wins() -> None:
    x = _activations(300, 64, 0)
    base = input_scale(x.abs().amax())
    search = InputScaleSearch(base)
    for chunk in x.split(70):  # chunks accumulate like one pass
        search.update(chunk)
    expected = [_modelopt_err2(x, base * f) for f in FACTORS]
    assert torch.allclose(search.err2, torch.tensor(expected, dtype=torch.float64), rtol=1e-6)
    best = min(range(len(FACTORS)), key=lambda k: expected[k])
    assert search.best_factor() == FACTORS[best]
    assert torch.equal(search.scale(), base * FACTORS[best])
    rep = search.report()
    assert rep["tokens"] == rep["tokens_measured"] == 300
    assert rep["rel_err"] == pytest.approx(expected[best] / float(x.double().pow(2).sum()))
    assert rep["rel_err"] <= rep["rel_err_max_rule"]


def test_zero_input_keeps_the_max_rule() -> None:
    search = InputScaleSearch(torch.tensor(0.5))
    search.update(torch.zeros(40, 32))
    assert search.best_factor() == 1.0 and float(search.scale()) == 0.5


def test_stride_counts_every_large_token_and_every_kth_small_one() -> None:
    """With stride 3, tokens that can saturate (amax > FACTORS[0] x calibrated amax) count once each; the others
    are taken at every third position of the small tokens across chunks, each standing for three."""
    x = _activations(200, 32, 1)
    base = input_scale(x.abs().amax())
    search = InputScaleSearch(base, stride=3)
    for chunk in x.split(45):
        search.update(chunk)
    large = x.abs().amax(-1) > FACTORS[0] * float(x.abs().amax())
    small = x[~large]
    assert 0 < int(large.sum()) < 200
    kept = small[0::3]
    for k, f in enumerate(FACTORS):
        want = _modelopt_err2(x[large], base * f) + 3 * _modelopt_err2(kept, base * f)
        assert float(search.err2[k]) == pytest.approx(want, rel=1e-6)
    rep = search.report()
    assert rep["tokens"] == 200 and rep["tokens_measured"] == int(large.sum()) + kept.shape[0]


def test_stride_from_the_calibration_size() -> None:
    assert search_stride(0) == 1 and search_stride(SEARCH_TOKENS) == 1
    assert search_stride(SEARCH_TOKENS + 1) == 2 and search_stride(10 * SEARCH_TOKENS) == 10
    with pytest.raises(ValueError, match="stride"):
        InputScaleSearch(torch.tensor(1.0), stride=0)


@pytest.mark.parametrize("propagate", ["quantized", "float"])
def test_export_writes_the_chosen_scale_for_every_input(fp32_model: Path, tmp_path: Path, propagate: str) -> None:
    """``--input-scale mse``: each quantized input's scale is the max rule's times the factor the report names,
    measured on every calibration token (the propagation pass, or with float propagation its own pass), one value
    per input tensor; ``max`` writes ModelOpt's rule."""
    calib = CalibOptions(max_samples=2, max_len=256)
    model = fp32_model
    data = [str(ROOT / "calib" / "sala-tiny-calib.jsonl")]
    outs = {}
    for rule in ("max", "mse"):
        opts = NVFP4LayerOptions(mse_iters=0, input_scale=rule)
        run = NVFP4RunOptions(device="cpu", show_progress=False, propagate=propagate)
        outs[rule] = run_method(model, tmp_path / rule, data, calib, NVFP4Method(opts, run), QUIET)
    report = json.loads((outs["mse"] / "quant_report.json").read_text())
    tokens = report["calibration"]["tokens"]
    mse, mx = CheckpointReader(outs["mse"]), CheckpointReader(outs["max"])
    groups = {
        "attn_in": "self_attn.q_proj",
        "attn_out": "self_attn.o_proj",
        "mlp_in": "mlp.gate_proj",
        "mlp_out": "mlp.down_proj",
    }
    seen = 0
    for layer in report["layers"]:
        for group, rep in layer.get("input_scale", {}).items():
            name = f"model.layers.{layer['layer']}.{groups[group]}.input_scale"
            assert rep["tokens"] == rep["tokens_measured"] == tokens
            assert rep["factor"] in FACTORS and rep["rel_err"] <= rep["rel_err_max_rule"]
            assert torch.equal(mse.get(name), (mx.get(name) * rep["factor"]).reshape(()))
            seen += 1
        assert "input_scale" not in json.loads((outs["max"] / "quant_report.json").read_text())["layers"][0]
    kinds = json.loads((fp32_model / "config.json").read_text())["mixer_types"]
    assert seen == sum(2 if k == "minicpm4" else 4 for k in kinds)  # minicpm4 attention stays bf16
    for i in range(len(kinds)):
        for t in ("mlp.gate_proj", "mlp.up_proj"):
            assert torch.equal(
                mse.get(f"model.layers.{i}.{t}.input_scale"), mse.get(f"model.layers.{i}.mlp.gate_proj.input_scale")
            )
