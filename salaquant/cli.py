"""``salaquant`` command line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from . import __version__
from .io.files import CheckpointError
from .model.config import ConfigError
from .progress import console as make_console
from .settings import SMOOTH_BY_DEFAULT, defaults, parse_size

_GPTQ, _NVFP4 = defaults("gptq"), defaults("nvfp4")  # every flag's default comes from the settings

app = typer.Typer(
    name="salaquant",
    help="Post-training quantization for MiniCPM-SALA: GPTQ W4A16 and NVFP4 for vLLM/SGLang.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = make_console()
err = make_console(stderr=True)


# options shared by the commands that calibrate
MaxSamples = Annotated[int | None, typer.Option(help="Keep at most this many samples.")]
MaxLen = Annotated[int, typer.Option(help="Truncate samples to this many tokens.")]
MinLen = Annotated[int, typer.Option(help="Drop samples shorter than this.")]
Shuffle = Annotated[bool, typer.Option(help="Shuffle the records (with --seed) instead of file order.")]
Seed = Annotated[int, typer.Option(help="Shuffle seed.")]
Field = Annotated[str | None, typer.Option(help="Record field holding the text.")]
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


def fail(message: str, code: int = 2) -> None:
    err.print("[bold red]error:[/] ", end="", highlight=False, markup=True)
    err.print(message, highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(code)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        console.print(f"salaquant {__version__}")
        raise typer.Exit(0)
    _progress_lines(ctx)


def _progress_lines(ctx: typer.Context) -> None:
    """Plain progress lines for the whole command when stderr is not a terminal (the heartbeat covers every long
    step, loading and exporting too), on rank 0 only under torchrun; a bad interval setting is refused first."""
    from . import progress

    try:
        progress.line_seconds()
    except ValueError as exc:
        fail(str(exc))
    if ctx.invoked_subcommand is not None and os.environ.get("RANK", "0") == "0":
        ctx.with_resource(progress.plain_lines(f"salaquant {ctx.invoked_subcommand}: started"))


@app.command()
def tiny(
    out: Annotated[Path, typer.Argument(help="Output folder for the checkpoint.")],
    preset: Annotated[str, typer.Option(help="tiny (CI size), small (trained-model shape) or full (9.48B).")] = "tiny",
    seed: Annotated[int, typer.Option(help="Random seed: the same seed writes the same bytes.")] = 0,
    std: Annotated[float, typer.Option(help="Standard deviation of the random linear/embedding weights.")] = 0.02,
    device: Annotated[str, typer.Option(help="Where to draw the random numbers (cpu or cuda).")] = "cpu",
    shard_size: Annotated[str, typer.Option(help="Largest shard, e.g. 4GB or 500MB.")] = "4GB",
    overwrite: Overwrite = False,
) -> None:
    """Write a random-init SALA checkpoint with the real structure and a byte-level tokenizer."""
    import math

    from .engine import resolve_device
    from .model.tiny import preset_config, write_random_checkpoint
    from .outputs import check_replace

    if not (math.isfinite(std) and std > 0):
        fail(f"--std {std}: expected a finite number above 0")
    if not -(2**63) <= seed < 2**64:  # what torch's generator takes
        fail(f"--seed {seed}: expected a number from -2**63 to 2**64 - 1")
    try:
        shard_bytes = parse_size(shard_size)
    except ValueError as exc:
        fail(f"--shard-size: {exc}")
    try:
        check_replace(out, overwrite, flag="")
        cfg = preset_config(preset)
        path = write_random_checkpoint(
            out,
            cfg,
            seed=seed,
            std=std,
            device=str(resolve_device(device)),
            max_shard_bytes=shard_bytes,
            overwrite=overwrite,
        )
    except (ValueError, CheckpointError) as exc:
        fail(str(exc))
    console.print(f"wrote {preset} SALA checkpoint to [bold]{path}[/]")


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="A SALA checkpoint folder (or its config.json).")],
) -> None:
    """Print the layer map, parameter counts per layer type and the bf16 / W4A16 / NVFP4 sizes."""
    from .model.config import SalaConfig
    from .model.layout import parameter_shapes
    from .summary import human_bytes, human_count, layer_map, summarize

    try:
        config = SalaConfig.from_file(model)
    except ConfigError as exc:
        fail(str(exc))
    s = summarize(config)

    console.print(
        f"[bold]{model}[/]: MiniCPM-SALA, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"intermediate {config.intermediate_size}, vocab {config.vocab_size}"
    )
    runs = ", ".join(f"{a}" if a == b else f"{a}-{b}" for _, a, b in layer_map(config) if _ == "minicpm4")
    console.print(f"minicpm4 (sparse softmax) layers: {runs or 'none'}; all others lightning (Simple GLA)")
    sc = config.sparse_config
    if sc is not None:
        console.print(
            f"sparse_config: block {sc['block_size']}, topk {sc['topk']} + window {sc['window_size']}, "
            f"dense_len {sc['dense_len']}"
        )

    table = Table(title="Layer map")
    table.add_column("layers")
    table.add_column("mixer")
    table.add_column("attention")
    for kind, a, b in layer_map(config):
        desc = (
            f"GQA {config.num_attention_heads}:{config.num_key_value_heads} x {config.head_dim}, "
            f"rope={'on' if config.attn_use_rope else 'off'}, o_gate"
            if kind == "minicpm4"
            else f"GLA {config.lightning_nh} heads x {config.lightning_head_dim}, q/k norm, rope, o_norm, z_proj"
        )
        table.add_row(str(a) if a == b else f"{a}-{b}", kind, desc)
    console.print(table)

    params = Table(title="Parameters")
    for col in ("part", "layers", "attention", "mlp", "norms", "total"):
        params.add_column(col, justify="right" if col != "part" else "left")
    for kind, st in s.kinds.items():
        params.add_row(
            kind,
            str(st.layers),
            human_count(st.attention),
            human_count(st.mlp),
            human_count(st.norms),
            human_count(st.total),
        )
    params.add_row("embed_tokens", "", "", "", "", human_count(s.embed))
    params.add_row("lm_head", "", "", "", "", human_count(s.lm_head) if s.lm_head else "tied")
    params.add_row("[bold]total", "", "", "", "", f"[bold]{human_count(s.total_params)}")
    console.print(params)

    sizes = Table(title="Checkpoint size (embeddings and lm_head bf16)")
    sizes.add_column("format")
    sizes.add_column("bytes", justify="right")
    sizes.add_column("vs bf16", justify="right")
    for name, value in (
        ("bf16", s.bf16_bytes),
        ("W4A16 GPTQ g128 (all decoder linears)", s.w4a16_bytes),
        ("NVFP4 default (minicpm4 attention bf16)", s.nvfp4_default_bytes),
        ("NVFP4 dense-all", s.nvfp4_dense_all_bytes),
    ):
        sizes.add_row(name, human_bytes(value), f"{value / s.bf16_bytes:.3f}")
    console.print(sizes)

    cfg_path = model if model.is_dir() else model.parent
    has_weights = any(cfg_path.glob("*.safetensors")) or any(cfg_path.glob("*.bin"))
    if has_weights:
        from .model.loading import validate_source

        try:
            reader, _ = validate_source(cfg_path)
        except (CheckpointError, ConfigError) as exc:
            fail(str(exc))
        console.print(
            f"weights: {len(parameter_shapes(config))} tensors present with the expected shapes, "
            f"{human_bytes(reader.total_bytes())} on disk"
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
    chunk_tokens: ChunkTokens = _GPTQ.engine.chunk_tokens,
    device: Device = _GPTQ.engine.device,
    hessian: Annotated[bool, typer.Option(help="Also keep X^T X per input group (d^2 floats each).")] = False,
    hessian_dtype: Annotated[str, typer.Option(help="fp32 or fp64 accumulation.")] = "fp32",
    resume: Resume = False,
    overwrite: Overwrite = False,
) -> None:
    """Run the calibration engine (forced dense, layer by layer) and save per-layer input statistics."""
    from .calib_data import CalibOptions
    from .calibrate_command import run_calibrate
    from .work_folder import RunInterrupted

    try:
        options = CalibOptions(
            max_samples=max_samples, max_len=max_len, min_len=min_len, shuffle=shuffle, seed=seed, field=field
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
        "calibration": _calibration(calib, max_samples, max_len, min_len, shuffle, seed, field),
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
    """SmoothQuant + block-scale search NVFP4, exported in ModelOpt's format for SGLang / vLLM modelopt_fp4."""
    recipe = {
        "method": "nvfp4",
        "calibration": _calibration(calib, max_samples, max_len, min_len, shuffle, seed, field),
        "smoothing": {"enabled": not no_smooth, "alpha": smooth_alpha},
        "quantization": {"budget": budget},
        "nvfp4": {
            "dense_all": dense_all,
            "exclude": exclude or [],
            "mse_iters": mse_iters,
            "mse_max_shrink": mse_max_shrink,
            "input_scale": input_scale,
        },
        "engine": {"device": device, "chunk_tokens": chunk_tokens, "propagate": propagate},
        "export": {"shard_size": shard_size},
    }
    _run_from_flags(recipe, input, output, save_recipe, resume, overwrite)


SaveRecipe = Annotated[Path | None, typer.Option(help="Write the recipe these flags imply to this YAML file.")]


def _calibration(
    sources: list[str], max_samples: int | None, max_len: int, min_len: int, shuffle: bool, seed: int, field: str | None
) -> dict[str, Any]:
    return {
        "sources": sources,
        "max_samples": max_samples,
        "max_len": max_len,
        "min_len": min_len,
        "shuffle": shuffle,
        "seed": seed,
        "field": field,
    }


def _run_from_flags(
    data: dict[str, Any], input: Path, output: Path, save_recipe: Path | None, resume: bool, overwrite: bool
) -> None:
    """Flags -> recipe (validated like a file; errors name the flag) -> the same run as ``salaquant run``."""
    from .recipe import RecipeError, recipe_from_dict

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
    from .run_recipe import GateFailed, run_recipe
    from .work_folder import RunInterrupted

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
    from .recipe import RecipeError, load_recipe

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
    from .recipe import load_recipe, shipped_recipes

    table = Table(title="Shipped recipes")
    table.add_column("name")
    table.add_column("method")
    table.add_column("description")
    for name in sorted(shipped_recipes()):
        r = load_recipe(name)
        table.add_row(name, r.method, r.description)
    console.print(table)


@app.command()
def generate(
    model: Annotated[Path, typer.Argument(help="A bf16, GPTQ or NVFP4 SALA checkpoint folder.")],
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "The",
    prompts: Annotated[
        Path | None,
        typer.Option(help="A file of prompts (one per line, or JSONL): each continuation is printed as a JSON line."),
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together (with --prompts).", min=1)] = 16,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 40,
    temperature: Annotated[float, typer.Option(help="0: greedy; above 0: sample at this temperature.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens only (0: all).")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample from the smallest set holding this probability (1: all).")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed of the sampler (a reproducible completion).")] = None,
    attention: Annotated[str, typer.Option(help="auto (dense below dense_len), dense or sparse.")] = "auto",
    device: Device = "auto",
    backend: Annotated[str, typer.Option(help="auto (Triton on CUDA), triton or reference.")] = "auto",
    attention_kernels: Annotated[
        bool, typer.Option(help="Run GLA / sparse attention with salaquant.kernels (Triton on CUDA).")
    ] = True,
    graphs: Annotated[bool, typer.Option(help="Replay each decode step as a CUDA graph (CUDA only).")] = True,
    compile: Annotated[
        bool,
        typer.Option(
            help="Compile the decode step with torch.compile before capturing it (CUDA graphs only): faster steps "
            "after about a minute of compiling per batch size at the full shape; pays off over long generations."
        ),
    ] = False,
) -> None:
    """Completion with the runtime (greedy unless --temperature): a quick check that a checkpoint loads and talks,
    or, with --prompts, batched generation over a file of prompts."""
    import json
    import time

    import torch

    from .calib_data import CalibrationError
    from .engine import resolve_device
    from .eval.generation import load_prompts
    from .io.reader import CheckpointReader
    from .model.config import ATTENTION_MODES
    from .model.modeling import NonFiniteLogits
    from .model.sampling import Sampling
    from .runtime.decode import Decoder
    from .runtime.load import checkpoint_format, load, open_checked
    from .workflow import load_tokenizer

    if attention not in ATTENTION_MODES:
        fail(f"--attention {attention!r}: expected one of {', '.join(ATTENTION_MODES)}")
    if max_new_tokens < 1:
        fail(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    try:
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
        dev = resolve_device(device)
        open_checked(model, dev, backend)  # before the tokenizer and the prompts: the checks of check and eval
        tok = load_tokenizer(model)
        texts = [prompt] if prompts is None else load_prompts(prompts, tok)
        net = load(model, device=dev, backend=backend, kernels=attention_kernels)
    except (ValueError, CheckpointError, CalibrationError, RuntimeError, OSError) as exc:
        fail(str(exc))
    ids = [torch.tensor(tok(t)["input_ids"], dtype=torch.long) for t in texts]
    if any(len(i) == 0 for i in ids):
        fail(f"prompt {[len(i) for i in ids].index(0)} has no tokens")
    generator = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    dec = Decoder(net, graphs=graphs, compile=compile, attention_mode=attention)
    eos = tok.eos_token_id
    t0 = time.perf_counter()
    try:
        outs = dec.generate_in_batches(
            ids, max_new_tokens, sampling, batch_size=batch_size, generator=generator, eos_token_id=eos
        )
    except NonFiniteLogits as exc:
        fail(f"{model}: {exc}; no text is printed")
    seconds = time.perf_counter() - t0
    fmt = checkpoint_format(CheckpointReader(model))
    made = sum(len(o) for o in outs)
    err.print(f"[dim]{model} ({fmt}) on {dev}: {made} tokens for {len(ids)} prompt(s) in {seconds:.2f} s[/]")
    if prompts is None:
        sys.stdout.write(prompt + tok.decode(outs[0], skip_special_tokens=True) + "\n")
        return
    for text, out in zip(texts, outs, strict=True):
        completion = tok.decode(out, skip_special_tokens=True)
        sys.stdout.write(json.dumps({"prompt": text, "completion": completion, "tokens": len(out)}) + "\n")


@app.command("eval")
def eval_command(
    quantized: Annotated[Path, typer.Argument(help="The exported (GPTQ / NVFP4) checkpoint folder.")],
    reference: Annotated[Path, typer.Option("--reference", "-r", help="The bf16 source checkpoint folder.")],
    data: Annotated[
        str | None, typer.Option(help="Held-out text: .jsonl, text, folder, parquet or hf:NAME... (default: shipped)")
    ] = None,
    field: Field = None,
    max_len: Annotated[int, typer.Option(help="Tokens per perplexity window (context length).")] = 4096,
    windows: Annotated[int, typer.Option(help="Number of windows scored.")] = 8,
    attention: Annotated[str, typer.Option(help="auto (sparse from dense_len on), dense or sparse.")] = "auto",
    niah: Annotated[
        str, typer.Option(help='Needle-in-a-haystack lengths, e.g. "8k,32k"; auto = dense_len,4xdense_len; none.')
    ] = "auto",
    niah_depths: Annotated[str, typer.Option(help="Needle depths (fractions of the context).")] = "0.1,0.3,0.5,0.7,0.9",
    prompts: Annotated[
        str | None, typer.Option(help="Generation prompts: .jsonl (prompt/text) or one per line (default: built-in).")
    ] = None,
    gen_tokens: Annotated[int, typer.Option(help="Greedy tokens per prompt (0 skips generation).")] = 40,
    gen_prompts: Annotated[
        int,
        typer.Option(help="Built-in prompts generated from (without --prompts); 16 with --gen-tokens 2048: long runs."),
    ] = 6,
    tasks: Annotated[
        str,
        typer.Option(help="Long-context tasks: niah_multikey, niah_multivalue (niah: both), vt, cwe, fwe; none."),
    ] = "none",
    lengths: Annotated[
        str, typer.Option(help='Task prompt lengths, e.g. "4k,32k,128k"; auto = the NIAH lengths.')
    ] = "auto",
    task_samples: Annotated[int, typer.Option(help="Cases per task and length.")] = 2,
    temperature: Annotated[
        float, typer.Option(help="NIAH, tasks and generation: 0 greedy, else sampled at this temperature.")
    ] = 0.0,
    repeat: Annotated[
        int, typer.Option(help="Runs of NIAH, tasks and generation with different seeds (needs --temperature).")
    ] = 1,
    kv_cache: Annotated[
        str, typer.Option(help="The export's minicpm4 KV cache as SGLang stores it: bf16, fp8_e5m2 or fp8_e4m3.")
    ] = "bf16",
    layer_windows: Annotated[int, typer.Option(help="Windows for the per-layer error (0 skips it).")] = 2,
    report: Annotated[
        Path | None,
        typer.Option(
            help="Write eval.json / eval.png to this folder: a new or empty one, one of earlier reports, or the "
            "evaluated export (default: none, the report is only printed)."
        ),
    ] = None,
    device: Device = "auto",
    backend: Annotated[str, typer.Option(help="Quantized linears: auto (Triton on CUDA), triton or reference.")] = (
        "auto"
    ),
    attention_kernels: Annotated[
        bool | None,
        typer.Option(
            "--attention-kernels/--no-attention-kernels", help="GLA / sparse attention kernels (default: runtime's)."
        ),
    ] = None,
    activations: Annotated[
        str, typer.Option(help="auto (fp4 for NVFP4: W4A4 as Blackwell runs it), fp4 or bf16 (weight-only).")
    ] = "auto",
    tp: Annotated[int, typer.Option(help="Tensor-parallel size for the format check.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the NIAH filler, keys and values.")] = 0,
    max_ppl_increase: Annotated[str | None, typer.Option(help='Fail above this perplexity increase: "5%" or 0.05.')] = (
        None
    ),
    max_kl: Annotated[
        str | None, typer.Option(help="Fail above this mean KL(source || quantized), nats/token.")
    ] = None,
    min_top1: Annotated[str | None, typer.Option(help='Fail below this top-1 agreement: "90%" or 0.9.')] = None,
    max_layer_error: Annotated[
        str | None, typer.Option(help="Fail when a layer's relative error exceeds this.")
    ] = None,
    max_niah_drop: Annotated[
        str | None, typer.Option(help='Fail when the NIAH exact-match rate drops by more than this ("10%").')
    ] = None,
    max_rerun_diff: Annotated[
        str | None, typer.Option(help="Fail when two runs of the same window differ by more (abs. logit).")
    ] = None,
    max_drop: Annotated[
        str | None, typer.Option(help='Fail when a task\'s mean score drops by more: "cwe=5%,vt=10%".')
    ] = None,
    no_collapse: Annotated[
        bool, typer.Option("--no-collapse", help="Fail on collapse (where the source has none) or NaN/Inf logits.")
    ] = False,
    no_new_loops: Annotated[
        bool, typer.Option("--no-new-loops", help="Fail on n-gram loops the source's continuation does not have.")
    ] = False,
) -> None:
    """Quantized vs bf16 source: perplexity, KL, top-1, NIAH, generation checks, per-layer error; gates.

    Exit status: 0 all thresholds met, 1 format check failed, 2 bad input, 3 a threshold missed.
    """
    from .calib_data import CalibrationError
    from .eval import EvalInputError, EvalOptions, Thresholds, run_eval
    from .eval.command import parse_depths, parse_lengths
    from .eval.tasks import TASKS, parse_tasks
    from .eval.thresholds import parse_fraction, parse_non_negative, parse_task_drops
    from .formats.check import CheckError

    try:

        def frac(value: str | None, name: str) -> float | None:
            return None if value is None else parse_fraction(value, name)

        def number(value: str | None, name: str) -> float | None:
            return None if value is None else parse_non_negative(value, name)

        gates = Thresholds(
            max_ppl_increase=frac(max_ppl_increase, "--max-ppl-increase"),
            max_kl=number(max_kl, "--max-kl"),
            min_top1=frac(min_top1, "--min-top1"),
            max_layer_error=number(max_layer_error, "--max-layer-error"),
            max_niah_drop=frac(max_niah_drop, "--max-niah-drop"),
            max_rerun_diff=number(max_rerun_diff, "--max-rerun-diff"),
            max_task_drop=parse_task_drops(max_drop, TASKS) if max_drop is not None else None,
            no_collapse=no_collapse,
            no_new_loops=no_new_loops,
        )
        options = EvalOptions(
            data=data,
            field=field,
            max_len=max_len,
            windows=windows,
            attention=attention,
            niah_lengths=parse_lengths(niah),
            niah_depths=parse_depths(niah_depths),
            prompts_file=prompts,
            gen_prompts=gen_prompts,
            tasks=parse_tasks(tasks),
            task_lengths=parse_lengths(lengths, "--lengths"),
            task_samples=task_samples,
            kv_cache=kv_cache,
            temperature=temperature,
            repeat=repeat,
            gen_tokens=gen_tokens,
            layer_windows=layer_windows,
            device=device,
            backend=backend,
            kernels=attention_kernels,
            activations=activations,
            tp=tp,
            seed=seed,
        )
        result = run_eval(quantized, reference, options, gates, report, console)
    except CheckError as exc:
        fail(f"format check failed, eval stopped: {exc}", code=1)
    except (EvalInputError, CalibrationError, ConfigError, CheckpointError, ValueError, OSError) as exc:
        fail(str(exc))
    if not result["passed"]:
        fail("eval: " + "; ".join(result["failures"]), code=3)


@app.command()
def demo(
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Folder for the checkpoints and demo.json (default: a new temp folder)."),
    ] = None,
    quick: Annotated[
        bool, typer.Option(help="Less calibration and evaluation (a smoke run of a few minutes).")
    ] = False,
    model: Annotated[Path | None, typer.Option(help="A bf16 SALA checkpoint (default: the shipped sala-tiny).")] = None,
    calib: Annotated[Path | None, typer.Option(help="Calibration JSONL (default: the shipped sample).")] = None,
    device: Device = "cpu",
    overwrite: Annotated[
        bool,
        typer.Option(help="Replace a folder salaquant wrote for another use (an export); a demo's own is reused."),
    ] = False,
) -> None:
    """Quantize the shipped tiny model with GPTQ W4A16 and NVFP4 (default, dense-all) and score each against bf16."""
    from .calib_data import CalibrationError
    from .demo import DemoError, run_demo

    try:
        run_demo(out, console, quick=quick, model=model, calib=calib, device=device, overwrite=overwrite)
    except (DemoError, CalibrationError, ConfigError, CheckpointError, ValueError, OSError) as exc:
        fail(str(exc))


@app.command()
def check(
    model: Annotated[Path, typer.Argument(help="A quantized checkpoint folder.")],
    tp: Annotated[int, typer.Option(help="Tensor-parallel size to validate shard shapes for.")] = 1,
) -> None:
    """Verify that a quantized checkpoint has what vLLM / SGLang need (formats, shapes, fused groups).

    Exit status: 0 the checkpoint passes, 1 it fails the format requirements (every problem listed), 2 bad input
    (a missing folder, an unreadable or corrupt file, a bad flag).
    """
    from .formats.check import CheckError, check_checkpoint

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


def interrupted(exc: KeyboardInterrupt) -> None:
    """Ctrl-C inside a run: say what was kept and how to resume (the run's message), exit 130."""
    err.print(str(exc) or "interrupted", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(130)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
