"""Offline builders for small byte-level tokenizers in the Hugging Face layout.

Both builders write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
so that ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads the result. Token ids:
``<unk>`` = 0, ``<s>`` (bos) = 1, ``</s>`` (eos) = 2, and pad is the eos token (id 2). Any
``extra_special`` tokens follow at ids 3, 4, ...; unused ``<reserved_i>`` special tokens pad the
vocabulary at the end. Encoding prepends ``<s>`` through a ``TemplateProcessing``
post-processor; no eos is appended. Decoding with ``skip_special_tokens=True`` gives back the
input text exactly (for text that does not itself spell a special token).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "BOS_ID",
    "BOS_TOKEN",
    "BPE_VOCAB_MULTIPLE",
    "BYTE_VOCAB_MULTIPLE",
    "EOS_ID",
    "EOS_TOKEN",
    "PAD_ID",
    "UNK_ID",
    "UNK_TOKEN",
    "build_byte_tokenizer",
    "byte_to_unicode",
    "train_bpe_tokenizer",
]

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
PAD_ID = EOS_ID
BYTE_VOCAB_MULTIPLE = 8
BPE_VOCAB_MULTIPLE = 64

_BASE_SPECIALS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)
_RESERVED_FMT = "<reserved_{}>"


def byte_to_unicode() -> dict[int, str]:
    """Map each byte value to its printable ByteLevel symbol (the GPT-2 byte alphabet).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in byte order, to code
    points 256, 257, ....
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
    ]
    keep = set(printable)
    mapping: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _check_extra_special(extra_special: Sequence[str]) -> list[str]:
    extra = list(extra_special)
    seen = set(_BASE_SPECIALS)
    for token in extra:
        if not isinstance(token, str) or not token:
            raise ValueError(f"extra special token must be a non-empty string, got {token!r}")
        if token in seen:
            raise ValueError(f"special token {token!r} is given twice or clashes with a built-in special token")
        if token.startswith("<reserved_"):
            raise ValueError(f"special token {token!r}: names starting with '<reserved_' are used for padding")
        seen.add(token)
    return extra


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _finish(tokenizer: Tokenizer, specials: list[str], multiple: int) -> int:
    """Register specials, pad with reserved tokens, and attach pre/post-processing."""
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    for expected_id, token in enumerate(specials):
        actual = tokenizer.token_to_id(token)
        if actual != expected_id:
            raise RuntimeError(f"special token {token!r} got id {actual}, expected {expected_id}")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    target = _round_up(size, multiple)
    reserved = [_RESERVED_FMT.format(i) for i in range(target - size)]
    if reserved:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    final = tokenizer.get_vocab_size(with_added_tokens=True)
    if final != target:
        raise RuntimeError(f"tokenizer vocabulary has {final} entries, expected {target}")
    return final


def _save(tokenizer: Tokenizer, out_dir: Path, extra_special: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special_map: dict[str, Any] = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": EOS_TOKEN,
    }
    if extra_special:
        special_map["additional_special_tokens"] = list(extra_special)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "padding_side": "right",
    }
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out_dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_byte_tokenizer(out_dir: str | Path, *, extra_special: Sequence[str] = ()) -> int:
    """Write a merge-free byte-level tokenizer to ``out_dir`` and return its vocabulary size.

    Vocabulary: ``<unk>``, ``<s>``, ``</s>``, then ``extra_special``, then the 256 ByteLevel
    symbols in byte order, padded with ``<reserved_i>`` specials to a multiple of 8 (264 with no
    extra specials). Every text encodes to one token per UTF-8 byte (plus the leading ``<s>``).
    """
    extra = _check_extra_special(extra_special)
    specials = [*_BASE_SPECIALS, *extra]
    vocab = {token: i for i, token in enumerate(specials)}
    base = len(specials)
    for b, symbol in byte_to_unicode().items():
        vocab[symbol] = base + b
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    size = _finish(tokenizer, specials, BYTE_VOCAB_MULTIPLE)
    _save(tokenizer, Path(out_dir), extra)
    return size


def train_bpe_tokenizer(
    texts: Iterable[str],
    out_dir: str | Path,
    vocab_size: int,
    *,
    min_frequency: int = 2,
    extra_special: Sequence[str] = (),
) -> int:
    """Train a byte-level BPE tokenizer on ``texts``, write it to ``out_dir``, return its vocab size.

    ``vocab_size`` bounds the trained vocabulary (specials, the full 256-symbol byte alphabet and
    merges); the result is padded with ``<reserved_i>`` specials to a multiple of 64. Because the
    initial alphabet holds every byte, any text encodes without ``<unk>``. The same input gives the
    same ``tokenizer.json``.
    """
    extra = _check_extra_special(extra_special)
    specials = [*_BASE_SPECIALS, *extra]
    minimum = len(specials) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} is below {minimum} (special tokens plus 256 byte symbols)")
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=sorted(byte_to_unicode().values()),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    size = _finish(tokenizer, specials, BPE_VOCAB_MULTIPLE)
    _save(tokenizer, Path(out_dir), extra)
    return size
