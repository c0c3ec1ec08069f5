"""Removes the session folders that killed Open MPI launches left behind.

[Note: stale session folders]
Open MPI 5 (PRRTE and PMIx) keeps each launch's state in a folder named after the launcher's
process id: ``$TMPDIR/ompi.<pid>`` for ``mpirun`` and ``$TMPDIR/prted.<pid>`` for a remote
host's daemon, holding PMIx's rendezvous files. A launch that ends normally removes its
folder; one that is killed (a timeout, ``kill -9``, a lost host) does not. Process ids are
reused, and sooner on a busy machine (every thread of TensorFlow or torch takes one), so a
later ``mpirun`` can be given the id of a dead launch whose folder is still there; PMIx then
stops before any rank starts with "The PMIx server's listener thread failed to start". Before
each launch ``unisonrun`` removes the folders of this user whose process is gone. A folder
whose id belongs to a running process is kept, whatever that process is, and so is one that
is younger than a minute (its launcher may be starting in a process namespace we cannot see).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^(?:ompi|prted)\.(\d+)$")
MIN_AGE_S = 60.0


def _alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_session_dirs(tmpdir: str | os.PathLike[str] | None = None, *,
                       alive: Callable[[int], bool] = _alive, now: float | None = None,
                       uid: int | None = None) -> list[Path]:
    """The Open MPI session folders in ``tmpdir`` that a dead launch of ``uid`` left.

    Args:
        tmpdir: The folder Open MPI writes to; ``$TMPDIR`` (or the system's) when ``None``.
        alive: Whether a process id is in use (tests pass their own).
        now: The current time (seconds since the epoch); ``time.time()`` when ``None``.
        uid: The owner to consider; the current user when ``None``.

    Returns:
        The folders, sorted, whose process is gone and that are older than ``MIN_AGE_S``.
    """
    base = Path(tmpdir if tmpdir is not None else tempfile.gettempdir())
    now = time.time() if now is None else now
    uid = os.geteuid() if uid is None else uid
    try:
        entries = list(base.iterdir())
    except OSError:
        return []
    stale = []
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None:
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not entry.is_dir() or entry.is_symlink() or info.st_uid != uid:
            continue
        if now - info.st_mtime < MIN_AGE_S or alive(int(match.group(1))):
            continue
        stale.append(entry)
    return sorted(stale)


def remove_session_dir(pid: int, tmpdir: str | os.PathLike[str] | None = None) -> None:
    """Removes the session folder of the ``mpirun`` with ``pid``, which the caller killed (and so knows
    is gone); nothing when there is none."""
    base = Path(tmpdir if tmpdir is not None else tempfile.gettempdir())
    shutil.rmtree(base / f"ompi.{pid}", ignore_errors=True)


def remove_stale_session_dirs(tmpdir: str | os.PathLike[str] | None = None, **kwargs: object) -> list[Path]:
    """Removes what ``stale_session_dirs`` finds; a folder that cannot be removed is logged
    and left. Returns the folders removed."""
    removed = []
    for folder in stale_session_dirs(tmpdir, **kwargs):  # type: ignore[arg-type]
        try:
            shutil.rmtree(folder)
        except OSError as error:
            logger.info("could not remove the stale Open MPI session folder %s: %s", folder, error)
            continue
        logger.info("removed the stale Open MPI session folder %s (its launch is gone)", folder)
        removed.append(folder)
    return removed
