"""Collective timeout: a rank left waiting for the others ends the job instead of hanging.

When one rank fails inside the engine and its caller catches the exception (or runs
with ``UNISON_ABORT_ON_ERROR=0``, or in a thread), the other ranks would wait for it
forever. An MPI collective already in flight cannot be cancelled, so the remedy is
not "raise and carry on": with ``UNISON_COLLECTIVE_TIMEOUT_SECONDS`` > 0 a watchdog
thread wakes a few times per limit and checks two things::

    a submitted request is older than the limit     (this rank waits on a handle)
    the engine thread is inside one cycle that long (a negotiation or a collective)

Either way it logs what this rank knows (the pending names, the ranks that never
submitted them where the negotiation table says so) and calls
:data:`on_collective_timeout`, which ends the job with ``MPI_Abort`` on the world. The hook
is a module attribute a program may replace (elastic mode does not replace it yet). ``join()`` is not
timed: a joined rank legitimately waits while the others train on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from unison.common import runtime
from unison.common.engine.requests import Kind

__all__ = ["Watchdog", "abort_job", "on_collective_timeout", "overdue_report"]

logger = logging.getLogger(__name__)


def abort_job(engine: Any, report: str) -> None:
    """The default :data:`on_collective_timeout`: end every rank of the job (``MPI_Abort``)."""
    runtime.before_abort("the collective timeout (UNISON_COLLECTIVE_TIMEOUT_SECONDS)")
    engine.mpi.COMM_WORLD.Abort(1)


#: Called once, from the watchdog thread, as ``on_collective_timeout(engine, report)`` when the
#: limit is exceeded (after the report was logged). Replace it (module attribute) to react
#: differently, e.g. revoke the engine's communicator in elastic mode.
on_collective_timeout: Callable[[Any, str], None] = abort_job


class Watchdog:
    """A daemon thread that checks ``engine`` every fraction of ``limit`` seconds."""

    def __init__(self, engine: Any, limit: float) -> None:
        self.engine, self.limit = engine, limit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unison-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = min(1.0, max(self.limit / 4, 0.05))
        while not self._stop.wait(period):
            if not self.engine.alive():
                return
            report = overdue_report(self.engine, self.limit)
            if report is not None:
                logger.critical("%s", report)
                on_collective_timeout(self.engine, report)  # looked up now: it may have been replaced
                return


def overdue_report(engine: Any, limit: float) -> str | None:
    """What this rank knows about requests and cycles older than ``limit`` s; None when none are."""
    now = time.monotonic()
    overdue, busy_for = engine.overdue(now, limit)
    if not overdue and busy_for <= limit:
        return None
    lines = [f"UNISON_COLLECTIVE_TIMEOUT_SECONDS={limit:g} exceeded on rank {engine.rank}:"]
    for req in overdue[:20]:
        lines.append(f"  {req.name!r} ({Kind(req.kind).name.lower()}, process set {req.process_set}) "
                     f"waiting {now - req.submitted:.1f} s: {engine.arrival(req)}")
    if len(overdue) > 20:
        lines.append(f"  ... and {len(overdue) - 20} more")
    if busy_for > limit:
        lines.append(f"  the engine thread has been inside one cycle for {busy_for:.1f} s: a negotiation "
                     "or a collective that some rank stopped taking part in")
    lines.append("Ending the job: a collective in flight cannot be cancelled. If a rank may "
                 "legitimately wait this long (e.g. while another evaluates), raise the limit.")
    return "\n".join(lines)
