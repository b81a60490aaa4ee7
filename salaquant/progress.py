"""Progress display for the calibration engine: layer i/N, sample j/M, tokens/s, ETA."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class EngineProgress:
    """Two bars (layers, samples of the current pass) on stderr; a no-op when disabled."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._tokens = 0
        self._t0 = 0.0

    def start(self, layers: int, samples: int, tokens: int, done: int) -> None:
        if not self.enabled:
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
        self._t0 = time.perf_counter()

    def phase(self, index: int, kind: str, what: str) -> None:
        if self._progress is None:
            return
        self._progress.update(self._layers, description=f"layer {index} {kind}")
        self._progress.reset(self._samples, description=f"  {what}", rate="")

    def sample_done(self, index: int, tokens: int) -> None:
        if self._progress is None:
            return
        self._tokens += tokens
        rate = self._tokens / max(1e-9, time.perf_counter() - self._t0)
        self._progress.update(self._samples, completed=index + 1, rate=f"{rate:,.0f} tok/s")

    def layer_done(self, index: int) -> None:
        if self._progress is not None:
            self._progress.update(self._layers, completed=index + 1)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
