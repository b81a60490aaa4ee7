"""Random-init SALA checkpoints with the real structure: toy sizes for tests, the real shape for GPU benchmarks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from ..io.files import SETTINGS_NAME
from ..io.writer import CheckpointWriter
from .config import DEFAULT_SPARSE_CONFIG, SalaConfig
from .layout import parameter_shapes

# The published MiniCPM-SALA config.json (architecture fields), sparse layers at 0, 9, 16, 17, 22, 29, 30, 31.
_SPARSE_LAYERS = {0, 9, 16, 17, 22, 29, 30, 31}
FULL_CONFIG: dict[str, Any] = {
    "architectures": ["MiniCPMSALAForCausalLM"],
    "model_type": "minicpm_sala",
    "vocab_size": 73448,
    "hidden_size": 4096,
    "intermediate_size": 16384,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 524288,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.1,
    "pretraining_tp": 1,
    "scale_emb": 12,
    "scale_depth": 1.4,
    "dim_model_base": 256,
    "mup_denominator": 32,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": [2, 73440],
    "pad_token_id": 2,
    "use_cache": True,
    "mixer_types": ["minicpm4" if i in _SPARSE_LAYERS else "lightning-attn" for i in range(32)],
    "attn_use_rope": False,
    "attn_use_output_gate": True,
    "lightning_use_rope": True,
    "lightning_nh": 32,
    "lightning_nkv": 32,
    "lightning_head_dim": 128,
    "lightning_scale": "1/sqrt(d)",
    "qk_norm": True,
    "use_output_gate": True,
    "use_output_norm": True,
    "sparse_config": dict(DEFAULT_SPARSE_CONFIG),
    "dtype": "bfloat16",
}


_TOY_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim", "lightning_head_dim")
_TOY_HEADS: dict[str, Any] = {
    "num_attention_heads": 16,
    "num_key_value_heads": 1,
    "lightning_nh": 4,
    "lightning_nkv": 4,
}
"""The toy presets' heads: minicpm4 GQA 16:1 (the real model's ratio), four lightning heads."""


def _scaled(sizes: tuple[int, ...], **overrides: Any) -> dict[str, Any]:
    """The published config with ``sizes`` (``_TOY_SIZES``' fields, in order), the toy heads and ``overrides``."""
    cfg = copy.deepcopy(FULL_CONFIG)
    cfg.update(zip(_TOY_SIZES, sizes, strict=True), **_TOY_HEADS, **overrides)
    cfg["eos_token_id"] = 2
    cfg["initializer_range"] = 0.02
    return cfg


PRESETS: dict[str, dict[str, Any]] = {
    # CI size: both layer types, sparse parameters scaled down so selection drops blocks at 512 tokens.
    "tiny": _scaled(
        (264, 128, 256, 4, 8, 32),
        max_position_embeddings=4096,
        mixer_types=["minicpm4", "lightning-attn", "lightning-attn", "minicpm4"],
        sparse_config={
            "kernel_size": 16,
            "kernel_stride": 8,
            "init_blocks": 1,
            "block_size": 32,
            "window_size": 64,
            "topk": 4,
            "use_nope": False,
            "dense_len": 256,
        },
    ),
    # The trained-model shape: 8 layers, minicpm4 first and last (the real 1:3 ratio), Marlin-friendly sizes.
    "small": _scaled(
        (4096, 256, 1024, 8, 16, 64),
        max_position_embeddings=8192,
        mixer_types=["minicpm4"] + ["lightning-attn"] * 6 + ["minicpm4"],
        sparse_config={**DEFAULT_SPARSE_CONFIG, "window_size": 512, "topk": 8, "dense_len": 1024},
    ),
    # The real 9.48B shape (random weights): for GPU benchmarks.
    "full": copy.deepcopy(FULL_CONFIG),
}


def preset_config(name: str, vocab_size: int | None = None) -> dict[str, Any]:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = copy.deepcopy(PRESETS[name])
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    return cfg


def write_random_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any],
    *,
    seed: int = 0,
    std: float = 0.02,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    max_shard_bytes: int = 4 * 10**9,
    overwrite: bool = False,
    tokenizer: bool = True,
) -> Path:
    """Write a random-init checkpoint tensor by tensor (never the whole model in memory).

    Linears and embeddings are N(0, std), norms are ones. The same seed gives the same bytes. How it was drawn
    (seed, std, dtype) is recorded in ``salaquant_settings.json``, which also marks the folder as salaquant's: a
    later ``overwrite`` may replace it.
    """
    from .tokenizer import build_byte_tokenizer

    cfg = SalaConfig.from_dict(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = Path(out_dir)
    with CheckpointWriter(out, max_shard_bytes=max_shard_bytes, overwrite=overwrite) as writer:
        for name, shape in parameter_shapes(cfg).items():
            if len(shape) == 1:
                tensor = torch.ones(shape, dtype=dtype)
            else:
                tensor = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)
                tensor = tensor.to(dtype).cpu()
            writer.add(name, tensor)
        writer.write_json("config.json", cfg.to_dict())
        settings = {"method": "random", "seed": seed, "std": std, "dtype": str(dtype).removeprefix("torch.")}
        writer.write_json(SETTINGS_NAME, settings)
        writer.write_json(
            "generation_config.json",
            {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": False},
        )
        if tokenizer:
            build_byte_tokenizer(Path(writer.tmp_dir))
    return out
