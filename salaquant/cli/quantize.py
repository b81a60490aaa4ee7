"""The commands that calibrate: ``calibrate``, ``gptq``, ``nvfp4``, ``run`` (recipes) and ``recipes``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ..io.files import CheckpointError
from ..settings import SMOOTH_BY_DEFAULT
from .app import app, console, fail, interrupted
from .options import (
    _GPTQ,
    _NVFP4,
    Bos,
    Budget,
    Calib,
    ChunkTokens,
    Device,
    Exclude,
    Field,
    Input,
    MaxLen,
    MaxSamples,
    MinLen,
    NoSmooth,
    Overwrite,
    Propagate,
    Resume,
    SaveRecipe,
    Seed,
    ShardSize,
    Shuffle,
    SmoothAlpha,
    calibration_flags,
)


@app.command()
def calibrate(
    input: Input,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the statistics.")],
    calib: Calib,
    max_samples: MaxSamples = None,
    max_len: MaxLen = _GPTQ.calibration.max_len,
    min_len: MinLen = _GPTQ.calibration.min_len,
    shuffle: Shuffle = _GPTQ.calibration.shuffle,
    seed: Seed = _GPTQ.calibration.seed,
    field: Field = _GPTQ.calibration.field,
    bos: Bos = _GPTQ.calibration.bos,
    chunk_tokens: ChunkTokens = _GPTQ.engine.chunk_tokens,
    device: Device = _GPTQ.engine.device,
    hessian: Annotated[bool, typer.Option(help="Also keep X^T X per input group (d^2 floats each).")] = False,
    hessian_dtype: Annotated[str, typer.Option(help="fp32 or fp64 accumulation.")] = "fp32",
    resume: Resume = False,
    overwrite: Overwrite = False,
) -> None:
    """Run the calibration engine (forced dense, layer by layer) and save per-layer input statistics."""
    from ..calibration.calib_data import CalibOptions
    from ..calibration.command import run_calibrate
    from ..work_folder import RunInterrupted

    try:
        options = CalibOptions(
            max_samples=max_samples,
            max_len=max_len,
            min_len=min_len,
            shuffle=shuffle,
            seed=seed,
            field=field,
            bos=bos,
        )
        run_calibrate(
            input,
            output,
            calib,
            options,
            chunk_tokens=chunk_tokens,
            device=device,
            hessian=hessian,
            hessian_dtype=hessian_dtype,
            resume=resume,
            overwrite=overwrite,
            console=console,
        )
    except RunInterrupted as exc:
        interrupted(exc)
    except (ValueError, CheckpointError, RuntimeError, OSError) as exc:
        fail(str(exc))


@app.command("gptq")
def gptq_command(
    input: Input,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the GPTQ checkpoint.")],
    calib: Calib,
    max_samples: MaxSamples = _GPTQ.calibration.max_samples,
    max_len: MaxLen = _GPTQ.calibration.max_len,
    min_len: MinLen = _GPTQ.calibration.min_len,
    shuffle: Shuffle = _GPTQ.calibration.shuffle,
    seed: Seed = _GPTQ.calibration.seed,
    field: Field = _GPTQ.calibration.field,
    bos: Bos = _GPTQ.calibration.bos,
    bits: Annotated[
        int, typer.Option(help="Bits of every decoder linear (4 or 8; 16 keeps bf16).")
    ] = _GPTQ.quantization.bits,
    group_size: Annotated[
        int, typer.Option(help="Inputs per scale group: -1, 32, 64 or 128.")
    ] = _GPTQ.quantization.group_size,
    minicpm4_bits: Annotated[
        int | None, typer.Option(help="Bits of the minicpm4 (sparse) layers.")
    ] = _GPTQ.quantization.minicpm4_bits,
    lightning_bits: Annotated[
        int | None, typer.Option(help="Bits of the lightning layers.")
    ] = _GPTQ.quantization.lightning_bits,
    layer_bits: Annotated[
        str, typer.Option(help='Per-layer bits, e.g. "0:8,2-7:4" (16 = bf16).')
    ] = _GPTQ.quantization.layer_bits,
    exclude: Exclude = None,
    budget: Budget = None,
    smooth_alpha: SmoothAlpha = _GPTQ.smoothing.alpha,
    smooth: Annotated[
        bool, typer.Option("--smooth/--no-smooth", help="SmoothQuant before GPTQ (off by default for weight-only).")
    ] = SMOOTH_BY_DEFAULT["gptq"],
    damp: Annotated[float, typer.Option(help="Dampening, fraction of the mean Hessian diagonal.")] = _GPTQ.gptq.damp,
    act_order: Annotated[
        bool, typer.Option(help="Columns by descending Hessian diagonal (static groups).")
    ] = _GPTQ.gptq.act_order,
    mse: Annotated[
        bool, typer.Option("--mse/--no-mse", help="Search clipped scales minimising the squared error.")
    ] = _GPTQ.gptq.mse,
    fp64: Annotated[bool, typer.Option(help="Accumulate Hessians and solve in float64.")] = _GPTQ.gptq.fp64,
    hessian_weighting: Annotated[
        str, typer.Option(help="samples (each sample weighs the same) or tokens.")
    ] = _GPTQ.gptq.hessian_weighting,
    method: Annotated[
        str, typer.Option(help="gptq, or rtn (round to nearest on the same grid: the baseline).")
    ] = _GPTQ.method,
    quantize_lm_head: Annotated[
        bool, typer.Option(help="Refused: no engine serves a quantized lm_head.")
    ] = _GPTQ.gptq.quantize_lm_head,
    propagate: Propagate = _GPTQ.engine.propagate,
    chunk_tokens: ChunkTokens = _GPTQ.engine.chunk_tokens,
    device: Device = _GPTQ.engine.device,
    tp: Annotated[int, typer.Option(help="Tensor-parallel size the checker validates shapes for.")] = _GPTQ.export.tp,
    marlin_fallback: Annotated[
        bool, typer.Option(help="Keep linears whose shapes gptq_marlin cannot serve in bf16 (else fail).")
    ] = _GPTQ.export.marlin_fallback,
    shard_size: ShardSize = _GPTQ.export.shard_size,
    save_recipe: SaveRecipe = None,
    resume: Resume = False,
    overwrite: Overwrite = False,
) -> None:
    """SmoothQuant + full-Hessian GPTQ, exported as a GPTQ v1 checkpoint for vLLM / SGLang gptq_marlin."""
    recipe = {
        "method": method,
        "calibration": calibration_flags(calib, max_samples, max_len, min_len, shuffle, seed, field, bos),
        "smoothing": {"enabled": smooth, "alpha": smooth_alpha},
        "quantization": {
            "bits": bits,
            "group_size": group_size,
            "minicpm4_bits": minicpm4_bits,
            "lightning_bits": lightning_bits,
            "layer_bits": layer_bits,
            "exclude": exclude or [],
            "budget": budget,
        },
        "gptq": {
            "damp": damp,
            "act_order": act_order,
            "mse": mse,
            "fp64": fp64,
            "hessian_weighting": hessian_weighting,
            "quantize_lm_head": quantize_lm_head,
        },
        "engine": {"device": device, "chunk_tokens": chunk_tokens, "propagate": propagate},
        "export": {"shard_size": shard_size, "tp": tp, "marlin_fallback": marlin_fallback},
    }
    _run_from_flags(recipe, input, output, save_recipe, resume, overwrite)


@app.command("nvfp4")
def nvfp4_command(
    input: Input,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the NVFP4 checkpoint.")],
    calib: Calib,
    max_samples: MaxSamples = _NVFP4.calibration.max_samples,
    max_len: MaxLen = _NVFP4.calibration.max_len,
    min_len: MinLen = _NVFP4.calibration.min_len,
    shuffle: Shuffle = _NVFP4.calibration.shuffle,
    seed: Seed = _NVFP4.calibration.seed,
    field: Field = _NVFP4.calibration.field,
    bos: Bos = _NVFP4.calibration.bos,
    dense_all: Annotated[
        bool, typer.Option(help="Quantize the minicpm4 attention blocks too.")
    ] = _NVFP4.nvfp4.dense_all,
    exclude: Exclude = None,
    budget: Budget = None,
    mse_iters: Annotated[
        int, typer.Option(help="Block-scale search steps (0: plain scales).")
    ] = _NVFP4.nvfp4.mse_iters,
    mse_max_shrink: Annotated[
        float, typer.Option(help="Smallest tried block scale = 1 - this.")
    ] = _NVFP4.nvfp4.mse_max_shrink,
    input_scale: Annotated[
        str, typer.Option(help="Activation global scale: max (ModelOpt's) or mse (least FP4 error, slower).")
    ] = _NVFP4.nvfp4.input_scale,
    rounding: Annotated[
        str, typer.Option(help="gptq (error feedback over the input Hessian), or nearest (faster calibration).")
    ] = _NVFP4.nvfp4.rounding,
    static_scales: Annotated[
        bool,
        typer.Option("--static-scales/--sweep-scales", help="gptq: block scales before the sweep, or as it goes."),
    ] = _NVFP4.nvfp4.static_scales,
    smooth_alpha: SmoothAlpha = _NVFP4.smoothing.alpha,
    no_smooth: NoSmooth = not SMOOTH_BY_DEFAULT["nvfp4"],
    propagate: Propagate = _NVFP4.engine.propagate,
    chunk_tokens: ChunkTokens = _NVFP4.engine.chunk_tokens,
    device: Device = _NVFP4.engine.device,
    shard_size: ShardSize = _NVFP4.export.shard_size,
    save_recipe: SaveRecipe = None,
    resume: Resume = False,
    overwrite: Overwrite = False,
) -> None:
    """SmoothQuant + block-scale search + GPTQ rounding NVFP4, in ModelOpt's format for SGLang / vLLM
    modelopt_fp4."""
    recipe = {
        "method": "nvfp4",
        "calibration": calibration_flags(calib, max_samples, max_len, min_len, shuffle, seed, field, bos),
        "smoothing": {"enabled": not no_smooth, "alpha": smooth_alpha},
        "quantization": {"budget": budget},
        "nvfp4": {
            "dense_all": dense_all,
            "exclude": exclude or [],
            "mse_iters": mse_iters,
            "mse_max_shrink": mse_max_shrink,
            "input_scale": input_scale,
            "rounding": rounding,
            "static_scales": static_scales,
        },
        "engine": {"device": device, "chunk_tokens": chunk_tokens, "propagate": propagate},
        "export": {"shard_size": shard_size},
    }
    _run_from_flags(recipe, input, output, save_recipe, resume, overwrite)


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
def run(
    recipe: Annotated[str, typer.Argument(help="A recipe file, or the name of a shipped recipe.")],
    input: Input,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the quantized checkpoint.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a key: --set gptq.damp=0.05")] = None,
    calib: Annotated[list[str] | None, typer.Option(help="Shorthand for --set calibration.sources=[...]")] = None,
    resume: Resume = False,
    overwrite: Overwrite = False,
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
    _run(resolved, input, output, resume, overwrite, recipe)


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
