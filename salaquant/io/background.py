"""An ordered background writer: file writes overlap the next GPU work, one batch at a time."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundWriter:
    """Runs jobs on one worker thread in submission order (or inline when ``enabled`` is false).

    ``drain()`` waits for every submitted job and re-raises the first failure, so a caller that drains before each
    submission keeps at most one job in flight and never loses an error.
    """

    def __init__(self, enabled: bool = True) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="salaquant-writer") if enabled else None
        self._pending: deque[Future[Any]] = deque()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._pool is None:
            fn(*args)
        else:
            self._pending.append(self._pool.submit(fn, *args))

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        """Wait for everything, then stop the worker (also when a job failed)."""
        try:
            self.drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
