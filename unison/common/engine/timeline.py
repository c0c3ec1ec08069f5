"""Timeline: a Chrome-trace JSON of what the engine did with each tensor.

Rank 0 writes it (``UNISON_TIMELINE=path.json`` or ``unison.start_timeline``).
Each tensor is one row (a trace "thread") with nested phases::

    NEGOTIATE_ALLREDUCE  |--- rank 0 ready . rank 1 ready ---|
    QUEUE                                                    |--|
    MEMCPY_IN_FUSION_BUFFER                                     |-|
    ALLREDUCE                                                     |-----|
    MEMCPY_OUT_FUSION_BUFFER                                             |-|

Open it in https://ui.perfetto.dev or chrome://tracing.

[Note: a timeline survives the job] The file is created fresh under a random name
beside ``path`` (:func:`open_fresh`: never a predictable name that a planted
symlink could redirect) and renamed over ``path`` at once, at ``start()``; events
then stream into it, flushed before every negotiation and every collective, and
``stop()`` ends the phases still open and closes the JSON array. A job that stalls,
aborts or is killed therefore leaves its trace up to the collective it was in, at
``path``, which is when a timeline is wanted most; an abort through Unison on rank 0
(the collective timeout's ``MPI_Abort``, an uncaught exception) first ends the open
phases with a ``job aborted`` event (:meth:`Timeline.abandon`). Before 2026-12-05 the
file was renamed into place only at ``stop()``, so such a job left a hidden, often
empty, temporary file and no trace.

[Note: valid after every write] Each write ends with the array's closing bracket and
then steps back over it, so the next write replaces it: the file on disk is a whole JSON
array after every flush, also when rank 0 is killed (an abort on another rank: Open MPI
ends rank 0 without running its Python). Before 2026-12-07 such a file lacked the ``]``:
Chrome and Perfetto read it, ``json.load`` did not.

Rows are named by tensor name, and for a process set other than the job's by the name and
the set (:func:`row`): one name in flight on two sets is two rows (before 2026-12-07 one,
its slices nested wrongly).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from typing import IO

__all__ = ["Timeline", "open_fresh", "row", "TRAILER"]

#: written after every write and stepped back over ([Note: valid after every write])
TRAILER = "\n]\n"


def row(set_id: int, name: str) -> str:
    """The timeline row of ``name`` on process set ``set_id`` (the job's, 0, keeps the bare name)."""
    return name if not set_id else f"{name} [process set {set_id}]"


def open_fresh(path: str) -> tuple[IO[str], str]:
    """Create a new file next to ``path`` for writing; returns (file, its temporary path).

    The file is created exclusively under a random name (``O_CREAT | O_EXCL |
    O_NOFOLLOW``, as :func:`tempfile.mkstemp` does), so a file or symlink planted at
    a predictable name is never followed or overwritten. Rename it over ``path``
    with :func:`os.replace` (which replaces a symlink at ``path``, never its target).
    """
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    os.fchmod(fd, 0o644)  # readable like a file opened with open(path, "w") under the usual umask
    return os.fdopen(fd, "w", newline="", encoding="utf-8"), tmp


class Timeline:
    """Records phases per tensor name; every method is a no-op while inactive."""

    def __init__(self) -> None:
        self._file: IO[str] | None = None
        self._path = ""
        self._tmp = ""
        self._tids: dict[str, int] = {}
        #: the phases begun and not ended, per name (a failed collective's are ended by close_open)
        self._open: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._first = True
        #: events not yet written: whole events only reach the file, so a killed job never leaves half of one
        self._buf: list[str] = []
        self._buf_chars = 0
        #: bytes of events in the file, where the closing bracket starts
        self._end = 0

    @property
    def active(self) -> bool:
        return self._file is not None

    def start(self, path: str) -> None:
        with self._lock:
            if self._file is not None:
                self._close()
            self._path = os.path.abspath(os.fspath(path))  # (a later chdir must not move it)
            self._file, self._tmp = open_fresh(self._path)
            self._buf, self._buf_chars, self._end = ["[\n"], 0, 0
            self._tids.clear()
            self._open.clear()
            self._first = True
            try:
                self._emit({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "unison engine"}})
                self._write_out()
                os.replace(self._tmp, self._path)  # published now: see [Note: a timeline survives the job]
            except BaseException:  # not recording: a failed start went on into a hidden temporary file
                file, self._file = self._file, None
                with contextlib.suppress(OSError):  # (a full disk fails the close's flush as well)
                    file.close()
                with contextlib.suppress(OSError):
                    os.remove(self._tmp)
                raise

    def stop(self) -> None:
        with self._lock:
            self._close()

    def abandon(self, reason: str) -> None:
        """Close the trace before the job is ended (``MPI_Abort``): the open phases end now, with an
        instant event naming ``reason``. Waits at most a second for the lock (another thread may hold
        it); a trace left open still reads up to its last flush."""
        if self._file is None or not self._lock.acquire(timeout=1.0):
            return
        try:
            if self._file is not None:
                self._emit({"name": f"job aborted: {reason}"[:200], "ph": "i", "s": "g", "pid": 0,
                            "ts": self._us(None)})
                self._close()
        finally:
            self._lock.release()

    def flush(self) -> None:
        """Hand what was recorded to the OS (cheap when nothing was): the engine calls it before each
        collective and after each cycle, so a job that hangs or is killed keeps it."""
        if self._buf and self._file is not None:
            with self._lock:
                if self._file is not None:
                    self._write_out()

    def _write_out(self, last: bool = False) -> None:
        """Write the buffered events and the closing bracket; unless ``last``, step back over the
        bracket so that the next write replaces it ([Note: valid after every write])."""
        assert self._file is not None  # noqa: S101 - callers hold the lock and checked
        text = "".join(self._buf)
        self._file.write(text + TRAILER)  # (one write: no moment without the bracket)
        self._file.flush()
        self._end += len(text.encode())
        if not last:
            self._file.seek(self._end)  # (a text file's position is its byte offset: UTF-8 has no state)
        self._buf.clear()
        self._buf_chars = 0

    def _close(self) -> None:
        if self._file is None:
            return
        now = self._us(None)
        for name, phases in self._open.items():  # a slice begun and not ended stays open in a viewer
            for phase in reversed(phases):
                self._emit({"name": phase, "ph": "E", "pid": 0, "tid": self._tid(name), "ts": now})
        self._open.clear()
        self._write_out(last=True)
        self._file.truncate()  # (nothing follows: the trailer is the last write)
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def _emit(self, event: dict) -> None:
        assert self._file is not None  # noqa: S101 - callers hold the lock and checked
        text = ("" if self._first else ",\n") + json.dumps(event)
        self._buf.append(text)
        self._buf_chars += len(text)
        self._first = False
        if self._buf_chars > 1 << 18:
            self._write_out()

    def _tid(self, name: str) -> int:
        tid = self._tids.get(name)
        if tid is None:
            tid = self._tids[name] = len(self._tids) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}})
        return tid

    def _us(self, t: float | None) -> float:
        return round(((time.monotonic() if t is None else t) - self._t0) * 1e6, 3)

    def begin(self, name: str, phase: str, t: float | None = None, args: dict | None = None) -> None:
        if self._file is None:
            return
        with self._lock:
            if self._file is not None:
                ev = {"name": phase, "ph": "B", "pid": 0, "tid": self._tid(name), "ts": self._us(t)}
                if args:
                    ev["args"] = args
                self._emit(ev)
                self._open.setdefault(name, []).append(phase)

    def end(self, name: str, phase: str, t: float | None = None) -> None:
        if self._file is None:
            return
        with self._lock:
            phases = self._open.get(name)
            if self._file is not None and phases and phase in phases:  # (not begun in this file: no end)
                self._emit({"name": phase, "ph": "E", "pid": 0, "tid": self._tid(name), "ts": self._us(t)})
                phases.reverse()
                phases.remove(phase)  # (the latest one of that phase)
                phases.reverse()
                if not phases:
                    self._open.pop(name, None)

    def close_open(self, name: str) -> None:
        """End every phase of ``name`` still open, latest first: its collective failed (a mismatch, a
        stall, a removed set, a shutdown), and its slices would otherwise stay open in the trace."""
        if self._file is None:
            return
        with self._lock:
            for phase in reversed(self._open.pop(name, [])):
                if self._file is not None:
                    self._emit({"name": phase, "ph": "E", "pid": 0, "tid": self._tid(name), "ts": self._us(None)})

    def mark(self, name: str, label: str, t: float | None = None) -> None:
        if self._file is None:
            return
        with self._lock:
            if self._file is not None:
                self._emit({"name": label, "ph": "i", "s": "t", "pid": 0, "tid": self._tid(name),
                            "ts": self._us(t)})
