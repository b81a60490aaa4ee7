"""``--budget`` for GPTQ: the units (fused q/k/v, fused gate/up, every other linear), their options (4-bit, 8-bit,
bf16) with gptq_marlin's bytes, the damage probe (round to nearest on the export's grid: the GPTQ solve needs the
statistics of the layer-by-layer run, which depend on the choice), and the plan a choice gives."""

from __future__ import annotations

from ..budget.size import Unit
from ..formats.gptq_v1.dynamic import LinearPlan
from ..formats.gptq_v1.packing import linear_bytes
from ..model.config import SalaConfig
from ..model.layout import FUSED_PARAMETERS, layer_linears
from ..model.modeling import DecoderLayer
from .layer import GPTQLayerOptions
from .solver import rtn

OPTIONS = ("4-bit", "8-bit", "bf16")
_BITS = {"4-bit": 4, "8-bit": 8}


def gptq_units(config: SalaConfig, plan: dict[str, LinearPlan]) -> list[Unit]:
    """Every layer's units in execution order. A unit whose linears ``plan`` keeps in bf16 (excluded, or shapes
    gptq_marlin cannot serve) has bf16 as its only option; the others choose among `OPTIONS`, with each member's
    group size from ``plan``."""
    units: list[Unit] = []
    for i, kind in enumerate(config.mixer_types):
        specs = {s.name: s for s in layer_linears(config, kind)}
        grouped = {m for members in FUSED_PARAMETERS.values() for m in members}
        names = [*FUSED_PARAMETERS.items(), *[(n, (n,)) for n in specs if n not in grouped]]
        names.sort(key=lambda item: list(specs).index(item[1][0]))
        for name, members in names:
            plans = [plan[f"model.layers.{i}.{m}"] for m in members]
            bf16 = sum(2 * specs[m].out_features * specs[m].in_features for m in members)
            weights = bf16 // 2
            if any(p.bits is None for p in plans):
                units.append(Unit(i, name, members, ("bf16",), (bf16,), weights))
                continue
            quantized = [
                sum(
                    linear_bytes(specs[m].out_features, specs[m].in_features, b, p.group_size)
                    for m, p in zip(members, plans, strict=True)
                )
                for b in (4, 8)
            ]
            units.append(Unit(i, name, members, OPTIONS, (*quantized, bf16), weights))
    return units


def gptq_probe(options: GPTQLayerOptions, plan: dict[str, LinearPlan]):
    """The damage probe: each member rounded to nearest at the option's bits, on the export's grid and group size
    (MSE-searched scales when the run uses them)."""

    def perturb(unit: Unit, option: str, layer: DecoderLayer) -> dict:
        out = {}
        for m in unit.members:
            weight = layer.get_submodule(m).weight.data.float()
            gs = plan[f"model.layers.{unit.layer}.{m}"].group_size
            out[m] = rtn(weight, options.solver_config(_BITS[option], gs)).dequantize()
        return out

    return perturb


def plan_of(units: list[Unit], choice: list[int], plan: dict[str, LinearPlan]) -> dict[str, LinearPlan]:
    """``plan`` with every unit's linears at its chosen option (bf16: excluded)."""
    out = dict(plan)
    for unit, k in zip(units, choice, strict=True):
        option = unit.options[k]
        for m in unit.members:
            name = f"model.layers.{unit.layer}.{m}"
            out[name] = LinearPlan(bits=_BITS.get(option), group_size=plan[name].group_size)
    return out
