"""What a work folder records of its run (model, data, statistics tree, salaquant version, settings) and, when a
resume meets other inputs, what differs, by name and setting."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..io.reader import CheckpointReader


def model_fingerprint(reader: CheckpointReader) -> str:
    """Config, tensor names/shapes/dtypes and shard sizes. The weights' content is covered separately: each
    tensor's digest is recorded as the run reads it (``state.json``) and compared when a run resumes."""
    h = hashlib.sha256(json.dumps(reader.config(), sort_keys=True).encode())
    for name in reader:
        h.update(f"{name}:{tuple(reader.shape(name))}:{reader.dtype(name)}".encode())
    for shard in reader.shard_files():
        h.update(f"{shard}:{(reader.path / shard).stat().st_size}".encode())
    return h.hexdigest()


_INPUT_NAMES = {
    "model": "another model (config.json, tensor names, shapes, dtypes or shard sizes)",
    "data": "other calibration data (tokens)",
    "leaves": "another statistics tree",
    "salaquant": "another salaquant version",
}


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key in sorted(value) for k, v in _flat(value[key], f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value}


def differences(recorded: Any, current: dict[str, Any], shown: int = 4) -> str:
    """What differs between the inputs a work folder recorded and this run's: the inputs by name, settings key by
    key (``gptq.damp 0.01, now 0.05``); a generic phrase for a folder that recorded none."""
    if not isinstance(recorded, dict):
        return "another model, calibration set, settings or salaquant version"
    parts: list[str] = []
    for name in ("model", "data", "leaves", "salaquant"):
        if recorded.get(name) != current[name]:
            was = f" ({recorded.get(name)}, now {current[name]})" if name == "salaquant" else ""
            parts.append(_INPUT_NAMES[name] + was)
    old = {**_flat(recorded.get("engine", {}), "engine."), **_flat(recorded.get("settings", {}), "")}
    new = {**_flat(current["engine"], "engine."), **_flat(current["settings"], "")}
    keys = [k for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
    changed = [f"{k} {json.dumps(old.get(k))}, now {json.dumps(new.get(k))}" for k in keys[:shown]]
    if len(keys) > shown:
        changed.append(f"{len(keys) - shown} more")
    if changed:
        parts.append("other settings (" + "; ".join(changed) + ")")
    return ", ".join(parts) or "other inputs"
