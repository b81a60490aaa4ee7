"""Calibration data: user files and datasets turned into token sequences for layer-by-layer calibration.

A source is one of (detected from the string or the path):

* ``hf:NAME[:CONFIG][@SPLIT][#FIELD]``: a Hugging Face hub dataset, loaded with
  ``datasets.load_dataset(NAME, CONFIG, split=SPLIT)`` (split ``train`` when omitted). This needs
  network access, or a filled local cache with ``HF_DATASETS_OFFLINE=1``.
* ``*.jsonl`` / ``*.json``: JSON Lines, one object per line, one sample per object (blank lines skipped).
* ``*.parquet`` / ``*.arrow``: a local table, loaded with ``datasets.load_dataset("parquet" | "arrow", ...)``;
  one sample per row.
* a folder: every non-hidden file below it in sorted path order, each read as if passed on its own.
* any other file (``*.txt``, ``*.md``, ...): UTF-8 text, the whole file is one sample.

The text of a record (JSON object or table row) is the first non-null of ``text``, ``question``,
``content``; else ``prompt + "\\n" + answer`` when both are present; else ``messages`` (a list of
``{"role", "content"}``) rendered with ``tokenizer.apply_chat_template(messages, tokenize=False)`` when
the tokenizer has a chat template, or as ``"role: content"`` lines joined by ``"\\n"`` when it has none.
``CalibOptions.field`` (or ``#FIELD`` in an ``hf:`` string) names the field to use instead; its value is
a string or a message list. Other keys (such as ``_tokens``) are ignored: text is always tokenized here.

One record is one sample; documents are never split into chunks.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "HISTOGRAM_BINS",
    "TEXT_FIELDS",
    "CalibOptions",
    "CalibSample",
    "CalibSet",
    "CalibrationError",
    "HFSource",
    "load_calibration",
    "parse_hf_source",
    "record_text",
    "samples_fingerprint",
]

TEXT_FIELDS = ("text", "question", "content")
"""Fields tried in order for the text of a record, before ``prompt`` + ``answer`` and ``messages``."""

HISTOGRAM_BINS: tuple[tuple[str, int, int | None], ...] = (
    ("<1K", 0, 1024),
    ("1-10K", 1024, 10240),
    ("10-50K", 10240, 51200),
    ("50-100K", 51200, 102400),
    ("100K+", 102400, None),
)
"""Sample-length bins of ``CalibSet.summary()``: (label, lower bound inclusive, upper bound exclusive)."""

_JSONL_SUFFIXES = (".jsonl", ".json")
_TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
_HF_PREFIX = "hf:"


class CalibrationError(ValueError):
    """Calibration data that cannot be read or gives no usable sample."""


@dataclass
class CalibSample:
    """One calibration sequence: ``ids`` (1-D int64) and where it came from (``file.jsonl:12``, ...)."""

    ids: torch.Tensor
    source: str
    group: str = ""
    """The input (file, folder or dataset) the sample belongs to; the key of the source mix."""

    def __post_init__(self) -> None:
        if not self.group:
            self.group = self.source

    def __len__(self) -> int:
        return int(self.ids.numel())


@dataclass
class CalibOptions:
    """How records become samples.

    ``max_samples`` keeps the first N usable samples (after ``shuffle``); ``max_len`` truncates each
    sample (BOS included); samples shorter than ``min_len`` tokens, and records whose text gives no
    token, are dropped. ``shuffle`` permutes the record order with ``random.Random(seed)``.
    """

    max_samples: int | None = None
    max_len: int = 131072
    min_len: int = 1
    shuffle: bool = False
    seed: int = 0
    field: str | None = None
    bos: bool = True

    def validate(self) -> None:
        """Raise ``CalibrationError`` on an out-of-range option."""
        if self.max_len < 1:
            raise CalibrationError(f"max_len must be >= 1, got {self.max_len}")
        if self.min_len < 1:
            raise CalibrationError(f"min_len must be >= 1, got {self.min_len}")
        if self.min_len > self.max_len:
            raise CalibrationError(
                f"min_len ({self.min_len}) is larger than max_len ({self.max_len}): every sample would be dropped"
            )
        if self.max_samples is not None and self.max_samples < 1:
            raise CalibrationError(f"max_samples must be >= 1 (or None for all), got {self.max_samples}")
        if self.field is not None and not self.field:
            raise CalibrationError("field must be a non-empty name")


@dataclass
class CalibSet:
    """The calibration samples in order, with what was read, dropped and truncated on the way."""

    samples: list[CalibSample]
    records: int = 0
    """Records read from all sources."""
    dropped: int = 0
    """Records tokenized but dropped (shorter than ``min_len``, or no text token)."""
    truncated: int = 0
    """Kept samples that were cut to ``max_len``."""

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[CalibSample]:
        return iter(self.samples)

    def __getitem__(self, index: int) -> CalibSample:
        return self.samples[index]

    @property
    def total_tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    def summary(self) -> dict[str, Any]:
        """Counts and lengths: samples, tokens, min/mean/max length, histogram, source mix, drops."""
        lengths = [len(s) for s in self.samples]
        histogram = {label: 0 for label, _, _ in HISTOGRAM_BINS}
        for n in lengths:
            histogram[_bin_label(n)] += 1
        sources: dict[str, dict[str, int]] = {}
        for s in self.samples:
            entry = sources.setdefault(s.group, {"samples": 0, "tokens": 0})
            entry["samples"] += 1
            entry["tokens"] += len(s)
        total = sum(lengths)
        return {
            "samples": len(lengths),
            "tokens": total,
            "min_len": min(lengths, default=0),
            "mean_len": total / len(lengths) if lengths else 0.0,
            "max_len": max(lengths, default=0),
            "histogram": histogram,
            "sources": sources,
            "records": self.records,
            "dropped": self.dropped,
            "truncated": self.truncated,
        }

    def fingerprint(self) -> str:
        """``samples_fingerprint`` of the sample ids (what the calibration engine records for resume)."""
        return samples_fingerprint([s.ids for s in self.samples])

    def render_summary(self, console: Console) -> None:
        """Print the summary as rich tables: totals, length histogram, source mix."""
        from rich.table import Table

        s = self.summary()
        totals = Table(title="Calibration set")
        totals.add_column("")
        totals.add_column("value", justify="right")
        totals.add_row("samples", f"{s['samples']:,}")
        totals.add_row("tokens", f"{s['tokens']:,}")
        totals.add_row("length min / mean / max", f"{s['min_len']:,} / {s['mean_len']:,.1f} / {s['max_len']:,}")
        totals.add_row("records read", f"{s['records']:,}")
        totals.add_row("dropped (too short)", f"{s['dropped']:,}")
        totals.add_row("truncated", f"{s['truncated']:,}")
        totals.add_row("fingerprint", self.fingerprint()[:16])
        console.print(totals)

        hist = Table(title="Sample length (tokens, 1K = 1024)")
        hist.add_column("bin")
        hist.add_column("samples", justify="right")
        for label, count in s["histogram"].items():
            hist.add_row(label, f"{count:,}")
        console.print(hist)

        mix = Table(title="Source mix")
        mix.add_column("source")
        mix.add_column("samples", justify="right")
        mix.add_column("tokens", justify="right")
        mix.add_column("share", justify="right")
        for name, entry in s["sources"].items():
            share = entry["tokens"] / s["tokens"] if s["tokens"] else 0.0
            mix.add_row(name, f"{entry['samples']:,}", f"{entry['tokens']:,}", f"{share:.1%}")
        console.print(mix)


def samples_fingerprint(samples: Sequence[torch.Tensor]) -> str:
    """sha256 (hex) over, per sample in order, its length (decimal ASCII) and token ids (int64 LE)."""
    h = hashlib.sha256()
    for ids in samples:
        flat = ids.detach().to(device="cpu", dtype=torch.int64).reshape(-1).contiguous()
        h.update(str(flat.numel()).encode())
        h.update(flat.numpy().astype("<i8", copy=False).tobytes())
    return h.hexdigest()


def _bin_label(n: int) -> str:
    for label, lo, hi in HISTOGRAM_BINS:
        if n >= lo and (hi is None or n < hi):
            return label
    raise AssertionError(n)  # the bins cover [0, inf)


@dataclass
class _Record:
    """A record not yet tokenized: ``text()`` gives its text (and may raise ``CalibrationError``)."""

    source: str
    group: str
    text: Callable[[], str]


@dataclass(frozen=True)
class HFSource:
    """A parsed ``hf:NAME[:CONFIG][@SPLIT][#FIELD]`` string."""

    name: str
    config: str | None = None
    split: str = "train"
    field: str | None = None

    @property
    def label(self) -> str:
        name = self.name if self.config is None else f"{self.name}:{self.config}"
        return f"dataset:{name}[{self.split}]"


def parse_hf_source(spec: str) -> HFSource:
    """Parse ``hf:NAME[:CONFIG][@SPLIT][#FIELD]`` (e.g. ``hf:wikitext:wikitext-2-raw-v1@train#text``)."""
    if not spec.startswith(_HF_PREFIX):
        raise CalibrationError(f"{spec!r}: a dataset source starts with {_HF_PREFIX!r}")
    rest = spec[len(_HF_PREFIX) :]
    field_name: str | None = None
    split = "train"
    if "#" in rest:
        rest, field_name = rest.split("#", 1)
        if not field_name:
            raise CalibrationError(f"{spec!r}: empty field after '#'")
    if "@" in rest:
        rest, split = rest.split("@", 1)
        if not split:
            raise CalibrationError(f"{spec!r}: empty split after '@'")
    name, _, config = rest.partition(":")
    if not name:
        raise CalibrationError(f"{spec!r}: expected hf:NAME[:CONFIG][@SPLIT][#FIELD]")
    if _ and not config:
        raise CalibrationError(f"{spec!r}: empty config after ':'")
    return HFSource(name=name, config=config or None, split=split, field=field_name)


def load_calibration(
    source: str | Path | Sequence[str | Path],
    tokenizer: Any,
    options: CalibOptions | None = None,
) -> CalibSet:
    """Read, tokenize and select the calibration samples of one or more sources (see the module doc).

    Each record is tokenized with ``tokenizer(text, add_special_tokens=False)``, ``tokenizer.bos_token_id``
    is prepended when ``options.bos`` and the tokenizer has one, and the result is cut to
    ``options.max_len``. Records are taken in source order (or shuffled), and samples are kept until
    ``options.max_samples`` are in hand. Raises ``CalibrationError`` on unreadable input or an empty result.
    """
    options = options or CalibOptions()
    options.validate()
    if isinstance(source, (str, Path)):
        sources: list[str | Path] = [source]
    else:
        sources = list(source)
        if not sources:
            raise CalibrationError("no calibration source given")

    records: list[_Record] = []
    for src in sources:
        records.extend(_read_source(src, tokenizer, options.field))
    if not records:
        raise CalibrationError(f"no records in {', '.join(str(s) for s in sources)}")
    if options.shuffle:
        random.Random(options.seed).shuffle(records)

    bos = getattr(tokenizer, "bos_token_id", None) if options.bos else None
    samples: list[CalibSample] = []
    seen = dropped = truncated = 0
    for rec in records:
        if options.max_samples is not None and len(samples) >= options.max_samples:
            break
        seen += 1
        ids = list(tokenizer(rec.text(), add_special_tokens=False)["input_ids"])
        if not ids:
            dropped += 1
            continue
        if bos is not None:
            ids.insert(0, int(bos))
        if len(ids) > options.max_len:
            ids = ids[: options.max_len]
            truncated += 1
        if len(ids) < options.min_len:
            dropped += 1
            continue
        samples.append(CalibSample(torch.tensor(ids, dtype=torch.int64), rec.source, rec.group))
    if not samples:
        raise CalibrationError(f"0 of {seen} samples have >= {options.min_len} tokens")
    return CalibSet(samples=samples, records=len(records), dropped=dropped, truncated=truncated)


# --------------------------------------------------------------------------------------------- sources


def _read_source(src: str | Path, tokenizer: Any, field_name: str | None) -> list[_Record]:
    if isinstance(src, str) and src.startswith(_HF_PREFIX):
        hf = parse_hf_source(src)
        return _read_dataset(hf, tokenizer, hf.field or field_name)
    path = Path(src)
    if not path.exists():
        raise CalibrationError(f"{path}: no such file or folder")
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path))),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise CalibrationError(f"{path}: folder holds no files")
        out: list[_Record] = []
        for p in files:
            out.extend(_read_file(p, str(path), tokenizer, field_name))
        return out
    return _read_file(path, str(path), tokenizer, field_name)


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _read_file(path: Path, group: str, tokenizer: Any, field_name: str | None) -> list[_Record]:
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        return _read_jsonl(path, group, tokenizer, field_name)
    if suffix in _TABLE_SUFFIXES:
        return _read_table(path, group, tokenizer, field_name)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CalibrationError(f"{path}: not UTF-8 text ({exc})") from exc
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    return [_Record(str(path), group, lambda: text)]


def json_objects(lines: Iterable[str], path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``("FILE:LINE", object)`` for each non-blank line of a JSON Lines file; a line that is not a JSON object
    raises ``CalibrationError`` naming the file and line."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            hint = " (expected one JSON object per line)" if lineno == 1 else ""
            raise CalibrationError(f"{where}: malformed JSON: {exc}{hint}") from exc
        if not isinstance(obj, dict):
            raise CalibrationError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield where, obj


def _read_jsonl(path: Path, group: str, tokenizer: Any, field_name: str | None) -> list[_Record]:
    out: list[_Record] = []
    try:
        with path.open(encoding="utf-8") as fh:
            for where, obj in json_objects(fh, path):
                text = record_text(obj, tokenizer, field_name, where)
                out.append(_Record(where, group, lambda t=text: t))
    except UnicodeDecodeError as exc:
        raise CalibrationError(f"{path}: not UTF-8 text ({exc})") from exc
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if not out:
        raise CalibrationError(f"{path}: no records (the file is empty or holds only blank lines)")
    return out


def _read_table(path: Path, group: str, tokenizer: Any, field_name: str | None) -> list[_Record]:
    builder = _TABLE_SUFFIXES[path.suffix.lower()]
    ds = _load_dataset(str(path), builder, None, "train", data_files=str(path))
    return _dataset_records(ds, str(path), group, tokenizer, field_name)


def _read_dataset(hf: HFSource, tokenizer: Any, field_name: str | None) -> list[_Record]:
    ds = _load_dataset(f"hf:{hf.name}", hf.name, hf.config, hf.split)
    return _dataset_records(ds, hf.label, hf.label, tokenizer, field_name)


def _load_dataset(what: str, name: str, config: str | None, split: str, **kwargs: Any) -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise CalibrationError(f"{what}: reading datasets needs the 'datasets' package") from exc
    try:
        return datasets.load_dataset(name, config, split=split, **kwargs)
    except Exception as exc:
        raise CalibrationError(f"{what}: cannot load dataset ({type(exc).__name__}: {exc})") from exc


def _dataset_records(ds: Any, label: str, group: str, tokenizer: Any, field_name: str | None) -> list[_Record]:
    n = len(ds)
    if n == 0:
        raise CalibrationError(f"{label}: no rows")
    if field_name is not None and field_name not in ds.column_names:
        raise CalibrationError(f"{label}: no column {field_name!r}; columns: {', '.join(ds.column_names)}")

    def text_of(i: int) -> str:
        where = f"{label}#{i}"
        return record_text(ds[i], tokenizer, field_name, where)

    return [_Record(f"{label}#{i}", group, lambda i=i: text_of(i)) for i in range(n)]


# --------------------------------------------------------------------------------------------- records


def record_text(record: dict[str, Any], tokenizer: Any, field_name: str | None, where: str) -> str:
    """The text of one record (see the module doc); ``where`` names it in errors."""
    if field_name is not None:
        if field_name not in record:
            raise CalibrationError(f"{where}: no field {field_name!r}; keys present: {_keys(record)}")
        return _value_text(record[field_name], field_name, tokenizer, where)
    for name in TEXT_FIELDS:
        if record.get(name) is not None:
            return _value_text(record[name], name, tokenizer, where, allow_messages=False)
    if record.get("prompt") is not None and record.get("answer") is not None:
        prompt = _value_text(record["prompt"], "prompt", tokenizer, where, allow_messages=False)
        answer = _value_text(record["answer"], "answer", tokenizer, where, allow_messages=False)
        return f"{prompt}\n{answer}"
    if record.get("messages") is not None:
        return _messages_text(record["messages"], tokenizer, where)
    raise CalibrationError(
        f"{where}: unknown field: the record has keys {_keys(record)}, none of "
        f"{', '.join(TEXT_FIELDS)}, prompt+answer, messages; name the text field with --field"
    )


def _keys(record: dict[str, Any]) -> str:
    return "[" + ", ".join(repr(k) for k in record) + "]"


def _value_text(value: Any, name: str, tokenizer: Any, where: str, allow_messages: bool = True) -> str:
    if isinstance(value, str):
        return value
    if allow_messages and isinstance(value, list):
        return _messages_text(value, tokenizer, where)
    raise CalibrationError(f"{where}: field {name!r} is {type(value).__name__}, expected a string")


def _messages_text(messages: Any, tokenizer: Any, where: str) -> str:
    if not isinstance(messages, list) or not messages:
        raise CalibrationError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise CalibrationError(f"{where}: messages[{i}] is not a {{role, content}} object")
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as exc:
            raise CalibrationError(f"{where}: the chat template failed ({type(exc).__name__}: {exc})") from exc
        if not isinstance(text, str):
            raise CalibrationError(f"{where}: the chat template gave {type(text).__name__}, expected a string")
        return text
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
