"""Where a command writes: the refusals made before any work, and the free-space check.

Every command that writes a folder checks, before it reads a tensor or a calibration record: that the output
is not the input, inside it or around it (paths resolved, symlinks followed); that it is not a file and does
not lie below one; that its parent's file system takes writes (a real probe, so a read-only mount or a
missing permission is caught, also for root); that an existing output is replaced only with ``--overwrite``
and only when salaquant wrote it (`salaquant.ownership`: a folder holding anything else is refused even with
``--overwrite``, and so is a work folder); that no other run is using the output (its work folder's lock); and
that every name salaquant derives from the output's (`derived_names`) fits its file system. Each refusal is one
`OutputError` naming the path.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .ownership import judge
from .summary import human_bytes


class OutputError(ValueError):
    """An output path that cannot be written as asked (named in the message)."""


class ExportRejected(RuntimeError):
    """A complete export that failed ``check`` (``"check"``: the format check, ``"gate"``: a recipe's eval gate).

    It never stands at the output: the export is moved to `failed_dir_for` (``OUT.<check>-failed``) for inspection
    and the message says so (`kept_at`). The work folder goes with it: a rerun would write the same export."""

    def __init__(self, message: str, check: str) -> None:
        super().__init__(message)
        self.check = check

    def kept_at(self, failed: Path, output: Path) -> None:
        """Add where the export was kept, and that ``output`` was not written, to the message's first line."""
        head, sep, rest = str(self.args[0]).partition("\n")
        self.args = (f"{head}; the export is kept at {failed} for inspection and {output} was not written{sep}{rest}",)


def work_dir_for(output: Path) -> Path:
    """Where an unfinished run keeps its state (next to the output, removed when the output is complete)."""
    return Path(f"{output}.work")


FAILED_CHECKS = ("check", "gate")
"""The checks a complete export must pass before it is moved to the output (see `ExportRejected`)."""


def failed_dir_for(output: Path, check: str) -> Path:
    """Where an export that failed ``check`` (one of `FAILED_CHECKS`) is kept, beside the output."""
    return Path(f"{output}.{check}-failed")


def derived_names(output: Path) -> list[str]:
    """Every name salaquant gives a folder beside ``output``, at its longest: the work folder, the writer's
    staging folder, the backups of replaced folders and the exports that failed a check (the longest: the backup
    of an older ``OUT.check-failed``)."""
    from .io.staging import backup_name, staging_name

    names = [output.name, work_dir_for(output).name, staging_name(output), backup_name(output)]
    for check in FAILED_CHECKS:
        failed = failed_dir_for(output, check)
        names += [failed.name, backup_name(failed)]
    return names


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def in_use_message(work: Path, pid: str) -> str:
    return f"another salaquant run (pid {pid}) is using {work}: wait for it to finish or stop it"


def lock_holder(work: Path) -> str | None:
    """The pid written in ``work/lock`` when another process holds that lock, else None. Probed without creating
    anything (the lock itself is taken by ``work_folder.guarded_run``)."""
    try:
        fd = os.open(work / "lock", os.O_RDWR)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def check_no_overlap(output: Path, inputs: Sequence[tuple[str, Path]], flag: str = "--output") -> None:
    """Refuse an output (or its work folder) that is an input, lies inside one or contains one."""
    out, work = _real(output), _real(work_dir_for(output))
    for what, path in inputs:
        src = _real(path)
        if out == src:
            raise OutputError(f"{flag} {output} is the {what} {path}: writing it would destroy the input")
        if out.is_relative_to(src):
            raise OutputError(f"{flag} {output} lies inside the {what} {path}: choose a folder outside it")
        if src.is_relative_to(out) or src.is_relative_to(work):
            raise OutputError(f"{flag} {output} contains the {what} {path}: replacing it would destroy the input")


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable_folder(output: Path, flag: str = "--output") -> None:
    """Refuse an output that is a file, lies below a file, or whose parent's file system refuses writes."""
    if output.is_symlink() and not output.is_dir():
        raise OutputError(f"{flag} {output} is a symlink to something that is not a folder")
    if output.exists() and not output.is_dir():
        raise OutputError(f"{flag} {output} is a file, not a folder: pass a folder path (--overwrite replaces folders)")
    anchor = nearest_existing(output.parent)
    if not anchor.is_dir():
        raise OutputError(f"{flag} {output} cannot be created: {anchor} is a file, not a folder")
    try:
        probe = tempfile.mkdtemp(prefix=".salaquant-probe-", dir=anchor)
        os.rmdir(probe)
    except OSError as exc:
        raise OutputError(f"{flag} {output}: cannot write in {anchor} ({exc.strerror or exc})") from exc


def check_replace(output: Path, overwrite: bool, flag: str = "--output") -> None:
    """Refuse an existing output holding files salaquant did not write, with or without ``--overwrite`` (a few are
    named), and one salaquant wrote without ``--overwrite``; a missing or empty folder passes. ``flag`` names the
    output in the message ("" for an argument). A file is left to `check_writable_folder`."""
    if output.exists() and not output.is_dir():
        return
    verdict = judge(output)
    named = f"{flag} {output}" if flag else str(output)
    if verdict.foreign:
        raise OutputError(
            f"{named} holds files salaquant did not write ({verdict.few()}): salaquant never deletes them, "
            "not even with --overwrite; choose another folder or move them out"
        )
    if verdict.kind is not None and not overwrite:
        raise OutputError(f"{named} is a {verdict.kind.name} salaquant wrote: pass --overwrite to replace it")


def refuse_foreign(path: Path, role: str = "") -> None:
    """Refuse to remove or replace ``path`` when it holds files salaquant did not write (``role`` says what the path
    is to the run); a missing or empty folder, or one salaquant wrote, passes."""
    verdict = judge(path)
    if verdict.foreign:
        raise OutputError(
            f"{path}{role} holds files salaquant did not write ({verdict.few()}): salaquant never deletes them; "
            "move them out or choose another output"
        )


def remove_owned(path: Path, role: str = "") -> None:
    """Remove ``path`` after `refuse_foreign` has passed it (nothing to do when it is missing)."""
    refuse_foreign(path, role)
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def check_name_lengths(output: Path, flag: str = "--output") -> None:
    """Refuse an output whose name, or a name salaquant derives from it (`derived_names`), or a folder still to
    be created on its way, is longer than its file system allows (``NAME_MAX``, in bytes)."""
    anchor = nearest_existing(output.parent)
    limit = os.pathconf(anchor, "PC_NAME_MAX")
    missing = Path(os.path.abspath(output.parent)).relative_to(anchor).parts
    for part in missing:
        if len(os.fsencode(part)) > limit:
            raise OutputError(
                f"{flag} {output}: the folder name {part!r} is longer than the {limit} bytes {anchor} takes"
            )
    own = len(os.fsencode(output.name))
    longest = max(derived_names(output), key=lambda n: len(os.fsencode(n)))
    extra = len(os.fsencode(longest)) - own
    if own + extra > limit:
        raise OutputError(
            f"{flag} {output}: its name is {own} bytes long and salaquant writes folders beside it with names up to "
            f"{extra} bytes longer ({longest.replace(output.name, 'NAME', 1)}); the file system of {anchor} allows "
            f"{limit}: choose a name of at most {limit - extra} bytes"
        )


def check_output(output: Path, overwrite: bool, resume: bool, inputs: Sequence[tuple[str, Path]] = ()) -> None:
    """All the refusals of the module doc, then: an output salaquant wrote without ``overwrite``, ``resume``
    without a work folder, an unfinished work folder with neither ``resume`` nor ``overwrite``."""
    check_no_overlap(output, inputs)
    check_writable_folder(output)
    check_name_lengths(output)
    holder = lock_holder(work_dir_for(output))
    if holder is not None:
        raise OutputError(in_use_message(work_dir_for(output), holder))
    check_replace(output, overwrite)
    work = work_dir_for(output)
    refuse_foreign(work, ", the work folder of this output,")
    for check in FAILED_CHECKS:  # an export failing a check replaces what an earlier failure left there
        refuse_foreign(failed_dir_for(output, check), f", where an export failing its {check} is kept,")
    if resume and not work.exists():
        raise OutputError(f"--resume: no work folder {work} to resume from: run without --resume to start")
    if not resume and not overwrite and (work / "state.json").exists():
        raise OutputError(
            f"{work} holds an unfinished run: rerun with --resume to continue it, or with --overwrite to discard it "
            "and start over"
        )


def check_free_space(output: Path, parts: dict[str, int]) -> None:
    """Refuse to start when the file system of ``output`` has less free space than ``parts`` add up to
    (named sizes still to be written, e.g. the export and the rest of the work folder)."""
    needed = sum(parts.values())
    anchor = nearest_existing(output.parent)
    free = shutil.disk_usage(anchor).free
    if free < needed:
        detail = ", ".join(f"{name} {human_bytes(n)}" for name, n in parts.items())
        raise OutputError(
            f"not enough free space for {output}: the run needs about {human_bytes(needed)} ({detail}), "
            f"{anchor} has {human_bytes(free)} free"
        )
