"""`salaquant gptq` end to end on the shipped tiny model and calibration set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.formats.check import check_checkpoint
from salaquant.formats.gptq_v1.dynamic import plan_for
from salaquant.formats.gptq_v1.packing import dequantize_gptq_v1
from salaquant.gptq.command import GPTQMethod, RunOptions
from salaquant.gptq.layer import GPTQLayerOptions, GPTQLayerQuantizer
from salaquant.gptq.plan import BitsOptions, PlanError, build_plan
from salaquant.io.reader import CheckpointReader
from salaquant.model.config import SalaConfig
from salaquant.model.loading import load_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-tiny"
CALIB = str(ROOT / "calib" / "sala-tiny-calib.jsonl")
QUIET = Console(file=open("/dev/null", "w"))  # noqa: SIM115


class _Capture(GPTQLayerQuantizer):
    """Records the fake-quantized weights the solver hands back to the engine."""

    captured: dict[str, torch.Tensor]

    def quantize_layer(self, index, layer, stats):
        result = super().quantize_layer(index, layer, stats)
        self.captured.update({f"model.layers.{index}.{k}": v.detach().clone() for k, v in layer.state_dict().items()})
        return result


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    import salaquant.gptq.command as command

    out = tmp_path_factory.mktemp("gptq") / "w4"
    captured: dict[str, torch.Tensor] = {}

    class Quantizer(_Capture):
        pass

    Quantizer.captured = captured
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(command, "GPTQLayerQuantizer", Quantizer)
        run_method(
            MODEL,
            out,
            [CALIB],
            CalibOptions(max_samples=6, max_len=768),
            GPTQMethod(
                BitsOptions(layer_bits="7:8"), GPTQLayerOptions(), RunOptions(device="cpu", show_progress=False)
            ),
            QUIET,
        )
    return out, captured


def test_export_layout_and_config(exported) -> None:
    out, _ = exported
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc == json.loads((out / "quantize_config.json").read_text())
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"], qc["checkpoint_format"]) == (
        "gptq",
        4,
        128,
        True,
        False,
        "gptq",
    )
    reader = CheckpointReader(out)
    q = "model.layers.1.mlp.down_proj"
    assert reader.dtype(f"{q}.qweight") == torch.int32 and reader.shape(f"{q}.qweight") == (1024 * 4 // 32, 256)
    assert reader.shape(f"{q}.scales") == (1024 // 128, 256) and reader.dtype(f"{q}.scales") == torch.float16
    assert reader.shape(f"{q}.qzeros") == (8, 256 * 4 // 32)
    assert torch.all(reader.get(f"{q}.qzeros") == 0x77777777)
    # layer 7 is 8-bit: its plan resolves through dynamic for checkpoint and fused names alike
    for name in ("model.layers.7.mlp.down_proj", "model.layers.7.mlp.gate_up_proj"):
        assert plan_for(qc.get("dynamic", {}), name, 4, 128).bits == 8
    assert torch.all(reader.get("model.layers.7.mlp.down_proj.qzeros") == 0x7F7F7F7F)
    for f in ("tokenizer.json", "quant_report.json", "salaquant_settings.json", "quantize.log"):
        assert (out / f).exists(), f
    # the tiny model's minicpm4 k/v are 16 wide: gptq_marlin needs 64, so q/k/v of layers 0 and 7 stay bf16
    settings = json.loads((out / "salaquant_settings.json").read_text())
    assert settings["marlin_exclusions"] == sorted(
        f"model.layers.{i}.self_attn.{m}_proj" for i in (0, 7) for m in "qkv"
    )
    assert reader.dtype("model.layers.0.self_attn.k_proj.weight") == torch.bfloat16
    assert "model.layers.0.self_attn.o_gate.qweight" in reader
    report = check_checkpoint(out)
    assert report.format == "gptq" and len(report.quantized) > 0
    assert not Path(f"{out}.work").exists()


def test_dequantized_export_equals_solver_weights(exported) -> None:
    out, captured = exported
    reader = CheckpointReader(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    n = 0
    for key in reader:
        if key.endswith(".qweight"):
            module = key.removesuffix(".qweight")
            bits = plan_for(qc.get("dynamic", {}), module, qc["bits"], qc["group_size"]).bits
            tensors = {k: reader.get(f"{module}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")}
            w = dequantize_gptq_v1(tensors, bits)
            assert torch.equal(w.to(torch.bfloat16), captured[f"{module}.weight"]), module
            n += 1
    assert n > 40


def test_gptq_beats_rtn_on_every_linear(exported) -> None:
    out, _ = exported
    report = json.loads((out / "quant_report.json").read_text())
    lins = [
        (layer["layer"], name, lin)
        for layer in report["layers"]
        for name, lin in layer["linears"].items()
        if lin["bits"] != 16
    ]
    assert len(lins) > 40
    for i, name, lin in lins:
        assert lin["rel_err"] < lin["rtn_rel_err"], (i, name, lin)


def test_reload_matches_fake_quant_logits(exported) -> None:
    out, captured = exported
    reloaded = load_model(out)  # GPTQ tensors dequantized by the project's loader
    reference = load_model(MODEL)
    state = reference.state_dict()
    for k, v in captured.items():
        if k.endswith("weight"):
            state[k] = v
    reference.load_state_dict(state)
    ids = torch.randint(3, 4096, (1, 100), generator=torch.Generator().manual_seed(0))
    assert torch.equal(reloaded(ids).logits, reference(ids).logits)
    # and the quantized model is close to, but not the same as, the bf16 source
    source = load_model(MODEL)(ids).logits
    assert not torch.equal(reloaded(ids).logits, source)
    p, q = torch.log_softmax(source, -1), torch.log_softmax(reloaded(ids).logits, -1)
    assert float((p.exp() * (p - q)).sum(-1).mean()) < 0.1


def test_marlin_incompatible_plan_fails_early(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="gptq_marlin"):
        run_method(
            MODEL,
            tmp_path / "o",
            ["/nonexistent.jsonl"],
            CalibOptions(),
            GPTQMethod(
                BitsOptions(), GPTQLayerOptions(), RunOptions(device="cpu", show_progress=False, marlin_fallback=False)
            ),
            QUIET,
        )


def test_quantized_lm_head_refused_before_any_work(tmp_path: Path) -> None:
    """No engine serves SALA with a quantized lm_head: the flag and the recipe key are refused up front."""
    from typer.testing import CliRunner

    from salaquant.cli import app

    out = tmp_path / "lm"
    args = ["gptq", "-i", str(MODEL), "-o", str(out), "--calib", CALIB, "--quantize-lm-head"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "--quantize-lm-head" in result.output and "KeyError: 'lm_head.g_idx'" in result.output
    assert not out.exists()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: gptq\ngptq:\n  quantize_lm_head: true\n")
    result = CliRunner().invoke(app, ["run", str(recipe), "-i", str(MODEL), "-o", str(out), "--calib", CALIB])
    assert result.exit_code == 2, result.output
    assert f"{recipe}:3" in result.output and "lm_head" in result.output
    assert not out.exists()


def test_plan_errors() -> None:
    cfg = SalaConfig.from_file(MODEL)
    with pytest.raises(PlanError, match="--layer-bits"):
        build_plan(cfg, BitsOptions(layer_bits="9:4"))
    with pytest.raises(PlanError, match="--bits"):
        build_plan(cfg, BitsOptions(bits=3))
    with pytest.raises(PlanError, match="split the fused"):
        build_plan(cfg, BitsOptions(exclude=(r"self_attn\.k_proj",)))
    with pytest.raises(PlanError, match="--group-size"):
        build_plan(cfg, BitsOptions(group_size=100))
    plan = build_plan(cfg, BitsOptions(layer_bits="0:8,2-3:16", lightning_bits=8, exclude=(r"o_gate",)))
    assert plan["model.layers.0.mlp.up_proj"].bits == 8
    assert plan["model.layers.2.mlp.up_proj"].bits is None
    assert plan["model.layers.4.mlp.up_proj"].bits == 8  # lightning
    assert plan["model.layers.7.mlp.up_proj"].bits == 4  # minicpm4, default
    assert plan["model.layers.7.self_attn.o_gate"].bits is None
