"""``salaquant gptq``: calibration -> SmoothQuant -> full-Hessian GPTQ per layer -> GPTQ v1 export -> check."""

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
from ..formats.gptq_v1.config import quantization_config
from ..model.checkpoint import CheckpointReader
from ..outputs import work_dir_for
from ..settings import defaults, parse_size
from ..summary import summarize
from ..work_folder import guarded_run
from ..workflow import check_run_space, prepare_calibration, run_report, start_run
from .budget import gptq_probe, gptq_units, plan_of
from .layer import GPTQLayerOptions, GPTQLayerQuantizer
from .plan import BitsOptions, PlanError, build_plan, check_marlin_leaves_some, check_tp, marlin_exclusions

_DEFAULTS = defaults("gptq")


@dataclass(frozen=True)
class RunOptions:
    """How a GPTQ run executes and exports; defaults are ``salaquant.settings``'."""

    device: str = _DEFAULTS.engine.device
    chunk_tokens: int = _DEFAULTS.engine.chunk_tokens
    propagate: str = _DEFAULTS.engine.propagate
    tp: int = _DEFAULTS.export.tp
    max_shard_bytes: int = parse_size(_DEFAULTS.export.shard_size)
    resume: bool = False
    overwrite: bool = False
    show_progress: bool = True
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


def run_gptq(
    model: Path,
    output: Path,
    sources: list[str],
    calib: CalibOptions,
    bits: BitsOptions,
    layer: GPTQLayerOptions,
    run: RunOptions,
    console: Console,
    extra_files: dict[str, Any] | None = None,
    accept: Callable[[Path], None] | None = None,
) -> Path:
    """Quantize ``model`` into ``output``. ``accept`` (a recipe's eval gate) sees the complete, format-checked
    export before it is moved to ``output``; it raises an `ExportRejected` to keep it beside ``output`` instead."""
    config, ranks = start_run(model, output, sources, device=run.device, overwrite=run.overwrite, resume=run.resume)
    if not ranks.main:  # one voice: rank 0 prints, shows progress and writes the export
        console = Console(quiet=True)
    plan = build_plan(config, bits)  # bad bit plans fail before any data or model work
    if all(p.bits is None for p in plan.values()):
        raise PlanError("the bits options keep every linear in 16 bits: nothing to export as GPTQ")
    check_tp(config, run.tp)
    excluded = marlin_exclusions(config, plan, run.tp)
    if excluded and not run.marlin_fallback:
        first = next(iter(excluded.items()))
        raise PlanError(
            f"{len(excluded)} linears cannot be served by gptq_marlin at tp={run.tp}, e.g. {first[0]}: "
            f"{first[1][0]}; exclude them or allow --marlin-fallback"
        )
    check_marlin_leaves_some(plan, excluded, run.tp)
    if excluded:
        head = "" if config.tie_word_embeddings else " (lm_head, never quantized, is kept too)"
        console.print(
            f"[yellow]keeping {len(excluded)} decoder linears in bf16{head}: gptq_marlin cannot serve their shapes "
            f"at tp={run.tp} (--no-marlin-fallback fails instead):[/]"
        )
        for name, reasons in excluded.items():
            console.print(f"  {name}: {reasons[0]}")
    budget = parse_budget(bits.budget) if bits.budget is not None else None
    units = gptq_units(config, plan) if budget is not None else []
    if budget is not None:
        with CheckpointReader(model) as reader:
            budget_range(reader, config, units, budget)  # a budget that cannot be met fails before any work
    work = work_dir_for(output)
    device = device_for(ranks, resolve_device(run.device))
    size = summarize(config).w4a16_bytes
    check_run_space(output, config, size, size, run.resume)  # before the data is read; its hidden states after
    with guarded_run(work, resume=run.resume, overwrite=run.overwrite, ranks=ranks):
        data = prepare_calibration(model, sources, calib, console)
        check_run_space(output, config, size, size, run.resume, data.total_tokens)
        chosen = None
        if budget is not None:
            with CheckpointReader(model) as reader:
                chosen = plan_budget(
                    work, run.resume, reader, config, [s.ids for s in data.samples], units, gptq_probe(layer, plan),
                    budget, SearchOptions(bits.budget_windows, bits.budget_seq_len), device, console, ranks,
                )  # fmt: skip
            plan = plan_of(units, chosen.choice, plan)
        settings = {
            "method": "gptq",
            "bits": dataclasses.asdict(bits),
            "gptq": dataclasses.asdict(layer),
            "marlin_exclusions": sorted(excluded),
            "calibration": dataclasses.asdict(calib),
            "budget_choice": None if chosen is None else {u.full_name: chosen.option(k) for k, u in enumerate(units)},
        }
        engine_opts = EngineOptions(
            device=run.device,
            chunk_tokens=run.chunk_tokens,
            propagate=run.propagate,
            hessian=True,
            hessian_dtype="fp64" if layer.fp64 else "fp32",
            hessian_sums=(layer.hessian_weighting,),  # the one sum the solve reads
            show_progress=run.show_progress,
        )
        engine = CalibrationEngine(model, [s.ids for s in data.samples], work, engine_opts, settings, ranks)
        t0 = time.perf_counter()
        result = engine.run(GPTQLayerQuantizer(config, plan, layer, ranks), resume=run.resume)
        engine.release()  # the hidden states are no longer needed: keep them out of the export's peak
        t_calib = time.perf_counter() - t0
        if not ranks.main:
            barrier(ranks)  # until rank 0 has written the export: every process ends with the run
            return output

        table, summary = _summary_table(result.reports)
        console.print(table)
        meta = {
            "damp_percent": layer.damp,
            "act_order_static_groups": layer.act_order,
            "mse": layer.mse,
            "smooth_alpha": layer.smooth_alpha,
            "hessian_weighting": layer.hessian_weighting,
        }
        qconfig = quantization_config(config, plan, bits.group_size, meta)
        report = run_report(engine, data, result, t_calib, summary)
        t1 = time.perf_counter()
        files = {
            "quantize_config.json": qconfig,
            "quant_report.json": report,
            "salaquant_settings.json": settings,
            **(extra_files or {}),
        }
        opts = {"max_shard_bytes": run.max_shard_bytes, "overwrite": run.overwrite}
        with export_checkpoint(model, output, result, qconfig, files, **opts) as staged:
            check = check_export(staged, output, tp=run.tp)
            if chosen is not None:
                record_budget(chosen, config, model, staged, [s.ids for s in data.samples], device, console)
            barrier(ranks)  # the other processes are done; the gate runs on this one alone
            if accept is not None:
                accept(staged)
        shutil.rmtree(work, ignore_errors=True)
        console.print(
            f"GPTQ checkpoint written to [bold]{output}[/] ({len(check.quantized)} quantized linears, "
            f"export {time.perf_counter() - t1:.1f} s); checks for gptq_marlin at tp={run.tp} passed"
        )
        check.print_to(console)
    return output
