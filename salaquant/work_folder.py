"""The work folder of a run: one run at a time (a lock), and what is kept when a run stops early.

`guarded_run` wraps a whole command (calibration, export, removal of the work folder). It takes an exclusive
lock on ``WORK/lock`` (a second run of the same output is refused, naming the first one's pid), discards an
unfinished work folder when the user asked to start over (``--overwrite`` without ``--resume``), and when the
run stops early says what was kept: a work folder holding no finished layer is removed; one holding finished
layers is kept, and the message says how to continue from it or start over. Ctrl-C becomes `RunInterrupted`
carrying that message. Two errors are passed on as they are, each message saying itself what became of the
work: a `ResumeError` (the work folder is an earlier run's, left as it was) and an `ExportRejected` (the export
failed a check and was kept beside the output; the work folder is removed, as a rerun would write the same).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .calibration.distributed import SINGLE, Ranks, barrier
from .outputs import ExportRejected, OutputError, in_use_message


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message says what was kept and how to resume."""


class ResumeError(RuntimeError):
    """A work folder that cannot be resumed (different model, data or settings)."""


def finished_layers(work: Path) -> tuple[int, int | None]:
    """(finished layers, layers) recorded in ``work/state.json``; (0, None) when there is none."""
    try:
        state = json.loads((work / "state.json").read_text())
        return int(state.get("finished", 0)), state.get("num_layers")
    except (OSError, ValueError):
        return 0, None


@contextlib.contextmanager
def _lock(work: Path) -> Iterator[None]:
    work.mkdir(parents=True, exist_ok=True)
    path = work / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise OutputError(in_use_message(work, holder)) from None
        if not path.exists() or os.stat(path).st_ino != os.fstat(fd).st_ino:
            raise OutputError(f"{work} was removed by another run while this one started: run the command again")
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def _resume_every(work: Path) -> int:
    """Layers between the resume points of the run in ``work`` (``state.json``; 1 when it does not say)."""
    try:
        return int(json.loads((work / "state.json").read_text()).get("resume_every", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def _kept(work: Path, interrupted: bool = False) -> str:
    """What remains of a run that stopped early, and the work folder removed when nothing is worth keeping. A run
    resumes from its last resume point (`resume_every`): the message names the layer it continues from, and says
    when layers finished after that point will be computed again. After Ctrl-C the same command resumes; after an
    error only once its cause is fixed (the same command would meet it again), and only with the same inputs (the
    fingerprint refuses others)."""
    done, total = finished_layers(work)
    every = _resume_every(work)
    cadence = f"the hidden states are saved after every {every} layers on this device"
    if done == 0:
        shutil.rmtree(work, ignore_errors=True)
        why = f": {cadence}, and no such point was reached" if every > 1 else ""
        return f"nothing was kept ({work} removed){why}"
    if total is not None and done >= total:
        kept, resumes = f"all {total} calibrated layers are kept in {work}", "export without calibrating again"
        again = ""
    else:
        layers = "layer 1" if done == 1 else f"layers 1-{done}"
        kept, resumes = f"{layers} of {total} are kept in {work}", f"continue from layer {done + 1}"
        again = f" ({cadence}: any layer finished after layer {done} is computed again)" if every > 1 else ""
    if interrupted:
        return f"{kept}: rerun the same command with --resume to {resumes}, or with --overwrite to start over{again}"
    return (
        f"{kept}: once the cause is fixed, rerun with --resume to {resumes} (the same model, calibration data and "
        f"settings), or with --overwrite to start over{again}"
    )


@contextlib.contextmanager
def guarded_run(work: Path, *, resume: bool, overwrite: bool, ranks: Ranks = SINGLE) -> Iterator[None]:
    """Hold the lock of ``work`` around a run; see the module doc for what happens when it stops early. In a
    data-parallel run rank 0 holds the lock and clears or keeps the folder; the other processes wait until it has
    started over, then run inside its lock."""
    if not ranks.main:
        barrier(ranks)  # rank 0 holds the lock and has cleared the folder
        yield
        return
    with _lock(work):
        if overwrite and not resume and (work / "state.json").exists():
            for entry in work.iterdir():
                if entry.name != "lock":
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        barrier(ranks)
        try:
            yield
        except KeyboardInterrupt:
            raise RunInterrupted(f"interrupted: {_kept(work, interrupted=True)}") from None
        except ResumeError:
            raise
        except ExportRejected:
            shutil.rmtree(work, ignore_errors=True)
            raise
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename is not None else ""
            raise RuntimeError(f"{where}{exc.strerror or exc}; {_kept(work)}") from exc
        except (ValueError, RuntimeError) as exc:
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (f"{exc.args[0]}; {_kept(work)}", *exc.args[1:])
            raise
