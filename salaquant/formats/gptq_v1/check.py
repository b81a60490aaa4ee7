"""The GPTQ v1 checker: what SGLang's and vLLM's ``gptq_marlin`` need of a checkpoint, each problem naming the
tensor or config key and the rule it breaks."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import torch

from ...io.reader import CheckpointReader
from ...model.config import SalaConfig
from ...model.layout import TP_SPLIT, fused_name, head_dim, layer_linears, split_layer_name
from ...serving import LM_HEAD_REFUSAL
from ..report import CheckReport, fail
from .dynamic import first_match, resolve
from .packing import SUPPORTED_BITS

__all__ = ["check_gptq", "marlin_shape_problems", "shape_problems"]

MARLIN_GROUP_SIZES = (-1, 32, 64, 128)
MARLIN_MIN_N = 64  # output partition multiple (GPTQ_MARLIN_MIN_THREAD_N)
MARLIN_MIN_K = 128  # input partition multiple (GPTQ_MARLIN_MIN_THREAD_K)
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
_PLAIN_WEIGHT_DTYPES = (torch.bfloat16, torch.float16)


def shape_problems(reader: CheckpointReader, name: str, shape: tuple[int, ...]) -> list[str] | None:
    """Whether the GPTQ tensors standing for parameter ``name`` of ``shape`` (as ``config.json`` implies it) have
    its ``in`` inputs (``g_idx``) and ``out`` outputs (``qweight``); None when ``name`` is not stored as GPTQ."""
    module = name.removesuffix(".weight")
    if name in reader or f"{module}.qweight" not in reader or len(shape) != 2:
        return None
    out_f, in_f = shape
    errors = []
    if f"{module}.g_idx" in reader and tuple(reader.shape(f"{module}.g_idx")) != (in_f,):
        errors.append(f"{module}.g_idx: shape {list(reader.shape(f'{module}.g_idx'))}, config.json implies [{in_f}]")
    if reader.shape(f"{module}.qweight")[-1] != out_f:
        errors.append(f"{module}.qweight: {reader.shape(f'{module}.qweight')[-1]} outputs, config.json implies {out_f}")
    return errors


def _check_gptq_config(qc: dict[str, Any], errors: list[str], warnings: list[str]) -> dict[str, Any]:
    """Top-level keys and dynamic overrides against what gptq_marlin accepts."""
    for key in ("bits", "group_size", "desc_act", "sym"):
        if key not in qc:
            errors.append(f"quantization_config.{key} is missing (gptq_marlin needs bits, group_size, desc_act, sym)")
    bits, gs, desc_act, sym = qc.get("bits"), qc.get("group_size"), qc.get("desc_act"), qc.get("sym")
    if "bits" in qc and (isinstance(bits, bool) or bits not in SUPPORTED_BITS):
        errors.append(f"quantization_config.bits = {bits!r}: gptq_marlin takes 4 or 8")
    if "group_size" in qc and (isinstance(gs, bool) or gs not in MARLIN_GROUP_SIZES):
        errors.append(f"quantization_config.group_size = {gs!r}: gptq_marlin takes one of {list(MARLIN_GROUP_SIZES)}")
    if "sym" in qc and sym is not True:
        errors.append(f"quantization_config.sym = {sym!r}: gptq_marlin needs sym=true (asymmetric falls back to gptq)")
    if "desc_act" in qc and not isinstance(desc_act, bool):
        errors.append(f"quantization_config.desc_act = {desc_act!r}: expected true or false")
    if desc_act is True:
        warnings.append("desc_act=true: act-order g_idx makes gptq_marlin reorder activations (slower)")
    fmt = qc.get("checkpoint_format", qc.get("format"))
    key = "checkpoint_format" if "checkpoint_format" in qc else "format"
    if fmt is None:
        warnings.append("quantization_config has no checkpoint_format; loaders assume 'gptq' (v1 zeros)")
    elif fmt != "gptq":
        errors.append(f"quantization_config.{key} = {fmt!r}: expected 'gptq' (v1 layout, qzeros = zero - 1)")
    lm_head = qc.get("lm_head", False)
    if not isinstance(lm_head, bool):
        errors.append(f"quantization_config.lm_head = {lm_head!r}: expected true or false")

    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        errors.append(f"quantization_config.dynamic must be an object of pattern -> overrides, got {dynamic!r}")
        dynamic = {}
    for pattern, overrides in dynamic.items():
        where = f"quantization_config.dynamic[{pattern!r}]"
        body = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
        try:
            re.compile(body)
        except re.error as exc:
            errors.append(f"{where}: not a valid regular expression ({exc})")
        if not isinstance(overrides, dict):
            errors.append(f"{where}: overrides must be an object, got {overrides!r}")
            continue
        if pattern.startswith("-:"):
            continue
        o_bits, o_gs = overrides.get("bits", bits), overrides.get("group_size", gs)
        if "bits" in overrides and (isinstance(o_bits, bool) or o_bits not in SUPPORTED_BITS):
            errors.append(f"{where}.bits = {o_bits!r}: gptq_marlin takes 4 or 8")
        if "group_size" in overrides and (isinstance(o_gs, bool) or o_gs not in MARLIN_GROUP_SIZES):
            errors.append(f"{where}.group_size = {o_gs!r}: gptq_marlin takes one of {list(MARLIN_GROUP_SIZES)}")
        if "sym" in overrides and overrides["sym"] is not True:
            errors.append(f"{where}.sym = {overrides['sym']!r}: gptq_marlin needs sym=true")
        if "desc_act" in overrides and not isinstance(overrides["desc_act"], bool):
            errors.append(f"{where}.desc_act = {overrides['desc_act']!r}: expected true or false")
    return dynamic


def _partition(
    tensor: str, kind: str | None, in_f: int, out_f: int, tp: int, head_dim: int | None, errors: list[str]
) -> tuple[int, int] | None:
    """(in, out) of the shard of ``tensor`` one tensor-parallel rank holds, or None (error recorded)."""
    if tp == 1 or kind is None:
        return in_f, out_f
    split = TP_SPLIT[kind]
    if split == "row":
        if in_f % tp:
            errors.append(f"{tensor}: row-parallel in_features={in_f} is not divisible by tp={tp}")
            return None
        return in_f // tp, out_f
    if split in ("heads", "kv_heads") and head_dim is not None and out_f % head_dim == 0:
        heads = out_f // head_dim
        if heads >= tp:
            if heads % tp:
                errors.append(f"{tensor}: {heads} heads of size {head_dim} do not split over tp={tp}")
                return None
            return in_f, heads // tp * head_dim
        if split == "kv_heads" and tp % heads == 0:
            return in_f, head_dim  # fewer kv heads than ranks: each rank holds one replicated head
        errors.append(f"{tensor}: {heads} heads of size {head_dim} do not split over tp={tp}")
        return None
    if out_f % tp:
        errors.append(f"{tensor}: column-parallel out_features={out_f} is not divisible by tp={tp}")
        return None
    return in_f, out_f // tp


def _marlin_shape(name: str, in_p: int, out_p: int, gs: int, tp: int, errors: list[str]) -> None:
    tensor = f"{name}.qweight"
    split = f" (tp={tp} shard)" if tp > 1 else ""
    # lm_head rows are padded to a multiple of 64 per rank at load, so only its input is constrained.
    if name != "lm_head" and out_p % MARLIN_MIN_N:
        errors.append(f"{tensor}: output partition {out_p}{split} is not a multiple of {MARLIN_MIN_N} (gptq_marlin)")
    if in_p % MARLIN_MIN_K:
        errors.append(f"{tensor}: input partition {in_p}{split} is not a multiple of {MARLIN_MIN_K} (gptq_marlin)")
    if gs > 0 and in_p % gs:
        errors.append(f"{tensor}: input partition {in_p}{split} is not a multiple of group_size {gs}")


def _layer_head_dim(config: SalaConfig, module: str) -> int | None:
    parts = split_layer_name(module)
    if parts is None or not 0 <= parts[0] < config.num_hidden_layers:
        return None
    return head_dim(config, config.mixer_types[parts[0]])


def marlin_shape_problems(
    config: SalaConfig, module: str, in_features: int, out_features: int, group_size: int, tp: int = 1
) -> list[str]:
    """What gptq_marlin would refuse about this decoder linear's tensor-parallel shard (empty when it fits)."""
    parts = split_layer_name(module)
    kind = parts[1] if parts and parts[1] in TP_SPLIT else None
    head_dim = _layer_head_dim(config, module)
    errors: list[str] = []
    part = _partition(f"{module}.qweight", kind, in_features, out_features, tp, head_dim, errors)
    if part is not None:
        _marlin_shape(module, part[0], part[1], group_size, tp, errors)
    return errors


def tp_problems(config: SalaConfig, tp: int) -> list[str]:
    """Where SGLang could not split this model's decoder linears over ``tp`` GPUs, whatever their format (whole
    heads per rank, divisible inputs or outputs); empty when every one splits. The first layer of each kind
    stands for the others (same shapes)."""
    errors: list[str] = []
    for kind in dict.fromkeys(config.mixer_types):
        i = config.mixer_types.index(kind)
        for spec in layer_linears(config, kind):
            module = f"model.layers.{i}.{spec.name}"
            _partition(module, spec.name, spec.in_features, spec.out_features, tp, head_dim(config, kind), errors)
    return errors


def _zeros_word(bits: int) -> int:
    """The v1 qzeros int32 word of symmetric ``bits``: zero - 1 = 2**(bits-1) - 1 in every field."""
    field_value = (1 << (bits - 1)) - 1
    word = 0
    for j in range(32 // bits):
        word |= field_value << (bits * j)
    return word - (1 << 32) if word >= 1 << 31 else word


def _check_gptq_module(
    reader: CheckpointReader,
    name: str,
    leaves: set[str],
    bits: int,
    gs: int,
    desc_act: bool,
    kind: str | None,
    tp: int,
    head_dim: int | None,
    errors: list[str],
) -> None:
    """Tensors of one quantized linear: presence, dtypes, shapes (A.1 layout), qzeros, g_idx, TP shards."""
    missing = [t for t in GPTQ_TENSORS if t not in leaves]
    for t in missing:
        errors.append(f"{name}.{t} is missing (a GPTQ linear needs {', '.join(GPTQ_TENSORS)})")
    for t in sorted(leaves - {*GPTQ_TENSORS, "bias"}):
        errors.append(f"{name}.{t}: unexpected next to {name}.qweight (a GPTQ linear holds only {GPTQ_TENSORS})")
    if missing:
        return
    n_errors = len(errors)
    expected_dtypes = {"qweight": torch.int32, "qzeros": torch.int32, "g_idx": torch.int32, "scales": torch.float16}
    for t, want in expected_dtypes.items():
        got = reader.dtype(f"{name}.{t}")
        if got != want:
            errors.append(f"{name}.{t}: dtype {got} is not {want}")
    qw, qz = reader.shape(f"{name}.qweight"), reader.shape(f"{name}.qzeros")
    sc, gi = reader.shape(f"{name}.scales"), reader.shape(f"{name}.g_idx")
    shapes = {"qweight": qw, "qzeros": qz, "scales": sc}
    for t, shape in shapes.items():
        if len(shape) != 2:
            errors.append(f"{name}.{t}: expected a 2-D tensor, got shape {list(shape)}")
    if len(gi) != 1:
        errors.append(f"{name}.g_idx: expected a 1-D tensor [in], got shape {list(gi)}")
    if len(errors) > n_errors:
        return
    pack = 32 // bits
    in_f, out_f = gi[0], qw[1]
    rule = f"{bits}-bit"
    if in_f % pack or qw[0] != in_f // pack:
        hint = ""
        if qw[0] and (qw[0] * 32) % in_f == 0 and (qw[0] * 32) // in_f in (2, 3, 4, 8) and in_f % pack == 0:
            hint = f"; the rows fit {qw[0] * 32 // in_f}-bit packing (is a dynamic rule for this module missing?)"
        errors.append(
            f"{name}.qweight: shape {list(qw)} does not match [in * bits / 32, out] = [{in_f} * {bits} / 32, "
            f"{out_f}] for {rule} (in from g_idx){hint}"
        )
        return
    groups = 1 if gs == -1 else math.ceil(in_f / gs)
    if sc != (groups, out_f):
        errors.append(
            f"{name}.scales: shape {list(sc)}, expected [groups, out] = [{groups}, {out_f}] (group_size {gs})"
        )
    if out_f % pack:
        errors.append(f"{name}.qzeros: out_features={out_f} is not a multiple of {pack} ({rule} packing)")
    elif qz != (groups, out_f // pack):
        errors.append(
            f"{name}.qzeros: shape {list(qz)}, expected [groups, out * bits / 32] = [{groups}, {out_f // pack}]"
        )
    if "bias" in leaves and reader.shape(f"{name}.bias") != (out_f,):
        errors.append(f"{name}.bias: shape {list(reader.shape(f'{name}.bias'))}, expected [{out_f}]")
    if len(errors) > n_errors:
        return

    qzeros = reader.get(f"{name}.qzeros")
    word = _zeros_word(bits)
    bad = (qzeros != word).nonzero()
    if bad.numel():
        r, c = (int(v) for v in bad[0])
        found = int(qzeros[r, c]) & 0xFFFFFFFF
        errors.append(
            f"{name}.qzeros: word [{r}, {c}] is {found:#010x}, expected {word & 0xFFFFFFFF:#010x} "
            f"(symmetric {bits}-bit v1 stores zero - 1 = {(1 << (bits - 1)) - 1} in every field); "
            f"{bad.shape[0]} word(s) differ"
        )
    g_idx = reader.get(f"{name}.g_idx").to(torch.int64)
    monotonic = bool((g_idx[1:] >= g_idx[:-1]).all()) if in_f > 1 else True
    if desc_act and gs != -1:
        if not monotonic:
            errors.append(f"{name}.g_idx: not monotonic (act-order permutation); salaquant requires monotonic g_idx")
        elif in_f and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            errors.append(f"{name}.g_idx: values outside [0, {groups})")
    else:
        expected = torch.arange(in_f, dtype=torch.int64) // gs if gs > 0 else torch.zeros(in_f, dtype=torch.int64)
        if not torch.equal(g_idx, expected):
            what = "not monotonic" if not monotonic else "not equal to i // group_size"
            errors.append(
                f"{name}.g_idx: {what} while desc_act=false (the kernel ignores g_idx, so the weights would be "
                "dequantized with the wrong groups)"
            )
    scales = reader.get(f"{name}.scales")
    if not bool(torch.isfinite(scales).all()):
        errors.append(f"{name}.scales: holds inf or NaN")

    part = _partition(f"{name}.qweight", kind, in_f, out_f, tp, head_dim, errors)
    if part is not None:
        _marlin_shape(name, part[0], part[1], gs, tp, errors)


def _natural_key(name: str) -> tuple[bool, list[Any]]:
    """Checkpoint order: ``model.*`` by layer number, then the rest (lm_head)."""
    return not name.startswith("model."), [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _describe(quantized: bool, bits: int, gs: int) -> str:
    return f"GPTQ {bits}-bit/g{gs}" if quantized else "not quantized"


def _rule(pattern: str | None) -> str:
    return "no dynamic rule matches" if pattern is None else f"rule {pattern!r}"


def check_gptq(reader: CheckpointReader, config: dict[str, Any], tp: int) -> CheckReport:
    """Check a GPTQ (v1) checkpoint for vLLM / SGLang ``gptq_marlin``."""
    qc: dict[str, Any] = config["quantization_config"]
    sala = SalaConfig.from_dict(config)  # valid: check_checkpoint checked the tensors against it
    errors: list[str] = []
    report = CheckReport(format="gptq")
    dynamic = _check_gptq_config(qc, errors, report.warnings)
    fail(errors, f"{reader.path / 'config.json'} quantization_config")
    bits: int = qc["bits"]
    gs: int = qc["group_size"]
    desc_act: bool = qc["desc_act"]
    lm_head_flag: bool = qc.get("lm_head", False)
    if lm_head_flag or "lm_head.qweight" in reader:
        what = "lm_head=true" if lm_head_flag else "lm_head.qweight"
        errors.append(f"lm_head: quantized ({what}); {LM_HEAD_REFUSAL}")

    side = reader.path / "quantize_config.json"
    if side.is_file():
        try:
            if json.loads(side.read_text(encoding="utf-8")) != qc:
                report.warnings.append("quantize_config.json differs from config.json quantization_config")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            report.warnings.append(f"quantize_config.json cannot be parsed: {exc}")

    modules: dict[str, set[str]] = {}
    for tensor in reader:
        module, _, leaf = tensor.rpartition(".")
        modules.setdefault(module, set()).add(leaf)

    def settings(module: str, base_quantized: bool = True) -> tuple[bool, int, int, bool, str | None]:
        quantized, overrides = resolve(dynamic, module)
        return (
            base_quantized and quantized,
            overrides.get("bits", bits),
            overrides.get("group_size", gs),
            overrides.get("desc_act", desc_act),
            first_match(dynamic, module),
        )

    # Decoder linears, plus lm_head; anything else holding a qweight is checked without a TP split.
    linears: dict[str, str | None] = {}
    for module, leaves in modules.items():
        parts = split_layer_name(module)
        if parts and parts[1] in TP_SPLIT and leaves & {"qweight", "weight"}:
            linears[module] = parts[1]
        elif module == "lm_head" and leaves & {"qweight", "weight"}:
            linears[module] = None
        elif "qweight" in leaves:
            linears[module] = None
            report.warnings.append(
                f"{module}: quantized module of unknown kind; checked without a tensor-parallel split"
            )

    # Fused groups: the engines resolve the fused name (SGLang; vLLM sparse layers) or the member names
    # (vLLM lightning layers); all must agree, and storage must agree.
    for module in sorted(linears, key=_natural_key):
        fused = fused_name(module)
        if fused is None:
            continue
        mine, theirs = settings(module), settings(fused)
        if mine[:3] != theirs[:3]:
            errors.append(
                f"{module}: dynamic gives it {_describe(*mine[:3])} ({_rule(mine[4])}) but the fused "
                f"{fused} {_describe(*theirs[:3])} ({_rule(theirs[4])}); fused members must share bits and group size"
            )
    groups: dict[str, list[str]] = {}
    for module in linears:
        fused = fused_name(module)
        if fused is not None:
            groups.setdefault(fused, []).append(module)
    for fused, members in sorted(groups.items(), key=lambda kv: _natural_key(kv[0])):
        stored = {m: "qweight" in modules[m] for m in members}
        if len(set(stored.values())) > 1:
            shown = ", ".join(f"{m} ({'GPTQ' if q else 'plain weight'})" for m, q in sorted(stored.items()))
            errors.append(f"{fused}: fused members must be all quantized or all plain, got {shown}")

    listed = _listed_modules(qc, errors)
    quantized_bits: dict[str, int] = {}

    for module in sorted(linears, key=_natural_key):
        kind = linears[module]
        leaves = modules[module]
        base = lm_head_flag if module == "lm_head" else True
        quantized, m_bits, m_gs, m_desc, rule = settings(module, base)
        stored_q, stored_w = "qweight" in leaves, "weight" in leaves
        if quantized:
            if not stored_q:
                if stored_w:
                    fix = (
                        "set lm_head=false or quantize it"
                        if module == "lm_head"
                        else f"add a negative rule such as '-:{re.escape(module)}$' to dynamic, or quantize it"
                    )
                    errors.append(
                        f"{module}.weight: stored as plain {reader.dtype(module + '.weight')} but the config quantizes "
                        f"{module} (no negative dynamic rule matches); SGLang builds a GPTQ layer and fails with "
                        f"KeyError: '{fused_name(module) or module}.weight'; {fix}"
                    )
                else:
                    errors.append(f"{module}: no qweight (the config quantizes it)")
                continue
            head = _layer_head_dim(sala, module)
            _check_gptq_module(reader, module, leaves, m_bits, m_gs, m_desc, kind, tp, head, errors)
            report.quantized.append(module)
            quantized_bits[module] = m_bits
        else:
            why = "lm_head=false" if module == "lm_head" and not lm_head_flag else f"dynamic {_rule(rule)}"
            if stored_q:
                errors.append(f"{module}.qweight: present, but {why} leaves {module} unquantized")
                continue
            if not stored_w:
                errors.append(f"{module}.weight is missing ({why} leaves the module unquantized)")
                continue
            dtype = reader.dtype(module + ".weight")
            if dtype not in _PLAIN_WEIGHT_DTYPES:
                errors.append(f"{module}.weight: dtype {dtype}, expected bfloat16 or float16 ({why})")
                continue
            report.unquantized.append(module)

    if listed is not None:
        _check_listed(listed, report, errors)
    elif plain := [m for m in report.unquantized if m != "lm_head"]:
        report.warnings.append(
            "quantization_config has no modules_in_block_to_quantize: transformers' GPTQ path (optimum) ignores "
            f"dynamic and would build quantized layers for the {len(plain)} plain decoder linears"
        )
    mixed = sorted({b for b in quantized_bits.values() if b != bits})
    if mixed:
        report.warnings.append(
            f"per-module bits ({', '.join(map(str, mixed))} besides {bits}): SGLang, vLLM and GPTQModel.load read them "
            f"from dynamic; transformers' GPTQ path (optimum) builds every quantized linear with {bits} bits and "
            "refuses this export (size mismatch)"
        )
    fail(errors, str(reader.path))
    return report


def _listed_modules(qc: dict[str, Any], errors: list[str]) -> list[str] | None:
    """``modules_in_block_to_quantize`` flattened (a list of lists of names, or a list of names); None if absent."""
    value = qc.get("modules_in_block_to_quantize")
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    flat = [s for item in items for s in (item if isinstance(item, list) else [item])]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in flat):
        errors.append(
            f"quantization_config.modules_in_block_to_quantize = {value!r}: expected a list of lists of module names"
        )
        return None
    return flat


def _check_listed(listed: list[str], report: CheckReport, errors: list[str]) -> None:
    """``modules_in_block_to_quantize`` against the stored linears, as both of its readers match it: optimum
    (transformers' GPTQ path) quantizes a linear whose name ends with a listed string, vLLM one whose name
    contains one. Either reading must give exactly the stored quantized linears."""
    for module in report.quantized:
        if module == "lm_head":
            continue
        if not any(s in module for s in listed):
            errors.append(
                f"{module}.qweight: quantized, but modules_in_block_to_quantize does not list it "
                "(vLLM would build an unquantized layer)"
            )
        if not any(module.endswith(s) for s in listed):
            errors.append(
                f"{module}.qweight: quantized, but no modules_in_block_to_quantize entry ends its name "
                "(transformers' GPTQ path would build a plain linear and drop the GPTQ tensors)"
            )
    for module in report.unquantized:
        if module == "lm_head":
            continue
        ends = [s for s in listed if module.endswith(s)]
        inside = [s for s in listed if s in module]
        if ends or inside:
            errors.append(
                f"{module}.weight: stored plain, but modules_in_block_to_quantize entry {(ends or inside)[0]!r} "
                f"selects it ({'transformers' if ends else 'vLLM'} would build a GPTQ layer); list full names such "
                "as model.layers.{i}.mlp.up_proj"
            )
    known = set(report.quantized) | set(report.unquantized)
    for entry in listed:
        if not any(m.endswith(entry) for m in known):
            errors.append(f"modules_in_block_to_quantize entry {entry!r} names no linear of this checkpoint")
