"""SmoothQuant folding preserves each layer's function; the Hessian transform matches the smoothed inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from salaquant.io.reader import CheckpointReader
from salaquant.model.config import SalaConfig
from salaquant.model.layout import input_groups
from salaquant.model.loading import CheckpointParts
from salaquant.model.modeling import layer_rope
from salaquant.smooth.fold import fold_scales, smooth_scales, smoothable, transform_hessian


def _inputs_of(layer: nn.Module, names: list[str], x: torch.Tensor, rope) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    hs = [layer.get_submodule(n).register_forward_pre_hook(lambda _m, a, n=n: seen.__setitem__(n, a[0])) for n in names]
    with torch.no_grad():
        layer(x, rope, None, "dense")
    for h in hs:
        h.remove()
    return seen


@pytest.mark.parametrize("index", [0, 1])  # minicpm4, lightning
def test_fold_preserves_function_and_hessian(tiny_ckpt_fp32: Path, index: int) -> None:
    reader = CheckpointReader(tiny_ckpt_fp32)
    cfg = SalaConfig.from_dict(reader.config())
    layer = CheckpointParts(reader, cfg).layer(index)
    x = torch.randn(1, 40, cfg.hidden_size)
    rope = layer_rope(cfg, layer.kind, 0, 40, "cpu")
    groups = [g for g in input_groups(cfg, layer.kind) if smoothable(g)]
    assert [g.name for g in groups] == (
        ["attn_in", "mlp_in", "mlp_out"] if index == 0 else ["attn_in", "attn_out", "mlp_in", "mlp_out"]
    )
    before = _inputs_of(layer, [g.members[0] for g in groups], x, rope)
    with torch.no_grad():
        ref = layer(x, rope, None, "dense")
    scales = {}
    for g in groups:
        xin = before[g.members[0]].reshape(-1, before[g.members[0]].shape[-1])
        act = xin.pow(2).mean(0).sqrt()
        # exaggerate: scales far from 1 so a missed consumer would show
        s = smooth_scales(
            act * torch.logspace(-1, 1, act.numel()), [layer.get_submodule(m).weight for m in g.members], 0.5
        )
        assert s.min() > 0 and s.max() / s.min() > 2
        fold_scales(layer, g, s)
        scales[g.name] = (s, xin.double().T @ xin.double())
    with torch.no_grad():
        out = layer(x, rope, None, "dense")
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item()), (out - ref).abs().max()
    after = _inputs_of(layer, [g.members[0] for g in groups], x, rope)
    for g in groups:
        s, h = scales[g.name]
        xin = after[g.members[0]].reshape(-1, after[g.members[0]].shape[-1]).double()
        assert torch.allclose(transform_hessian(h, s.double()), xin.T @ xin, rtol=1e-4, atol=1e-6 * h.abs().max())


def test_scales_formula() -> None:
    act = torch.tensor([4.0, 1.0, 0.25])
    w1 = torch.tensor([[1.0, 2.0, 1.0]])
    w2 = torch.tensor([[0.5, 1.0, 4.0]])
    s = smooth_scales(act, [w1, w2], alpha=0.5)
    raw = torch.tensor([(4.0**0.5) / (1.0**0.5), 1.0 / (2.0**0.5), (0.25**0.5) / (4.0**0.5)])
    expect = raw / raw.log().mean().exp()
    assert torch.allclose(s, expect)
    # alpha = 1: the weights do not matter; a 1e6 spread is clamped to [0.01, 100] after normalising
    wide = torch.tensor([1e3, 1.0, 1e-3])
    assert torch.allclose(smooth_scales(wide, [w1], alpha=1.0), torch.tensor([100.0, 1.0, 0.01]))
