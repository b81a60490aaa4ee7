"""Progress and tables on a terminal or in a log: live bars for a person, plain lines for a file or pipe.

A rich live display writes nothing until it stops when its console is not a terminal, and tables are cut to 80
columns there. `console` gives consoles that are wide when not a terminal; `EngineProgress` (the calibration
engine's layers and samples) and `Phases` (eval's, the demo's and the budget search's steps) draw bars on a
terminal and print plain lines on stderr otherwise.

Plain lines come from one `Lines` per process (`plain_lines`; the command line starts it for the whole command):
a line at each step, and a heartbeat thread that prints the current step again, with what runs inside it
(`detail`: a prefill, a decoded token count), whenever `interval` seconds pass without a line. A step that
takes minutes (one forward of a long sample, a solve, a NIAH prefill, a long generation) therefore still shows
a line at least every ``interval`` seconds. The lines go to stderr only: a command's stdout (generated text, JSON
lines) holds its output alone.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

LINE_SECONDS = 30.0  # plain progress: the longest silence between two lines (default of INTERVAL_VARIABLE)
INTERVAL_VARIABLE = "SALAQUANT_PROGRESS_SECONDS"
LOG_WIDTH = 200  # columns of a console that is not a terminal (tables are not squeezed to 80)

Text = str | Callable[[], str]  # a callable is read when the line is printed (a live count costs nothing until then)


def console(stderr: bool = False) -> Console:
    """A console for command output: the terminal's width on a terminal, `LOG_WIDTH` columns otherwise."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=LOG_WIDTH)


def line_seconds() -> float:
    """The longest silence between two plain progress lines: ``SALAQUANT_PROGRESS_SECONDS`` (seconds above 0),
    `LINE_SECONDS` when unset; a ValueError naming the variable otherwise."""
    text = os.environ.get(INTERVAL_VARIABLE, "").strip()
    if not text:
        return LINE_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"{INTERVAL_VARIABLE}={text!r}: expected a number of seconds above 0 (unset: {LINE_SECONDS:g})"
        )
    return seconds


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _read(text: Text | None) -> str:
    return "" if text is None else text() if callable(text) else text


class Lines:
    """Plain progress lines on stderr, never more than ``interval`` seconds apart while open.

    ``line(text, force=True)`` prints a step at once; ``line(text)`` makes ``text`` the current step without a line
    of its own; ``detail`` adds what runs inside the step. A daemon thread prints the current step (and detail)
    when ``interval`` passes without a line, marked "still running" when nothing changed since the last line.
    """

    def __init__(self, out: Console, interval: float) -> None:
        self.out = out
        self.interval = interval
        self.t0 = self.last = time.perf_counter()
        self._text: Text = ""
        self._detail: Text | None = None
        self._printed = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="salaquant-progress", daemon=True)
        self._beat.start()

    def line(self, text: Text, force: bool = False) -> None:
        with self._lock:
            self._text, self._detail = text, None
            if force:
                self._print()

    def detail(self, text: Text | None) -> None:
        with self._lock:
            self._detail = text

    def _print(self) -> None:
        """One line now (the caller holds the lock)."""
        now = time.perf_counter()
        text = "; ".join(t for t in (_read(self._text), _read(self._detail)) if t) or "working"
        shown = f"{text}, still running" if text == self._printed else text
        self.last, self._printed = now, text
        self.out.print(f"[{_clock(now - self.t0)}] {shown}", markup=False, highlight=False, soft_wrap=True)

    def _heartbeat(self) -> None:
        wait = self.interval
        while not self._stop.wait(wait):
            with self._lock:
                if self._stop.is_set():
                    return
                if time.perf_counter() - self.last >= self.interval:
                    self._print()
                wait = max(0.0, self.last + self.interval - time.perf_counter())

    def close(self) -> None:
        self._stop.set()
        self._beat.join()


_active: Lines | None = None


@contextlib.contextmanager
def plain_lines(text: Text = "") -> Iterator[Lines | None]:
    """The process's `Lines` when stderr is not a terminal (None on a terminal): the one already open, or a new one
    (starting at ``text``) closed on leaving. Commands open one for their whole run, so every step of every part
    (and the time between them: loading, exporting) shares one clock and one heartbeat."""
    global _active
    if _active is not None:
        yield _active
        return
    out = console(stderr=True)
    if out.is_terminal:
        yield None
        return
    _active = Lines(out, line_seconds())
    _active.line(text)
    try:
        yield _active
    finally:
        _active.close()
        _active = None


def detail(text: Text | None) -> None:
    """What runs inside the current step (a callable is read only when a line is printed); None clears it. Nothing
    happens when no plain lines are open (a terminal, a library call without progress)."""
    lines = _active
    if lines is not None:
        lines.detail(text)


class EngineProgress:
    """Two bars (layers, samples of the current pass) on a terminal, plain lines otherwise. Disabled, it shows
    nothing of its own and names the layer and pass as the `detail` of an enclosing step's lines, if any."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._lines: Lines | None = None
        self._stack = contextlib.ExitStack()
        self._tokens = 0
        self._t0 = 0.0
        self._layers_total = self._samples_total = 0
        self._where = ""

    def start(self, layers: int, samples: int, tokens: int, done: int) -> None:
        self._t0 = time.perf_counter()
        self._layers_total, self._samples_total = layers, samples
        if not self.enabled:
            return
        self._lines = self._stack.enter_context(plain_lines())
        if self._lines is not None:
            self._lines.line(f"calibration: {layers} layers ({done} done), {samples} samples, {tokens:,} tokens", True)
            return
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._progress.start()
        self._layers = self._progress.add_task("layers", total=layers, completed=done, rate="")
        self._samples = self._progress.add_task("samples", total=samples, rate="")

    def _rate(self) -> str:
        return f"{self._tokens / max(1e-9, time.perf_counter() - self._t0):,.0f} tok/s"

    def phase(self, index: int, kind: str, what: str) -> None:
        self._where = f"layer {index + 1}/{self._layers_total} ({kind}) {what}"
        if not self.enabled:  # shown by an enclosing step's lines, if any (the demo's quantize step)
            detail(self._where)
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

    def layer_done(self, index: int, note: str = "") -> None:
        """Layer ``index`` finished; ``note`` (e.g. that it is a resume point) ends its plain line."""
        if self._lines is not None:
            self._lines.line(f"layer {index + 1}/{self._layers_total} done, {self._rate()}{note}", force=True)
        if self._progress is not None:
            self._progress.update(self._layers, completed=index + 1)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._lines is not None:  # what a heartbeat names while the command goes on (export, checks)
            self._lines.line(f"calibration ended ({self._layers_total} layers)")
        self._lines = None
        self._stack.close()
        if not self.enabled:
            detail(None)


class Phases:
    """One bar per phase (or plain lines off a terminal) on stderr; nothing when disabled. ``phase(name, total)``
    yields the step function to call once per finished item."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._stack = contextlib.ExitStack()
        self._lines: Lines | None = None
        self.progress: Progress | None = None

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
        if self.enabled:
            self._lines = self._stack.enter_context(plain_lines())
            if self._lines is None:
                self.progress = Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    TimeRemainingColumn(),
                    console=Console(stderr=True),
                )
                self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        self._lines = None
        self._stack.close()
