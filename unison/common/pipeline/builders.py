"""The four built-in schedules, as per-rank compute orders.

Timelines for ``p = 3`` ranks and ``m = 4`` microbatches, two columns per forward time and a
backward twice as long (``render_text(build_schedule(name, 3, 4), width=36)``)::

    gpipe  rank 0 |F0F1F2F3............B0==B1==B2==B3==|
           rank 1 |..F0F1F2F3......B0==B1==B2==B3==....|
           rank 2 |....F0F1F2F3B0==B1==B2==B3==........|
    1f1b   rank 0 |F0F1F2........B0==F3B1==..B2==..B3==|
           rank 1 |..F0F1....B0==F2B1==F3B2==..B3==....|
           rank 2 |....F0B0==F1B1==F2B2==F3B3==........|

Both take ``(m + p - 1) * (f + b)``; 1F1B (PipeDream-Flush) starts backwards early so rank
``s`` holds at most ``p - s`` microbatches' activations instead of ``m``. Interleaved 1F1B
(Megatron-LM) gives each rank ``v`` thinner stages so the fill and drain shrink ``v``-fold.
ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") splits the backward pass into
``I`` (gradient of the input, which the previous stage waits for) and ``W`` (gradient of the
weights, which nobody waits for) and uses the ``W`` passes to fill the drain.

[Note: zb-h1 memory] ZB-H1 is built by greedy list scheduling in unit time (F = I = W = 1).
At each tick every idle rank runs its next ``F`` if allowed and its input has arrived, else
the ``I`` of its oldest microbatch once the gradient has arrived, else its oldest pending
``W``. An ``F`` is allowed while stage ``s`` holds fewer than ``p - s`` microbatches waiting
for their ``I`` (1F1B's bound on whole activations) and fewer than ``p`` waiting for their
``W``. After ``I`` a microbatch keeps only what ``W`` needs, which is less; like the paper's
schedule, every stage may keep up to ``p`` such microbatches, so that deferred ``W`` passes fill
the drain. For ``m >= p`` the bubble is ``p - 1`` per rank at F = I = W, a third of 1F1B's
``3 (p - 1)`` (checked for p <= 8, m <= 32 in the tests).
"""

from __future__ import annotations

from collections.abc import Callable

from unison.common.pipeline.schedule import SCHEDULES, Action, Schedule, ScheduleError, check_sizes

__all__ = ["build_schedule"]

Rows = list[list[Action]]
Unit = Callable[[str, int, int], Action]


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build a named schedule for ``p`` ranks, ``m`` microbatches and ``v`` stages per rank.

    Args:
        name: one of ``SCHEDULES``: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``.
        p: pipeline ranks (>= 1).
        m: microbatches per step (>= 1; interleaved needs a multiple of ``p``).
        v: virtual stages per rank; 1 except for ``"interleaved"``, which needs >= 2.

    Returns:
        The schedule; it always passes :func:`validate`.

    Raises:
        ScheduleError: unknown name or values the schedule cannot use; the message says
            which values would work.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    check_sizes(key, p, m, v)
    if key == "interleaved":
        if v < 2:
            raise ScheduleError(f"interleaved needs v >= 2 virtual stages per rank (received v={v}); "
                                "use '1f1b' for one stage per rank")
        if m % p:
            up = -(-m // p) * p
            raise ScheduleError(f"interleaved needs num_microbatches ({m}) to be a multiple of the number "
                                f"of ranks ({p}); use {up} or {up + p}")
    elif v != 1:
        raise ScheduleError(f"{key} runs one stage per rank (received v={v}); use v=1, or the "
                            "'interleaved' schedule for several stages per rank")
    return Schedule(key, p, m, v, tuple(tuple(row) for row in _BUILDERS[key](p, m, v)))


def _gpipe(p: int, m: int, v: int) -> Rows:
    """All forwards, then all backwards in the same (first-in, first-out) microbatch order."""
    return [[Action("F", r, k) for k in range(m)] + [Action("B", r, k) for k in range(m)]
            for r in range(p)]


def _one_f_one_b(p: int, m: int, v: int) -> Rows:
    """PipeDream-Flush: ``min(m, p - r - 1)`` warm-up forwards, 1F1B, then the cool-down."""
    return [_warm_up_then_alternate(r, min(m, p - r - 1), m, lambda op, k, r: Action(op, r, k))
            for r in range(p)]


def _interleaved(p: int, m: int, v: int) -> Rows:
    """Megatron-LM's interleaved 1F1B.

    A rank walks its work in groups of ``p`` microbatches per stage: microbatches
    ``0..p-1`` through its first stage, the same ``p`` through its second stage, and so on,
    then the next ``p`` microbatches. Backwards walk the stages in reverse. Rank ``r`` runs
    ``2 * (p - r - 1) + (v - 1) * p`` warm-up forwards, then alternates, then drains.
    """
    def unit(op: str, k: int, r: int) -> Action:
        """The rank's ``k``-th forward or backward."""
        chunk = (k % (p * v)) // p
        if op == "B":
            chunk = v - 1 - chunk
        return Action(op, chunk * p + r, (k // (p * v)) * p + k % p)

    return [_warm_up_then_alternate(r, min(m * v, 2 * (p - r - 1) + (v - 1) * p), m * v, unit)
            for r in range(p)]


def _warm_up_then_alternate(r: int, warm: int, total: int, unit: Unit) -> list[Action]:
    """Rank ``r``: ``warm`` forwards, then forward/backward pairs, then the backwards left.

    ``unit(op, k, r)`` is rank ``r``'s ``k``-th forward (``op == "F"``) or backward (``"B"``).
    """
    row = [unit("F", k, r) for k in range(warm)]
    for k in range(total - warm):
        row += [unit("F", warm + k, r), unit("B", k, r)]
    return row + [unit("B", k, r) for k in range(total - warm, total)]


def _zb_h1(p: int, m: int, v: int) -> Rows:
    """ZB-H1 by unit-time greedy list scheduling; see [Note: zb-h1 memory]."""
    never = float("inf")
    f_end = [[never] * m for _ in range(p)]
    i_end = [[never] * m for _ in range(p)]
    nf, ni, nw = [0] * p, [0] * p, [0] * p
    rows: Rows = [[] for _ in range(p)]
    t = 0
    while any(n < m for n in nw):
        for s in range(p):
            k = nf[s]
            if (k < m and (s == 0 or f_end[s - 1][k] <= t)
                    and k - ni[s] < p - s and k - nw[s] < p):
                rows[s].append(Action("F", s, k))
                f_end[s][k] = t + 1
                nf[s] += 1
                continue
            k = ni[s]
            if k < m and f_end[s][k] <= t and (s == p - 1 or i_end[s + 1][k] <= t):
                rows[s].append(Action("I", s, k))
                i_end[s][k] = t + 1
                ni[s] += 1
                continue
            k = nw[s]
            if k < ni[s] and i_end[s][k] <= t:
                rows[s].append(Action("W", s, k))
                nw[s] += 1
        t += 1
    return rows


_BUILDERS: dict[str, Callable[[int, int, int], Rows]] = {
    "gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": _zb_h1,
}
