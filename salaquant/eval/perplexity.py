"""Perplexity of a causal LM over fixed-length windows of a token stream."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass
class PerplexityResult:
    nll_sum: float
    tokens: int
    windows: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def encode_stream(tokenizer, texts: Iterable[str], eos_id: int) -> torch.Tensor:
    """Token ids of the texts (no BOS), each followed by ``eos_id``: the layout the tiny model trained on."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def windows(tokens: torch.Tensor, seq_len: int, max_windows: int | None = None) -> list[torch.Tensor]:
    """Non-overlapping windows of ``seq_len`` tokens from the start of a 1-D token stream."""
    n = tokens.numel() // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    return [tokens[i * seq_len : (i + 1) * seq_len] for i in range(n)]


@torch.no_grad()
def perplexity(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    seq_len: int,
    max_windows: int | None = None,
    batch_size: int = 1,
    device: torch.device | str = "cpu",
) -> PerplexityResult:
    """Every window is scored independently; all seq_len - 1 next-token predictions of a window count."""
    wins = windows(tokens, seq_len, max_windows)
    if not wins:
        raise ValueError(f"need at least {seq_len} tokens for one window, got {tokens.numel()}")
    nll, count = 0.0, 0
    for i in range(0, len(wins), batch_size):
        batch = torch.stack(wins[i : i + batch_size]).to(device=device, dtype=torch.long)
        logits = logits_fn(batch).float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        nll += float(loss)
        count += batch[:, 1:].numel()
    return PerplexityResult(nll_sum=nll, tokens=count, windows=len(wins))


def compare_models(
    reference, model, wins: list[torch.Tensor], attention_mode: str = "dense", device: torch.device | str = "cpu"
) -> dict[str, float]:
    """Perplexity of ``model``, mean per-token KL(reference || model) and top-1 agreement of next-token
    predictions over the windows (both models called as ``m(ids, attention_mode=...).logits``); the figures
    of ``salaquant.eval.metrics``, which also has the reference's perplexity and the per-token differences."""
    from .metrics import ModelPair, compare_windows

    s = compare_windows(ModelPair(reference, model, attention_mode, device), wins)[0].summary()
    return {"ppl": s["ppl_quantized"], "kl": s["kl"], "top1": s["top1"]}
