"""Where a benchmark's JSON goes: ``--out`` names a folder (the benchmark's own file name inside it) or a file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_results(out: Path, default_name: str, payload: object, indent: int | None = 2) -> Path:
    """Write ``payload`` as JSON to ``out`` (a ``.json`` path) or to ``out / default_name``; returns the path."""
    path = out if out.suffix == ".json" else out / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent))
    print(f"wrote {path}")
    return path


def shape_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark at a model preset's shape: ``--out``, ``--preset`` (default ``full``, the
    published shape) and ``--device``; the description is the first paragraph of ``doc``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--device", default="cuda")
    return ap
