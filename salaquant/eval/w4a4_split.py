"""A W4A4 NVFP4 layer with only its weights, or only its activations, quantized: where its error comes from.

A layer loaded W4A4 (``NVFP4Linear`` with an ``input_scale``) quantizes two things; the per-layer report runs
it twice more on the same inputs:

* **weights only**: the same linears with their ``input_scale`` taken away, i.e. the weight-only layer;
* **activations only**: every NVFP4 linear replaced by one that quantizes its input exactly as before (same
  ``input_scale``) but multiplies by the float model's weight *in the smoothed basis of the export*.

The export folds SmoothQuant scales ``s`` into the layer (a producer divided by ``s``, its consumers' input
columns multiplied by ``s``), so the float weight has to be moved into that basis for the activations the FP4
quantizer sees to be the export's own. ``s`` is read back from the two layers: for a norm producer it is
``norm_float / norm_export`` (exact up to the norm's storage rounding); for ``up_proj`` rows (whose export weight
is quantized) it is each row's least-squares ratio of the float row to the dequantized one. Whatever ``s`` is
recovered, producer and consumers get the same one, so the activations-only layer computes the float layer's
function exactly when its activations are not quantized: only the FP4 activations make it differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..formats.modelopt_nvfp4.numerics import NVFP4Weight, quantize_activations
from ..model.config import SalaConfig
from ..model.layout import input_groups
from ..runtime.linear import NVFP4Linear


class ActivationsOnlyLinear(nn.Module):
    """``y = fp4(x) @ W^T``: the FP4 GEMM's activation quantization (none without an ``input_scale``) with a
    float weight, the product in fp32 and returned in the input's dtype."""

    def __init__(self, weight: torch.Tensor, input_scale: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight.float())
        self.register_buffer("input_scale", input_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = quantize_activations(x, self.input_scale)
        return (x.float() @ self.weight.T).to(x.dtype)


def is_w4a4(layer: nn.Module) -> bool:
    """Whether any linear of the layer quantizes its activations to FP4."""
    return any(isinstance(m, NVFP4Linear) and m.input_scale is not None for m in layer.modules())


def _weight(layer: nn.Module, name: str) -> torch.Tensor:
    """fp32 ``[out, in]`` weight of the linear ``name`` of a decoder layer (dequantized if NVFP4), also when the
    runtime fused it (its rows of the fused weight)."""
    parent_name, _, child = name.rpartition(".")
    parent = layer.get_submodule(parent_name)
    if child in parent._modules:
        return _module_weight(parent.get_submodule(child))
    rows = _module_weight(parent.get_submodule(parent.fused_name)).split(parent.fused_sizes, 0)
    return rows[parent.fused_members.index(child)]


def _module_weight(module: nn.Module) -> torch.Tensor:
    if isinstance(module, NVFP4Linear):
        return NVFP4Weight(module.weight, module.weight_scale, module.weight_scale_2).dequantize()
    return module.weight.detach().float()


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` with 1 where ``den`` is 0 (a channel no scale reached)."""
    return torch.where(den != 0, num / torch.where(den != 0, den, 1.0), torch.ones_like(num))


@torch.no_grad()
def smoothing_scales(
    float_layer: nn.Module, export_layer: nn.Module, kind: str, config: SalaConfig
) -> dict[str, torch.Tensor]:
    """Per input group of the layer, the per-channel scale ``s`` the export folded in (1 where none was)."""
    scales: dict[str, torch.Tensor] = {}
    for g in input_groups(config, kind):
        if g.producer == "norm":
            f = float_layer.get_submodule(g.source).weight.float()
            scales[g.name] = _ratio(f, export_layer.get_submodule(g.source).weight.float())
        elif g.producer == "rows":
            # the producer's rows were divided by s after its own input columns were scaled by its group's s
            (own,) = [h for h in input_groups(config, kind) if g.source in h.members]
            a = _weight(float_layer, g.source) * scales[own.name][None, :]
            q = _weight(export_layer, g.source)
            scales[g.name] = _ratio(a.pow(2).sum(1), (a * q).sum(1))
    return scales


@torch.no_grad()
def activations_only_weights(
    float_layer: nn.Module, export_layer: nn.Module, kind: str, config: SalaConfig
) -> dict[str, torch.Tensor]:
    """For every NVFP4 linear of the export layer (a fused one included), the float weight in the export's
    smoothed basis."""
    scales = smoothing_scales(float_layer, export_layer, kind, config)
    groups = input_groups(config, kind)
    rows_of = {g.source: scales[g.name] for g in groups if g.producer == "rows"}
    group_of = {m: g.name for g in groups for m in g.members}

    def smoothed(member: str) -> torch.Tensor:
        w = _weight(float_layer, member)
        if group_of[member] in scales:
            w = w * scales[group_of[member]][None, :]
        if member in rows_of:
            w = w / rows_of[member][:, None]
        return w

    out: dict[str, torch.Tensor] = {}
    for name, module in export_layer.named_modules():
        if isinstance(module, NVFP4Linear):
            out[name] = torch.cat([smoothed(m) for m in linear_members(export_layer, name)], 0)
    return out


def linear_members(layer: nn.Module, name: str) -> tuple[str, ...]:
    """The linears a (fused or plain) linear ``name`` of a decoder layer computes, as layer-relative names."""
    parent_name, _, child = name.rpartition(".")
    parent = layer.get_submodule(parent_name)
    if child != getattr(parent, "fused_name", None):
        return (name,)
    return tuple(f"{parent_name}.{m}" for m in parent.fused_members)


def _set(layer: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, child, module)


@contextmanager
def weights_only(layer: nn.Module) -> Iterator[None]:
    """The layer with every NVFP4 linear's activation quantization off, restored on exit."""
    saved = {m: m.input_scale for m in layer.modules() if isinstance(m, NVFP4Linear)}
    try:
        for m in saved:
            m.input_scale = None
        yield
    finally:
        for m, s in saved.items():
            m.input_scale = s


@contextmanager
def activations_only(export_layer: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """The export layer with each NVFP4 linear named in ``weights`` (from ``activations_only_weights``) computing
    from that float weight with the linear's own FP4 activations (none if it has no ``input_scale``). Restored on
    exit."""
    saved = {name: export_layer.get_submodule(name) for name in weights}
    try:
        for name, w in weights.items():
            _set(export_layer, name, ActivationsOnlyLinear(w, saved[name].input_scale))
        yield
    finally:
        for name, module in saved.items():
            _set(export_layer, name, module)
