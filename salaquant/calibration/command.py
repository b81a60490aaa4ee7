"""``salaquant calibrate``: calibration data -> engine (statistics only) -> per-layer statistics folder."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..io.staging import replace_folder, staging_folder
from ..outputs import work_dir_for
from ..recipe import check_flags
from ..work_folder import guarded_run
from ..workflow import check_run_space, prepare_calibration, start_run, statistics_bytes
from .calib_data import CalibOptions
from .contract import EngineOptions
from .distributed import barrier
from .engine import CalibrationEngine

# What the statistics folder holds: its report (what it holds, from which run), and from the work folder the
# per-layer statistics and the log.
STATISTICS_NAME = "calibration.json"
LAYERS_DIR = "layers"
LOG_NAME = "log.txt"


def run_calibrate(
    model: Path,
    output: Path,
    sources: list[str],
    options: CalibOptions,
    *,
    chunk_tokens: int,
    device: str,
    hessian: bool,
    hessian_dtype: str,
    resume: bool,
    overwrite: bool,
    console: Console,
) -> Path:
    if hessian_dtype not in ("fp32", "fp64"):
        raise ValueError(f"--hessian-dtype {hessian_dtype!r}: expected fp32 or fp64")
    calibration = dataclasses.asdict(options)
    check_flags({"calibration": calibration, "engine": {"device": device, "chunk_tokens": chunk_tokens}})
    config, ranks = start_run(model, output, sources, device=device, overwrite=overwrite, resume=resume)
    if not ranks.main:  # one voice: rank 0 prints and writes the statistics
        console = Console(quiet=True)
    work = work_dir_for(output)
    stats = statistics_bytes(config, hessian)
    check_run_space(output, config, stats, stats, resume)  # before the data is read; its hidden states after
    with guarded_run(work, resume=resume, overwrite=overwrite, ranks=ranks):
        data = prepare_calibration(model, sources, options, console)
        check_run_space(output, config, stats, stats, resume, data.total_tokens)
        opts = EngineOptions(
            device=device,
            chunk_tokens=chunk_tokens,
            propagate="float",
            hessian=True,
            hessian_dtype=hessian_dtype,
            save_hessians=hessian,
        )
        engine = CalibrationEngine(model, [s.ids for s in data.samples], work, opts, ranks=ranks)
        result = engine.run(resume=resume)
        if not ranks.main:
            barrier(ranks)  # until rank 0 has written the statistics
            return output

        table = Table(title="Input statistics (absmax: largest channel / median channel)")
        for col in ("layer", "kind", "group", "tokens", "max |x|", "outlier ratio"):
            table.add_column(col, justify="left" if col in ("kind", "group") else "right")
        layers: list[dict[str, Any]] = []
        for i in range(result.num_layers):
            t = result.layer_tensors(i)
            entry: dict[str, Any] = {"layer": i, "kind": engine.config.mixer_types[i], "groups": {}}
            for key in sorted(k for k in t if k.endswith(".absmax")):
                group = key.removesuffix(".absmax")
                absmax = t[key]
                ratio = float(absmax.max() / absmax.median().clamp(min=1e-12))
                entry["groups"][group] = {"max_abs": float(absmax.max()), "outlier_ratio": ratio}
                table.add_row(
                    str(i),
                    entry["kind"],
                    group,
                    str(int(t[f"{group}.counts"][0])),
                    f"{float(absmax.max()):.3g}",
                    f"{ratio:.1f}",
                )
            layers.append(entry)
        console.print(table)

        report = {
            "model": str(model),
            "calibration": data.summary(),
            "engine": opts.fingerprint_fields(),
            "timings_s": result.timings,
            "tokens": result.tokens,
            "processes": ranks.world,
            "rank_tokens": result.rank_tokens,
            "layers": layers,
        }
        tmp = staging_folder(output)
        try:
            shutil.copytree(work / LAYERS_DIR, tmp / LAYERS_DIR)
            shutil.copy(work / LOG_NAME, tmp / LOG_NAME)
            (tmp / STATISTICS_NAME).write_text(json.dumps(report, indent=2, default=str))
            replace_folder(tmp, output)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(work)
        barrier(ranks)
    console.print(f"statistics of {result.num_layers} layers written to [bold]{output}[/]")
    return output
