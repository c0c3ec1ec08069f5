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
OOM killer), a crash, ``os._exit``, ``MPI_Abort``. Once a rank's training function has returned
(``elastic.run``), its file goes too: what the program does after that, ``os._exit`` included, is
left to mpirun. ``unison.run.rankwatch`` on the driver's side reads these files; see [Note: ending
a job whose rank died] there.
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
from unison.run.rankwatch import folder, marker_name

__all__ = ["release"]

logger = logging.getLogger(__name__)

#: ``UNISON_ELASTIC_STATE_DIR`` / ``UNISON_ELASTIC_ATTEMPT``: set by the elastic driver (see store.py)
_ENV_STATE_DIR, _ENV_ATTEMPT = "ELASTIC_STATE_DIR", "ELASTIC_ATTEMPT"
register_env(_ENV_STATE_DIR, _ENV_ATTEMPT)

_marker: Path | None = None


def _mark(state: Any, process_sets: Any) -> None:
    """Init hook: leave this rank's file (once per process; a rebuild after a failure keeps it)."""
    global _marker
    found = env_value(_ENV_STATE_DIR)
    if _marker is not None or found is None:
        return
    raw = env_value(_ENV_ATTEMPT)
    attempt = int(raw[1]) if raw is not None and raw[1].strip().isdigit() else 0
    path = folder(found[1], attempt) / marker_name(socket.gethostname(), os.getpid())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{state.rank}\n")
    except OSError as exc:  # the driver then leaves this rank to mpirun, as without the file
        logger.debug("elastic: cannot leave the rank's file %s: %s", path, exc)
        return
    _marker = path
    atexit.register(_unmark)


def release() -> None:
    """This rank's end no longer counts as a death: its training function returned (a program may
    leave with ``os._exit`` after that, which must not end the others)."""
    _unmark()


def _unmark() -> None:
    """At a normal exit: the file goes before the process does."""
    global _marker
    path, _marker = _marker, None
    if path is not None:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


runtime.add_init_hook(_mark)
