"""transformers registration: AutoConfig / AutoModelForCausalLM load a SALA checkpoint without remote code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import salaquant.model.hf  # noqa: F401  (registers the Auto classes)
from salaquant.model.loading import load_model


@pytest.fixture()
def ckpt_with_auto_map(tiny_ckpt: Path, tmp_path: Path) -> Path:
    """The published config carries an auto_map pointing at remote code we never import."""
    d = tmp_path / "m"
    shutil.copytree(tiny_ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {
        "AutoConfig": "configuration_minicpm_sala.MiniCPMSALAConfig",
        "AutoModelForCausalLM": "modeling_minicpm_sala.MiniCPMSALAForCausalLM",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_auto_model_loads_and_matches_loader(ckpt_with_auto_map: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt_with_auto_map)
    assert config.model_type == "minicpm_sala"
    hf = AutoModelForCausalLM.from_pretrained(ckpt_with_auto_map, dtype=torch.float32)
    assert type(hf).__name__ == "MiniCPMSALAForCausalLM"
    ours = load_model(ckpt_with_auto_map, dtype="fp32")
    ids = torch.randint(0, 264, (1, 80))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ours(ids).logits)
        # generate() (greedy, with the SALA cache) equals the loader's token-by-token greedy decode
        gen = hf.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(gen, ours.greedy(ids, 12))


def test_auto_tokenizer_and_generate(tiny_ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt)
    assert model.dtype == torch.bfloat16
    enc = tok("The quick brown fox", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, enc.input_ids.shape[1] + 5)
    assert isinstance(tok.decode(out[0]), str)


def test_loss_matches_manual_cross_entropy(tiny_ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    ids = torch.randint(0, 264, (1, 20))
    with torch.no_grad():
        out = model(ids, labels=ids)
    manual = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    assert torch.allclose(out.loss, manual)


def test_padded_batch_refused(tiny_ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt)
    ids = torch.randint(0, 264, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with pytest.raises(ValueError, match="padded"):
        model(ids, attention_mask=mask)


def test_import_salaquant_registers_lazily(tiny_ckpt: Path) -> None:
    """In a fresh interpreter ``import salaquant`` loads neither transformers' model code nor a kernel, and
    ``AutoModelForCausalLM`` then loads a SALA checkpoint with the weights ``load_model`` reads."""
    import subprocess
    import sys

    code = f"""
import sys
import salaquant
heavy = [m for m in ("transformers.modeling_utils", "triton", "salaquant.model.hf") if m in sys.modules]
assert not heavy, heavy
import torch
from transformers import AutoModelForCausalLM
from salaquant.model.loading import load_model
hf = AutoModelForCausalLM.from_pretrained({str(tiny_ckpt)!r}, dtype=torch.float32)
ours = load_model({str(tiny_ckpt)!r}, dtype="fp32")
assert type(hf).__name__ == "MiniCPMSALAForCausalLM", type(hf)
ids = torch.arange(40).view(1, 40)
with torch.no_grad():
    assert torch.equal(hf(ids).logits, ours(ids).logits)
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def test_pretrained_model_contract(tiny_ckpt: Path, tmp_path: Path) -> None:
    """What transformers' quantizers, device_map planning and save_pretrained read: the base model is a
    PreTrainedModel (its parallelism plans, read through ``supports_tp_plan`` / ``supports_pp_plan``, and every
    other attribute readable, as optimum reads them all), ``device_map`` loads, and ``save_pretrained`` writes
    the checkpoint's names back so that a reload computes the same logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, PreTrainedModel

    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32, device_map="cpu")
    assert isinstance(hf.base_model, PreTrainedModel) and hf.base_model is hf.model
    assert hf.supports_tp_plan is False and hf.supports_pp_plan is False
    for module in (hf, hf.model):
        for attr in dir(module):
            getattr(module, attr)  # optimum's _replace_by_quant_layers reads every attribute
    hf.save_pretrained(tmp_path / "saved")
    names: set[str] = set()
    for file in (tmp_path / "saved").glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    with safe_open(str(tiny_ckpt / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    ids = torch.randint(0, 264, (1, 40))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)
