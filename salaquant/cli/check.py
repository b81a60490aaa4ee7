"""``salaquant check``: what the serving engines need of an export, and the command that serves it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..io.files import CheckpointError
from ..model.config import ConfigError
from .app import app, console, fail


@app.command()
def check(
    model: Annotated[Path, typer.Argument(help="A quantized checkpoint folder.")],
    tp: Annotated[int, typer.Option(help="Tensor-parallel size to validate shard shapes for.")] = 1,
) -> None:
    """Verify that a quantized checkpoint has what vLLM / SGLang need (formats, shapes, fused groups).

    Exit status: 0 the checkpoint passes, 1 it fails the format requirements (every problem listed), 2 bad input
    (a missing folder, an unreadable or corrupt file, a bad flag).
    """
    from ..formats.check import CheckError, check_checkpoint

    if tp < 1:
        fail(f"--tp {tp}: expected a number >= 1")
    try:
        report = check_checkpoint(model, tp=tp)
    except CheckError as exc:
        fail(str(exc), code=1)
    except (CheckpointError, ConfigError, OSError) as exc:
        fail(str(exc))
    console.print(
        f"{model}: {report.format} checkpoint OK for tp={tp}: {len(report.quantized)} quantized linears, "
        f"{report.plain_summary()}"
    )
    report.print_to(console)
