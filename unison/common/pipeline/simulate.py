"""Timing a schedule without running it.

Every rank runs its compute list in order; an action starts when its rank is free and, if it
needs another rank's result (the previous stage's ``F``, the next stage's ``B``/``I``), when
that result has finished plus ``send_latency``. Communication itself takes no rank time.

[Note: split backward times] ``backward`` is always the time of a *full* backward pass, so one
set of numbers compares every schedule. For a split schedule (zb-h1) ``weight`` is the ``W``
part and ``I`` takes the rest, ``backward - weight``; with ``weight=None`` both halves take
``backward / 2``. The defaults ``forward=1, backward=2`` therefore give zb-h1 F = I = W = 1,
the equal-times case of the paper. ``weight`` is ignored by schedules that do not split.

Reference values at equal stage times and ``send_latency=0`` (``f``/``b`` per stage; the
tests check each one)::

    gpipe, 1f1b    makespan (m + p - 1)(f + b)      bubble (p - 1) / (m + p - 1)
    interleaved    makespan (m v + p - 1)(f + b)    i.e. bubble time (p - 1)(f + b) in units
                   of a v-times-thinner stage: 1F1B's bubble time divided by v
    zb-h1          bubble time (p - 1) f when f = i = w and m >= p: a third of 1F1B's
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from unison.common.pipeline.builders import build_schedule
from unison.common.pipeline.schedule import SCHEDULES, Action, Schedule, ScheduleError, as_times, dependencies
from unison.common.pipeline.validate import validate

__all__ = ["Event", "SimResult", "simulate", "compare_schedules"]

Times = float | Sequence[float]


class Event(NamedTuple):
    """One compute action as simulated: ``(rank, action, start, end)``."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` found.

    Attributes:
        schedule: the simulated schedule.
        makespan: time from the first start to the last end.
        bubble: idle fraction, ``1 - sum(busy) / (p * makespan)``.
        busy: compute time per rank.
        peak_activations: per virtual stage, the most microbatches whose ``F`` had finished
            and whose ``B`` (``W`` for split schedules) had not.
        peak_full_activations: the same count up to ``B`` or ``I``: microbatches holding
            their whole activations. It equals ``peak_activations`` unless the schedule
            splits backwards; after ``I`` only what ``W`` needs is kept.
        events: every compute action with its rank, start and end, in rank order.
    """

    schedule: Schedule
    makespan: float
    bubble: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]
    peak_full_activations: tuple[int, ...]
    events: list[Event]

    @property
    def bubble_time(self) -> float:
        """Mean idle time per rank: ``makespan - mean(busy)``."""
        return self.makespan - sum(self.busy) / len(self.busy)


def simulate(schedule: Schedule, forward: Times = 1.0, backward: Times = 2.0, weight: Times | None = None,
             send_latency: float = 0.0) -> SimResult:
    """Time ``schedule`` with the given per-stage costs.

    Args:
        schedule: a schedule; it is validated first.
        forward: ``F`` time, one number for every stage or one per virtual stage.
        backward: full backward time, likewise; see [Note: split backward times].
        weight: ``W`` time of split schedules (``None``: ``backward / 2``); at most ``backward``.
        send_latency: delay between a result on one rank and its use on another.

    Raises:
        ScheduleError: an invalid schedule, or times of the wrong length or sign.
    """
    validate(schedule)
    n = schedule.num_stages
    cost = {"F": as_times(forward, n, "forward"), "B": as_times(backward, n, "backward")}
    if not 0.0 <= send_latency < math.inf:  # (inf gave makespan inf and bubble nan before 2026-12-07)
        raise ScheduleError(f"send_latency must be a non-negative finite number; received {send_latency!r}")
    if schedule.split_backward:
        w = [b / 2 for b in cost["B"]] if weight is None else as_times(weight, n, "weight")
        if any(wt > bt for wt, bt in zip(w, cost["B"], strict=True)):
            raise ScheduleError(f"weight times {w} exceed backward times {cost['B']}; weight is the W "
                                "part of a full backward, so give weight <= backward")
        cost["W"] = w
        cost["I"] = [bt - wt for wt, bt in zip(w, cost["B"], strict=True)]
    events = _run(schedule, cost, float(send_latency))
    busy = [0.0] * schedule.p
    for e in events:
        busy[e.rank] += e.end - e.start
    makespan = max((e.end for e in events), default=0.0)
    bubble = 1.0 - sum(busy) / (schedule.p * makespan) if makespan > 0 else 0.0
    return SimResult(schedule, makespan, bubble, tuple(busy), _peaks(schedule, ("B", "W")),
                     _peaks(schedule, ("B", "I")), events)


def compare_schedules(p: int, m: int, v: int = 2, forward: float = 1.0, backward: float = 2.0,
                      send_latency: float = 0.0) -> list[SimResult]:
    """Simulate every built-in schedule for one model.

    ``forward`` and ``backward`` are the times of one rank's share of the model; the
    interleaved schedule cuts that share into ``v`` stages of ``1/v`` the time each.
    """
    out = []
    for name in SCHEDULES:
        vv = v if name == "interleaved" else 1
        out.append(simulate(build_schedule(name, p, m, vv), forward / vv, backward / vv,
                            send_latency=send_latency))
    return out


def _run(schedule: Schedule, cost: dict[str, list[float]], latency: float) -> list[Event]:
    """Start times, rank by rank, waking a rank when the result it waits for is known."""
    end: dict[Action, float] = {}
    free = [0.0] * schedule.p
    pos = [0] * schedule.p
    waiting: dict[Action, int] = {}
    events: list[Event] = []
    runnable = deque(range(schedule.p))
    while runnable:
        r = runnable.popleft()
        row = schedule.compute[r]
        while pos[r] < len(row):
            a = row[pos[r]]
            deps = dependencies(schedule, a)
            missing = [d for d in deps if d not in end]
            if missing:
                waiting[missing[0]] = r
                break
            start = free[r]
            for d in deps:
                remote = schedule.stage_rank(d.stage) != r
                start = max(start, end[d] + (latency if remote else 0.0))
            end[a] = free[r] = start + cost[a.op][a.stage]
            events.append(Event(r, a, start, end[a]))
            if a in waiting:
                runnable.append(waiting.pop(a))
            pos[r] += 1
    events.sort(key=lambda e: (e.rank, e.start))
    return events


def _peaks(schedule: Schedule, release: tuple[str, ...]) -> tuple[int, ...]:
    """Per stage, the most microbatches between their ``F`` and their releasing op.

    Depends only on each rank's order, never on times: one rank's actions never overlap.
    """
    held = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    for row in schedule.compute:
        for a in row:
            if a.op == "F":
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.op in release:
                held[a.stage] -= 1
    return tuple(peak)
