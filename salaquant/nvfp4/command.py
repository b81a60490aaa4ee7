"""``salaquant nvfp4``: calibration -> 3-group SmoothQuant -> block-scale search -> GPTQ rounding (or nearest) ->
ModelOpt NVFP4 export -> check."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..budget.search import SearchOptions
from ..budget.size import Unit, parse_budget
from ..calibration.calib_data import CalibOptions
from ..calibration.distributed import Ranks
from ..driver import Execution
from ..export import check_export
from ..formats.modelopt_nvfp4.config import flat_quantization_config, hf_quant_config
from ..formats.report import CheckReport
from ..model.config import SalaConfig
from ..settings import defaults
from ..summary import summarize
from .budget import nvfp4_probe, nvfp4_units, plan_of
from .layer import HESSIAN_SUM, NVFP4LayerOptions, NVFP4LayerQuantizer
from .plan import NVFP4Plan, NVFP4PlanError, build_nvfp4_plan

_DEFAULTS = defaults("nvfp4")


@dataclass(frozen=True)
class NVFP4RunOptions(Execution):
    """Which linears an NVFP4 run quantizes, how it executes and exports; defaults are ``salaquant.settings``'."""

    dense_all: bool = _DEFAULTS.nvfp4.dense_all
    exclude: tuple[str, ...] = ()
    budget: str | None = None  # NVFP4 or bf16 for every unit, chosen by measurement under this size
    budget_windows: int = _DEFAULTS.quantization.budget_windows
    budget_seq_len: int = _DEFAULTS.quantization.budget_seq_len


def _summary(reports: list[dict[str, Any]]) -> tuple[Table, dict[str, dict[str, float]]]:
    """Mean relative errors per linear kind: diag-H weighted (searched and plain scales) and, with GPTQ rounding,
    under the full Hessian (GPTQ's and rounding to nearest under the same scales)."""
    keys = ("rel_err", "rel_err_plain_scales", "seconds", "hessian_rel_err", "hessian_rel_err_nearest")
    acc: dict[str, list[list[float]]] = {}
    for rep in reports:
        for name, lin in rep.get("linears", {}).items():
            if lin.get("format") == "nvfp4":
                acc.setdefault(f"{rep['kind']} {name}", []).append([lin.get(k, math.nan) for k in keys])
    gptq = any(not math.isnan(v[3]) for vs in acc.values() for v in vs)
    table = Table(title="Relative weighted error on the calibration inputs, mean over layers")
    cols = ["linear", "layers", "diag-H searched", "plain scales", "ratio", "seconds"]
    cols += ["full-H gptq", "nearest", "ratio"] if gptq else []
    for col in cols:
        table.add_column(col, justify="left" if col == "linear" else "right")
    out: dict[str, dict[str, float]] = {}
    for key in sorted(acc):
        n = len(acc[key])
        a, b, t, hg, hn = (sum(v[k] for v in acc[key]) / n for k in range(len(keys)))
        out[key] = {"searched": a, "plain": b} | ({"hessian_gptq": hg, "hessian_nearest": hn} if gptq else {})
        row = [key, str(n), f"{a:.3e}", f"{b:.3e}", f"{a / b:.3f}" if b else "-", f"{t:.3f}"]
        row += [f"{hg:.3e}", f"{hn:.3e}", f"{hg / hn:.3f}" if hn else "-"] if gptq else []
        table.add_row(*row)
    return table, out


class NVFP4Method:
    """NVFP4 for `run_method`: which blocks stay bf16 (SGLang's exclusions, ``dense_all``, ``exclude``), the
    block-scale search per layer (``NVFP4LayerOptions``), ModelOpt's export layout."""

    def __init__(self, layer: NVFP4LayerOptions | None = None, run: NVFP4RunOptions | None = None) -> None:
        self.layer, self.run = layer or NVFP4LayerOptions(), run or NVFP4RunOptions()
        self.budget = self.run.budget
        self.budget_search = SearchOptions(self.run.budget_windows, self.run.budget_seq_len)
        self.plan: NVFP4Plan | None = None

    def _plan(self) -> NVFP4Plan:
        assert self.plan is not None, "prepare() builds the plan"
        return self.plan

    def prepare(self, config: SalaConfig, console: Console) -> None:
        run = self.run
        if run.budget is not None and run.dense_all:
            raise NVFP4PlanError(f"--budget {run.budget} chooses every block's format itself: drop --dense-all")
        budget = parse_budget(run.budget) if run.budget is not None else None
        # with a budget every block may take NVFP4 (as dense-all) unless an --exclude pattern keeps it bf16
        self.plan = build_nvfp4_plan(config, run.dense_all or budget is not None, run.exclude)
        for note in self.plan.notes:
            console.print(f"[yellow]note:[/] {note}")

    def units(self, config: SalaConfig) -> list[Unit]:
        return nvfp4_units(config, self._plan())

    def probe(self) -> Any:
        return nvfp4_probe

    def apply_budget(self, config: SalaConfig, units: list[Unit], choice: list[int]) -> None:
        self.plan = plan_of(config, units, choice, self._plan())

    def export_bytes(self, config: SalaConfig) -> int:
        return summarize(config).sizes["nvfp4_dense_all" if self.run.dense_all else "nvfp4_default"]

    def settings(self, calib: CalibOptions, budget_choice: dict[str, str] | None) -> dict[str, Any]:
        return {
            "method": "nvfp4",
            "dense_all": self.run.dense_all,
            "exclude": list(self.run.exclude),
            "nvfp4": dataclasses.asdict(self.layer),
            "calibration": dataclasses.asdict(calib),
            "budget": self.run.budget,
            "budget_choice": budget_choice,
        }

    def statistics(self) -> dict[str, Any]:
        if self.layer.needs_hessian:  # GPTQ rounding: the one Hessian sum it solves with
            return {"hessian": True, "hessian_dtype": "fp32", "hessian_sums": (HESSIAN_SUM,)}
        return {"hessian": False}

    def quantizer(self, config: SalaConfig, total_tokens: int, ranks: Ranks) -> NVFP4LayerQuantizer:
        return NVFP4LayerQuantizer(config, self._plan(), self.layer, total_tokens, ranks)

    def summary(self, reports: list[dict[str, Any]]) -> tuple[Table, dict[str, dict[str, float]]]:
        return _summary(reports)

    def export_config(self, config: SalaConfig) -> tuple[dict[str, Any], dict[str, Any]]:
        exclude_modules = self._plan().exclude_modules(config)
        return flat_quantization_config(exclude_modules), {"hf_quant_config.json": hf_quant_config(exclude_modules)}

    def check(self, staged: Path, output: Path) -> CheckReport:
        return check_export(staged, output)

    def done(self, output: Path, check: CheckReport, export_seconds: float) -> str:
        return (
            f"NVFP4 checkpoint written to [bold]{output}[/] ({len(check.quantized)} NVFP4 linears, "
            f"{len(check.unquantized)} bf16); ModelOpt-format checks passed"
        )
