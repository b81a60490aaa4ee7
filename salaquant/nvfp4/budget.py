"""``--budget`` for NVFP4: the units (each layer's attention block, which SGLang builds unquantized as a whole as
soon as one of its linears is excluded; the fused gate/up; down_proj), their options (NVFP4, bf16) with ModelOpt's
bytes, the damage probe (plain block scales, global scales shared within a fused group as the export shares them)
and the plan a choice gives."""

from __future__ import annotations

import torch

from ..budget.size import Unit
from ..formats.modelopt_nvfp4.numerics import global_scale, linear_bytes, quantize_nvfp4
from ..model.config import SalaConfig
from ..model.layout import FUSED_OF, FUSED_PARAMETERS, exclusion_block, layer_linears
from ..model.modeling import DecoderLayer
from .plan import NVFP4Plan

OPTIONS = ("nvfp4", "bf16")
_TINY = torch.finfo(torch.float32).tiny


def nvfp4_units(config: SalaConfig, plan: NVFP4Plan) -> list[Unit]:
    """Every layer's units in execution order: its attention block, then the MLP's fused gate/up and down_proj. A
    unit that ``plan`` excludes (an ``--exclude`` pattern) has bf16 as its only option."""
    units: list[Unit] = []
    for i, kind in enumerate(config.mixer_types):
        specs = layer_linears(config, kind)
        groups: dict[str, list[str]] = {}
        for s in specs:
            unit = exclusion_block(s.name) or FUSED_OF.get(s.name) or s.name
            groups.setdefault(unit, []).append(s.name)
        shape = {s.name: (s.out_features, s.in_features) for s in specs}
        for name, members in groups.items():
            weights = sum(o * n for o, n in (shape[m] for m in members))
            fp4 = sum(linear_bytes(*shape[m]) for m in members)
            if any(f"model.layers.{i}.{m}" in plan.excluded for m in members):
                units.append(Unit(i, name, tuple(members), ("bf16",), (2 * weights,), weights))
            else:
                units.append(Unit(i, name, tuple(members), OPTIONS, (fp4, 2 * weights), weights))
    return units


def nvfp4_probe(unit: Unit, option: str, layer: DecoderLayer) -> dict:
    """Each member quantized to NVFP4 and back with plain block scales; fused members share one global scale."""
    weights = {m: layer.get_submodule(m).weight.data.float() for m in unit.members}
    amax = {m: max(float(w.abs().amax()), _TINY) for m, w in weights.items()}  # an all-zero weight: no 0/0
    for members in FUSED_PARAMETERS.values():
        if all(m in weights for m in members):
            shared = max(amax[m] for m in members)
            amax.update(dict.fromkeys(members, shared))
    return {m: quantize_nvfp4(w, weight_scale_2=global_scale(amax[m])).dequantize() for m, w in weights.items()}


def plan_of(config: SalaConfig, units: list[Unit], choice: list[int], plan: NVFP4Plan) -> NVFP4Plan:
    """``plan`` with every unit's linears quantized or excluded as chosen."""
    quantized, excluded = set(plan.quantized), set(plan.excluded)
    for unit, k in zip(units, choice, strict=True):
        names = {f"model.layers.{unit.layer}.{m}" for m in unit.members}
        if unit.options[k] == "nvfp4":
            quantized |= names
            excluded -= names
        else:
            excluded |= names
            quantized -= names
    return NVFP4Plan(quantized=quantized, excluded=excluded, notes=list(plan.notes))
