"""Every export kind through SGLang's own loader (``sglang_engine``: what runs of SGLang and each stand-in).

For each kind: SGLang reads the same model from ``config.json`` as salaquant does, picks the quantization method
the export is meant for, builds a quantized or a bf16 layer exactly where the export quantized or kept a linear,
writes every byte of every parameter from the checkpoint (two loads from different fills agree), and its
parameters decode to the weights salaquant reads back. Broken exports that SGLang would load silently or fail on
are refused by ``salaquant check``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import sglang_engine
import torch
from rich.console import Console
from safetensors.torch import load_file, save_file

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.formats.check import CheckError, check_checkpoint
from salaquant.formats.gptq_v1.packing import dequantize_gptq_v1
from salaquant.formats.modelopt_nvfp4.numerics import NVFP4Weight
from salaquant.gptq.command import GPTQMethod, RunOptions
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions
from salaquant.model.config import SalaConfig
from salaquant.model.loading import load_model
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.serving import FORMATS, SGLANG_VERSION

pytestmark = pytest.mark.skipif(not sglang_engine.available(), reason="SGLang is not installed")

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-tiny"
CALIB = [str(ROOT / "calib" / "sala-tiny-calib.jsonl")]
QUIET = Console(quiet=True)
SMALL = CalibOptions(max_samples=2, max_len=128)
KINDS = ("bf16", "gptq", "gptq_mixed", "gptq_exclude", "gptq_budget")
KINDS += ("nvfp4", "nvfp4_dense_all", "nvfp4_budget", "nvfp4_gptq")
# SGLang's fused linears and the checkpoint linears they hold, in the order they are stacked.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FUSED_OF = {m: fused for fused, members in FUSED.items() for m in members}
# Keys SGLang and salaquant default differently when config.json leaves them out.
DEFAULTS_DIFFER = ("attn_use_rope", "use_output_gate", "use_output_norm", "scale_emb", "attn_use_output_gate")


def _gptq(out: Path, bits: BitsOptions) -> Path:
    run = RunOptions(device="cpu", show_progress=False)
    return run_method(MODEL, out, CALIB, SMALL, GPTQMethod(bits, GPTQLayerOptions(), run), QUIET)


def _nvfp4(out: Path, dense_all: bool, budget: str | None = None, rounding: str = "nearest") -> Path:
    run = NVFP4RunOptions(device="cpu", show_progress=False, dense_all=dense_all, budget=budget, budget_seq_len=64)
    return run_method(
        MODEL, out, CALIB, SMALL, NVFP4Method(NVFP4LayerOptions(mse_iters=8, rounding=rounding), run), QUIET
    )


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang")
    return {
        "bf16": MODEL,
        "gptq": _gptq(root / "gptq", BitsOptions()),
        "gptq_mixed": _gptq(root / "gptq_mixed", BitsOptions(layer_bits="1:8,2-3:16")),
        "gptq_exclude": _gptq(root / "gptq_exclude", BitsOptions(exclude=(r"layers\.4\.mlp\.down_proj",))),
        "gptq_budget": _gptq(root / "gptq_budget", BitsOptions(budget="7bits", budget_seq_len=64)),  # 4, 8, bf16
        "nvfp4": _nvfp4(root / "nvfp4", dense_all=False),
        "nvfp4_dense_all": _nvfp4(root / "nvfp4_dense", dense_all=True),
        "nvfp4_budget": _nvfp4(root / "nvfp4_budget", dense_all=False, budget="6bits"),
        "nvfp4_gptq": _nvfp4(root / "nvfp4_gptq", dense_all=True, rounding="gptq"),
    }


def _flag(path: Path) -> str | None:
    """The ``--quantization`` value the export is served with (None: a bf16 model)."""
    qc = json.loads((path / "config.json").read_text()).get("quantization_config")
    return None if qc is None else FORMATS[qc["quant_method"]].flag


def test_the_pinned_version_is_what_runs() -> None:
    assert sglang_engine.version() == SGLANG_VERSION


# ----------------------------------------------------------------------------------------------- the config


def _model_facts(config: SalaConfig) -> dict[str, object]:
    """Everything of our config that changes what the model computes, in SGLang's attribute names."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "mixer_types": ["lightning-attn" if m == "lightning" else m for m in config.mixer_types],
        "lightning_nh": config.lightning_nh,
        "lightning_nkv": config.lightning_nkv,
        "lightning_head_dim": config.lightning_head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "scale_emb": config.scale_emb,
        "scale_depth": config.scale_depth,
        "dim_model_base": config.dim_model_base,
        "attn_use_rope": config.attn_use_rope,
        "attn_use_output_gate": config.attn_use_output_gate,
        "lightning_use_rope": config.lightning_use_rope,
        "use_output_gate": config.use_output_gate,
        "use_output_norm": config.use_output_norm,
        "qk_norm": config.qk_norm,
        "attention_bias": config.attention_bias,
        "tie_word_embeddings": config.tie_word_embeddings,
        "lightning_layerwise_decay": False,
        "has_minicpm_sparse_attention": config.sparse_config is not None,
    }


def _sglang_facts(hf_config: object, config: SalaConfig) -> dict[str, object]:
    facts = {key: getattr(hf_config, key) for key in _model_facts(config)}
    facts["rope_theta"] = float(facts["rope_theta"])
    return facts


def _lightning_scale(hf_config: object) -> float:
    """The lightning attention scale as SGLang's mixer computes it from the config."""
    scale = hf_config.lightning_scale
    if scale == "1/sqrt(d)":
        return hf_config.lightning_head_dim**-0.5
    if scale == "1/d":
        return 1.0 / hf_config.lightning_head_dim
    return float(scale)


@pytest.mark.parametrize("kind", KINDS)
def test_sglang_reads_the_model_salaquant_reads(exports, kind: str) -> None:
    path = exports[kind]
    ours = SalaConfig.from_file(path)
    theirs = sglang_engine.parse_config(path)
    assert type(theirs).__name__ == "MiniCPMHybridConfig"
    assert _sglang_facts(theirs, ours) == _model_facts(ours)
    assert math.isclose(_lightning_scale(theirs), ours.lightning_scale, rel_tol=1e-12)


def test_export_states_the_keys_whose_defaults_differ(tmp_path: Path) -> None:
    """A source whose config.json leaves out keys that SGLang and salaquant default differently: SGLang reads the
    source as another model, and the export as the model salaquant quantized."""
    source = tmp_path / "source"
    shutil.copytree(MODEL, source)
    raw = json.loads((source / "config.json").read_text())
    for key in DEFAULTS_DIFFER:
        raw.pop(key)
    (source / "config.json").write_text(json.dumps(raw))
    ours = SalaConfig.from_file(source)
    assert _sglang_facts(sglang_engine.parse_config(source), ours) != _model_facts(ours)  # the hazard is real

    out = run_method(
        source,
        tmp_path / "w4",
        CALIB,
        SMALL,
        GPTQMethod(BitsOptions(), GPTQLayerOptions(method="rtn"), RunOptions(device="cpu", show_progress=False)),
        QUIET,
    )
    written = json.loads((out / "config.json").read_text())
    assert all(key in written for key in DEFAULTS_DIFFER)
    assert _sglang_facts(sglang_engine.parse_config(out), ours) == _model_facts(ours)


# ----------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("kind", KINDS)
def test_sglang_writes_every_parameter(exports, kind: str) -> None:
    assert sglang_engine.unwritten(exports[kind], _flag(exports[kind])) == {}


def _members(module: str) -> list[str]:
    head, _, leaf = module.rpartition(".")
    return [f"{head}.{m}" for m in FUSED[leaf]] if leaf in FUSED else [module]


def _expected_raw(tensors: dict[str, torch.Tensor], module: str, leaf: str) -> torch.Tensor:
    """What the checkpoint holds for SGLang's ``module.leaf``: member tensors stacked along the outputs."""
    parts = [tensors[f"{m}.{leaf}"] for m in _members(module)]
    if leaf == "g_idx":
        assert all(torch.equal(p, parts[0]) for p in parts)
        return parts[0]
    if leaf in ("weight_scale_2", "input_scale"):
        return torch.stack([p.reshape(()) for p in parts])
    dim = 1 if leaf in ("qweight", "qzeros", "scales") else 0  # GPTQ stores [in, out]
    return torch.cat(parts, dim=dim)


def _decoded(module: torch.nn.Module, members: list[str], ours: dict[str, torch.Tensor]) -> torch.Tensor:
    """SGLang's parameters of one linear decoded to a float weight [out, in]."""
    p = dict(module.named_parameters())
    if "qweight" in p:
        in_f = p["g_idx"].shape[0]
        bits = 32 * p["qweight"].shape[0] // in_f
        tensors = {k: p[k].data for k in ("qweight", "qzeros", "scales", "g_idx")}
        return dequantize_gptq_v1(tensors, bits)
    if p["weight"].dtype == torch.uint8:
        rows, start = [], 0
        for i, m in enumerate(members):
            n = ours[f"{m}.weight"].shape[0]
            w = NVFP4Weight(
                p["weight"].data[start : start + n],
                p["weight_scale"].data[start : start + n],
                p["weight_scale_2"].data.reshape(-1)[i],
            )
            rows.append(w.dequantize())
            start += n
        return torch.cat(rows)
    return p["weight"].data


@pytest.mark.parametrize("kind", KINDS)
def test_sglang_holds_what_the_export_holds(exports, kind: str) -> None:
    """Every SGLang parameter equals the checkpoint's tensors (stacked where SGLang fuses linears); every linear
    decodes to the weights salaquant's loader reads back; where each linear is quantized is where the export
    quantized it."""
    path = exports[kind]
    loaded = sglang_engine.load(path, _flag(path))
    assert loaded.quantization == _flag(path)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    for name, param in loaded.parameters.items():
        module, _, leaf = name.rpartition(".")
        expected = _expected_raw(tensors, module, leaf)
        got = param.data
        assert got.shape == expected.shape, name
        if got.dtype != expected.dtype:  # SGLang holds fp16 GPTQ scales in the model's bf16: must be exact
            assert torch.equal(expected.to(got.dtype).to(expected.dtype), expected), f"{name}: not exact in {got.dtype}"
            expected = expected.to(got.dtype)
        assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name

    ours = load_model(path).state_dict()  # bf16, as the engines compute with
    quantized = set() if kind == "bf16" else set(check_checkpoint(path).quantized)
    methods = sglang_engine.linear_methods(loaded.model)
    assert methods
    for module_name, method in methods.items():
        members = _members(module_name)
        module = loaded.model.get_submodule(module_name)
        expected = torch.cat([ours[f"{m}.weight"] for m in members])
        assert torch.equal(_decoded(module, members, tensors).to(expected.dtype), expected), module_name
        is_quantized = {m in quantized for m in members}
        assert len(is_quantized) == 1, module_name
        assert (method != "UnquantizedLinearMethod") == is_quantized.pop(), (module_name, method)


# ----------------------------------------------------------------------------------------------- broken exports


def _broken(src: Path, dst: Path, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of the export ``src`` without the tensors ``drop`` and with ``add`` (one safetensors file)."""
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0])
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, files[0], metadata={"format": "pt"})
    return dst


def _edit_quant_config(path: Path, edit) -> None:
    for name in ("config.json", "quantize_config.json"):
        f = path / name
        if not f.is_file():
            continue
        data = json.loads(f.read_text())
        edit(data["quantization_config"] if name == "config.json" else data)
        f.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("kind", "tensor"),
    [("gptq", "model.layers.1.self_attn.k_proj.scales"), ("nvfp4", "model.layers.2.mlp.up_proj.weight_scale")],
)
def test_missing_tensor_sglang_leaves_unwritten_and_check_refuses(exports, tmp_path: Path, kind, tensor) -> None:
    path = _broken(exports[kind], tmp_path / "broken", drop=(tensor,))
    module = tensor.rpartition(".")[0].rpartition(".")[0]
    holes = sglang_engine.unwritten(path, _flag(path))
    assert list(holes) == [f"{module}.{FUSED_OF[tensor.split('.')[-2]]}.{tensor.rpartition('.')[2]}"]
    with pytest.raises(CheckError, match=tensor.replace(".", r"\.")):
        check_checkpoint(path)


def test_wrong_bits_in_config_refused(exports, tmp_path: Path) -> None:
    path = _broken(exports["gptq"], tmp_path / "bits8")
    _edit_quant_config(path, lambda qc: qc.update(bits=8))
    with pytest.raises(Exception):  # noqa: B017 (what SGLang raises is its own business: that it fails)
        sglang_engine.load(path, "gptq_marlin")
    with pytest.raises(CheckError, match="8-bit"):
        check_checkpoint(path)


@pytest.mark.parametrize("kind", ["gptq", "gptq_exclude"])
def test_missing_exclusion_rule_refused(exports, tmp_path: Path, kind: str) -> None:
    """Without its negative rules SGLang builds GPTQ layers for bf16 linears and fails on the first one; the
    checker refuses, naming the key SGLang fails on."""
    path = _broken(exports[kind], tmp_path / "norule")
    _edit_quant_config(path, lambda qc: qc.pop("dynamic"))
    with pytest.raises(KeyError) as failed:
        sglang_engine.load(path, "gptq_marlin")
    key = failed.value.args[0]
    assert key.endswith(".weight")
    with pytest.raises(CheckError, match=f"KeyError: '{key}'"):
        check_checkpoint(path)


def test_quantized_lm_head_refused(exports, tmp_path: Path) -> None:
    """What ``--quantize-lm-head`` used to write: SGLang cannot load it, so ``check`` refuses it."""
    vocab, hidden = json.loads((MODEL / "config.json").read_text())["vocab_size"], 256
    lm_head = {
        "lm_head.qweight": torch.zeros(hidden // 8, vocab, dtype=torch.int32),
        "lm_head.qzeros": torch.full((hidden // 128, vocab // 8), 0x77777777, dtype=torch.int32),
        "lm_head.scales": torch.ones(hidden // 128, vocab, dtype=torch.float16),
        "lm_head.g_idx": torch.arange(hidden, dtype=torch.int32) // 128,
    }
    path = _broken(exports["gptq"], tmp_path / "lm_head", drop=("lm_head.weight",), add=lm_head)
    _edit_quant_config(path, lambda qc: qc.update(lm_head=True))
    with pytest.raises(KeyError, match="lm_head"):
        sglang_engine.load(path, "gptq_marlin")
    with pytest.raises(CheckError, match="no engine serves SALA with a quantized lm_head"):
        check_checkpoint(path)


def test_plain_gptq_is_not_a_method_sglang_serves(exports) -> None:
    """Why the serve command says ``gptq_marlin``: SGLang has no plain ``gptq`` method."""
    with pytest.raises(ValueError, match="Unknown quantization method: gptq"):
        sglang_engine.load(exports["gptq"], "gptq")
    assert FORMATS["gptq"].flag == "gptq_marlin" and FORMATS["modelopt"].flag == "modelopt_fp4"
