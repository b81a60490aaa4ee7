"""An ordered background writer: file writes overlap the next GPU work, one batch at a time."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundWriter:
    """Runs jobs on one worker thread in submission order (or inline when ``enabled`` is false).

    A failed job stops the jobs queued behind it (a state file must not record files that were never written):
    they end without running. ``drain()`` waits for every submitted job and re-raises the first failure, after
    which new jobs run again; ``wait(job)`` waits for one job and the ones before it, and re-raises the first
    failure among them. A caller that drains before each batch of submissions never loses an error.
    """

    def __init__(self, enabled: bool = True) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="salaquant-writer") if enabled else None
        self._pending: deque[Future[Any]] = deque()
        self._failure: BaseException | None = None  # the first failure since the last drain (set by the worker)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any] | None:
        """Queue ``fn(*args)``; its future, which ``wait`` takes (None when it ran inline)."""
        if self._pool is None:
            fn(*args)
            return None
        future = self._pool.submit(self._run, fn, args)
        self._pending.append(future)
        return future

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if self._failure is not None:
            raise _Skipped
        try:
            return fn(*args)
        except BaseException as e:
            self._failure = e
            raise

    def wait(self, future: Future[Any] | None) -> None:
        """Wait for one submitted job (and so for every job before it: one worker, in order); re-raises the
        first failure. ``drain`` still waits for the rest."""
        if future is None:
            return
        try:
            future.result()
        except BaseException as e:
            raise self._failure or e from None
        while self._pending:  # it and every job before it ended well: nothing left for drain to report
            if self._pending.popleft() is future:
                break

    def drain(self) -> None:
        """Wait for every submitted job; re-raise the first failure (the jobs behind it did not run)."""
        first: BaseException | None = None  # jobs before it succeeded, jobs behind it were skipped
        while self._pending:
            try:
                self._pending.popleft().result()
            except BaseException as e:
                first = first or e
        self._failure = None  # every job has ended, so the worker is idle: the next batch starts afresh
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for everything, then stop the worker (also when a job failed)."""
        try:
            self.drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


class _Skipped(Exception):
    """A job that did not run because one before it failed."""
