"""The one pipeline every quantization method runs: checks -> calibration -> budget -> engine -> export -> check.

A method (`Method`: ``gptq.command.GPTQMethod``, ``nvfp4.command.NVFP4Method``) brings what differs: how the run
executes and writes (``run``, an `Execution`), its plan of which linears take which format (validated before any
data or model work), its budget units and probe, the statistics its layer quantizer reads, the quantizer itself,
the summary table, the quantization config and the checker of its format. `run_method` does the rest in one order
for all of them: refusals before any work, a space check before and after the data is read, one guarded work
folder (resumable), the budget search, the layer-by-layer engine, the staged export that the checker and a
recipe's gate see before it replaces the output, and one voice under torchrun (rank 0 prints and writes).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from rich.console import Console
from rich.table import Table

from .budget.search import BudgetPlan, BudgetSearch, SearchOptions, budget_range, plan_budget, record_budget
from .budget.size import Budget, Unit, parse_budget
from .calibration.calib_data import CalibOptions
from .calibration.contract import EngineOptions, LayerQuantizer
from .calibration.distributed import Ranks, barrier, device_for
from .calibration.engine import CalibrationEngine
from .devices import resolve_device
from .export import export_checkpoint
from .formats.report import CheckReport
from .io.reader import CheckpointReader
from .model.config import SalaConfig
from .outputs import work_dir_for
from .settings import defaults, parse_size
from .work_folder import guarded_run
from .workflow import check_run_space, prepare_calibration, run_report, start_run

_DEFAULTS = defaults("gptq")


@dataclass(frozen=True)
class Execution:
    """How a run executes and writes, whatever its method; defaults are ``salaquant.settings``'."""

    device: str = _DEFAULTS.engine.device
    chunk_tokens: int = _DEFAULTS.engine.chunk_tokens
    propagate: str = _DEFAULTS.engine.propagate
    max_shard_bytes: int = parse_size(_DEFAULTS.export.shard_size)
    resume: bool = False
    overwrite: bool = False
    show_progress: bool = True


class Method(Protocol):
    """What one quantization method brings to `run_method` (methods keep their plan as state)."""

    run: Execution  # how the run executes and writes
    budget: str | None  # an export size to choose formats under, or None
    budget_search: SearchOptions

    def prepare(self, config: SalaConfig, console: Console) -> None:
        """Build and validate the plan; raise before any data or model work."""

    def units(self, config: SalaConfig) -> list[Unit]:
        """The budget's units (called only with a budget)."""

    def probe(self) -> Any:
        """The budget search's probe of each unit's options."""

    def apply_budget(self, config: SalaConfig, units: list[Unit], choice: list[int]) -> None:
        """Take the budget's chosen option for every unit into the plan."""

    def export_bytes(self, config: SalaConfig) -> int:
        """The export's size, for the space check."""

    def settings(self, calib: CalibOptions, budget_choice: dict[str, str] | None) -> dict[str, Any]:
        """What the run records (and the engine fingerprints for resume)."""

    def statistics(self) -> dict[str, Any]:
        """The ``EngineOptions`` fields of the statistics the layer quantizer reads."""

    def quantizer(self, config: SalaConfig, total_tokens: int, ranks: Ranks) -> LayerQuantizer:
        """The layer quantizer the engine runs."""

    def summary(self, reports: list[dict[str, Any]]) -> tuple[Table, dict[str, dict[str, float]]]:
        """The per-linear table printed after calibration, and its figures for the report."""

    def export_config(self, config: SalaConfig) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(quantization_config, {file name: content})``: the config.json entry and the format's own files."""

    def check(self, staged: Path, output: Path) -> CheckReport:
        """The format checker on the staged export."""

    def done(self, output: Path, check: CheckReport, export_seconds: float) -> str:
        """The line that reports the written export."""


def run_method(
    model: Path,
    output: Path,
    sources: list[str],
    calib: CalibOptions,
    method: Method,
    console: Console,
    extra_files: dict[str, Any] | None = None,
    accept: Callable[[Path], None] | None = None,
) -> Path:
    """Quantize ``model`` into ``output`` with ``method``, run as its ``method.run`` says. ``accept`` (a recipe's eval
    gate) sees the complete, format-checked export before it is moved to ``output``; it raises an `ExportRejected`
    to keep it beside ``output`` instead."""
    run = method.run
    config, ranks = start_run(model, output, sources, device=run.device, overwrite=run.overwrite, resume=run.resume)
    if not ranks.main:  # one voice: rank 0 prints, shows progress and writes the export
        console = Console(quiet=True)
    method.prepare(config, console)  # bad plans fail before any data or model work
    budget = parse_budget(method.budget) if method.budget is not None else None
    units = method.units(config) if budget is not None else []
    if budget is not None:
        with CheckpointReader(model) as reader:
            budget_range(reader, config, units, budget)  # a budget that cannot be met fails before any work
    work = work_dir_for(output)
    device = device_for(ranks, resolve_device(run.device))
    size = method.export_bytes(config)
    check_run_space(output, config, size, size, run.resume)  # before the data is read; its hidden states after
    with guarded_run(work, resume=run.resume, overwrite=run.overwrite, ranks=ranks):
        data = prepare_calibration(model, sources, calib, console)
        check_run_space(output, config, size, size, run.resume, data.total_tokens)
        samples = [s.ids for s in data.samples]
        chosen = _search_budget(method, budget, units, work, run, model, config, samples, device, console, ranks)
        choice = None if chosen is None else {u.full_name: chosen.option(k) for k, u in enumerate(units)}
        settings = method.settings(calib, choice)
        engine_opts = EngineOptions(
            device=run.device,
            chunk_tokens=run.chunk_tokens,
            propagate=run.propagate,
            show_progress=run.show_progress,
            **method.statistics(),
        )
        engine = CalibrationEngine(model, samples, work, engine_opts, settings, ranks)
        t0 = time.perf_counter()
        result = engine.run(method.quantizer(config, data.total_tokens, ranks), resume=run.resume)
        engine.release()  # the hidden states are no longer needed: keep them out of the export's peak
        t_calib = time.perf_counter() - t0
        if not ranks.main:
            barrier(ranks)  # until rank 0 has written the export: every process ends with the run
            return output

        table, summary = method.summary(result.reports)
        console.print(table)
        qconfig, own_files = method.export_config(config)
        report = run_report(engine, data, result, t_calib, summary)
        t1 = time.perf_counter()
        files = {**own_files, "quant_report.json": report, "salaquant_settings.json": settings, **(extra_files or {})}
        opts = {"max_shard_bytes": run.max_shard_bytes, "overwrite": run.overwrite}
        with export_checkpoint(model, output, result, qconfig, files, **opts) as staged:
            check = method.check(staged, output)
            if chosen is not None:
                record_budget(chosen, config, model, staged, samples, device, console)
            barrier(ranks)  # the other processes are done; the gate runs on this one alone
            if accept is not None:
                accept(staged)
        shutil.rmtree(work, ignore_errors=True)
        console.print(method.done(output, check, time.perf_counter() - t1))
        check.print_to(console)
    return output


def _search_budget(
    method: Method,
    budget: Budget | None,
    units: list[Unit],
    work: Path,
    run: Execution,
    model: Path,
    config: SalaConfig,
    samples: list[torch.Tensor],
    device: torch.device,
    console: Console,
    ranks: Ranks,
) -> BudgetPlan | None:
    """The budget's choice of every unit's option, taken into the method's plan (None without a budget)."""
    if budget is None:
        return None
    with CheckpointReader(model) as reader:
        search = BudgetSearch(
            reader, config, samples, units, method.probe(), budget, method.budget_search, device, console, ranks
        )
        chosen = plan_budget(work, run.resume, search)
    method.apply_budget(config, units, chosen.choice)
    return chosen
