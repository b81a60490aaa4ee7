"""Blocks of flags that several commands take alike, declared once.

A command names a block by one keyword-only parameter (``calibration: Flags``); ``with_blocks`` puts the block's
flags in that parameter's place in the signature typer reads, so that ``--help`` lists them where the parameter
stands, and calls the command with the block's values gathered in one dict under the parameter's name.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

Flags = dict[str, Any]
"""What a command receives for a block: each flag's value by its parameter name."""

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class FlagBlock:
    """Flags as typer parameters: ``(name, Annotated[type, typer.Option(...)], default)`` each."""

    flags: tuple[tuple[str, Any, Any], ...]

    def parameters(self) -> list[inspect.Parameter]:
        kind = inspect.Parameter.KEYWORD_ONLY
        return [inspect.Parameter(n, kind, default=d, annotation=a) for n, a, d in self.flags]


def with_blocks(**blocks: FlagBlock) -> Callable[[F], F]:
    """Expand each ``name=block`` into the command's parameter ``name`` (see the module's docstring)."""

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        missing = set(blocks) - set(signature.parameters)
        if missing:
            raise TypeError(f"{command.__name__} has no parameter {sorted(missing)[0]!r} for its block")
        params: list[inspect.Parameter] = []
        for p in signature.parameters.values():
            params.extend(blocks[p.name].parameters() if p.name in blocks else [p])

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            for name, block in blocks.items():
                kwargs[name] = {flag: kwargs.pop(flag) for flag, _, _ in block.flags}
            return command(**kwargs)

        wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper  # type: ignore[return-value]

    return decorate
