"""Long-context training tasks over corpus text: keyed-value retrieval, several keys, several values, variable
chains and word-frequency questions, 1K to 16K tokens, generated from a seed.

Each instance is ``[BOS] header haystack-with-insertions questions`` where every answer is supervised: a
``TaskSample`` holds the token ids and a mask of the tokens whose prediction is trained (the answers and the full
stop that closes them), so the haystack itself adds no training passes over the corpus. Haystacks are slices of the
token array handed in (the train split less its validation tail: the held-out split is never read here) or, for a
share of instances, short sentences built from this module's own word lists, so that low-entropy repetitive
filler is seen too. Sentences, keys, value kinds, question phrasings, variable syntaxes and word shapes are this
module's own and differ from ``salaquant eval``'s templates (``salaquant.eval.niah`` / ``salaquant.eval.tasks``),
so that eval measures transfer to unseen phrasings, not a memorised template. The same ``(seed, index)`` gives the
same instance.

Kinds (``KINDS``):

* ``kv``: 1 to 16 keyed statements (``"The locker combination for heron is 4812."`` and other shapes); 1 to 4
  questions at the end, each restating its statement's lead-in so the answer continues it; with several keys some
  questions also sit inside the haystack, after their statement;
* ``multivalue``: one key stated 2 to 5 times with different values among other keys; the question asks for all;
* ``chain``: ``Let TORMEL be 5521.`` then 1 to 6 hops (``NIMOSS takes the value of TORMEL.``) in order, with up to
  two distractor chains; the question asks for every name holding the value, answered in chain order;
* ``common``: a separated list of words in which 3 to 10 words repeat most; the question asks for them;
* ``frequent``: coded words drawn with Zipf weights; the question asks for the 1 to 3 most frequent, whose counts
  are made distinct;
* ``repeat``: a span of corpus tokens (in text order, or shuffled so that only copying predicts it) stated twice
  with corpus text between; every token of the second copy after its first is trained. No template at all: the
  plainest retrieval, with a dense training signal, from which a copy (induction) circuit forms far sooner than
  from the few answer tokens of the other kinds.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KINDS = ("kv", "multivalue", "chain", "common", "frequent", "repeat")
DEFAULT_WEIGHTS = {"kv": 0.3, "multivalue": 0.1, "chain": 0.2, "common": 0.1, "frequent": 0.1, "repeat": 0.2}
"""Share of each kind among the instances (keyed retrieval and chains first: eval's main long-context rows)."""
MAX_ATTEMPTS = 20
"""Draws of an instance before a length is reported too short for its kind."""
SHUFFLED_SHARE = 0.5
"""Share of ``repeat`` spans whose tokens are shuffled (copying is then the only way to predict them)."""
SYNTHETIC_SHARE = 0.3
"""Share of retrieval/chain haystacks made of this module's short sentences instead of corpus text."""

KEY_WORDS = (
    "heron", "badger", "cobalt", "juniper", "pewter", "thistle", "walnut", "garnet", "sparrow", "cedar", "indigo",
    "marble", "otter", "pebble", "raven", "sorrel", "tundra", "velvet", "wren", "yarrow", "zephyr", "acorn", "basalt",
    "canyon", "dune", "ember", "fjord", "glacier", "hazel", "iris", "jasper", "kestrel", "linen", "maple", "nectar",
    "onyx", "plover", "quill", "rosemary", "slate", "topaz", "umber", "vesper", "walrus", "bramble", "cinder",
    "dahlia", "ermine", "ferret", "gravel", "hemlock", "ivory", "jackal", "kelp", "lilac", "mango", "nutmeg",
    "oyster", "parsley", "quince", "russet", "sable", "tansy", "urchin", "vole", "wicker", "aster", "birch",
    "coral", "delta", "egret", "flint", "gannet", "hyacinth", "ibis", "jade", "kiln", "lupin", "mica", "nettle",
    "opal", "puffin", "ridge", "spruce", "tern", "vane", "whelk", "alder", "beacon", "clover", "dynamo", "elm",
    "fennel", "gull", "hornet", "ingot", "jetty", "kettle", "lark", "mussel", "newt", "olive", "pylon", "rook",
)  # fmt: skip
"""Key words: none of them is one of eval's NIAH keys."""
VALUE_KINDS = (
    ("locker combination", "locker combinations"),
    ("access number", "access numbers"),
    ("serial number", "serial numbers"),
    ("room number", "room numbers"),
    ("account number", "account numbers"),
    ("ticket number", "ticket numbers"),
    ("badge number", "badge numbers"),
    ("pass number", "pass numbers"),
    ("reference number", "reference numbers"),
    ("order number", "order numbers"),
    ("password", "passwords"),
    ("pin", "pins"),
    ("key number", "key numbers"),
    ("box number", "box numbers"),
    ("lucky number", "lucky numbers"),
    ("magic number", "magic numbers"),
)
"""(singular, plural) value kinds of keyed statements."""
SYLLABLES = (
    "tor", "mel", "quin", "ash", "dra", "vex", "lum", "pho", "gri", "sel", "orn", "yth", "bri", "zan", "hul", "wen",
    "ost", "jal", "ruk", "fey", "nim", "oss", "plo", "crat", "ith", "mox", "sten", "ulf", "krin", "dor", "ev", "thal",
)  # fmt: skip
"""Syllables of made-up names and coded words (closed syllables and clusters: not eval's consonant-vowel words)."""
NOUNS = (
    "lamp", "boat", "garden", "window", "wagon", "kitten", "castle", "mill", "bell", "forest", "clock", "farmer",
    "baker", "candle", "bridge", "letter", "horse", "market", "harbour", "chapel", "orchard", "shepherd", "cottage",
)  # fmt: skip
ADJECTIVES = ("still", "old", "bright", "narrow", "heavy", "gentle", "busy", "cold", "empty", "tall", "dusty", "calm")
PLACES = (
    "near the mill", "by the gate", "on the hill", "in the valley", "at the fair", "across the field",
    "beside the well", "under the bridge", "along the lane", "behind the barn",
)  # fmt: skip
VERBS = ("stands", "waits", "rests", "sleeps", "shines", "turns", "leans", "sits")


def made_up_words(rng: random.Random, n: int, low: int = 2, high: int = 3) -> list[str]:
    """``n`` distinct lowercase words of ``low`` to ``high`` of ``SYLLABLES``."""
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(low, high)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def value(rng: random.Random) -> str:
    """A number of 3 to 7 digits, no leading zero."""
    digits = rng.randint(3, 7)
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def sentence(rng: random.Random) -> str:
    """One short synthetic filler sentence."""
    shape = rng.randrange(3)
    noun, adj = rng.choice(NOUNS), rng.choice(ADJECTIVES)
    if shape == 0:
        return f"The {adj} {noun} {rng.choice(VERBS)} {rng.choice(PLACES)}."
    if shape == 1:
        return f"A {noun} is {adj} today."
    return f"Every {noun} {rng.choice(PLACES)} is {adj}."


# ---------------------------------------------------------------------------------------------- templates
# keyed statements: (statement, question) with {k} key, {v} value, {n} value kind; each question ends with the
# statement's lead-in, so that the answer " {v}" continues both alike
KV_TEMPLATES = (
    (" The {n} for {k} is {v}.", " Which {n} belongs to {k}? The {n} for {k} is"),
    (" The {n} of {k} is {v}.", " Tell me the {n} of {k}. The {n} of {k} is"),
    (" Note that {k} has the {n} {v}.", " Recall what was noted about {k}. {k} has the {n}"),
    (" For {k}, the {n} is {v}.", " Question: what is it for {k}? Answer: For {k}, the {n} is"),
    (" Keep in mind: {k} -> {v}.", " Look up {k} in the notes. {k} ->"),
    (" {K}'s {n} is {v}.", " What did the text give as {K}'s {n}? {K}'s {n} is"),
    (" Record: {n} of {k} = {v}.", " Find the record for {k}. Record: {n} of {k} ="),
    (" The {n} assigned to {k} reads {v}.", " Which {n} was assigned to {k}? The {n} assigned to {k} reads"),
)
MULTI_TEMPLATES = (
    (" One {n} for {k} is {v}.", " List every {n} for {k}. The {p} for {k} are"),
    (" Another {n} of {k}: {v}.", " Which {p} does {k} have? The {p} of {k} are"),
    (" {K} was given the {n} {v}.", " Gather all of {K}'s {p}. {K} was given the {p}"),
)
CHAIN_START = (" Let {a} be {v}.", " Set {a} to {v}.", " {a} := {v};", " Assign {v} to {a}.")
CHAIN_HOP = (" {b} takes the value of {a}.", " Set {b} to {a}.", " {b} := {a};", " Copy {a} into {b}.")
CHAIN_QUESTION = (
    " Which names hold the value {v} after all of the assignments above? They are:",
    " Trace {v} through the assignments. The names that end up equal to {v} are:",
    " Question: which of the names above carry the number {v}? Answer: the names carrying {v} are:",
)
CHAIN_HEADER = (" Follow the assignments in the text.", " Some names are given values below.", "")
COMMON_HEADER = (
    " Here is a list of words; some of them come up again and again.",
    " Count how often each word occurs in the following list.",
    " A long list of words follows.",
)
COMMON_QUESTION = (
    " Which {c} words occur most often in the list? The {c} words that occur most often are:",
    " Name the {c} words repeated most in the list above. Answer: the {c} most repeated words are:",
)
COMMON_SEPARATORS = (";", ",", " |", " -")
FREQUENT_HEADER = (
    " The passage below is written in a code of made-up words.",
    " Read this coded passage and keep count of its words.",
    "",
)
FREQUENT_QUESTION = (
    " Which {c} coded {w} appear most in the passage, most frequent first? {W}:",
    " Question: what {v} the {c} commonest coded {w} above? Answer: the {c} commonest coded {w} {v}:",
)
KV_HEADER = (" Some facts are hidden in the text below.", " Read the text and remember the numbers in it.", "")


@dataclass
class Piece:
    """A text to insert: ``parts`` are ``(text, supervised)``; ``after`` orders it behind another insertion."""

    parts: list[tuple[str, bool]]
    after: int | None = None  # index of the insertion it must follow (a question after its statement)


@dataclass
class TaskSample:
    """One training instance: ``ids [n]`` int32 and ``mask [n]`` bool (True where the token is trained)."""

    kind: str
    ids: np.ndarray
    mask: np.ndarray
    answers: list[str] = field(default_factory=list)


class Encoder:
    """Token ids of short strings through a ``tokenizers.Tokenizer`` (or anything with ``encode``), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.cache: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        ids = self.cache.get(text)
        if ids is None:
            enc = self.tok.encode(text, add_special_tokens=False)
            ids = list(enc.ids if hasattr(enc, "ids") else enc)
            if len(self.cache) < 200_000:
                self.cache[text] = ids
        return ids


def sentence_ends(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Which token ids end a sentence or a line (insertions go right after one of them)."""
    out = np.zeros(vocab_size, dtype=bool)
    for i in range(vocab_size):
        text = tokenizer.decode([i])
        out[i] = text.rstrip(" \"')").endswith((".", "!", "?")) or text.endswith("\n")
    return out


class TaskGenerator:
    """Instances of ``KINDS`` over slices of ``corpus`` (token ids); ``make(index, length)`` is deterministic."""

    def __init__(
        self,
        tokenizer: Any,
        corpus: np.ndarray,
        bos_id: int,
        eos_id: int,
        seed: int,
        weights: dict[str, float] | None = None,
        ends: np.ndarray | None = None,
        max_keys: int = 16,
        max_questions: int = 4,
    ) -> None:
        self.max_keys, self.max_questions = max_keys, max_questions
        self.enc = Encoder(tokenizer)
        self.corpus = corpus
        self.bos, self.eos = bos_id, eos_id
        self.seed = seed
        self.weights = weights or DEFAULT_WEIGHTS
        size = int(corpus.max()) + 1
        self.ends = ends if ends is not None else sentence_ends(tokenizer, size)
        self.makers: dict[str, Callable[[random.Random, int], TaskSample]] = {
            "kv": self._kv,
            "multivalue": self._multivalue,
            "chain": self._chain,
            "common": self._common,
            "frequent": self._frequent,
            "repeat": self._repeat,
        }

    # ------------------------------------------------------------------ entry points
    def make(self, index: int, length: int, kind: str | None = None) -> TaskSample:
        """Instance ``index`` of at most ``length`` tokens (kinds drawn by ``weights`` unless ``kind`` is given)."""
        rng = random.Random(f"sala-small-tasks:{self.seed}:{index}:{length}")
        if kind is None:
            names = list(self.weights)
            kind = rng.choices(names, [self.weights[n] for n in names])[0]
        for attempt in range(MAX_ATTEMPTS):  # a draw too large for the length is drawn again (deterministically)
            try:
                sample = self.makers[kind](rng, length)
                break
            except ValueError:
                if attempt == MAX_ATTEMPTS - 1:
                    raise
                rng = random.Random(f"sala-small-tasks:{self.seed}:{index}:{length}:{attempt + 1}")
        assert sample.ids.size <= length, (kind, sample.ids.size, length)
        return sample

    def packed(self, index: int, length: int, min_frac: float = 0.6) -> TaskSample:
        """Exactly ``length`` tokens: unsupervised corpus text ending in EOS, then an instance of
        ``min_frac * length`` to ``length`` tokens (so instance lengths vary continuously between buckets)."""
        rng = random.Random(f"sala-small-pack:{self.seed}:{index}:{length}")
        inner = rng.randint(int(min_frac * length), length)
        sample = self.make(index, inner)
        pad = length - sample.ids.size
        if pad == 0:
            return sample
        lead = np.concatenate([self._corpus_slice(rng, pad - 1), np.array([self.eos], dtype=np.int32)])
        return TaskSample(
            sample.kind,
            np.concatenate([lead, sample.ids]),
            np.concatenate([np.zeros(pad, dtype=bool), sample.mask]),
            sample.answers,
        )

    # ------------------------------------------------------------------ assembly
    def _corpus_slice(self, rng: random.Random, n: int) -> np.ndarray:
        if n <= 0:
            return np.zeros(0, dtype=np.int32)
        start = rng.randrange(0, self.corpus.size - n)
        return self.corpus[start : start + n].astype(np.int32)

    def _synthetic(self, rng: random.Random, n: int) -> np.ndarray:
        out: list[int] = []
        while len(out) < n:
            out.extend(self.enc(" " + sentence(rng)))
        return np.array(out[:n], dtype=np.int32)

    def _encode_piece(self, piece: Piece) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        mask: list[bool] = []
        for text, supervised in piece.parts:
            t = self.enc(text)
            ids.extend(t)
            mask.extend([supervised] * len(t))
        return ids, mask

    def _assemble(
        self,
        rng: random.Random,
        length: int,
        kind: str,
        header: str,
        inserts: Sequence[Piece],
        tail: Sequence[Piece],
        answers: list[str],
        ordered: bool = False,
    ) -> TaskSample:
        """``[BOS] header`` + haystack with ``inserts`` at sentence ends (in the given order when ``ordered``;
        a piece with ``after`` lands behind that piece) + ``tail``; exactly ``length`` tokens."""
        head_ids = [self.bos, *self.enc(header)] if header else [self.bos]
        enc_ins = [self._encode_piece(p) for p in inserts]
        enc_tail = [self._encode_piece(p) for p in tail]
        fixed = len(head_ids) + sum(len(i) for i, _ in enc_ins) + sum(len(i) for i, _ in enc_tail)
        budget = length - fixed
        if budget < 8 * (len(inserts) + 1):
            raise ValueError(f"{kind}: {length} tokens are too few for {len(inserts)} insertions")
        synthetic = rng.random() < SYNTHETIC_SHARE
        hay = self._synthetic(rng, budget) if synthetic else self._corpus_slice(rng, budget)
        cand = np.nonzero(self.ends[hay[:-1]])[0] + 1 if hay.size > 1 else np.zeros(0, dtype=np.int64)
        if cand.size < len(inserts):
            cand = np.arange(1, hay.size)
        free = [i for i, p in enumerate(inserts) if p.after is None]
        spots = sorted(rng.sample(range(cand.size), len(free)))
        if not ordered:
            rng.shuffle(spots)
        at: dict[int, int] = {i: int(cand[s]) for i, s in zip(free, spots, strict=True)}
        for i, p in enumerate(inserts):  # dependants: a sentence end strictly after their anchor, else the end
            if p.after is not None:
                later = cand[cand > at[p.after]]
                at[i] = int(later[rng.randrange(later.size)]) if later.size else hay.size
        order = sorted(range(len(inserts)), key=lambda i: (at[i], inserts[i].after is not None, i))
        ids: list[int] = list(head_ids)
        mask: list[bool] = [False] * len(head_ids)
        prev = 0
        for i in order:
            ids.extend(hay[prev : at[i]].tolist())
            mask.extend([False] * (at[i] - prev))
            ids.extend(enc_ins[i][0])
            mask.extend(enc_ins[i][1])
            prev = at[i]
        ids.extend(hay[prev:].tolist())
        mask.extend([False] * (hay.size - prev))
        for t_ids, t_mask in enc_tail:
            ids.extend(t_ids)
            mask.extend(t_mask)
        return TaskSample(kind, np.array(ids, dtype=np.int32), np.array(mask, dtype=bool), answers)

    # ------------------------------------------------------------------ kinds
    @staticmethod
    def _fill(template: str, k: str, v: str = "", n: str = "", p: str = "") -> str:
        return template.format(k=k, K=k[:1].upper() + k[1:], v=v, n=n, p=p)

    def _keys(self, rng: random.Random, count: int) -> list[str]:
        if rng.random() < 0.5:
            return rng.sample(KEY_WORDS, count)
        return made_up_words(rng, count)

    def _kv(self, rng: random.Random, length: int) -> TaskSample:
        many = min(self.max_keys, max(1, length // 512 if self.max_keys <= 16 else length // 64))
        n_keys = 1 if rng.random() < 0.3 else rng.randint(2, many) if many > 1 else 1
        keys = self._keys(rng, n_keys)
        vals = [value(rng) for _ in keys]
        kind = rng.choice(VALUE_KINDS)[0]
        tpl = rng.choice(KV_TEMPLATES)
        inserts = [Piece([(self._fill(tpl[0], k, v, kind), False)]) for k, v in zip(keys, vals, strict=True)]
        questions = max(1, min(self.max_questions, length // 256))  # each about 30 tokens with its answer
        asked = rng.sample(range(n_keys), min(n_keys, rng.randint(1, questions)))
        inside = [i for i in range(n_keys) if i not in asked and rng.random() < 0.5][:questions]
        for i in inside:
            inserts.append(Piece(self._qa(tpl[1], keys[i], vals[i], kind), after=i))
        tail = [Piece(self._qa(tpl[1], keys[i], vals[i], kind)) for i in asked]
        return self._assemble(rng, length, "kv", rng.choice(KV_HEADER), inserts, tail, [vals[i] for i in asked])

    def _qa(self, question: str, k: str, v: str, kind: str, p: str = "") -> list[tuple[str, bool]]:
        return [(self._fill(question, k, v, kind, p), False), (" " + v, True), (".", True)]

    def _multivalue(self, rng: random.Random, length: int) -> TaskSample:
        count = rng.randint(2, 5)
        keys = self._keys(rng, 1 + rng.randint(0, 3))
        vals: list[str] = []
        while len(vals) < count:
            v = value(rng)
            if v not in vals:
                vals.append(v)
        kind, plural = rng.choice(VALUE_KINDS)
        tpl = rng.choice(MULTI_TEMPLATES)
        stated = [(keys[0], v) for v in vals] + [(k, value(rng)) for k in keys[1:]]
        rng.shuffle(stated)  # placed in this order, so the answer lists the values as the text gives them
        inserts = [Piece([(self._fill(tpl[0], k, v, kind), False)]) for k, v in stated]
        vals = [v for k, v in stated if k == keys[0]]
        question = self._fill(tpl[1], keys[0], "", kind, plural)
        tail = [Piece([(question, False), (" " + ", ".join(vals), True), (".", True)])]
        return self._assemble(rng, length, "multivalue", rng.choice(KV_HEADER), inserts, tail, vals, ordered=True)

    def _chain(self, rng: random.Random, length: int) -> TaskSample:
        hops = rng.randint(1, 6)
        n_chains = 1 + (rng.randint(0, 2) if length >= 2048 else 0)
        style = rng.randrange(3)
        names = made_up_words(rng, n_chains * (hops + 1))
        names = [w.upper() if style == 0 else w.capitalize() if style == 1 else w for w in names]
        start, hop = rng.choice(CHAIN_START), rng.choice(CHAIN_HOP)
        chains, values = [], []
        for c in range(n_chains):
            v = value(rng)
            while v in values:
                v = value(rng)
            values.append(v)
            chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
            chains.append(chain)
        # all statements in one ordered stream: each chain keeps its own order, chains interleave at random
        stream: list[tuple[int, int]] = [(c, j) for c in range(n_chains) for j in range(hops + 1)]
        rng.shuffle(stream)
        pos = {c: 0 for c in range(n_chains)}
        texts = []
        for c, _ in stream:
            j = pos[c]
            pos[c] += 1
            chain = chains[c]
            texts.append(start.format(a=chain[0], v=values[c]) if j == 0 else hop.format(a=chain[j - 1], b=chain[j]))
        inserts = [Piece([(t, False)]) for t in texts]
        target = chains[0]
        q = rng.choice(CHAIN_QUESTION).format(v=values[0])
        tail = [Piece([(q, False), (" " + ", ".join(target), True), (".", True)])]
        return self._assemble(rng, length, "chain", rng.choice(CHAIN_HEADER), inserts, tail, list(target), ordered=True)

    def _common(self, rng: random.Random, length: int) -> TaskSample:
        top = rng.randint(3, max(3, min(10, length // 128)))
        sep = rng.choice(COMMON_SEPARATORS)
        header = rng.choice(COMMON_HEADER)
        question = rng.choice(COMMON_QUESTION).format(c=top)
        words = made_up_words(rng, top + length // 3, 1, 3)
        common, rare = words[:top], words[top:]
        budget = length - 1 - len(self.enc(header)) - len(self.enc(question)) - 24 * top
        item = {w: self.enc(f" {w}{sep}") for w in words}
        rare_freq = rng.randint(1, 3)
        freq = rare_freq + rng.randint(2, 8)
        cost = sum(len(item[w]) for w in common) * freq
        while freq > rare_freq + 1 and cost > budget // 2:
            freq -= 1
            cost = sum(len(item[w]) for w in common) * freq
        if cost > budget:
            raise ValueError(f"common: {length} tokens are too few")
        pool = common * freq
        for w in rare:
            extra = len(item[w]) * rare_freq
            if cost + extra > budget:
                break
            pool += [w] * rare_freq
            cost += extra
        rng.shuffle(pool)
        ids = [self.bos, *self.enc(header)]
        for w in pool:
            ids.extend(item[w])
        mask = [False] * len(ids)
        return self._finish(rng, "common", ids, mask, question, common)

    def _finish(
        self, rng: random.Random, kind: str, ids: list[int], mask: list[bool], question: str, answers: list[str]
    ) -> TaskSample:
        for text, sup in ((question, False), (" " + ", ".join(answers), True), (".", True)):
            t = self.enc(text)
            ids.extend(t)
            mask.extend([sup] * len(t))
        return TaskSample(kind, np.array(ids, dtype=np.int32), np.array(mask, dtype=bool), answers)

    def _frequent(self, rng: random.Random, length: int) -> TaskSample:
        top = rng.randint(1, 3)
        header = rng.choice(FREQUENT_HEADER)
        plural = top > 1
        question = rng.choice(FREQUENT_QUESTION).format(
            c=top, w="words" if plural else "word", W="They are" if plural else "It is", v="are" if plural else "is"
        )
        vocab = made_up_words(rng, 120, 1, 2)
        alpha = rng.uniform(1.2, 2.2)
        weights = [1.0 / (r + 1) ** alpha for r in range(len(vocab))]
        budget = length - 1 - len(self.enc(header)) - len(self.enc(question)) - 12 * top
        cost = {w: len(self.enc(" " + w)) for w in vocab}
        words: list[str] = []
        used = 0
        while True:
            w = rng.choices(vocab, weights)[0]
            if used + cost[w] > budget:
                break
            words.append(w)
            used += cost[w]
        counts = Counter(words)
        ranked = [w for w, _ in counts.most_common()]
        if len(ranked) <= top:
            raise ValueError(f"frequent: {length} tokens are too few")
        answers = ranked[:top]
        # distinct counts for the top words, above every other word's: occurrences of other words become top words
        # (only words of at least the same token cost, so the text does not grow)
        floor = counts[ranked[top]]
        for w in reversed(answers):
            while counts[w] <= floor:
                spare = [i for i, x in enumerate(words) if x not in answers and cost[x] >= cost[w]]
                if not spare:
                    raise ValueError(f"frequent: {length} tokens are too few")
                i = rng.choice(spare)
                counts[words[i]] -= 1
                words[i] = w
                counts[w] += 1
            floor = counts[w]
        final = Counter(words).most_common(top + 1)
        assert [w for w, _ in final[:top]] == answers and all(
            final[i][1] > final[i + 1][1] for i in range(min(top, len(final) - 1))
        )
        ids = [self.bos, *self.enc(header)]
        for w in words:
            ids.extend(self.enc(" " + w))
        return self._finish(rng, "frequent", ids, [False] * len(ids), question, answers)

    def _repeat(self, rng: random.Random, length: int) -> TaskSample:
        """``[BOS] lead span gap span``: span lengths log-uniform from 8 tokens to half the instance, the gap and
        the lead corpus text splitting the rest at random, so copy distances cover the whole length."""
        room = length - 1
        if room < 24:
            raise ValueError(f"repeat: {length} tokens are too few")
        span_len = round(math.exp(rng.uniform(math.log(8), math.log(room // 2))))
        span = self._corpus_slice(rng, span_len)
        if rng.random() < SHUFFLED_SHARE:
            span = span[np.random.default_rng(rng.getrandbits(32)).permutation(span_len)]
        rest = room - 2 * span_len
        gap = rng.randint(0, rest)
        lead = self._corpus_slice(rng, rng.randint(0, rest - gap))
        parts = [np.array([self.bos], dtype=np.int32), lead, span, self._corpus_slice(rng, gap), span]
        ids = np.concatenate(parts)
        mask = np.zeros(ids.size, dtype=bool)
        mask[ids.size - span_len + 1 :] = True
        return TaskSample("repeat", ids, mask, [])
