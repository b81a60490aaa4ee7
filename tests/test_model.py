"""The SALA model against an independent plain implementation, caches, attention modes, loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sala_reference import reference_logits

from salaquant.io.files import CheckpointError
from salaquant.io.reader import CheckpointReader
from salaquant.io.writer import save_state_dict
from salaquant.model.config import ConfigError, SalaConfig
from salaquant.model.layers import apply_rope, rope_cos_sin
from salaquant.model.loading import CheckpointParts, load_model
from salaquant.model.modeling import layer_rope


def _state(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v.float() for k, v in load_file(f).items()})
    return out


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_ckpt_rope"])
def test_forward_matches_independent_reference(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    cfg = json.loads((path / "config.json").read_text())
    model = load_model(path, dtype="fp32")
    ids = torch.randint(0, cfg["vocab_size"], (1, 70))  # > one GLA chunk of 64
    ours = model(ids, attention_mode="dense").logits[0]
    ref = reference_logits(_state(path), cfg, ids[0])
    assert torch.allclose(ours, ref, atol=2e-4, rtol=1e-4), (ours - ref).abs().max()


def test_bf16_forward_close_to_fp32(tiny_ckpt: Path) -> None:
    ids = torch.randint(0, 264, (1, 40))
    lo = load_model(tiny_ckpt)(ids).logits
    hi = load_model(tiny_ckpt, dtype="fp32")(ids).logits
    assert lo.dtype == torch.float32
    assert (lo - hi).abs().max() < 0.05 * hi.abs().max()


def test_rope_matches_complex_rotation() -> None:
    x = torch.randn(1, 5, 2, 8)
    cos, sin = rope_cos_sin(torch.arange(5), 8, 10000.0)
    ours = apply_rope(x, cos, sin)
    z = torch.complex(x[..., :4].double(), x[..., 4:].double())
    angle = torch.arange(5, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(4).double() / 4)
    z = z * torch.exp(1j * angle)[None, :, None, :]
    expect = torch.cat([z.real, z.imag], -1).float()
    assert torch.allclose(ours, expect, atol=1e-5)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_decode_with_cache_equals_full_forward(tiny_ckpt: Path, mode: str) -> None:
    model = load_model(tiny_ckpt, dtype="fp32")
    ids = torch.randint(0, 264, (2, 300))
    full = model(ids, attention_mode=mode).logits
    cache = model.new_cache()
    parts = [model(ids[:, :200], cache=cache, attention_mode=mode).logits]  # prefill
    parts.append(model(ids[:, 200:237], cache=cache, attention_mode=mode).logits)  # chunked prefill
    for t in range(237, 300):  # token by token
        parts.append(model(ids[:, t : t + 1], cache=cache, attention_mode=mode).logits)
    stepped = torch.cat(parts, dim=1)
    assert cache.seen_tokens == 300
    assert torch.allclose(stepped, full, atol=1e-4, rtol=1e-4), (stepped - full).abs().max()


def test_greedy_decode_equals_full_forward_argmax(tiny_ckpt: Path) -> None:
    """Crossing dense_len (256) during decode in auto mode switches the minicpm4 layers to sparse."""
    model = load_model(tiny_ckpt, dtype="fp32")
    prompt = torch.randint(0, 264, (1, 240))
    out = model.greedy(prompt, max_new_tokens=40)
    full = model(out[:, :-1]).logits  # auto mode: 279 tokens >= dense_len, sparse everywhere
    # the token chosen at every step equals the argmax of the full forward at the same position
    steps_full = full[:, 239:].argmax(-1)
    assert torch.equal(out[:, 240:], steps_full[:, : out.shape[1] - 240])


def test_attention_modes(tiny_ckpt: Path) -> None:
    """Forced dense past dense_len is dense; sparse drops blocks; short inputs: sparse == dense."""
    model = load_model(tiny_ckpt, dtype="fp32")
    long = torch.randint(0, 264, (1, 600))
    dense = model(long, attention_mode="dense").logits
    auto = model(long, attention_mode="auto").logits
    sparse = model(long, attention_mode="sparse").logits
    assert torch.equal(auto, sparse)  # 600 >= dense_len 256
    assert not torch.allclose(dense, sparse, atol=1e-3)
    # below the selection budget (6 blocks of 32 tokens) every block is selected
    short = long[:, :190]
    assert torch.allclose(
        model(short, attention_mode="sparse").logits, model(short, attention_mode="dense").logits, atol=1e-5
    )
    # before the switch point forced-dense and auto agree exactly
    mid = long[:, :255]
    assert torch.equal(model(mid, attention_mode="auto").logits, model(mid, attention_mode="dense").logits)


def test_checkpoint_round_trip(tiny_ckpt: Path, tmp_path: Path) -> None:
    model = load_model(tiny_ckpt)
    state = {k: v for k, v in model.state_dict().items()}
    cfg = SalaConfig.from_file(tiny_ckpt)
    out = save_state_dict(state, tmp_path / "rt", cfg.to_dict(), aux_from=tiny_ckpt, max_shard_bytes=200_000)
    assert (out / "model.safetensors.index.json").exists()
    assert (out / "tokenizer.json").exists()
    again = load_model(out)
    ids = torch.randint(0, 264, (1, 50))
    assert torch.equal(model(ids).logits, again(ids).logits)
    assert (
        json.loads((out / "config.json").read_text())["mixer_types"]
        == json.loads((tiny_ckpt / "config.json").read_text())["mixer_types"]
    )


def test_layer_by_layer_equals_whole_model(tiny_ckpt: Path) -> None:
    reader = CheckpointReader(tiny_ckpt)
    cfg = SalaConfig.from_dict(reader.config())
    model = load_model(tiny_ckpt, dtype="fp32")
    ids = torch.randint(0, 264, (1, 30))
    h = model.model.embed(ids)
    rope = {k: layer_rope(cfg, k, 0, 30, h.device) for k in set(cfg.mixer_types)}
    for i in range(cfg.num_hidden_layers):
        layer = CheckpointParts(reader, cfg, dtype="fp32").layer(i)
        h = layer(h, rope[layer.kind], None, "dense")
    logits = model.lm_head(model.model.norm(h) / cfg.logit_divisor).float()
    assert torch.allclose(logits, model(ids, attention_mode="dense").logits, atol=1e-6)


# ----------------------------------------------------------------------------- bad input


def _raw(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda c: c.pop("mixer_types"), "mixer_types"),
        (lambda c: c.update(model_type="llama"), "model_type"),
        (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda c: c.update(mixer_types=["minicpm4", "mamba", "lightning", "minicpm4"]), "mixer_types[1]"),
        (lambda c: c.update(mixer_types=["minicpm4"]), "mixer_types"),
        (lambda c: (c.pop("head_dim"), c.update(num_attention_heads=12)), "num_attention_heads"),
        (lambda c: c.update(lightning_nkv=3), "lightning_nkv"),
        (lambda c: c.pop("hidden_size"), "hidden_size"),
        (lambda c: c.update(rope_scaling={"type": "yarn"}), "rope_scaling"),
    ],
)
def test_bad_config_names_the_key(tiny_ckpt: Path, edit, needle: str) -> None:
    raw = _raw(tiny_ckpt)
    edit(raw)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        SalaConfig.from_dict(raw)


def test_lightning_spellings_accepted(tiny_ckpt: Path) -> None:
    raw = _raw(tiny_ckpt)
    raw["mixer_types"] = ["minicpm4", "lightning", "lightning_attn", "minicpm4"]
    assert SalaConfig.from_dict(raw).mixer_types == ["minicpm4", "lightning", "lightning", "minicpm4"]


def test_missing_and_misshaped_tensors(tiny_ckpt: Path, tmp_path: Path) -> None:
    state = load_file(tiny_ckpt / "model.safetensors")
    cfg = _raw(tiny_ckpt)
    broken = dict(state)
    del broken["model.layers.2.self_attn.z_proj.weight"]
    save_state_dict(broken, tmp_path / "missing", cfg)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.z_proj\.weight"):
        load_model(tmp_path / "missing")
    bad = dict(state)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 128, dtype=torch.bfloat16)
    save_state_dict(bad, tmp_path / "shape", cfg)
    with pytest.raises(CheckpointError, match=r"k_proj.*\[16, 128\].*expected \[8, 128\]"):
        load_model(tmp_path / "shape")


def test_pickle_checkpoint_refused(tiny_ckpt: Path, tmp_path: Path) -> None:
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(tiny_ckpt / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(d)
