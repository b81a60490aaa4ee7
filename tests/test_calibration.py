"""Tests for salaquant.calibration.calib_data, using the shipped sala-tiny tokenizer."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from shipped import CALIB_FILE, SHIPPED

import salaquant.model.hf  # noqa: F401  (registers the minicpm_sala config for AutoTokenizer)
from salaquant.calibration.calib_data import (
    CalibOptions,
    CalibrationError,
    CalibSample,
    CalibSet,
    load_calibration,
    parse_hf_source,
)


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SHIPPED))


def expected_ids(tok: Any, text: str) -> list[int]:
    return [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_tokenizer_fixture_sanity(tok: Any) -> None:
    assert tok.bos_token_id == 1
    assert not getattr(tok, "chat_template", None)


def test_text_jsonl_ids_match_direct_tokenization(tok: Any, tmp_path: Path) -> None:
    texts = ["The quick brown fox.", "Sparse and lightning layers.\nSecond line."]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    cs = load_calibration(path, tok, CalibOptions())
    assert [s.ids.tolist() for s in cs] == [expected_ids(tok, t) for t in texts]
    assert all(s.ids.dtype == torch.int64 and s.ids.ndim == 1 for s in cs)
    assert [s.source for s in cs] == [f"{path}:1", f"{path}:2"]

    no_bos = load_calibration(path, tok, CalibOptions(bos=False))
    assert [s.ids.tolist() for s in no_bos] == [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_field_priority_blank_lines_and_source_lines(tok: Any, tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        json.dumps({"question": "Q one", "content": "not this"})
        + "\n\n   \n"
        + json.dumps({"content": "C three", "meta": 1})
        + "\n"
        + json.dumps({"text": "T four", "question": "not this"})
        + "\n",
        encoding="utf-8",
    )
    cs = load_calibration(path, tok, CalibOptions())
    assert [s.ids.tolist() for s in cs] == [expected_ids(tok, t) for t in ("Q one", "C three", "T four")]
    assert [s.source for s in cs] == [f"{path}:1", f"{path}:4", f"{path}:5"]


def test_seeds_format_question_with_and_without_tokens(tok: Any, tmp_path: Path) -> None:
    recs = [
        {"question": "What is sparse attention?", "_tokens": 12345},
        {"question": "Explain Simple GLA briefly."},
        {"question": "Why calibrate on long documents?", "_tokens": 3},
    ]
    path = write_jsonl(tmp_path / "calib_dense_96.jsonl", recs)
    cs = load_calibration(path, tok, CalibOptions())
    # _tokens is metadata only: lengths come from tokenizing the text
    assert [len(s) for s in cs] == [len(expected_ids(tok, r["question"])) for r in recs]
    assert [s.ids.tolist() for s in cs] == [expected_ids(tok, r["question"]) for r in recs]


def test_prompt_answer_joined_with_newline(tok: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "pa.jsonl", [{"prompt": "2 + 2 =", "answer": "4"}])
    (s,) = load_calibration(path, tok, CalibOptions()).samples
    assert s.ids.tolist() == expected_ids(tok, "2 + 2 =\n4")


def test_messages_plain_rendering_without_chat_template(tok: Any, tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    (s,) = load_calibration(path, tok, CalibOptions()).samples
    assert s.ids.tolist() == expected_ids(tok, "user: hi there\nassistant: hello")


def test_messages_use_chat_template_when_present(tok: Any, tmp_path: Path) -> None:
    templated = copy.deepcopy(tok)
    templated.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    msgs = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    (s,) = load_calibration(path, templated, CalibOptions()).samples
    assert s.ids.tolist() == expected_ids(tok, "<|user|>hi there\n<|assistant|>hello\n")
    assert not getattr(tok, "chat_template", None)  # the shared tokenizer is untouched


def test_forced_field(tok: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "f.jsonl", [{"text": "ignored", "body": "the body"}])
    (s,) = load_calibration(path, tok, CalibOptions(field="body")).samples
    assert s.ids.tolist() == expected_ids(tok, "the body")
    with pytest.raises(CalibrationError, match=r"f\.jsonl:1: no field 'missing'.*'text', 'body'"):
        load_calibration(path, tok, CalibOptions(field="missing"))


def test_unknown_field_names_file_line_and_keys(tok: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "u.jsonl", [{"text": "fine"}, {"body": "x", "_tokens": 4}])
    with pytest.raises(CalibrationError) as ei:
        load_calibration(path, tok, CalibOptions())
    msg = str(ei.value)
    assert f"{path}:2" in msg and "unknown field" in msg
    assert "'body'" in msg and "'_tokens'" in msg and "--field" in msg


def test_malformed_line_names_file_and_line(tok: Any, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "broken"\n', encoding="utf-8")
    with pytest.raises(CalibrationError, match=re.escape(f"{path}:3: malformed JSON")):
        load_calibration(path, tok, CalibOptions())
    path.write_text('["not", "an", "object"]\n', encoding="utf-8")
    with pytest.raises(CalibrationError, match=re.escape(f"{path}:1: expected a JSON object")):
        load_calibration(path, tok, CalibOptions())


def test_empty_and_missing_files(tok: Any, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(CalibrationError, match=r"empty\.jsonl: no records"):
        load_calibration(empty, tok, CalibOptions())
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(CalibrationError, match=r"nope\.jsonl: no such file"):
        load_calibration(missing, tok, CalibOptions())
    with pytest.raises(CalibrationError, match="no calibration source"):
        load_calibration([], tok, CalibOptions())
    assert issubclass(CalibrationError, ValueError)


def test_non_utf8_text_file(tok: Any, tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(CalibrationError, match=r"latin1\.txt: not UTF-8"):
        load_calibration(path, tok, CalibOptions())


def test_all_too_short(tok: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "short.jsonl", [{"text": "a"}, {"text": "b c"}, {"text": ""}])
    with pytest.raises(CalibrationError, match=r"0 of 3 samples have >= 100 tokens"):
        load_calibration(path, tok, CalibOptions(min_len=100))


def test_min_len_drops_and_counts(tok: Any, tmp_path: Path) -> None:
    long_text = "word " * 50
    path = write_jsonl(tmp_path / "m.jsonl", [{"text": "a"}, {"text": long_text}, {"text": ""}])
    cs = load_calibration(path, tok, CalibOptions(min_len=10))
    assert [s.source for s in cs] == [f"{path}:2"]
    s = cs.summary()
    assert (s["records"], s["dropped"], s["samples"]) == (3, 2, 1)


def test_bad_options(tok: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}])
    for opts, pattern in [
        (CalibOptions(max_len=0), "max_len must be >= 1"),
        (CalibOptions(min_len=0), "min_len must be >= 1"),
        (CalibOptions(min_len=20, max_len=10), "larger than max_len"),
        (CalibOptions(max_samples=0), "max_samples must be >= 1"),
    ]:
        with pytest.raises(CalibrationError, match=pattern):
            load_calibration(path, tok, opts)


def test_truncation(tok: Any, tmp_path: Path) -> None:
    text = "one two three four five six seven eight nine ten " * 4
    full = expected_ids(tok, text)
    assert len(full) > 12
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": text}, {"text": "hi"}])
    cs = load_calibration(path, tok, CalibOptions(max_len=12))
    assert cs[0].ids.tolist() == full[:12]
    assert cs[1].ids.tolist() == expected_ids(tok, "hi")
    assert cs.summary()["truncated"] == 1


def test_plain_text_file_and_folder(tok: Any, tmp_path: Path) -> None:
    one = tmp_path / "notes.md"
    one.write_text("# Title\n\nSome notes.\n", encoding="utf-8")
    (s,) = load_calibration(one, tok, CalibOptions()).samples
    assert s.ids.tolist() == expected_ids(tok, "# Title\n\nSome notes.\n")
    assert s.source == str(one)

    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("bravo", encoding="utf-8")
    (folder / "a.txt").write_text("alpha", encoding="utf-8")
    (folder / "sub" / "c.txt").write_text("charlie", encoding="utf-8")
    (folder / ".hidden").write_text("skip me", encoding="utf-8")
    cs = load_calibration(folder, tok, CalibOptions())
    assert [s.ids.tolist() for s in cs] == [expected_ids(tok, t) for t in ("alpha", "bravo", "charlie")]
    assert [Path(s.source).name for s in cs] == ["a.txt", "b.txt", "c.txt"]
    assert cs.summary()["sources"] == {str(folder): {"samples": 3, "tokens": sum(len(s) for s in cs)}}


def test_shuffle_is_seeded_and_max_samples(tok: Any, tmp_path: Path) -> None:
    texts = [f"document number {i}" for i in range(20)]
    path = write_jsonl(tmp_path / "s.jsonl", [{"text": t} for t in texts])
    in_order = [s.source for s in load_calibration(path, tok, CalibOptions())]
    assert in_order == [f"{path}:{i}" for i in range(1, 21)]

    a = [s.source for s in load_calibration(path, tok, CalibOptions(shuffle=True, seed=3))]
    b = [s.source for s in load_calibration(path, tok, CalibOptions(shuffle=True, seed=3))]
    c = [s.source for s in load_calibration(path, tok, CalibOptions(shuffle=True, seed=4))]
    assert a == b and a != in_order and sorted(a) == sorted(in_order) and a != c

    first5 = load_calibration(path, tok, CalibOptions(max_samples=5))
    assert [s.source for s in first5] == in_order[:5]
    shuffled5 = load_calibration(path, tok, CalibOptions(max_samples=5, shuffle=True, seed=3))
    assert [s.source for s in shuffled5] == a[:5]


def test_multiple_sources_and_mix(tok: Any, tmp_path: Path) -> None:
    j = write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": "two"}])
    t = tmp_path / "b.txt"
    t.write_text("three", encoding="utf-8")
    cs = load_calibration([j, str(t)], tok, CalibOptions())
    mix = cs.summary()["sources"]
    assert list(mix) == [str(j), str(t)]
    assert mix[str(j)] == {"samples": 2, "tokens": len(cs[0]) + len(cs[1])}
    assert mix[str(t)] == {"samples": 1, "tokens": len(cs[2])}


def _fake_set(lengths: list[int]) -> CalibSet:
    return CalibSet(
        samples=[CalibSample(torch.arange(n, dtype=torch.int64), f"x:{i}", "x") for i, n in enumerate(lengths)]
    )


def test_summary_histogram_by_hand() -> None:
    lengths = [1, 1023, 1024, 10239, 10240, 51199, 51200, 102399, 102400, 131072, 5000]
    s = _fake_set(lengths).summary()
    assert s["histogram"] == {"<1K": 2, "1-10K": 3, "10-50K": 2, "50-100K": 2, "100K+": 2}
    assert (s["samples"], s["tokens"], s["min_len"], s["max_len"]) == (11, sum(lengths), 1, 131072)
    assert s["mean_len"] == pytest.approx(sum(lengths) / 11)
    assert s["sources"] == {"x": {"samples": 11, "tokens": sum(lengths)}}


def test_fingerprint() -> None:
    a = _fake_set([3, 5])
    h = hashlib.sha256()
    for n in (3, 5):
        h.update(str(n).encode())
        h.update(b"".join(i.to_bytes(8, "little") for i in range(n)))
    assert a.fingerprint() == h.hexdigest()
    assert _fake_set([3, 5]).fingerprint() == a.fingerprint()
    assert _fake_set([5, 3]).fingerprint() != a.fingerprint()
    # same concatenated ids, different split into samples
    b = CalibSet(samples=[CalibSample(torch.tensor([0, 1]), "y"), CalibSample(torch.tensor([2]), "y")])
    c = CalibSet(samples=[CalibSample(torch.tensor([0]), "y"), CalibSample(torch.tensor([1, 2]), "y")])
    assert b.fingerprint() != c.fingerprint()


def test_parquet_via_datasets(tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict({"text": ["alpha beta", "gamma"], "n": [1, 2]}).to_parquet(str(path))
    cs = load_calibration(path, tok, CalibOptions())
    assert [s.ids.tolist() for s in cs] == [expected_ids(tok, "alpha beta"), expected_ids(tok, "gamma")]
    assert [s.source for s in cs] == [f"{path}#0", f"{path}#1"]

    other = tmp_path / "qa.parquet"
    datasets.Dataset.from_dict({"body": ["delta"], "prompt": ["p"], "answer": ["a"]}).to_parquet(str(other))
    assert load_calibration(other, tok, CalibOptions())[0].ids.tolist() == expected_ids(tok, "p\na")
    assert load_calibration(other, tok, CalibOptions(field="body"))[0].ids.tolist() == expected_ids(tok, "delta")
    with pytest.raises(CalibrationError, match="no column 'nope'"):
        load_calibration(other, tok, CalibOptions(field="nope"))


def test_parse_hf_source() -> None:
    hf = parse_hf_source("hf:wikitext:wikitext-2-raw-v1@train#text")
    assert (hf.name, hf.config, hf.split, hf.field) == ("wikitext", "wikitext-2-raw-v1", "train", "text")
    assert hf.label == "dataset:wikitext:wikitext-2-raw-v1[train]"
    hf = parse_hf_source("hf:org/data")
    assert (hf.name, hf.config, hf.split, hf.field) == ("org/data", None, "train", None)
    hf = parse_hf_source("hf:org/data@validation")
    assert (hf.config, hf.split) == (None, "validation")
    for bad in ("hf:", "hf:name@", "hf:name#", "hf:name:@x"):
        with pytest.raises(CalibrationError):
            parse_hf_source(bad)


def test_shipped_calibration_split(tok: Any) -> None:
    records = [json.loads(line) for line in CALIB_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    cs = load_calibration(CALIB_FILE, tok, CalibOptions())
    s = cs.summary()
    assert s["samples"] == len(records) == 32
    assert cs[0].ids.tolist() == expected_ids(tok, records[0]["text"])
    assert s["tokens"] == sum(len(expected_ids(tok, r["text"])) for r in records)
    assert sum(s["histogram"].values()) == 32 and s["dropped"] == 0 and s["truncated"] == 0
    assert len(cs.fingerprint()) == 64

    buf = io.StringIO()
    cs.render_summary(Console(file=buf, width=120, color_system=None))
    out = buf.getvalue()
    assert "Calibration set" in out and "1-10K" in out and str(CALIB_FILE) in out
