"""What a format checker returns or raises: the report of a passing export and the error listing every problem."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class CheckError(ValueError):
    """The checkpoint would not load (or not load as intended); ``errors`` lists every problem."""

    def __init__(self, message: str, errors: list[str] | None = None) -> None:
        super().__init__(message)
        self.errors = list(errors) if errors is not None else [message]


@dataclass
class CheckReport:
    """What a passing checkpoint holds: its format, quantized and plain linears, and warnings."""

    format: str
    quantized: list[str] = field(default_factory=list)
    unquantized: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    serving: list[str] = field(default_factory=list)  # how SGLang serves it and on which GPUs

    def plain_summary(self) -> str:
        """``"7 kept in 16 bits (lm_head and 6 decoder linears)"``: lm_head, which no export quantizes (no engine
        serves SALA with a quantized one), counted apart from the decoder linears a plan or an exclusion kept."""
        decoder = sum(m != "lm_head" for m in self.unquantized)
        parts = ["lm_head"] if "lm_head" in self.unquantized else []
        if decoder:
            parts.append(f"{decoder} decoder linear{'s' if decoder != 1 else ''}")
        return f"{len(self.unquantized)} kept in 16 bits" + (f" ({' and '.join(parts)})" if parts else "")

    def print_to(self, console: Any) -> None:
        """Print the serving lines and the warnings on a rich ``Console``."""
        for line in self.serving:
            console.print(line, markup=False, highlight=False)
        for w in self.warnings:
            console.print(f"[yellow]warning:[/] {w}")


def fail(errors: list[str], where: str) -> None:
    """Raise `CheckError` listing ``errors`` (found in ``where``) when there are any."""
    if errors:
        lines = "\n".join(f"  - {e}" for e in errors)
        raise CheckError(f"{len(errors)} problem(s) in {where}:\n{lines}", errors)
