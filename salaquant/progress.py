"""Progress and tables on a terminal or in a log: live bars for a person, plain lines for a file or pipe.

A rich live display writes nothing until it stops when its console is not a terminal, and tables are cut to 80
columns there. `console` gives consoles that are wide when not a terminal; `EngineProgress` (the calibration
engine's layers and samples) and `Phases` (eval's and the demo's steps) print a plain line at each step and at
most every `LINE_SECONDS` in between instead of bars when stderr is not a terminal.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

LINE_SECONDS = 30.0  # plain progress: the longest silence between two lines
LOG_WIDTH = 200  # columns of a console that is not a terminal (tables are not squeezed to 80)


def console(stderr: bool = False) -> Console:
    """A console for command output: the terminal's width on a terminal, `LOG_WIDTH` columns otherwise."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=LOG_WIDTH)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _Lines:
    """Plain progress lines on stderr: each call to `line` prints when forced or when `LINE_SECONDS` passed."""

    def __init__(self, out: Console) -> None:
        self.out = out
        self.t0 = self.last = time.perf_counter()

    def line(self, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self.last >= LINE_SECONDS:
            self.last = now
            self.out.print(f"[{_clock(now - self.t0)}] {text}", markup=False, highlight=False, soft_wrap=True)


class EngineProgress:
    """Two bars (layers, samples of the current pass) on a terminal, plain lines otherwise; a no-op when
    disabled."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._lines: _Lines | None = None
        self._tokens = 0
        self._t0 = 0.0
        self._layers_total = self._samples_total = 0
        self._where = ""

    def start(self, layers: int, samples: int, tokens: int, done: int) -> None:
        if not self.enabled:
            return
        self._t0 = time.perf_counter()
        self._layers_total, self._samples_total = layers, samples
        out = Console(stderr=True)
        if not out.is_terminal:
            self._lines = _Lines(console(stderr=True))
            self._lines.line(f"calibration: {layers} layers ({done} done), {samples} samples, {tokens:,} tokens", True)
            return
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=out,
            transient=False,
        )
        self._progress.start()
        self._layers = self._progress.add_task("layers", total=layers, completed=done, rate="")
        self._samples = self._progress.add_task("samples", total=samples, rate="")

    def _rate(self) -> str:
        return f"{self._tokens / max(1e-9, time.perf_counter() - self._t0):,.0f} tok/s"

    def phase(self, index: int, kind: str, what: str) -> None:
        self._where = f"layer {index + 1}/{self._layers_total} ({kind}) {what}"
        if self._lines is not None:
            self._lines.line(self._where, force=True)
        if self._progress is None:
            return
        self._progress.update(self._layers, description=f"layer {index} {kind}")
        self._progress.reset(self._samples, description=f"  {what}", rate="")

    def sample_done(self, index: int, tokens: int) -> None:
        self._tokens += tokens
        if self._lines is not None:
            self._lines.line(f"{self._where}: sample {index + 1}/{self._samples_total}, {self._rate()}")
        if self._progress is None:
            return
        self._progress.update(self._samples, completed=index + 1, rate=self._rate())

    def layer_done(self, index: int) -> None:
        if self._lines is not None:
            self._lines.line(f"layer {index + 1}/{self._layers_total} done, {self._rate()}", force=True)
        if self._progress is not None:
            self._progress.update(self._layers, completed=index + 1)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self._lines = None


class Phases:
    """One bar per phase (or plain lines off a terminal) on stderr; nothing when disabled. ``phase(name, total)``
    yields the step function to call once per finished item."""

    def __init__(self, enabled: bool) -> None:
        out = Console(stderr=True)
        self._lines = _Lines(console(stderr=True)) if enabled and not out.is_terminal else None
        self.progress = (
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=out,
            )
            if enabled and out.is_terminal
            else None
        )

    @contextlib.contextmanager
    def phase(self, description: str, total: int) -> Iterator[Callable[..., None]]:
        if self._lines is not None:
            lines = self._lines
            lines.line(f"{description}: 0/{total}", force=True)
            done = [0]

            def step(*_: object) -> None:
                done[0] += 1
                lines.line(f"{description}: {done[0]}/{total}", force=done[0] == total)

            yield step
            return
        if self.progress is None:
            yield lambda *_: None
            return
        progress = self.progress
        task = progress.add_task(description, total=total)
        yield lambda *_: progress.advance(task)

    def __enter__(self) -> Phases:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
