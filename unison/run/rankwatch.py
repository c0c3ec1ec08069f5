"""The restart tier's watch over this host's ranks: a rank that dies ends its job at once.

[Note: ending a job whose rank died]
In the restart tier a rank's death ends the MPI job; the driver then starts the next one. Open
MPI's ``prterun`` takes 0.26-0.45 s to end the others (see [Note: telling an abrupt death from an
exit] in ``unison/common/liveness.py``), during which nothing useful runs. :class:`RankWatch`
runs beside each job of the restart tier: it reads the files the ranks on this host leave while
they live, opens a pidfd for each (``pidfd_open``, Linux 5.3; without it there is no watch and
``mpirun`` ends the job as before), and when one ends with its file still there it logs which
rank died and calls ``on_death``, which kills ``mpirun`` and every process below it. The job then
ends within milliseconds, with status 137, and the driver counts a failure against this host,
as it would from ``mpirun``'s report.

Only this host's ranks are watched (the files of other hosts' ranks are on their disks, and their
pids are not ours); a death elsewhere ends the job through ``mpirun`` as before. The in-place tier
is never watched: there a rank's death is survived inside the job.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from unison.run.supervise import kill_tree

__all__ = ["RankWatch", "available", "folder", "records_folder", "read_records", "marker_name",
           "parse_marker_name"]

logger = logging.getLogger("unison.run.elastic")


def folder(state_dir: str | os.PathLike[str], attempt: int) -> Path:
    """Where the ranks of the driver's job ``attempt`` leave their files."""
    return Path(state_dir) / f"ranks-{attempt:06d}"


def records_folder(state_dir: str | os.PathLike[str], attempt: int) -> Path:
    """Where the ranks of the driver's job ``attempt`` keep their records for the driver's verdict (see
    [Note: how a rank's job ended] in ``unison/common/liveness.py``); apart from :func:`folder`, which the
    launcher removes when the job's watch ends."""
    return Path(state_dir) / f"ends-{attempt:06d}"


def read_records(path: Path) -> dict[tuple[str, int], tuple[str, int]]:
    """``(host, pid) -> (phase, rank)`` of every record in ``path`` (an unreadable one: phase "started")."""
    try:
        names = os.listdir(path)
    except OSError:
        return {}
    found = {}
    for name in names:
        parsed = parse_marker_name(name)
        if parsed is None:
            continue
        try:
            phase, rank = (path / name).read_text().split()[:2]
            found[parsed] = (phase, int(rank))
        except (OSError, ValueError):  # cut short by a death mid-write: it never got past its start
            found[parsed] = ("started", -1)
    return found


def marker_name(host: str, pid: int) -> str:
    return f"{host}.{pid}"


def parse_marker_name(name: str) -> tuple[str, int] | None:
    """``(host, pid)`` of a marker's file name, or None for anything else in the folder."""
    host, _, pid = name.rpartition(".")
    return (host, int(pid)) if host and pid.isdigit() else None


def available() -> bool:
    """Whether this system can watch processes that are not our children (pidfds)."""
    return hasattr(os, "pidfd_open") and hasattr(select, "poll")


class RankWatch:
    """Watches the ranks whose files are in ``folder`` (see [Note: ending a job whose rank died]).

    Args:
        folder: the job's marker folder (``unison.common.liveness.folder``).
        on_death: called once, from the watch's thread, with ``(rank, pid)`` of the first rank of
            this host that ended with its file still there; :meth:`watch` sets it to kill ``mpirun``.
        host: this host's name, as the ranks write it (``socket.gethostname()``).
        poll_s: how often to look for new files while waiting.
    """

    def __init__(self, folder: Path, on_death: Callable[[int, int], None] | None = None, host: str | None = None,
                 poll_s: float = 0.05) -> None:
        self.folder = folder
        self.on_death = on_death
        self.host = host or socket.gethostname()
        self.poll_s = poll_s
        #: ``(rank, pid)`` of the rank that died, once one did
        self.died: tuple[int, int] | None = None
        #: the watched job's mpirun (set by :meth:`watch`)
        self.mpirun_pid: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._unwatchable: set[int] = set()  # pids pidfd_open refused: not tried again

    def watch(self, process: subprocess.Popen[bytes]) -> None:
        """Start watching the job of ``process`` (``mpirun``): a rank's death kills it and all below it."""
        self.mpirun_pid = process.pid
        if self.on_death is None:
            def end_job(rank: int, pid: int) -> None:
                kill_tree(process.pid)

            self.on_death = end_job
        self.start()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="unisonrun-rankwatch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ the thread
    def _marker(self, pid: int) -> Path:
        return self.folder / marker_name(self.host, pid)

    def _new_pids(self) -> list[int]:
        try:
            names = os.listdir(self.folder)
        except OSError:
            return []
        watched = set(self._fds.values()) | self._unwatchable
        found = []
        for name in names:
            parsed = parse_marker_name(name)
            if parsed is not None and parsed[0] == self.host and parsed[1] not in watched:
                found.append(parsed[1])
        return found

    def _ended(self, pid: int) -> bool:
        """A rank ended: True (and ``on_death`` called) when its file is still there."""
        marker = self._marker(pid)
        try:
            rank = int(marker.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False  # removed at a normal exit
        self.died = (rank, pid)
        logger.warning("rank %d (PID %d on %s) died without exiting (a signal or a crash): ending the job now",
                       rank, pid, self.host)
        if self.on_death is not None:
            self.on_death(rank, pid)
        return True

    def _run(self) -> None:
        poller = select.poll()
        try:
            while not self._stop.is_set():
                for pid in self._new_pids():
                    try:
                        fd = os.pidfd_open(pid)
                    except ProcessLookupError:  # ended before we looked
                        if self._ended(pid):
                            return
                        continue
                    except OSError as exc:
                        logger.debug("cannot watch PID %d: %s", pid, exc)
                        self._unwatchable.add(pid)
                        continue
                    self._fds[fd] = pid
                    poller.register(fd, select.POLLIN)
                for fd, _ in poller.poll(int(self.poll_s * 1000)):
                    pid = self._fds.pop(fd)
                    poller.unregister(fd)
                    os.close(fd)
                    if self._ended(pid):
                        return
        finally:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
