"""BackgroundWriter: jobs run in order off the calling thread, failures reach the caller."""

from __future__ import annotations

import threading
import time

import pytest

from salaquant.io.background import BackgroundWriter


def test_jobs_run_in_order_on_another_thread() -> None:
    seen: list[tuple[int, str]] = []
    writer = BackgroundWriter()
    for i in range(5):
        # Early jobs sleep longest: a pool with more than one worker, or no ordering, would reorder them.
        writer.submit(lambda i=i: (time.sleep(0.02 * (5 - i)), seen.append((i, threading.current_thread().name))))
    writer.close()
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert all(name != threading.current_thread().name for _, name in seen)


def test_failure_is_raised_by_drain_and_close() -> None:
    writer = BackgroundWriter()

    def fail() -> None:
        raise OSError("disk full")

    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.drain()
    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.close()


def test_disabled_runs_inline() -> None:
    seen: list[str] = []
    writer = BackgroundWriter(enabled=False)
    writer.submit(lambda: seen.append(threading.current_thread().name))
    assert seen == [threading.current_thread().name]
    writer.close()


def test_a_failure_stops_the_jobs_behind_it_until_drained() -> None:
    """Jobs queued behind a failed one do not run (a state file must not record a write that failed); ``wait`` on
    a later job and ``drain`` raise the first failure; after the drain new jobs run."""
    seen: list[str] = []
    writer = BackgroundWriter()

    def fail() -> None:
        time.sleep(0.05)  # the jobs behind it are queued before it fails
        raise OSError("disk full")

    writer.submit(seen.append, "before")
    writer.submit(fail)
    later = writer.submit(seen.append, "after")
    with pytest.raises(OSError, match="disk full"):
        writer.wait(later)
    with pytest.raises(OSError, match="disk full"):
        writer.drain()
    assert seen == ["before"]
    writer.wait(writer.submit(seen.append, "next batch"))
    writer.close()
    assert seen == ["before", "next batch"]
