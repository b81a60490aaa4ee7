"""`salaquant nvfp4`: exclusion plans, smoothing, shared scales, export format, reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from salaquant.calibration.calib_data import CalibOptions
from salaquant.calibration.stats import GroupStats
from salaquant.driver import run_method
from salaquant.formats.check import CheckError, check_checkpoint
from salaquant.io.reader import CheckpointReader
from salaquant.model.config import SalaConfig
from salaquant.model.layout import input_groups
from salaquant.model.loading import CheckpointParts, load_model
from salaquant.model.modeling import layer_rope
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.layer import NVFP4LayerOptions, NVFP4LayerQuantizer
from salaquant.nvfp4.plan import NVFP4PlanError, build_nvfp4_plan

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-tiny"
CALIB = str(ROOT / "calib" / "sala-tiny-calib.jsonl")
QUIET = Console(file=open("/dev/null", "w"))  # noqa: SIM115


def test_exclusion_plans() -> None:
    cfg = SalaConfig.from_file(MODEL)
    default = build_nvfp4_plan(cfg)
    assert "model.layers.0.self_attn.o_gate" in default.excluded
    assert "model.layers.0.mlp.gate_proj" in default.quantized
    assert "model.layers.3.self_attn.q_proj" in default.quantized
    assert default.exclude_modules(cfg) == ["lm_head", "model.layers.0.self_attn*", "model.layers.7.self_attn*"]
    dense = build_nvfp4_plan(cfg, dense_all=True)
    assert not dense.excluded and dense.exclude_modules(cfg) == ["lm_head"]
    # one attention sub-module excludes the whole block (as SGLang builds it), with a note
    one = build_nvfp4_plan(cfg, exclude=(r"layers\.3\.self_attn\.o_proj",))
    assert {f"model.layers.3.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "z_proj", "o_proj")} <= one.excluded
    assert one.notes and "whole attention block" in one.notes[0]
    assert "model.layers.3.self_attn*" in one.exclude_modules(cfg)
    with pytest.raises(NVFP4PlanError, match="gate_up_proj"):
        build_nvfp4_plan(cfg, exclude=(r"layers\.2\.mlp\.gate_proj",))
    everything = build_nvfp4_plan(cfg, exclude=(r"layers\.5\.",))
    assert "model.layers.5*" in everything.exclude_modules(cfg)


def test_dense_all_smoothing_keeps_o_gate_consistent(tiny_ckpt_fp32: Path) -> None:
    """minicpm4 attn_in smoothing must scale o_gate's columns too (its input is the same normed x)."""
    reader = CheckpointReader(tiny_ckpt_fp32)
    cfg = SalaConfig.from_dict(reader.config())
    assert "self_attn.o_gate" in input_groups(cfg, "minicpm4")[0].members
    quantizer = NVFP4LayerQuantizer(cfg, build_nvfp4_plan(cfg, dense_all=True), NVFP4LayerOptions())
    layer = CheckpointParts(reader, cfg).layer(0)
    x = torch.randn(1, 30, cfg.hidden_size)
    rope = layer_rope(cfg, "minicpm4", 0, 30, "cpu")
    stats = {}
    for g in input_groups(cfg, "minicpm4"):
        dim = layer.get_submodule(g.members[0]).in_features
        st = GroupStats(dim, hessian=False)
        st.update(torch.randn(64, dim) * torch.logspace(-1, 1, dim))  # uneven channels: scales far from 1
        st.end_sample()
        stats[g.name] = st
    with torch.no_grad():
        ref = layer(x, rope, None, "dense")
    ranges: dict[str, float] = {}
    quantizer.smooth(0, layer, stats, ranges)
    assert set(ranges) == {"attn_in", "mlp_in"} and ranges["attn_in"] > 2
    with torch.no_grad():
        out = layer(x, rope, None, "dense")
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


def _run(out: Path, **kw) -> Path:
    return run_method(
        MODEL,
        out,
        [CALIB],
        CalibOptions(max_samples=4, max_len=512),
        NVFP4Method(
            NVFP4LayerOptions(mse_iters=kw.pop("mse_iters", 20), rounding=kw.pop("rounding", "gptq")),
            NVFP4RunOptions(device="cpu", show_progress=False, **kw),
        ),
        QUIET,
    )


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nvfp4")
    # the default exclusions rounded to nearest, dense-all with the default GPTQ rounding
    return {"default": _run(root / "default", rounding="nearest"), "dense_all": _run(root / "dense", dense_all=True)}


def test_export_format(exports) -> None:
    for name, out in exports.items():
        cfg = json.loads((out / "config.json").read_text())
        qc = cfg["quantization_config"]
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
        hf = json.loads((out / "hf_quant_config.json").read_text())
        assert hf["producer"]["name"] == "salaquant"
        assert hf["quantization"]["kv_cache_quant_algo"] is None and hf["quantization"]["group_size"] == 16
        assert hf["quantization"]["exclude_modules"] == qc["exclude_modules"] and "lm_head" in qc["exclude_modules"]
        reader = CheckpointReader(out)
        assert not any(k.endswith("pre_quant_scale") for k in reader)
        m = "model.layers.1.mlp.down_proj"
        assert reader.dtype(f"{m}.weight") == torch.uint8 and reader.shape(f"{m}.weight") == (256, 512)
        assert reader.dtype(f"{m}.weight_scale") == torch.float8_e4m3fn and reader.shape(f"{m}.weight_scale") == (
            256,
            64,
        )
        assert reader.shape(f"{m}.weight_scale_2") == () and reader.dtype(f"{m}.input_scale") == torch.float32
        assert reader.dtype("lm_head.weight") == torch.bfloat16
        sparse_q = reader.dtype("model.layers.0.self_attn.q_proj.weight")
        assert sparse_q == (torch.uint8 if name == "dense_all" else torch.bfloat16)
        assert check_checkpoint(out).format == "modelopt-nvfp4"


def test_fused_members_share_scales(exports) -> None:
    reader = CheckpointReader(exports["dense_all"])
    cfg = SalaConfig.from_file(exports["dense_all"])
    for i in range(cfg.num_hidden_layers):
        for members in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            part = "self_attn" if members[0] == "q_proj" else "mlp"
            for t in ("weight_scale_2", "input_scale"):
                vals = [reader.get(f"model.layers.{i}.{part}.{m}.{t}") for m in members]
                assert all(torch.equal(v, vals[0]) for v in vals), (i, members, t)
        # the gate on the same input: same input_scale, own weight_scale_2
        gate = "o_gate" if cfg.mixer_types[i] == "minicpm4" else "z_proj"
        assert torch.equal(
            reader.get(f"model.layers.{i}.self_attn.{gate}.input_scale"),
            reader.get(f"model.layers.{i}.self_attn.q_proj.input_scale"),
        )


def test_search_never_worse_and_reload_close(exports) -> None:
    """Rounding to nearest: the searched scales never raise the diag-H error over the plain ones. GPTQ rounding
    trades the diagonal error for the full-Hessian one: that is lower than rounding to nearest in the mean."""
    for out in exports.values():
        report = json.loads((out / "quant_report.json").read_text())
        lins = [lin for layer in report["layers"] for lin in layer["linears"].values() if lin["format"] == "nvfp4"]
        assert lins
        if "hessian_rel_err" not in lins[0]:
            assert all(lin["rel_err"] <= lin["rel_err_plain_scales"] for lin in lins)
            assert any(lin["rel_err"] < lin["rel_err_plain_scales"] for lin in lins)
        else:
            ratios = [lin["hessian_rel_err"] / lin["hessian_rel_err_nearest"] for lin in lins]
            assert sum(ratios) / len(ratios) < 0.9, ratios
    assert "hessian_rel_err" not in json.dumps(json.loads((exports["default"] / "quant_report.json").read_text()))
    ids = torch.randint(3, 4096, (1, 64), generator=torch.Generator().manual_seed(0))
    src = load_model(MODEL)(ids).logits
    p = torch.log_softmax(src, -1)
    for out in exports.values():
        q = torch.log_softmax(load_model(out)(ids).logits, -1)
        kl = float((p.exp() * (p - q)).sum(-1).mean())
        assert 0 < kl < 0.2, kl


def test_checker_catches_unshared_scale(exports, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(exports["default"], bad)
    shard = next(bad.glob("*.safetensors"))
    state = load_file(shard)
    key = "model.layers.2.mlp.up_proj.weight_scale_2"
    state[key] = state[key] * 2
    save_file(state, shard, metadata={"format": "pt"})
    with pytest.raises(CheckError, match=r"model\.layers\.2\.mlp\.gate_up_proj: weight_scale_2 differs"):
        check_checkpoint(bad)


def test_reload_equals_modelopt_dequantization(exports) -> None:
    """The loader's weights equal what ModelOpt itself decodes from the exported tensors."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    out = exports["dense_all"]
    reader = CheckpointReader(out)
    model = load_model(out)
    params = dict(model.named_parameters())
    checked = 0
    for m in ("model.layers.0.self_attn.o_gate", "model.layers.3.self_attn.v_proj", "model.layers.7.mlp.down_proj"):
        packed = reader.get(f"{m}.weight")
        shape = torch.Size([packed.shape[0], packed.shape[1] * 2])
        ref = NVFP4QTensor(shape, torch.float32, packed).dequantize(
            dtype=torch.float32,
            scale=reader.get(f"{m}.weight_scale"),
            double_scale=reader.get(f"{m}.weight_scale_2"),
            block_sizes={-1: 16},
        )
        assert torch.equal(params[f"{m}.weight"], ref.to(torch.bfloat16)), m
        checked += 1
    assert checked == 3
