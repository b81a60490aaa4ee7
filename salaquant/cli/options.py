"""The flags several commands share, each with its help text; every default comes from ``salaquant.settings``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..settings import defaults

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
ShardSize = Annotated[str, typer.Option(help="Largest output shard, e.g. 4GB.")]
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


def calibration_flags(
    sources: list[str],
    max_samples: int | None,
    max_len: int,
    min_len: int,
    shuffle: bool,
    seed: int,
    field: str | None,
    bos: bool,
) -> dict[str, Any]:
    return {
        "sources": sources,
        "max_samples": max_samples,
        "max_len": max_len,
        "min_len": min_len,
        "shuffle": shuffle,
        "seed": seed,
        "field": field,
        "bos": bos,
    }
