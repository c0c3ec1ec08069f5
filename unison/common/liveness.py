"""Each rank under ``unisonrun``'s elastic driver leaves a file while it lives; a normal exit removes it.

[Note: telling an abrupt death from an exit]
When a rank dies, Open MPI 5.0's ``prterun`` ends the job's other ranks on its own schedule: it
sends them SIGCONT, sleeps 250 ms, then SIGTERM (and SIGKILL), and only then exits (traced with
``strace`` here: 0.26 s from a rank's SIGKILL to ``mpirun``'s exit with every other rank asleep,
0.45 s with them training). In the restart tier, where the job ends anyway, that is time the next
job could already be starting. The driver can watch its own host's ranks through pidfds, but a
pidfd says only *that* a process ended, not how, and a rank that exits normally (its training
done, or status 76 for a host change) must not end the others.

So at ``init()`` every rank of a job the driver started (``UNISON_ELASTIC_STATE_DIR`` set) writes
``<state dir>/ranks-<attempt>/<hostname>.<pid>`` (its rank inside) and removes it in an ``atexit``
handler, which Python runs at every normal end of the interpreter: the program's end, ``sys.exit``
with any status, an uncaught exception. The file is gone before the process is, so a rank whose
file is still there when its pidfd says it ended died without exiting: a signal (SIGKILL, the
OOM killer), a crash, ``os._exit``, ``MPI_Abort``. When a rank's training function returns
(``elastic.run``), its file goes too: what the program does after that, ``os._exit`` included, is
left to mpirun; the next call of an ``elastic.run`` function puts the file back (before 2026-12-05
it stayed gone, so a rank that died in a program's second call, say the next epoch's, went
unwatched). ``unison.run.rankwatch`` on the driver's side reads these files; see [Note: ending a
job whose rank died] there.

[Note: how a rank's job ended]
The watch's file says only whether a rank is in its training now. For its verdict on a job that
ended, the driver needs more: did a rank die inside its training (start the job again from the
last commit), or after its training function returned (a failure of the program's own last steps,
which a restart would only repeat), or did it exit normally? So every rank of a job under the driver
also keeps a record, ``<state dir>/ends-<attempt>/<hostname>.<pid>``, holding its phase and rank:

    started    at ``init()``
    training   at each call of an ``elastic.run`` function
    returned   when that function returned
    exited     at the interpreter's normal end (``atexit``: the program's end, ``sys.exit``)

each written whole (a temporary file, then a rename). A record left at ``started`` or ``training``
is a rank that died before its training was done; one left at ``returned`` is a rank that died, or
left by ``os._exit``, after it. The driver reads the records of the ranks on its own host (the
others are on their hosts' disks) once ``mpirun`` has ended; see [Note: the driver's verdict] in
``unison/run/elastic_driver.py``.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
from pathlib import Path
from typing import Any

from unison.common import runtime
from unison.common.config import env_value, register_env
from unison.run.rankwatch import folder, marker_name, records_folder

__all__ = ["entered", "returned", "release", "phase", "last_rank", "STARTED", "TRAINING", "RETURNED", "EXITED"]

logger = logging.getLogger(__name__)

#: ``UNISON_ELASTIC_STATE_DIR`` / ``UNISON_ELASTIC_ATTEMPT``: set by the elastic driver (see store.py)
_ENV_STATE_DIR, _ENV_ATTEMPT = "ELASTIC_STATE_DIR", "ELASTIC_ATTEMPT"
register_env(_ENV_STATE_DIR, _ENV_ATTEMPT)

#: the phases of a rank's record (see [Note: how a rank's job ended])
STARTED, TRAINING, RETURNED, EXITED = "started", "training", "returned", "exited"

_marker: Path | None = None  # the watch's file, while it is there
_home: Path | None = None  # where the watch's file goes (set once at init)
_record: Path | None = None
_phase: str | None = None
_rank = 0
_pid: int | None = None  # the process that marked itself (a child forked from it must not unmark it)


def _mark(state: Any, process_sets: Any) -> None:
    """Init hook: leave this rank's file and record (once per process; a rebuild after a failure keeps them)."""
    global _home, _record, _rank, _pid
    found = env_value(_ENV_STATE_DIR)
    if _home is not None or found is None:
        return
    raw = env_value(_ENV_ATTEMPT)
    attempt = int(raw[1]) if raw is not None and raw[1].strip().isdigit() else 0
    _pid = os.getpid()
    name = marker_name(socket.gethostname(), _pid)
    _home, _rank = folder(found[1], attempt) / name, state.rank
    _record = records_folder(found[1], attempt) / name
    _arm()
    _write(STARTED)
    atexit.register(_at_exit)


def _arm() -> None:
    """Put the watch's file there (again)."""
    global _marker
    if _home is None or _marker is not None:
        return
    try:
        _home.parent.mkdir(parents=True, exist_ok=True)
        _home.write_text(f"{_rank}\n")
    except OSError as exc:  # the driver then leaves this rank to mpirun, as without the file
        logger.debug("elastic: cannot leave the rank's file %s: %s", _home, exc)
        return
    _marker = _home


def _write(phase_: str) -> None:
    """This rank's record says ``phase_`` (written whole: a temporary file, then a rename)."""
    global _phase
    _phase = phase_
    if _record is None:
        return
    tmp = _record.with_name(f".{_record.name}.tmp")
    try:
        _record.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(f"{phase_} {_rank}\n")
        os.replace(tmp, _record)
    except OSError as exc:  # the driver then judges the job by mpirun's report alone
        logger.debug("elastic: cannot write the rank's record %s: %s", _record, exc)


def phase() -> str | None:
    """This rank's phase (see [Note: how a rank's job ended]); None outside a job of the driver."""
    return _phase


def last_rank() -> int:
    """This rank's number at the last :func:`entered` or :func:`returned` (its number at init before)."""
    return _rank


def entered(rank: int) -> None:
    """A call of an ``elastic.run`` function began: a death from here is one inside the training."""
    global _rank
    _rank = rank
    _arm()
    _write(TRAINING)


def returned(rank: int) -> None:
    """The training function returned: this rank's end no longer counts as a death for the watch (a
    program may leave with ``os._exit`` after that, which must not end the others)."""
    global _rank
    _rank = rank
    release()
    _write(RETURNED)


def release() -> None:
    """Remove the watch's file (until the next :func:`entered`)."""
    _unmark()


def _at_exit() -> None:
    """At a normal exit: the record says so and the watch's file goes, before the process does. Not in a child
    forked from the rank (its file and record name the rank's own pid: [Note: a process forked after init()])."""
    if _pid is not None and os.getpid() != _pid:
        return
    _write(EXITED)
    _unmark()


def _unmark() -> None:
    global _marker
    path, _marker = _marker, None
    if path is not None:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


runtime.add_init_hook(_mark)
