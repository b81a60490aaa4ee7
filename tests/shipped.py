"""The repository's shipped files the tests read: the tiny model and its calibration and held-out text."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "sala-tiny"
"""The shipped tiny model: trained weights, the tokenizer and held-out text."""
CALIB_FILE = ROOT / "calib" / "sala-tiny-calib.jsonl"
"""The shipped calibration sample (sala-tiny's tokenizer)."""
CALIB = str(CALIB_FILE)
"""``CALIB_FILE`` as the command line takes it."""
HELDOUT = str(SHIPPED / "heldout.jsonl")
"""The shipped model's held-out text, as the command line takes it."""
