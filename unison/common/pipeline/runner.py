"""What every framework's pipeline executor does around the driver, written once.

An executor (``unison.torch_backend.Pipeline``, the Keras one) owns stage modules and a
:class:`~unison.common.pipeline.driver.StageWorker`; the rest is the same for every framework
and lives here: the checks of the arguments and the cut into stages (agreed over the job), the
communicators of a data x pipeline grid, the training and forward-only drivers, the pre-flight
check of a batch, and the loss every rank returns::

    world (Dup)  --Split by pipeline-->  pipeline comm  --> PipelineDriver(schedule)
                                                        --> PipelineDriver(fill_drain) for evaluation
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from unison.common.pipeline.builders import build_schedule
from unison.common.pipeline.driver import (
    PipelineDriver,
    PipelineError,
    StageWorker,
    StepStats,
    enter_step,
    raise_together,
)
from unison.common.pipeline.grid import PipelineGrid, fill_drain, world_comm
from unison.common.pipeline.partition import check_balance
from unison.common.pipeline.schedule import Schedule

__all__ = ["PipelineRunner", "CHECKPOINTS", "plan_stages", "agreed", "layer_ranges", "same_on_every_rank",
           "check_ties", "microbatch_shares"]

#: activation checkpointing: never, every microbatch, or every microbatch but the last
CHECKPOINTS = ("never", "always", "except_last")

#: numbers the runners a process builds; built collectively, so each has one number on every rank
_RUNNERS = itertools.count()

T = TypeVar("T")


def agreed(make: Callable[[], T], failed: str | None = None) -> T:
    """``make()`` on every rank of the job; collective.

    Args:
        make: what to run.
        failed: what ``make`` does, for messages. A ValueError or TypeError of ``make`` speaks
            for itself when ``failed`` is None; any other exception (and any at all when
            ``failed`` is given) is reported as ``"<failed> failed: <type>: <message>"``.

    Raises:
        PipelineError: on every rank, with the first failing rank's message, when ``make``
            raised on any rank (so no rank goes on to wait for the others); on that rank its
            ``__cause__`` is the original exception.
    """
    result, problem, error = None, None, None
    try:
        result = make()
    except Exception as exc:
        what = failed or "setting up the pipeline"
        plain = failed is None and isinstance(exc, (ValueError, TypeError))
        problem, error = (str(exc) if plain else f"{what} failed: {type(exc).__name__}: {exc}"), exc
    try:
        raise_together(world_comm(), problem)
    except PipelineError as agreed_error:
        raise agreed_error from error
    return result  # type: ignore[return-value]  # set: raise_together raised otherwise


def same_on_every_rank(comm: Any, **values: Any) -> None:
    """Raise the same PipelineError on every rank unless ``values`` agree across ``comm``; collective.

    Ranks built with different balances, chunk counts or schedules would exchange messages the
    others never expect: instead of a hang or a silently different model, every rank names the
    values that differ, rank by rank.
    """
    mine = {key: repr(value) for key, value in values.items()}
    everyone = comm.allgather(mine)
    differ = [key for key in mine if len({theirs.get(key) for theirs in everyone}) > 1]
    if differ:
        listing = "; ".join(
            f"{key}: " + ", ".join(f"rank {r} {theirs.get(key)}" for r, theirs in enumerate(everyone))
            for key in differ)
        raise PipelineError(f"the pipeline was built with different arguments on different ranks ({listing}); "
                            "pass the same values on every rank (a balance measured on each rank differs: "
                            "measure it with unison's balance_by_time, where rank 0's timings decide, or "
                            "broadcast it)")


def plan_stages(num_layers: int, balance: Sequence[int] | None, default: Callable[[int], list[int]],
                chunks: int, schedule: str, v: int, checkpoint: str, pp: int) -> tuple[Schedule, list[int]]:
    """The checks every executor makes, and its cut of ``num_layers`` layers into stages.

    Args:
        default: ``default(num_stages)`` -> the balance to use when ``balance`` is None.

    Returns:
        The schedule and the balance (layers per stage).

    Raises:
        ValueError: (a ScheduleError for schedules and balances) with the values and the fix.
    """
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINTS)}; received {checkpoint!r}")
    built = build_schedule(schedule, pp, chunks, v)
    stages = built.num_stages
    if num_layers < stages:
        raise ValueError(f"the model has {num_layers} layers, too few for {stages} stages (p={pp} ranks x "
                         f"v={v}); use fewer ranks or virtual stages, or split the model into more layers")
    sizes = default(stages) if balance is None else check_balance(balance, num_layers, pp, v)
    return built, sizes


def layer_ranges(balance: Sequence[int], stages: Sequence[int]) -> dict[int, range]:
    """Stage -> the indices of its layers in the model, for the given ``stages``."""
    starts = list(itertools.accumulate([0, *balance]))
    return {s: range(starts[s], starts[s + 1]) for s in stages}


class PipelineRunner:
    """The framework-neutral part of a pipeline executor; collective to construct.

    Args:
        schedule: the training schedule (its ``p`` is ``grid.pp``).
        chunks: microbatches per step (the schedule's ``m``).
        grid: where this rank sits.
        names: what the executor's API calls the inputs and the targets, for messages.
        **layout: more values that must be the same on every rank (the balance, the
            checkpoint mode, the layer count); checked with the schedule's, see
            :func:`same_on_every_rank`.
    """

    def __init__(self, schedule: Schedule, chunks: int, grid: PipelineGrid,
                 names: tuple[str, str] = ("inputs", "targets"), **layout: Any) -> None:
        same_on_every_rank(world_comm(), schedule=schedule.name, p=schedule.p, chunks=chunks, v=schedule.v,
                           pp=grid.pp, dp=grid.dp, tp=grid.tp, **layout)
        self.schedule, self.chunks, self.grid, self.names = schedule, chunks, grid, names
        self._world = world_comm().Dup()
        pipe = self._world.Split(color=grid.pipeline, key=grid.position)
        #: the executors this process built, in order (collectively: the same index on every rank)
        self.index = next(_RUNNERS)
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
            if n == 0:
                return (f"{name} has a batch of 0 rows on the rank holding {stage}; a step needs at least "
                        f"chunks={self.chunks} rows (one per microbatch): skip empty batches")
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

    def run(self, worker: StageWorker, problem: str | None, train: bool, purpose: str = "forward") -> StepStats:
        """One step of the training schedule, or (``train=False``) a forward-only pass for ``purpose``
        (``"evaluate"``, ``"predict"``)."""
        # [Note: a pipeline step is entered through the engine] (before the first evaluate's setup, collective)
        # A forward-only step is named by its purpose: evaluate on one rank and predict on another paired as
        # one step, then evaluate waited for ever in global_loss's all-reduce, which predict never makes
        # (before 2026-12-07; found by an audit). Named apart, they fail on every rank as a stall.
        kind = "train" if train else f"{purpose}.{self.chunks}"
        flagged = enter_step(self._world, f"pipeline.{self.index}.{kind}", problem)
        if train:
            driver = self.driver
        else:
            driver = self._eval.get(self.chunks)  # type: ignore[assignment]
            if driver is None:
                s = self.schedule
                driver = self._eval[self.chunks] = PipelineDriver(fill_drain(s.p, self.chunks, s.v),
                                                                  self.driver.comm, world=self._world)
        self.stats = driver.step(worker, check=problem, flagged=flagged)
        return self.stats

    def replica_share(self, batch: Any, weight: float | None = None) -> float:
        """``dp * rows / global rows``: the weight of this pipeline's mean loss and gradients among the
        replicas (1.0 when they all had the same batch size); collective on a grid (``dp > 1``).

        Each replica's loss and gradients are means over its own batch; weighted by this share, the
        average over the replicas is the mean over every row of the global batch (before 2026-12-05
        replicas with different batch sizes counted alike). The rows come from the ranks holding
        stage 0 (``batch``: this rank's inputs, anything with a ``shape``). A loss whose mean counts
        its targets unequally (ignored or class-weighted targets: [Note: weighted microbatches]) passes
        ``weight``, the total weight of this replica's targets, on the ranks holding the last stage:
        when every replica has one, the shares are ``dp * weight / global weight`` instead.
        """
        if self.grid.dp == 1:
            return 1.0
        shape = getattr(batch, "shape", None)
        rows = int(shape[0]) if self.holds_first and shape is not None and len(shape) else -1
        counted = float(weight) if self.holds_last and weight is not None else -1.0
        replica = self.grid.pipeline // self.grid.tp  # a tensor group's shards run one replica's batch
        per_replica: dict[int, float] = {}
        weights: dict[int, float] = {}
        for theirs, n, w in self._world.allgather((replica, rows, counted)):
            if n >= 0:
                per_replica[theirs] = n
            if w >= 0:
                weights[theirs] = w
        if weights and set(weights) == set(per_replica):  # (every replica's loss is a weighted mean)
            per_replica = weights
        total = sum(per_replica.values())
        if len(set(per_replica.values())) <= 1 or total == 0 or replica not in per_replica:
            return 1.0
        return self.grid.dp * per_replica[replica] / total

    def global_loss(self, local: float, mean: bool = True) -> float:
        """The last stage's ``local`` loss on every rank; averaged over the replicas when ``mean``."""
        from mpi4py import MPI

        total = np.array([local if self.holds_last else 0.0])
        self._world.Allreduce(MPI.IN_PLACE, [total, MPI.DOUBLE], op=MPI.SUM)
        return float(total[0]) / ((self.grid.dp if mean else 1) * self.grid.tp)  # a tensor group's ranks agree

    def close(self) -> None:
        """Free the communicators and buffers (collective); idempotent."""
        if self._world is None:
            return
        for driver in [self.driver, *self._eval.values()]:
            driver.close()
        self._world.Free()
        self._world = None


def check_ties(held: Sequence[Sequence[tuple[int, str]]], balance: Sequence[int], schedule: Schedule,
               what: str = "a parameter") -> None:
    """Refuse a tensor shared by layers whose stages sit on different ranks (tied weights).

    Each rank would train its own copy with only its stages' part of the gradient, and the copies
    drifted apart silently (before 2026-12-05). Layers on one rank share the tensor, which gets
    both uses' gradients, as in one process.

    Args:
        held: per layer, ``(id(tensor), its name there)`` of each of its weights.
        what: how the message names such a tensor (``"a parameter"``, ``"the variable"``).

    Raises:
        ValueError: naming the layers, their stages and ranks, and the fix.
    """
    starts = list(itertools.accumulate(balance))
    first: dict[int, tuple[int, str]] = {}  # id(tensor) -> (its first layer, its name there)
    for i, weights in enumerate(held):
        for key, name in weights:
            j, first_name = first.setdefault(key, (i, name))
            sj, si = (bisect.bisect_right(starts, k) for k in (j, i))
            rj, ri = schedule.stage_rank(sj), schedule.stage_rank(si)
            if rj != ri:
                raise ValueError(
                    f"layers {j} and {i} share {what} ({j}.{first_name} is {i}.{name}: tied weights) but sit in "
                    f"stages {sj} and {si}, on pipeline ranks {rj} and {ri}; each rank would train its own copy. "
                    "Choose a balance that puts both layers on one rank, or untie the weights")


def microbatch_shares(weights: Sequence[float] | None, chunks: int) -> tuple[list[float], float | None]:
    """Each microbatch's factor in its replica's mean loss, and the replica's total weight (None: plain).

    [Note: weighted microbatches] A step's loss is the mean over the whole batch, and each
    microbatch's loss is a mean over its own targets. Scaled by ``1 / chunks`` they add up to the
    batch's mean only when every target counts alike. A cross-entropy with ``ignore_index`` (the
    padding of a language model's sequences) or class weights divides by the weight of the targets
    it counted, which differs between microbatches: scaled by ``1 / chunks``, the gradients were
    up to 45% off one process's and a microbatch of padding alone made the loss NaN (found by an
    audit, 2026-12-06). Each backend reads such a loss's weights from the targets (``weights``, one
    per microbatch: the denominator of its mean) and scales each microbatch by ``weight / total``;
    across the replicas of a grid :meth:`PipelineRunner.replica_share` uses the totals. A
    microbatch that counts nothing adds nothing (its factor is 0, and the backends skip its NaN).
    """
    if weights is None:
        return [1.0 / chunks] * chunks, None
    total = float(sum(weights))
    if total <= 0:
        return [0.0] * len(weights), 0.0
    return [float(w) / total for w in weights], total
