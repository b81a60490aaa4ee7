"""What an export tells a user about serving it, and config keys an engine must not default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from salaquant.cli import app
from salaquant.export import model_card
from salaquant.model.config import ConfigError, SalaConfig

ROOT = Path(__file__).resolve().parents[1]


def test_check_prints_the_serve_command_and_gpus(shipped_rtn_export: Path) -> None:
    result = CliRunner().invoke(app, ["check", str(shipped_rtn_export)])
    assert result.exit_code == 0, result.output
    assert f"--model-path {shipped_rtn_export} --quantization gptq_marlin" in result.output
    assert "compute capability 8.0 or newer" in result.output
    card = (shipped_rtn_export / "README.md").read_text()
    assert "--quantization gptq_marlin" in card and "compute capability 8.0" in card


def test_model_card_keeps_the_front_matter_first() -> None:
    source = "---\nlicense: apache-2.0\n---\n# MiniCPM-SALA\n\nThe card.\n"
    card = model_card("modelopt", source)
    assert card.startswith("---\nlicense: apache-2.0\n---\n# MiniCPM-SALA, modelopt (salaquant)\n")
    assert "--quantization modelopt_fp4" in card and "W4A4" in card
    assert card.rstrip().endswith("The card.")
    assert model_card("gptq", "").count("## The source model") == 0


def test_every_key_an_engine_reads_is_stated() -> None:
    raw = json.loads((ROOT / "models" / "sala-tiny" / "config.json").read_text())
    for key in ("attn_use_rope", "use_output_gate", "use_output_norm", "scale_emb", "lightning_scale"):
        raw.pop(key, None)
    out = SalaConfig.from_dict(raw).to_dict()
    assert out["attn_use_rope"] is False and out["use_output_gate"] is True and out["use_output_norm"] is True
    assert out["scale_emb"] == 1.0 and out["lightning_scale"] == "1/sqrt(d)"
    assert out["lightning_layerwise_decay"] is False and out["attention_bias"] is False
    raw["lightning_scale"] = 0.25
    assert SalaConfig.from_dict(raw).to_dict()["lightning_scale"] == 0.25


def test_layerwise_decay_refused() -> None:
    raw = json.loads((ROOT / "models" / "sala-tiny" / "config.json").read_text())
    raw["lightning_layerwise_decay"] = True
    with pytest.raises(ConfigError, match="lightning_layerwise_decay"):
        SalaConfig.from_dict(raw)
