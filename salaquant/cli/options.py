"""The flags several commands share, each with its help text; every default comes from ``salaquant.settings``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..settings import Recipe, defaults
from .blocks import FlagBlock

_GPTQ, _NVFP4 = defaults("gptq"), defaults("nvfp4")  # every flag's default comes from the settings

# options shared by the commands that calibrate
MaxSamples = Annotated[int | None, typer.Option(help="Keep at most this many samples.")]
MaxLen = Annotated[int, typer.Option(help="Truncate samples to this many tokens.")]
MinLen = Annotated[int, typer.Option(help="Drop samples shorter than this.")]
Shuffle = Annotated[bool, typer.Option(help="Shuffle the records (with --seed) instead of file order.")]
Seed = Annotated[int, typer.Option(help="Shuffle seed.")]
Field = Annotated[str | None, typer.Option(help="Record field holding the text.")]
Bos = Annotated[
    bool, typer.Option(help="Begin every sample with the tokenizer's BOS (--no-bos: as a model trained without it).")
]
ChunkTokens = Annotated[int, typer.Option(help="Tokens per chunk for long samples.")]
Device = Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu.")]
Resume = Annotated[bool, typer.Option(help="Continue an interrupted run from its work folder.")]
Overwrite = Annotated[
    bool, typer.Option(help="Replace an output folder salaquant wrote (one holding other files is never replaced).")
]
SmoothAlpha = Annotated[float, typer.Option(help="SmoothQuant migration strength.")]
NoSmooth = Annotated[bool, typer.Option("--no-smooth", help="Skip SmoothQuant.")]
Exclude = Annotated[list[str] | None, typer.Option(help="Keep linears matching this regex in bf16.")]
Budget = Annotated[
    str | None,
    typer.Option(help="Export size, e.g. 6.5GB, or 4.5bits per weight: each group's format chosen by measured damage."),
]
Propagate = Annotated[str, typer.Option(help="quantized or float: what the next layer calibrates on.")]
Input = Annotated[Path, typer.Option("--input", "-i", help="The bf16 SALA checkpoint folder.")]
Calib = Annotated[list[str], typer.Option(help="Calibration source(s): .jsonl, text, folder, parquet, hf:NAME...")]
SaveRecipe = Annotated[Path | None, typer.Option(help="Write the recipe these flags imply to this YAML file.")]


def _from(section: Any, **annotations: Any) -> FlagBlock:
    """A block of ``section``'s keys, each flag's default the section's value."""
    return FlagBlock(tuple((name, a, getattr(section, name)) for name, a in annotations.items()))


def calibration_block(settings: Recipe, max_samples: int | None) -> FlagBlock:
    """How samples are read: the ``calibration`` keys but ``sources`` (``--calib``, required) and ``max_samples``
    (every sample for ``calibrate``, the method's default for a quantizer)."""
    c = settings.calibration
    block = _from(c, max_len=MaxLen, min_len=MinLen, shuffle=Shuffle, seed=Seed, field=Field, bos=Bos)
    return FlagBlock((("max_samples", MaxSamples, max_samples), *block.flags))


def engine_block(settings: Recipe, propagate: bool = True) -> FlagBlock:
    """The calibration engine's keys (``propagate`` only where the layers are quantized as they go)."""
    if propagate:
        return _from(settings.engine, propagate=Propagate, chunk_tokens=ChunkTokens, device=Device)
    return _from(settings.engine, chunk_tokens=ChunkTokens, device=Device)


def table_block(values: Any, table: tuple[tuple[Any, ...], ...]) -> FlagBlock:
    """Flags of attributes of ``values`` (a settings section, or options such as ``EvalOptions()``), ``(key, type,
    help)`` or ``(key, type, help, declarations)`` each: the default is the attribute's value, the flag ``--key``
    unless declarations are given."""
    flags = []
    for key, kind, text, *decls in table:
        option = typer.Option(*(decls[0] if decls else ()), help=text)
        flags.append((key, Annotated[kind, option], getattr(values, key)))
    return FlagBlock(tuple(flags))


RUN_BLOCK = FlagBlock((("resume", Resume, False), ("overwrite", Overwrite, False)))
"""What a command that writes a folder does with one already there."""
