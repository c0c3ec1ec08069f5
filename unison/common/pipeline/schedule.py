"""The schedule data format that every pipeline executor reads.

A schedule is data, not code: for each rank, the ordered list of compute actions it runs.
Keeping it as a plain table is what lets one process build, validate, simulate and draw a
schedule that the PyTorch and Keras executors later run unchanged on real ranks.

Stages are *virtual*: a model cut into ``p * v`` pieces, with piece ``s`` on rank ``s % p``
(Megatron's interleaved layout; with ``v == 1`` stage ``s`` is simply rank ``s``)::

    v = 2, p = 4:   rank 0: s0 s4   rank 1: s1 s5   rank 2: s2 s6   rank 3: s3 s7

Only compute actions are stored. The communication around them is derived
(:meth:`Schedule.actions`) so that it can never disagree with the compute order
([Note: derived communication]):

- ``F`` of stage ``s`` whose input stage ``s - 1`` lives on another rank is preceded by
  ``RECV_ACT`` from that rank; if stage ``s + 1`` lives elsewhere, ``F`` is followed by
  ``SEND_ACT`` to it.
- ``B`` (or ``I`` when the backward pass is split) of stage ``s`` is preceded by ``RECV_GRAD``
  from the rank of ``s + 1`` and followed by ``SEND_GRAD`` to the rank of ``s - 1``, each only
  when that stage exists and lives on another rank. ``W`` never communicates.

Executors post sends without waiting and block on receives right where they appear; the
validator (``validate.py``) proves that this cannot deadlock for a given schedule.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from unison.common.exceptions import UnisonError

__all__ = ["SCHEDULES", "COMPUTE_OPS", "COMM_OPS", "ScheduleError", "Action", "Schedule"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
COMPUTE_OPS = ("F", "B", "I", "W")
COMM_OPS = ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")


class ScheduleError(UnisonError, ValueError):
    """A pipeline schedule cannot be built or would not run.

    Raised for bad ``(p, m, v)`` or schedule names, for balances that do not fit the
    model, and by :func:`validate` for a schedule that is incomplete, out of order or
    would deadlock (with a step x rank grid of the schedule in the message).
    """


@dataclass(frozen=True)
class Action:
    """One step of one rank.

    Attributes:
        op: ``"F"`` forward, ``"B"`` full backward, ``"I"`` backward for the input,
            ``"W"`` backward for the weights; or a communication op from ``COMM_OPS``.
        stage: the virtual stage (``0 .. p*v - 1``); for communication, the stage on
            this rank that sends or receives.
        microbatch: ``0 .. m - 1``.
        peer: for communication, the other rank; ``None`` for compute.
    """

    op: str
    stage: int
    microbatch: int
    peer: int | None = None

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.op}{self.microbatch}@s{self.stage}"
        kind = self.op.lower()
        arrow = "->" if self.op.startswith("SEND") else "<-"
        return f"{kind} m{self.microbatch} s{self.stage}{arrow}r{self.peer}"


@dataclass(frozen=True)
class Schedule:
    """Per-rank compute order of a pipeline schedule.

    Attributes:
        name: one of ``SCHEDULES`` for built schedules; free text for hand-made ones.
        p: number of ranks. m: number of microbatches. v: stages per rank.
        compute: ``compute[rank]`` is that rank's compute actions in execution order.
            Lists are accepted and stored as tuples.
    """

    name: str
    p: int
    m: int
    v: int
    compute: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute", tuple(tuple(row) for row in self.compute))

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    @cached_property
    def split_backward(self) -> bool:
        """True when the backward pass is split into ``I`` and ``W`` (zb-h1)."""
        return any(a.op in ("I", "W") for row in self.compute for a in row)

    def stage_rank(self, stage: int) -> int:
        """The rank that holds virtual ``stage`` (Megatron layout: ``stage % p``)."""
        return stage % self.p

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages held by ``rank``, in model order."""
        return tuple(rank + k * self.p for k in range(self.v))

    def actions(self, rank: int) -> tuple[Action, ...]:
        """``rank``'s compute actions with the derived communication, in execution order."""
        return tuple(a for _, a in expand(self, rank))

    def tag(self, action: Action) -> int:
        """A message number, the same for a send and its matching receive.

        Unique per (activation or gradient, receiving stage, microbatch) and below
        ``2 * num_stages * m``, so it fits an MPI tag for any practical schedule.
        """
        if action.op == "SEND_ACT":
            kind, dest = 0, action.stage + 1
        elif action.op == "RECV_ACT":
            kind, dest = 0, action.stage
        elif action.op == "SEND_GRAD":
            kind, dest = 1, action.stage - 1
        elif action.op == "RECV_GRAD":
            kind, dest = 1, action.stage
        else:
            raise ScheduleError(f"tag() needs a communication action ({', '.join(COMM_OPS)}); "
                                f"received {action}")
        return (kind * self.num_stages + dest) * self.m + action.microbatch


def expand(schedule: Schedule, rank: int) -> list[tuple[int, Action]]:
    """``rank``'s actions with derived communication, each with its compute step.

    See [Note: derived communication] in this module's docstring.
    """
    last = schedule.num_stages - 1
    owner = schedule.stage_rank
    out: list[tuple[int, Action]] = []
    for step, a in enumerate(schedule.compute[rank]):
        s, mb = a.stage, a.microbatch
        before: Action | None = None
        after: Action | None = None
        if a.op == "F":
            if s > 0 and owner(s - 1) != rank:
                before = Action("RECV_ACT", s, mb, owner(s - 1))
            if s < last and owner(s + 1) != rank:
                after = Action("SEND_ACT", s, mb, owner(s + 1))
        elif a.op in ("B", "I"):
            if s < last and owner(s + 1) != rank:
                before = Action("RECV_GRAD", s, mb, owner(s + 1))
            if s > 0 and owner(s - 1) != rank:
                after = Action("SEND_GRAD", s, mb, owner(s - 1))
        if before is not None:
            out.append((step, before))
        out.append((step, a))
        if after is not None:
            out.append((step, after))
    return out


def dependencies(schedule: Schedule, action: Action) -> list[Action]:
    """The compute actions that must finish before ``action`` can start.

    ``F`` needs the previous stage's ``F``; ``B``/``I`` need their own stage's ``F`` and the
    next stage's ``B``/``I``; ``W`` needs its own stage's ``I``.
    """
    s, mb = action.stage, action.microbatch
    back = "I" if schedule.split_backward else "B"
    if action.op == "F":
        return [Action("F", s - 1, mb)] if s > 0 else []
    if action.op in ("B", "I"):
        deps = [Action("F", s, mb)]
        if s < schedule.num_stages - 1:
            deps.append(Action(back, s + 1, mb))
        return deps
    if action.op == "W":
        return [Action("I", s, mb)]
    return []


def check_sizes(name: str, p: object, m: object, v: object) -> None:
    """Raises ScheduleError unless ``p``, ``m`` and ``v`` are positive integers."""
    what = {"p": "the number of pipeline ranks", "m": "the number of microbatches",
            "v": "the number of virtual stages per rank"}
    for key, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {key} is {what[key]} and must be a positive integer; "
                                f"received {key}={value!r}")


def as_times(value: float | Sequence[float], num_stages: int, what: str) -> list[float]:
    """A per-stage time list from one number or a sequence of ``num_stages`` numbers."""
    if isinstance(value, numbers.Real):  # (numpy scalars too: np.float32 is no float)
        times = [float(value)] * num_stages
    else:
        times = [float(t) for t in value]  # type: ignore[union-attr]  # (a Real is handled above)
        if len(times) != num_stages:
            raise ScheduleError(f"{what} has {len(times)} per-stage times but the schedule has "
                                f"{num_stages} stages; give one number or {num_stages}")
    if any(not 0.0 <= t < math.inf for t in times):  # (inf gave makespan inf and bubble nan before 2026-12-07)
        raise ScheduleError(f"{what} times must be non-negative finite numbers; received {times}")
    return times
