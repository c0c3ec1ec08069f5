"""A picture of the data x pipeline x tensor grid: which rank holds which shard, stage and replica.

The text form is :meth:`Grid.describe`; this module draws the same layout as boxes, one per
rank, for a PNG in the docs or a run's log folder::

                     data replica 0          data replica 1
                   +----------------+      +----------------+
      stage 0      | [0]      [1]   |      | [2]      [3]   |     (one frame per tensor group;
                   +----------------+      +----------------+      a box's colour is its shard,
      stage 1      | [4]      [5]   |      | [6]      [7]   |      so a data group is one colour
                   +----------------+      +----------------+      along a row, a pipeline group
                                                                   one column)

The geometry is plain data (:func:`layout`), tested in one process; matplotlib is imported
only inside :func:`render_png`, through its Agg canvas, so importing this module needs nothing
but the standard library and never changes pyplot's backend.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from unison.common.files import atomic_path
from unison.common.plotting import require_matplotlib

if TYPE_CHECKING:
    from unison.common.tensor_parallel.grid import Grid

__all__ = ["Box", "layout", "render_png"]

#: the most ranks one picture draws (one box each); beyond it the labels cannot be read
MAX_RANKS = 512
#: the gap between two tensor groups of a row, in box widths
GROUP_GAP = 0.6
#: how many groups of one kind the footer lists before "..."
LISTED_GROUPS = 8
#: one fill per tensor shard (cycled past ten), and one frame colour per data replica
_SHARD_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3",
                 "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")
_FRAME_COLORS = ("#1b3a6b", "#7a3b0c", "#1e5631", "#6b1d1f", "#3f2d6e")


class Box(NamedTuple):
    """One rank's box: its coordinates in the grid and the box's lower-left corner (unit boxes;
    ``y`` grows downwards with the stage)."""

    rank: int
    stage: int
    replica: int
    shard: int
    x: float
    y: float


def layout(grid: Grid) -> list[Box]:
    """Where each rank's box goes: row = pipeline stage, column group = data replica, and the
    tensor shards side by side inside the group, ``GROUP_GAP`` between groups; in rank order."""
    boxes = []
    for rank in range(grid.size):
        c = grid.coords(rank)
        x = c.dp * (grid.tp + GROUP_GAP) + c.tp
        boxes.append(Box(rank, c.pp, c.dp, c.tp, x, float(c.pp) * 1.5))
    return boxes


def _check_target(path: str | os.PathLike[str]) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Grid.render_png: path must be a str or os.PathLike naming the PNG to write; received "
                        f"{type(path).__name__} {path!r}")
    target = os.fspath(path)
    folder = os.path.dirname(target) or os.curdir
    if not target or target.endswith(os.sep):
        raise ValueError(f"Grid.render_png: path must name a file; received {target!r}. Add a file name such "
                         "as 'grid.png'")
    if os.path.isdir(target):
        raise IsADirectoryError(f"Grid.render_png: {target!r} is a folder; name a file inside it, such as "
                                f"{os.path.join(target, 'grid.png')!r}")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"Grid.render_png: the folder {folder!r} of {target!r} does not exist; create it "
                                "first or choose a path in an existing folder")
    return target


def _check_labels(grid: Grid, stage_labels: Sequence[str] | None) -> list[str]:
    if stage_labels is None:
        return [f"stage {p}" for p in range(grid.pp)]
    labels = [str(s) for s in stage_labels]
    if len(labels) != grid.pp:
        raise ValueError(f"Grid.render_png: stage_labels needs one label per pipeline stage ({grid.pp}); received "
                         f"{len(labels)}: {labels!r}")
    return [f"stage {p}\n{label}" for p, label in enumerate(labels)]


def _listed(groups: list[list[int]]) -> str:
    shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups[:LISTED_GROUPS])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > LISTED_GROUPS else "")


def render_png(grid: Grid, path: str | os.PathLike[str], title: str | None = None,
               stage_labels: Sequence[str] | None = None) -> None:
    """Draw ``grid`` as one box per rank into a PNG (see the module docstring for the picture).

    Each box shows its rank and tensor shard; boxes are filled by shard, each tensor group is
    framed in its data replica's colour, rows are labelled by stage (with ``stage_labels``
    beneath, e.g. which layers a stage holds), and a footer lists every kind of group. The
    file is written to a temporary name in the same folder and renamed into place.

    Args:
        grid: the layout to draw.
        path: the PNG to write; its folder must exist.
        title: the heading; default ``"Grid(dp=.., pp=.., tp=..): N ranks"`` and the rank formula.
        stage_labels: one line per pipeline stage, shown under ``stage p``.

    Raises:
        TypeError: ``path`` is not a str or path.
        ValueError: ``path`` names no file, ``stage_labels`` has not ``pp`` entries, or the grid has
            more than ``MAX_RANKS`` ranks.
        FileNotFoundError: ``path``'s folder does not exist.
        IsADirectoryError: ``path`` is a folder.
        ImportError: matplotlib cannot be imported (the message says what to install).
    """
    target = _check_target(path)
    labels = _check_labels(grid, stage_labels)
    if grid.size > MAX_RANKS:
        raise ValueError(f"Grid.render_png draws one box per rank, at most {MAX_RANKS}; {grid!r} has {grid.size} "
                         "ranks. Use Grid.describe() for the text table instead")
    require_matplotlib("Grid.render_png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width = grid.dp * (grid.tp + GROUP_GAP) - GROUP_GAP
    fig = Figure(figsize=(min(30.0, 2.2 + 0.95 * width), 1.9 + 1.05 * grid.pp), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _draw(ax, grid, labels, width)
    fig.suptitle(title or f"{grid!r}: {grid.size} ranks    rank = pp * {grid.dp * grid.tp} + dp * {grid.tp} + tp",
                 fontsize=11)
    with atomic_path(target) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def _draw(ax: Any, grid: Grid, labels: list[str], width: float) -> None:
    boxes = layout(grid)
    for box in boxes:
        _rank_box(ax, box, grid.tp)
    for p in range(grid.pp):
        for d in range(grid.dp):
            _group_frame(ax, d * (grid.tp + GROUP_GAP), p * 1.5, grid.tp, _FRAME_COLORS[d % len(_FRAME_COLORS)])
        ax.text(-0.25, p * 1.5 + 0.5, labels[p], ha="right", va="center", fontsize=9)
    for d in range(grid.dp):
        ax.text(d * (grid.tp + GROUP_GAP) + grid.tp / 2, -0.25, f"data replica {d}", ha="center", va="bottom",
                fontsize=9, color=_FRAME_COLORS[d % len(_FRAME_COLORS)], fontweight="bold")
    footer = ("a frame is a tensor group; a colour is a tensor shard\n"
              f"tensor groups: {_listed(grid.tp_groups())}\n"
              f"data groups: {_listed(grid.dp_groups())}\n"
              f"pipeline groups: {_listed(grid.pp_groups())}")
    bottom = (grid.pp - 1) * 1.5 + 1.25
    ax.text(-0.1, bottom, footer, ha="left", va="top", fontsize=8, family="monospace")
    ax.set_xlim(-1.6, width + 0.2)
    ax.set_ylim(bottom + 1.05, -0.7)
    ax.set_aspect("equal")
    ax.axis("off")


def _rank_box(ax: Any, box: Box, tp: int) -> None:
    from matplotlib.patches import FancyBboxPatch

    color = _SHARD_COLORS[box.shard % len(_SHARD_COLORS)]
    ax.add_patch(FancyBboxPatch((box.x + 0.08, box.y + 0.08), 0.84, 0.84, facecolor=color, edgecolor="white",
                                boxstyle="round,pad=0,rounding_size=0.08", linewidth=1))
    ax.text(box.x + 0.5, box.y + 0.42, str(box.rank), ha="center", va="center", fontsize=13, color="white",
            fontweight="bold")
    ax.text(box.x + 0.5, box.y + 0.78, f"shard {box.shard}/{tp}", ha="center", va="center", fontsize=6.5,
            color="white")


def _group_frame(ax: Any, x: float, y: float, tp: int, color: str) -> None:
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x - 0.02, y - 0.02), tp + 0.04, 1.04, fill=False, edgecolor=color, linewidth=2))
