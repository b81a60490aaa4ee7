"""What ``salaquant inspect`` reports: layer map, parameter counts per layer type, sizes per format."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .formats.gptq_v1.packing import linear_bytes as gptq_v1_bytes
from .formats.modelopt_nvfp4.numerics import linear_bytes as nvfp4_bytes
from .model.config import LIGHTNING, SPARSE, SalaConfig
from .model.layout import global_parameter_shapes, layer_linears, layer_norms

KINDS = (SPARSE, LIGHTNING)
SIZES = ("bf16", "w4a16", "nvfp4_default", "nvfp4_dense_all")
"""The formats ``summarize`` sizes a checkpoint in: bf16; GPTQ W4A16 g128 of every decoder linear; NVFP4 with the
minicpm4 attention in bf16 (the default) and of every decoder linear."""


@dataclass
class KindStats:
    layers: int = 0
    attention: int = 0
    mlp: int = 0
    norms: int = 0

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms


@dataclass
class ModelSummary:
    config: SalaConfig
    kinds: dict[str, KindStats] = field(default_factory=dict)
    embed: int = 0
    lm_head: int = 0
    final_norm: int = 0
    sizes: dict[str, int] = field(default_factory=dict)  # tensor bytes of the whole checkpoint per entry of SIZES

    @property
    def total_params(self) -> int:
        return sum(k.total for k in self.kinds.values()) + self.embed + self.lm_head + self.final_norm


def layer_map(config: SalaConfig) -> list[tuple[str, int, int]]:
    """Runs of consecutive layers of one kind: (kind, first, last)."""
    runs: list[tuple[str, int, int]] = []
    for i, kind in enumerate(config.mixer_types):
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], i)
        else:
            runs.append((kind, i, i))
    return runs


def summarize(config: SalaConfig) -> ModelSummary:
    s = ModelSummary(config=config, kinds={k: KindStats() for k in KINDS})
    glob = global_parameter_shapes(config)
    s.embed = math.prod(glob["model.embed_tokens.weight"])
    s.final_norm = config.hidden_size
    s.lm_head = math.prod(glob["lm_head.weight"]) if "lm_head.weight" in glob else 0
    fixed = 2 * (s.embed + s.lm_head + s.final_norm)
    sizes = s.sizes = dict.fromkeys(SIZES, fixed)
    for kind in config.mixer_types:
        st = s.kinds[kind]
        st.layers += 1
        norms = sum(layer_norms(config, kind).values())
        st.norms += norms
        for b in SIZES:
            sizes[b] += 2 * norms
        for spec in layer_linears(config, kind):
            n = spec.out_features * spec.in_features
            if spec.name.startswith("mlp."):
                st.mlp += n
            else:
                st.attention += n
            sizes["bf16"] += 2 * n
            sizes["w4a16"] += gptq_v1_bytes(spec.out_features, spec.in_features, 4, 128)
            fp4 = nvfp4_bytes(spec.out_features, spec.in_features)
            sizes["nvfp4_dense_all"] += fp4
            keep_bf16 = kind == SPARSE and spec.name.startswith("self_attn.")
            sizes["nvfp4_default"] += 2 * n if keep_bf16 else fp4
    return s


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3f}{unit}"
    return str(n)
