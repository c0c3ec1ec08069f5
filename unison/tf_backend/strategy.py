"""``UnisonStrategy``: a ``tf.distribute.Strategy`` with one replica per MPI process.

Keras 3 drives a strategy through a handful of ``StrategyExtended`` hooks
(verified on Keras 3.15 / TF 2.21; docs/design/unison_strategy.md lists them):

* **Variables** (``_create_variable``): every variable made under ``scope()``
  (weights, optimizer slots, ``iteration``) starts with rank 0's value: its
  initial value is broadcast when it is created, whatever seeds the ranks used.
* **Input** (``_experimental_distribute_dataset``): the dataset's batch is the
  global batch; rank r keeps rows ``[r*n//size, (r+1)*n//size)`` of each one, so
  every rank runs the same number of steps even when the last batch is partial.
  ``distribute_datasets_from_function`` gets an ``InputContext`` with
  ``num_input_pipelines=size`` and ``input_pipeline_id=rank``.
* **Gradients** (``_batch_reduce_to``): Keras hands over all of a step's
  gradients in one list; they are summed in ONE host callback and one grouped
  engine call (fused, any completion order), so TensorFlow's op scheduling can
  never deadlock the ranks.
* **Metrics**: Keras keeps loss and metric state in ON_READ/SUM variables and
  never reduces them across processes. Here such variables sum their updates
  over the ranks inside ``strategy.run``, so every rank holds the global state
  and reports the number one process would on the same global batches.

Names of engine collectives come from per-name execution counters, identical
on every rank because every rank runs the same program.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import distribute_lib, input_lib, input_util, reduce_util
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.util import nest

from unison.common import runtime
from unison.common.engine import frontend
from unison.common.ops import Sum

__all__ = ["UnisonStrategy", "split_global_batch"]

_DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
_executions: collections.Counter[str] = collections.Counter()


def _run_name(base: str) -> str:
    """``base.<n>`` for the n-th execution of ``base`` in this process (same n on every rank)."""
    n = _executions[base]
    _executions[base] += 1
    return f"{base}.{n}"


def _sum_arrays(base: str, *arrays: np.ndarray) -> list[np.ndarray]:
    outs = frontend.grouped_allreduce([np.ascontiguousarray(a) for a in arrays], Sum, _run_name(base))
    return [np.asarray(o, dtype=a.dtype).reshape(a.shape) for o, a in zip(outs, arrays, strict=True)]


def grouped_sum(tensors: Sequence[Any], base: str) -> list[tf.Tensor]:
    """Sum dense tensors over the ranks in one engine call (one host callback in a graph)."""
    ts = [tf.convert_to_tensor(t) for t in tensors]
    if not ts or runtime.size() == 1:
        return ts
    if tf.executing_eagerly():
        return [tf.constant(o) for o in _sum_arrays(base, *[t.numpy() for t in ts])]
    out = tf.numpy_function(lambda *a: _sum_arrays(base, *a), ts, [t.dtype for t in ts], stateful=True,
                            name="unison_grouped_sum")
    for o, t in zip(out, ts, strict=True):
        o.set_shape(t.shape)
    return list(out)


def _gather_array(base: str, a: np.ndarray) -> np.ndarray:
    return np.asarray(frontend.allgather(np.ascontiguousarray(a), _run_name(base)), dtype=a.dtype)


class _GlobalSumVariable(resource_variable_ops.ResourceVariable):
    """Metric state (ON_READ / SUM): assignments inside ``strategy.run`` add the global change.

    Every rank adds the sum over ranks of ``new - old``, so the state (and
    ``metric.result()``) is global and identical on every rank. Assignments in
    cross-replica context (``reset_state``, checkpoint restore) stay local.
    """

    def assign(self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        if isinstance(tf.distribute.get_replica_context(), _UnisonReplicaContext) and runtime.size() > 1:
            value = tf.convert_to_tensor(value, dtype=self.dtype)
            delta = grouped_sum([value - self.read_value()], f"unison.metric.{self._shared_name}")[0]
            return super().assign_add(delta, use_locking=use_locking, name=name, read_value=read_value)
        return super().assign(value, use_locking=use_locking, name=name, read_value=read_value)


class _UnisonReplicaContext(distribute_lib.ReplicaContext):
    def __init__(self, strategy: tf.distribute.Strategy) -> None:
        super().__init__(strategy, replica_id_in_sync_group=runtime.rank())

    @property
    def devices(self) -> tuple[str, ...]:
        return (_DEVICE,)


def split_global_batch(dataset: tf.data.Dataset, rank: int, size: int) -> tf.data.Dataset:
    """Map each global batch of n rows to this rank's rows ``[rank*n//size, (rank+1)*n//size)``.

    Raises:
        ValueError: the dataset is not batched (its elements have no batch dimension).
    """
    specs = nest.flatten(dataset.element_spec)
    if not specs or any(getattr(s, "shape", None) is None or s.shape.rank in (None, 0) for s in specs):
        raise ValueError(f"UnisonStrategy needs a batched dataset (each element a global batch); got "
                         f"elements {dataset.element_spec}. Call dataset.batch(global_batch_size) first")

    def take(*elem: Any) -> Any:
        n = tf.shape(nest.flatten(elem)[0], out_type=tf.int64)[0]
        lo, hi = (rank * n) // size, ((rank + 1) * n) // size
        out = nest.map_structure(lambda t: t[lo:hi], elem)
        return out if len(elem) > 1 else out[0]

    return dataset.map(take)


class UnisonExtended(distribute_lib.StrategyExtendedV1):
    """The strategy's machinery: one local CPU replica, collectives through Unison's engine."""

    def __init__(self, container_strategy: tf.distribute.Strategy) -> None:
        super().__init__(container_strategy)
        self._input_workers_obj = input_lib.InputWorkers([(_DEVICE, (_DEVICE,))])
        self._variables_created = 0

    # variables ------------------------------------------------------------------------------
    def _create_variable(self, next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        kwargs.pop("colocate_with", None)
        with tf.device(_DEVICE):
            if (kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ
                    and kwargs.get("aggregation") == tf.VariableAggregation.SUM):
                kwargs.pop("use_resource", None)
                kwargs.pop("experimental_enable_variable_lifting", None)
                var = _GlobalSumVariable(**kwargs)
            else:
                var = next_creator(**kwargs)
        if runtime.size() > 1:
            if not tf.executing_eagerly():
                raise RuntimeError(f"variable {var.name} was created inside a tf.function under "
                                   "UnisonStrategy; build the model and optimizer before the first step "
                                   "(model.build(...) / optimizer.build(model.trainable_variables))")
            name = f"unison.variable.{self._variables_created}"
            self._variables_created += 1
            init = var.numpy()
            var.assign(np.asarray(frontend.broadcast(init, 0, name)).reshape(init.shape))
        return var

    def _validate_colocate_with_variable(self, colocate_with_variable: Any) -> None:
        pass

    # input ----------------------------------------------------------------------------------
    @property
    def _input_workers(self) -> Any:
        return self._input_workers_obj

    def _experimental_distribute_dataset(self, dataset: Any, options: Any) -> Any:
        dataset = split_global_batch(dataset, runtime.rank(), runtime.size())
        return input_util.get_distributed_dataset(dataset, self._input_workers, self._container_strategy(),
                                                  options=options)

    def _distribute_datasets_from_function(self, dataset_fn: Any, options: Any) -> Any:
        ctx = distribute_lib.InputContext(num_input_pipelines=runtime.size(),
                                          input_pipeline_id=runtime.rank(),
                                          num_replicas_in_sync=runtime.size())
        return input_util.get_distributed_datasets_from_function(
            dataset_fn, self._input_workers, [ctx], self._container_strategy(), options=options)

    def _experimental_distribute_values_from_function(self, value_fn: Any) -> Any:
        return value_fn(distribute_lib.ValueContext(runtime.rank(), runtime.size()))

    # compute --------------------------------------------------------------------------------
    def _call_for_each_replica(self, fn: Any, args: Any, kwargs: Any) -> Any:
        with tf.device(_DEVICE), _UnisonReplicaContext(self._container_strategy()):
            return fn(*args, **kwargs)

    def _reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: Any) -> Any:
        return self._batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def _batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any, options: Any) -> list:
        values = [self._local_results(v)[0] for v, _ in value_destination_pairs]
        signature = "|".join(f"{v.dtype.name}{tf.TensorShape(v.shape).as_list()}" for v in values)
        base = f"unison.reduce.{len(values)}.{zlib.crc32(signature.encode()):08x}"
        out = grouped_sum(values, base)
        if reduce_op == reduce_util.ReduceOp.MEAN:
            out = [o / tf.cast(runtime.size(), o.dtype) for o in out]
        return out

    def _reduce(self, reduce_op: Any, value: Any) -> Any:
        flat = nest.flatten(value)
        return nest.pack_sequence_as(value, self._batch_reduce_to(reduce_op, [(v, None) for v in flat], None))

    def _gather_to_implementation(self, value: Any, destinations: Any, axis: int, options: Any) -> Any:
        v = self._local_results(value)[0]
        if runtime.size() == 1:
            return v
        perm = None
        if axis != 0:
            perm = [axis] + [i for i in range(len(v.shape)) if i != axis]
            v = tf.transpose(v, perm)
        if tf.executing_eagerly():
            out = tf.constant(_gather_array("unison.gather", v.numpy()))
        else:
            out = tf.numpy_function(lambda a: _gather_array("unison.gather", a), [v], v.dtype, stateful=True)
            out.set_shape([None] + v.shape.as_list()[1:])
        return out if perm is None else tf.transpose(out, np.argsort(perm))

    def _update(self, var: Any, fn: Any, args: Any, kwargs: Any, group: bool) -> Any:
        return self._update_non_slot(var, fn, (var,) + tuple(args), kwargs, group)

    def _update_non_slot(self, colocate_with: Any, fn: Any, args: Any, kwargs: Any, group: bool) -> Any:
        with tf.device(_DEVICE), distribute_lib.UpdateContext(_DEVICE):
            result = fn(*args, **kwargs)
            return result if group else nest.map_structure(self._local_results, result)

    def read_var(self, replica_local_var: Any) -> Any:
        return tf.identity(replica_local_var)

    def _local_results(self, value: Any) -> tuple:
        if isinstance(value, values_lib.DistributedValues):
            return value.values
        return (value,)

    def value_container(self, value: Any) -> Any:
        return value

    def _in_multi_worker_mode(self) -> bool:
        return False

    @property
    def _num_replicas_in_sync(self) -> int:
        return runtime.size()

    @property
    def worker_devices(self) -> tuple[str, ...]:
        return (_DEVICE,)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return (_DEVICE,)

    def non_slot_devices(self, var_list: Any) -> tuple[str, ...]:
        return (_DEVICE,)

    @property
    def experimental_should_init(self) -> bool:
        return True

    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def should_checkpoint(self) -> bool:
        return runtime.rank() == 0

    @property
    def should_save_summary(self) -> bool:
        return runtime.rank() == 0

    @property
    def _global_batch_size(self) -> bool:
        return True

    @property
    def _support_per_replica_values(self) -> bool:
        return False

    def _get_local_replica_id(self, replica_id_in_sync_group: int) -> int:
        return 0


class UnisonStrategy(distribute_lib.Strategy):
    """One replica per process; ``num_replicas_in_sync == unison.size()``.

    ``unison.init()`` is called if needed. On ranks other than 0, Keras's progress
    output is routed to logging (hidden by default), so only rank 0 prints a bar.

    Example::

        strategy = UnisonStrategy()
        with strategy.scope():
            model = keras.Sequential([...])
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(dataset.batch(global_batch_size), epochs=5)
    """

    def __init__(self, quiet_nonzero_ranks: bool = True) -> None:
        runtime.init()
        super().__init__(UnisonExtended(self))
        if quiet_nonzero_ranks and runtime.rank() != 0:
            import keras

            keras.config.disable_interactive_logging()
        _guard_keras()


_GUARDED = False


def _guard_keras() -> None:
    """Refuse a model built outside ``scope()`` but compiled or fit inside it.

    Keras binds a model to the strategy that was current when the model was
    created; such a model would train locally on every rank and the ranks would
    silently diverge. Models used entirely outside the scope are left alone.
    """
    global _GUARDED
    if _GUARDED:
        return
    import keras

    def check(model: Any, what: str) -> None:
        current = tf.distribute.get_strategy()
        # Keras records the strategy current at creation (None outside any scope)
        if isinstance(current, UnisonStrategy) and getattr(model, "_distribute_strategy", None) is not current:
            raise ValueError(f"{what}: this model was created outside `with strategy.scope():`, so it "
                             "would train on each rank separately and the ranks would diverge. Create "
                             "the model (and compile it) inside the UnisonStrategy scope")

    def wrap(name: str) -> None:
        original = getattr(keras.Model, name)

        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            check(self, f"model.{name}()")
            return original(self, *args, **kwargs)

        guarded.__doc__ = original.__doc__
        setattr(keras.Model, name, guarded)

    for name in ("compile", "fit", "evaluate", "predict"):
        wrap(name)
    _GUARDED = True
