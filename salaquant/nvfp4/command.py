"""``salaquant nvfp4``: calibration -> 3-group SmoothQuant -> block-scale search -> ModelOpt NVFP4 export -> check."""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..budget.search import SearchOptions, budget_range, plan_budget, record_budget
from ..budget.size import parse_budget
from ..calib_data import CalibOptions
from ..distributed import barrier, device_for
from ..engine import CalibrationEngine, EngineOptions, resolve_device
from ..export import check_export, export_checkpoint
from ..formats.modelopt_nvfp4.config import flat_quantization_config, hf_quant_config
from ..model.checkpoint import CheckpointReader
from ..outputs import work_dir_for
from ..settings import defaults, parse_size
from ..summary import summarize
from ..work_folder import guarded_run
from ..workflow import check_run_space, prepare_calibration, run_report, start_run
from .budget import nvfp4_probe, nvfp4_units, plan_of
from .layer import NVFP4LayerOptions, NVFP4LayerQuantizer
from .plan import NVFP4PlanError, build_nvfp4_plan

_DEFAULTS = defaults("nvfp4")


@dataclass(frozen=True)
class NVFP4RunOptions:
    """Which linears an NVFP4 run quantizes, how it executes and exports; defaults are ``salaquant.settings``'."""

    dense_all: bool = _DEFAULTS.nvfp4.dense_all
    exclude: tuple[str, ...] = ()
    budget: str | None = None  # NVFP4 or bf16 for every unit, chosen by measurement under this size
    budget_windows: int = _DEFAULTS.quantization.budget_windows
    budget_seq_len: int = _DEFAULTS.quantization.budget_seq_len
    device: str = _DEFAULTS.engine.device
    chunk_tokens: int = _DEFAULTS.engine.chunk_tokens
    propagate: str = _DEFAULTS.engine.propagate
    max_shard_bytes: int = parse_size(_DEFAULTS.export.shard_size)
    resume: bool = False
    overwrite: bool = False
    show_progress: bool = True


def _summary(reports: list[dict[str, Any]]) -> tuple[Table, dict[str, dict[str, float]]]:
    acc: dict[str, list[tuple[float, float, float]]] = {}
    for rep in reports:
        for name, lin in rep.get("linears", {}).items():
            if lin.get("format") == "nvfp4":
                acc.setdefault(f"{rep['kind']} {name}", []).append(
                    (lin["rel_err"], lin["rel_err_plain_scales"], lin["seconds"])
                )
    table = Table(title="Relative weighted error (diag-H) on the calibration inputs, mean over layers")
    for col in ("linear", "layers", "searched", "plain scales", "ratio", "search s"):
        table.add_column(col, justify="left" if col == "linear" else "right")
    out: dict[str, dict[str, float]] = {}
    for key in sorted(acc):
        n = len(acc[key])
        a, b, t = (sum(v[k] for v in acc[key]) / n for k in range(3))
        out[key] = {"searched": a, "plain": b}
        table.add_row(key, str(n), f"{a:.3e}", f"{b:.3e}", f"{a / b:.3f}" if b else "-", f"{t:.3f}")
    return table, out


def run_nvfp4(
    model: Path,
    output: Path,
    sources: list[str],
    calib: CalibOptions,
    layer: NVFP4LayerOptions,
    run: NVFP4RunOptions,
    console: Console,
    extra_files: dict[str, Any] | None = None,
    accept: Callable[[Path], None] | None = None,
) -> Path:
    """Quantize ``model`` into ``output``. ``accept`` (a recipe's eval gate) sees the complete, format-checked
    export before it is moved to ``output``; it raises an `ExportRejected` to keep it beside ``output`` instead."""
    config, ranks = start_run(model, output, sources, device=run.device, overwrite=run.overwrite, resume=run.resume)
    if not ranks.main:  # one voice: rank 0 prints, shows progress and writes the export
        console = Console(quiet=True)
    if run.budget is not None and run.dense_all:
        raise NVFP4PlanError(f"--budget {run.budget} chooses every block's format itself: drop --dense-all")
    budget = parse_budget(run.budget) if run.budget is not None else None
    # with a budget every block may take NVFP4 (as dense-all) unless an --exclude pattern keeps it bf16
    plan = build_nvfp4_plan(config, run.dense_all or budget is not None, run.exclude)  # fails before any work
    for note in plan.notes:
        console.print(f"[yellow]note:[/] {note}")
    units = nvfp4_units(config, plan) if budget is not None else []
    if budget is not None:
        with CheckpointReader(model) as reader:
            budget_range(reader, config, units, budget)  # a budget that cannot be met fails before any work
    work = work_dir_for(output)
    device = device_for(ranks, resolve_device(run.device))
    sizes = summarize(config)
    size = sizes.nvfp4_dense_all_bytes if run.dense_all else sizes.nvfp4_default_bytes
    check_run_space(output, config, size, size, run.resume)  # before the data is read; its hidden states after
    with guarded_run(work, resume=run.resume, overwrite=run.overwrite, ranks=ranks):
        data = prepare_calibration(model, sources, calib, console)
        check_run_space(output, config, size, size, run.resume, data.total_tokens)
        chosen = None
        if budget is not None:
            with CheckpointReader(model) as reader:
                chosen = plan_budget(
                    work, run.resume, reader, config, [s.ids for s in data.samples], units, nvfp4_probe, budget,
                    SearchOptions(run.budget_windows, run.budget_seq_len), device, console, ranks,
                )  # fmt: skip
            plan = plan_of(config, units, chosen.choice, plan)
        exclude_modules = plan.exclude_modules(config)
        settings = {
            "method": "nvfp4",
            "dense_all": run.dense_all,
            "exclude": list(run.exclude),
            "nvfp4": dataclasses.asdict(layer),
            "calibration": dataclasses.asdict(calib),
            "budget": run.budget,
            "budget_choice": None if chosen is None else {u.full_name: chosen.option(k) for k, u in enumerate(units)},
        }
        engine_opts = EngineOptions(
            device=run.device,
            chunk_tokens=run.chunk_tokens,
            propagate=run.propagate,
            hessian=False,
            show_progress=run.show_progress,
        )
        engine = CalibrationEngine(model, [s.ids for s in data.samples], work, engine_opts, settings, ranks)
        t0 = time.perf_counter()
        result = engine.run(NVFP4LayerQuantizer(config, plan, layer, data.total_tokens, ranks), resume=run.resume)
        engine.release()  # the hidden states are no longer needed: keep them out of the export's peak
        t_calib = time.perf_counter() - t0
        if not ranks.main:
            barrier(ranks)  # until rank 0 has written the export: every process ends with the run
            return output
        table, summary = _summary(result.reports)
        console.print(table)
        qconfig = flat_quantization_config(exclude_modules)
        report = run_report(engine, data, result, t_calib, summary)
        files = {
            "hf_quant_config.json": hf_quant_config(exclude_modules),
            "quant_report.json": report,
            "salaquant_settings.json": settings,
            **(extra_files or {}),
        }
        opts = {"max_shard_bytes": run.max_shard_bytes, "overwrite": run.overwrite}
        with export_checkpoint(model, output, result, qconfig, files, **opts) as staged:
            check = check_export(staged, output)
            if chosen is not None:
                record_budget(chosen, config, model, staged, [s.ids for s in data.samples], device, console)
            barrier(ranks)  # the other processes are done; the gate runs on this one alone
            if accept is not None:
                accept(staged)
        shutil.rmtree(work, ignore_errors=True)
        console.print(
            f"NVFP4 checkpoint written to [bold]{output}[/] ({len(check.quantized)} NVFP4 linears, "
            f"{len(check.unquantized)} bf16); ModelOpt-format checks passed"
        )
        check.print_to(console)
    return output
