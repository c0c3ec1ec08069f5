"""A data x pipeline x tensor grid as the pipeline executors' layout.

The pipeline executors take a :class:`~unison.common.pipeline.grid.PipelineGrid`: which
pipeline this rank belongs to, its position in it, and the data group that averages its
stage's gradients. On a :class:`Grid` with ``tp > 1`` every stage is split over a tensor group,
and the stage's ``tp`` shards run the schedule in lockstep: shard ``t`` of every stage of
replica ``d`` forms one pipeline (ranks ``rank_of(p, d, t)`` for ``p = 0..pp-1``), so a
stage's activations travel point to point between matching shards, while the tensor-parallel
layers inside a stage talk over the tensor group. Gradients are averaged over the data group
only (the ``dp`` ranks that hold the same shard of the same stage); the loss, which every rank
of the last stage's tensor group computes alike, is counted once per group.
"""

from __future__ import annotations

from unison.common import runtime
from unison.common.pipeline.grid import PipelineGrid
from unison.common.tensor_parallel.grid import Grid, GridSets

__all__ = ["grid_pipeline"]


def grid_pipeline(grid: Grid, sets: GridSets | None = None) -> PipelineGrid:
    """This rank's pipeline layout on ``grid``; pass it as the executors' ``grid=``.

    Args:
        grid: the job's data x pipeline x tensor grid.
        sets: this rank's sets from ``grid.register()`` (registered here when None; collective then).

    Raises:
        ValueError: the grid does not describe the running job.
    """
    sets = sets if sets is not None else grid.register()
    me = runtime.rank()
    p, d, t = grid.coords(me)
    return PipelineGrid(pp=grid.pp, dp=grid.dp, pipeline=d * grid.tp + t, position=p,
                        data_set=sets.dp if grid.dp > 1 else None, tp=grid.tp,
                        ranks=tuple(grid.pp_group_ranks(me)))
