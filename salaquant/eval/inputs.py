"""Eval's checks of its inputs before any model is loaded: the two checkpoints and their compatibility, the
report folder, the format check of the export, NIAH and task lengths against the model's positions, and the
gates' needs."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..io.reader import CheckpointReader
from ..model.config import SalaConfig
from ..ownership import CHECKPOINT, EVAL_REPORT, judge
from .options import EvalInputError, EvalOptions
from .thresholds import Thresholds

COMPARED_FIELDS = tuple(f.name for f in dataclasses.fields(SalaConfig) if f.name != "raw")


def open_checkpoint(path: Path, what: str) -> tuple[SalaConfig, CheckpointReader]:
    if not path.exists():
        raise EvalInputError(f"{what} {path}: no such folder")
    if not path.is_dir():
        raise EvalInputError(f"{what} {path}: not a folder (pass the checkpoint folder)")
    config = SalaConfig.from_file(path)  # ConfigError naming the key of a non-SALA config
    return config, CheckpointReader(path)  # CheckpointError when the weights are missing


def compatibility_problems(quantized: SalaConfig, reference: SalaConfig) -> list[str]:
    """Architecture fields of the two configs that differ (an export keeps every one of them)."""
    return [
        f"{name}: {getattr(quantized, name)!r} in the quantized checkpoint, {getattr(reference, name)!r} in the source"
        for name in COMPARED_FIELDS
        if getattr(quantized, name) != getattr(reference, name)
    ]


def checked_report_dir(folder: Path, quantized: Path, reference: Path) -> Path:
    """The ``--report`` folder, made if missing: a new or empty folder, one of earlier eval reports, or the evaluated
    export when salaquant wrote it. Refused: the reference checkpoint or a folder inside it (a report never goes into
    the bf16 source), a folder inside the evaluated checkpoint, another salaquant folder, any folder holding files
    salaquant did not write (`salaquant.ownership`)."""
    if folder.exists() and not folder.is_dir():
        raise EvalInputError(f"--report {folder}: exists and is not a folder")
    real, ref, q = (Path(os.path.realpath(p)) for p in (folder, reference, quantized))
    if real.is_relative_to(ref):
        where = "is" if real == ref else "lies inside"
        raise EvalInputError(
            f"--report {folder} {where} the reference checkpoint {reference}: a report never goes into the bf16 "
            "source; pass a folder of its own"
        )
    if real != q and real.is_relative_to(q):
        raise EvalInputError(
            f"--report {folder} lies inside the evaluated checkpoint {quantized}: pass the checkpoint itself or a "
            "folder outside it"
        )
    verdict = judge(folder)
    if verdict.foreign:
        raise EvalInputError(
            f"--report {folder} holds files salaquant did not write ({verdict.few()}): pass a new or empty folder, "
            "one of earlier eval reports, or the evaluated export"
        )
    kind = verdict.kind.name if verdict.kind is not None else None
    if kind not in (None, EVAL_REPORT) and not (kind == CHECKPOINT and real == q):
        raise EvalInputError(
            f"--report {folder} is a {kind} salaquant wrote, not the evaluated checkpoint {quantized}: pass a new or "
            "empty folder, one of earlier eval reports, or the evaluated export"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EvalInputError(f"--report {folder}: cannot create it ({exc.strerror or exc})") from exc
    if not os.access(folder, os.W_OK):
        raise EvalInputError(f"--report {folder}: not writable")
    return folder


def format_check(path: Path, tp: int) -> dict[str, Any]:
    """Run the export code's checker (raises ``CheckError``: eval stops)."""
    from ..formats.check import check_checkpoint

    rep = check_checkpoint(path, tp=tp)
    return {
        "status": "passed",
        "detail": f"{rep.format}, tp={tp}: {len(rep.quantized)} quantized linears, {rep.plain_summary()}",
        "quantized_linears": len(rep.quantized),
        "unquantized_linears": len(rep.unquantized),
        "warnings": rep.warnings,
    }


def first_length(x: int | list[int] | None) -> int | None:
    return x[0] if isinstance(x, list) and x else x if isinstance(x, int) else None


def auto_niah_lengths(config: SalaConfig, path: Path, notes: list[str]) -> list[int]:
    """``--niah auto``: dense_len and 4 x dense_len (none without a sparse_config), those the model's positions
    hold; a length left out is noted in the report."""
    if config.dense_len is None:
        return []
    limit = config.max_position_embeddings
    lengths = [config.dense_len, 4 * config.dense_len]
    left_out = [n for n in lengths if n > limit]
    if left_out:
        notes.append(f"--niah auto: {left_out} left out, past max_position_embeddings {limit} of {path}/config.json")
    return [n for n in lengths if n <= limit]


def check_positions(opts: EvalOptions, niah_lengths: Sequence[int], config: SalaConfig, path: Path) -> None:
    """Refuse a window, NIAH or task length past the model's ``max_position_embeddings`` (the positions it was
    built for), before the tokenizer or a model is loaded: a prompt of 2M tokens asks the attention for terabytes."""
    limit = config.max_position_embeddings
    asked = [("--max-len", [opts.max_len]), ("--niah", niah_lengths), ("--lengths", opts.task_lengths or [])]
    for flag, lengths in asked:
        for n in lengths:
            if n > limit:
                raise EvalInputError(
                    f"{flag} {length_flag(n)}: longer than the model's {limit} positions (max_position_embeddings "
                    f"in {path}/config.json)"
                )


def length_flag(n: int) -> str:
    """``n`` tokens as a length flag takes them (``65536`` -> ``64k``, ``2097152`` -> ``2m``)."""
    for unit, size in (("m", 1024 * 1024), ("k", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def check_gate_needs(gates: Thresholds, opts: EvalOptions, niah_lengths: Sequence[int]) -> None:
    if gates.max_niah_drop is not None and not niah_lengths:
        raise EvalInputError("--max-niah-drop needs NIAH lengths (--niah), but NIAH is off")
    missing = [t for t in (gates.max_task_drop or {}) if t not in opts.tasks]
    if missing:
        raise EvalInputError(f"--max-drop {missing[0]}=...: the task is not run (add it to --tasks)")
    if gates.no_new_loops and opts.gen_tokens == 0:
        raise EvalInputError("--no-new-loops needs generation, but --gen-tokens is 0")
    if gates.max_layer_error is not None and opts.layer_windows == 0:
        raise EvalInputError("--max-layer-error needs the per-layer error, but --layer-windows is 0")
