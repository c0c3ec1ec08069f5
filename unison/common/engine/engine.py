"""The engine: one background thread per process owns all engine communication.

Callers submit named requests and get handles. The thread sleeps until a
submission wakes it (or, with requests pending, until ``UNISON_CYCLE_TIME``
passes), then runs a cycle: for each process set this rank belongs to, a
negotiation round (:mod:`.controller`) decides which names every rank has
submitted, and the executor (:mod:`.executor`) runs them, fused. Ranks with
nothing pending still take part in a cycle every ``IDLE_CYCLE_S`` so a peer that
waits on them, a join or a shutdown is never stuck; waiting inside a cycle
sleeps rather than spins, so an idle engine costs next to no CPU.

Errors: an exception in the thread fails every pending handle with that same
exception object (its traceback intact) and is raised again by every later
call. A rank's ``shutdown()`` fails every rank's pending handles promptly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from unison.common.config import Config
from unison.common.engine.autotune import Autotuner
from unison.common.engine.controller import (
    FLAG_SHUTDOWN,
    FLAG_STALL_ABORT,
    FLAG_STALL_CHECK,
    FLAG_TIMELINE,
    Controller,
)
from unison.common.engine.executor import Executor
from unison.common.engine.handles import Handle, wake_waiters
from unison.common.engine.process_sets import ProcessSet
from unison.common.engine.requests import Kind, Request
from unison.common.engine.timeline import Timeline
from unison.common.exceptions import UnisonError

__all__ = ["Engine", "StallError", "ShutdownError", "DuplicateNameError"]

logger = logging.getLogger(__name__)

IDLE_CYCLE_S = 0.005


class StallError(UnisonError):
    """Some ranks submitted a tensor that others never did, for too long."""


class ShutdownError(UnisonError):
    """The engine stopped (this or another rank shut down) with the request pending."""


class DuplicateNameError(UnisonError, ValueError):
    """A name was submitted again while the first submission is still in flight."""


class _SetState:
    def __init__(self, ps: ProcessSet, comm: Any, mpi: Any, config: Config, timeline: Timeline) -> None:
        self.ps = ps
        self.comm = comm
        self.controller = Controller(comm, mpi, config.cache_capacity, ps.process_set_id or 0)
        self.executor = Executor(comm, mpi, config.chunk_bytes, timeline)
        self.last_stall_report = 0.0


class Engine:
    """Owns the background thread, the queue and the per-process-set negotiation."""

    def __init__(self, comm: Any, mpi: Any, config: Config, rank: int) -> None:
        self.mpi = mpi
        self.config = config
        self.rank = rank
        self.timeline = Timeline()
        self.fusion_threshold = config.fusion_threshold
        self.cycle_time = config.cycle_time / 1000.0
        self._cv = threading.Condition()
        self._queue: deque[Request] = deque()
        self._inflight: set[tuple[int, str]] = set()
        self._sets: dict[int, _SetState] = {}
        self._set_objs: list[ProcessSet] = []
        self._error: BaseException | None = None
        self._stopping = False
        self._stopped = threading.Event()
        self._timeline_toggle = False
        self._join_handles: list[Handle] = []
        self._running: list = []  # responses being executed, failed if the thread dies
        self._sleeping = False
        self.autotuner = Autotuner(config, rank) if config.autotune else None
        gps = ProcessSet()
        gps.process_set_id = 0
        self._set_objs.append(gps)
        self._sets[0] = _SetState(gps, comm, mpi, config, self.timeline)
        self._world = comm
        if config.timeline and rank == 0:
            self.timeline.start(config.timeline)
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
        if ps.process_set_id is not None:
            return ps
        ranks = ps.ranks or []
        size = self._world.Get_size()
        bad = [r for r in ranks if not 0 <= r < size]
        if bad or not ranks:
            raise ValueError(f"ProcessSet ranks {ranks} must be non-empty and within [0, {size})")
        with self._cv:
            sid = len(self._set_objs)
            self._set_objs.append(ps)

        def activate() -> None:
            group = self._world.Get_group().Incl(ranks)
            comm = self._world.Create_group(group)
            group.Free()
            if comm != self.mpi.COMM_NULL:
                self._sets[sid] = _SetState(ps, comm, self.mpi, self.config, self.timeline)

        name = f"unison.add_process_set.{sid}"
        req = Request(name=name, kind=Kind.BARRIER, array=np.asarray(ranks, dtype=np.int64),
                      handle=Handle(name), action=activate)
        self.submit(req).wait()
        ps.process_set_id = sid
        return ps

    def process_set(self, ps: ProcessSet | None) -> _SetState:
        sid = 0 if ps is None else ps.process_set_id
        if sid is None:
            raise ValueError(f"{ps!r} is not registered; pass it to unison.init(process_sets=[...]) or "
                             "unison.add_process_set() on every rank first")
        state = self._sets.get(sid)
        if state is None:
            raise ValueError(f"this rank ({self.rank}) is not a member of {ps!r}")
        return state

    def check(self) -> None:
        """Raise the background thread's error, or a shutdown error, if any."""
        if self._error is not None:
            raise self._error
        if self._stopped.is_set() or self._stopping:
            raise ShutdownError("the Unison engine has stopped (unison.shutdown() was called on some "
                                "rank); call unison.init() again to restart it")

    def submit(self, req: Request) -> Handle:
        """Queue ``req`` (its process set was checked by the caller) and wake the thread."""
        if self._error is not None or self._stopping:
            self.check()
        if self.timeline.active:
            self.timeline.begin(req.name, "NEGOTIATE_" + req.kind.name, req.submitted)
        key = (req.process_set, req.name)
        with self._cv:
            if key in self._inflight:
                req.handle.set_error(DuplicateNameError(
                    f"a collective named {req.name!r} is already in flight on this rank; wait for it "
                    "(unison.synchronize) before submitting the name again, or use another name"))
                return req.handle
            self._inflight.add(key)
            self._queue.append(req)
            if self._sleeping:
                self._cv.notify()
        return req.handle

    def join(self) -> Handle:
        handle = Handle("unison.join")
        self.check()
        with self._cv:
            self._join_handles.append(handle)
            self._cv.notify()
        return handle

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

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after one last cycle that tells the other ranks."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        if self.rank == 0:
            self.timeline.stop()

    # ------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            while not self._cycle():
                pass
        except BaseException as exc:  # noqa: BLE001 - handed to every caller
            logger.error("[unison rank %d] engine thread failed: %r", self.rank, exc)
            self._error = exc
            for resp in self._running:
                if resp.request is not None:
                    resp.request.handle.set_error(exc)
            for st in self._sets.values():
                st.controller.fail_all(exc)
            with self._cv:
                for req in self._queue:
                    req.handle.set_error(exc)
                self._queue.clear()
                for h in self._join_handles:
                    h.set_error(exc)
        finally:
            self._stopped.set()
            wake_waiters()

    def _busy(self) -> bool:
        return any(st.controller.has_work() for st in self._sets.values()) or bool(self._join_handles)

    def _cycle(self) -> bool:
        """One cycle over every process set; returns True when the engine should stop."""
        with self._cv:
            if not self._queue and not self._stopping and not self._timeline_toggle:
                self._sleeping = True
                self._cv.wait(self.cycle_time if self._busy() else IDLE_CYCLE_S)
                self._sleeping = False
            new = list(self._queue)
            self._queue.clear()
            stopping = self._stopping
            toggle, self._timeline_toggle = self._timeline_toggle, False
            joins = bool(self._join_handles)
        for req in new:
            self._sets[req.process_set].controller.add(req)
        if joins and not self._sets[0].controller.joined:
            self._sets[0].controller.join()
        stop = False
        for sid in sorted(self._sets):
            st = self._sets[sid]
            flags = FLAG_SHUTDOWN if stopping else 0
            if toggle and self.rank == 0 and sid == 0:
                flags |= FLAG_TIMELINE
            flags |= self._stall_flags(st)
            responses, any_flags, all_joined = st.controller.cycle(flags)
            if any_flags & (FLAG_STALL_CHECK | FLAG_STALL_ABORT):
                self._stall_round(st)
            self._running = responses
            st.executor.run(responses, self.fusion_threshold)
            self._running = []
            if responses:
                with self._cv:
                    self._inflight.difference_update([(sid, resp.name) for resp in responses])
                wake_waiters()
            if all_joined and sid == 0:
                last = st.controller.finish_join()
                with self._cv:
                    handles, self._join_handles = self._join_handles, []
                for h in handles:
                    h.set_result(last)
                wake_waiters()
            if any_flags & FLAG_SHUTDOWN:
                stop = True
        if self.autotuner is not None:
            self._apply_tuning(self.autotuner.step(self._sets[0]))
        if stop:
            err = ShutdownError("a rank called unison.shutdown() while this collective was pending; "
                                "every rank must finish its collectives before shutting down")
            for st in self._sets.values():
                st.controller.fail_all(err)
            with self._cv:
                for h in self._join_handles:
                    h.set_error(err)
                self._join_handles.clear()
                self._stopping = True
            wake_waiters()
        return stop

    # ------------------------------------------------------------- stalls
    def _stall_flags(self, st: _SetState) -> int:
        cfg = self.config
        if cfg.stall_check_disable or not st.controller.pending:
            return 0
        limit = cfg.stall_check_time_seconds
        if cfg.stall_shutdown_time_seconds:
            limit = min(limit, cfg.stall_shutdown_time_seconds) if limit else cfg.stall_shutdown_time_seconds
        if not limit:
            return 0
        now = time.monotonic()
        oldest = min(req.submitted for req in st.controller.pending.values())
        if now - oldest >= limit and now - st.last_stall_report >= limit:
            st.last_stall_report = now
            return FLAG_STALL_CHECK
        return 0

    def _stall_round(self, st: _SetState) -> None:
        """Collective: rank 0 of the set names stalled tensors and missing ranks; maybe abort."""
        ctl = st.controller
        now = time.monotonic()
        mine = {name: now - req.submitted for name, req in ctl.pending.items()}
        everyone = st.comm.gather((mine, list(ctl.joined_ranks)), root=0)
        decision = None
        if ctl.rank == 0:
            decision = self._judge_stalls(everyone, ctl.size)
        decision = st.comm.bcast(decision, root=0)
        if decision is not None:
            ctl.fail_all(StallError(decision))
            with self._cv:
                self._inflight = {k for k in self._inflight if k[0] != ctl.set_id}
            wake_waiters()

    def _judge_stalls(self, everyone: list, size: int) -> str | None:
        cfg = self.config
        ages: dict[str, float] = {}
        have: dict[str, set[int]] = {}
        joined = set(everyone[0][1])
        for r, (pending, _) in enumerate(everyone):
            for name, age in pending.items():
                ages[name] = max(ages.get(name, 0.0), age)
                have.setdefault(name, set()).add(r)
        lines = []
        worst = 0.0
        for name in sorted(have, key=lambda k: -ages[k]):
            missing = [r for r in range(size) if r not in have[name] and r not in joined]
            if missing and ages[name] >= (cfg.stall_check_time_seconds or ages[name]):
                lines.append(f"{name!r} (waiting {ages[name]:.1f} s) missing on rank(s) {missing}")
                worst = max(worst, ages[name])
        if not lines:
            return None
        report = "; ".join(lines)
        logger.warning("[unison rank 0] stalled collectives: %s. Some ranks submitted these tensors and "
                       "others have not: check that every rank runs the same collectives.", report)
        if cfg.stall_shutdown_time_seconds and worst >= cfg.stall_shutdown_time_seconds:
            return (f"stalled for more than UNISON_STALL_SHUTDOWN_TIME_SECONDS="
                    f"{cfg.stall_shutdown_time_seconds:g} s: {report}")
        return None

    def _apply_tuning(self, params: tuple[int, float] | None) -> None:
        if params is not None:
            self.fusion_threshold, cycle_ms = params
            self.cycle_time = cycle_ms / 1000.0
