"""GPTQ v1 export format: packing, dynamic rules and the checkpoint checker."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from salaquant.formats.check import CHECKERS, CheckError, check_checkpoint
from salaquant.formats.gptq_v1.config import modules_in_block
from salaquant.formats.gptq_v1.dynamic import LinearPlan, build_dynamic, resolve
from salaquant.formats.gptq_v1.packing import dequantize_gptq_v1, pack_gptq_v1, unpack_gptq_v1
from salaquant.model.config import SalaConfig
from salaquant.model.layout import parameter_shapes

# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


def _reference_qweight(codes: torch.Tensor, bits: int) -> np.ndarray:
    """Word r of column c holds input rows p*r .. p*r+p-1, row p*r+j in bits [bits*j, bits*(j+1))."""
    out_f, in_f = codes.shape
    p = 32 // bits
    c = codes.tolist()
    words = np.zeros((in_f // p, out_f), dtype=np.uint32)
    for r in range(in_f // p):
        for col in range(out_f):
            word = 0
            for j in range(p):
                word |= int(c[col][p * r + j]) << (bits * j)
            words[r, col] = word
    return words.view(np.int32)


def _random_linear(out_f: int, in_f: int, bits: int, gs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g, dtype=torch.int32)
    groups = 1 if gs == -1 else in_f // gs
    scales = (torch.rand(groups, out_f, generator=g) * 0.01 + 1e-3).half()
    g_idx = torch.arange(in_f, dtype=torch.int32) // gs if gs > 0 else torch.zeros(in_f, dtype=torch.int32)
    return codes, scales, g_idx


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_matches_reference_packer(bits: int) -> None:
    codes, scales, g_idx = _random_linear(16, 64, bits, 32, seed=bits)
    packed = pack_gptq_v1(codes, scales, g_idx, bits, 2 ** (bits - 1))
    ref = _reference_qweight(codes, bits)
    assert packed["qweight"].dtype == torch.int32
    assert packed["qweight"].shape == (64 * bits // 32, 16)
    np.testing.assert_array_equal(packed["qweight"].numpy(), ref)
    assert (packed["qweight"] < 0).any(), "random codes must produce words with the top bit set"
    assert packed["scales"].dtype == torch.float16 and packed["g_idx"].dtype == torch.int32


def test_pack_bit_order_by_hand() -> None:
    # One column, 8 input rows with codes 0..7 -> 0x76543210; all 15 -> 0xFFFFFFFF = -1.
    codes = torch.tensor([list(range(8)), [15] * 8] * 4, dtype=torch.int32)  # [8, 8]
    packed = pack_gptq_v1(codes, torch.ones(1, 8), torch.zeros(8, dtype=torch.int32), 4, 8)
    assert packed["qweight"].shape == (1, 8)
    assert int(packed["qweight"][0, 0]) == 0x76543210
    assert int(packed["qweight"][0, 1]) == -1
    codes8 = torch.tensor([[0x01, 0x02, 0x03, 0x84]] * 4, dtype=torch.int32)  # out 4, in 4
    w = int(pack_gptq_v1(codes8, torch.ones(1, 4), torch.zeros(4, dtype=torch.int32), 8, 128)["qweight"][0, 0])
    assert w == 0x84030201 - 2**32


@pytest.mark.parametrize(("bits", "word"), [(4, 0x77777777), (8, 0x7F7F7F7F)])
def test_symmetric_qzeros_word(bits: int, word: int) -> None:
    codes, scales, g_idx = _random_linear(32, 128, bits, 64)
    qzeros = pack_gptq_v1(codes, scales, g_idx, bits, 2 ** (bits - 1))["qzeros"]
    assert qzeros.dtype == torch.int32 and qzeros.shape == (2, 32 * bits // 32)
    assert (qzeros == word).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, -1])
def test_unpack_roundtrip_and_dequantize(bits: int, gs: int) -> None:
    codes, scales, g_idx = _random_linear(48, 256, bits, gs, seed=7)
    zero = 2 ** (bits - 1)
    packed = pack_gptq_v1(codes, scales, g_idx, bits, zero)
    got_codes, zeros = unpack_gptq_v1(packed["qweight"], packed["qzeros"], bits, 256, 48)
    assert got_codes.dtype == torch.int32 and torch.equal(got_codes, codes)
    assert zeros.dtype == torch.int32 and (zeros == zero).all() and zeros.shape == scales.shape
    w = dequantize_gptq_v1(packed, bits)
    expected = (codes.float() - zero) * scales.float()[g_idx.long()].T
    assert w.dtype == torch.float32 and torch.equal(w, expected)


def test_pack_validation() -> None:
    codes, scales, g_idx = _random_linear(16, 64, 4, 32)
    with pytest.raises(ValueError, match=r"supported: 4, 8"):
        pack_gptq_v1(codes, scales, g_idx, 3, 4)
    with pytest.raises(ValueError, match="in_features=60"):
        pack_gptq_v1(codes[:, :60], scales, g_idx[:60], 4, 8)
    with pytest.raises(ValueError, match="out_features=12"):
        pack_gptq_v1(codes[:12], scales[:, :12], g_idx, 4, 8)
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 15\]"):
        pack_gptq_v1(codes + 1, scales, g_idx, 4, 8)
    with pytest.raises(ValueError, match="g_idx values"):
        pack_gptq_v1(codes, scales, g_idx + 1, 4, 8)
    with pytest.raises(ValueError, match="integer"):
        pack_gptq_v1(codes.float(), scales, g_idx, 4, 8)
    with pytest.raises(ValueError, match="supported: 4, 8"):
        unpack_gptq_v1(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 2, 32, 2)


# --------------------------------------------------------------------------------------------
# dynamic rules
# --------------------------------------------------------------------------------------------

SPARSE = {0, 9, 16, 17, 22, 29, 30, 31}
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def _sala_plan() -> dict[str, LinearPlan]:
    """minicpm4 layers 8-bit, o_gate / z_proj bf16 everywhere, layer 3's MLP 8-bit group 64, rest 4-bit g128."""
    plans: dict[str, LinearPlan] = {}
    for i in range(32):
        bits = 8 if i in SPARSE else 4
        for k in ATTN:
            plans[f"model.layers.{i}.self_attn.{k}"] = LinearPlan(bits, 128)
        gate = "o_gate" if i in SPARSE else "z_proj"
        plans[f"model.layers.{i}.self_attn.{gate}"] = LinearPlan(None, 128)
        for k in MLP:
            plans[f"model.layers.{i}.mlp.{k}"] = LinearPlan(8, 64) if i == 3 else LinearPlan(bits, 128)
    return plans


def _expected(i: int, module: str) -> tuple[bool, dict[str, Any]]:
    """Hand-written expectation for layer i, module ``self_attn.x`` / ``mlp.x`` (incl. fused names)."""
    if module in ("self_attn.o_gate", "self_attn.z_proj"):
        return False, {}
    if i == 3 and module.startswith("mlp."):
        return True, {"bits": 8, "group_size": 64}
    if i in SPARSE:
        return True, {"bits": 8, "group_size": 128}
    return True, {}


def test_build_dynamic_resolves_every_checkpoint_and_fused_name() -> None:
    plans = _sala_plan()
    dynamic = build_dynamic(plans, 4, 128, 32)
    assert json.loads(json.dumps(dynamic)) == dynamic
    # o_gate and z_proj are excluded in every layer holding them: one compact negative rule, listed first.
    negatives = [p for p in dynamic if p.startswith("-:")]
    assert len(negatives) == 1 and r"\d+" in negatives[0]
    assert next(iter(dynamic)) == negatives[0]
    assert len(dynamic) <= 4
    checked = 0
    for i in range(32):
        modules = [f"self_attn.{k}" for k in ATTN] + [f"mlp.{k}" for k in MLP]
        modules += ["self_attn.o_gate" if i in SPARSE else "self_attn.z_proj", "self_attn.qkv_proj", "mlp.gate_up_proj"]
        for module in modules:
            assert resolve(dynamic, f"model.layers.{i}.{module}") == _expected(i, module), (i, module)
            checked += 1
    assert checked == 32 * 10
    # Spot rows of the table, written out.
    assert resolve(dynamic, "model.layers.0.self_attn.qkv_proj") == (True, {"bits": 8, "group_size": 128})
    assert resolve(dynamic, "model.layers.1.self_attn.k_proj") == (True, {})
    assert resolve(dynamic, "model.layers.3.mlp.gate_up_proj") == (True, {"bits": 8, "group_size": 64})
    assert resolve(dynamic, "model.layers.3.self_attn.qkv_proj") == (True, {})
    assert resolve(dynamic, "model.layers.13.mlp.down_proj") == (True, {})
    assert resolve(dynamic, "model.layers.30.self_attn.o_gate") == (False, {})
    assert resolve(dynamic, "model.layers.5.self_attn.z_proj") == (False, {})
    assert resolve(dynamic, "lm_head") == (True, {})


def test_build_dynamic_per_layer_exclusion_does_not_leak() -> None:
    plans = {n: LinearPlan(4, 128) for n in _sala_plan()}
    for k in MLP:
        plans[f"model.layers.5.mlp.{k}"] = LinearPlan(None, 128)
    dynamic = build_dynamic(plans, 4, 128, 32)
    assert len(dynamic) == 1
    (pattern,) = dynamic
    assert pattern.startswith("-:") and r"\d+" not in pattern
    assert resolve(dynamic, "model.layers.5.mlp.gate_up_proj") == (False, {})
    assert resolve(dynamic, "model.layers.5.mlp.down_proj") == (False, {})
    assert resolve(dynamic, "model.layers.15.mlp.gate_up_proj") == (True, {})
    assert resolve(dynamic, "model.layers.5.self_attn.qkv_proj") == (True, {})
    assert build_dynamic({n: LinearPlan(4, 128) for n in plans}, 4, 128, 32) == {}


def test_build_dynamic_refuses_split_fused_group_and_bad_names() -> None:
    plans = _sala_plan()
    plans["model.layers.4.self_attn.k_proj"] = LinearPlan(8, 128)
    with pytest.raises(ValueError, match=r"model\.layers\.4\.self_attn\.qkv_proj.*k_proj"):
        build_dynamic(plans, 4, 128, 32)
    plans = _sala_plan()
    plans["model.layers.6.mlp.up_proj"] = LinearPlan(None, 128)
    with pytest.raises(ValueError, match=r"model\.layers\.6\.mlp\.gate_up_proj"):
        build_dynamic(plans, 4, 128, 32)
    plans = _sala_plan()
    del plans["model.layers.2.self_attn.v_proj"]
    with pytest.raises(ValueError, match="v_proj"):
        build_dynamic(plans, 4, 128, 32)
    with pytest.raises(ValueError, match="lm_head"):
        build_dynamic({**_sala_plan(), "lm_head": LinearPlan(4, 128)}, 4, 128, 32)
    with pytest.raises(ValueError, match="outside"):
        build_dynamic(_sala_plan(), 4, 128, 16)


def test_resolve_first_match_semantics() -> None:
    rules: dict[str, dict[str, Any]] = {
        r"+:model\.layers\.1\.mlp\..*": {"bits": 8},
        r"-:model\.layers\.1\..*": {},
        r"model\.layers\.2\.self_attn": {"group_size": 64},
        r"-:.*o_gate": {},
    }
    assert resolve(rules, "model.layers.1.mlp.down_proj") == (True, {"bits": 8})  # positive listed first wins
    assert resolve(rules, "model.layers.1.self_attn.q_proj") == (False, {})
    assert resolve(rules, "model.layers.2.self_attn.qkv_proj") == (True, {"group_size": 64})  # no prefix = positive
    assert resolve(rules, "model.layers.2.self_attn.o_gate") == (True, {"group_size": 64})  # earlier rule wins
    assert resolve(rules, "model.layers.3.self_attn.o_gate") == (False, {})
    assert resolve(rules, "model.layers.12.mlp.down_proj") == (True, {})
    assert resolve(rules, "xmodel.layers.1.mlp.up_proj") == (True, {})  # re.match anchors at the start
    assert resolve(rules, "lm_head") == (True, {})
    assert resolve({}, "model.layers.0.self_attn.q_proj") == (True, {})


# --------------------------------------------------------------------------------------------
# Checker
# --------------------------------------------------------------------------------------------

# Tiny SALA-shaped model: layer 0 minicpm4 (2 heads, 1 kv head, o_gate), layer 1 lightning (z_proj).
HIDDEN, HEAD = 256, 128


def _linear_shapes(intermediate: int) -> dict[str, tuple[int, int]]:
    s = {
        "model.layers.0.self_attn.q_proj": (256, HIDDEN),
        "model.layers.0.self_attn.k_proj": (128, HIDDEN),
        "model.layers.0.self_attn.v_proj": (128, HIDDEN),
        "model.layers.0.self_attn.o_gate": (256, HIDDEN),
        "model.layers.0.self_attn.o_proj": (HIDDEN, 256),
        "model.layers.1.self_attn.q_proj": (256, HIDDEN),
        "model.layers.1.self_attn.k_proj": (256, HIDDEN),
        "model.layers.1.self_attn.v_proj": (256, HIDDEN),
        "model.layers.1.self_attn.z_proj": (256, HIDDEN),
        "model.layers.1.self_attn.o_proj": (HIDDEN, 256),
    }
    for i in (0, 1):
        s[f"model.layers.{i}.mlp.gate_proj"] = (intermediate, HIDDEN)
        s[f"model.layers.{i}.mlp.up_proj"] = (intermediate, HIDDEN)
        s[f"model.layers.{i}.mlp.down_proj"] = (HIDDEN, intermediate)
    return s


def _default_plan(shapes: dict[str, tuple[int, int]]) -> dict[str, LinearPlan]:
    return {n: LinearPlan(None if n.endswith(("o_gate", "z_proj")) else 4, 128) for n in shapes}


def _write_ckpt(
    folder: Path,
    *,
    intermediate: int = 512,
    plan: dict[str, LinearPlan] | None = None,
    dynamic: dict[str, dict[str, Any]] | None = None,
    qc: dict[str, Any] | None = None,
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """Write config.json + model.safetensors; ``plan`` gives each linear's bits (None = bf16)."""
    shapes = _linear_shapes(intermediate)
    plan = plan if plan is not None else _default_plan(shapes)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(64, HIDDEN).bfloat16(),
        "model.norm.weight": torch.ones(HIDDEN).bfloat16(),
        "lm_head.weight": torch.randn(64, HIDDEN).bfloat16(),
    }
    for n, (out_f, in_f) in shapes.items():
        p = plan[n]
        if p.bits is None:
            tensors[f"{n}.weight"] = torch.randn(out_f, in_f).bfloat16()
        else:
            codes, scales, g_idx = _random_linear(out_f, in_f, p.bits, p.group_size, seed=out_f + in_f)
            for k, v in pack_gptq_v1(codes, scales, g_idx, p.bits, 2 ** (p.bits - 1)).items():
                tensors[f"{n}.{k}"] = v
    if edit is not None:
        edit(tensors)
    quant = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
        "lm_head": False,
        "dynamic": dynamic if dynamic is not None else build_dynamic(plan, 4, 128, 2),
        "modules_in_block_to_quantize": modules_in_block(plan, 2),
    }
    quant.update(qc or {})
    config = {
        "architectures": ["MiniCPMSALAForCausalLM"],
        "model_type": "minicpm_sala",
        "hidden_size": HIDDEN,
        "intermediate_size": intermediate,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD,
        "lightning_nh": 2,
        "lightning_nkv": 2,
        "lightning_head_dim": HEAD,
        "mixer_types": ["minicpm4", "lightning-attn"],
        "vocab_size": 64,
        "quantization_config": quant,
    }
    # the norms of the layout, which the served model needs beside the linears
    for name, shape in parameter_shapes(SalaConfig.from_dict(config)).items():
        if len(shape) == 1 and name not in tensors:
            tensors[name] = torch.ones(shape).bfloat16()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _error(folder: Path, tp: int = 1) -> str:
    with pytest.raises(CheckError) as info:
        check_checkpoint(folder, tp=tp)
    return str(info.value)


def test_checker_passes_good_checkpoint(tmp_path: Path) -> None:
    folder = _write_ckpt(tmp_path / "good")
    for tp in (1, 2):
        report = check_checkpoint(folder, tp=tp)
        assert report.format == "gptq"
        assert report.unquantized == ["model.layers.0.self_attn.o_gate", "model.layers.1.self_attn.z_proj", "lm_head"]
        assert len(report.quantized) == 14 and "model.layers.1.mlp.down_proj" in report.quantized
        assert report.warnings == []


def test_checker_passes_mixed_bits(tmp_path: Path) -> None:
    shapes = _linear_shapes(512)
    plan = _default_plan(shapes)
    for n in shapes:
        if n.startswith("model.layers.0.") and plan[n].bits is not None:
            plan[n] = LinearPlan(8, 128)
    plan.update({f"model.layers.1.mlp.{k}": LinearPlan(4, 64) for k in MLP})
    report = check_checkpoint(_write_ckpt(tmp_path / "mixed", plan=plan))
    assert len(report.quantized) == 14
    # optimum builds every quantized linear with the top-level bits: the report says which clients read 8 bits
    assert len(report.warnings) == 1 and "(8 besides 4)" in report.warnings[0]
    assert "transformers' GPTQ path" in report.warnings[0] and "GPTQModel.load" in report.warnings[0]


def test_modules_in_block_lists_full_names_per_layer() -> None:
    plan = _default_plan(_linear_shapes(512))
    listed = modules_in_block(plan, 2)
    assert listed[0] == [f"model.layers.0.{m}" for m in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj")] + [
        f"model.layers.0.self_attn.{m}" for m in ("k_proj", "o_proj", "q_proj", "v_proj")
    ]
    assert "model.layers.1.self_attn.z_proj" not in listed[1] and len(listed[1]) == 7


def test_checker_modules_in_block_against_both_readers(tmp_path: Path) -> None:
    """optimum quantizes names ending with an entry, vLLM names containing one: each misreading is an error."""
    plan = _default_plan(_linear_shapes(512))
    full = modules_in_block(plan, 2)
    # in-block names select layer 0's o_gate (plain) for both readers
    short = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o", "mlp.up_proj"]]
    errors = _error(_write_ckpt(tmp_path / "short", qc={"modules_in_block_to_quantize": short}))
    assert "model.layers.0.self_attn.o_gate.weight: stored plain" in errors and "vLLM" in errors
    assert "model.layers.1.mlp.gate_proj.qweight: quantized, but no modules_in_block_to_quantize entry" in errors
    assert "model.layers.1.mlp.gate_proj.qweight: quantized, but modules_in_block_to_quantize does not list" in errors
    # a layer left out: its quantized linears would load as plain ones in transformers
    errors = _error(_write_ckpt(tmp_path / "layer", qc={"modules_in_block_to_quantize": full[:1]}))
    assert "model.layers.1.mlp.down_proj.qweight: quantized, but no modules_in_block_to_quantize" in errors
    # an entry naming nothing, and a value of the wrong shape
    odd = [*full, ["model.layers.5.mlp.up_proj"]]
    assert "'model.layers.5.mlp.up_proj' names no linear" in _error(
        _write_ckpt(tmp_path / "odd", qc={"modules_in_block_to_quantize": odd})
    )
    assert "expected a list of lists of module names" in _error(
        _write_ckpt(tmp_path / "shape", qc={"modules_in_block_to_quantize": [[1, 2]]})
    )


def test_checker_warns_without_modules_in_block(tmp_path: Path) -> None:
    report = check_checkpoint(_write_ckpt(tmp_path / "ck", qc={"modules_in_block_to_quantize": None}))
    assert len(report.warnings) == 1 and "no modules_in_block_to_quantize" in report.warnings[0]
    assert "2 plain decoder linears" in report.warnings[0]


def test_checker_wrong_dtype(tmp_path: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.self_attn.q_proj.scales"] = t["model.layers.1.self_attn.q_proj.scales"].bfloat16()

    msg = _error(_write_ckpt(tmp_path / "ck", edit=edit))
    assert "model.layers.1.self_attn.q_proj.scales: dtype torch.bfloat16 is not torch.float16" in msg


def test_checker_output_partition_with_tp(tmp_path: Path) -> None:
    shapes = _linear_shapes(192)
    plan = _default_plan(shapes)
    plan.update({f"model.layers.{i}.mlp.down_proj": LinearPlan(None, 128) for i in (0, 1)})
    folder = _write_ckpt(tmp_path / "ck", intermediate=192, plan=plan)
    check_checkpoint(folder, tp=1)
    msg = _error(folder, tp=2)
    assert "model.layers.0.mlp.gate_proj.qweight: output partition 96 (tp=2 shard) is not a multiple of 64" in msg
    assert "model.layers.1.mlp.up_proj.qweight" in msg
    assert "self_attn" not in msg


def test_checker_group_size_16(tmp_path: Path) -> None:
    msg = _error(_write_ckpt(tmp_path / "ck", qc={"group_size": 16}))
    assert "quantization_config.group_size = 16" in msg
    dyn = {r"+:model\.layers\.1\.mlp\..*": {"group_size": 16}}
    msg = _error(_write_ckpt(tmp_path / "ck2", dynamic=dyn))
    assert r"dynamic['+:model\\.layers\\.1\\.mlp\\..*'].group_size = 16" in msg


def test_checker_asymmetric(tmp_path: Path) -> None:
    msg = _error(_write_ckpt(tmp_path / "ck", qc={"sym": False}))
    assert "quantization_config.sym = False" in msg

    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.down_proj.qzeros"][0, 1] = 0x76777777

    msg = _error(_write_ckpt(tmp_path / "ck2", edit=edit))
    assert "model.layers.0.mlp.down_proj.qzeros: word [0, 1] is 0x76777777, expected 0x77777777" in msg


def test_checker_bf16_o_gate_without_negative_rule(tmp_path: Path) -> None:
    dyn = {r"-:model\.layers\.\d+\.self_attn\.z_proj$": {}}
    msg = _error(_write_ckpt(tmp_path / "ck", dynamic=dyn))
    assert "model.layers.0.self_attn.o_gate.weight" in msg and "KeyError" in msg
    assert "z_proj" not in msg


def test_checker_excluded_module_with_qweight(tmp_path: Path) -> None:
    dyn = {r"-:model\.layers\.\d+\.self_attn\.(?:o_gate|z_proj)$": {}, r"-:model\.layers\.1\.mlp\.down_proj$": {}}
    msg = _error(_write_ckpt(tmp_path / "ck", dynamic=dyn))
    assert "model.layers.1.mlp.down_proj.qweight: present" in msg


def test_checker_fused_member_with_different_bits(tmp_path: Path) -> None:
    shapes = _linear_shapes(512)
    plan = _default_plan(shapes)
    default_dynamic = build_dynamic(plan, 4, 128, 2)
    plan["model.layers.1.self_attn.k_proj"] = LinearPlan(8, 128)
    # With a rule for k_proj alone: qkv_proj resolves to 4-bit, k_proj to 8-bit.
    dyn = {**default_dynamic, r"+:model\.layers\.1\.self_attn\.k_proj$": {"bits": 8}}
    msg = _error(_write_ckpt(tmp_path / "ck", plan=plan, dynamic=dyn))
    assert "model.layers.1.self_attn.k_proj" in msg and "model.layers.1.self_attn.qkv_proj" in msg
    # Without any rule: the 8-bit qweight does not have the 4-bit shape.
    msg = _error(_write_ckpt(tmp_path / "ck2", plan=plan, dynamic=default_dynamic))
    assert "model.layers.1.self_attn.k_proj.qweight: shape [64, 256]" in msg and "8-bit" in msg
    # One member kept bf16 while the others are quantized.
    plan["model.layers.1.self_attn.k_proj"] = LinearPlan(None, 128)
    msg = _error(_write_ckpt(tmp_path / "ck3", plan=plan, dynamic=default_dynamic))
    assert "model.layers.1.self_attn.qkv_proj: fused members must be all quantized or all plain" in msg


def test_checker_non_monotonic_g_idx(tmp_path: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.up_proj.g_idx"] = t["model.layers.0.mlp.up_proj.g_idx"].flip(0).contiguous()

    msg = _error(_write_ckpt(tmp_path / "ck", edit=edit))
    assert "model.layers.0.mlp.up_proj.g_idx: not monotonic" in msg
    msg = _error(_write_ckpt(tmp_path / "ck2", edit=edit, qc={"desc_act": True}))
    assert "model.layers.0.mlp.up_proj.g_idx: not monotonic" in msg


def test_checker_unknown_method_and_registry(tmp_path: Path) -> None:
    folder = _write_ckpt(tmp_path / "ck", qc={"quant_method": "awq"})
    assert "gptq" in CHECKERS
    assert "unsupported quant_method 'awq'" in _error(folder)
    with pytest.raises(CheckError, match="tensor-parallel"):
        check_checkpoint(folder, tp=0)


def test_check_error_lists_every_problem(tmp_path: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.up_proj.g_idx"] = t["model.layers.0.mlp.up_proj.g_idx"].flip(0).contiguous()
        t["model.layers.1.mlp.gate_proj.qzeros"] = t["model.layers.1.mlp.gate_proj.qzeros"].long()

    with pytest.raises(CheckError) as info:
        check_checkpoint(_write_ckpt(tmp_path / "ck", edit=edit))
    assert len(info.value.errors) == 2
    assert any(re.match(r"model\.layers\.1\.mlp\.gate_proj\.qzeros: dtype", e) for e in info.value.errors)
