"""Files written whole or not at all: into ``NAME.tmp``, then renamed over ``NAME``."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Give an ``OSError`` raised while writing ``path`` that path when it names none: a ``write`` that fails on a
    full disk reports only "No space left on device", and the message must say which file (and so which disk)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` into ``path.tmp``, then rename over ``path``; a failed write (a full disk) leaves no ``.tmp``."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with naming(tmp):
            write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def atomic_json(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2)))
