"""The trained retrieving SALA model shipped in models/sala-small: its files as the card lists them, and the
behaviour the card claims (held-out perplexity, copying, needle retrieval), on the CPU."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from salaquant.eval import niah
from salaquant.eval.perplexity import encode_stream, perplexity
from salaquant.model.config import SalaConfig
from salaquant.model.loading import load_model
from salaquant.workflow import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-small"
sys.path.insert(0, str(ROOT / "tools"))
try:
    import sala_small
finally:
    sys.path.pop(0)

README_HELDOUT_PPL = 30.42  # the card's figure: sala-tiny's held-out text, first 16 x 1024 tokens, dense


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)  # the project's own loader (AutoTokenizer with the model registered)


def test_config_is_the_tools_config() -> None:
    raw = json.loads((MODEL / "config.json").read_text())
    assert SalaConfig.from_dict(raw).to_dict() == SalaConfig.from_dict(sala_small.small_config()).to_dict()
    assert raw["architectures"] == ["MiniCPMSALAForCausalLM"]


def test_shards_sizes_and_the_cards_checksums() -> None:
    shards = sorted(MODEL.glob("*.safetensors"))
    assert len(shards) == 2 and all(p.stat().st_size <= 16 * 2**20 for p in shards)
    assert sum(p.stat().st_size for p in shards) <= sala_small.MAX_MODEL_BYTES
    card = (MODEL / "README.md").read_text()
    listed = {name: digest for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+)$", card, re.M)}
    files = {p.name for p in shards} | {"config.json", "tokenizer.json"}
    assert set(listed) == files
    for name in files:
        assert hashlib.sha256((MODEL / name).read_bytes()).hexdigest() == listed[name], name
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}


def test_heldout_perplexity_matches_the_card(model, tokenizer) -> None:
    heldout = ROOT / "models" / "sala-tiny" / "heldout.jsonl"
    texts = [json.loads(line)["text"] for line in heldout.read_text().splitlines()]
    stream = encode_stream(tokenizer, texts, tokenizer.eos_token_id)
    result = perplexity(lambda ids: model(ids, attention_mode="dense").logits, stream, 1024, max_windows=16)
    assert abs(result.perplexity / README_HELDOUT_PPL - 1) < 0.01, result.perplexity


def test_copies_a_repeated_random_span(model) -> None:
    x = torch.randint(3, 4096, (2, 127), generator=torch.Generator().manual_seed(7))
    ids = torch.cat([torch.ones(2, 1, dtype=torch.long), x, x], dim=1)
    with torch.no_grad():
        pred = model(ids, attention_mode="dense").logits[:, 128:-1].argmax(-1)
    assert (pred == x[:, 1:]).float().mean() > 0.8  # a model without a copy circuit scores about 0


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_retrieves_evals_needle(model, tokenizer, depth: float) -> None:
    case = niah.make_case(tokenizer, 1024, depth, seed=3, bos_id=tokenizer.bos_token_id)
    out = model.greedy(case.ids[None], max_new_tokens=case.max_new_tokens)[0, case.length :]
    assert niah.contains_value(tokenizer.decode(out.tolist()), case.value)
