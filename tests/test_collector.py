"""The statistics pass of one layer (``salaquant.calibration.collector``): skipping the layer's last product where
its outputs are dropped leaves every statistic as the full forward's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from salaquant.calibration.collector import GroupCollector, last_product_skipped
from salaquant.calibration.contract import EngineOptions
from salaquant.io.reader import CheckpointReader
from salaquant.model.config import SalaConfig
from salaquant.model.layout import input_groups
from salaquant.model.loading import CheckpointParts
from salaquant.model.modeling import layer_rope


@pytest.mark.parametrize("index", [0, 1])  # minicpm4, lightning
def test_last_product_skipped_keeps_the_statistics(tiny_ckpt_fp32: Path, index: int) -> None:
    """With and without the skip, every group's sums (Hessians included) are bit for bit the same; inside it the
    layer's output is its input plus the attention branch alone (the MLP's down projection returns zeros, so the
    MLP adds nothing), and after it the layer computes its full output again."""
    reader = CheckpointReader(tiny_ckpt_fp32)
    cfg = SalaConfig.from_dict(reader.config())
    layer = CheckpointParts(reader, cfg).layer(index)
    x = torch.randn(1, 48, cfg.hidden_size, generator=torch.Generator().manual_seed(index))
    rope = layer_rope(cfg, layer.kind, 0, 48, "cpu")
    groups = input_groups(cfg, layer.kind)

    def collected(skip: bool) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
        collector = GroupCollector(layer, groups, torch.device("cpu"), EngineOptions(hessian=True))
        with torch.no_grad():
            if skip:
                with last_product_skipped(layer):
                    y = layer(x, rope, None, "dense")
            else:
                y = layer(x, rope, None, "dense")
        collector.end_sample()
        stats = collector.next_leaf()
        collector.remove()
        return {name: st.to_tensors() for name, st in stats.items()}, y

    full, y_full = collected(skip=False)
    skipped, y_skipped = collected(skip=True)
    assert full.keys() == skipped.keys() == {g.name for g in groups}
    for name in full:
        assert full[name].keys() == skipped[name].keys()
        for key, value in full[name].items():
            assert torch.equal(value, skipped[name][key]), (name, key)
    with torch.no_grad():
        attn_only = x + layer.self_attn(layer.input_layernorm(x), rope, None, "dense") * layer.residual_scale
        assert torch.equal(y_skipped, attn_only)
        assert not torch.equal(y_full, attn_only)
        assert torch.equal(layer(x, rope, None, "dense"), y_full)  # the linear's own forward is back
