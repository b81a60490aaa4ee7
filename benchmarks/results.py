"""Where a benchmark's JSON goes: ``--out`` names a folder (the benchmark's own file name inside it) or a file."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out: Path, default_name: str, payload: object, indent: int | None = 2) -> Path:
    """Write ``payload`` as JSON to ``out`` (a ``.json`` path) or to ``out / default_name``; returns the path."""
    path = out if out.suffix == ".json" else out / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent))
    print(f"wrote {path}")
    return path
