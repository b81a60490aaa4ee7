"""sala-small's configuration and checkpoint writer (``tools/sala_small.py``): the real design at Marlin-friendly
sizes, and a written checkpoint that ``salaquant.model`` reads back to the same logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from salaquant.model import attention
from salaquant.model.config import LIGHTNING, SPARSE, SalaConfig
from salaquant.model.gla import simple_gla
from salaquant.model.layout import parameter_shapes
from salaquant.model.loading import load_model
from salaquant.model.modeling import init_weights

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
try:
    import sala_small
finally:
    sys.path.pop(0)


def test_config_is_the_real_design_at_marlin_sizes() -> None:
    cfg = SalaConfig.from_dict(sala_small.small_config())
    assert cfg.mixer_types[0] == cfg.mixer_types[-1] == SPARSE
    assert cfg.mixer_types.count(LIGHTNING) == 3 * cfg.mixer_types.count(SPARSE)
    assert cfg.head_dim == cfg.lightning_head_dim == 128
    assert cfg.num_attention_heads > cfg.num_key_value_heads
    assert not cfg.attn_use_rope and cfg.attn_use_output_gate and cfg.lightning_use_rope and cfg.qk_norm
    assert (cfg.scale_emb, cfg.scale_depth, cfg.dim_model_base) == (12.0, 1.4, 256)
    assert cfg.dense_len is not None and 4096 < cfg.dense_len < 16384
    shapes = parameter_shapes(cfg)
    for name, shape in shapes.items():
        if "layers" in name:
            assert all(d % 128 == 0 for d in shape), (name, shape)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert params * 2 <= sala_small.MAX_MODEL_BYTES


def test_written_checkpoint_loads_to_the_same_logits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = sala_small.build_model()
    init_weights(model, std=0.02, generator=torch.Generator().manual_seed(0))
    out = sala_small.write_checkpoint(model, tmp_path / "ck", ROOT / "models/sala-tiny")
    shards = sorted(out.glob("*.safetensors"))
    assert shards and all(p.stat().st_size <= sala_small.MAX_SHARD_BYTES for p in shards)
    assert sum(p.stat().st_size for p in shards) <= sala_small.MAX_MODEL_BYTES
    assert (out / "tokenizer.json").read_bytes() == (ROOT / "models/sala-tiny/tokenizer.json").read_bytes()
    ids = torch.randint(3, 4096, (1, 80), generator=torch.Generator().manual_seed(1))
    loaded = load_model(out)
    with torch.no_grad():
        want = model.to(torch.bfloat16)(ids, attention_mode="dense").logits
        got = loaded(ids, attention_mode="dense").logits
    assert torch.equal(want, got)


def test_fast_path_binds_and_unbinds() -> None:
    model = sala_small.build_model()
    reference = attention.dense_causal_attention
    sala_small.use_fast_path(model)
    try:
        assert attention.dense_causal_attention is sala_small.flash_causal_attention
        assert all(m.gla_fn is sala_small.fla_simple_gla for m in model.modules() if hasattr(m, "gla_fn"))
        q, k, v = torch.randn(1, 70, 8, 16), torch.randn(1, 70, 2, 16), torch.randn(1, 70, 2, 16)
        assert torch.allclose(sala_small.flash_causal_attention(q, k, v, 0.25), reference(q, k, v, 0.25), atol=1e-5)
    finally:
        sala_small.use_reference_path(model)
    assert attention.dense_causal_attention is reference
    assert all(m.gla_fn is simple_gla for m in model.modules() if hasattr(m, "gla_fn"))


def test_checkpoint_replaces_its_own_folder_only(tmp_path: Path) -> None:
    model = sala_small.build_model()
    out = tmp_path / "ck"
    sala_small.write_checkpoint(model, out, ROOT / "models/sala-tiny")
    (out / sala_small.SUMMARY).write_text("{}")  # as the training tool leaves it
    sala_small.write_checkpoint(model, out, ROOT / "models/sala-tiny")  # a later call writes the same folder
    assert (out / "config.json").is_file() and not (out / sala_small.SUMMARY).exists()
    (out / sala_small.SUMMARY).write_text("{}")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"notes\.txt"):
        sala_small.write_checkpoint(model, out, ROOT / "models/sala-tiny")
    assert (out / "notes.txt").read_text() == "mine" and (out / "config.json").is_file()
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"train_summary\.json"):
        sala_small.write_checkpoint(model, user, ROOT / "models/sala-tiny")
    assert (user / "config.json").read_text() == "{}"
