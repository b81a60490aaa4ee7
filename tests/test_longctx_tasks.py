"""The long-context training tasks of ``tools/longctx_tasks.py``: deterministic, answers right, and none of eval's
templates, keys or filler in them."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from salaquant.eval import niah, tasks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
try:
    import longctx_tasks as lt
finally:
    sys.path.pop(0)

tokenizers = pytest.importorskip("tokenizers")

EVAL_STRINGS = (
    "secret code",
    "VAR ",
    "Remember the secret codes",
    "Memorize and track",
    "Below is a numbered list",
    "Read the following coded text",
    "most frequently appeared",
    *niah.FILLER,
)


@pytest.fixture(scope="module")
def gen() -> lt.TaskGenerator:
    tok = tokenizers.Tokenizer.from_file(str(ROOT / "models/sala-tiny/tokenizer.json"))
    text = " ".join(lt.sentence(__import__("random").Random(i)) for i in range(3000))
    corpus = np.array(tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)
    return lt.TaskGenerator(tok, corpus, 1, 2, seed=5)


def decode(gen: lt.TaskGenerator, ids: np.ndarray) -> str:
    return gen.enc.tok.decode(ids.tolist(), skip_special_tokens=True)


def split(gen: lt.TaskGenerator, s: lt.TaskSample) -> tuple[str, list[str]]:
    """The text before the first supervised token, and each supervised span decoded."""
    starts = np.flatnonzero(s.mask & ~np.r_[False, s.mask[:-1]])
    ends = np.flatnonzero(s.mask & ~np.r_[s.mask[1:], False]) + 1
    spans = [decode(gen, s.ids[a:b]) for a, b in zip(starts, ends, strict=True)]
    return decode(gen, s.ids[: starts[-1]]), spans


def test_deterministic_and_sized(gen: lt.TaskGenerator) -> None:
    for kind in lt.KINDS:
        a, b = gen.make(3, 2048, kind), gen.make(3, 2048, kind)
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.mask, b.mask)
        assert a.ids.size <= 2048 and a.mask.any()
        assert not np.array_equal(a.ids, gen.make(4, 2048, kind).ids)
    for n in (1024, 4096):
        p = gen.packed(7, n)
        assert p.ids.size == n and p.mask.size == n


def test_dense_keyed_instances_fit_every_length(gen: lt.TaskGenerator) -> None:
    dense = lt.TaskGenerator(gen.enc.tok, gen.corpus, 1, 2, seed=9, max_keys=32, max_questions=12)
    for n in (512, 661, 1024, 2048):
        for index in range(30):
            s = dense.packed(index, n)
            assert s.ids.size == n and s.mask.any()


@pytest.mark.parametrize("index", range(6))
def test_keyed_answers_are_the_stated_values(gen: lt.TaskGenerator, index: int) -> None:
    s = gen.make(index, 2048, "kv")
    text, spans = split(gen, s)
    answers = [sp.rstrip(".").strip() for sp in spans[-len(s.answers) :]]
    assert answers == s.answers
    for value in answers:  # the value is stated once, next to a key that the question before its answer names
        stated = [m.start() for m in re.finditer(rf"(?<!\d){value}(?!\d)", text)]
        assert stated
        window = text[max(0, stated[0] - 80) : stated[0]]
        keys = re.findall(r"[A-Za-z]+", window)
        assert any(k.lower() in (w.lower() for w in keys) for k in lt.KEY_WORDS + tuple(keys[-6:]))


@pytest.mark.parametrize("index", range(6))
def test_multivalue_lists_every_value_of_the_key(gen: lt.TaskGenerator, index: int) -> None:
    s = gen.make(index, 2048, "multivalue")
    text, spans = split(gen, s)
    listed = [v.strip() for v in spans[-1].rstrip(".").split(",")]
    key = re.search(r"(?:for|of|all of) (\w+?)(?:'s)?[.?]", text[text.rfind(" List") :] or text[-200:])
    found = []
    for sentence in re.split(r"(?<=\.)\s", text):
        nums = re.findall(r"\d{3,7}", sentence)
        if nums and key and key.group(1).lower() in sentence.lower():
            found += nums
    assert listed == s.answers
    if key:
        assert found == listed


@pytest.mark.parametrize("index", range(8))
def test_chain_answer_is_every_name_holding_the_value(gen: lt.TaskGenerator, index: int) -> None:
    s = gen.make(index, 4096, "chain")
    text, spans = split(gen, s)
    val: dict[str, str] = {}
    start = r"(?:Let (\w+) be (\d+)\.|Set (\w+) to (\d+)\.|(\w+) := (\d+);|Assign (\d+) to (\w+)\.)"
    hop = (
        r"(?:(\w+) takes the value of (\w+)\.|Set (\w+) to ([A-Za-z]\w*)\.|(\w+) := ([A-Za-z]\w*);"
        r"|Copy (\w+) into (\w+)\.)"
    )
    for m in re.finditer(f"{start}|{hop}", text):
        g = m.groups()
        if g[0]:
            val[g[0]] = g[1]
        elif g[2]:
            val[g[2]] = g[3]
        elif g[4]:
            val[g[4]] = g[5]
        elif g[6]:
            val[g[7]] = g[6]
        elif g[8]:
            val[g[8]] = val[g[9]]
        elif g[10]:
            val[g[10]] = val[g[11]]
        elif g[12]:
            val[g[12]] = val[g[13]]
        else:
            val[g[15]] = val[g[14]]
    asked = re.findall(r"\d+", text[text.rfind(".") + 1 :] or text)[-1]
    holders = [name for name, v in val.items() if v == asked]
    listed = [w.strip() for w in spans[-1].rstrip(".").split(",")]
    assert listed == holders == s.answers


@pytest.mark.parametrize("index", range(4))
def test_word_frequency_answers_are_the_most_frequent(gen: lt.TaskGenerator, index: int) -> None:
    for kind in ("common", "frequent"):
        s = gen.make(index, 2048, kind)
        text, spans = split(gen, s)
        body = text.split("Which")[0].split("Name the")[0].split("Question:")[0]
        body = body.strip()
        for header in lt.COMMON_HEADER + lt.FREQUENT_HEADER:
            if header and body.startswith(header.strip()):
                body = body[len(header.strip()) :]
        counts = Counter(re.findall(r"[a-z]+", body))
        listed = [w.strip() for w in spans[-1].rstrip(".").split(",")]
        assert listed == s.answers
        ranked = counts.most_common()
        if kind == "common":
            top = ranked[0][1]
            assert set(listed) == {w for w, c in ranked if c == top}
        else:
            assert [w for w, _ in ranked[: len(listed)]] == listed
            assert all(ranked[i][1] > ranked[i + 1][1] for i in range(len(listed)))


def test_nothing_of_evals_templates_keys_or_filler(gen: lt.TaskGenerator) -> None:
    assert not set(lt.KEY_WORDS) & set(niah.KEYS)
    filler_words = {w.lower().strip(".") for s in niah.FILLER for w in s.split()}
    assert not set(lt.NOUNS + lt.ADJECTIVES + lt.VERBS) & filler_words
    for index in range(40):
        for kind in lt.KINDS:
            text = decode(gen, gen.make(index, 1024, kind).ids)
            for s in EVAL_STRINGS:
                assert s not in text, (kind, s)
            assert not re.search(rf"\b({'|'.join(niah.KEYS)})\b", text), kind
    rng = __import__("random").Random(0)
    assert not set(lt.made_up_words(rng, 200)) & set(tasks.nonsense_words(rng, 200))


@pytest.mark.parametrize("index", range(8))
def test_repeat_trains_the_second_copy_of_a_span(gen: lt.TaskGenerator, index: int) -> None:
    for n in (64, 1024):
        s = gen.make(index, n, "repeat")
        trained = np.flatnonzero(s.mask)
        assert trained.size and trained[-1] == s.ids.size - 1 and np.all(np.diff(trained) == 1)
        span = trained.size + 1  # the second copy: its first token is not predictable, the rest are trained
        second = s.ids[-span:]
        firsts = [i for i in range(1, s.ids.size - 2 * span + 1) if np.array_equal(s.ids[i : i + span], second)]
        assert firsts, "the trained span is stated before"
        assert s.ids[0] == 1 and 8 <= span <= (n - 1) // 2 + 1
    spans = {gen.make(i, 4096, "repeat").mask.sum() for i in range(40)}
    assert min(spans) < 64 and max(spans) > 512  # lengths spread from short to long spans


def test_every_kind_fits_the_shortest_packed_instance(gen: lt.TaskGenerator) -> None:
    for kind in lt.KINDS:  # packed rows of 512 tokens hold instances from 0.6 x 512 tokens on
        for index in range(25):
            s = gen.make(index, 300, kind)
            assert s.ids.size <= 300 and s.mask.any(), kind
