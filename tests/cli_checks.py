"""The command line as the bad-input tests drive it: one ``CliRunner``, a small CPU calibration, and the one
``error:`` line a refusal must print."""

from __future__ import annotations

from typer.testing import CliRunner, Result

from salaquant.cli import app

SMALL = ["--max-samples", "2", "--max-len", "64", "--device", "cpu"]
"""Calibration flags that keep a run on the tiny model to seconds on a CPU."""
runner = CliRunner()


def cli(*args: str) -> Result:
    """``salaquant ARGS`` in this process, its output captured."""
    return runner.invoke(app, list(args))


def one_error_line(res: Result) -> str:
    """The refusal: exactly one ``error:`` line, no traceback; returns that line."""
    assert "Traceback" not in res.output, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    return errors[0]


def text(res: Result) -> str:
    """The output with every run of whitespace made one space (a message the console wrapped reads whole)."""
    return " ".join(res.output.split())
