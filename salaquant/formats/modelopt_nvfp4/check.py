"""The ModelOpt NVFP4 checker: what SGLang's and vLLM's ``modelopt_fp4`` loaders need of a checkpoint."""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

from ...io.files import read_json_object
from ...io.reader import CheckpointReader
from ...model.config import SalaConfig
from ...model.layout import FUSED_PARAMETERS, layer_linears
from ..report import CheckReport, fail

__all__ = ["NVFP4_TENSORS", "check_modelopt", "excluded_by", "shape_problems"]

NVFP4_TENSORS = {
    "weight": torch.uint8,
    "weight_scale": torch.float8_e4m3fn,
    "weight_scale_2": torch.float32,
    "input_scale": torch.float32,
}


def shape_problems(reader: CheckpointReader, name: str, shape: tuple[int, ...]) -> list[str] | None:
    """Whether the packed codes standing for parameter ``name`` of ``shape`` [out, in] (as ``config.json`` implies
    it) are ``[out, in / 2]``; None when ``name`` is not stored as NVFP4 codes."""
    if name not in reader or reader.dtype(name) != torch.uint8 or len(shape) != 2:
        return None
    want = (shape[0], shape[1] // 2)
    got = tuple(reader.shape(name))
    return [] if got == want else [f"{name}: shape {list(got)}, config.json implies {list(want)}"]


def excluded_by(patterns: list[str], module: str) -> bool:
    """vLLM's rule: exact match, then ``module*`` meaning the module and everything below it, then fnmatch."""
    for p in patterns:
        if module == p or (p.endswith("*") and (module == p[:-1].rstrip(".") or module.startswith(p[:-1]))):
            return True
        if fnmatch.fnmatch(module, p):
            return True
    return False


def check_modelopt(reader: CheckpointReader, config: dict[str, Any], tp: int) -> CheckReport:
    """Check a ModelOpt NVFP4 checkpoint for SGLang / vLLM ``modelopt_fp4`` (NVFP4 shards need no TP check)."""
    qc = config["quantization_config"]
    errors: list[str] = []
    if qc.get("quant_algo") != "NVFP4":
        errors.append(f"quantization_config.quant_algo is {qc.get('quant_algo')!r}, expected 'NVFP4'")
    excl = qc.get("exclude_modules", qc.get("ignore"))
    if not isinstance(excl, list) or not excl:
        errors.append("quantization_config.exclude_modules must be a non-empty list (at least lm_head)")
        excl = []
    hf_path = reader.path / "hf_quant_config.json"
    if hf_path.exists():
        nested = read_json_object(hf_path).get("quantization", {})
        if not isinstance(nested, dict):
            errors.append("hf_quant_config.json: quantization is not a JSON object")
            nested = {}
        for key in ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"):
            if key not in nested:
                errors.append(f"hf_quant_config.json: quantization.{key} is missing (vLLM requires the key)")
        if nested.get("exclude_modules") != excl:
            errors.append("hf_quant_config.json exclude_modules differ from config.json's")
    else:
        errors.append("hf_quant_config.json is missing")
    if any(k.endswith(".pre_quant_scale") for k in reader):
        errors.append("pre_quant_scale tensors found: salaquant folds every scale; stock loaders ignore them")

    sala = SalaConfig.from_dict(config)
    report = CheckReport(format="modelopt-nvfp4")
    for i, kind in enumerate(sala.mixer_types):
        stored: dict[str, bool] = {}
        for spec in layer_linears(sala, kind):
            module = f"model.layers.{i}.{spec.name}"
            is_fp4 = reader.dtype(f"{module}.weight") == torch.uint8 if f"{module}.weight" in reader else False
            stored[spec.name] = is_fp4
            if excluded_by(excl, module):
                if is_fp4 or f"{module}.weight_scale" in reader:
                    errors.append(f"{module}.weight: NVFP4 tensors present but exclude_modules excludes {module}")
                elif f"{module}.weight" not in reader or reader.dtype(f"{module}.weight") not in (
                    torch.bfloat16,
                    torch.float16,
                ):
                    errors.append(f"{module}.weight: excluded module must hold a bf16/fp16 weight")
                report.unquantized.append(module)
                continue
            missing = [t for t in NVFP4_TENSORS if f"{module}.{t}" not in reader]
            if missing:
                for t in missing:
                    errors.append(
                        f"{module}.{t} is missing ({module} is not excluded, so it needs {', '.join(NVFP4_TENSORS)}; "
                        "SGLang would serve the bytes it never wrote)"
                    )
                continue
            for t, dtype in NVFP4_TENSORS.items():
                if reader.dtype(f"{module}.{t}") != dtype:
                    errors.append(f"{module}.{t}: dtype {reader.dtype(f'{module}.{t}')}, expected {dtype}")
            if spec.in_features % 16:
                errors.append(f"{module}.weight: in_features {spec.in_features} is not a multiple of 16")
            if tuple(reader.shape(f"{module}.weight")) != (spec.out_features, spec.in_features // 2):
                errors.append(
                    f"{module}.weight: shape {list(reader.shape(f'{module}.weight'))}, expected "
                    f"{[spec.out_features, spec.in_features // 2]}"
                )
            if tuple(reader.shape(f"{module}.weight_scale")) != (spec.out_features, spec.in_features // 16):
                errors.append(
                    f"{module}.weight_scale: shape {list(reader.shape(f'{module}.weight_scale'))}, "
                    f"expected {[spec.out_features, spec.in_features // 16]}"
                )
            for t in ("weight_scale_2", "input_scale"):
                v = reader.get(f"{module}.{t}")
                if v.numel() != 1 or not bool(torch.isfinite(v).all()) or float(v) <= 0:
                    errors.append(f"{module}.{t}: must be one positive finite fp32 value, got {v.tolist()}")
            report.quantized.append(module)
        for fused, members in FUSED_PARAMETERS.items():
            present = [m for m in members if m in stored]
            if len({stored[m] for m in present}) > 1:
                errors.append(
                    f"model.layers.{i}.{fused}: members must be all NVFP4 or all bf16 "
                    f"({', '.join(f'{m}={stored[m]}' for m in present)})"
                )
                continue
            if present and stored[present[0]]:
                for t in ("weight_scale_2", "input_scale"):
                    vals = {float(reader.get(f"model.layers.{i}.{m}.{t}")) for m in present}
                    if len(vals) > 1:
                        errors.append(
                            f"model.layers.{i}.{fused}: {t} differs across {', '.join(present)} "
                            f"({sorted(vals)}); engines take the max without rescaling block scales"
                        )
    if "lm_head.weight" in reader and reader.dtype("lm_head.weight") == torch.uint8:
        errors.append("lm_head.weight: NVFP4 lm_head is not supported by salaquant exports")
    fail(errors, str(reader.path))
    del tp
    return report
