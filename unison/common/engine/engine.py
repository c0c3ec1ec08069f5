"""The engine: one background thread per process owns all engine communication.

Callers submit named requests and get handles. The thread sleeps until a
submission wakes it (or, with requests pending, until ``UNISON_CYCLE_TIME``
passes), then runs a cycle: for each process set this rank belongs to, a
negotiation round (:mod:`.controller`) decides which names every rank has
submitted, and the executor (:mod:`.executor`) runs them, fused. Ranks with
nothing pending still take part in a cycle every ``IDLE_CYCLE_S`` so a peer that
waits on them, a join or a shutdown is never stuck; waiting inside a cycle
sleeps after a brief spin, so an idle engine costs ~1.6% of a core (20 ms idle
cycles; at 5 ms it was 5%, mostly that spin: docs/engine.md). A submission
wakes the thread at once, so the idle period adds no latency.

Errors: an exception in the thread fails every pending handle with that same
exception object (its traceback intact) and is raised again by every later
call. A rank's ``shutdown()`` fails every rank's pending handles promptly.

[Note: no handle left behind] Every accepted request sits in ``_inflight`` from
``submit`` until the executor has completed its handle. Whatever ends the thread
(a shutdown flag from any rank, an exception), :meth:`Engine._close` runs last:
under the lock it marks the engine stopped, so ``submit`` and ``join`` refuse from
then on, and it fails every request still in ``_inflight`` and every join handle.
So no handle can be queued after the last cycle and never completed; and a
``Handle.wait`` that outlives its engine thread raises as well.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from unison.common import runtime
from unison.common.config import Config
from unison.common.engine.autotune import Autotuner
from unison.common.engine.controller import (
    FLAG_IDLE,
    FLAG_SHUTDOWN,
    FLAG_STALL_ABORT,
    FLAG_STALL_CHECK,
    FLAG_TIMELINE,
    Controller,
    wait,
)
from unison.common.engine.errors import DuplicateNameError, JoinError, ShutdownError, StallError, process_failure
from unison.common.engine.executor import Executor
from unison.common.engine.handles import Handle, wake_waiters
from unison.common.engine.process_sets import ProcessSet, not_registered
from unison.common.engine.requests import AUTO_NAME_MARK, Kind, Request
from unison.common.engine.stalls import stall_flags, stall_round
from unison.common.engine.timeline import Timeline, row
from unison.common.engine.watchdog import Watchdog
from unison.common.exceptions import MismatchError
from unison.common.ops import ReduceOp

__all__ = ["Engine", "StallError", "ShutdownError", "DuplicateNameError", "JoinError"]

logger = logging.getLogger(__name__)

IDLE_CYCLE_S = 0.02
_caller = threading.local()


class _CallerWaits:
    """The context of :func:`caller_waits` (a class: a generator-based context manager costs a few
    microseconds of every blocking call)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _caller.waits = True

    def __exit__(self, *exc: object) -> None:
        _caller.waits = False


_CALLER_WAITS = _CallerWaits()


def caller_waits() -> _CallerWaits:
    """Submissions inside are waited for at once by the submitting thread: ``submit`` leaves
    the engine thread asleep, since the waiter will run the cycle itself ([Note: a waiter runs
    the cycle]); blocking collectives wrap their submission in it."""
    return _CALLER_WAITS


#: at most this many cycles run on a waiting caller's thread per wait ([Note: a waiter runs the cycle])
INLINE_CYCLES = 8
#: how long ``stop()`` waits for the last cycle before failing what is left itself
STOP_TIMEOUT_S = 30.0

_PEER_SHUTDOWN = ("a rank called unison.shutdown() (or exited) while this collective was pending; every "
                  "rank must finish its collectives, or call unison.join(), before shutting down")
_STOPPED = ("the Unison engine has stopped (unison.shutdown() was called on some rank, or a rank "
            "exited); call unison.init() again to restart it")


def shutdown_message(stopping: list[int], me: int) -> str:
    """Why a pending collective failed, naming the ranks (of the job) that shut down."""
    who = ", ".join(str(r) + (" (this rank)" if r == me else "") for r in stopping)
    return (f"rank{'s' if len(stopping) > 1 else ''} {who} shut down (unison.shutdown() or the process "
            "exited) while this collective was pending; every rank must finish its collectives, or "
            "call unison.join(), before shutting down")


class _SetState:
    def __init__(self, ps: ProcessSet, comm: Any, mpi: Any, config: Config, timeline: Timeline, sid: int) -> None:
        self.ps = ps
        self.comm = comm
        # (sid passed in: a set is activated before its id is handed back to ps; its controller had id 0,
        # so a stall round on it left its failed requests in flight, under the global set's id)
        self.controller = Controller(comm, mpi, config.cache_capacity, sid, ps.ranks)
        self.executor = Executor(comm, mpi, config.chunk_bytes, timeline, sid, ps.ranks)
        self.last_stall_report = 0.0

    def world_ranks(self, ranks: list[int]) -> list[int]:
        """Ranks of this set's communicator as ranks of the job."""
        return ranks if self.ps.ranks is None else [self.ps.ranks[r] for r in ranks]

    def close(self, error: BaseException) -> list[Request]:
        """Fail this set's pending requests with ``error``, free its communicator; returns them."""
        failed = list(self.controller.pending.values())
        self.controller.fail_all(error)
        self.comm.Free()
        return failed


class Engine:
    """Owns the background thread, the queue and the per-process-set negotiation."""

    def __init__(self, comm: Any, mpi: Any, config: Config, rank: int) -> None:
        self.mpi = mpi
        self.config = config
        self.rank = rank
        self.timeline = Timeline()
        self.fusion_threshold = config.fusion_threshold
        self.cycle_time = config.cycle_time / 1000.0
        #: a request's algorithm when its caller named none: the job's setting for the op (each
        #: rank's own, carried in the signature, so ranks set differently raise a mismatch)
        self._algorithms = {Kind.ALLREDUCE: config.allreduce_algorithm, Kind.ALLGATHER: config.allgather_algorithm,
                            Kind.BROADCAST: config.broadcast_algorithm,
                            Kind.REDUCESCATTER: config.reducescatter_algorithm,
                            Kind.ALLTOALL: config.alltoall_algorithm}
        self._cv = threading.Condition()
        self._queue: deque[Request] = deque()
        #: (process set, name) -> request, from submit until its handle completes
        self._inflight: dict[tuple[int, str], Request] = {}
        #: unnamed calls whose reused name is still in flight, in submission order
        #: ([Note: unnamed calls reuse names] in frontend.py)
        self._held: dict[tuple[int, str], deque[Request]] = {}
        self._sets: dict[int, _SetState] = {}
        self._set_objs: list[ProcessSet | None] = []  # by id; None once removed (ids are never reused)
        self._error: BaseException | None = None
        #: set by stop() (this rank asks every rank to stop) and by _close(); read under the lock
        self._stopping = False
        self._stopped = threading.Event()
        self._exit_error: BaseException = ShutdownError(_STOPPED)
        #: what later calls raise once stopped (names the ranks that shut down, once known)
        self._stopped_text = _STOPPED
        #: a peer's shutdown, as the error of this rank's pending handles (set by the last cycle)
        self._peer_shutdown: ShutdownError | None = None
        self._timeline_toggle = False
        self._join_handles: list[Handle] = []
        self._sleeping = False
        #: when the current (or last) cycle began: the watchdog times cycles with it
        self._cycle_since = time.monotonic()
        #: held for every cycle, by the engine thread or by a waiter running one ([Note: a waiter
        #: runs the cycle])
        self._cycle_lock = threading.Lock()
        #: what a waiter's cycle left for the engine thread: ("stop", None) or ("error", exc)
        self._handed_over: tuple[str, BaseException | None] | None = None
        #: a submission woke the sleeping engine thread, which is on its way to run the cycle
        self._woken = False
        #: why this rank gave up on its collectives, while it does ([Note: abandoned collectives])
        self._abandon: str | None = None
        self.autotuner = Autotuner(config, rank) if config.autotune else None
        self._removed_bytes = 0  # agreed bytes of removed sets of every rank (autotune's running count)
        gps = ProcessSet()
        gps.process_set_id = 0
        self._set_objs.append(gps)
        self._sets[0] = _SetState(gps, comm, mpi, config, self.timeline, 0)
        self._world = comm
        if config.timeline and rank == 0:
            self.timeline.start(config.timeline)
        # (a Config field added with settings validation; absent or 0: off)
        limit = float(getattr(config, "collective_timeout_seconds", 0.0) or 0.0)
        self._watchdog = Watchdog(self, limit) if limit > 0 else None
        self._thread = threading.Thread(target=self._run, name="unison-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- public side
    def add_process_set(self, ps: ProcessSet) -> ProcessSet:
        """Register ``ps`` (collective: every rank, same order). Returns it with its id.

        The communicator is created by the engine thread, as a negotiated request
        of the global set: every rank creates it at the same point of the same
        cycle and starts negotiating on it from the next cycle. (Created from the
        calling thread, it would race the engine's own collectives on the global
        communicator, and ranks could start cycling the new set at different
        cycles, each waiting inside a different set's round for the other.)
        """
        if self._registered(ps):
            return ps
        ranks = ps.ranks or []
        size = self._world.Get_size()
        with self._cv:
            sid = len(self._set_objs)
            self._set_objs.append(ps)
        try:
            self._agree_on_ranks(ranks, sid)
            bad = [r for r in ranks if not 0 <= r < size]
            if bad or not ranks:  # (the same list on every rank by now: raised on every rank)
                raise ValueError(f"ProcessSet ranks {ranks} must be non-empty and within [0, {size})")
        except BaseException:
            with self._cv:
                if self._set_objs[-1] is ps:
                    self._set_objs.pop()
            raise

        def activate() -> None:
            group = self._world.Get_group().Incl(ranks)
            comm = self._world.Create_group(group)
            group.Free()
            if comm != self.mpi.COMM_NULL:
                self._sets[sid] = _SetState(ps, comm, self.mpi, self.config, self.timeline, sid)

        name = f"unison.add_process_set.{sid}"
        req = Request(name=name, kind=Kind.BARRIER, array=np.asarray(ranks, dtype=np.int64),
                      handle=Handle(name), action=activate)
        try:
            self.submit(req).wait()
        except BaseException:
            with self._cv:  # refused on every rank alike (e.g. a rank had joined): ids stay aligned
                if self._set_objs[-1] is ps:
                    self._set_objs.pop()
            raise
        ps.process_set_id = sid
        return ps

    def _registered(self, ps: ProcessSet) -> bool:
        """Whether ``ps`` is registered with this engine (an id from an engine before a shutdown is not)."""
        sid = ps.process_set_id
        return sid is not None and sid < len(self._set_objs) and self._set_objs[sid] is ps

    def _agree_on_ranks(self, ranks: list[int], sid: int) -> None:
        """Raise MismatchError on every rank when the ranks passed different rank lists for set ``sid``:
        one all-reduce (MAX) of a digest and its negation, so it also runs while a rank has joined
        (which then refuses the registration itself, as before). The registering barrier compared
        only the lists' lengths: lists of one length with other members created the group with
        different ranks, and they hung in it."""
        digest = hashlib.sha256(np.asarray(ranks, dtype=np.int64).tobytes()).digest()
        mine = np.array([len(ranks), int.from_bytes(digest[:7], "little")], dtype=np.int64)
        name = f"unison.add_process_set.{sid}.ranks"
        both = np.asarray(self.submit(Request(name=name, kind=Kind.ALLREDUCE, array=np.concatenate([mine, -mine]),
                                              handle=Handle(name), op=int(ReduceOp.MAX))).wait())
        if (both[:2] == -both[2:]).all():
            return
        raise MismatchError(f"unison.add_process_set: the ranks passed different rank lists (this rank, "
                            f"{self.rank}, passed {ranks}); pass the same ProcessSet on every rank, in the "
                            "same order")

    def remove_process_set(self, ps: ProcessSet) -> bool:
        """Unregister ``ps`` (collective: every rank, same order); False for the global or an unknown set.

        Like :meth:`add_process_set`, a negotiated request of the global set: every rank
        drops the set's negotiation state and frees its communicator at the same point of
        the same cycle, so no member is left cycling a set the others have dropped. A
        request still pending on the set fails with ``ValueError``. The set's id is not
        reused; ``ps.process_set_id`` becomes None (the object can be added again).
        """
        sid = ps.process_set_id
        if sid is None or sid == 0 or ps.ranks is None or sid >= len(self._set_objs) \
                or self._set_objs[sid] is not ps:
            return False

        def deactivate() -> None:
            st = self._sets.pop(sid, None)
            if st is not None and st.controller.size == self._sets[0].controller.size:
                self._removed_bytes += st.executor.agreed_bytes  # autotune's count must not fall back
            if st is not None:
                self._forget(st.close(ValueError(
                    f"{ps!r} was removed (unison.remove_process_set) while this collective on it was "
                    "pending; finish a set's collectives before removing it")))

        name = f"unison.remove_process_set.{sid}"
        req = Request(name=name, kind=Kind.BARRIER, array=np.asarray(ps.ranks, dtype=np.int64),
                      handle=Handle(name), action=deactivate)
        self.submit(req).wait()
        ps.process_set_id = None
        with self._cv:  # the id stays taken; the object (and its unnamed-call counters) is let go (a leak audit:
            self._set_objs[sid] = None  # 2 KB per added and removed set, kept for the engine's life)
        return True

    def process_set(self, ps: ProcessSet | None) -> _SetState:
        sid = 0 if ps is None else ps.process_set_id
        if sid is None or (ps is not None and ps.ranks is not None and not self._registered(ps)):
            raise not_registered(ps)
        state = self._sets.get(sid)
        if state is None:
            raise ValueError(f"this rank ({self.rank}) is not a member of {ps!r}")
        return state

    def check(self) -> None:
        """Raise the background thread's error, or a shutdown error, if any."""
        if self._error is not None:
            raise self._error
        if self._stopping or self._stopped.is_set():
            raise ShutdownError(self._stopped_text)

    def alive(self) -> bool:
        """Whether the engine thread still runs (handles can still complete)."""
        return not self._stopped.is_set()

    def exit_error(self) -> BaseException:
        """What a handle left pending by a stopped engine raises."""
        return self._error or self._exit_error

    def submit(self, req: Request) -> Handle:
        """Queue ``req`` (its process set was checked by the caller) and wake the thread.

        Raises:
            DuplicateNameError: ``req.name`` is already in flight on this rank (Horovod raises
                its ValueError at submission too).
            ShutdownError: the engine stopped (or the thread's own error, if it failed).
        """
        if not req.algorithm:
            req.algorithm = self._algorithms.get(req.kind, "auto")
        key = (req.process_set, req.name)
        with self._cv:
            if not self._stopping and key in self._inflight and AUTO_NAME_MARK in req.name:
                req.handle._engine = self  # an unnamed call's reused name: it runs after the last one
                self._held.setdefault(key, deque()).append(req)  # (its negotiation begins when released)
                return req.handle
            if not self._stopping and key not in self._inflight:
                if self.timeline.active:  # (begun before it is queued: the engine thread may end it at once)
                    self.timeline.begin(row(*key), "NEGOTIATE_" + req.kind.name, req.submitted)
                self._inflight[key] = req
                self._queue.append(req)
                req.handle._engine = self
                if self._sleeping and not getattr(_caller, "waits", False):
                    self._cv.notify()
                    self._woken = True
                return req.handle
        self.check()
        raise DuplicateNameError(
            f"a collective named {req.name!r} is already in flight on this rank; wait for it "
            "(unison.synchronize) before submitting the name again, or use another name")

    def join(self) -> Handle:
        handle = Handle("unison.join")
        handle._engine = self
        with self._cv:
            if not self._stopping:
                self._join_handles.append(handle)
                self._cv.notify()
                return handle
        self.check()
        raise ShutdownError(self._stopped_text)  # (check() raised already)

    def start_timeline(self, path: str) -> None:
        if self.rank == 0:
            self.timeline.start(path)
        with self._cv:
            self._timeline_toggle = True
            self._cv.notify()

    def stop_timeline(self) -> None:
        if self.rank == 0:
            self.timeline.stop()
        with self._cv:
            self._timeline_toggle = True
            self._cv.notify()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the thread after one last cycle that tells the other ranks."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("[unison rank %d] the engine thread did not stop within %g s (it waits in a "
                         "collective that another rank left); failing its pending requests", self.rank,
                         timeout)
            self._close(ShutdownError(f"the Unison engine did not stop within {timeout:g} s at "
                                      "unison.shutdown(): some rank stopped taking part"), thread_ended=False)
        elif self._error is None:
            self._free_communicators()
        if self.rank == 0:
            self.timeline.stop()
        if self.autotuner is not None:
            self.autotuner.close()

    def _free_communicators(self) -> None:
        """Free the communicators of every set (the job's duplicate included) once the thread has ended.

        Before 2026-12-06 they were never freed (a leak audit): each ``init()``/``shutdown()`` kept three
        communicators (six with a process set), and Open MPI keeps about 65,000, so a job that re-initialises
        (the elastic reset, a test suite) would run out. Only after a clean stop: after a failure (a dead
        rank under ULFM) the communicators are revoked, and the recovery that follows owns what is left.
        """
        with self._cv:
            sets, self._sets = list(self._sets.values()), {}
        if self.mpi.Is_finalized():  # (the program finalized MPI itself: freeing now would abort)
            return
        for st in sets:
            try:
                st.comm.Free()
            except Exception:  # noqa: BLE001 - MPI already finalized (a stop at interpreter exit)
                logger.debug("a process set's communicator was already freed", exc_info=True)

    # ------------------------------------------------------------- the thread
    def _run(self) -> None:
        error: BaseException = ShutdownError(_PEER_SHUTDOWN)
        try:
            while not self._cycle():
                pass
            error = self._peer_shutdown or error
        except BaseException as exc:  # noqa: BLE001 - handed to every caller
            failure = process_failure(exc, self.mpi)
            if failure is not None:  # a peer died (ULFM): release the survivors, see [Note: process failure]
                self.revoke()
                exc = failure
            elif not isinstance(exc, Exception):  # an interrupt mid-cycle: the peers wait in it (runtime's Note)
                self._broken(exc)
            logger.error("[unison rank %d] engine thread failed: %r", self.rank, exc)
            self._error = error = exc
        finally:
            self._close(error)

    def _broken(self, exc: BaseException) -> None:
        """Have the job aborted when this process exits: ``exc`` (a ``KeyboardInterrupt``, a ``SystemExit``)
        ended the engine inside a cycle its peers take part in ([Note: an engine that ends inside a cycle
        aborts the job at exit] in runtime.py). An ordinary exception reaches the callers, and an uncaught one
        aborts the job already (the runtime's excepthook)."""
        if not self.config.abort_on_error:
            return
        status = 130 if isinstance(exc, KeyboardInterrupt) else 1
        if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code:
            status = exc.code
        runtime.abort_at_exit(status, f"its Unison engine stopped inside a collective cycle ({type(exc).__name__}"
                                      f"{f': {exc}' if str(exc) else ''})")

    def revoke(self) -> None:
        """Revoke every communicator of this engine (ULFM; a no-op without it).

        [Note: process failure] Under ``mpirun --with-ft ulfm`` a collective that involves a
        dead rank fails (``ERR_PROC_FAILED``), but survivors waiting only on each other (a
        ring step between two live ranks) would wait on. Revoking the communicators makes
        every pending and later operation on them fail on every survivor (``ERR_REVOKED``),
        so every engine thread ends and hands :class:`UnisonInternalError` to its handles.
        """
        for st in list(self._sets.values()):
            try:
                st.comm.Revoke()
            except Exception:  # noqa: BLE001 - no ULFM, or already revoked: nothing to release
                logger.debug("revoke failed", exc_info=True)

    def registered_sets(self) -> list[ProcessSet]:
        """Every process set registered with this engine (the global one first; removed ones are not)."""
        with self._cv:
            return [ps for ps in self._set_objs if ps is not None]

    def _close(self, error: BaseException, thread_ended: bool = True) -> None:
        """Refuse new work and fail every handle still pending (see [Note: no handle left behind])."""
        with self._cv:
            self._stopping = True
            self._exit_error = error
            requests = list(self._inflight.values()) + [r for q in self._held.values() for r in q]
            self._inflight.clear()
            self._held.clear()
            self._queue.clear()
            joins, self._join_handles = self._join_handles, []
            # unregistered with this engine: a later init()'s engine gives them ids afresh (they kept theirs,
            # another set's there: its data, silently)
            for sid, obj in enumerate(self._set_objs):
                if sid and obj is not None and obj.process_set_id == sid:
                    obj.process_set_id = None
        for req in requests:
            req.handle.set_error(error)
            self.timeline.close_open(row(req.process_set, req.name))
        for handle in joins:
            handle.set_error(error)
        if thread_ended:
            self._stopped.set()
            if self._watchdog is not None:
                self._watchdog.stop()
        wake_waiters()

    def abandon(self, reason: str | None) -> None:
        """Fail, on every member, the pending collectives of each process set this rank belongs to,
        from the next cycle on and for as long as ``reason`` is set; ``None`` ends it.

        [Note: abandoned collectives] A rank that gives up on a piece of work (a pipeline stage
        that raised) will not submit the collectives its peers may already wait on (the tensor
        group's all-reduces inside the stage): they would wait for ever, since stall shutdown is
        off by default. While abandoning, each of this rank's cycles asks for a stall round
        (``FLAG_STALL_ABORT``) in which every member fails its pending handles with a
        ``StallError`` carrying ``reason``: a member's late submission fails in the next of those
        rounds (this rank's engine runs an idle cycle at least every ``IDLE_CYCLE_S``). Nothing is
        remembered past the abandon: before 2026-12-05 the names this rank never submitted were
        marked, so its next step's call of such a name failed at once while its peers' waited (a
        deadlock). The caller ends it once every rank has left the work (the pipeline driver: after
        its end-of-step agreement).
        """
        with self._cv:
            self._abandon = reason
            if reason is not None and self._sleeping:
                self._cv.notify()

    # [Note: a peer with nothing to offer]
    # A rank with nothing pending takes part in a round every IDLE_CYCLE_S; one with pending work waits
    # the cycle time between rounds, to gather more tensors to fuse. Both wait in a round for the other.
    # So an idle rank often sat in a round that a busy peer would join only at the end of its cycle time,
    # and what it submitted meanwhile missed that round (its row was sent when it entered): the next round
    # came a cycle time later, two in all (measured with a 500 ms cycle time: 1.0 s a step, 2.0 s with
    # 1 s). Each round now says whether some rank had nothing pending (FLAG_IDLE, as the other any-rank
    # flags); a rank with pending work then goes into the next round at once, without its cycle time:
    # nothing of its can complete before the idle rank submits, and waiting in the round (sleeping, as any
    # wait in a round) it is there when that rank's round comes, so the idle rank never waits in one and
    # enters the round after its submission at once. Once every rank has work, the cycle time applies
    # again. (Before 2026-12-07, an audit.)
    _peer_idle = False

    def _busy(self) -> bool:
        return any(st.controller.has_work() for st in self._sets.values()) or bool(self._join_handles)

    def _cycle(self) -> bool:
        """Sleep until there is work (or an idle cycle is due), then run one cycle; returns True
        when the engine should stop."""
        with self._cv:
            if (not self._queue and not self._stopping and not self._timeline_toggle
                    and self._handed_over is None):
                self._sleeping = True
                busy = self._busy()
                if not (busy and self._peer_idle):  # [Note: a peer with nothing to offer]
                    self._cv.wait(self.cycle_time if busy else IDLE_CYCLE_S)
                self._sleeping = False
        with self._cycle_lock:
            self._woken = False
            handed = self._handed_over  # read under the lock: a waiter's cycle may have just ended
            if handed is not None:  # it saw the end ([Note: a waiter runs the cycle])
                if handed[1] is not None:
                    raise handed[1]
                return True
            return self._run_cycle()

    def progress(self, handle: Handle) -> None:
        """Run cycles on the calling thread until ``handle`` completes, at most ``INLINE_CYCLES``
        of them, when no cycle is running; return at once otherwise.

        [Note: a waiter runs the cycle] A lone blocking collective used to cost two thread
        wake-ups per rank: the engine thread's, to negotiate and run it, and the caller's, to
        return its result (on a loaded machine each is tens of microseconds). A thread that
        is about to block on a handle may instead run the cycle itself, under the same
        ``_cycle_lock`` the engine thread takes for each of its cycles, so cycles stay one at a
        time and in the same order on every rank whichever thread runs them (a rank's cycle k
        pairs with every other rank's cycle k, as before). When the engine thread holds the
        lock, the waiter just waits. What would end the engine thread inside a waiter's cycle
        (an exception, every rank's shutdown flag) is handed to the engine thread, which ends
        as if its own cycle had seen it: it fails the pending handles, this one included, and
        the waiter's ordinary wait raises that error. A ``KeyboardInterrupt`` (or any
        ``BaseException``) inside a waiter's cycle leaves that cycle half done, so it ends
        the engine the same way and is raised again at once.
        """
        if self._stopping or self._woken or threading.current_thread() is self._thread:
            return  # (woken: the engine thread is about to run the cycle; racing it costs more)
        error: BaseException | None = None  # (set before the lock is taken: an interrupt between the two
        stop = False                         # would leave it held; Python checks for signals at calls and jumps)
        if not self._cycle_lock.acquire(blocking=False):
            # another waiter's cycle: it may end without running this handle's request, which
            # was submitted without waking the engine thread; wake it, to run the next cycle
            with self._cv:
                if self._sleeping:
                    self._cv.notify()
                    self._woken = True
            return
        try:
            for _ in range(INLINE_CYCLES):
                if handle._done or self._stopping or self._handed_over is not None:
                    break
                if self._run_cycle():
                    stop = True
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the engine thread, below
            error = exc
            if not isinstance(exc, Exception):  # (marked here, before it reaches the program and its exit)
                self._broken(exc)
        finally:
            try:
                if stop or error is not None:  # set before the lock is free: no cycle may follow it
                    with self._cv:
                        if self._handed_over is None:
                            self._handed_over = ("error", error) if error is not None else ("stop", None)
                        self._cv.notify()
            finally:  # (released even when an interrupt lands here)
                self._cycle_lock.release()
        if error is not None and not isinstance(error, Exception):
            raise error
        if not (stop or error is not None):  # the engine thread goes on with what is left
            with self._cv:
                if self._sleeping and (self._queue or not handle._done):
                    self._cv.notify()

    def _run_cycle(self) -> bool:
        """One cycle over every process set (the caller holds ``_cycle_lock``); True to stop."""
        with self._cv:
            self._cycle_since = time.monotonic()
            new = list(self._queue)
            self._queue.clear()
            stopping = self._stopping
            self._timeline_toggle = False  # (it only woke the thread: the flag below is a level)
            joins = bool(self._join_handles)
            abandon = self._abandon
        for req in new:
            st = self._sets.get(req.process_set)
            if st is None:  # removed (by another thread's remove_process_set) after it was checked
                req.handle.set_error(ValueError(f"process set {req.process_set} was removed before "
                                                f"{req.name!r} could run on it; register a set again"))
                self._forget([req])
            elif not st.controller.add(req):  # failed at once
                self._forget([req])
        if joins:  # joined in every set this rank belongs to: members' allreduces there get its identity
            for st in self._sets.values():
                if not st.controller.joined:
                    st.controller.join()
        stop = False
        peer_idle = False
        for sid in sorted(self._sets):
            st = self._sets.get(sid)
            if st is None:  # removed by this cycle's remove_process_set (on every member alike)
                continue
            flags = FLAG_SHUTDOWN if stopping else 0
            if self.rank == 0 and self.timeline.active:  # a level, raised every cycle while rank 0 records:
                flags |= FLAG_TIMELINE  # (a toggle missed the env-started timeline and a restarted one)
            others = self._other_controllers(sid)
            flags |= stall_flags(st.controller, self.config, st.last_stall_report, others)
            if abandon is not None:
                flags |= FLAG_STALL_ABORT
            self.timeline.flush()  # what was recorded is on disk before a collective that may hang
            responses, any_flags, all_joined = st.controller.cycle(flags)
            if any_flags & FLAG_IDLE and st.controller.pending:
                peer_idle = True
            if any_flags & FLAG_STALL_CHECK:  # on every member: one check a period, not one per rank's clock
                st.last_stall_report = time.monotonic()
            if any_flags & (FLAG_STALL_CHECK | FLAG_STALL_ABORT):
                self._stall_round(st, abandon, others)
            st.executor.run(responses, self.fusion_threshold)
            if responses:
                self._forget([resp.request for resp in responses if resp.request is not None])
            if all_joined and sid == 0:
                self._finish_join(st)
            if any_flags & FLAG_SHUTDOWN:
                if sid == 0:
                    self._who_shut_down(st, stopping)
                stop = True
        self._peer_idle = peer_idle
        self.timeline.flush()  # a job that then sleeps, or is killed, keeps this cycle's events
        if self.autotuner is not None:
            every = self._sets[0].controller.size  # sets of every rank count alike on every rank
            agreed = self._removed_bytes + sum(s.executor.agreed_bytes for s in self._sets.values()
                                               if s.controller.size == every)
            self._apply_tuning(self.autotuner.step(self._sets[0], agreed))
        return stop

    def _who_shut_down(self, st: _SetState, stopping: bool) -> None:
        """Collective on the global set, in the cycle every rank sees ``FLAG_SHUTDOWN``: which
        ranks asked to stop. Pending handles then fail with a message naming them."""
        mine = np.array([1 if stopping else 0], dtype=np.uint8)
        every = np.empty(st.controller.size, dtype=np.uint8)
        wait(st.comm.Iallgather(mine, every))
        ranks = [r for r in range(every.size) if every[r]]
        text = shutdown_message(ranks, self.rank)
        self._peer_shutdown = ShutdownError(text)
        self._stopped_text = f"the Unison engine has stopped: {text}. Call unison.init() again to restart it"

    def _forget(self, done: list[Request]) -> None:
        """Requests whose handles completed leave ``_inflight``; wake their waiters."""
        with self._cv:
            inflight = self._inflight
            for req in done:
                key = (req.process_set, req.name)
                if inflight.get(key) is req:
                    del inflight[key]
                    if self._held:
                        self._release(key)
        if self.timeline.active:
            for req in done:
                if req.handle._error is not None:
                    self.timeline.close_open(row(req.process_set, req.name))
        wake_waiters()

    def _release(self, key: tuple[int, str]) -> None:
        """Queue the next unnamed call held for ``key``'s name, now free (under ``_cv``)."""
        held = self._held.get(key)
        if not held:
            return
        req = held.popleft()
        if not held:
            del self._held[key]
        self._inflight[key] = req
        # held since its submission, it negotiates from now (before 2026-12-07 its slice began at the
        # submission, inside its predecessor's on the same row, and the predecessor's end closed it)
        if self.timeline.active:
            self.timeline.begin(row(*key), "NEGOTIATE_" + req.kind.name)
        self._queue.append(req)
        if self._sleeping:
            self._cv.notify()

    def _finish_join(self, st: _SetState) -> None:
        """Every rank joined: ``join()`` returns the last rank to join, on every rank.

        Collectives refused while this rank had joined raised :class:`JoinError` on the
        ranks that submitted them; this rank is told in a warning (Horovod's joined rank
        returns normally from ``join()``, and scripts rely on it).
        """
        last, refused = st.controller.finish_join()
        for other in self._sets.values():  # (every rank finishes in this same cycle: all are in set 0)
            if other is not st and other.controller.joined:
                refused += other.controller.finish_join()[1]
        with self._cv:
            handles, self._join_handles = self._join_handles, []
        if refused and handles:
            logger.warning("[unison rank %d] while this rank had joined, other ranks ran collectives a "
                           "joined rank cannot take part in; they raised JoinError there: %s. Only "
                           "allreduce and barrier work with join: run the others before join() on "
                           "every rank", self.rank, "; ".join(refused))
        for h in handles:
            h.set_result(last)
        wake_waiters()

    # ------------------------------------------------------------- timeouts
    def overdue(self, now: float, limit: float) -> tuple[list[Request], float]:
        """(requests submitted more than ``limit`` s ago, oldest first; seconds in the current cycle)."""
        with self._cv:
            old = [req for req in self._inflight.values() if now - req.submitted > limit]
            # only while this rank waits on something: an idle cycle held up by a busy peer (one long call
            # holding its GIL) ended the job with nothing pending anywhere (before 2026-12-05); a stuck
            # cycle is still caught once a request is submitted and goes overdue
            busy_for = 0.0
            if self._cycle_lock.locked() and self._inflight:  # (from the first request: the wait it caused)
                since = max(self._cycle_since, min(req.submitted for req in self._inflight.values()))
                busy_for = now - since
        return sorted(old, key=lambda req: req.submitted), busy_for

    def arrival(self, req: Request) -> str:
        """What this rank knows of which ranks submitted ``req`` (read from another thread)."""
        st = self._sets.get(req.process_set)
        if st is None:
            return "not negotiated yet"
        ctl = st.controller
        entry = ctl.table.get(req.name)
        if entry is not None:
            joined = set(ctl.joined_ranks)
            missing = [r for r in range(ctl.size) if r not in entry and r not in joined]
            return f"not submitted by rank(s) {st.world_ranks(missing)}"
        if ctl.pending.get(req.name) is req:
            if req.name in ctl.to_announce:  # (it was called a cached name, which it is not)
                return ("waiting in negotiation: not yet announced to the other ranks (the engine thread "
                        "is held up in an earlier negotiation or collective)")
            return ("waiting in negotiation (a cached name: which ranks have not submitted it is not "
                    "known here; UNISON_STALL_CHECK_TIME_SECONDS names them)")
        if req in self._queue:
            return "not negotiated yet: the engine thread is still in an earlier cycle"
        return "submitted by every rank; its collective has not finished (some rank stopped taking part)"

    # ------------------------------------------------------------- stalls
    def _other_controllers(self, sid: int) -> list[Controller]:
        """For the job's own set (0), this rank's other sets' controllers: the job-wide deadlock check
        judges them with it ([Note: a deadlock is a stall nobody can end]); none for any other set."""
        if sid != 0 or len(self._sets) == 1:
            return []
        return [other.controller for k, other in sorted(self._sets.items()) if k != 0]

    def _stall_round(self, st: _SetState, abandon: str | None = None,
                     others: list[Controller] | None = None) -> None:
        """Collective over the set (see :mod:`.stalls`); drop the handles it failed from ``_inflight``
        (the ``others`` sets' too: a job-wide deadlock fails theirs)."""
        if abandon is not None:
            # Read again: the cycle's negotiation may have waited for peers that started new work
            # after the caller ended the abandon (a pipeline's next step, its gradient all-reduce
            # already pending): the reason read when the cycle began would fail that work.
            with self._cv:
                abandon = self._abandon
        others = others or []
        if stall_round(st.controller, self.mpi, self.config, abandon, st.world_ranks, self.rank,
                       others) is not None:
            sids = {st.controller.set_id, *(c.set_id for c in others)}
            with self._cv:
                failed = [k for k, r in self._inflight.items() if k[0] in sids and r.handle.done()]
                for k in failed:
                    del self._inflight[k]
                    self._release(k)
            for k in failed:
                self.timeline.close_open(row(*k))
            wake_waiters()

    def _apply_tuning(self, params: tuple[int, float] | None) -> None:
        if params is not None:
            self.fusion_threshold, cycle_ms = params
            self.cycle_time = cycle_ms / 1000.0
