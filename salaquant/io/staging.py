"""Output folders written beside their destination and moved into place whole: the staging folder
(``.NAME.tmp-PID-*``, removed when its writer's process is gone), and the replacement of an existing folder,
which keeps a backup until the new one is in place and refuses a folder holding files salaquant did not write."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(out_dir: Path) -> list[Path]:
    """Remove the temporary folders that killed writers of ``out_dir`` left beside it (``.NAME.tmp-PID-*`` whose
    process is gone); returns what was removed."""
    removed = []
    parent = out_dir.parent
    if not parent.is_dir():
        return removed
    prefix = f".{out_dir.name}.tmp-"
    for entry in parent.iterdir():
        if not entry.name.startswith(prefix) or not entry.is_dir():
            continue
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


_PID_DIGITS = 7  # Linux process ids are below 2**22 (pid_max at most 4194304)
_RANDOM_CHARS = 8  # what tempfile.mkdtemp adds to its prefix


_WIDEST_TAIL = f"{'P' * _PID_DIGITS}-{'X' * _RANDOM_CHARS}"


def staging_name(out_dir: Path) -> str:
    """The longest name `staging_folder` gives the folder it makes beside ``out_dir``."""
    return f".{out_dir.name}.tmp-{_WIDEST_TAIL}"


def backup_name(out_dir: Path) -> str:
    """The longest name `replace_folder` gives the backup of an existing ``out_dir`` it replaces."""
    return f".{out_dir.name}.old-{_WIDEST_TAIL}"


def staging_folder(out_dir: Path) -> Path:
    """A new temporary folder beside ``out_dir`` (``.NAME.tmp-PID-*``), with the permissions of a folder made by
    ``mkdir`` under the current umask (``mkdtemp`` alone gives 0700: a server running as another user could not
    read the export). Leftovers of killed writers of the same output are removed first."""
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def replace_folder(tmp: Path, out_dir: Path) -> None:
    """Rename the complete folder ``tmp`` to ``out_dir``; an existing ``out_dir`` is removed only once the new one
    is in place (it is restored if the rename fails). Every output salaquant replaces goes through here, so here,
    at the moment of replacing, an ``out_dir`` holding files salaquant did not write is refused
    (`salaquant.outputs.refuse_foreign`: a file a user put there during a long run is caught too)."""
    if out_dir.exists() or out_dir.is_symlink():
        from ..outputs import refuse_foreign

        refuse_foreign(out_dir)
        backup = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-{os.getpid()}-", dir=out_dir.parent))
        backup.rmdir()
        os.replace(out_dir, backup)
        try:
            os.replace(tmp, out_dir)
        except BaseException:
            os.replace(backup, out_dir)
            raise
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)
