"""``salaquant gptq``: calibration -> SmoothQuant -> full-Hessian GPTQ per layer -> GPTQ v1 export -> check."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..budget.search import SearchOptions
from ..budget.size import Unit
from ..calibration.calib_data import CalibOptions
from ..calibration.distributed import Ranks
from ..driver import Execution
from ..export import check_export
from ..formats.gptq_v1.config import quantization_config
from ..formats.gptq_v1.dynamic import LinearPlan
from ..formats.report import CheckReport
from ..model.config import SalaConfig
from ..settings import defaults
from ..summary import summarize
from .budget import gptq_probe, gptq_units, plan_of
from .layer import GPTQLayerOptions, GPTQLayerQuantizer
from .plan import BitsOptions, PlanError, build_plan, check_marlin_leaves_some, check_tp, marlin_exclusions

_DEFAULTS = defaults("gptq")


@dataclass(frozen=True)
class RunOptions(Execution):
    """How a GPTQ run executes and exports; defaults are ``salaquant.settings``'."""

    tp: int = _DEFAULTS.export.tp
    # keep linears that gptq_marlin cannot serve in bf16 (else the checker fails)
    marlin_fallback: bool = _DEFAULTS.export.marlin_fallback


def _summary_table(reports: list[dict[str, Any]]) -> tuple[Table, dict[str, dict[str, float]]]:
    """Mean relative output error per (layer kind, linear) for GPTQ and RTN."""
    acc: dict[str, list[tuple[float, float]]] = {}
    for rep in reports:
        for name, lin in rep.get("linears", {}).items():
            if lin.get("bits", 16) != 16:
                acc.setdefault(f"{rep['kind']} {name}", []).append((lin["rel_err"], lin["rtn_rel_err"]))
    table = Table(title="Relative output error on the calibration inputs (mean over layers)")
    for col in ("linear", "layers", "GPTQ", "RTN", "GPTQ / RTN"):
        table.add_column(col, justify="left" if col == "linear" else "right")
    summary: dict[str, dict[str, float]] = {}
    for key in sorted(acc):
        g = sum(a for a, _ in acc[key]) / len(acc[key])
        r = sum(b for _, b in acc[key]) / len(acc[key])
        summary[key] = {"gptq": g, "rtn": r}
        table.add_row(key, str(len(acc[key])), f"{g:.3e}", f"{r:.3e}", f"{g / r:.3f}" if r > 0 else "-")
    return table, summary


class GPTQMethod:
    """GPTQ W4A16 for `run_method`: bits per linear (``BitsOptions``), the layer solve (``GPTQLayerOptions``), the
    linears gptq_marlin cannot serve at ``tp`` kept in bf16 (``marlin_fallback``) or refused, GPTQ v1 export."""

    def __init__(self, bits: BitsOptions, layer: GPTQLayerOptions, run: RunOptions | None = None) -> None:
        self.bits, self.layer, self.run = bits, layer, run or RunOptions()
        self.tp, self.marlin_fallback = self.run.tp, self.run.marlin_fallback
        self.budget = bits.budget
        self.budget_search = SearchOptions(bits.budget_windows, bits.budget_seq_len)
        self.plan: dict[str, LinearPlan] = {}
        self.excluded: dict[str, list[str]] = {}

    def prepare(self, config: SalaConfig, console: Console) -> None:
        self.plan = build_plan(config, self.bits)
        if all(p.bits is None for p in self.plan.values()):
            raise PlanError("the bits options keep every linear in 16 bits: nothing to export as GPTQ")
        check_tp(config, self.tp)
        excluded = marlin_exclusions(config, self.plan, self.tp)
        if excluded and not self.marlin_fallback:
            first = next(iter(excluded.items()))
            raise PlanError(
                f"{len(excluded)} linears cannot be served by gptq_marlin at tp={self.tp}, e.g. {first[0]}: "
                f"{first[1][0]}; exclude them or allow --marlin-fallback"
            )
        check_marlin_leaves_some(self.plan, excluded, self.tp)
        if excluded:
            head = "" if config.tie_word_embeddings else " (lm_head, never quantized, is kept too)"
            console.print(
                f"[yellow]keeping {len(excluded)} decoder linears in bf16{head}: gptq_marlin cannot serve their "
                f"shapes at tp={self.tp} (--no-marlin-fallback fails instead):[/]"
            )
            for name, reasons in excluded.items():
                console.print(f"  {name}: {reasons[0]}")
        self.excluded = excluded

    def units(self, config: SalaConfig) -> list[Unit]:
        return gptq_units(config, self.plan)

    def probe(self) -> Any:
        return gptq_probe(self.layer, self.plan)

    def apply_budget(self, config: SalaConfig, units: list[Unit], choice: list[int]) -> None:
        self.plan = plan_of(units, choice, self.plan)

    def export_bytes(self, config: SalaConfig) -> int:
        return summarize(config).sizes["w4a16"]

    def settings(self, calib: CalibOptions, budget_choice: dict[str, str] | None) -> dict[str, Any]:
        return {
            "method": "gptq",
            "bits": dataclasses.asdict(self.bits),
            "gptq": dataclasses.asdict(self.layer),
            "marlin_exclusions": sorted(self.excluded),
            "calibration": dataclasses.asdict(calib),
            "budget_choice": budget_choice,
        }

    def statistics(self) -> dict[str, Any]:
        return {
            "hessian": True,
            "hessian_dtype": "fp64" if self.layer.fp64 else "fp32",
            "hessian_sums": (self.layer.hessian_weighting,),  # the one sum the solve reads
        }

    def quantizer(self, config: SalaConfig, total_tokens: int, ranks: Ranks) -> GPTQLayerQuantizer:
        return GPTQLayerQuantizer(config, self.plan, self.layer, ranks)

    def summary(self, reports: list[dict[str, Any]]) -> tuple[Table, dict[str, dict[str, float]]]:
        return _summary_table(reports)

    def export_config(self, config: SalaConfig) -> tuple[dict[str, Any], dict[str, Any]]:
        meta = {
            "damp_percent": self.layer.damp,
            "act_order_static_groups": self.layer.act_order,
            "mse": self.layer.mse,
            "smooth_alpha": self.layer.smooth_alpha,
            "hessian_weighting": self.layer.hessian_weighting,
        }
        qconfig = quantization_config(config, self.plan, self.bits.group_size, meta)
        return qconfig, {"quantize_config.json": qconfig}

    def check(self, staged: Path, output: Path) -> CheckReport:
        return check_export(staged, output, tp=self.tp)

    def done(self, output: Path, check: CheckReport, export_seconds: float) -> str:
        return (
            f"GPTQ checkpoint written to [bold]{output}[/] ({len(check.quantized)} quantized linears, "
            f"export {export_seconds:.1f} s); checks for gptq_marlin at tp={self.tp} passed"
        )
