"""Per-layer error: which decoder layer, and which of its two branches, the quantization hurt.

The float model's hidden states are carried through its own layers; at every layer the same input h goes
through the float layer and the quantized layer, and over all tokens of all windows

* ``rel_err`` = ||y_q - y_f|| / ||y_f||, y = the layer's output (residual stream included);
* ``rel_err_branch`` = ||y_q - y_f|| / ||y_f - h||, the same error against what the layer adds to the stream;
* ``attention`` = ||a_q - a_f|| / ||a_f||, a = ``self_attn(input_layernorm(h))``, the attention branch alone;
* ``mlp`` = ||m_q - m_f|| / ||m_f||, m = ``mlp(post_attention_layernorm(h2))`` on the float layer's own
  mid-layer stream h2 = h + attention x residual scale, the MLP branch alone.

Each branch starts at a norm, so SmoothQuant (which moves scales between a norm or a linear and the linears
that follow, all inside one branch) leaves both branches comparable, whereas single linears are not (an
``up_proj`` output is rescaled per channel when it is smoothed into ``down_proj``). Errors do not compound
from layer to layer, so a bad layer stands out by itself: a layer whose ``rel_err`` is more than
``OUTLIER_FACTOR`` times the median of all layers is reported as an outlier.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..model.modeling import layer_rope
from . import w4a4_split
from .metrics import ModelPair

OUTLIER_FACTOR = 5.0
OUTLIER_MIN_ERROR = 1e-3  # below this, no layer is called an outlier (e.g. a model against itself)


@dataclass
class _Acc:
    err2: float = 0.0
    ref2: float = 0.0

    def add(self, y_q: torch.Tensor, y_f: torch.Tensor) -> None:
        self.err2 += float((y_q.float() - y_f.float()).pow(2).sum())
        self.ref2 += float(y_f.float().pow(2).sum())

    @property
    def rel(self) -> float:
        if math.isnan(self.err2):
            return math.nan
        if self.ref2 == 0:
            return 0.0 if self.err2 == 0 else math.inf
        return math.sqrt(self.err2 / self.ref2)


@dataclass
class LayerError:
    index: int
    kind: str
    rel_err: float
    rel_err_branch: float
    attention: float
    mlp: float
    weights_only: float | None = None  # W4A4 layers only
    activations_only: float | None = None

    @property
    def activation_share(self) -> float | None:
        if self.weights_only is None or self.activations_only is None:
            return None
        a2, w2 = self.activations_only**2, self.weights_only**2
        return a2 / (a2 + w2) if a2 + w2 > 0 else (math.nan if math.isnan(a2 + w2) else 0.0)

    @property
    def worst_branch(self) -> str:
        return "mlp" if _order(self.mlp) > _order(self.attention) else "attention"

    def summary(self) -> dict[str, Any]:
        return {
            "layer": self.index,
            "name": f"model.layers.{self.index}",
            "kind": self.kind,
            "rel_err": self.rel_err,
            "rel_err_branch": self.rel_err_branch,
            "attention": self.attention,
            "mlp": self.mlp,
            "worst_branch": self.worst_branch,
            "weights_only": self.weights_only,
            "activations_only": self.activations_only,
            "activation_share": self.activation_share,
        }


def _order(x: float) -> float:
    return math.inf if math.isnan(x) else x


class _Seen:
    """Forward hooks on the float layer: its attention output, its mid-layer stream and its MLP output."""

    attention: torch.Tensor
    mid: torch.Tensor
    mlp: torch.Tensor

    def attention_output(self, _module: Any, _args: Any, output: torch.Tensor) -> None:
        self.attention = output

    def mid_stream(self, _module: Any, args: tuple[torch.Tensor, ...]) -> None:
        self.mid = args[0]

    def mlp_output(self, _module: Any, _args: Any, output: torch.Tensor) -> None:
        self.mlp = output


@torch.no_grad()
def layer_errors(
    pair: ModelPair, wins: Sequence[torch.Tensor], on_layer: Callable[[int], None] | None = None
) -> list[LayerError]:
    """Relative error of every quantized decoder layer (and of its two branches) against the float one, on the
    float model's hidden states; a W4A4 layer is also run with only its weights and only its activations
    quantized."""
    reference, quantized, attention_mode, device = pair.reference, pair.quantized, pair.attention_mode, pair.device
    config = reference.config
    layers_f, layers_q = reference.model.layers, quantized.model.layers
    results = []
    hidden = [reference.model.embed(w[None].to(device)) for w in wins]
    for i, (lf, lq) in enumerate(zip(layers_f, layers_q, strict=True)):
        out, branch, attn, mlp, w_only, a_only = _Acc(), _Acc(), _Acc(), _Acc(), _Acc(), _Acc()
        split = w4a4_split.is_w4a4(lq)
        if split:
            float_weights = w4a4_split.activations_only_weights(lf, lq, lf.kind, config)
        seen, seen_q = _Seen(), _Seen()
        hooks = [
            lf.self_attn.register_forward_hook(seen.attention_output),
            lq.self_attn.register_forward_hook(seen_q.attention_output),
            lf.mlp.register_forward_hook(seen.mlp_output),
            lf.post_attention_layernorm.register_forward_pre_hook(seen.mid_stream),
        ]
        try:
            for j, h in enumerate(hidden):
                rope = layer_rope(config, lf.kind, 0, h.shape[1], h.device)
                y_f = lf(h, rope, None, attention_mode)
                y_q = lq(h, rope, None, attention_mode)
                out.add(y_q, y_f)
                branch.err2 += float((y_q.float() - y_f.float()).pow(2).sum())
                branch.ref2 += float((y_f.float() - h.float()).pow(2).sum())
                attn.add(seen_q.attention, seen.attention)  # both layers' own attention branch on h
                mlp.add(lq.mlp(lq.post_attention_layernorm(seen.mid)), seen.mlp)
                if split:
                    with w4a4_split.weights_only(lq):
                        w_only.add(lq(h, rope, None, attention_mode), y_f)
                    with w4a4_split.activations_only(lq, float_weights):
                        a_only.add(lq(h, rope, None, attention_mode), y_f)
                hidden[j] = y_f
        finally:
            for handle in hooks:
                handle.remove()
        results.append(
            LayerError(
                i,
                lf.kind,
                out.rel,
                branch.rel,
                attn.rel,
                mlp.rel,
                w_only.rel if split else None,
                a_only.rel if split else None,
            )
        )
        if on_layer is not None:
            on_layer(i)
    return results


def outliers(errors: Sequence[LayerError], factor: float = OUTLIER_FACTOR) -> list[int]:
    """Layers whose error exceeds ``factor`` x the median layer error (and ``OUTLIER_MIN_ERROR``), or is NaN."""
    if not errors:
        return []
    finite = [e.rel_err for e in errors if math.isfinite(e.rel_err)]
    median = statistics.median(finite) if finite else 0.0
    return [
        e.index
        for e in errors
        if not math.isfinite(e.rel_err) or (e.rel_err > OUTLIER_MIN_ERROR and e.rel_err > factor * median)
    ]


def summarize(errors: Sequence[LayerError]) -> dict[str, Any]:
    """The per-layer list, the worst layer and the outliers."""
    if not errors:
        return {"layers": [], "worst": None, "outliers": [], "median_rel_err": None}
    worst = max(errors, key=lambda e: _order(e.rel_err))
    finite = [e.rel_err for e in errors if math.isfinite(e.rel_err)]
    median = statistics.median(finite) if finite else math.nan
    return {
        "layers": [e.summary() for e in errors],
        "worst": worst.summary() | {"times_median": worst.rel_err / median if median > 0 else None},
        "outliers": outliers(errors),
        "median_rel_err": median,
    }
