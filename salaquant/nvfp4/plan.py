"""Which linears NVFP4 quantizes, under the constraints of the serving engines.

Default: every decoder linear except the attention block of the minicpm4 layers (SGLang builds an
attention block unquantized as soon as one of its sub-modules is excluded, and their k/v are only
``num_key_value_heads * head_dim`` wide); ``dense_all`` quantizes every decoder linear. ``exclude``
patterns add exclusions: a pattern that hits one attention sub-module excludes that layer's whole
``self_attn`` block, and one that would split a fused MLP group (gate/up) is refused. lm_head and the
embeddings always stay bf16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..model.config import SPARSE, SalaConfig
from ..model.layout import FUSED_PARAMETERS, exclusion_block, layer_linears, linear_names, no_match, unmatched


class NVFP4PlanError(ValueError):
    """An impossible exclusion plan; the message names the pattern and the modules (``exclude``: the offending
    pattern, by index)."""

    def __init__(self, message: str, exclude: int | None = None) -> None:
        super().__init__(message)
        self.exclude = exclude


@dataclass
class NVFP4Plan:
    quantized: set[str]  # full linear names
    excluded: set[str]
    notes: list[str] = field(default_factory=list)

    def exclude_modules(self, config: SalaConfig) -> list[str]:
        """``exclude_modules`` as ModelOpt writes them: prefix wildcards, never empty (lm_head at least)."""
        out = ["lm_head"]
        for i, kind in enumerate(config.mixer_types):
            names = [f"model.layers.{i}.{s.name}" for s in layer_linears(config, kind)]
            attn = [n for n in names if ".self_attn." in n]
            mlp = [n for n in names if ".mlp." in n]
            if all(n in self.excluded for n in names):
                out.append(f"model.layers.{i}*")
                continue
            if all(n in self.excluded for n in attn):
                out.append(f"model.layers.{i}.self_attn*")
            else:
                out += [f"{n}*" for n in attn if n in self.excluded]
            if all(n in self.excluded for n in mlp):
                out.append(f"model.layers.{i}.mlp*")
            else:
                out += [f"{n}*" for n in mlp if n in self.excluded]
        return out


def build_nvfp4_plan(config: SalaConfig, dense_all: bool = False, exclude: tuple[str, ...] = ()) -> NVFP4Plan:
    patterns = []
    for k, pat in enumerate(exclude):
        try:
            patterns.append(re.compile(pat))
        except re.error as exc:
            raise NVFP4PlanError(f"--exclude {pat!r}: not a valid regular expression ({exc})", exclude=k) from exc
    names = linear_names(config)
    k = unmatched(patterns, names)
    if k is not None:
        raise NVFP4PlanError(no_match("--exclude", exclude[k], names), exclude=k)
    quantized: set[str] = set()
    excluded: set[str] = set()
    notes: list[str] = []
    for i, kind in enumerate(config.mixer_types):
        prefix = f"model.layers.{i}."
        names = [prefix + s.name for s in layer_linears(config, kind)]
        hit = {n for n in names if any(p.search(n) for p in patterns)}
        blocks: dict[str, set[str]] = {}
        for n in names:
            block = exclusion_block(n.removeprefix(prefix))
            if block is not None:
                blocks.setdefault(block, set()).add(n)
        if kind == SPARSE and not dense_all:
            hit |= blocks.get("self_attn", set())
        for block, members in blocks.items():
            if hit & members and not members <= hit:
                notes.append(
                    f"{prefix}{block}: excluding {', '.join(sorted(n.removeprefix(prefix) for n in hit & members))} "
                    f"excludes the whole {'attention' if block == 'self_attn' else block} block "
                    "(SGLang builds it unquantized)"
                )
                hit |= members
        for fused, members in FUSED_PARAMETERS.items():
            full = {prefix + m for m in members}
            if full & hit and not full <= hit:
                raise NVFP4PlanError(
                    f"--exclude would split the fused {prefix}{fused} ({', '.join(sorted(full & hit))} but not "
                    f"{', '.join(sorted(full - hit))}): engines load them as one parameter"
                )
        excluded |= hit
        quantized |= set(names) - hit
    return NVFP4Plan(quantized=quantized, excluded=excluded, notes=notes)
