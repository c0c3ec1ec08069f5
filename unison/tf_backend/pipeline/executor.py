"""Pipeline-parallel training of a Keras 3 ``Sequential`` across ranks (TensorFlow backend).

The model's layers are cut into ``p * v`` stages (by an explicit balance, or by parameter
count); each rank keeps only its stages. A step splits the batch into ``chunks`` microbatches
and runs a schedule from ``unison.common.pipeline`` through the framework-neutral driver,
which moves activations and gradients point to point and makes a failure on any rank raise
the same :class:`PipelineError` on every rank. The last stage computes the loss. On a data x
pipeline grid, each stage's gradients are then averaged over the ranks that hold the same
stage (an engine all-reduce over that position's process set), and each stage's own Keras
optimizer applies them; the stages' moving statistics are averaged over the same set after the
step, and each replica draws from its own random stream.

A step computes the gradient of the loss over the whole batch with Keras's reduction, so ``k``
steps equal the unpartitioned model trained in one process on the same batches (layers that mix
rows of a batch, such as BatchNormalization, differ by their microbatch statistics; random
layers draw per microbatch).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from unison.common import runtime
from unison.common.engine import frontend
from unison.common.ops import Average, Sum
from unison.common.pipeline import PipelineError, Schedule, ScheduleError, balance_by_cost
from unison.common.pipeline.grid import (
    PipelineGrid,
    check_pipeline_grid,
    pipeline_grid,
    rank0_decides,
    world_comm,
)
from unison.common.pipeline.runner import PipelineRunner, agreed, check_ties, layer_ranges, plan_stages
from unison.tf_backend.functions import broadcast_variables
from unison.tf_backend.pipeline.fit import fit
from unison.tf_backend.pipeline.stages import KerasStage, KerasStages, _unique, scaled_loss

__all__ = ["Pipeline", "balance_by_params"]

_instances = itertools.count()


def balance_by_params(layers: Sequence[keras.Layer], p: int) -> list[int]:
    """Layers per stage for ``p`` stages with the largest stage's parameter count as small as possible.

    Raises:
        ScheduleError: fewer layers than stages, or ``p`` not a positive integer.
        ValueError: a layer is not built.
    """
    return balance_by_cost([layer.count_params() for layer in layers], p)


def balance_by_time(model: keras.Sequential | Sequence[keras.Layer], sample: Any, p: int,
                    repeats: int = 3) -> list[int]:
    """Layers per stage for ``p`` stages with the slowest stage as fast as possible.

    Each layer's forward and backward time (a compiled ``tf.function`` per layer, timed after
    one untimed call) is measured on ``sample`` (one microbatch), the fastest of ``repeats``
    runs. When Unison runs on several ranks this is collective: every rank measures, rank 0's
    times decide, and every rank returns the same balance.

    Raises:
        ScheduleError: fewer layers than stages, or ``repeats`` below 1.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ScheduleError(f"repeats must be a positive integer; received {repeats!r}")
    x = tf.convert_to_tensor(sample)
    layers = _as_layers(model, tuple(x.shape[1:]), x.dtype.name)
    # the measurement trains each layer's forward: put its state (BatchNormalization's moving
    # statistics, Dropout's seed generator) back afterwards, so measuring changes nothing
    state = [v for layer in layers for v in layer.non_trainable_variables]
    saved = [v.numpy() for v in state]
    try:  # agreed: a measurement that fails on one rank raises on every rank (it left rank 0 going on alone)
        times = agreed(lambda: _time_layers(layers, x, repeats), failed="balance_by_time's measurement")
    finally:
        for v, value in zip(state, saved, strict=True):
            v.assign(value)
    return balance_by_cost(rank0_decides(times), p)


def _time_layers(layers: list[keras.Layer], x: Any, repeats: int) -> list[float]:
    times = []
    for layer in layers:
        step = tf.function(_forward_backward(layer))
        step(x)  # trace
        best = math.inf
        for _ in range(repeats):
            start = perf_counter()
            _ = [t.numpy() for t in step(x)]
            best = min(best, perf_counter() - start)
        times.append(best)
        x = layer(x, training=False)
    return times


def _forward_backward(layer: keras.Layer) -> Callable[[Any], Any]:
    def run(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        return [g for g in tape.gradient(y, [x, *layer.trainable_variables]) if g is not None] or [y]
    return run


class _Held:
    """Some layers seen as one model by unison.keras's seed-generator helpers (which walk ``_flatten_layers``)."""

    def __init__(self, layers: list[keras.Layer]) -> None:
        self._held = layers

    def _flatten_layers(self, include_self: bool = True) -> list[keras.Layer]:
        return [sub for layer in self._held for sub in layer._flatten_layers(include_self=True)]


@dataclass(frozen=True)
class _Plan:
    layers: list[keras.Layer]
    balance: list[int]
    schedule: Schedule
    loss: Callable[[Any, Any], Any]
    is_mean: bool


class Pipeline(PipelineRunner):
    """A Keras model split into pipeline stages across ranks; collective (every rank, same arguments).

    Args:
        model: a ``keras.Sequential`` or a list of Keras layers, built the same way on every rank
            (same seed, or the same weights loaded). The pipeline trains this rank's layers in
            place and never touches the others: drop your reference to the model to free them;
            :meth:`get_weights` gathers the trained weights of every stage.
        balance: layers per stage, ``p * v`` numbers summing to the layer count; default
            :func:`balance_by_params`.
        chunks: microbatches per step; every batch must be a multiple of it.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``.
        virtual_stages: ``v``, stages per rank (the interleaved schedule needs ``v >= 2``).
        checkpoint: ``"never"``, ``"always"`` or ``"except_last"`` (every microbatch but the
            last): forget activations in forward and recompute them, with the same random
            numbers, before backward.
        loss: a Keras loss, a loss name (``"mse"``) or ``loss(y_true, y_pred)`` returning a
            scalar or per-example values (averaged), applied on the last stage.
        optimizer: a factory, called once on each rank for the variables of every stage it holds
            (each once): ``lambda: keras.optimizers.SGD(0.1)``, or an optimizer name (``"adam"``).
        grid: a :func:`pipeline_grid` for data x pipeline, or ``grid_pipeline(grid, sets)`` for a
            tensor-parallel ``Grid``; default: one pipeline of all ranks. With ``dp > 1`` every replica
            of a stage starts from pipeline 0's weights (broadcast), draws its own random numbers,
            and averages its moving statistics with the others' after every step.
        input_shape: one example's shape (without the batch dimension), needed only when the
            layers are not built yet; every rank then builds the whole model once.
        input_dtype: the inputs' dtype for that build.

    Raises:
        PipelineError: on every rank, for a model, balance, schedule, chunks or layout that cannot
            run (a ``grid`` that is no PipelineGrid, tensor-parallel layers on another process set
            than the grid's tensor group); the message names the values and the fix.
    """

    def __init__(self, model: keras.Sequential | Sequence[keras.Layer], balance: Sequence[int] | None = None,
                 chunks: int = 1, schedule: str = "1f1b", virtual_stages: int = 1, checkpoint: str = "never",
                 loss: Any = None, optimizer: Callable[[], keras.optimizers.Optimizer] | str | None = None,
                 grid: PipelineGrid | None = None, input_shape: Sequence[int] | None = None,
                 input_dtype: str = "float32") -> None:
        if keras.backend.backend() != "tensorflow":  # the same on every rank: no agreement needed
            raise PipelineError(
                f"unison.tf_backend.Pipeline runs on Keras's TensorFlow backend only (KERAS_BACKEND is "
                f"{keras.backend.backend()!r}): each stage's forward and backward are TensorFlow functions "
                "(tf.function, GradientTape, recomputation with TensorFlow's random state), which a JAX or "
                "torch model cannot run. Set KERAS_BACKEND=tensorflow, or on torch use "
                "unison.torch_backend.Pipeline with torch modules")
        grid = grid if grid is not None else pipeline_grid(dp=1)
        plan = agreed(lambda: _plan(model, balance, chunks, schedule, virtual_stages, checkpoint, loss, optimizer,
                                    grid, input_shape, input_dtype))
        # every rank gathers, then every rank checks (agreed): before any communicator exists
        group, mine = _tensor_group(grid), layer_ranges(plan.balance, plan.schedule.stages_of(grid.position))
        agreed(lambda: _check_tensor_groups(plan.layers, mine, group))
        super().__init__(plan.schedule, chunks, grid, names=("x", "y"), balance=plan.balance,
                         checkpoint=checkpoint, layers=len(plan.layers))
        self.balance, self.checkpoint, self._is_mean = plan.balance, checkpoint, plan.is_mean
        self._layers = plan.layers
        #: stage -> the indices of its layers in the model
        self.layer_ranges = layer_ranges(plan.balance, self.schedule.stages_of(grid.position))
        last = self.schedule.num_stages - 1
        self.stages = {s: KerasStage(s, plan.layers[r.start:r.stop], plan.loss if s == last else None)
                       for s, r in self.layer_ranges.items()}
        self._worker = KerasStages(self.stages, self.schedule.num_stages, checkpoint)
        try:
            self.optimizer = self._make_rank_optimizer(optimizer)
        except PipelineError:  # raised on every rank: free the communicators together
            self.close()
            raise
        self._name = f"keras_pipeline.{next(_instances)}"
        if grid.dp > 1:  # root_rank is a global rank (Horovod's rule): the data set's first is pipeline 0's
            ranks = grid.data_set.ranks if grid.data_set is not None else None
            broadcast_variables([v for s in sorted(self.stages) for v in self.stages[s].all_weights],
                                root_rank=ranks[0] if ranks else 0, process_set=grid.data_set)
            self._own_seed_streams()
        #: this rank's moving statistics, each once (see :meth:`_average_statistics`)
        self._statistics = _unique(v for s in sorted(self.stages) for v in self.stages[s].statistics)

    @property
    def trainable_variables(self) -> list[Any]:
        """This rank's trainable variables, stage by stage, each once (a layer in two of its stages)."""
        return _unique(v for s in sorted(self.stages) for v in self.stages[s].weights)

    def train_step(self, x: Any = None, y: Any = None) -> float:
        """One step on a batch: forward, backward, gradient averaging over ``dp``, optimizer steps.

        Args:
            x: this pipeline's batch of inputs, on the rank holding stage 0 (ignored elsewhere).
            y: its targets, on the rank holding the last stage (ignored elsewhere).

        Returns:
            The loss over the batch (the mean over every replica's batch on a grid, or the sum
            for a ``reduction="sum"`` loss), on every rank.

        Raises:
            PipelineError: on every rank, when a batch does not split into ``chunks``, a rank
                lacks its inputs or targets, or any stage fails.
        """
        problem = self._begin(x, y, need_targets=True, train=True)
        self.run(self._worker, problem, train=True)
        # (a "sum" loss sums already)
        share = self.replica_share(x, self._worker.weight_total) if self._is_mean else 1.0
        grads = self._reduce_gradients(self._worker.grads, share)

        def apply() -> None:
            # One optimizer over the rank's variables, each once: a layer in two of its stages (interleaved)
            # gets both stages' gradients summed and one update, as in one process (before 2026-12-05 each
            # stage's optimizer stepped it with its part: Adam's moments and weight decay went wrong, silently)
            summed: dict[int, Any] = {}
            for s in sorted(self.stages):
                for v, g in zip(self.stages[s].weights, grads[s], strict=True):
                    if g is not None:  # (None: [Note: no gradient through integers])
                        summed[id(v)] = g if id(v) not in summed else summed[id(v)] + g
            variables = [v for v in self.trainable_variables if id(v) in summed]
            if variables:
                self.optimizer.apply([summed[id(v)] for v in variables], variables)

        # agreed: an optimizer that fails on one rank raises on every rank (before 2026-12-05 the others
        # waited in global_loss's collective for ever)
        agreed(apply, failed=f"the optimizer's apply() for stages {sorted(self.stages)}")
        self._average_statistics()
        return self.global_loss(self._worker.loss * share, self._is_mean)

    def fit(self, x: Any, y: Any, batch_size: int, epochs: int = 1, verbose: int = 1, shuffle: bool = True,
            seed: int = 0) -> list[float]:
        """Train on in-memory arrays for ``epochs``; Keras's progress bar on rank 0. Collective.

        Args:
            x: every example's inputs (may be None on ranks that do not hold stage 0).
            y: their targets (may be None on ranks that do not hold the last stage).
            batch_size: the global batch (all replicas together): a multiple of ``dp * chunks``.
                The last partial batch of an epoch is dropped.
            epochs: passes over the data.
            verbose: 0 silent, 1 a progress bar, 2 one line per epoch (on rank 0 only).
            shuffle: visit the examples in a new order each epoch (``seed`` and the number of epochs
                this pipeline's ``fit`` calls have begun pick it, the same on every rank: a second
                ``fit`` goes on to new orders, as Keras's does).
            seed: the shuffling seed.

        Returns:
            Each epoch's mean training loss, on every rank.

        Raises:
            PipelineError: on every rank, for arguments that cannot run (values and fix named).
        """
        return fit(self, x, y, batch_size, epochs, verbose, shuffle, seed)

    def evaluate(self, x: Any = None, y: Any = None) -> float:
        """The loss over a batch without training (dropout off), on every rank."""
        self._forward_only(x, y, need_targets=True)
        share = self.replica_share(x, self._worker.weight_total) if self._is_mean else 1.0
        return self.global_loss(self._worker.loss * share, self._is_mean)

    def predict(self, x: Any = None) -> np.ndarray | None:
        """The model's output for a batch, on the rank holding the last stage (None elsewhere)."""
        self._forward_only(x, None, need_targets=False)
        outputs = self._worker.outputs
        # agreed: outputs whose shapes differ between microbatches raised on the last stage's ranks alone
        # (before 2026-12-07; found by an audit)
        return agreed(lambda: np.concatenate([outputs[k] for k in sorted(outputs)]) if self.holds_last else None,
                      failed="predict()'s joining of the last stage's microbatch outputs (they must have the same "
                             "shape but for the batch dimension)")

    def get_weights(self) -> list[np.ndarray]:
        """Every layer's weights in model order (``keras.Sequential.get_weights`` order), on every rank.

        Collective. Pipeline 0's ranks contribute their stages; on a grid the replicas are equal.

        Raises:
            PipelineError: on every rank, on a tensor-parallel grid (``tp > 1``): a rank holds only its
                shards of the split layers, which ``keras.Sequential.set_weights`` cannot take.
        """
        if self.grid.tp > 1:  # (the same on every rank: each raises)
            # before 2026-12-07 every rank returned shard 0 of each split layer (pipeline 0 is replica 0's
            # shard 0), which fits no unsplit model and lost the other shards (found by an audit)
            raise PipelineError(
                f"get_weights() cannot gather a tensor-parallel pipeline (tp={self.grid.tp}): each rank holds "
                "only its shards of the split layers, and one list in keras.Sequential.get_weights() order has "
                "no place for them. Save them with unison.tf_backend.save_tensor_parallel(path, pipe, "
                "data_process_set=pipe.grid.data_set) (each rank writes its stages' shards) and read them back "
                "with load_tensor_parallel(path, model), into a split or an unsplit model")
        mine = {}
        first = {}  # a layer used twice (tied inside a stage) is listed once, as keras.Sequential does
        for i, layer in enumerate(self._layers):
            first.setdefault(id(layer), i)
        if self.grid.pipeline == 0:
            mine = {i: self._layers[i].get_weights() for r in self.layer_ranges.values() for i in r
                    if first[id(self._layers[i])] == i}
        held: dict[int, list[np.ndarray]] = {}
        for part in self._world.allgather(mine):
            held.update(part)
        return [w for i in sorted(held) for w in held[i]]

    # ------------------------------------------------------------------ helpers
    def _make_rank_optimizer(self, factory: Any) -> keras.optimizers.Optimizer:
        """One optimizer for every stage this rank holds, built for their variables (each once); a
        failure anywhere raises everywhere."""
        def make() -> keras.optimizers.Optimizer:
            opt = _make_optimizer(factory)
            if opt.global_clipnorm is not None and (self.grid.pp > 1 or self.grid.tp > 1):
                raise ValueError(
                    f"optimizer() returned an optimizer with global_clipnorm={opt.global_clipnorm}: it would "
                    "clip by the norm of this rank's gradients only (some stages, or shards of them), not the "
                    "whole model's, so ranks would scale their updates differently from one process. Use "
                    "clipvalue= (or clipnorm=, per variable, without tensor parallelism), or train without "
                    "a pipeline")
            if opt.clipnorm is not None and self.grid.tp > 1:
                raise ValueError(
                    f"optimizer() returned an optimizer with clipnorm={opt.clipnorm}: with tensor parallelism "
                    "(tp > 1) a rank holds shards of split variables, and each shard would be clipped by its "
                    "own norm, not the variable's. Use clipvalue=, or train without clipping by norm")
            opt.build(self.trainable_variables)
            return opt

        return agreed(make, failed=f"optimizer() for stages {sorted(self.stages)}")

    def _forward_only(self, x: Any, y: Any, need_targets: bool) -> None:
        """Every stage's forward with training off; backward sends only empty arrays."""
        problem = self._begin(x, y, need_targets, train=False)
        self.run(self._worker, problem, train=False, purpose="evaluate" if need_targets else "predict")

    def _begin(self, x: Any, y: Any, need_targets: bool, train: bool) -> str | None:
        """Check this rank's batch and hand its microbatches to the worker; return the pre-flight problem.

        Whatever is wrong with the batch (a list, a scalar, an object whose ``shape`` numpy cannot
        use) becomes the problem the driver raises on every rank, never an exception here alone.
        The worker gets no microbatches when the step will not run.
        """
        inputs = targets = None
        try:
            problem = self.batch_problem(x, y, need_targets)
            if problem is None:
                inputs = _split(self.names[0], x, self.chunks) if self.holds_first else None
                targets = _split(self.names[1], y, self.chunks) if self.holds_last and y is not None else None
        except Exception as exc:  # noqa: BLE001  # reported on every rank by the driver's pre-flight check
            problem = (f"this rank's batch does not split into {self.chunks} microbatches ({type(exc).__name__}: "
                       f"{exc}); pass numpy arrays or tensors with one row per example")
            inputs = targets = None
        self._worker.begin(inputs, targets, self.chunks, train)
        return problem

    def _own_seed_streams(self) -> None:
        """Give each data-parallel replica its own random stream (Dropout's masks); shards of one tensor group
        keep equal states, and replica 0 keeps its stream (a seeded run draws the same masks every time).

        The seed generators' states are left out of the broadcast, but a seeded script starts every replica's
        generators alike: global rows i and i + B / dp drew the same Dropout mask at every step, where one
        process draws independent masks (before 2026-12-07; found by an audit). unison.keras's DataParallel
        mixes each rank into its states the same way ([Note: each rank's own random stream]).
        """
        from unison.keras.data_parallel import own_seed_streams  # (lazily, as strategy.py imports it)

        own_seed_streams(_Held([self._layers[i] for r in self.layer_ranges.values() for i in r]),
                         self.grid.pipeline // self.grid.tp)

    def _average_statistics(self) -> None:
        """Average this rank's moving statistics (BatchNormalization's) over its data group; collective there.

        Each replica updates them from its own rows, and only the gradients were averaged: replicas' statistics
        drifted apart, ``evaluate`` averaged losses of different models, and ``get_weights`` returned replica
        0's (before 2026-12-07; found by an audit). Averaged after every step, as unison.keras's DataParallel
        averages them (there at each epoch's end), in float64 so that equal values come back bit for bit.
        """
        if self.grid.dp == 1 or not self._statistics:
            return
        values = [np.asarray(v.numpy()) for v in self._statistics]
        averaged = frontend.grouped_allreduce([v.astype(np.float64) for v in values], Average,
                                              f"{self._name}.statistics.{self.grid.position}",
                                              process_set=self.grid.data_set)
        for variable, value, mean in zip(self._statistics, values, averaged, strict=True):
            variable.assign(np.asarray(mean).astype(value.dtype))

    def _reduce_gradients(self, grads: dict[int, list[Any]], share: float = 1.0) -> dict[int, list[Any]]:
        """Each stage's gradient sums, averaged (summed for a ``"sum"`` loss) over its data group, each
        replica's weighted by its ``share`` (see :meth:`replica_share`). A stage no gradient reached (upstream
        of integers: [Note: no gradient through integers]) gets None for each variable, on every replica alike."""
        out: dict[int, list[Any]] = {s: grads.get(s) or [None] * len(st.weights) for s, st in self.stages.items()}
        order = [(s, i) for s in sorted(out) for i in range(len(out[s])) if out[s][i] is not None]
        if self.grid.dp == 1 or not order:
            return out
        values = [np.asarray(out[s][i]) for s, i in order]
        reduced = frontend.grouped_allreduce([v * share for v in values] if share != 1.0 else values,
                                             Average if self._is_mean else Sum,
                                             f"{self._name}.grads.{self.grid.position}",
                                             process_set=self.grid.data_set)
        for (s, i), value in zip(order, reduced, strict=True):
            out[s][i] = value
        return out


def _make_optimizer(optimizer: Any) -> keras.optimizers.Optimizer:
    opt = keras.optimizers.get(optimizer) if isinstance(optimizer, str) else optimizer()
    if not isinstance(opt, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer() must return a keras.optimizers.Optimizer; it returned {type(opt).__name__}")
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        # its apply() divides the gradients by the loss scale, but the stages never multiply the
        # loss by it (nor agree across stages on skipping a step): every update would be 1/scale
        raise TypeError("optimizer() returned a LossScaleOptimizer, which the pipeline does not support: its "
                        "stages do not scale the loss, so each update would shrink by the loss scale. Return "
                        "the inner optimizer, and train in float32 or under the 'mixed_bfloat16' policy (no "
                        "loss scaling needed)")
    return opt


def _split(name: str, batch: Any, chunks: int) -> list[np.ndarray]:
    """``batch`` as ``chunks`` numpy microbatches.

    Raises:
        ValueError: ``batch`` has a ``shape`` but numpy sees no batch dimension in it.
    """
    array = np.asarray(batch)
    if array.ndim == 0:
        raise ValueError(f"{name} ({type(batch).__name__}, shape {tuple(batch.shape)}) converts to a numpy array "
                         "without a batch dimension")
    return np.split(array, chunks)


def _as_layers(model: Any, input_shape: Any, input_dtype: str) -> list[keras.Layer]:
    """The layers of a Sequential or a list, built (by every rank, on ``input_shape``) if they are not."""
    if isinstance(model, keras.Sequential):
        layers = list(model.layers)
    elif isinstance(model, keras.Model) or not isinstance(model, Sequence):
        raise TypeError(f"a pipeline needs a keras.Sequential or a list of Keras layers; received "
                        f"{type(model).__name__}. Wrap the layers in keras.Sequential([...])")
    else:
        layers = list(model)
        bad = [i for i, layer in enumerate(layers) if not isinstance(layer, keras.Layer)]
        if bad:
            raise TypeError(f"layer {bad[0]} is {type(layers[bad[0]]).__name__}, not a keras.Layer; a pipeline "
                            "needs a list of Keras layers")
    unbuilt = [layer.name for layer in layers if not layer.built]
    if unbuilt:
        if input_shape is None:
            raise ValueError(f"layers {unbuilt} are not built; start the Sequential with keras.Input(shape), or "
                             "pass input_shape=(...) (one example's shape, without the batch dimension)")
        keras.Sequential([keras.Input(tuple(input_shape), dtype=input_dtype), *layers])
    return layers


def _plan(model: Any, balance: Any, chunks: Any, schedule: Any, v: Any, checkpoint: Any, loss: Any,
          optimizer: Any, grid: PipelineGrid, input_shape: Any, input_dtype: str) -> _Plan:
    """Check the arguments and build the layers; raises ValueError or TypeError with the values and the fix."""
    check_pipeline_grid(grid)
    if loss is None:
        raise TypeError("Pipeline needs loss=: a Keras loss, a loss name ('mse') or loss(y_true, y_pred), "
                        "applied on the last stage")
    if isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError("optimizer must be a factory, not an optimizer instance: each stage needs its own "
                        "optimizer; pass lambda: keras.optimizers.SGD(0.1)")
    if optimizer is None or not (isinstance(optimizer, str) or callable(optimizer)):
        raise TypeError("optimizer must be a factory returning a Keras optimizer, one per stage, e.g. "
                        f"lambda: keras.optimizers.SGD(0.1), or a name ('adam'); received {optimizer!r}")
    layers = _as_layers(model, input_shape, input_dtype)
    _refuse_penalties(layers)
    built, sizes = plan_stages(len(layers), balance, lambda stages: balance_by_params(layers, stages), chunks,
                               schedule, v, checkpoint, grid.pp)
    check_ties([[(id(v), v.path) for v in layer.weights] for layer in layers], sizes, built, "the variable")
    fn, is_mean = scaled_loss(loss, chunks)
    return _Plan(layers, sizes, built, fn, is_mean)


def _refuse_penalties(layers: list[keras.Layer]) -> None:
    """Refuse layers with regularizers: the stages differentiate their outputs and loss only, so the
    penalties were left out of the loss and the gradients, silently (before 2026-12-05).

    Raises:
        ValueError: naming the layer and the regularizer.
    """
    for i, layer in enumerate(layers):
        for sub in [layer, *getattr(layer, "_flatten_layers", lambda: [])()]:
            found = [k for k, value in vars(sub).items() if k.endswith("_regularizer") and value is not None]
            if found or getattr(sub, "losses", None):
                what = ", ".join(found) or "losses (add_loss)"
                raise ValueError(f"layer {i} ({layer.name}) has {what}: a Keras "
                                 "pipeline does not add layers' losses to the training loss, so training would "
                                 "ignore them. Remove the regularizers (or put the penalty in loss=), or train "
                                 "without a pipeline")


def _tensor_group(grid: PipelineGrid) -> list[int]:
    """The job ranks of this rank's tensor group on ``grid``: those of its replica and stage position (this rank
    alone when ``tp == 1``). Collective over the job."""
    mine = (grid.pipeline // grid.tp, grid.position)
    return [rank for rank, theirs in enumerate(world_comm().allgather(mine)) if theirs == mine]


def _check_tensor_groups(layers: list[keras.Layer], ranges: dict[int, range], group: list[int]) -> None:
    """Refuse this rank's tensor-parallel layers whose process set is not the grid's tensor group.

    Their collectives would wait for ranks that run other stages or replicas: before 2026-12-07 layers on the
    default (every-rank) set inside a pp=2 pipeline were accepted and the first step stalled until the engine's
    timeout (found by an audit).

    Raises:
        ValueError: naming the layer, the two rank lists and the fix.
    """
    tp = sys.modules.get("unison.tf_backend.tensor_parallel")  # (loaded on first use: not loaded, no such layer)
    if tp is None:
        return
    parallel = (tp.ColumnParallelLinear, tp.RowParallelLinear, tp.VocabParallelEmbedding)
    for stage, held in sorted(ranges.items()):
        for i in held:
            for sub in layers[i]._flatten_layers(include_self=True):
                if not isinstance(sub, parallel):
                    continue
                ranks = sub.process_set.ranks
                ranks = list(range(runtime.size())) if ranks is None else list(ranks)
                if ranks != group:
                    raise ValueError(
                        f"layer {i} ({layers[i].name}, stage {stage}) holds the tensor-parallel "
                        f"{type(sub).__name__} {sub.name!r} split over ranks {ranks} (its process_set), but the "
                        f"grid's tensor group of this rank is ranks {group}: its collectives would wait for ranks "
                        "that run other stages or replicas. Build the parallel layers on the grid's tensor set "
                        "(sets = Grid(dp=..., pp=..., tp=...).register(); process_set=sets.tp) and pass "
                        "grid=grid_pipeline(grid, sets)")
