"""``salaquant tiny`` and ``salaquant inspect``: a random checkpoint of the real structure; what a checkpoint holds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..io.files import CheckpointError
from ..model.config import ConfigError
from ..settings import parse_size
from .app import app, console, fail
from .options import (
    Overwrite,
)


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

    from ..devices import resolve_device
    from ..model.tiny import preset_config, write_random_checkpoint
    from ..outputs import check_replace

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
    from ..model.config import SalaConfig
    from ..model.layout import parameter_shapes
    from ..summary import human_bytes, human_count, layer_map, summarize

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
        ("bf16", s.sizes["bf16"]),
        ("W4A16 GPTQ g128 (all decoder linears)", s.sizes["w4a16"]),
        ("NVFP4 default (minicpm4 attention bf16)", s.sizes["nvfp4_default"]),
        ("NVFP4 dense-all", s.sizes["nvfp4_dense_all"]),
    ):
        sizes.add_row(name, human_bytes(value), f"{value / s.sizes['bf16']:.3f}")
    console.print(sizes)

    cfg_path = model if model.is_dir() else model.parent
    has_weights = any(cfg_path.glob("*.safetensors")) or any(cfg_path.glob("*.bin"))
    if has_weights:
        from ..model.loading import validate_source

        try:
            reader, _ = validate_source(cfg_path)
        except (CheckpointError, ConfigError) as exc:
            fail(str(exc))
        console.print(
            f"weights: {len(parameter_shapes(config))} tensors present with the expected shapes, "
            f"{human_bytes(reader.total_bytes())} on disk"
        )
