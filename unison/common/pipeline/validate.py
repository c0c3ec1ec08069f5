"""Proving a schedule runs before any rank runs it.

A wrong schedule on real ranks shows up as a hang with no message. Here it shows up as a
``ScheduleError`` whose first line says what is wrong and whose body is the schedule as a
step x rank grid with the offending cells marked ``>>F3@s1<<``::

    deadlock: rank 1 waits at step 1 (B0@s1) for the gradient of microbatch 0 from rank 2, which
    rank 2 computes at step 2 (B0@s2), but rank 2 waits at step 1 (F1@s2) for the activation of
    microbatch 1 from rank 1; cycle: rank 1 -> rank 2 -> rank 1; rank 0 waits behind it
    step | rank 0    | rank 1    | rank 2
       0 | F0@s0     | F0@s1     | F0@s2
       1 | F1@s0     | >>B0@s1<< | >>F1@s2<<
       2 | F2@s0     | F1@s1     | B0@s2
       ...

(the first line is one line in the message). Only the ranks in the cycle are marked.

The checks, in order: every action is a compute action of a real stage and microbatch on the
rank that holds the stage; each stage runs ``F`` and ``B`` (or ``I`` and ``W``) exactly once
per microbatch; a rank never runs an action before one of its own that it depends on; and the
ranks finish when run with buffered sends and blocking receives (the executors' contract,
see [Note: derived communication] in ``schedule.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from unison.common.pipeline.schedule import (
    COMPUTE_OPS,
    Action,
    Schedule,
    ScheduleError,
    check_sizes,
    dependencies,
    expand,
)

__all__ = ["validate", "render_grid"]

_WHAT = {"RECV_ACT": "activation", "RECV_GRAD": "gradient"}


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every rank can run ``schedule`` to the end.

    Raises:
        ScheduleError: wrong counts or placement, an action before its own rank's
            dependency, or a deadlock; the message holds a step x rank grid.
    """
    check_sizes(schedule.name, schedule.p, schedule.m, schedule.v)
    if len(schedule.compute) != schedule.p:
        raise ScheduleError(f"schedule {schedule.name!r} has compute lists for {len(schedule.compute)} "
                            f"ranks but p={schedule.p}; give one list per rank")
    _check_actions(schedule)
    _check_counts(schedule)
    _check_local_order(schedule)
    _check_deadlock(schedule)


def render_grid(schedule: Schedule, marks: Iterable[tuple[int, int]] = (), context: int = 8) -> str:
    """The compute lists as a text table: one row per step, one column per rank.

    Args:
        schedule: the schedule to print.
        marks: ``(rank, step)`` cells to mark as ``>>cell<<``.
        context: with marks and a long schedule, only the steps within ``context`` of a
            marked one are printed (``...`` stands for the others).
    """
    marked = set(marks)
    steps = max((len(row) for row in schedule.compute), default=0)
    cells = [[""] * schedule.p for _ in range(steps)]
    for r, row in enumerate(schedule.compute):
        for i, a in enumerate(row):
            text = str(a)
            cells[i][r] = f">>{text}<<" if (r, i) in marked else text
    width = max([len(f"rank {schedule.p - 1}")] + [len(c) for line in cells for c in line])
    keep = set(range(steps))
    if marked and steps > 2 * context + 8:
        keep = {i for _, step in marked for i in range(step - context, step + context + 1)}
    lines = ["step | " + " | ".join(f"rank {r}".ljust(width) for r in range(schedule.p)).rstrip()]
    for i in range(steps):
        if i in keep:
            lines.append(f"{i:4d} | " + " | ".join(c.ljust(width) for c in cells[i]).rstrip())
        elif i - 1 in keep:
            lines.append(" ...")
    return "\n".join(lines)


def _fail(schedule: Schedule, reason: str, marks: Iterable[tuple[int, int]] = ()) -> ScheduleError:
    return ScheduleError(f"{reason}\n{render_grid(schedule, marks)}")


def _check_actions(schedule: Schedule) -> None:
    for r, row in enumerate(schedule.compute):
        for i, a in enumerate(row):
            where = f"rank {r} step {i}"
            if not isinstance(a, Action):
                raise ScheduleError(f"{where} holds {a!r}, not an Action; build compute lists from "
                                    "Action(op, stage, microbatch)")
            if a.op not in COMPUTE_OPS:
                raise _fail(schedule, f"{where} holds {a.op!r}; compute lists take only "
                            f"{', '.join(COMPUTE_OPS)} (communication is derived)", [(r, i)])
            for what, value in (("stage", a.stage), ("microbatch", a.microbatch)):
                if type(value) is not int:  # (1.0 and True equal 1: they passed, and simulate failed later)
                    raise _fail(schedule, f"{where}: {what} {value!r} is a {type(value).__name__}; stages and "
                                f"microbatches are Python ints (convert with int())", [(r, i)])
            if not 0 <= a.stage < schedule.num_stages:
                raise _fail(schedule, f"{where}: stage {a.stage} does not exist; stages are 0.."
                            f"{schedule.num_stages - 1} (p*v = {schedule.p}*{schedule.v})", [(r, i)])
            if not 0 <= a.microbatch < schedule.m:
                raise _fail(schedule, f"{where}: microbatch {a.microbatch} does not exist; "
                            f"microbatches are 0..{schedule.m - 1}", [(r, i)])
            if schedule.stage_rank(a.stage) != r:
                raise _fail(schedule, f"{where}: {a} is on rank {r} but stage {a.stage} belongs to rank "
                            f"{schedule.stage_rank(a.stage)}; move it there", [(r, i)])


def _check_counts(schedule: Schedule) -> None:
    split = schedule.split_backward
    seen: dict[Action, tuple[int, int]] = {}
    for r, row in enumerate(schedule.compute):
        for i, a in enumerate(row):
            if split and a.op == "B":
                raise _fail(schedule, f"rank {r} step {i}: {a} is a full backward in a schedule that "
                            "splits backwards into I and W; use I and W for every backward", [(r, i)])
            if a in seen:
                r0, i0 = seen[a]
                raise _fail(schedule, f"{a} runs twice: rank {r0} step {i0} and rank {r} step {i}; every "
                            "stage runs each op once per microbatch", [(r0, i0), (r, i)])
            seen[a] = (r, i)
    ops = ("F", "I", "W") if split else ("F", "B")
    for op in ops:
        for s in range(schedule.num_stages):
            for mb in range(schedule.m):
                want = Action(op, s, mb)
                if want not in seen:
                    r = schedule.stage_rank(s)
                    marks = [seen[a] for a in seen if want in dependencies(schedule, a)]
                    raise _fail(schedule, f"{want} is missing: rank {r} must run {op} of stage {s} for "
                                f"microbatch {mb} (every stage runs {', '.join(ops)} once per "
                                "microbatch)", [m for m in marks if m[0] == r])


def _check_local_order(schedule: Schedule) -> None:
    for r, row in enumerate(schedule.compute):
        step = {a: i for i, a in enumerate(row)}
        for i, a in enumerate(row):
            for dep in dependencies(schedule, a):
                j = step.get(dep)
                if j is not None and j > i:
                    raise _fail(schedule, f"rank {r} runs {a} at step {i} before {dep} (step {j}), "
                                "which it needs; move it after that step", [(r, i)])


def _check_deadlock(schedule: Schedule) -> None:
    """Run every rank with buffered sends and blocking receives; raise if they get stuck."""
    rows = [expand(schedule, r) for r in range(schedule.p)]
    pos = [0] * schedule.p
    sent: set[int] = set()
    waiting: dict[int, int] = {}
    runnable = deque(range(schedule.p))
    while runnable:
        r = runnable.popleft()
        while pos[r] < len(rows[r]):
            a = rows[r][pos[r]][1]
            if a.op.startswith("RECV") and schedule.tag(a) not in sent:
                waiting[schedule.tag(a)] = r
                break
            if a.op.startswith("SEND"):
                sent.add(schedule.tag(a))
                if schedule.tag(a) in waiting:
                    runnable.append(waiting.pop(schedule.tag(a)))
            pos[r] += 1
    stuck = {r: rows[r][pos[r]] for r in range(schedule.p) if pos[r] < len(rows[r])}
    if stuck:
        reason, cycle = _explain(schedule, stuck)
        raise _fail(schedule, "deadlock: " + reason, [(r, stuck[r][0]) for r in cycle])


def _explain(schedule: Schedule, stuck: dict[int, tuple[int, Action]]) -> tuple[str, list[int]]:
    """One line on the cycle of waits among the ``stuck`` ranks, and the ranks in the cycle."""
    def waits(r: int) -> str:
        step, recv = stuck[r]
        return (f"at step {step} ({schedule.compute[r][step]}) for the {_WHAT[recv.op]} of "
                f"microbatch {recv.microbatch} from rank {recv.peer}")

    path = [min(stuck)]
    while True:
        peer = stuck[path[-1]][1].peer
        if peer is None or peer not in stuck:
            return f"rank {path[-1]} waits {waits(path[-1])}, which finished without sending it", path[-1:]
        if peer in path:
            break
        path.append(peer)
    cycle = path[path.index(peer):]
    start = cycle.index(min(cycle))
    cycle = cycle[start:] + cycle[:start]
    first, second = cycle[0], cycle[1 % len(cycle)]
    recv = stuck[first][1]
    producer = (Action("F", recv.stage - 1, recv.microbatch) if recv.op == "RECV_ACT"
                else Action("I" if schedule.split_backward else "B", recv.stage + 1, recv.microbatch))
    made_at = schedule.compute[second].index(producer)
    text = (f"rank {first} waits {waits(first)}, which rank {second} computes at step {made_at} ({producer}), "
            f"but rank {second} waits {waits(second)}; cycle: "
            + " -> ".join(f"rank {r}" for r in cycle + [first]))
    behind = sorted(set(stuck) - set(cycle))
    if behind:
        who = f"ranks {', '.join(map(str, behind))} wait" if len(behind) > 1 else f"rank {behind[0]} waits"
        text += f"; {who} behind it"
    return text, cycle
