"""Running a schedule across MPI ranks, for any framework.

The driver walks this rank's ``Schedule.actions`` in order: a receive blocks where it stands,
a compute action calls the framework's :class:`StageWorker`, a send is posted without waiting
(``messages.py`` has the wire format). Arrays at stage boundaries are numpy, so the PyTorch
and Keras executors share this loop and differ only in their workers.

[Note: pipeline failures] A failed pipeline step must never hang, and every rank must raise
the same error. A rank whose worker raises (or whose output fails the shape check, or that
receives a ``FAILED`` header) stops walking its schedule and posts a ``FAILED`` header for
every send it still owed; its downstream and upstream neighbours then stop too instead of
waiting forever. Afterwards every rank of ``world`` joins one agreement::

    rank 0   F0 F1 [F2 raises] ---FAILED---> rank 1 (waiting in recv_act m2) stops, ...
    every rank:  Allreduce(MAX, status)
                 0  -> wait for this step's sends, return StepStats
                 >0 -> allgather(error, ledger of sent messages)
                       receive and drop the messages sent to this rank that it never read
                       wait for this step's sends, raise PipelineError(the first origin's message)

The ledger exchange ([Note: the message ledger] in ``messages.py``) completes every posted send
and leaves nothing in flight, so the driver is ready for the next step. A problem found before
the step (``step(check=...)``: a batch the microbatches do not divide, say) is agreed the same
way before any message is sent.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Protocol

import numpy as np

from unison.common import agreement, runtime
from unison.common.exceptions import UnisonError
from unison.common.pipeline.messages import Mailbox, check_sendable, describe
from unison.common.pipeline.schedule import Action, Schedule
from unison.common.pipeline.validate import validate
from unison.common.pool import ResultPool

__all__ = ["PipelineError", "RemoteTraceback", "StageWorker", "StepStats", "PipelineDriver", "raise_together"]

#: Most bytes of receive buffers a driver keeps for reuse.
POOL_BYTES = 256 << 20
ACT, GRAD = 0, 1
UPSTREAM, ORIGIN = 1, 2  # how a rank's step failed: stopped by a neighbour, or the failure itself
_KIND = {"RECV_ACT": ACT, "SEND_ACT": ACT, "RECV_GRAD": GRAD, "SEND_GRAD": GRAD}
_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}


class PipelineError(UnisonError, ValueError):
    """A pipeline step cannot run or failed on some rank.

    Raised on every rank of the pipeline (of ``world``) with the same message, which names the
    rank, the stage and microbatch where it started, the values and the fix.
    """


class RemoteTraceback(Exception):
    """The ``__cause__`` of a PipelineError on ranks other than the one that failed: its traceback."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]) if self.args and self.args[0] else "(no traceback)"


class StageWorker(Protocol):
    """The framework side of a pipeline: computes its rank's stages on numpy boundaries."""

    def forward(self, stage: int, mb: int, x: np.ndarray | None) -> np.ndarray | None:
        """Forward of microbatch ``mb`` on ``stage``.

        ``x`` is None on stage 0 (the worker takes microbatch ``mb`` of its own input).
        Returns the activation for the next stage; None on the last stage, which computes the
        loss itself.
        """
        ...

    def backward(self, stage: int, mb: int, grad: np.ndarray | None) -> np.ndarray | None:
        """Full backward (B): ``grad`` is None on the last stage; returns the input gradient
        (None on stage 0)."""
        ...

    def backward_input(self, stage: int, mb: int, grad: np.ndarray | None) -> np.ndarray | None:
        """I of a split backward: as :meth:`backward`, without the weight gradients."""
        ...

    def backward_weight(self, stage: int, mb: int) -> None:
        """W of a split backward: the weight gradients of microbatch ``mb``."""
        ...


@dataclass
class StepStats:
    """What one :meth:`PipelineDriver.step` measured on this rank.

    Attributes:
        makespan: seconds from the start of the schedule (right after the pre-flight agreement,
            which the ranks leave together) to the end of the step's agreement, so that every
            rank of a pipeline measures about the same span.
        busy: seconds this rank spent in worker calls.
        bubble: ``1 - busy / makespan``: this rank's idle fraction.
        peak_per_stage: for each stage on this rank, the most microbatches alive at once
            (``F`` done, ``B`` or, for split schedules, ``W`` not yet), as ``simulate`` counts.
        events: ``(action, start, end)`` of every compute action, in seconds from the start.
    """

    makespan: float
    busy: float
    bubble: float
    peak_per_stage: dict[int, int]
    events: list[tuple[Action, float, float]] = field(default_factory=list)


@dataclass
class _Failure:
    level: int
    message: str
    trace: str = ""
    exc: BaseException | None = None


class _Stopped(Exception):
    """A neighbour sent a FAILED header instead of an array."""


class PipelineDriver:
    """Runs ``schedule`` on this rank of ``comm``, one training step at a time.

    Args:
        schedule: the schedule; it is validated first.
        comm: an mpi4py communicator of the pipeline's ``p`` ranks; its rank ``i`` holds stages
            ``i, i + p, ...``.
        world: the communicator whose ranks agree on errors (every pipeline of a data x pipeline
            grid); all its ranks call :meth:`step` together. Default: ``comm``.

    The driver ``Dup()``s both, so its messages never match other traffic; :meth:`close`
    frees them.

    Raises:
        PipelineError: ``comm`` does not have ``p`` ranks, ``world`` lacks some of them, or the
            schedule needs more message tags than MPI offers.
        ScheduleError: the schedule is invalid.
    """

    def __init__(self, schedule: Schedule, comm: Any, world: Any = None) -> None:
        from mpi4py import MPI

        validate(schedule)
        if comm.Get_size() != schedule.p:
            raise PipelineError(f"the {schedule.name} schedule runs on p={schedule.p} ranks but the "
                                f"communicator has {comm.Get_size()}; give a communicator of exactly the "
                                "pipeline's ranks")
        tags, top = 2 * schedule.num_stages * schedule.m, int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767)
        if tags - 1 > top:
            raise PipelineError(f"the schedule needs {tags} message tags but MPI offers {top + 1}; use "
                                "fewer microbatches or stages")
        if world is not None:
            where = MPI.Group.Translate_ranks(comm.Get_group(), list(range(schedule.p)), world.Get_group())
            if MPI.UNDEFINED in where:
                raise PipelineError("world must contain every rank of the pipeline's communicator; "
                                    "pass the communicator of the whole job (or a superset of comm)")
        self.schedule = schedule
        self.comm = comm.Dup()
        self.world = self.comm if world is None else world.Dup()
        self.rank = self.comm.Get_rank()
        self.world_rank = self.world.Get_rank()
        self._world_of = MPI.Group.Translate_ranks(self.comm.Get_group(), list(range(schedule.p)),
                                                   self.world.Get_group())
        #: this rank's actions with their communication, derived once
        self.actions = schedule.actions(self.rank)
        # received arrays; a step's shapes repeat, so a small pool covers them
        self._pool = ResultPool(max_bytes=POOL_BYTES)

    def step(self, worker: StageWorker, check: str | None = None, flagged: bool | None = None) -> StepStats:
        """Run one step of the schedule with ``worker``; see [Note: pipeline failures].

        Args:
            worker: this rank's stages.
            check: this rank's pre-flight problem, if any (a sentence with the values and the
                fix); agreed over ``world`` before any message, so every rank raises.
            flagged: whether any rank has a ``check``, when the caller agreed on that already
                (:func:`enter_step`); None: the step agrees on it over ``world``.

        Returns:
            This rank's timings and peak activations.

        Raises:
            PipelineError: on every rank, when any rank's ``check`` is set or its step failed.
        """
        if flagged is None or flagged:
            raise_together(self.world, check)
        run = _Step(self, worker)
        failure = run.walk()
        if failure is not None:  # collectives a stage's peers wait on inside it (a tensor group's) never come
            _abandon_engine(failure.message)
        try:
            self._agree_on_end(run, failure)
        finally:
            if failure is not None:
                _abandon_engine(None)
        return run.stats(perf_counter() - run.t0)

    def close(self) -> None:
        """Free the driver's communicators (collective over ``world``) and its receive buffers; idempotent."""
        if self.comm is None:
            return
        if self.world is not self.comm:
            self.world.Free()
        self.comm.Free()
        self.comm = self.world = None  # type: ignore[assignment]
        self._pool.clear()

    def _agree_on_end(self, run: _Step, failure: _Failure | None) -> None:
        from mpi4py import MPI

        status = np.array([0 if failure is None else failure.level], np.int64)
        self.world.Allreduce(MPI.IN_PLACE, [status, MPI.INT64_T], op=MPI.MAX)
        if not status[0]:
            run.mailbox.wait_all()
            return
        ledger = [(self._world_of[dest], tag, pieces) for dest, tag, pieces in run.mailbox.sent]
        mine = None if failure is None else (failure.level, failure.message, failure.trace)
        records = self.world.allgather((mine, self.rank, ledger))
        for _, source, sent in records:
            for dest, tag, pieces in sent:
                if dest == self.world_rank:
                    run.mailbox.discard(source, tag, pieces)
        run.mailbox.wait_all()
        origin = min((r for r, (info, _, _) in enumerate(records) if info and info[0] == ORIGIN))
        _, message, trace = records[origin][0]
        error = PipelineError(message)
        if origin == self.world_rank and failure is not None and failure.exc is not None:
            raise error from failure.exc
        raise error from RemoteTraceback(trace)


def raise_together(comm: Any, problem: str | None) -> None:
    """Agree over ``comm`` whether any rank has a ``problem``; if so raise it on every rank.

    Raises:
        PipelineError: ``"rank r: <problem>"`` for the lowest rank with a problem, on every rank.
    """
    agreement.raise_together(comm, problem, PipelineError)


def enter_step(world: Any, entry: str, check: str | None) -> bool | None:
    """Whether any rank of ``world`` has a pre-flight ``check``, agreed by one engine all-reduce named ``entry``
    when ``world`` is the whole job (else None: :meth:`PipelineDriver.step` agrees over ``world`` itself).

    [Note: a pipeline step is entered through the engine] A step's messages are MPI's own point-to-point
    calls, and its setup (a forward-only driver made at the first ``evaluate``) MPI's own collectives, which
    the engine does not see: a step that some ranks skip (``evaluate`` on rank 0 alone, a rank that left the
    loop a step early and all-reduces its metrics) left the others blocked in MPI for ever (before
    2026-12-06). The executors enter each step, before anything else collective, through the engine (frontend
    [Note: entered through the engine]) under a name of the executor and the kind of step, carrying the
    check, so ranks running different kinds of step (one trains, one evaluates) wait under different names
    instead of pairing their messages.
    """
    if not _engine_covers(world):
        return None
    from unison.common.engine import frontend

    return frontend.enter(entry, check is not None)


def _engine_covers(comm: Any) -> bool:
    """Whether ``comm`` holds the whole job of more than one rank, so the engine's job-wide set spans it."""
    return runtime.is_initialized() and runtime.size() > 1 and comm.Get_size() == runtime.size()


def _peer(a: Action) -> int:
    if a.peer is None:
        raise PipelineError(f"{a} is a communication action without a peer rank")
    return a.peer


def _abandon_engine(reason: str | None) -> None:
    """Have the running engine fail the collectives peers wait on for this rank, or stop doing so
    (see [Note: abandoned collectives] in unison/common/engine/engine.py)."""
    from unison.common.engine import frontend

    eng = frontend.running_engine()
    if eng is not None:
        eng.abandon(reason)


class _Step:
    """The state of one step on one rank: arrays waiting to be used or sent, counts, timings."""

    def __init__(self, driver: PipelineDriver, worker: StageWorker) -> None:
        self.driver = driver
        self.schedule = driver.schedule
        self.worker = worker
        self.mailbox = Mailbox(driver.comm, driver._pool)
        self.inbox: dict[tuple[int, int, int], np.ndarray] = {}  # (kind, receiving stage, mb)
        self.outbox: dict[tuple[int, int, int], np.ndarray] = {}  # (kind, sending stage, mb)
        self.first: dict[tuple[int, int], tuple[int, str]] = {}  # (kind, stage) -> (mb, shape and dtype)
        stages = self.schedule.stages_of(driver.rank)
        self.live = dict.fromkeys(stages, 0)
        self.peak = dict.fromkeys(stages, 0)
        self.release = "W" if self.schedule.split_backward else "B"
        self.events: list[tuple[Action, float, float]] = []
        self.busy = 0.0
        self.t0 = perf_counter()

    def walk(self) -> _Failure | None:
        """Run this rank's actions; on failure, owe nobody a message and say what happened."""
        actions = self.driver.actions
        for i, a in enumerate(actions):
            try:
                self.do(a)
            except _Stopped as stop:
                failure = _Failure(UPSTREAM, f"rank {self.driver.world_rank} stopped at {a}: {stop}")
            except Exception as exc:
                detail = str(exc) if isinstance(exc, PipelineError) else f"{type(exc).__name__}: {exc}"
                what = _NAMES.get(a.op, a.op.lower())
                message = (f"pipeline step failed on rank {self.driver.world_rank} at {a} ({what} of stage "
                           f"{a.stage}, microbatch {a.microbatch}): {detail}")
                failure = _Failure(ORIGIN, message, "".join(traceback.format_exception(exc)), exc)
            else:
                continue
            for b in actions[i:]:
                if b.op.startswith("SEND"):
                    self.mailbox.send_failed(_peer(b), self.schedule.tag(b))
            return failure
        return None

    def do(self, a: Action) -> None:
        s, mb, op = a.stage, a.microbatch, a.op
        if op in ("RECV_ACT", "RECV_GRAD"):
            array = self.mailbox.recv(_peer(a), self.schedule.tag(a))
            if array is None:
                raise _Stopped(f"rank {self.driver._world_of[_peer(a)]} failed")
            self.inbox[(_KIND[op], s, mb)] = array
        elif op in ("SEND_ACT", "SEND_GRAD"):
            self.mailbox.send(self.outbox.pop((_KIND[op], s, mb)), _peer(a), self.schedule.tag(a))
        elif op == "F":
            x = self.inbox.pop((ACT, s, mb)) if s > 0 else None
            y = self.timed(a, self.worker.forward, s, mb, x)
            self.live[s] += 1
            self.peak[s] = max(self.peak[s], self.live[s])
            if s < self.schedule.num_stages - 1:
                self.hand_on(ACT, a, y)
        elif op in ("B", "I"):
            grad = self.inbox.pop((GRAD, s, mb)) if s < self.schedule.num_stages - 1 else None
            fn = self.worker.backward if op == "B" else self.worker.backward_input
            dx = self.timed(a, fn, s, mb, grad)
            if s > 0:
                self.hand_on(GRAD, a, dx)
        else:
            self.timed(a, self.worker.backward_weight, s, mb)
        if op == self.release:
            self.live[s] -= 1

    def timed(self, a: Action, fn: Any, *args: Any) -> Any:
        start = perf_counter()
        out = fn(*args)
        end = perf_counter()
        self.busy += end - start
        self.events.append((a, start - self.t0, end - self.t0))
        return out

    def hand_on(self, kind: int, a: Action, array: Any) -> None:
        """Check a stage's result and queue it for the next stage: a send, or the same rank's inbox."""
        s, mb = a.stage, a.microbatch
        dest = s + 1 if kind == ACT else s - 1
        what = (f"the output of stage {s}" if kind == ACT else f"the input gradient of stage {s}")
        problem = check_sendable(array, f"{what} for microbatch {mb}")
        if problem:
            raise PipelineError(problem)
        ref_mb, ref = self.first.setdefault((kind, s), (mb, describe(array)))
        if ref != describe(array):
            raise PipelineError(
                f"{what} for microbatch {mb} is {describe(array)} but microbatch {ref_mb} gave "
                f"{ref} in this step; a stage boundary carries one shape per step, so make "
                "every microbatch the same size (the same number of rows and the same sequence length: "
                "pad, or drop the last partial batch)")
        if self.schedule.stage_rank(dest) == self.driver.rank:
            self.inbox[(kind, dest, mb)] = array
        else:
            self.outbox[(kind, s, mb)] = array

    def stats(self, makespan: float) -> StepStats:
        bubble = 1.0 - self.busy / makespan if makespan > 0 else 0.0
        return StepStats(makespan, self.busy, bubble, dict(self.peak), self.events)
