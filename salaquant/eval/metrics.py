"""Next-token statistics of a quantized model against its source on the same windows.

For every predicted position t of a window (targets ``ids[1:]``), with p and q the source's and the
quantized model's next-token distributions:

* ``nll`` = -log p(target) and -log q(target); perplexity = exp(mean NLL) over all positions;
* ``nll_diff`` = -log q(target) + log p(target), per token (positive: the quantized model is worse there);
* ``kl`` = KL(p || q) = sum_v p_v (log p_v - log q_v), per position, in nats;
* ``top1`` = argmax p == argmax q;
* positions whose logits hold a NaN or an Inf are counted for each model (their NLL and KL are NaN).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

NLL_DIFF_HISTOGRAM_BINS = 61
NLL_DIFF_HISTOGRAM_RANGE = 3.0  # nats either side of 0; values beyond land in the outer bins


def _quantile(x: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile of the finite values (NaN when there is none)."""
    v = x[torch.isfinite(x)].double().sort().values
    if v.numel() == 0:
        return math.nan
    pos = q * (v.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


@dataclass
class ModelStats:
    """One model's side of a comparison: its NLL at every position, the positions with NaN/Inf logits, how often
    its top-1 is the unknown token, and how often each token is its top-1."""

    nll: list[torch.Tensor] = field(default_factory=list)
    nonfinite: int = 0
    unk_top1: int = 0
    top1_counts: torch.Tensor | None = None

    def update(
        self, logp: torch.Tensor, logits: torch.Tensor, top: torch.Tensor, t: torch.Tensor, unk_id: int | None
    ) -> None:
        """``logp`` the log-softmax of ``logits [T, V]``, ``top`` their argmax, ``t [T, 1]`` the targets."""
        self.nll.append(-logp.gather(-1, t)[:, 0].cpu())
        self.nonfinite += int((~torch.isfinite(logits)).any(-1).sum())
        if unk_id is not None:
            self.unk_top1 += int((top == unk_id).sum())
        counts = torch.bincount(top.cpu(), minlength=logits.shape[-1])
        self.top1_counts = counts if self.top1_counts is None else self.top1_counts + counts


@dataclass
class LogitComparison:
    """Accumulates the per-position statistics of both models over any number of windows."""

    unk_id: int | None = None
    source: ModelStats = field(default_factory=ModelStats)
    quantized: ModelStats = field(default_factory=ModelStats)
    kl: list[torch.Tensor] = field(default_factory=list)
    agree: int = 0
    tokens: int = 0
    windows: int = 0

    @torch.no_grad()
    def update(self, source_logits: torch.Tensor, quantized_logits: torch.Tensor, targets: torch.Tensor) -> None:
        """``*_logits`` [T, V] predict ``targets`` [T] (position t predicts the token at t + 1 of the window)."""
        p = torch.log_softmax(source_logits.float(), -1)
        q = torch.log_softmax(quantized_logits.float(), -1)
        t = targets.to(p.device)[:, None]
        top_p, top_q = source_logits.argmax(-1), quantized_logits.argmax(-1)
        self.source.update(p, source_logits, top_p, t, self.unk_id)
        self.quantized.update(q, quantized_logits, top_q, t, self.unk_id)
        prob = p.exp()
        self.kl.append(torch.where(prob > 0, prob * (p - q), torch.zeros_like(p)).sum(-1).cpu())
        self.agree += int((top_p == top_q).sum())
        self.tokens += int(targets.numel())
        self.windows += 1

    def summary(self) -> dict[str, Any]:
        """Every figure as plain floats and ints (NaN where a model produced non-finite logits)."""
        if self.tokens == 0:
            raise ValueError("no window was compared")
        nll_p, nll_q, kl = torch.cat(self.source.nll), torch.cat(self.quantized.nll), torch.cat(self.kl)
        mean_p, mean_q = float(nll_p.double().mean()), float(nll_q.double().mean())
        ppl_p, ppl_q = _exp(mean_p), _exp(mean_q)
        diff = nll_q - nll_p
        edges = torch.linspace(-NLL_DIFF_HISTOGRAM_RANGE, NLL_DIFF_HISTOGRAM_RANGE, NLL_DIFF_HISTOGRAM_BINS + 1)
        finite = diff[torch.isfinite(diff)].clamp(-NLL_DIFF_HISTOGRAM_RANGE, NLL_DIFF_HISTOGRAM_RANGE)
        hist = torch.histc(finite, NLL_DIFF_HISTOGRAM_BINS, -NLL_DIFF_HISTOGRAM_RANGE, NLL_DIFF_HISTOGRAM_RANGE)
        return {
            "windows": self.windows,
            "tokens": self.tokens,
            "ppl_source": ppl_p,
            "ppl_quantized": ppl_q,
            "ppl_ratio": ppl_q / ppl_p if ppl_p > 0 else math.nan,
            "ppl_increase": ppl_q / ppl_p - 1 if ppl_p > 0 else math.nan,
            "nll_source": mean_p,
            "nll_quantized": mean_q,
            "nll_diff": {
                "mean": float(diff.double().mean()),
                "std": float(diff.double().std()) if diff.numel() > 1 else 0.0,
                "p05": _quantile(diff, 0.05),
                "p50": _quantile(diff, 0.5),
                "p95": _quantile(diff, 0.95),
                "p99": _quantile(diff, 0.99),
                "max": float(diff.max()),
                "min": float(diff.min()),
                "fraction_worse": float((diff > 0).double().mean()),
                "histogram": {"edges": [round(float(e), 6) for e in edges], "counts": [int(c) for c in hist]},
            },
            "kl": float(kl.double().mean()),
            "kl_p50": _quantile(kl, 0.5),
            "kl_p99": _quantile(kl, 0.99),
            "kl_max": float(kl.max()),
            "top1": self.agree / self.tokens,
            "nonfinite_positions_source": self.source.nonfinite,
            "nonfinite_positions_quantized": self.quantized.nonfinite,
            "unk_top1_fraction_source": self.source.unk_top1 / self.tokens if self.unk_id is not None else None,
            "unk_top1_fraction_quantized": self.quantized.unk_top1 / self.tokens if self.unk_id is not None else None,
            "most_frequent_top1_source": _mode(self.source.top1_counts, self.tokens),
            "most_frequent_top1_quantized": _mode(self.quantized.top1_counts, self.tokens),
        }


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _mode(counts: torch.Tensor | None, total: int) -> dict[str, Any] | None:
    if counts is None:
        return None
    token = int(counts.argmax())
    return {"token": token, "fraction": int(counts[token]) / total}


@dataclass
class RerunCheck:
    """The quantized model run twice on the same window: how far apart the two logits are."""

    tokens: int
    max_abs_logit_diff: float
    top1_changes: int

    def summary(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "max_abs_logit_diff": self.max_abs_logit_diff, "top1_changes": self.top1_changes}


@dataclass(frozen=True)
class ModelPair:
    """A quantized model and its source, run alike: both called as ``m(ids, attention_mode=...)`` on ``device``."""

    reference: Any
    quantized: Any
    attention_mode: str = "dense"
    device: torch.device | str = "cpu"


@torch.no_grad()
def compare_windows(
    pair: ModelPair,
    wins: Sequence[torch.Tensor],
    unk_id: int | None = None,
    rerun_first: bool = False,
    on_window: Callable[[int], None] | None = None,
) -> tuple[LogitComparison, RerunCheck | None]:
    """Both models (``.logits`` of each call) on every window; with ``rerun_first`` the quantized model also runs
    the first window a second time (run-to-run stability)."""
    reference, quantized, attention_mode, device = pair.reference, pair.quantized, pair.attention_mode, pair.device
    cmp = LogitComparison(unk_id=unk_id)
    rerun: RerunCheck | None = None
    for i, w in enumerate(wins):
        ids = w[None].to(device)
        p = reference(ids, attention_mode=attention_mode).logits[0, :-1]
        q = quantized(ids, attention_mode=attention_mode).logits[0, :-1]
        cmp.update(p, q, ids[0, 1:])
        del p
        if rerun_first and i == 0:
            again = quantized(ids, attention_mode=attention_mode).logits[0, :-1]
            a, b = again.float(), q.float()
            same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # equal infinities and NaN at the same place
            delta = torch.where(same, torch.zeros_like(a), (a - b).abs().nan_to_num(math.inf))
            rerun = RerunCheck(
                tokens=int(q.shape[0]),
                max_abs_logit_diff=float(delta.max()),
                top1_changes=int((again.argmax(-1) != q.argmax(-1)).sum()),
            )
            del again, a, b, delta
        del q
        if on_window is not None:
            on_window(i)
    return cmp, rerun
