"""Needle in a haystack: a synthetic key/value sentence buried in filler text, then a question about it.

A case of length L at depth d is exactly L tokens:

    [BOS] filler ... <needle> ... filler <question>

* filler: plain sentences drawn with ``random.Random(seed)`` from a fixed list (deterministic, and nothing in
  it resembles the needle);
* needle: ``" The secret code for <key> is <value>."`` with a seeded key word and a 5-digit value; it starts at
  the sentence boundary of the filler closest to ``d x`` (filler tokens), so ``d = 0`` puts it first and
  ``d = 1`` last;
* question: ``" What is the secret code for <key>? The secret code for <key> is"``.

The model continues greedily for a few tokens; a case is retrieved when the decoded continuation contains the
value as a whole number (``exact_match``). Lengths from ``dense_len`` on run InfLLM-v2 sparse attention in the
``auto`` mode, which is the point of running long cases.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import torch

FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "The river runs down to the sea.",
    "A small bird sings in the tree.",
    "The road is long and quiet.",
    "Snow falls on the hills in winter.",
    "The bread is warm and the tea is hot.",
)
KEYS = (
    "amber",
    "falcon",
    "harbor",
    "lantern",
    "meadow",
    "orchid",
    "quartz",
    "saffron",
    "timber",
    "willow",
    "copper",
    "violet",
)
VALUE_DIGITS = 5
EXTRA_TOKENS = 4  # generated beyond the value's own token count


@dataclass
class NiahCase:
    length: int
    depth: float
    key: str
    value: str
    ids: torch.Tensor  # [length] int64: the whole prompt
    needle_start: int  # token index of the needle's first token
    needle_end: int  # one past its last token
    max_new_tokens: int

    def summary(self) -> dict[str, Any]:
        return {
            "length": self.length,
            "depth": self.depth,
            "key": self.key,
            "value": self.value,
            "needle_start": self.needle_start,
            "needle_end": self.needle_end,
        }


def needle_text(key: str, value: str) -> str:
    return f" The secret code for {key} is {value}."


def question_text(key: str) -> str:
    return f" What is the secret code for {key}? The secret code for {key} is"


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_case(tokenizer: Any, length: int, depth: float, seed: int, bos_id: int | None = None) -> NiahCase:
    """The case of ``length`` tokens with the needle at ``depth`` (0..1); the same arguments give the same case."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"NIAH depth {depth}: expected a fraction between 0 and 1")
    rng = random.Random(f"niah:{seed}:{length}:{depth}")
    key = rng.choice(KEYS)
    value = str(rng.randint(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS - 1))
    prefix = [bos_id] if bos_id is not None else []
    needle, question = _encode(tokenizer, needle_text(key, value)), _encode(tokenizer, question_text(key))
    budget = length - len(prefix) - len(needle) - len(question)
    if budget < 1:
        raise ValueError(
            f"NIAH length {length}: too short for the needle and the question "
            f"({len(prefix) + len(needle) + len(question)} tokens)"
        )
    sentences = [_encode(tokenizer, " " + s) for s in FILLER]
    filler: list[int] = []
    boundaries = [0]
    while len(filler) < budget:
        filler.extend(rng.choice(sentences))
        boundaries.append(len(filler))
    filler = filler[:budget]
    boundaries = [b for b in boundaries if b <= budget]
    at = min(boundaries, key=lambda b: (abs(b - depth * budget), b))
    ids = prefix + filler[:at] + needle + filler[at:] + question
    assert len(ids) == length
    start = len(prefix) + at
    return NiahCase(
        length=length,
        depth=depth,
        key=key,
        value=value,
        ids=torch.tensor(ids, dtype=torch.long),
        needle_start=start,
        needle_end=start + len(needle),
        max_new_tokens=len(_encode(tokenizer, " " + value)) + EXTRA_TOKENS,
    )


def contains_value(text: str, value: str) -> bool:
    """``value`` appears in ``text`` as a whole number (not inside a longer run of digits)."""
    return re.search(rf"(?<!\d){re.escape(value)}(?!\d)", text) is not None


def effective_attention(mode: str, length: int, dense_len: int | None) -> str:
    """What the minicpm4 layers run for a prompt of ``length`` tokens in ``mode``."""
    if mode == "auto":
        return "sparse" if dense_len is not None and length >= dense_len else "dense"
    return mode
