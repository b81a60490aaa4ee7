"""A second process holding a run's work-folder lock, as a concurrent salaquant run holds it (an exclusive flock
on ``lock`` with its process id written in), for the tests of what a refused run says and leaves."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "os.write(fd, str(os.getpid()).encode())\n"
    "print('locked', flush=True)\n"
    "time.sleep(60)\n"
)


@contextmanager
def lock_held(work: Path) -> Iterator[subprocess.Popen]:
    """The process holding ``work / "lock"`` from entry (once it says so) until exit, when it is killed."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(work / "lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()
