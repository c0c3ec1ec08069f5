"""Host liveness: end a job spanning hosts, naming the host, when a host stops answering.

[Note: why a heartbeat]
When a host's network link goes down mid-job, nothing fails: TCP retransmits for many minutes
before it reports an error, so the ranks on the other hosts wait in their next collective, and
``mpirun`` waits for the lost host's daemon, for as long (measured on test hosts: a job whose
host lost its link was still hanging 69 s later, when an outer timeout ended it). MPI's own
defaults never notice. So every rank of a job that spans hosts runs a small heartbeat:

* a daemon thread on its own duplicate of the job's communicator (its messages never match
  anyone else's) sends an 8-byte message every ``interval`` seconds to its two ring neighbours
  (ranks ``r - 1`` and ``r + 1``) and keeps one nonblocking receive posted from each. Cost per
  rank: O(1) messages, whatever the job size; the thread sleeps between looks (``poll``
  seconds, at most one second), never spins;
* a neighbour heard from for the last time more than ``UNISON_HOST_TIMEOUT_SECONDS`` ago
  (default 30) is lost: the rank writes one line to stderr naming that neighbour's host (the
  hostnames are gathered once, at start) and what to check, then calls ``MPI_Abort`` on
  ``COMM_WORLD`` with :data:`ABORT_CODE`;
* ``unisonrun`` recognises that line (``unison/run/report.py``), names the host in its closing
  line, and kills ``mpirun`` if it does not exit soon after (it may keep waiting for the lost
  host's daemon).

With ranks placed in blocks (all of a host's ranks next to each other), each host's first and
last rank have a neighbour on another host, so losing any host is seen from outside it.

A rank that shuts Unison down says goodbye (a negative count) to its neighbours, which stop
watching it: a rank that finishes early is not a lost host. The heartbeat runs only when the job
spans hosts (some rank's ``cross_size`` is above 1) and the timeout is not 0; a job on one host
has nothing a link can cut.

The line is written to stderr directly, as the exception hook in ``runtime.py`` does, and not
through ``logging``: the launcher must see it whatever logging the program configured.

This module registers its start with :func:`unison.common.runtime.add_init_hook` and imports
only the base modules below it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

import numpy as np

from unison.common import runtime
from unison.common.config import ENV_HOST_TIMEOUT

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: ``MPI_Abort`` error code, and so ``mpirun``'s and ``unisonrun``'s exit status, for a lost
#: host: 75 is ``EX_TEMPFAIL`` in sysexits.h, a failure that a retry may not meet again
ABORT_CODE = 75
#: the line a rank writes before aborting; ``unison/run/report.py`` reads it back
LOST_LINE = ("[unison] host {host} is not answering: rank {rank} (on {me}) has heard nothing from rank "
             "{peer} on {host} for {seconds:.1f} s (UNISON_{env}={timeout:g}); check that host and its "
             "network link; aborting the job")
BYE = -1
MAX_POLL_S = 1.0
MAX_INTERVAL_S = 5.0
STOP_WAIT_S = 3.0
_NAME_BYTES = 256
_TAG = 1


def timings(timeout: float) -> tuple[float, float]:
    """How often to send and to look, for a host timeout of ``timeout`` seconds.

    Returns:
        ``(interval, poll)``: a heartbeat goes out every ``interval`` seconds (six per timeout,
        at most every 5 s) and the thread wakes every ``poll`` seconds (twenty per timeout, at
        most every second), so a lost host is named at most two polls after ``timeout`` (a silence is
        confirmed by a second look: [Note: only a neighbour's silence counts]).
    """
    return min(timeout / 6.0, MAX_INTERVAL_S), min(timeout / 20.0, MAX_POLL_S)


def ring_neighbours(rank: int, size: int) -> list[int]:
    """The ranks ``rank`` exchanges heartbeats with: its ring neighbours, without repeats."""
    if size < 2:
        return []
    return sorted({(rank - 1) % size, (rank + 1) % size})


class Heartbeat:
    """The heartbeat thread of one rank; see [Note: why a heartbeat].

    Args:
        comm: A communicator used by nothing else (the caller duplicates one).
        mpi: The ``mpi4py.MPI`` module.
        hosts: Every rank's hostname, by rank of ``comm``.
        timeout: Seconds without a message after which a neighbour's host is lost.
        on_lost: Called with the line to report instead of writing it and aborting (tests).
    """

    def __init__(self, comm: Any, mpi: Any, hosts: list[str], timeout: float,
                 on_lost: Any = None) -> None:
        self.comm, self.mpi, self.hosts, self.timeout = comm, mpi, hosts, timeout
        self.rank = comm.Get_rank()
        self.peers = ring_neighbours(self.rank, comm.Get_size())
        self.interval, self.poll = timings(timeout)
        self._on_lost = on_lost or self._abort
        self._stop = threading.Event()
        self._inbox = {peer: np.zeros(1, dtype=np.int64) for peer in self.peers}
        self._receives: dict[int, Any] = {}
        self._sends: dict[int, tuple[Any, np.ndarray]] = {}
        #: heartbeats still on their way when a goodbye went out behind them (kept alive until they complete)
        self._behind: list[tuple[Any, np.ndarray]] = []
        self._heard: dict[int, float] = {}
        self._count = 0
        self._thread = threading.Thread(target=self._run, name="unison-heartbeat", daemon=True)
        self.lost: str | None = None

    def start(self) -> None:
        """Posts the receives and starts the thread."""
        now = time.monotonic()
        for peer in self.peers:
            self._heard[peer] = now
            self._post(peer)
        self._thread.start()

    def stop(self) -> bool:
        """Says goodbye to the neighbours and ends the thread.

        Returns:
            Whether the thread ended and every request completed (the communicator may be freed).
        """
        self._stop.set()
        self._thread.join(STOP_WAIT_S + 2.0)
        return not self._thread.is_alive() and not self._receives and not self._sends and not self._behind

    def _post(self, peer: int) -> None:
        self._receives[peer] = self.comm.Irecv(self._inbox[peer], source=peer, tag=_TAG)

    def _send(self, value: int) -> None:
        for peer in self.peers:
            if peer not in self._heard and value != BYE:
                continue  # it said goodbye: nothing listens any more
            pending = self._sends.get(peer)
            if pending is not None and not pending[0].Test():
                if value != BYE:
                    continue  # the last one is still on its way: never queue more behind it
                # a goodbye is never skipped: the neighbour would watch a rank that finished and report its
                # host lost (MPI delivers the two in order)
                self._behind.append(pending)
            buffer = np.array([value], dtype=np.int64)
            self._sends[peer] = (self.comm.Isend(buffer, dest=peer, tag=_TAG), buffer)

    def _receive(self, now: float) -> None:
        for peer, request in list(self._receives.items()):
            if not request.Test():
                continue
            if int(self._inbox[peer][0]) == BYE:
                del self._receives[peer], self._heard[peer]
            else:
                self._heard[peer] = now
                self._post(peer)

    def _silent(self, now: float) -> tuple[int, float] | None:
        """The neighbour silent for longer than the timeout, with the seconds, or ``None``."""
        for peer, heard in self._heard.items():
            if now - heard > self.timeout:
                return peer, now - heard
        return None

    def _run(self) -> None:
        try:
            self._beat()
        except Exception as exc:  # noqa: BLE001 - an MPI error: see below
            # ULFM reported a neighbour failed (a dead rank, or the in-place tier's failure detector giving
            # up on a lost host): the job's own collectives fail the same way, and the elastic recovery (or
            # the job's end) takes it from here; this heartbeat has nothing left to watch
            logger.info("heartbeat: stopped, MPI reports a failure: %s", exc)

    def _beat(self) -> None:
        """[Note: only a neighbour's silence counts] A look reads what arrived up to its start, so silence is
        measured to that start: this thread's own stall (a loaded host, a slow ``MPI_Test``) happened after
        it and is nobody's silence (measured to the end of the look, a stalled watcher blamed a healthy
        neighbour: under load, with the limit at 3 s, 4 runs in 4). A neighbour is reported only when two
        looks in a row, the thread running normally between them, find it silent, and never once this rank
        is stopping (a watcher stalled across ``shutdown()`` woke after a finished job and aborted it)."""
        next_send = 0.0
        suspect = None  # the neighbour the last look found silent
        looked = time.monotonic()
        while not self._stop.wait(self.poll):
            now = time.monotonic()
            awake = now - looked <= self.poll + MAX_POLL_S  # this thread ran since its last look
            self._receive(now)
            if now >= next_send:
                self._count += 1
                self._send(self._count)
                next_send = now + self.interval
            looked = time.monotonic()
            silent = self._silent(now)
            confirmed = silent is not None and awake and suspect == silent[0]
            suspect = None if silent is None else silent[0]
            if confirmed and silent is not None and not self._stop.is_set():
                self.lost = self.describe(*silent)
                self._on_lost(self.lost)
                return
        self._goodbye()

    def describe(self, peer: int, seconds: float) -> str:
        """The line that reports ``peer``'s host as lost after ``seconds`` of silence."""
        return LOST_LINE.format(host=self.hosts[peer], rank=self.rank, me=self.hosts[self.rank],
                                peer=peer, seconds=seconds, env=ENV_HOST_TIMEOUT, timeout=self.timeout)

    def _goodbye(self) -> None:
        """Tells the neighbours this rank stops, then withdraws its own receives."""
        deadline = time.monotonic() + STOP_WAIT_S
        self._settle(deadline, receives=False)  # a pending heartbeat would make the goodbye skip a peer
        self._send(BYE)
        for request in self._receives.values():
            request.Cancel()
        self._settle(deadline, receives=True)
        if self._receives or self._sends:
            logger.debug("heartbeat: %d receive(s), %d send(s) still pending at stop",
                         len(self._receives), len(self._sends))

    def _settle(self, deadline: float, receives: bool) -> None:
        """Waits until the sends (and the cancelled receives) complete, or ``deadline`` passes."""
        while True:
            self._behind = [s for s in self._behind if not s[0].Test()]
            self._sends = {p: s for p, s in self._sends.items() if not s[0].Test()}
            if receives:
                self._receives = {p: r for p, r in self._receives.items() if not r.Test()}
            if not self._sends and not self._behind and not (receives and self._receives) \
                    or time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def _abort(self, line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        runtime.before_abort("a rank stopped answering (the heartbeat)")
        self.mpi.COMM_WORLD.Abort(ABORT_CODE)


def _gather_hosts(st: runtime.State) -> tuple[list[str], int]:
    """Every rank's hostname and the largest ``cross_size`` (one collective, no pickles)."""
    mine = np.zeros(_NAME_BYTES + 8, dtype=np.uint8)
    name = st.mpi.Get_processor_name().encode()[:_NAME_BYTES]
    mine[:8] = np.frombuffer(np.int64(st.cross_size).tobytes(), dtype=np.uint8)
    mine[8:8 + len(name)] = np.frombuffer(name, dtype=np.uint8)
    every = np.empty((st.size, mine.size), dtype=np.uint8)
    st.comm.Allgather(mine, every)
    hosts = [bytes(row[8:]).rstrip(b"\0").decode(errors="replace") for row in every]
    widest = max(int(np.frombuffer(row[:8].tobytes(), dtype=np.int64)[0]) for row in every)
    return hosts, widest


def _start(st: runtime.State, _process_sets: Any = None) -> None:
    """Init hook (collective when it runs at all): start the heartbeat if the job spans hosts."""
    timeout = st.config.host_timeout_seconds
    if st.comm is None or st.size < 2 or timeout <= 0:  # the same on every rank (a must-match setting)
        return
    hosts, widest = _gather_hosts(st)
    if widest < 2:
        return
    beat = Heartbeat(st.comm.Dup(), st.mpi, hosts, timeout)
    beat.start()
    st.cache["heartbeat"] = beat
    logger.debug("heartbeat started: neighbours %s, every %.2f s, timeout %g s", beat.peers,
                 beat.interval, timeout)


def _stop(st: runtime.State) -> None:
    """Shutdown hook: stop the heartbeat; its communicator is kept until ``MPI_Finalize``.

    [Note: the heartbeat's communicator is never freed]
    Ranks stop at different moments, so a neighbour's last heartbeat or goodbye may still be on
    its way when this rank stops. Over Open MPI's TCP transport a message arriving for a
    communicator that was freed is a fatal error ("Socket closed ... on a NULL communicator",
    seen on test hosts after ``shutdown(); init()``); over shared memory it is silently dropped.
    A message for a communicator that still exists merely waits unmatched. So each ``init()``
    leaves one duplicate communicator behind, a few hundred bytes, and ``MPI_Finalize`` frees it.
    """
    beat = st.cache.pop("heartbeat", None)
    if beat is None:
        return
    if not st.cache.get("rebuilding"):
        _farewell(beat)
    if not beat.stop():
        logger.debug("heartbeat did not stop cleanly within %.1f s", STOP_WAIT_S + 2.0)
    _retired.append(beat.comm)


def _farewell(beat: Heartbeat) -> None:
    """Waits, the heartbeat still running, until every rank has reached its shutdown.

    [Note: the heartbeat watches until every rank is stopping]
    After ``shutdown()`` a rank enters ``MPI_Finalize``, which waits for every host's daemon. A host that lost
    its link in a job's last seconds (ranks saving a checkpoint, no collective pending) was never reported:
    before 2026-12-07 the heartbeat stopped first and said goodbye, the engine's stop waited its 30 s, and
    ``MPI_Finalize`` waited for the lost host for ever, naming nobody (an audit on test hosts: still running
    134 s after the link went down). Now the heartbeat stops after the engine (a last shutdown hook) and
    only once a nonblocking barrier on its communicator shows every rank stopping: until then a silent
    neighbour is reported and the job aborted as at any other time. A rank that finishes early waits here
    for the others, as it would in ``MPI_Finalize``. Not when elastic recovery rebuilds Unison (a failed
    rank would never arrive), and not once the heartbeat has ended on an MPI failure (ULFM's report).
    """
    try:
        request = beat.comm.Ibarrier()
        while not request.Test():
            if not beat._thread.is_alive():  # it reported a lost host (aborting), or MPI reported a failure
                return
            time.sleep(0.01)
    except Exception as exc:  # noqa: BLE001 - an MPI failure (ULFM): nothing to wait for
        logger.info("heartbeat: farewell ended by MPI: %s", exc)


#: communicators of stopped heartbeats (see [Note: the heartbeat's communicator is never freed])
_retired: list[Any] = []


def running() -> bool:
    """Whether this rank runs a heartbeat (the job spans hosts and the timeout is not 0)."""
    st = runtime.state("unison.common.heartbeat.running()")
    return "heartbeat" in st.cache


runtime.add_init_hook(_start)
runtime.add_shutdown_hook(_stop, last=True)
