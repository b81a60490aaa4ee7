"""Steps shared by the commands that calibrate: checks before any work, tokenizer, calibration data."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from .calibration.calib_data import CalibOptions, CalibSet, load_calibration
from .calibration.distributed import Ranks, barrier, from_environment
from .io.files import CheckpointError, read_json_object
from .model.config import SalaConfig
from .model.layout import input_groups, layer_parameter_shapes
from .model.loading import check_finite, validate_source
from .outputs import check_free_space, check_output, folder_bytes, work_dir_for

if TYPE_CHECKING:
    from .calibration.contract import EngineResult
    from .calibration.engine import CalibrationEngine


def start_run(
    model: Path, output: Path, sources: list[str], *, device: str, overwrite: bool, resume: bool
) -> tuple[SalaConfig, Ranks]:
    """What every command that calibrates checks before any data or model work: the output paths
    (`check_output`, the source and every calibration file counting as inputs), the device, the source checkpoint
    from its headers (`validate_source`, about a second) and its weights for NaN/Inf (`check_finite`, a read of
    every weight: docs/calibration.md gives its cost); then, under ``torchrun``, the process group (every process
    has made the same checks before any of them starts the run)."""
    from .devices import resolve_device

    inputs = [("input checkpoint", model)]
    inputs += [("calibration source", Path(s)) for s in sources if not s.startswith("hf:")]
    check_output(output, overwrite, resume, inputs)
    resolve_device(device)
    reader, config = validate_source(model)
    with reader:
        check_finite(reader)
    ranks = from_environment(device)
    barrier(ranks)
    return config, ranks


def check_run_space(
    output: Path, config: SalaConfig, export_bytes: int, layer_bytes: int, resume: bool, tokens: int | None = None
) -> None:
    """Refuse a run whose export and work folder (per-layer files of ``layer_bytes`` in all, the hidden states of
    ``tokens`` tokens written beside their previous copy) do not fit on the disk. What a resumed run's work folder
    already holds is not counted again. Called twice: before the calibration data is read (``tokens`` None: the
    export and the layer files) and once its size is known, before any model work."""
    hidden = 0 if tokens is None else tokens * config.hidden_size * 2
    written = folder_bytes(work_dir_for(output)) if resume else 0
    check_free_space(output, {"export": export_bytes, "work folder": max(0, layer_bytes + 2 * hidden - written)})


def statistics_bytes(config: SalaConfig, hessian: bool) -> int:
    """Bytes of the per-layer statistics ``calibrate`` writes: per input group, a few vectors of its width, and
    the d x d fp32 Hessian with ``hessian``."""
    total = 0
    for i, kind in enumerate(config.mixer_types):
        shapes = layer_parameter_shapes(config, i)
        for g in input_groups(config, kind):
            d = shapes[f"model.layers.{i}.{g.members[0]}.weight"][1]
            total += 16 * d + (4 * d * d if hessian else 0)
    return total


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
"""The files a checkpoint's tokenizer is built from (the fast tokenizer's JSON, or a SentencePiece model)."""

TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""The tokenizer's JSON files, each parsed before transformers reads it so that a corrupt one is named."""


def load_tokenizer(model: Path) -> Any:
    """The tokenizer of checkpoint folder ``model``, as transformers' ``AutoTokenizer`` builds it. Every command that
    tokenizes reads it here: a path that is not a folder, a missing tokenizer file, or a tokenizer file that is not
    a JSON object is refused naming the file (`CheckpointError`), before transformers turns it into a message of
    its own without the path."""
    from transformers import AutoTokenizer

    from .model import hf  # noqa: F401  (AutoTokenizer reads config.json)

    folder = Path(model)
    if not folder.is_dir():
        what = f"path {folder} is not a folder" if folder.exists() else f"folder {folder} does not exist"
        raise CheckpointError(f"checkpoint {what}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"{folder / TOKENIZER_FILES[0]} is missing: the checkpoint's tokenizer files (tokenizer.json, "
            "tokenizer_config.json) belong beside its config.json"
        )
    present = [name for name in dict.fromkeys((*TOKENIZER_JSON, *TOKENIZER_FILES)) if (folder / name).exists()]
    for name in TOKENIZER_JSON:
        if name in present:
            read_json_object(folder / name)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # transformers and tokenizers raise many types (tokenizers: bare Exception)
        detail = " ".join(str(exc).split())
        files = ", ".join(present)
        raise CheckpointError(
            f"{folder}: cannot build the tokenizer from {files} ({type(exc).__name__}: {detail})"
        ) from exc


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
        "processes": engine.ranks.world,
        "rank_tokens": result.rank_tokens,
        "rank_peaks": result.rank_peaks,
        "cpu_threads": result.cpu_threads,
        "calibration": data.summary(),
        "timings_s": {**result.timings, "calibrate_and_quantize": seconds},
        "layer_seconds": result.layer_seconds,
        "summary": summary,
        "layers": result.reports,
    }
