"""SmoothQuant scales for one input group, and their exact fold into a SALA decoder layer.

For an input group whose input x comes from a norm (or from ``up_proj`` for ``down_proj``), the scales
``s_j = act_j^alpha / w_j^(1 - alpha)`` (normalised to geometric mean 1 and clamped) move difficulty from
activations to weights: the producer is divided by s (norm weight, or up_proj output rows), every consumer's
input columns are multiplied by s, and the group's Hessian becomes ``diag(1/s) H diag(1/s)``. The layer's
function is unchanged up to rounding. Groups whose input is the gated attention output of a minicpm4 layer
(no norm in front of ``o_proj``) cannot be smoothed this way and are skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.layout import InputGroup


def smoothable(group: InputGroup) -> bool:
    """Whether the group's input has a producer that a per-channel scale folds into (``InputGroup.producer``)."""
    return group.producer is not None


def smooth_scales(
    act: torch.Tensor,
    weights: list[torch.Tensor],
    alpha: float,
    clamp: tuple[float, float] = (0.01, 100.0),
    eps: float = 1e-5,
) -> torch.Tensor:
    """``s = act^alpha / w^(1 - alpha)``, w the max over the consumers of each input column's absmax;
    normalised so that the geometric mean of s is 1, then clamped."""
    w = torch.stack([m.detach().float().abs().amax(0) for m in weights]).amax(0).clamp(min=eps)
    a = act.float().clamp(min=eps)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    s = s / torch.exp(torch.log(s).mean())
    return s.clamp(*clamp)


@torch.no_grad()
def fold_scales(layer: nn.Module, group: InputGroup, scales: torch.Tensor) -> None:
    """Divide the group's producer by ``scales`` and multiply its consumers' input columns by them, in fp32,
    storing back in each parameter's dtype."""
    s = scales.float()
    if group.producer == "norm":
        norm = layer.get_submodule(group.source)
        norm.weight.data = (norm.weight.data.float() / s).to(norm.weight.dtype)
    elif group.producer == "rows":
        up = layer.get_submodule(group.source)
        up.weight.data = (up.weight.data.float() / s[:, None]).to(up.weight.dtype)
    else:
        raise ValueError(f"group {group.name}: its input ({group.source}) has no producer to fold scales into")
    for name in group.members:
        lin = layer.get_submodule(name)
        lin.weight.data = (lin.weight.data.float() * s[None, :]).to(lin.weight.dtype)


def transform_hessian(h: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The Hessian of the smoothed input x / s: ``diag(1/s) H diag(1/s)``."""
    inv = (1.0 / scales).to(h.dtype)
    return h * inv[:, None] * inv[None, :]
