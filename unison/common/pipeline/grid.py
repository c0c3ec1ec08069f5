"""What both executors need around the driver: the data x pipeline layout and a forward-only order.

::

    pp = 2, dp = 2       position 0 (stages 0, 2, ...)   position 1 (stages 1, 3, ...)
      pipeline 0              rank 0                          rank 1
      pipeline 1              rank 2                          rank 3
                         data group {0, 2}               data group {1, 3}

Rank ``d * pp + i`` is position ``i`` of pipeline ``d``. The ranks at one position hold the same
stages, so after each step their gradients are averaged over that position's *data group*, a
process set registered with the engine. Nothing here imports a framework: the PyTorch and the
Keras executors share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from unison.common import runtime
from unison.common.engine.frontend import add_process_set
from unison.common.engine.process_sets import ProcessSet
from unison.common.pipeline.driver import raise_together
from unison.common.pipeline.schedule import Action, Schedule

T = TypeVar("T")

__all__ = ["PipelineGrid", "pipeline_grid", "check_pipeline_grid", "world_comm", "fill_drain", "rank0_decides"]


@dataclass(frozen=True)
class PipelineGrid:
    """Where this rank sits in a data x pipeline layout.

    Attributes:
        pp: ranks per pipeline. dp: pipelines (data-parallel replicas).
        pipeline: this rank's pipeline ``d`` (its rank among the replicas).
        position: this rank's place ``i`` in its pipeline (it holds stages ``i, i + pp, ...``).
        data_set: the registered process set of the ranks at this position; None when ``dp == 1``.
        tp: ranks per tensor group: each stage is split over ``tp`` ranks, which run the
            schedule in lockstep as ``tp`` pipelines (one per shard) and hold the same loss.
        ranks: the job ranks of this rank's pipeline in stage order, when they are not
            ``pipeline * pp + i`` (a data x pipeline x tensor grid).
    """

    pp: int
    dp: int
    pipeline: int
    position: int
    data_set: ProcessSet | None = None
    tp: int = 1
    ranks: tuple[int, ...] | None = None

    @property
    def pipeline_ranks(self) -> list[int]:
        """The job ranks of this rank's pipeline, in stage order."""
        if self.ranks is not None:
            return list(self.ranks)
        return [self.pipeline * self.pp + i for i in range(self.pp)]


def pipeline_grid(pp: int | None = None, dp: int = 1) -> PipelineGrid:
    """Arrange the job as ``dp`` pipelines of ``pp`` ranks; collective (every rank, same arguments).

    Registers one process set per pipeline position when ``dp > 1`` (each layout once per
    process: asking again returns the same sets). Calls ``unison.init()`` if needed.

    Args:
        pp: ranks per pipeline; default ``size // dp``.
        dp: data-parallel replicas.

    Raises:
        PipelineError: on every rank, when ``pp * dp`` is not the job's size or a value is not a
            positive integer.
    """
    if not runtime.is_initialized():
        runtime.init()
    size, rank = runtime.size(), runtime.rank()
    raise_together(world_comm(), _problem(pp, dp, size))
    pp = size // dp if pp is None else pp
    data_set = None
    if dp > 1:
        # this session's registered data groups (they die with it), so repeated grids reuse them
        registered = runtime.state().cache.setdefault("pipeline.grids", {})
        if (pp, dp) not in registered:
            registered[(pp, dp)] = [add_process_set(ProcessSet([d * pp + i for d in range(dp)]))
                                    for i in range(pp)]
        data_set = registered[(pp, dp)][rank % pp]
    return PipelineGrid(pp, dp, rank // pp, rank % pp, data_set)


def check_pipeline_grid(grid: Any) -> None:
    """Refuse a ``grid=`` that is not a :class:`PipelineGrid` (before any communicator exists).

    Before 2026-12-07 unison's tensor-parallel ``Grid`` got as far as splitting the job's (duplicated)
    communicator and raised AttributeError "'Grid' object has no attribute 'pipeline'" in the Keras executor,
    "... no attribute 'position'" in the torch one (found by an audit). Both executors call it first.

    Raises:
        TypeError: naming the value and the constructor to use.
    """
    if isinstance(grid, PipelineGrid):
        return
    if hasattr(grid, "register") and hasattr(grid, "coords"):  # unison.common.tensor_parallel.Grid
        raise TypeError(f"grid= takes this rank's pipeline layout, a PipelineGrid; received the tensor-parallel "
                        f"{grid!r}. Pass grid=grid_pipeline(grid, sets) (from unison.common.tensor_parallel, "
                        "with sets = grid.register()), and build the tensor-parallel layers on sets.tp")
    raise TypeError(f"grid= takes a PipelineGrid: hvd.pipeline_grid(pp, dp), or grid_pipeline(grid, sets) for a "
                    f"tensor-parallel Grid; received {type(grid).__name__} {grid!r}")


def world_comm() -> Any:
    """The job's communicator (Unison's own duplicate of it), for use from the main thread."""
    comm = runtime.state("a pipeline").comm
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_SELF
    return comm


def rank0_decides(value: T) -> T:
    """Rank 0's ``value`` on every rank when Unison runs on several ranks (collective), else ``value``."""
    if not runtime.is_initialized() or runtime.size() == 1:
        return value
    return world_comm().bcast(value, root=0)  # type: ignore[attr-defined, no-any-return]


def fill_drain(p: int, m: int, v: int) -> Schedule:
    """A schedule for forward-only passes: every forward in order, then (empty) backwards.

    Forward-only is not a schedule of its own (the validator wants a backward for every
    forward), so evaluation runs this fill-drain order with backwards that compute nothing.
    Stage-major on each rank: all microbatches through a rank's first stage, then its next, so
    with interleaved stages (v > 1) the pipeline fills once, ``m * v + p - 1`` thin-stage times.
    Before 2026-12-07 the order was microbatch-major (each microbatch through all of a rank's
    stages before the next): microbatch k + 1 waited for k to come round the whole ring, and at
    p=4, m=8, v=2 a forward pass took 21.5 thin-stage times instead of 9.5 (an audit).
    """
    rows = []
    for r in range(p):
        stages = [r + k * p for k in range(v)]
        rows.append(tuple(Action("F", s, k) for s in stages for k in range(m))
                    + tuple(Action("B", s, k) for s in reversed(stages) for k in range(m)))
    return Schedule("forward-only", p, m, v, tuple(rows))


def _problem(pp: object, dp: object, size: int) -> str | None:
    for name, value in (("pp", pp), ("dp", dp)):
        if value is None and name == "pp":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"pipeline_grid: {name} must be a positive integer; received {name}={value!r}"
    if pp is None:
        if size % dp:  # type: ignore[operator]
            return (f"pipeline_grid(dp={dp}): the job's {size} ranks do not split into {dp} pipelines; use a "
                    f"dp that divides {size}")
        return None
    want = pp * dp  # type: ignore[operator]
    if want != size:
        more = "more" if want > size else "fewer"
        return (f"pipeline_grid(pp={pp}, dp={dp}) needs pp * dp = {want} ranks, {more} than the job's {size}; "
                f"a pipeline of pp stages needs pp ranks per replica, so use pp * dp == {size} or launch "
                f"{want} ranks")
    return None
