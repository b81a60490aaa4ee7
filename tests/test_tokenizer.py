"""Tests for salaquant.model.tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from salaquant.model.tokenizer import build_byte_tokenizer, byte_to_unicode, train_bpe_tokenizer

MIXED_TEXT = (
    "Hello,  world!\tTabs\nnew line  , spaces ,  it's "
    "naïve café — Ünïcödé · 中文字符 · 日本語 · 한국어 · عربى · emoji 🙂🚀👩‍💻 \x00\x7f end "
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Sparse and lightning attention layers share one residual stream. 量化模型 🙂",
] * 40


def test_byte_alphabet_matches_tokenizers() -> None:
    mapping = byte_to_unicode()
    assert sorted(mapping) == list(range(256))
    assert set(mapping.values()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_byte_tokenizer_layout_and_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "tok"
    assert build_byte_tokenizer(out) == 264
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == 264
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 2)
    assert tok.convert_ids_to_tokens([0, 1, 2, 259, 263]) == [
        "<unk>",
        "<s>",
        "</s>",
        "<reserved_0>",
        "<reserved_4>",
    ]

    ids = tok(MIXED_TEXT)["input_ids"]
    assert ids[0] == 1 and ids.count(1) == 1
    assert len(ids) == len(MIXED_TEXT.encode("utf-8")) + 1  # one token per byte, plus <s>
    assert ids[1:] == [3 + b for b in MIXED_TEXT.encode("utf-8")]
    assert tok.decode(ids, skip_special_tokens=True) == MIXED_TEXT

    raw = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    assert raw["model"]["merges"] == []
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (config["bos_token"], config["eos_token"], config["unk_token"], config["pad_token"]) == (
        "<s>",
        "</s>",
        "<unk>",
        "</s>",
    )


def test_byte_tokenizer_extra_special(tmp_path: Path) -> None:
    out = tmp_path / "tok"
    assert build_byte_tokenizer(out, extra_special=["<|im_end|>"]) == 264
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_tokens_to_ids("<|im_end|>") == 3
    assert tok("a<|im_end|>")["input_ids"] == [1, 4 + ord("a"), 3]
    with pytest.raises(ValueError):
        build_byte_tokenizer(tmp_path / "bad", extra_special=["<s>"])


def test_bpe_tokenizer_compresses_and_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "bpe"
    size = train_bpe_tokenizer(CORPUS, out, vocab_size=400)
    assert size % 64 == 0
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == size
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 2)

    sample = CORPUS[0]
    ids = tok(sample)["input_ids"]
    assert ids[0] == 1
    assert len(ids) < len(sample.encode("utf-8")) / 2
    assert tok.decode(ids, skip_special_tokens=True) == sample

    mixed = tok(MIXED_TEXT)["input_ids"]
    assert 0 not in mixed  # the full byte alphabet covers unseen text
    assert tok.decode(mixed, skip_special_tokens=True) == MIXED_TEXT


def test_bpe_tokenizer_is_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert train_bpe_tokenizer(CORPUS, a, vocab_size=400) == train_bpe_tokenizer(iter(CORPUS), b, vocab_size=400)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_bpe_vocab_size_too_small(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(CORPUS, tmp_path / "x", vocab_size=100)
