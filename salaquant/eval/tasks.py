"""Synthetic long-context tasks after RULER's definitions, generated from a seed (nothing is downloaded).

Every case is a prompt of at most ``length`` tokens (filled close to it) and a list of
reference answers; the model continues greedily for ``max_new_tokens`` and the case scores the fraction of the
references its continuation holds (``score``: RULER's "string match all", each reference matched as a whole word,
case-insensitively). Tasks:

* ``niah_multikey``: four needles ``The secret code for <key> is <value>.`` with different keys in filler text;
  the question asks for one key's code (one reference; the other three are distractors).
* ``niah_multivalue``: four needles for one key, each with its own value; the question asks for all of them
  (four references: partial credit per value).
* ``vt`` (variable tracking): ``VAR A = 12345`` and a chain ``VAR B = A``, ``VAR C = B``, ... (four hops)
  spread through filler; the question asks for every variable holding the value (five references).
* ``cwe`` (common words extraction): a numbered list of words in which ten words appear 30 times each (fewer in
  prompts too short for that, at least 5) and the others 3 times; the question asks for the ten most common (ten
  references).
* ``fwe`` (frequent words extraction): coded words drawn with Zipf weights (exponent 2) into a text; the question
  asks for the three most frequent, whose counts are made distinct (three references).

Words are pronounceable nonsense made from a seeded generator, so the model cannot know them beforehand; the same
``(task, length, index, seed)`` always gives the same case.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .niah import FILLER, KEYS, VALUE_DIGITS

TASKS = ("niah_multikey", "niah_multivalue", "vt", "cwe", "fwe")
NEEDLES = 4
VT_HOPS = 4
CWE_COMMON, CWE_COMMON_FREQ, CWE_RARE_FREQ = 10, 30, 3
FWE_TOP, FWE_ALPHA = 3, 2.0
ANSWER_EXTRA_TOKENS = 8
"""Tokens generated beyond the references' own (separators, the start of an answer)."""


@dataclass
class TaskCase:
    task: str
    length: int
    index: int
    ids: torch.Tensor  # [<= length] int64: the whole prompt
    answers: list[str]
    max_new_tokens: int

    def summary(self) -> dict[str, Any]:
        return {"task": self.task, "length": self.length, "index": self.index, "tokens": int(self.ids.numel()),
                "answers": self.answers}  # fmt: skip


def score(text: str, answers: Sequence[str]) -> float:
    """The fraction of ``answers`` that ``text`` holds as whole words (case-insensitive): 1 for a perfect answer,
    0 for none, partial credit per reference."""
    if not answers:
        raise ValueError("a case needs at least one reference answer")
    low = text.lower()
    found = sum(re.search(rf"(?<!\w){re.escape(a.lower())}(?!\w)", low) is not None for a in answers)
    return found / len(answers)


def nonsense_words(rng: random.Random, n: int, syllables: int = 3) -> list[str]:
    """``n`` distinct lowercase words of consonant-vowel syllables."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        w = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


class _Builder:
    """Token ids of a prompt: a head, items until the budget is spent, a tail; all of it at most ``length``."""

    def __init__(self, tokenizer: Any, length: int, head: str, tail: str, bos_id: int | None) -> None:
        self.tok = tokenizer
        self.prefix = ([bos_id] if bos_id is not None else []) + self.encode(head)
        self.suffix = self.encode(tail)
        self.budget = length - len(self.prefix) - len(self.suffix)
        self.length = length

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def fill(self, items: Callable[[int], str]) -> list[list[int]]:
        """Encoded items ``items(0), items(1), ...`` while they fit the budget."""
        out: list[list[int]] = []
        used = 0
        while True:
            ids = self.encode(items(len(out)))
            if used + len(ids) > self.budget:
                return out
            out.append(ids)
            used += len(ids)

    def ids(self, body: Sequence[Sequence[int]]) -> torch.Tensor:
        flat = [t for part in body for t in part]
        return torch.tensor(self.prefix + flat + self.suffix, dtype=torch.long)


def _filler(rng: random.Random, builder: _Builder, reserve: Sequence[str]) -> list[list[int]]:
    """Filler sentences for the budget left after the ``reserve`` texts."""
    taken = sum(len(builder.encode(t)) for t in reserve)
    builder.budget -= taken
    sentences = builder.fill(lambda _i: " " + rng.choice(FILLER))
    builder.budget += taken
    return sentences


def _insert(rng: random.Random, builder: _Builder, filler: list[list[int]], texts: Sequence[str]) -> list[list[int]]:
    """``texts`` placed between filler sentences at seeded, distinct positions, in the given order."""
    slots = sorted(rng.sample(range(len(filler) + 1), len(texts))) if len(filler) + 1 >= len(texts) else []
    if not slots:
        raise ValueError(f"length {builder.length}: too short for this task")
    body: list[list[int]] = []
    for i, sentence in enumerate(filler):
        for slot, text in zip(slots, texts, strict=True):
            if slot == i:
                body.append(builder.encode(text))
        body.append(sentence)
    for slot, text in zip(slots, texts, strict=True):
        if slot == len(filler):
            body.append(builder.encode(text))
    return body


def _value(rng: random.Random) -> str:
    return str(rng.randint(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS - 1))


def _niah_multikey(rng: random.Random, tok: Any, length: int, bos: int | None) -> tuple[torch.Tensor, list[str], int]:
    keys = rng.sample(KEYS, NEEDLES)
    values = [_value(rng) for _ in keys]
    asked = rng.randrange(NEEDLES)
    tail = f" What is the secret code for {keys[asked]}? The secret code for {keys[asked]} is"
    b = _Builder(tok, length, " Remember the secret codes in the text below.", tail, bos)
    needles = [f" The secret code for {k} is {v}." for k, v in zip(keys, values, strict=True)]
    body = _insert(rng, b, _filler(rng, b, needles), needles)
    return b.ids(body), [values[asked]], len(b.encode(" " + values[asked]))


def _niah_multivalue(rng: random.Random, tok: Any, length: int, bos: int | None) -> tuple[torch.Tensor, list[str], int]:
    key = rng.choice(KEYS)
    values = []
    while len(values) < NEEDLES:
        v = _value(rng)
        if v not in values:
            values.append(v)
    tail = f" What are all the secret codes for {key}? The secret codes for {key} are"
    b = _Builder(tok, length, " Remember the secret codes in the text below.", tail, bos)
    needles = [f" One of the secret codes for {key} is {v}." for v in values]
    body = _insert(rng, b, _filler(rng, b, needles), needles)
    return b.ids(body), values, len(b.encode(" " + ", ".join(values)))


def _vt(rng: random.Random, tok: Any, length: int, bos: int | None) -> tuple[torch.Tensor, list[str], int]:
    names = [w.upper() for w in nonsense_words(rng, VT_HOPS + 1, syllables=2)]
    value = _value(rng)
    chain = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i + 1]} = {names[i]}." for i in range(VT_HOPS)]
    tail = (
        f" Question: Find all variables that are assigned the value {value} in the text above. Answer: According "
        f"to the chain of variable assignments in the text above, {VT_HOPS + 1} variables are assigned the value "
        f"{value}, they are:"
    )
    b = _Builder(tok, length, " Memorize and track the chain of variable assignments hidden in the text.", tail, bos)
    body = _insert(rng, b, _filler(rng, b, chain), chain)  # in chain order, so each name is defined before use
    return b.ids(body), names, len(b.encode(" " + ", ".join(names)))


def _cwe(rng: random.Random, tok: Any, length: int, bos: int | None) -> tuple[torch.Tensor, list[str], int]:
    tail = (
        f" Question: What are the {CWE_COMMON} most common words in the above list? Answer: The top {CWE_COMMON} "
        "words that appear most often in the list are:"
    )
    b = _Builder(
        tok, length, " Below is a numbered list of words. Memorize the ones that appear most often.", tail, bos
    )
    words = nonsense_words(rng, CWE_COMMON + length // 4)
    common, rare = words[:CWE_COMMON], words[CWE_COMMON:]
    word_ids = {w: b.encode(" " + w) for w in words}

    def numbered(pool: Sequence[str]) -> list[list[int]]:
        return [b.encode(f" {i + 1}.") + word_ids[w] for i, w in enumerate(pool)]

    def pool_of(n_rare: int, freq: int) -> list[str]:
        return common * freq + rare[:n_rare] * CWE_RARE_FREQ

    def tokens(pool: Sequence[str]) -> int:  # numbers up to the pool's size take at most this many tokens each
        return sum(len(word_ids[w]) for w in pool) + len(pool) * len(b.encode(f" {len(pool)}."))

    # the common words take at most half of the budget: 30 times each where that fits, fewer in short prompts
    freq = next((f for f in range(CWE_COMMON_FREQ, CWE_RARE_FREQ + 1, -1) if tokens(common * f) <= b.budget // 2), 0)
    if not freq:
        raise ValueError(f"length {length}: too short for cwe ({CWE_COMMON} words, {CWE_RARE_FREQ + 2} times each)")

    def fits(n_rare: int) -> bool:
        return tokens(pool_of(n_rare, freq)) <= b.budget

    lo, hi = 0, len(rare)  # the most rare words that fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    pool = pool_of(lo, freq)
    rng.shuffle(pool)
    return b.ids(numbered(pool)), common, len(b.encode(" " + ", ".join(common)))


def _fwe(rng: random.Random, tok: Any, length: int, bos: int | None) -> tuple[torch.Tensor, list[str], int]:
    tail = (
        f" Question: What are the {FWE_TOP} most frequently appeared coded words in the above coded text? Answer: "
        f"According to the coded text above, the {FWE_TOP} most frequently appeared words are:"
    )
    b = _Builder(tok, length, " Read the following coded text and track the frequency of each coded word.", tail, bos)
    vocab = nonsense_words(rng, 200, syllables=2)
    weights = [1.0 / (r + 1) ** FWE_ALPHA for r in range(len(vocab))]
    chosen: list[str] = []

    def draw(_i: int) -> str:
        chosen.append(rng.choices(vocab, weights)[0])
        return " " + chosen[-1]

    drawn = b.fill(draw)
    text_words = chosen[: len(drawn)]  # the last word drawn did not fit
    counts = Counter(text_words)
    top = [w for w, _ in counts.most_common(FWE_TOP + 1)]
    if len(top) < FWE_TOP + 1:
        raise ValueError(f"length {length}: too short for fwe")
    # make the top counts strictly ordered and above the rest, replacing words of the tail in place
    rest = [i for i, w in enumerate(text_words) if w not in top[:FWE_TOP]]
    need = [0] * FWE_TOP
    floor = counts[top[FWE_TOP]]
    for r in range(FWE_TOP - 1, -1, -1):
        want = floor + (FWE_TOP - r)
        need[r] = max(0, want - counts[top[r]])
        floor = max(want, counts[top[r]])
    for r, n in enumerate(need):
        for _ in range(n):
            if not rest:
                raise ValueError(f"length {length}: too short for fwe")
            i = rest.pop(rng.randrange(len(rest)))
            text_words[i] = top[r]
            drawn[i] = b.encode(" " + top[r])
    final = Counter(text_words).most_common(FWE_TOP + 1)
    assert [w for w, _ in final[:FWE_TOP]] == top[:FWE_TOP] and final[FWE_TOP - 1][1] > final[FWE_TOP][1]
    return b.ids(drawn), top[:FWE_TOP], len(b.encode(" " + ", ".join(top[:FWE_TOP])))


_MAKERS = {"niah_multikey": _niah_multikey, "niah_multivalue": _niah_multivalue, "vt": _vt, "cwe": _cwe, "fwe": _fwe}


def parse_tasks(text: str) -> list[str]:
    """``"niah,cwe"`` -> the task names (``niah``: both NIAH variants; ``none`` or empty: no task), in order, once
    each; unknown names are kept for the options' check to name."""
    out: list[str] = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part == "none":
            continue
        for name in ("niah_multikey", "niah_multivalue") if part == "niah" else (part,):
            if name not in out:
                out.append(name)
    return out


def make_task_case(
    tokenizer: Any, task: str, length: int, index: int, seed: int, bos_id: int | None = None
) -> TaskCase:
    """Case ``index`` of ``task`` at ``length`` tokens; the same arguments give the same case."""
    if task not in _MAKERS:
        raise ValueError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")
    rng = random.Random(f"{task}:{seed}:{length}:{index}")
    ids, answers, answer_tokens = _MAKERS[task](rng, tokenizer, length, bos_id)
    assert ids.numel() <= length
    return TaskCase(task, length, index, ids, answers, answer_tokens + ANSWER_EXTRA_TOKENS)
