"""Which folders salaquant wrote: the one rule behind every output it replaces or removes.

salaquant never deletes a file it did not write (as ``save_pretrained`` never does). An existing folder is
salaquant's when

1. it holds the marker of a kind of folder salaquant writes: a file only salaquant writes, with the content
   salaquant gives it; and
2. every entry in it, sub-folders included, is one that kind writes.

Names alone prove nothing: an export holds what any Hugging Face checkpoint holds (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``README.md``, remote-code ``*.py``), so a user's checkpoint or project
folder would pass for one; the marker says whose folder it is. The marker alone is not enough either: notes or a
sub-folder a user put into an export later are not salaquant's, and stay where they are. A folder with no marker,
or with any entry its kind does not write, is refused, named by a few of those entries (`Verdict.foreign`).

The kinds, each built from its writers' own names:

* checkpoint (``gptq``, ``nvfp4`` and ``run`` exports, their ``OUT.check-failed`` / ``OUT.gate-failed``, a ``tiny``
  random checkpoint): marker ``salaquant_settings.json`` (a JSON object with ``method``); the weights, shards and
  index `CheckpointWriter` writes, ``config.json``, the serving files `CheckpointWriter.copy_aux` copies
  (`SERVING_FILES`), the files of `salaquant.export.EXPORT_FILES` and an eval report (``eval --report`` into the
  export);
* statistics (``calibrate``): marker ``calibration.json`` (with ``engine``), the layer files and the log;
* eval report (``eval --report``): marker ``eval.json`` (with ``salaquant``) and ``eval.png``;
* demo (``demo``): marker ``demo.json`` (with ``rows``; the demo writes it first), its export folders (each a
  checkpoint by its own marker), their work folders and the hidden folders of an export being written or replaced;
* work folder (``OUT.work``): marker ``lock`` (a process id, the first file a run writes there), the run's state,
  logs, layer files, hidden states and budget choice.

Names are compared in lower case, as `CheckpointWriter.copy_aux` compares them, and ``NAME.tmp`` (a file being
written by `salaquant.io.atomic`) counts as ``NAME``. Symbolic links are never salaquant's.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

CHECKPOINT = "checkpoint"
STATISTICS = "statistics folder"
EVAL_REPORT = "eval report folder"
DEMO = "demo folder"
WORK = "work folder"

_MAX_MARKER_BYTES = 64 * 2**20  # a marker is a small JSON file: a larger file of that name is not one


@dataclass(frozen=True)
class Kind:
    """A kind of folder salaquant writes: what messages call it, its marker and what it holds."""

    name: str
    marker: str  # a file name; "" for a sub-folder vouched for by its parent's marker
    proves: Callable[[Path], bool]  # the marker's content is salaquant's
    files: tuple[str, ...]  # lower-case shell patterns of the files it holds
    folders: tuple[tuple[str, Kind], ...] = field(default=())  # sub-folder patterns and what each holds


@dataclass(frozen=True)
class Verdict:
    """What an existing folder is: ``kind`` is the kind of salaquant folder it is (None when it is missing, empty
    or holds no marker); ``foreign`` its entries salaquant did not write (paths relative to it, folders ending in
    ``/``), all of them when there is no marker. Only a folder with no foreign entry may be replaced."""

    kind: Kind | None
    foreign: tuple[str, ...]

    def few(self) -> str:
        """A few foreign entries, for a message."""
        more = len(self.foreign) - 4
        return ", ".join(self.foreign[:4]) + (f" and {more} more" if more > 0 else "")


def _json_with(key: str) -> Callable[[Path], bool]:
    def proves(path: Path) -> bool:
        try:
            if path.stat().st_size > _MAX_MARKER_BYTES:
                return False
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        return isinstance(obj, dict) and key in obj

    return proves


def _process_id(path: Path) -> bool:
    try:
        text = path.read_bytes()[:33]
    except OSError:
        return False
    return len(text) <= 32 and (not text.strip() or text.strip().isdigit())


def _anything(_path: Path) -> bool:
    return True


@functools.cache
def kinds() -> tuple[Kind, ...]:
    """Every kind of folder salaquant writes (the module doc). The writers' names are imported here, on first use:
    the writers themselves import the modules that call this one."""
    from .calibration.command import LAYERS_DIR, LOG_NAME, STATISTICS_NAME
    from .demo import FOLDERS, MARKER
    from .eval.report import JSON_NAME, PNG_NAME
    from .export import EXPORT_FILES
    from .io.files import CONFIG_NAME, INDEX_NAME, SERVING_FILES, SETTINGS_NAME, SHARD_NAME, SINGLE_FILE_NAME

    shards = re.sub(r"\{[^}]*\}", "*", SHARD_NAME)
    report = (JSON_NAME, PNG_NAME)
    exported = (CONFIG_NAME, SINGLE_FILE_NAME, INDEX_NAME, shards, *SERVING_FILES, *EXPORT_FILES, *report)
    checkpoint = Kind(CHECKPOINT, SETTINGS_NAME, _json_with("method"), _lower(exported))
    # a CheckpointWriter's temporary folder (.NAME.tmp-PID-*) holds shards under a temporary name until they are
    # complete; a replaced folder waits as .NAME.old-PID-* until the new one is in place (io/staging.py)
    staging = Kind("staging folder", "", _anything, _lower((*exported, "shard-*.safetensors.part")))
    # the engine's files: one .safetensors and one .json per layer, hidden states per leaf of samples (engine.py)
    layers = Kind("layer files", "", _anything, ("*.safetensors", "*.json"))
    hidden = Kind("hidden states", "", _anything, ("*.safetensors",))
    # the lock (work_folder.py), the resume state and logs (engine.py), the budget choice (budget/search.py)
    work = Kind(
        WORK,
        "lock",
        _process_id,
        ("lock", "state.json", "log.txt", "log-rank*.txt", "budget.json"),
        (("layers", layers), ("hidden", hidden)),
    )
    statistics = Kind(
        STATISTICS, STATISTICS_NAME, _json_with("engine"), _lower((STATISTICS_NAME, LOG_NAME)), ((LAYERS_DIR, layers),)
    )
    eval_report = Kind(EVAL_REPORT, JSON_NAME, _json_with("salaquant"), _lower(report))
    demo_folders: list[tuple[str, Kind]] = []
    for name in FOLDERS:
        demo_folders += [
            (name, checkpoint),
            (f"{name}.work", work),
            (f".{name}.tmp-*", staging),
            (f".{name}.old-*", checkpoint),
        ]
    demo = Kind(DEMO, MARKER, _json_with("rows"), _lower((MARKER,)), tuple(demo_folders))
    return checkpoint, statistics, eval_report, demo, work


def _lower(patterns: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.lower() for p in patterns))


def _holds(patterns: tuple[str, ...], name: str) -> bool:
    low = name.lower().removesuffix(".tmp")
    return any(fnmatchcase(low, p) for p in patterns)


def _proven(folder: Path, kind: Kind) -> bool:
    marker = folder / kind.marker
    return marker.is_file() and not marker.is_symlink() and kind.proves(marker)


def _foreign(folder: Path, kind: Kind, prefix: str) -> list[str]:
    """The entries of ``folder`` that ``kind`` does not write (recursively, named from the judged folder)."""
    found: list[str] = []
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        name = entry.name
        if entry.is_symlink():
            found.append(prefix + name)
        elif entry.is_dir():
            sub = next((k for pattern, k in kind.folders if fnmatchcase(name.lower(), pattern.lower())), None)
            if sub is None or (sub.marker and not _proven(entry, sub) and any(entry.iterdir())):
                found.append(f"{prefix}{name}/")
            elif not sub.marker or _proven(entry, sub):
                found += _foreign(entry, sub, f"{prefix}{name}/")
        elif not (entry.is_file() and _holds(kind.files, name)):
            found.append(prefix + name)
    return found


def judge(folder: Path) -> Verdict:
    """The `Verdict` on ``folder``: a missing or empty folder is nobody's and may be written; an existing file or
    link to one is foreign; a folder is the kind whose marker it holds with the fewest foreign entries (an export
    holding an eval report is an export), or foreign as a whole when it holds no marker."""
    if not folder.exists() and not folder.is_symlink():
        return Verdict(None, ())
    if not folder.is_dir():
        return Verdict(None, (folder.name,))
    entries = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in folder.iterdir())
    if not entries:
        return Verdict(None, ())
    verdicts = [Verdict(k, tuple(_foreign(folder, k, ""))) for k in kinds() if _proven(folder, k)]
    if not verdicts:
        return Verdict(None, tuple(entries))
    return min(verdicts, key=lambda v: len(v.foreign))
