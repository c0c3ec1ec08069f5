"""The data x pipeline x tensor grid: which ranks form each group, without a framework.

Hybrid parallelism splits the job three ways. A *tensor group* holds the shards of one layer
and talks on every layer (an all-reduce per block forward), so its ranks are the closest
together; a *data group* averages gradients once per step; a *pipeline group* passes
activations between stages. The rank order puts tensor groups on neighbouring ranks (one
host, when ranks are placed host by host), as Megatron-LM does::

    rank = p * (dp * tp) + d * tp + t        t fastest, then d, then p

    dp = 2, pp = 2, tp = 2 (8 ranks)
                      data 0        data 1
      stage 0      [ 0   1 ]     [ 2   3 ]      tensor groups: {0,1} {2,3} {4,5} {6,7}
      stage 1      [ 4   5 ]     [ 6   7 ]      data groups:   {0,2} {1,3} {4,6} {5,7}
                                                pipeline groups: {0,4} {1,5} {2,6} {3,7}

A :class:`Grid` is plain data: it can be built, printed and checked in one process.
:meth:`Grid.register` turns its groups into registered process sets (a collective).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

from unison.common import runtime
from unison.common.engine.frontend import add_process_set
from unison.common.engine.process_sets import ProcessSet

__all__ = ["Grid", "Coords", "GridSets"]


class Coords(NamedTuple):
    """Where a rank sits: its pipeline stage ``pp``, data replica ``dp`` and tensor shard ``tp``."""

    pp: int
    dp: int
    tp: int


class GridSets(NamedTuple):
    """One rank's registered process sets (see :meth:`Grid.register`)."""

    tp: ProcessSet
    dp: ProcessSet
    pp: ProcessSet


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Grid: {name} must be a positive integer; received {name}={value!r}. "
                         f"Pass {name}=1 for no {_WHAT[name]} parallelism")
    return value


_WHAT = {"dp": "data", "pp": "pipeline", "tp": "tensor", "size": "job"}


def _job_size() -> int | None:
    return runtime.size() if runtime.is_initialized() else None


class Grid:
    """A data x pipeline x tensor layout of ``size`` ranks (see the module docstring for the order).

    Args:
        dp: data-parallel replicas; None: what ``size`` leaves after ``pp * tp``.
        pp: pipeline stages (ranks per pipeline).
        tp: ranks per tensor group (shards of each layer).
        size: ranks in the job; None: the running job's size when Unison is initialized,
            otherwise ``dp * pp * tp``.

    Raises:
        ValueError: a size that is not a positive integer, or ``dp * pp * tp != size``.
    """

    def __init__(self, dp: int | None = None, pp: int = 1, tp: int = 1, size: int | None = None) -> None:
        self.pp = _check_positive("pp", pp)
        self.tp = _check_positive("tp", tp)
        size = _job_size() if size is None else _check_positive("size", size)
        if dp is None:
            dp = 1 if size is None else self._rest(size)
        self.dp = _check_positive("dp", dp)
        self.size = self.dp * self.pp * self.tp if size is None else size
        if self.dp * self.pp * self.tp != self.size:
            raise ValueError(self._mismatch())

    def _rest(self, size: int) -> int:
        if size % (self.pp * self.tp):
            raise ValueError(f"Grid(pp={self.pp}, tp={self.tp}): the job's {size} ranks do not split into "
                             f"groups of pp * tp = {self.pp * self.tp}; use pp * tp dividing {size}")
        return size // (self.pp * self.tp)

    def _mismatch(self) -> str:
        want = self.dp * self.pp * self.tp
        return (f"Grid(dp={self.dp}, pp={self.pp}, tp={self.tp}) needs dp * pp * tp = {want} ranks, but the "
                f"job has {self.size}; choose sizes whose product is {self.size} (or leave dp=None to fill the "
                f"job), or launch {want} ranks")

    def __repr__(self) -> str:
        return f"Grid(dp={self.dp}, pp={self.pp}, tp={self.tp})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Grid) and (self.dp, self.pp, self.tp) == (other.dp, other.pp, other.tp)

    def __hash__(self) -> int:
        return hash((self.dp, self.pp, self.tp))

    # ------------------------------------------------------------------ positions

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(f"{self!r}: rank must be an integer in [0, {self.size}); received rank={rank!r}")
        return rank

    def coords(self, rank: int) -> Coords:
        """``rank``'s (pipeline stage, data replica, tensor shard)."""
        r = self._check_rank(rank)
        return Coords(r // (self.dp * self.tp), (r // self.tp) % self.dp, r % self.tp)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """The rank at stage ``pp``, replica ``dp``, shard ``tp`` (the inverse of :meth:`coords`)."""
        for name, value, bound in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp)):
            if not 0 <= value < bound:
                raise ValueError(f"{self!r}: {name} coordinate must be in [0, {bound}); received {name}={value}")
        return pp * self.dp * self.tp + dp * self.tp + tp

    def tp_group_ranks(self, rank: int) -> list[int]:
        """The ranks holding the other shards of ``rank``'s layers, in shard order."""
        c = self.coords(rank)
        return [self.rank_of(c.pp, c.dp, t) for t in range(self.tp)]

    def dp_group_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same shard of the same stage as ``rank`` (they average gradients)."""
        c = self.coords(rank)
        return [self.rank_of(c.pp, d, c.tp) for d in range(self.dp)]

    def pp_group_ranks(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s pipeline, in stage order."""
        c = self.coords(rank)
        return [self.rank_of(p, c.dp, c.tp) for p in range(self.pp)]

    # ------------------------------------------------------------------ all groups

    def tp_groups(self) -> list[list[int]]:
        """Every tensor group, ordered by its lowest rank."""
        return [self.tp_group_ranks(r) for r in range(0, self.size, self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """Every data group, ordered by its lowest rank."""
        return [self.dp_group_ranks(r) for r in range(self.size) if self.coords(r).dp == 0]

    def pp_groups(self) -> list[list[int]]:
        """Every pipeline group, ordered by its lowest rank."""
        return [self.pp_group_ranks(r) for r in range(self.dp * self.tp)]

    def describe(self) -> str:
        """A text table: one row per pipeline stage, one bracketed tensor group per data replica."""
        width = len(str(self.size - 1))
        lines = [f"{self!r} over {self.size} ranks (rank = pp * {self.dp * self.tp} + dp * {self.tp} + tp)"]
        for p in range(self.pp):
            cells = ["[" + " ".join(f"{self.rank_of(p, d, t):>{width}}" for t in range(self.tp)) + "]"
                     for d in range(self.dp)]
            lines.append(f"  stage {p}: " + "  ".join(cells))
        for kind in ("tp", "dp", "pp"):
            groups = getattr(self, f"{kind}_groups")()
            lines.append(f"  {_WHAT[kind]} groups: " + " ".join("{" + ",".join(map(str, g)) + "}" for g in groups))
        return "\n".join(lines)

    # ------------------------------------------------------------------ process sets

    def register(self) -> GridSets:
        """Register every group as a process set and return this rank's three; collective.

        Every rank of the job calls it with the same grid. All tensor groups are registered
        first, then data groups, then pipeline groups, each in :meth:`tp_groups` order, so every
        rank registers the same sets in the same order. A grid registered before in this
        Unison session returns the same sets.

        Raises:
            ValueError: Unison is not initialized, or the grid's size is not the job's.
        """
        job = _job_size()
        if job != self.size:
            has = "Unison is not initialized" if job is None else f"the job has {job}"
            raise ValueError(f"{self!r}.register() needs an initialized Unison job of {self.size} ranks; {has} "
                             "(call unison.init() first and build the grid with size=None)")
        cache = runtime.state().cache.setdefault("tensor_parallel.grids", {})
        if self not in cache:
            cache[self] = {kind: [add_process_set(ProcessSet(g)) for g in getattr(self, f"{kind}_groups")()]
                           for kind in ("tp", "dp", "pp")}
        me = runtime.rank()
        mine = {kind: next(s for s in sets if me in (s.ranks or [])) for kind, sets in cache[self].items()}
        return GridSets(mine["tp"], mine["dp"], mine["pp"])

    # ------------------------------------------------------------------ picture

    def render_png(self, path: str | os.PathLike[str], title: str | None = None,
                   stage_labels: Sequence[str] | None = None) -> None:
        """Draw this grid into a PNG: one box per rank, rows are stages, column groups data replicas,
        tensor shards side by side (see :mod:`unison.common.tensor_parallel.render`).

        Args:
            path: the PNG to write (atomically); its folder must exist.
            title: the heading; default the grid, its size and the rank formula.
            stage_labels: one line per pipeline stage shown under ``stage p`` (what it holds).

        Raises:
            TypeError, ValueError, FileNotFoundError, IsADirectoryError: a bad ``path`` or
                ``stage_labels``, or more ranks than one picture draws; the message says which.
        """
        from unison.common.tensor_parallel.render import render_png

        render_png(self, path, title=title, stage_labels=stage_labels)
