"""Pictures of simulated schedules: a terminal timeline and stacked Gantt charts (PNG).

``render_text`` draws one row per rank with time running right; each box starts with its op
and microbatch (a ``'`` per earlier stage on the same rank, for interleaved schedules) and is
filled with the op's own character; idle time is ``.``::

    1f1b p=2 m=3 v=1: makespan 12, bubble 25.0%
    rank 0 |F0-F1-......B0====F2-B1====...B2====|
    rank 1 |...F0-B0====F1-B1====F2-B2====......|
    F- forward  B= backward  . idle

matplotlib is imported only inside :func:`render_png`, through its Agg canvas, so importing
this module needs nothing but the standard library and never changes pyplot's backend.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from unison.common.files import atomic_path
from unison.common.pipeline.schedule import Schedule
from unison.common.pipeline.simulate import SimResult, simulate
from unison.common.plotting import require_matplotlib

__all__ = ["render_text", "render_png"]

_FILL = {"F": "-", "B": "=", "I": "~", "W": "+"}
_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}
_COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#dd8452", "W": "#8172b3"}


def _result(item: Schedule | SimResult) -> SimResult:
    return item if isinstance(item, SimResult) else simulate(item)


def _headline(res: SimResult) -> str:
    s = res.schedule
    return (f"{s.name} p={s.p} m={s.m} v={s.v}: makespan {res.makespan:g}, "
            f"bubble {100 * res.bubble:.1f}%")


def render_text(item: Schedule | SimResult, width: int | None = None) -> str:
    """A terminal timeline of a schedule (simulated with the defaults) or a simulation.

    Args:
        item: a :class:`Schedule` or :class:`SimResult`.
        width: columns for the whole makespan; ``None`` gives the shortest action room
            for its label.

    Returns:
        A headline, one ``rank r |...|`` row per rank and a legend.
    """
    res = _result(item)
    sched = res.schedule
    lines = [_headline(res)]
    if res.makespan > 0:
        label = len(str(sched.m - 1)) + sched.v + 1
        shortest = min((e.end - e.start for e in res.events if e.end > e.start), default=res.makespan)
        cols = width if width is not None else min(400, math.ceil(res.makespan / shortest * label))
        scale = max(1, cols) / res.makespan
        rows = [["."] * max(1, cols) for _ in range(sched.p)]
        for e in res.events:
            c0, c1 = round(e.start * scale), round(e.end * scale)
            chunk = "'" * (e.action.stage // sched.p)
            text = f"{e.action.op}{e.action.microbatch}{chunk}".ljust(c1 - c0, _FILL[e.action.op])
            rows[e.rank][c0:c1] = text[: c1 - c0]
        lines += [f"rank {r} |{''.join(row)}|" for r, row in enumerate(rows)]
    used = sorted({e.action.op for e in res.events}, key="FBIW".index)
    lines.append("  ".join(f"{op}{_FILL[op]} {_NAMES[op]}" for op in used) + "  . idle")
    return "\n".join(lines)


def render_png(items: Schedule | SimResult | Sequence[Schedule | SimResult], path: str | os.PathLike[str],
               title: str | None = None) -> None:
    """Draw schedules as stacked Gantt charts (one panel each, one row per rank) into a PNG.

    Boxes are coloured by op (stages after a rank's first are lighter) and hold their
    microbatch number; each panel's title gives the makespan and bubble. The file is
    written to a temporary name in the same folder and renamed into place.

    Args:
        items: schedules (simulated with the defaults) or simulation results.
        path: the PNG to write.
        title: a heading over all panels.
    """
    require_matplotlib("render_png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    seq = [items] if isinstance(items, (Schedule, SimResult)) else list(items)
    results = [_result(it) for it in seq]
    heights = [0.42 * r.schedule.p + 0.9 for r in results]
    fig = Figure(figsize=(14, sum(heights) + (0.5 if title else 0.2)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(results), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    for ax, res in zip(axes, results, strict=True):
        _panel(ax, res)
    axes[-1].set_xlabel("time")
    axes[-1].set_xlim(0, max([r.makespan for r in results] + [1e-9]))
    used = sorted({e.action.op for r in results for e in r.events}, key="FBIW".index)
    axes[0].legend(handles=[Patch(color=_COLORS[op], label=_NAMES[op]) for op in used],
                   loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(used), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    _save_atomically(fig, os.fspath(path))


def _panel(ax: Any, res: SimResult) -> None:
    from matplotlib.colors import to_rgb

    sched = res.schedule
    for e in res.events:
        chunk = e.action.stage // sched.p
        light = 0.5 * chunk / (sched.v - 1) if sched.v > 1 else 0.0
        color = tuple(c + (1.0 - c) * light for c in to_rgb(_COLORS[e.action.op]))
        ax.barh(e.rank, e.end - e.start, left=e.start, height=0.8, color=color, edgecolor="white",
                linewidth=0.6)
        ax.text((e.start + e.end) / 2, e.rank, str(e.action.microbatch), ha="center", va="center",
                fontsize=6.5, color="black" if light > 0.2 else "white")
    ax.set_yticks(range(sched.p), [f"rank {r}" for r in range(sched.p)])
    ax.set_ylim(sched.p - 0.5, -0.5)
    v = f", v={sched.v}" if sched.v > 1 else ""
    ax.set_title(f"{sched.name} (p={sched.p}, m={sched.m}{v}): makespan {res.makespan:g}, "
                 f"bubble {100 * res.bubble:.1f}%", fontsize=10, loc="left")


def _save_atomically(fig: Any, path: str) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
