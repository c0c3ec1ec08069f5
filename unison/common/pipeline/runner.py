"""What every framework's pipeline executor does around the driver, written once.

An executor (``unison.torch_backend.Pipeline``, the Keras one) owns stage modules and a
:class:`~unison.common.pipeline.driver.StageWorker`; the rest is the same for every framework
and lives here: the communicators of a data x pipeline grid, the training and forward-only
drivers, the pre-flight check of a batch, and the loss every rank returns::

    world (Dup)  --Split by pipeline-->  pipeline comm  --> PipelineDriver(schedule)
                                                        --> PipelineDriver(fill_drain) for evaluation
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unison.common.pipeline.driver import PipelineDriver, StageWorker, StepStats
from unison.common.pipeline.grid import PipelineGrid, fill_drain, world_comm
from unison.common.pipeline.schedule import Schedule

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """The framework-neutral part of a pipeline executor; collective to construct.

    Args:
        schedule: the training schedule (its ``p`` is ``grid.pp``).
        chunks: microbatches per step (the schedule's ``m``).
        grid: where this rank sits.
        names: what the executor's API calls the inputs and the targets, for messages.
    """

    def __init__(self, schedule: Schedule, chunks: int, grid: PipelineGrid,
                 names: tuple[str, str] = ("inputs", "targets")) -> None:
        self.schedule, self.chunks, self.grid, self.names = schedule, chunks, grid, names
        self._world = world_comm().Dup()
        pipe = self._world.Split(color=grid.pipeline, key=grid.position)
        self.driver = PipelineDriver(schedule, pipe, world=self._world)
        pipe.Free()
        self._eval: dict[int, PipelineDriver] = {}
        #: the timings of the last step (None before the first)
        self.stats: StepStats | None = None

    @property
    def holds_first(self) -> bool:
        """Whether this rank holds stage 0 (it needs the inputs)."""
        return self.grid.position == 0

    @property
    def holds_last(self) -> bool:
        """Whether this rank holds the last stage (it needs the targets)."""
        return self.schedule.stage_rank(self.schedule.num_stages - 1) == self.grid.position

    def batch_problem(self, inputs: Any, targets: Any, need_targets: bool) -> str | None:
        """Why this rank cannot run a step on this batch (a sentence with the fix), or None."""
        held = []
        if self.holds_first:
            held.append((self.names[0], inputs, "stage 0"))
        if self.holds_last and (need_targets or targets is not None):
            held.append((self.names[1], targets, f"the last stage ({self.schedule.num_stages - 1})"))
        rows = {}
        for name, value, stage in held:
            shape = getattr(value, "shape", None)
            if value is None or shape is None or len(shape) == 0:
                what = "None" if value is None else f"{type(value).__name__} without a batch dimension"
                return f"{name} must be a batch (an array or tensor) on the rank holding {stage}; received {what}"
            rows[name] = n = int(shape[0])
            if n % self.chunks:
                k = self.chunks
                near = sorted({max(k, n // k * k), n // k * k + k})
                return (f"{name} has a batch of {n} rows, which {k} microbatches (chunks={k}) do not divide; use "
                        f"a batch that is a multiple of {k} (e.g. {' or '.join(map(str, near))}) or a chunks "
                        f"that divides {n}")
        if len(set(rows.values())) > 1:
            (a, n), (b, k) = rows.items()
            return f"{a} has {n} rows but {b} has {k}; give one target per example"
        return None

    def run(self, worker: StageWorker, problem: str | None, train: bool) -> StepStats:
        """One step of the training schedule, or (``train=False``) a forward-only pass."""
        if train:
            driver = self.driver
        else:
            driver = self._eval.get(self.chunks)  # type: ignore[assignment]
            if driver is None:
                s = self.schedule
                driver = self._eval[self.chunks] = PipelineDriver(fill_drain(s.p, self.chunks, s.v),
                                                                  self.driver.comm, world=self._world)
        self.stats = driver.step(worker, check=problem)
        return self.stats

    def global_loss(self, local: float, mean: bool = True) -> float:
        """The last stage's ``local`` loss on every rank; averaged over the replicas when ``mean``."""
        from mpi4py import MPI

        total = np.array([local if self.holds_last else 0.0])
        self._world.Allreduce(MPI.IN_PLACE, [total, MPI.DOUBLE], op=MPI.SUM)
        return float(total[0]) / (self.grid.dp if mean else 1)

    def close(self) -> None:
        """Free the communicators (collective)."""
        for driver in [self.driver, *self._eval.values()]:
            driver.close()
        self._world.Free()
