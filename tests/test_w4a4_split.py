"""The per-layer W4A4 split: a layer with only its weights, or only its FP4 activations, quantized."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.eval.command import run_eval
from salaquant.eval.options import EvalOptions
from salaquant.eval.w4a4_split import ActivationsOnlyLinear, activations_only, smoothing_scales
from salaquant.model.layout import GROUP_NAMES, input_groups
from salaquant.model.modeling import layer_rope
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.runtime.linear import NVFP4Linear
from salaquant.runtime.load import load

ROOT = Path(__file__).resolve().parents[1]
QUIET = Console(quiet=True)


@pytest.fixture(scope="module")
def smoothed_export(fp32_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An NVFP4 export with SmoothQuant on all four groups (``up_proj`` rows -> ``down_proj`` included)."""
    return run_method(
        fp32_model,
        tmp_path_factory.mktemp("nvfp4") / "out",
        [str(ROOT / "calib" / "sala-tiny-calib.jsonl")],
        CalibOptions(max_samples=2, max_len=128),
        NVFP4Method(
            NVFP4LayerOptions(mse_iters=0, smooth_groups=GROUP_NAMES),
            NVFP4RunOptions(device="cpu", show_progress=False),
        ),
        QUIET,
    )


def _models(fp32_model: Path, export: Path, activations: str = "fp4"):
    kw = {"dtype": "fp32", "kernels": False}
    return load(fp32_model, **kw), load(export, **kw, activations=activations)


def test_recovered_smoothing_scales_are_the_exports(fp32_model: Path, smoothed_export: Path) -> None:
    """The scales read back from the two layers span the range the quantizer reports having folded in, for norm
    producers and ``up_proj`` rows alike, and are 1 where a group was not smoothed."""
    ref, q = _models(fp32_model, smoothed_export)
    report = json.loads((smoothed_export / "quant_report.json").read_text())
    seen = set()
    for rep in report["layers"]:
        i, kind = rep["layer"], rep["kind"]
        s = smoothing_scales(ref.model.layers[i], q.model.layers[i], kind, ref.config)
        for g in input_groups(ref.config, kind):
            if g.name in rep["smooth_scale_range"]:
                spread = float(s[g.name].max() / s[g.name].min())
                tol = 0.01 if g.producer == "norm" else 0.03  # norms stored bf16; rows fitted to quantized ones
                assert spread == pytest.approx(rep["smooth_scale_range"][g.name], rel=tol), (i, g.name)
                seen.add(g.producer)
            elif g.name in s:
                assert torch.equal(s[g.name], torch.ones_like(s[g.name])), (i, g.name)
    assert seen == {"norm", "rows"}


def test_activations_only_layer_without_fp4_is_the_float_layer(fp32_model: Path, smoothed_export: Path) -> None:
    """In the smoothed basis the float weights make the export layer compute the float layer's function: with its
    FP4 activations off it matches the float layer to fp32 rounding, and with them on it does not."""
    from salaquant.eval.w4a4_split import activations_only_weights, linear_members

    ref, q = _models(fp32_model, smoothed_export)
    unfused = load(fp32_model, dtype="fp32", kernels=False, fuse=False)
    h = torch.randn(1, 64, ref.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for lf, lq, alone in zip(ref.model.layers, q.model.layers, unfused.model.layers, strict=True):
        rope = layer_rope(ref.config, lf.kind, 0, h.shape[1], h.device)
        y_f = lf(h, rope, None, "dense")
        weights = activations_only_weights(lf, lq, lf.kind, ref.config)
        assert weights and all(isinstance(lq.get_submodule(n), NVFP4Linear) for n in weights)
        with activations_only(lq, weights):
            y_a = lq(h, rope, None, "dense")
            for name in weights:
                m = lq.get_submodule(name)
                assert isinstance(m, ActivationsOnlyLinear)
                m.input_scale = None
            y_plain = lq(h, rope, None, "dense")
        assert all(isinstance(lq.get_submodule(n), NVFP4Linear) for n in weights)  # restored
        # the export stores the linears it leaves unquantized in bf16: so does the float layer compared with (the
        # float model unfused, as the two models may fuse different groups)
        quantized = {m for n in weights for m in linear_members(lq, n)}
        bf16 = copy.deepcopy(alone)
        for name, m in bf16.named_modules():
            if isinstance(m, torch.nn.Linear) and name not in quantized:
                m.weight.data = m.weight.data.bfloat16().float()
        y_b = bf16(h, rope, None, "dense")
        assert (y_plain - y_b).norm() / (y_b - h).norm() < 1e-5
        assert (y_a - y_f).norm() / (y_f - h).norm() > 1e-3
        assert torch.equal(lq(h, rope, None, "dense"), lq(h, rope, None, "dense"))


def test_eval_reports_the_split_for_w4a4_only(fp32_model: Path, smoothed_export: Path, tmp_path: Path) -> None:
    """``salaquant eval`` of a W4A4 export: each layer's weights-only error is exactly the weight-only eval's
    error of that layer, the activations' share lies strictly between 0 and 1, and the JSON and table carry it;
    the weight-only eval has no split."""
    opts = {"max_len": 128, "windows": 1, "niah_lengths": [], "gen_tokens": 0, "layer_windows": 1}
    opts |= {"device": "cpu", "dtype": "fp32", "show_progress": False}
    w4a4 = run_eval(smoothed_export, fp32_model, EvalOptions(**opts), None, tmp_path / "a", QUIET)
    w4a16 = run_eval(smoothed_export, fp32_model, EvalOptions(**opts, activations="bf16"), None, None, QUIET)
    for e4, e16 in zip(w4a4["layers"]["layers"], w4a16["layers"]["layers"], strict=True):
        assert e4["weights_only"] == e16["rel_err"]
        assert 0 < e4["activation_share"] < 1 and e4["activations_only"] > 0
        assert e16["weights_only"] is e16["activations_only"] is e16["activation_share"] is None
    saved = json.loads((tmp_path / "a" / "eval.json").read_text())["layers"]["layers"]
    assert [e["activation_share"] for e in saved] == [e["activation_share"] for e in w4a4["layers"]["layers"]]
    console = Console(record=True, width=200)
    from salaquant.eval import report

    report.render(w4a4, console)
    assert "FP4 acts only" in console.export_text()
