"""Steps shared by the commands that calibrate: output checks, tokenizer, calibration data."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from .calibration import CalibOptions, CalibSet, load_calibration

if TYPE_CHECKING:
    from .pipeline import CalibrationEngine, EngineResult


def work_dir_for(output: Path) -> Path:
    """Where an unfinished run keeps its state (next to the output, removed when the output is complete)."""
    return Path(f"{output}.work")


def check_output(output: Path, overwrite: bool, resume: bool) -> None:
    """Refuse a non-empty output without ``overwrite``, and ``resume`` without a work folder."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not overwrite:
        raise ValueError(f"{output} exists and is not empty: pass --overwrite to replace it")
    if resume and not work_dir_for(output).exists():
        raise ValueError(f"--resume: no work folder {work_dir_for(output)} to resume from")


def load_tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    from .model import hf  # noqa: F401  (AutoTokenizer reads config.json)

    return AutoTokenizer.from_pretrained(model)


def prepare_calibration(model: Path, sources: list[str], options: CalibOptions, console: Console) -> CalibSet:
    """Tokenize the calibration sources with the model's tokenizer and print their summary."""
    data = load_calibration(sources, load_tokenizer(model), options)
    data.render_summary(console)
    return data


def run_report(
    engine: CalibrationEngine, data: CalibSet, result: EngineResult, seconds: float, summary: dict[str, Any]
) -> dict[str, Any]:
    """The common part of ``quant_report.json``: versions, device, data, timings, per-layer reports."""
    import platform

    import torch

    from . import __version__

    return {
        "salaquant": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(engine.device),
        "calibration": data.summary(),
        "timings_s": {**result.timings, "calibrate_and_quantize": seconds},
        "layer_seconds": result.layer_seconds,
        "summary": summary,
        "layers": result.reports,
    }
