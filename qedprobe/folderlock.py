"""An exclusive lock on an output folder, so that two runs never write the same files.

``lock_folder(folder)`` takes ``folder/.lock`` (or another name) with ``fcntl.flock`` (released when the returned
file is closed or the process ends, also on a kill); it returns None when another open lock
holds it. On systems without ``fcntl`` there is no lock (returns a plain open file).
"""
from __future__ import annotations

from pathlib import Path

LOCK_NAME = ".lock"


def lock_folder(folder, name: str = LOCK_NAME):
    """The open lock file ``folder/name`` (both created), or None when another run holds it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / name, "w")
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        return handle
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle
