"""Files written whole or not at all: into ``NAME.tmp``, then renamed over ``NAME``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` into ``path.tmp``, then rename over ``path``; a failed write (a full disk) leaves no ``.tmp``."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def atomic_json(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2)))
