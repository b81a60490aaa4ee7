"""The trained tiny SALA model shipped in models/sala-tiny."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from salaquant.eval.perplexity import encode_stream, perplexity
from salaquant.model.loading import load_model

MODEL = Path(__file__).resolve().parents[1] / "models" / "sala-tiny"
# The README's figure: held-out perplexity of the bf16 checkpoint on its first 16 x 1024 held-out tokens,
# dense attention (benchmarks/studies/eval_tiny.py).
README_HELDOUT_PPL = 31.371


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    import salaquant.model.hf  # noqa: F401

    return AutoTokenizer.from_pretrained(MODEL)


def test_files_and_size() -> None:
    names = {p.name for p in MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in MODEL.iterdir()) < 25 * 10**6
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] == "minicpm_sala"
    assert cfg["mixer_types"][0] == cfg["mixer_types"][-1] == "minicpm4"
    assert cfg["mixer_types"].count("minicpm4") * 3 == cfg["mixer_types"].count("lightning-attn")
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] == 16
    assert cfg["hidden_size"] % 128 == 0 and cfg["intermediate_size"] % 128 == 0


def test_heldout_perplexity_matches_readme(model, tokenizer) -> None:
    texts = [json.loads(line)["text"] for line in (MODEL / "heldout.jsonl").read_text().splitlines()]
    stream = encode_stream(tokenizer, texts, tokenizer.eos_token_id)
    result = perplexity(lambda ids: model(ids, attention_mode="dense").logits, stream, 1024, max_windows=16)
    assert result.tokens == 16 * 1023
    assert abs(result.perplexity / README_HELDOUT_PPL - 1) < 0.01, result.perplexity


def test_greedy_generation_deterministic_and_varied(model, tokenizer) -> None:
    ids = tokenizer("It is a truth universally acknowledged, that", return_tensors="pt").input_ids
    a = model.greedy(ids, max_new_tokens=40)[0, ids.shape[1] :]
    b = model.greedy(ids, max_new_tokens=40)[0, ids.shape[1] :]
    assert torch.equal(a, b)
    assert len(set(a.tolist())) >= 10  # not one token repeated, nor a two-token loop
    assert tokenizer.unk_token_id not in a.tolist()


def test_loads_with_auto_model(model) -> None:
    from transformers import AutoModelForCausalLM

    import salaquant.model.hf  # noqa: F401

    hf = AutoModelForCausalLM.from_pretrained(MODEL)
    ids = torch.randint(3, 4096, (1, 64))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, model(ids).logits)
