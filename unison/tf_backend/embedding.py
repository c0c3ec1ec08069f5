"""``ShardedEmbedding``: a Keras 3 layer whose table lives sharded over the ranks (unison.ps).

[Note: the TensorFlow sharded embedding]
The table is a :class:`unison.ps.ShardedTable`, never a Keras weight. ``call(ids)`` dedups the
ids (``tf.unique``), pulls the unique rows through a stateful ``tf.numpy_function`` and gathers
them back into ``ids.shape + (dim,)``. A ``tf.custom_gradient`` around the pull turns the
gradient of the unique rows (duplicate ids summed by the gather's gradient) into a push: a
stateful ``tf.numpy_function`` in the backward pass, which the table's server-side optimizer
applies. Both work eagerly and inside ``tf.function`` (so in ``model.fit``).

Keras only differentiates with respect to trainable weights, and the embedding is usually the
first layer: nothing trainable lies before it. So the layer has one scalar weight,
``push_anchor``, fed to the custom gradient as an input that the forward ignores; its gradient
is zero but computed from the push's output, so asking for the anchor's gradient (which
``model.fit`` does, as for every trainable weight) runs the push. The anchor never changes
under SGD or Adam (its gradient is always zero) and is not part of the table.

Gradient scale: under a ``tf.distribute`` strategy with N replicas in sync (``UnisonStrategy``
at N ranks), Keras scales each replica's loss by 1/N and the strategy sums the dense
gradients. The layer follows the same convention: it multiplies the rows' gradient by N before
the push, and the table (``average=True``) divides by its N workers, so the table gets the
average of the ranks' local-mean gradients, exactly as the dense weights do. Without a
strategy (a custom loop with ``DistributedOptimizer`` or ``DistributedGradientTape``, which
average), the gradient is pushed as is and the table averages it.

[Note: one push per training step, TensorFlow]
The table's optimizer steps once per push, so a layer called twice in a step (a table shared by two
inputs) must push once, the two lookups' rows together, as a Keras ``Embedding``'s optimizer steps once
on the summed gradient. Each push callback only keeps its rows' gradient; the table's state
(:class:`_TableSteps`, shared by every layer looking into the table) counts the lookups of trainable
layers since its last push, whatever their ``training`` argument, and the push callback that brings the
count to zero pushes everything kept as one push, still inside the backward pass. Two layers given one
``table=`` (a user and an item tower) are two lookups of one step: until 2026-12-07 each layer kept and
pushed its own, and the table's Adagrad or Adam stepped twice per step. Until 2026-12-07 too, lookups
made with ``training=False`` (Keras's idiom for fine-tuning under frozen BatchNorm) were not counted, so
under a ``GradientTape`` each of their push callbacks found the count at zero and pushed alone (Adagrad
stepped twice for two lookups). A lookup whose output never reaches a gradient (``evaluate``,
``predict``, a metric computed outside the tape) leaves the count above zero: the next lookup after a
push callback, or ``synchronize()``/``save_table()``/``load_table()``, pushes what is kept first, so
nothing is lost and no push lands after a later pull; ``fit``, ``evaluate`` and ``predict`` call
``synchronize()`` when they return (:func:`_hook_model`), so nothing is kept after them. Before 2026-12-06
each lookup pushed on its own, and Adagrad or Adam stepped twice.
Each gradient computed through a lookup runs its push callback: a persistent ``GradientTape`` asked twice
for the layer's ``push_anchor`` pushes twice (the table's optimizer steps twice, as two
``apply_gradients`` of the two results would); ask once for all the trainable variables.

[Note: the table follows the optimizer's accumulation]
A Keras optimizer with ``gradient_accumulation_steps=k`` changes the dense weights once every k
steps, with the mean of the k steps' gradients: at the step whose ``iterations + 1`` (its own
counter, one per step) is a multiple of k. The layer follows the optimizer ``model.fit`` trains
with (``fit`` tells it, once a layer exists: :func:`_hook_model`; a custom loop calls
:meth:`ShardedEmbedding.follow`): each step's rows are kept, and at the optimizer's update step all
k steps' rows are pushed as one push, their gradients divided by k, so the table's optimizer steps
once on the same mean. Horovod's ``DistributedOptimizer(backward_passes_per_step=k)``
(``unison.tf_backend.keras``) applies the SUM of the k steps unless ``average_aggregated_gradients``:
the layer then pushes the sum too (the optimizer's ``_unison_accumulation_factor``). The push
is given the optimizer's counter as read in the backward pass, before the optimizer counts the
step (:meth:`ShardedEmbedding._counter`), so the table keeps the optimizer's phase across ``fit``
calls. Before
2026-12-06 (evening) the layer pushed every step: under k=2 the table's SGD moved twice as often
as the dense weights, and its Adagrad's sums grew from each step's gradient, silently unlike one
process's.

Under BSP (the default) pulls and pushes are collective: every rank must make the same
sequence of them. ``model.fit``/``evaluate``/``predict`` under ``UnisonStrategy`` give every
rank the same number of steps (each global batch is split over the ranks), so each training
step makes one pull and one push per layer on every rank, and each evaluation or prediction
step one pull. Datasets fed per rank (``distribute_datasets_from_function``, or a custom loop)
must give every rank the same number of batches.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from unison.common.ps import ASP, SSP, Handle, ShardedTable
from unison.common.ps.consistency import consistency_from_name
from unison.common.ps.optimizers import Optimizer, optimizer_from_config

__all__ = ["ShardedEmbedding", "follow_optimizer"]

logger = logging.getLogger(__name__)


def _consistency_config(consistency: Any) -> Any:
    c = consistency_from_name(consistency)
    if isinstance(c, SSP):
        return {"name": "ssp", "staleness": c.staleness}
    return "asp" if isinstance(c, ASP) else "bsp"


def _consistency_from_config(config: Any) -> Any:
    if isinstance(config, dict):
        return SSP(int(config.get("staleness", 2)))
    return config


def _policy_problem(policy: Any) -> str | None:
    """Why the layer cannot run under the dtype ``policy``, or None."""
    if policy.compute_dtype == policy.variable_dtype:
        return None
    return (f"ShardedEmbedding does not support the mixed-precision policy {policy.name!r} (its pushes would "
            "carry loss-scaled gradients); give the layer dtype='float32' (the rest of the model may stay mixed)")


def _dp_rows() -> tf.Tensor:
    """This rank's batch rows in a ``unison.keras.DataParallel`` train step (int64; -1 outside one): [Note:
    the table weighs ranks by their rows]."""
    from unison.keras.optimizer import _ROWS

    rows = _ROWS.get()
    return tf.constant(-1, tf.int64) if rows is None else tf.cast(rows, tf.int64)


def follow_optimizer(model: Any) -> None:
    """Tell every :class:`ShardedEmbedding` in ``model`` to follow its optimizer's gradient accumulation
    ([Note: the table follows the optimizer's accumulation]); ``model.fit`` calls it (:func:`_hook_model`)."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return
    for layer in _embeddings(model):
        layer.follow(optimizer)


def _embeddings(model: Any) -> list[ShardedEmbedding]:
    return [layer for layer in model._flatten_layers(include_self=False) if isinstance(layer, ShardedEmbedding)]


_MODEL_HOOKED = False


def _hook_model() -> None:
    """Make ``model.fit`` call :func:`follow_optimizer` first, and ``fit``/``evaluate``/``predict`` push what
    the model's tables keep when they return ([Note: one push per training step, TensorFlow]), for every
    model (once, when the first ``ShardedEmbedding`` is made): with ``UnisonStrategy``, Horovod-style
    (``DistributedOptimizer``) or in one process. Installed on the class that defines each method, around
    whatever is there (``UnisonStrategy``'s checks wrap it there too, before or after)."""
    global _MODEL_HOOKED
    if _MODEL_HOOKED:
        return
    for name in ("fit", "evaluate", "predict"):
        owner = next(c for c in keras.Model.__mro__ if name in c.__dict__)
        setattr(owner, name, _pushing_when_done(owner.__dict__[name], name == "fit"))
    _MODEL_HOOKED = True


def _pushing_when_done(original: Any, follow: bool) -> Any:
    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if follow:
            follow_optimizer(self)  # [Note: the table follows the optimizer's accumulation]
        result = original(self, *args, **kwargs)
        for layer in _embeddings(self):  # (a lookup without a gradient left its step's push kept: Note)
            layer.synchronize()
        return result

    return call


class _TableSteps:
    """One table's training-step state, shared by every layer looking into it ([Note: one push per training
    step, TensorFlow]): two layers given one ``table=`` (a user and an item tower) push once per step."""

    def __init__(self) -> None:
        self.pending: list[Handle] = []
        self.kept: list[tuple[np.ndarray, np.ndarray]] = []  # this step's rows' gradients
        self.open = 0  # lookups a gradient may follow since the last push
        self.pushing = False  # a push callback ran since the last lookup
        self.optimizer: Any = None  # [Note: the table follows the optimizer's accumulation]
        self.iteration = -1  # the followed optimizer's counter when this step's push callback ran
        self.accumulated: list[tuple[np.ndarray, np.ndarray]] = []  # steps kept until the update step
        self.rows = -1  # this step's batch rows under unison.keras.DataParallel (-1: elsewhere)


_STEPS: weakref.WeakKeyDictionary[ShardedTable, _TableSteps] = weakref.WeakKeyDictionary()


def _table_steps(table: ShardedTable) -> _TableSteps:
    """``table``'s :class:`_TableSteps` (made by its first layer)."""
    return _STEPS.setdefault(table, _TableSteps())


@keras.saving.register_keras_serializable(package="unison")
class ShardedEmbedding(keras.layers.Layer):
    """An embedding lookup into a :class:`unison.ps.ShardedTable` of ``num_rows x dim`` (Keras 3, TF backend).

    Collective to create (every rank of the table, the same arguments: the table checks). ``call(ids)``
    takes integer ids of any shape and returns ``ids.shape + (dim,)``. When a gradient is taken
    through the output (``model.fit``, or a ``tf.GradientTape`` asking for the layer's
    ``push_anchor`` weight, i.e. for ``model.trainable_variables``), the rows' gradient is pushed
    to the table, whose own optimizer updates them; a forward without a gradient (``predict``,
    ``evaluate``) only pulls. See [Note: the TensorFlow sharded embedding] for the gradient
    scale and the BSP rule (every rank the same number of steps).

    Args:
        num_rows, dim: the table's shape.
        optimizer: the table's server-side optimizer (``unison.ps.SGD``/``Adagrad``/``Adam``;
            default ``SGD(lr=0.01)``). The model's Keras optimizer does not touch the table.
        consistency: ``"bsp"`` (default), ``unison.ps.SSP(s)`` or ``"asp"``.
        sharding: ``"hash"`` (default) or ``"row"``.
        initializer: ``"uniform"`` (default), ``"normal"``, ``"zeros"`` or ``keys -> rows``.
        seed: the initial rows' seed (the same table on any number of ranks).
        name: the layer's name (also the table's, when the layer creates it).
        table: an existing :class:`ShardedTable` to look into; the table arguments above are then
            ignored (its shape is used).
        **kwargs: other ``keras.layers.Layer`` arguments (``dtype``: float32 or float64 rows).

    Attributes:
        table: the :class:`ShardedTable`. Its rows are not Keras weights: save them with
            ``layer.table.save(path)`` (``model.save`` stores only the layer's configuration).
    """

    def __init__(self, num_rows: int, dim: int, optimizer: Optimizer | None = None, consistency: Any = "bsp",
                 sharding: str = "hash", initializer: Any = "uniform", seed: int = 0, name: str | None = None,
                 table: ShardedTable | None = None, **kwargs: Any) -> None:
        if isinstance(optimizer, dict):  # from get_config
            optimizer = optimizer_from_config(optimizer)
        consistency = _consistency_from_config(consistency)
        super().__init__(name=name, **kwargs)
        self.supports_masking = False
        # its lookups and pushes are host calls (tf.py_function), which XLA cannot compile: Keras then
        # falls back from jit_compile="auto" (on a GPU host it picked XLA and fit failed in the PyFunc)
        self.supports_jit = False
        variable_dtype = tf.as_dtype(self.dtype_policy.variable_dtype)
        rows_dtype = "float64" if variable_dtype == tf.float64 else "float32"
        if table is None:  # a mixed policy on one rank is refused on every rank, with the table's checks (it was
            # refused in build() alone, after the collective creation, and the others waited in their first pull)
            table = ShardedTable(num_rows, dim, rows_dtype, sharding=sharding, optimizer=optimizer,
                                 consistency=consistency, name=self.name, initializer=initializer, seed=seed,
                                 refuse=_policy_problem(self.dtype_policy))
        elif not isinstance(table, ShardedTable):
            raise TypeError(f"ShardedEmbedding(table={table!r}): give a unison.ps.ShardedTable")
        self.table = table
        self.num_rows, self.dim = table.num_rows, table.dim
        self._rows_dtype = tf.as_dtype(table.dtype)
        self._config = {
            "num_rows": self.num_rows,
            "dim": self.dim,
            "optimizer": table.optimizer.config(),
            "consistency": _consistency_config(table.consistency),
            "sharding": table.sharding.kind,
            "initializer": initializer if isinstance(initializer, str) else "uniform",
            "seed": seed,
        }
        self._shared = _table_steps(table)  # [Note: one push per training step, TensorFlow]
        _hook_model()

    def build(self, input_shape: Any = None) -> None:
        problem = _policy_problem(self.dtype_policy)  # (a layer given its table: checked here)
        if problem is not None:
            raise ValueError(problem)
        self.push_anchor = self.add_weight(name="push_anchor", shape=(), initializer="zeros", trainable=True,
                                           dtype=self._rows_dtype.name)
        self.built = True

    def compute_output_shape(self, input_shape: Any) -> tuple:
        return tuple(input_shape) + (self.dim,)

    # host callbacks ----------------------------------------------------------------------------------
    def _pull(self, keys: np.ndarray, counted: np.ndarray) -> np.ndarray:
        if self._shared.pushing:  # a new step: what a lookup without a gradient left kept goes first (Note)
            self._flush()
        self._wait_pushes()  # raise an earlier push's error here (the table orders the pull after it anyway)
        if bool(counted):
            self._shared.open += 1
        return np.asarray(self.table.pull(np.asarray(keys, np.int64)), self.table.dtype)

    def _push(self, keys: np.ndarray, grads: np.ndarray, scale: np.ndarray, counter: np.ndarray,
              rows: np.ndarray) -> np.ndarray:
        g = np.array(grads, self.table.dtype) * np.asarray(scale, self.table.dtype)  # a copy: pushed later
        self._shared.kept.append((np.array(keys, np.int64), g))
        self._shared.pushing = True
        self._shared.rows = int(rows)
        steps = self._accumulation()
        if steps > 1:
            if int(counter) < 0:  # (a ValueError: TensorFlow reports it from a graph as InvalidArgumentError)
                raise ValueError(
                    f"ShardedEmbedding {self.name!r} follows an optimizer with gradient_accumulation_steps="
                    f"{steps}, but this step was traced before it did; call layer.follow(optimizer) before the "
                    "first step of a tf.function (model.fit does)")
            self._shared.iteration = int(counter)
        self._shared.open -= 1
        if self._shared.open <= 0:  # the step's last lookup: [Note: one push per training step, TensorFlow]
            self._flush()
        return np.zeros(1, self.table.dtype)  # (not 0-d: host_ops [Note: a callback's key is not 0-d])

    def _flush(self) -> None:
        """End the step: push the kept rows' gradients as one push (the table sums duplicate keys), or under
        the followed optimizer's accumulation keep them until its update step ([Note: the table follows the
        optimizer's accumulation])."""
        shared = self._shared
        kept, shared.kept, shared.open, shared.pushing = shared.kept, [], 0, False
        if not kept:
            return
        weight = self._rows_weight(self._shared.rows)  # (once per step: every lookup of it has the same rows)
        if weight != 1.0:
            for _, g in kept:
                g *= np.asarray(weight, g.dtype)
        steps = self._accumulation()
        if steps > 1:
            self._shared.accumulated.extend(kept)
            if (self._shared.iteration + 1) % steps:
                return
            kept, self._shared.accumulated = self._shared.accumulated, []
        self._push_now(kept, steps)

    def _push_now(self, kept: list[tuple[np.ndarray, np.ndarray]], steps: int) -> None:
        grads = np.concatenate([g for _, g in kept])
        if steps > 1:  # the mean of the steps, times what the optimizer applies of it (Horovod's sum: k)
            factor = float(getattr(self._shared.optimizer, "_unison_accumulation_factor", 1.0))
            grads *= np.asarray(factor / steps, grads.dtype)
        self._shared.pending.append(self.table.push_async(np.concatenate([k for k, _ in kept]), grads))

    def _rows_weight(self, rows: int) -> float:
        """This rank's weight among the table's workers in a step of ``rows`` batch rows (``unison.keras.
        DataParallel``; -1 elsewhere: 1.0). [Note: the table weighs ranks by their rows] DataParallel combines
        the dense gradients as ``sum_r rows_r g_r / sum_r rows_r`` (exact when a last batch splits unevenly),
        and the table averages its workers' pushes: each push is scaled by ``workers * rows_r / sum_r rows_r``
        so the table's average is the same weighted mean. Before 2026-12-06 (evening) a ragged last batch
        (21 rows in batches of 8 at 2 ranks) left the table's rows 0.012 off one process's. One small
        all-reduce of the rows per step (when the step's rows are pushed or kept), over the job (the table's
        workers must be every rank of it: else the pushes are not weighted)."""
        from unison.common import runtime

        workers = len(self.table.workers)
        if rows < 0 or workers < 2 or workers != self.table.size or self.table.size != runtime.size():
            return 1.0
        from unison.common.engine import frontend
        from unison.common.ops import Sum

        total = float(np.asarray(frontend.allreduce(np.array([rows], np.float64), Sum,
                                                    name=f"unison.ps.{self.table.name}.rows")).reshape(-1)[0])
        if total <= 0:
            return 1.0
        return workers * rows / total

    def _counter(self) -> tf.Tensor:
        """The followed optimizer's step counter, read in the backward pass (-1 when the optimizer does not
        accumulate). Read in the graph, not in the host callback: the read is then ordered before the
        optimizer counts the step (same variable), where the callback ran after it (measured: a callback
        read saw every step's counter already counted)."""
        if self._accumulation() > 1:
            return tf.cast(keras.ops.convert_to_tensor(self._shared.optimizer._iterations), tf.int64)
        return tf.constant(-1, tf.int64)

    def _accumulation(self) -> int:
        """The followed optimizer's ``gradient_accumulation_steps`` (1: none, or no optimizer followed)."""
        return int(getattr(self._shared.optimizer, "gradient_accumulation_steps", None) or 1)

    def follow(self, optimizer: Any) -> None:
        """Push to the table at ``optimizer``'s update steps only: with ``gradient_accumulation_steps=k``
        the mean of the k steps' row gradients, once per k steps ([Note: the table follows the optimizer's
        accumulation]). ``model.fit`` calls it with the model's optimizer; call it in a custom loop whose
        Keras optimizer accumulates. ``None`` stops following (a push every step).
        Steps accumulated for an optimizer no longer followed are pushed at once (a warning says so).
        The table follows it: every layer looking into the table, as the step's rows are the table's.

        Raises:
            TypeError: ``optimizer`` is neither None nor a Keras optimizer.
        """
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"ShardedEmbedding.follow({optimizer!r}): give the Keras optimizer that trains the "
                            "model (a keras.optimizers.Optimizer), or None")
        if optimizer is not self._shared.optimizer and self._shared.accumulated:
            logger.warning("ShardedEmbedding %r: follows another optimizer while %d step(s) of row gradients "
                           "wait for the last one's update step; they are pushed now", self.name,
                           len(self._shared.accumulated))
            accumulated, self._shared.accumulated = self._shared.accumulated, []
            self._push_now(accumulated, self._accumulation())
        self._shared.optimizer = optimizer

    def _wait_pushes(self) -> None:
        pending, self._shared.pending = self._shared.pending, []
        for handle in pending:
            handle.wait()

    def synchronize(self) -> None:
        """Push what the table keeps (from every layer looking into it) and wait until its pushes so far are
        applied (raises a push's error)."""
        self._flush()
        self._wait_pushes()

    # the lookup ----------------------------------------------------------------------------------------
    def call(self, ids: Any, training: Any = None) -> tf.Tensor:
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            if ids.dtype.is_floating:  # Keras may hand ids as floats (e.g. from numpy arrays):
                ids = tf.cast(ids, tf.int64)  # truncated, as keras.layers.Embedding does (2.7 -> row 2)
            else:
                message = f"ShardedEmbedding: ids must be integers; got {ids.dtype}. Cast them with tf.cast"

                def refuse() -> np.ndarray:
                    # the table's own check raises it on every rank (BSP: in the round the others' pulls are
                    # in; SSP/ASP: posted to them); raised here alone (before 2026-12-05) it left the others
                    # waiting in that round for ever
                    self.table.pull(np.zeros(1, np.bool_))
                    raise TypeError(message)

                if tf.executing_eagerly():
                    refuse()
                # in a graph: when the step runs, in place of its pull
                ids = tf.numpy_function(refuse, [], tf.int64, stateful=True, name="unison_ps_refuse")
        ids = tf.cast(ids, tf.int64)
        unique, inverse = tf.unique(tf.reshape(ids, [-1]))
        # a lookup a gradient may follow, whatever ``training`` is (see the Note)
        counted = tf.constant(bool(self.trainable))
        rows = self._lookup(unique, tf.convert_to_tensor(self.push_anchor), counted)
        out = tf.gather(rows, inverse)
        out = tf.reshape(out, tf.concat([tf.shape(ids), [self.dim]], axis=0))
        return tf.cast(out, self.compute_dtype)

    def _lookup(self, unique: tf.Tensor, anchor: tf.Tensor, counted: tf.Tensor) -> tf.Tensor:
        dim, dtype = self.dim, self._rows_dtype

        @tf.custom_gradient
        def lookup(keys: tf.Tensor, anchor_value: tf.Tensor) -> Any:
            rows = tf.numpy_function(self._pull, [keys, counted], dtype, stateful=True, name="unison_ps_pull")
            rows.set_shape([None, dim])

            def grad(dy: Any) -> tuple[None, tf.Tensor]:
                dy = tf.convert_to_tensor(dy, dtype)  # IndexedSlices from the gather: duplicates summed
                # Keras scales each replica's loss by 1/N under a strategy of N replicas (which sums the
                # dense gradients); the table averages over its workers, so undo the 1/N here
                scale = tf.constant(tf.distribute.get_strategy().num_replicas_in_sync, dtype)
                done = tf.reshape(tf.numpy_function(self._push, [keys, dy, scale, self._counter(), _dp_rows()],
                                                    dtype, stateful=True, name="unison_ps_push"), [])
                return None, tf.zeros_like(anchor_value) + done  # the anchor's gradient needs the push

            return rows, grad

        return lookup(unique, anchor)

    # configuration, checkpoints --------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(self._config)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ShardedEmbedding:
        """A layer of a saved model (``keras.models.load_model`` on every rank: collective). Its table is new,
        with the initial rows: the model file holds the configuration only, so load the rows with
        :meth:`load_table` (a warning says so)."""
        layer = cls(**config)
        logger.warning("ShardedEmbedding %r: made from its configuration with a new table of initial rows (a "
                       "saved model holds no rows); load the saved rows with layer.load_table(path)", layer.name)
        return layer

    def save_table(self, path: Any, metadata: dict[str, Any] | None = None) -> Any:
        """Save the table (rows and optimizer state) to the folder ``path``. Collective. Row gradients of steps
        waiting for the optimizer's update step (``gradient_accumulation_steps``) are not in the table yet,
        so not saved (a warning says so)."""
        self.synchronize()
        if self._shared.accumulated:
            logger.warning("ShardedEmbedding %r: saved while %d step(s) of row gradients wait for the optimizer's "
                           "update step (gradient_accumulation_steps): they are not in the saved table; save "
                           "after an update step to keep them", self.name, len(self._shared.accumulated))
        return self.table.save(path, metadata)

    def load_table(self, path: Any) -> dict[str, Any]:
        """Load the table from ``path`` (saved on any number of ranks). Collective. Row gradients of steps
        waiting for the optimizer's update step belong to the training before the load: they are dropped (a
        warning says so), as loading the model's optimizer variables drops its accumulated gradients."""
        self.synchronize()
        if self._shared.accumulated:
            logger.warning("ShardedEmbedding %r: loading drops %d step(s) of row gradients that waited for the "
                           "optimizer's update step", self.name, len(self._shared.accumulated))
            self._shared.accumulated = []
        return self.table.load(path)
