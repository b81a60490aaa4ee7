"""The statistics hooks of one decoder layer: forward pre-hooks on the first member of each input group feed the
`GroupStats` of the current leaf of samples (the engine sums the leaves in a fixed tree). Where the statistics
pass drops the layer's outputs, ``last_product_skipped`` spares it the layer's last product."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..model.layout import LAST_LINEAR, InputGroup
from ..model.modeling import DecoderLayer
from .contract import EngineOptions
from .stats import GroupStats, LayerStats

__all__ = ["GroupCollector", "last_product_skipped"]


@contextmanager
def last_product_skipped(layer: DecoderLayer) -> Iterator[None]:
    """Within the block the layer's last linear (``LAST_LINEAR``) returns zeros instead of its product: for a pass
    whose layer outputs nobody reads. Its forward pre-hooks still run on its real input (the linear is called as
    before), so the statistics are those of the full forward; only the outputs are wrong, and dropped."""
    module = layer.get_submodule(LAST_LINEAR)
    assert isinstance(module, nn.Linear)
    module.forward = lambda x: x.new_zeros((*x.shape[:-1], module.out_features))  # shadows the class's forward
    try:
        yield
    finally:
        del module.forward


class GroupCollector:
    """Forward pre-hooks on the first member of each input group of one layer, feeding the statistics of the
    current leaf of samples (`next_leaf` starts a new one and returns the finished one)."""

    def __init__(self, layer: DecoderLayer, groups: list[InputGroup], device: torch.device, opts: EngineOptions):
        self.dims: dict[str, int] = {}
        self.handles = []
        self.device = device
        self.dtype = torch.float64 if opts.hessian_dtype == "fp64" else torch.float32
        self.hessian = opts.hessian
        self.sums = tuple(opts.hessian_sums)
        for g in groups:
            module = layer.get_submodule(g.members[0])
            assert isinstance(module, nn.Linear)
            self.dims[g.name] = module.in_features
            self.handles.append(module.register_forward_pre_hook(self._hook(g.name)))
        self.stats = self.empty()

    def empty(self) -> LayerStats:
        return {
            name: GroupStats(d, device=self.device, dtype=self.dtype, hessian=self.hessian, sums=self.sums)
            for name, d in self.dims.items()
        }

    def _hook(self, name: str):
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self.stats[name].update(args[0])

        return hook

    def end_sample(self) -> None:
        for st in self.stats.values():
            st.end_sample()

    def next_leaf(self) -> LayerStats:
        done, self.stats = self.stats, self.empty()
        for st in done.values():
            st.close()
        return done

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
