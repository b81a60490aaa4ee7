"""Write a GPTQ W4A16 checkpoint (GPTQ v1 layout) that vLLM / SGLang load with gptq_marlin."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..model.checkpoint import CheckpointReader, CheckpointWriter
from ..model.config import SalaConfig
from ..model.layout import global_parameter_shapes
from ..pipeline import EngineResult
from .dynamic import LinearPlan, build_dynamic


def quantization_config(
    config: SalaConfig, plan: dict[str, LinearPlan], group_size: int, lm_head: bool, meta: dict[str, Any]
) -> dict[str, Any]:
    """The ``quantization_config`` / ``quantize_config.json`` dict: top-level bits = the most common bits."""
    counts = Counter(p.bits for p in plan.values() if p.bits is not None)
    if not counts:
        raise ValueError("the plan quantizes no linear: nothing to export as GPTQ")
    default_bits = counts.most_common(1)[0][0]
    dynamic = build_dynamic(plan, default_bits, group_size, config.num_hidden_layers)
    out: dict[str, Any] = {
        "quant_method": "gptq",
        "bits": default_bits,
        "group_size": group_size,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
        "lm_head": lm_head,
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"salaquant:{__version__}"], **meta},
    }
    if dynamic:
        out["dynamic"] = dynamic
    return out


def export_gptq(
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
    engine's work folder; config with ``quantization_config``, ``quantize_config.json``, tokenizer and
    remote-code files, and ``extra_files`` (reports, resolved settings) as JSON."""
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
        writer.write_json("quantize_config.json", qconfig)
        for name, obj in extra_files.items():
            writer.write_json(name, obj)
        writer.copy_aux(source)
        log = result.work_dir / "log.txt"
        if log.exists():
            (writer.tmp_dir / "quantize.log").write_text(log.read_text())
    return output


def read_quantization_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())["quantization_config"]
