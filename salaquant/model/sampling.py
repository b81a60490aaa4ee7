"""Next-token choice for decoding: greedy, or sampling with temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Sampling", "filter_logits", "next_token"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``temperature == 0`` is greedy (argmax; ``top_k``/``top_p`` unused).

    Otherwise the logits are divided by ``temperature``, cut to the ``top_k`` largest (0: no cut) and to the
    smallest set of most likely tokens whose probabilities sum to at least ``top_p`` (1: no cut), and the
    token is drawn from what remains.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cut), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits [..., V]`` with every token outside the top-k and the top-p nucleus set to ``-inf``.

    The nucleus keeps a token when the probability mass of the tokens ranked above it is below ``top_p``,
    so the most likely token always stays. Ties at the cut are kept or dropped by ``torch.sort``'s order.
    """
    out = logits.float().clone()
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token ``[B, 1]`` from the last position's ``logits [B, V]``."""
    if sampling.greedy:
        return logits.argmax(-1, keepdim=True)
    scaled = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)
