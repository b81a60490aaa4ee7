"""The commands that calibrate: ``calibrate``, ``gptq``, ``nvfp4``, ``run`` (recipes) and ``recipes``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ..io.files import CheckpointError
from ..settings import SMOOTH_BY_DEFAULT, Recipe
from .app import app, console, fail, interrupted
from .blocks import FlagBlock, Flags, with_blocks
from .options import (
    _GPTQ,
    _NVFP4,
    RUN_BLOCK,
    Budget,
    Calib,
    Exclude,
    Input,
    NoSmooth,
    SaveRecipe,
    SmoothAlpha,
    calibration_block,
    engine_block,
    table_block,
)


@app.command()
@with_blocks(
    calibration=calibration_block(_GPTQ, None), engine=engine_block(_GPTQ, propagate=False), existing=RUN_BLOCK
)
def calibrate(
    *,
    input: Input,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the statistics.")],
    calib: Calib,
    calibration: Flags,
    engine: Flags,
    hessian: Annotated[bool, typer.Option(help="Also keep X^T X per input group (d^2 floats each).")] = False,
    hessian_dtype: Annotated[str, typer.Option(help="fp32 or fp64 accumulation.")] = "fp32",
    existing: Flags,
) -> None:
    """Run the calibration engine (forced dense, layer by layer) and save per-layer input statistics."""
    from ..calibration.calib_data import CalibOptions
    from ..calibration.command import run_calibrate
    from ..work_folder import RunInterrupted

    try:
        run_calibrate(
            input,
            output,
            calib,
            CalibOptions(**calibration),
            **engine,
            hessian=hessian,
            hessian_dtype=hessian_dtype,
            **existing,
            console=console,
        )
    except RunInterrupted as exc:
        interrupted(exc)
    except (ValueError, CheckpointError, RuntimeError, OSError) as exc:
        fail(str(exc))


SHARD_HELP = "Largest output shard, e.g. 4GB."
GPTQ_QUANTIZATION = (
    ("bits", int, "Bits of every decoder linear (4 or 8; 16 keeps bf16)."),
    ("group_size", int, "Inputs per scale group: -1, 32, 64 or 128."),
    ("minicpm4_bits", int | None, "Bits of the minicpm4 (sparse) layers."),
    ("lightning_bits", int | None, "Bits of the lightning layers."),
    ("layer_bits", str, 'Per-layer bits, e.g. "0:8,2-7:4" (16 = bf16).'),
)
GPTQ_SOLVER = (
    ("damp", float, "Dampening, fraction of the mean Hessian diagonal."),
    ("act_order", bool, "Columns by descending Hessian diagonal (static groups)."),
    ("mse", bool, "Search clipped scales minimising the squared error.", ("--mse/--no-mse",)),
    ("fp64", bool, "Accumulate Hessians and solve in float64."),
    ("hessian_weighting", str, "samples (each sample weighs the same) or tokens."),
    ("quantize_lm_head", bool, "Refused: no engine serves a quantized lm_head."),
)
GPTQ_EXPORT = (
    ("tp", int, "Tensor-parallel size the checker validates shapes for."),
    ("marlin_fallback", bool, "Keep linears whose shapes gptq_marlin cannot serve in bf16 (else fail)."),
    ("shard_size", str, SHARD_HELP),
)
NVFP4_OPTIONS = (
    ("dense_all", bool, "Quantize the minicpm4 attention blocks too."),
    ("mse_iters", int, "Block-scale search steps (0: plain scales)."),
    ("mse_max_shrink", float, "Smallest tried block scale = 1 - this."),
    ("mse_max_grow", float, "Largest tried block scale = this x the plain one (1: none)."),
    ("input_scale", str, "Activation global scale: max (ModelOpt's) or mse (least FP4 error, slower)."),
    ("rounding", str, "gptq (error feedback over the input Hessian), or nearest (faster calibration)."),
    ("static_scales", bool, "gptq: block scales before the sweep, or as it goes.", ("--static-scales/--sweep-scales",)),
)
NVFP4_EXPORT = (("shard_size", str, SHARD_HELP),)
"""The method flags of ``gptq`` and ``nvfp4``, by settings section: ``(key, type, help[, declarations])``."""


def quantizer_blocks(settings: Recipe, **sections: tuple[tuple[Any, ...], ...]) -> dict[str, FlagBlock]:
    """The flag blocks of a quantizer command: calibration, one per settings section (its table), the engine, and
    what to do with an output folder already there."""
    return {
        "calibration": calibration_block(settings, settings.calibration.max_samples),
        **{name: table_block(getattr(settings, name), table) for name, table in sections.items()},
        "engine": engine_block(settings),
        "existing": RUN_BLOCK,
    }


@app.command("gptq")
@with_blocks(**quantizer_blocks(_GPTQ, quantization=GPTQ_QUANTIZATION, gptq=GPTQ_SOLVER, export=GPTQ_EXPORT))
def gptq_command(
    *,
    input: Input,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the GPTQ checkpoint.")],
    calib: Calib,
    calibration: Flags,
    quantization: Flags,
    exclude: Exclude = None,
    budget: Budget = None,
    smooth_alpha: SmoothAlpha = _GPTQ.smoothing.alpha,
    smooth: Annotated[
        bool, typer.Option("--smooth/--no-smooth", help="SmoothQuant before GPTQ (off by default for weight-only).")
    ] = SMOOTH_BY_DEFAULT["gptq"],
    gptq: Flags,
    method: Annotated[
        str, typer.Option(help="gptq, or rtn (round to nearest on the same grid: the baseline).")
    ] = _GPTQ.method,
    engine: Flags,
    export: Flags,
    save_recipe: SaveRecipe = None,
    existing: Flags,
) -> None:
    """SmoothQuant + full-Hessian GPTQ, exported as a GPTQ v1 checkpoint for vLLM / SGLang gptq_marlin."""
    recipe = {
        "method": method,
        "calibration": {"sources": calib, **calibration},
        "smoothing": {"enabled": smooth, "alpha": smooth_alpha},
        "quantization": {**quantization, "exclude": exclude or [], "budget": budget},
        "gptq": gptq,
        "engine": engine,
        "export": export,
    }
    _run_from_flags(recipe, input, output, save_recipe, **existing)


@app.command("nvfp4")
@with_blocks(**quantizer_blocks(_NVFP4, nvfp4=NVFP4_OPTIONS, export=NVFP4_EXPORT))
def nvfp4_command(
    *,
    input: Input,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the NVFP4 checkpoint.")],
    calib: Calib,
    calibration: Flags,
    exclude: Exclude = None,
    budget: Budget = None,
    nvfp4: Flags,
    smooth_alpha: SmoothAlpha = _NVFP4.smoothing.alpha,
    no_smooth: NoSmooth = not SMOOTH_BY_DEFAULT["nvfp4"],
    engine: Flags,
    export: Flags,
    save_recipe: SaveRecipe = None,
    existing: Flags,
) -> None:
    """SmoothQuant + block-scale search + GPTQ rounding NVFP4, in ModelOpt's format for SGLang / vLLM
    modelopt_fp4."""
    recipe = {
        "method": "nvfp4",
        "calibration": {"sources": calib, **calibration},
        "smoothing": {"enabled": not no_smooth, "alpha": smooth_alpha},
        "quantization": {"budget": budget},
        "nvfp4": {**nvfp4, "exclude": exclude or []},
        "engine": engine,
        "export": export,
    }
    _run_from_flags(recipe, input, output, save_recipe, **existing)


def _run_from_flags(
    data: dict[str, Any], input: Path, output: Path, save_recipe: Path | None, resume: bool, overwrite: bool
) -> None:
    """Flags -> recipe (validated like a file; errors name the flag) -> the same run as ``salaquant run``."""
    from ..recipe import RecipeError, recipe_from_dict

    try:
        recipe = recipe_from_dict(data, "flags")
    except RecipeError as exc:
        fail(str(exc))
    if save_recipe is not None:
        try:
            save_recipe.write_text(recipe.to_yaml())
        except OSError as exc:
            fail(f"--save-recipe {save_recipe}: {exc.strerror or exc}")
        console.print(f"recipe written to {save_recipe}")
    _run(recipe, input, output, resume, overwrite, None)


def _run(recipe, input: Path, output: Path, resume: bool, overwrite: bool, recipe_path: str | None) -> None:
    from ..run_recipe import GateFailed, run_recipe
    from ..work_folder import RunInterrupted

    try:
        run_recipe(recipe, input, output, console, resume=resume, overwrite=overwrite, recipe_path=recipe_path)
    except RunInterrupted as exc:
        interrupted(exc)
    except GateFailed as exc:
        fail(str(exc), code=3)
    except (ValueError, CheckpointError, RuntimeError, OSError) as exc:
        fail(str(exc))


@app.command()
@with_blocks(existing=RUN_BLOCK)
def run(
    *,
    recipe: Annotated[str, typer.Argument(help="A recipe file, or the name of a shipped recipe.")],
    input: Input,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the quantized checkpoint.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a key: --set gptq.damp=0.05")] = None,
    calib: Annotated[list[str] | None, typer.Option(help="Shorthand for --set calibration.sources=[...]")] = None,
    existing: Flags,
) -> None:
    """Quantize as a YAML recipe says (CLI overrides win); the resolved recipe is saved in the output."""
    from ..recipe import RecipeError, load_recipe

    overrides = list(set_ or [])
    if calib:
        overrides.append("calibration.sources=" + json.dumps(list(calib)))
    try:
        resolved = load_recipe(recipe, overrides)
    except RecipeError as exc:
        fail(str(exc))
    _run(resolved, input, output, existing["resume"], existing["overwrite"], recipe)


@app.command()
def recipes() -> None:
    """List the shipped recipes (usable by name with ``salaquant run``)."""
    from ..recipe import load_recipe, shipped_recipes

    table = Table(title="Shipped recipes")
    table.add_column("name")
    table.add_column("method")
    table.add_column("description")
    for name in sorted(shipped_recipes()):
        r = load_recipe(name)
        table.add_row(name, r.method, r.description)
    console.print(table)
