"""Write a quantized SALA checkpoint: source globals + the engine's per-layer tensors + configs and reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .model.checkpoint import CheckpointReader, CheckpointWriter
from .model.config import SalaConfig
from .model.layout import global_parameter_shapes
from .pipeline import EngineResult


def export_checkpoint(
    source: Path,
    output: Path,
    result: EngineResult,
    qconfig: dict[str, Any],
    extra_files: dict[str, Any],
    *,
    lm_head_tensors: dict[str, torch.Tensor] | None = None,
    max_shard_bytes: int = 4 * 10**9,
    overwrite: bool = False,
) -> Path:
    """Embeddings, final norm and (unless quantized) lm_head from the source; every decoder layer from the
    engine's work folder; ``config.json`` with ``quantization_config``; tokenizer and remote-code files;
    ``extra_files`` (format configs, reports, resolved settings) as JSON, or as text when given a string."""
    reader = CheckpointReader(source)
    config = SalaConfig.from_dict(reader.config())
    shapes = global_parameter_shapes(config)
    with CheckpointWriter(output, max_shard_bytes=max_shard_bytes, overwrite=overwrite) as writer:
        writer.add(
            "model.embed_tokens.weight",
            reader.get_checked("model.embed_tokens.weight", shapes["model.embed_tokens.weight"]),
        )
        for i in range(config.num_hidden_layers):
            for name, tensor in result.layer_tensors(i).items():
                writer.add(f"model.layers.{i}.{name}", tensor)
        writer.add("model.norm.weight", reader.get_checked("model.norm.weight", shapes["model.norm.weight"]))
        if lm_head_tensors:
            for name, tensor in lm_head_tensors.items():
                writer.add(f"lm_head.{name}", tensor)
        elif "lm_head.weight" in shapes:
            writer.add("lm_head.weight", reader.get_checked("lm_head.weight", shapes["lm_head.weight"]))
        raw = reader.config()
        raw["quantization_config"] = qconfig
        raw.setdefault("torch_dtype", "bfloat16")
        writer.write_json("config.json", raw)
        for name, obj in extra_files.items():
            if isinstance(obj, str):
                (writer.tmp_dir / name).write_text(obj)
            else:
                writer.write_json(name, obj)
        writer.copy_aux(source)
        log = result.work_dir / "log.txt"
        if log.exists():
            (writer.tmp_dir / "quantize.log").write_text(log.read_text())
    return output
