"""The ``salaquant`` application: its root options (``--version``, progress lines), the error and interrupt exits
every command shares, and ``main``. The commands register on `app` from their modules (``salaquant.cli``)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from .. import __version__
from ..progress import console as make_console

app = typer.Typer(
    name="salaquant",
    help="Post-training quantization for MiniCPM-SALA: GPTQ W4A16 and NVFP4 for vLLM/SGLang.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = make_console()
err = make_console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    err.print("[bold red]error:[/] ", end="", highlight=False, markup=True)
    err.print(message, highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(code)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        console.print(f"salaquant {__version__}")
        raise typer.Exit(0)
    _progress_lines(ctx)
    if ctx.invoked_subcommand is not None:
        from ..cpu_gemm import bf16_linears_in_fp32

        ctx.with_resource(bf16_linears_in_fp32())


def _progress_lines(ctx: typer.Context) -> None:
    """Plain progress lines for the whole command when stderr is not a terminal (the heartbeat covers every long
    step, loading and exporting too), on rank 0 only under torchrun; a bad interval setting is refused first."""
    from .. import progress

    try:
        progress.line_seconds()
    except ValueError as exc:
        fail(str(exc))
    if ctx.invoked_subcommand is not None and os.environ.get("RANK", "0") == "0":
        ctx.with_resource(progress.plain_lines(f"salaquant {ctx.invoked_subcommand}: started"))


def interrupted(exc: KeyboardInterrupt) -> None:
    """Ctrl-C inside a run: say what was kept and how to resume (the run's message), exit 130."""
    err.print(str(exc) or "interrupted", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(130)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
