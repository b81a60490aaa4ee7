"""Decode-time state of a MiniCPM-SALA model: KV (+ compressed K) for minicpm4 layers, GLA state for lightning."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import LIGHTNING, SalaConfig


@dataclass
class SparseLayerCache:
    """Keys/values [B, T, Hkv, D] of a minicpm4 layer, plus the mean-pooled K1/K2 windows the sparse
    path has built so far (extended incrementally, only when sparse attention runs)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k1: torch.Tensor | None = None
    k2: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None or self.v is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=1)
            self.v = torch.cat([self.v, v], dim=1)
        return self.k, self.v


@dataclass
class LightningLayerCache:
    """Recurrent GLA state [B, H, K, V] in fp32."""

    state: torch.Tensor | None = None


@dataclass
class SalaCache:
    """One entry per decoder layer; ``seen_tokens`` counts the positions already processed."""

    layers: list[SparseLayerCache | LightningLayerCache] = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def for_config(cls, config: SalaConfig) -> SalaCache:
        return cls(layers=[LightningLayerCache() if m == LIGHTNING else SparseLayerCache() for m in config.mixer_types])

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """Positions ``[t]`` of the next ``t`` tokens."""
        return torch.arange(self.seen_tokens, self.seen_tokens + t, device=device)

    def advance(self, t: int) -> None:
        self.seen_tokens += t

    # transformers' generation utilities ask caches for these
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def __len__(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        total = 0
        for entry in self.layers:
            for t in vars(entry).values():
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total
