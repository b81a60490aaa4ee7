"""Fused projections: q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``, as the serving engines run
them; where a layer has an output gate, q/k/v with it as one ``qkvz_proj`` (lightning) or ``qkvg_proj`` (minicpm4).

A decode step then runs one 4-bit matrix product where it ran four (or two), at wide shapes the kernels run
closer to the memory's bandwidth (4096 -> 8704 / 16384 and 4096 -> 32768 at SALA's size). Each fused linear is its
members' output columns stacked in ``RUNTIME_FUSED`` order, so its output splits back into theirs:

* bf16: the weights concatenated along the output rows;
* GPTQ (v1 layout, ``qweight [in * bits / 32, out]``, ``scales [in / group, out]``): ``qweight`` and ``scales``
  concatenated along their output columns; members must share bits and group size;
* NVFP4 (``weight [out, in / 2]``, ``weight_scale [out, in / 16]``): both concatenated along the output rows;
  members must share ``weight_scale_2`` and ``input_scale`` (the export writes them shared within the engines'
  groups; an output gate with its own global scale stays apart).

Members that differ in kind or in those settings stay unfused. The exported files are read unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.layout import RUNTIME_FUSED
from .linear import GPTQLinear, NVFP4Linear

_QUANTIZED: dict[type[nn.Module], tuple[tuple[tuple[str, int], ...], tuple[str, ...]]] = {
    GPTQLinear: ((("qweight", 1), ("scales", 1)), ("bits", "group_size", "backend")),
    NVFP4Linear: ((("weight", 0), ("weight_scale", 0)), ("weight_scale_2", "backend", "input_scale")),
}
"""Per quantized linear: the tensors concatenated (attribute, dimension) and the settings its members must
share, in the order of its constructor's arguments."""


def _same(values: list[object]) -> bool:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return all(isinstance(t, torch.Tensor) and torch.equal(t, first) for t in values[1:])
    return all(v == first for v in values[1:])


def fuse_linears(members: list[nn.Module]) -> nn.Module | None:
    """One linear computing ``cat([m(x) for m in members], -1)``, or None when the members cannot share one."""
    first = members[0]
    if all(type(m) is nn.Linear for m in members):
        if any(m.bias is not None for m in members) or len({m.weight.dtype for m in members}) > 1:
            return None
        weight = torch.cat([m.weight.detach() for m in members], 0)
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        fused.weight = nn.Parameter(weight, requires_grad=False)
        return fused
    kind = type(first)
    if kind not in _QUANTIZED or not all(type(m) is kind for m in members):
        return None
    stacked, shared = _QUANTIZED[kind]
    if not all(_same([getattr(m, name) for m in members]) for name in shared):
        return None
    tensors = [torch.cat([getattr(m, name) for m in members], dim) for name, dim in stacked]
    return kind(*tensors, *(getattr(first, name) for name in shared))


def fuse_layer(layer: nn.Module) -> list[str]:
    """Replace each fusable group of the decoder layer by its fused linear; returns the fused names made. The
    parent module records ``fused_name``, ``fused_members`` and ``fused_sizes`` (``model.layers.fused_outputs``
    splits the product back by them)."""
    made = []
    for fused_name, member_names in RUNTIME_FUSED.items():
        parent_name, _, child = fused_name.rpartition(".")
        parent = layer.get_submodule(parent_name)
        names = tuple(m.rpartition(".")[2] for m in member_names)
        if not all(n in parent._modules for n in names) or getattr(parent, "fused_name", None) is not None:
            continue
        fused = fuse_linears([parent.get_submodule(n) for n in names])
        if fused is None:
            continue
        parent.add_module(child, fused)
        parent.fused_name, parent.fused_members = child, names
        parent.fused_sizes = tuple(_out_features(parent.get_submodule(n)) for n in names)
        for n in names:
            del parent._modules[n]
        made.append(fused_name)
    return made


def fuse_projections(model: nn.Module) -> list[str]:
    """``fuse_layer`` on every decoder layer; returns ``model.layers.i.<fused>`` for each fused linear made."""
    return [f"model.layers.{i}.{name}" for i, layer in enumerate(model.model.layers) for name in fuse_layer(layer)]


def _out_features(m: nn.Module) -> int:
    return int(m.out_features)
