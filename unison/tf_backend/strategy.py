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
* **Collectives in a graph** (:func:`_host_collective`): a submit callback
  hands its tensors to the engine without waiting and is exempt from
  tf.function's program-order chain of stateful ops, so TensorFlow runs it as
  soon as they exist; a collect callback waits, chained in program order, so
  every rank waits on its collectives in the same order, and submits never
  wait: no op order TensorFlow picks can deadlock the ranks. (Chained submits
  could not start before the gradient listed first, the last one computed.)
* **Gradients** (``_batch_reduce_to``): Keras hands over all of a step's
  gradients in one list. With ``overlap_gradients`` each gradient has its own
  submit, so its reduction starts while backward still runs; otherwise one
  submit takes them all (one fused group) when the last is computed. Overlap
  needs a spare core per process for the engine: where every core is busy with
  TensorFlow's compute (as many processes as cores, the usual CPU case) both
  took the same ~29 ms per step of the benchmark MLP here, and reducing after
  backward keeps the ring's lock-step exchanges off the cores compute needs.
  ``overlap_gradients=None`` picks per host. Gradients are paired by variable,
  never by position among the non-None ones: see [Note: gradients None on some
  ranks, under the strategy] (:func:`_guard_optimizers`).
* **Metrics**: Keras keeps loss and metric state in ON_READ/SUM variables and
  never reduces them across processes. Here such variables sum their updates
  over the ranks inside ``strategy.run``, so every rank holds the global state
  and reports the number one process would on the same global batches.

Names of engine collectives are fixed when a step is traced (see :func:`_op_name`),
identical on every rank because every rank traces the same program.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import os
import threading
import weakref
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
from unison.common.files import atomic_keras_save
from unison.common.ops import Max, Sum
from unison.tf_backend import host_ops
from unison.tf_backend.host_ops import refuse_xla

__all__ = ["UnisonStrategy", "split_global_batch"]

_DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
_executions: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()  # host callbacks run on several TensorFlow threads
_pending: dict[int, tuple[Any, np.ndarray]] = {}  # submitted reductions by id, until collected
_ids = itertools.count(1)


_traced: weakref.WeakKeyDictionary[Any, collections.Counter[str]] = weakref.WeakKeyDictionary()


def _run_name(base: str) -> str:
    """``base.<n>`` for the n-th execution of ``base`` in this process (same n on every rank)."""
    with _lock:
        n = _executions[base]
        _executions[base] += 1
    return f"{base}.{n}"


def _op_name(base: str) -> str:
    """The engine name of a collective created now.

    In a graph being traced (``tf.function``) the name is fixed at trace time:
    ``base.t<k>`` for the k-th such collective of this graph, so every execution
    of the step reuses the same names and the engine's response cache answers
    their negotiation (a new name costs an extra all-gather per step). Every rank
    traces the same program, so k agrees even if ranks retrace at different
    times. One graph op never runs twice at once (a step's reductions finish
    before the next step's start), so a fixed name is never in flight twice.
    Eagerly, ``base.<n>`` numbers the executions instead.
    """
    if tf.executing_eagerly():
        return _run_name(base)
    graph = tf.compat.v1.get_default_graph()
    with _lock:
        counts = _traced.setdefault(graph, collections.Counter())
        k = counts[base]
        counts[base] += 1
    return f"{base}.t{k}"


def _enqueue(handle: Any, shapes: list[tuple[np.dtype, tuple[int, ...]]]) -> np.ndarray:
    with _lock:
        key = next(_ids)
        _pending[key] = (handle, shapes)
    return host_ops.key_array(key)


def _submit_sum(name: str, *arrays: np.ndarray) -> np.ndarray:
    """Hand ``arrays`` to the engine for one grouped sum over the ranks; returns a key for :func:`_collect`.

    Never blocks. TensorFlow's array for a callback input keeps the tensor's
    buffer alive, so the engine may read it after the callback has returned.
    """
    handle = frontend.grouped_allreduce_async([np.ascontiguousarray(a) for a in arrays], Sum, name)
    return _enqueue(handle, [(a.dtype, a.shape) for a in arrays])


def _submit_gather(name: str, a: np.ndarray) -> np.ndarray:
    """Hand ``a`` to the engine for an all-gather along axis 0; returns a key for :func:`_collect`."""
    return _enqueue(frontend.allgather_async(np.ascontiguousarray(a), name), [(a.dtype, (-1, *a.shape[1:]))])


def _collect(*keys: np.ndarray) -> list[np.ndarray]:
    """Wait for the collectives submitted under ``keys``; their results, in order."""
    with _lock:
        entries = [_pending.pop(host_ops.key_of(k)) for k in keys]
    out = []
    for handle, shapes in entries:
        results = handle.wait()
        results = results if isinstance(results, list) else [results]
        out += [np.asarray(r, dtype=dt).reshape(shape) for r, (dt, shape) in zip(results, shapes, strict=True)]
    return out


def _host_collective(submits: list[tuple[Callable[..., np.int64], list[tf.Tensor]]],
                     outputs: list[tuple[tf.DType, Any]]) -> list[tf.Tensor]:
    """Run collectives as host callbacks: ``submit(*arrays)`` each, then one collect for all.

    ``outputs``: the dtype and (static) shape of each result. Eagerly: submit, then
    wait. In a graph, the submits are stateful callbacks marked to run independently of
    tf.function's program-order chain of stateful ops, so TensorFlow runs each as soon
    as its inputs exist (a gradient as backward computes it, a loss right after forward)
    and the engine works meanwhile. (Stateless callbacks would also be free to run
    early, but grappler folds a stateless callback of constants at optimisation time: it
    would run once, not once per step.) The collect is stateful and chained: every rank
    waits on its collectives in the same order, and since submits never wait, no order
    TensorFlow picks for them can deadlock the ranks.
    """
    if tf.executing_eagerly():
        keys = [submit(*[t.numpy() for t in ts]) for submit, ts in submits]
        return [tf.constant(o) for o in _collect(*keys)]
    refuse_xla("UnisonStrategy reduction")
    keys = []
    for submit, ts in submits:
        key = tf.numpy_function(submit, ts, tf.int64, stateful=True, name="unison_submit")
        # stateful, so it is never constant-folded, merged or pruned, but exempt from the
        # program-order chain of stateful ops: it runs when its inputs exist
        manager = getattr(tf.compat.v1.get_default_graph(), "experimental_acd_manager", None)
        if manager is not None:
            manager.run_independently(key.op)
        keys.append(key)
    one, back = host_ops.scalars_as_one([shape for _, shape in outputs])
    out = tf.numpy_function(lambda *k: one(_collect(*k)), keys, [dt for dt, _ in outputs], stateful=True,
                            name="unison_collect")
    out = back(list(out))
    for o, (_, shape) in zip(out, outputs, strict=True):
        o.set_shape(shape)
    return out


def grouped_sum(tensors: Sequence[Any], base: str, overlap: bool = False) -> list[tf.Tensor]:
    """Sum dense tensors over the ranks.

    One grouped engine call (fused) when the last of them exists; with ``overlap``,
    one call per tensor, each starting as soon as its tensor exists.
    """
    ts = [tf.convert_to_tensor(t) for t in tensors]
    if not ts or runtime.size() == 1:
        return ts
    name = _op_name(base)
    if overlap:
        submits = [(lambda a, i=i: _submit_sum(f"{name}.{i}", a), [t]) for i, t in enumerate(ts)]
        return _host_collective(submits, [(t.dtype, t.shape) for t in ts])
    return _grouped(ts, Sum, name)


def grouped_max(tensors: Sequence[Any], base: str) -> list[tf.Tensor]:
    """The elementwise maximum of dense tensors over the ranks, in one grouped engine call."""
    ts = [tf.convert_to_tensor(t) for t in tensors]
    if not ts or runtime.size() == 1:
        return ts
    return _grouped(ts, Max, _op_name(base))


def _grouped(ts: list[tf.Tensor], op: Any, name: str) -> list[tf.Tensor]:
    """One grouped request of ``op``; its small members come back as one tensor per dtype
    (host_ops.run_grouped)."""
    return host_ops.run_grouped(
        lambda arrays: frontend.grouped_allreduce_async([np.ascontiguousarray(a) for a in arrays], op, name),
        ts, name)


def overwritten_by_max(grads: list[Any], variables: Sequence[Any], base: str) -> list[Any]:
    """``grads`` with those of the variables Keras overwrites with their gradient taken as their maximum
    over the ranks (the others unchanged).

    [Note: float8 scales over the ranks]
    After ``model.quantize("float8")`` a layer's ``*_scale`` and ``*_amax_history`` variables have
    ``overwrite_with_gradient=True``: their "gradient" is their next value (the new scale, computed
    from the amax history, and the history rolled with this batch's absolute maximum in front), and
    Keras assigns it in ``apply`` before any reduction. One process over the global batch takes the
    maximum over all its rows; each rank saw its share only, so the maximum over the ranks is the
    global batch's (the scales, computed from the agreed history, are equal on every rank and stay
    so). Keras's own ``tf.distribute`` path overwrites each replica with its local value; before
    2026-12-07 so did this one, and the ranks' weights drifted apart.
    """
    present = [i for i, (g, v) in enumerate(zip(grads, variables, strict=True))
               if g is not None and getattr(v, "overwrite_with_gradient", False)]
    if present:
        for i, r in zip(present, grouped_max([grads[i] for i in present], base), strict=True):
            grads[i] = r
    return grads


def sum_gradients(grads: Sequence[Any], base: str, overlap: bool = False) -> list[Any]:
    """Sum a step's gradients over the ranks: dense ones with :func:`grouped_sum`, ``tf.IndexedSlices``
    by gathering every rank's rows and indices.

    [Note: sparse gradients under the strategy]
    An ``Embedding``'s gradient is ``tf.IndexedSlices``: one row per lookup, a row looked up twice
    listed twice. Keras's optimizers apply slices row by row (Adam squares each row, then
    scatter-adds), which is not what they do with the dense sum when rows repeat; one process on the
    global batch gets every rank's rows, in rank order. So the slices are all-gathered (the reduction
    ``hvd.DistributedOptimizer`` uses, :func:`unison.tf_backend.functions._reduce_sparse`) and the
    optimizer gets what one process would. Each rank's rows already carry Keras's 1/replicas loss
    scale, so gathering them is the sum the dense path computes. Before 2026-12-05 they were summed
    densely: with Adam the weights drifted from one process (0.10 after 3 steps, tests/mpi/mpi_keras.py).
    """
    from unison.tf_backend.functions import _reduce_sparse

    out: list[Any] = list(grads)
    dense = [k for k, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
    for k, r in zip(dense, grouped_sum([grads[k] for k in dense], base, overlap=overlap), strict=True):
        out[k] = r
    if runtime.size() > 1:
        for k, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                out[k] = _reduce_sparse(g, Sum, 1.0, f"{base}.sparse.{k}", None)
    return out


def gather_rows(tensor: Any, base: str) -> tf.Tensor:
    """All ranks' rows of ``tensor`` (axis 0, counts may differ), in rank order."""
    t = tf.convert_to_tensor(tensor)
    name = _op_name(base)
    return _host_collective([(lambda a: _submit_gather(name, a), [t])],
                            [(t.dtype, [None] + t.shape.as_list()[1:])])[0]


class _GlobalSumVariable(resource_variable_ops.ResourceVariable):
    """Metric state (ON_READ / SUM): assignments inside ``strategy.run`` add the global change.

    Every rank adds the sum over ranks of ``new - old`` (``assign``) or of the
    increments (``assign_add``, ``assign_sub``), so the state (and
    ``metric.result()``) is global and identical on every rank, as a
    ``MirroredStrategy`` variable reads. Assignments in cross-replica context
    (``reset_state``, checkpoint restore) stay local.
    """

    def assign(self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        if isinstance(tf.distribute.get_replica_context(), _UnisonReplicaContext) and runtime.size() > 1:
            value = tf.convert_to_tensor(value, dtype=self.dtype)
            delta = grouped_sum([value - self.read_value()], f"unison.metric.{self._shared_name}")[0]
            return super().assign_add(delta, use_locking=use_locking, name=name, read_value=read_value)
        return super().assign(value, use_locking=use_locking, name=name, read_value=read_value)

    # assign_add and assign_sub are ops of their own, not assign: before 2026-12-07 they stayed per rank
    # inside strategy.run while assign was summed (a raw ON_READ/SUM variable counted 2 where
    # MirroredStrategy's 2 replicas count 4; found by an audit)
    def assign_add(self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        return super().assign_add(self._global(delta), use_locking=use_locking, name=name, read_value=read_value)

    def assign_sub(self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        return super().assign_sub(self._global(delta), use_locking=use_locking, name=name, read_value=read_value)

    def _global(self, delta: Any) -> Any:
        """``delta`` summed over the ranks inside ``strategy.run``; as given elsewhere."""
        if isinstance(tf.distribute.get_replica_context(), _UnisonReplicaContext) and runtime.size() > 1:
            delta = tf.convert_to_tensor(delta, dtype=self.dtype)
            return grouped_sum([delta], f"unison.metric.{self._shared_name}")[0]
        return delta


class _UnisonReplicaContext(distribute_lib.ReplicaContext):
    def __init__(self, strategy: tf.distribute.Strategy) -> None:
        super().__init__(strategy, replica_id_in_sync_group=runtime.rank())

    @property
    def devices(self) -> tuple[str, ...]:
        return (_DEVICE,)


def split_global_batch(dataset: tf.data.Dataset, rank: int, size: int,
                       refuse_small: bool = False) -> tf.data.Dataset:
    """Map each global batch of n rows to this rank's rows ``[rank*n//size, (rank+1)*n//size)``.

    Args:
        refuse_small: a global batch of fewer rows than ranks raises ``tf.errors.InvalidArgumentError``
            (naming the rows, the ranks and the fix) when the step reads it, on every rank alike (they read
            the same batches), instead of leaving some ranks an empty batch.

    Raises:
        ValueError: the dataset is not batched (its elements have no batch dimension).
    """
    specs = nest.flatten(dataset.element_spec)
    if not specs or any(getattr(s, "shape", None) is None or s.shape.rank in (None, 0) for s in specs):
        raise ValueError(f"UnisonStrategy needs a batched dataset (each element a global batch); got "
                         f"elements {dataset.element_spec}. Call dataset.batch(global_batch_size) first")

    # tf.data calls the map function with a tuple element unpacked, anything else (a tensor, a dict) whole
    unpacked = type(dataset.element_spec) is tuple

    def take(*elem: Any) -> Any:
        n = _rows(nest.flatten(elem)[0])
        if refuse_small:
            message = (f"unison.keras.DataParallel: a global batch of the tf.data dataset has fewer rows than the "
                       f"{size} ranks, so some rank would get none; make every global batch at least {size} rows "
                       "(batch(..., drop_remainder=True), or pad the last one)")
            check = tf.debugging.assert_greater_equal(n, tf.constant(size, tf.int64), message=message)
            with tf.control_dependencies([check]):
                n = tf.identity(n)
        lo, hi = (rank * n) // size, ((rank + 1) * n) // size
        out = nest.map_structure(lambda t: _slice_rows(t, lo, hi), elem)
        # [Note: the element's structure] A tuple element stays a tuple of its length: a 1-tuple
        # ``((a, b),)`` (Keras's ``predict([a, b])`` of a two-input model) was unwrapped to ``(a, b)``
        # before 2026-12-07 (found by an audit), which Keras read as ``x=a, y=b``: predict raised.
        return out if unpacked else out[0]

    return dataset.map(take)


def _rows(t: Any) -> tf.Tensor:
    """The number of rows (first dimension) of a dense, sparse or ragged tensor, as int64."""
    if isinstance(t, tf.SparseTensor):
        return t.dense_shape[0]
    if isinstance(t, tf.RaggedTensor):
        return t.nrows(out_type=tf.int64)
    return tf.shape(t, out_type=tf.int64)[0]


def _slice_rows(t: Any, lo: tf.Tensor, hi: tf.Tensor) -> Any:
    """Rows ``[lo, hi)`` of a dense, ragged or sparse tensor.

    A ``tf.SparseTensor`` cannot be indexed; ``tf.sparse.slice`` takes its rows (indices renumbered
    from ``lo``) and keeps the other dimensions whole. Before 2026-12-07 sparse input raised
    "'SparseTensor' object is not subscriptable" on every rank (found by an audit).
    """
    if not isinstance(t, tf.SparseTensor):
        return t[lo:hi]  # (a RaggedTensor slices by rows too)
    zeros = tf.zeros_like(t.dense_shape[1:])
    out = tf.sparse.slice(t, tf.concat([[lo], zeros], 0), tf.concat([[hi - lo], t.dense_shape[1:]], 0))
    out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return out


def _describe_dataset(dataset: Any) -> str:
    """What the ranks must agree on: the number of global batches (when tf.data knows it), the
    batch size (when the dataset was batched with a constant one) and the elements' specs."""
    try:
        batches = int(dataset.cardinality())
    except Exception:  # (not a tf.data.Dataset)
        batches = -2
    size = getattr(dataset, "_batch_size", None)
    try:
        size = int(size) if size is not None else None
    except Exception:
        size = None
    known = f"{batches} global batches" if batches >= 0 else "an unknown number of global batches"
    seeds = shuffle_seeds(dataset)
    shuffled = f", shuffled with seeds {seeds}" if seeds else ""
    return f"{known}, batch_size {size if size is not None else '?'}, elements {dataset.element_spec}{shuffled}"


def shuffle_seeds(dataset: Any) -> list[tuple[int, int]]:
    """The (seed, seed2) of each ``shuffle`` in ``dataset``'s chain of inputs (``(0, 0)``: no seed at all)."""
    seeds = []
    while dataset is not None:
        if type(dataset).__name__ == "_ShuffleDataset":
            try:
                seeds.append((int(dataset._seed), int(dataset._seed2)))
            except Exception:  # (another TensorFlow layout: not compared)
                pass
        dataset = getattr(dataset, "_input_dataset", None)
    return seeds


def data_sources(dataset: Any, digest: Callable[[np.ndarray], str]) -> list[str]:
    """What of ``dataset``'s chain of inputs may be each rank's own where its element specs agree: each
    ``shard(num_shards, index)`` and each in-memory source (``from_tensor_slices``, ``from_tensors``, a
    reader's file names), by ``digest`` of its tensors. Data a generator, a map or an interleave makes is not
    seen. Before 2026-12-07 ``dataset.shard(size, rank)`` on each rank (Horovod's habit) was accepted and the
    ranks together trained on 1/size of the data (found by an audit)."""
    found, todo, seen = [], [dataset], set()
    while todo:
        d = todo.pop()
        if d is None or id(d) in seen or not hasattr(d, "element_spec"):
            continue
        seen.add(id(d))
        kind = type(d).__name__
        try:
            if kind == "_ShardDataset":
                found.append(f"shard({int(d._num_shards)}, {int(d._index)})")
            elif kind in ("_TensorSliceDataset", "_TensorDataset"):
                found.append(f"{kind.strip('_')} {[digest(np.asarray(t.numpy())) for t in d._tensors]}")
        except Exception:  # (another TensorFlow layout, or symbolic tensors: not compared)
            pass
        todo.extend(nest.flatten(getattr(d, "_datasets", None)))  # (zip)
        todo.extend(getattr(d, name, None) for name in ("_input_dataset", "_dataset_to_concatenate", "_impl",
                                                        "_filenames"))
    return found


def _with_agreement_to_stop(model: Any, callbacks: Any) -> Any:
    """``fit``'s callbacks and, last, the agreement that a stop set on one rank stops every rank
    (``unison.keras``'s: one all-reduce of a flag per batch and per epoch). Without it (before
    2026-12-05) a callback that stopped one rank's training (a time limit, a rule on the rank's own
    values) let that rank return from ``fit`` while the others waited in the next step for ever."""
    import keras

    from unison.keras.data_parallel import _AgreeToStop

    agree = _AgreeToStop(model)
    if isinstance(callbacks, keras.callbacks.CallbackList):  # (already built: the agreement joins its list)
        agree.set_model(model)
        callbacks.callbacks.append(agree)
        return callbacks
    return [*nest.flatten(callbacks or []), agree]  # (Keras takes one callback alone too)


#: the arguments of fit/evaluate/predict that set how many steps run and what they compute (besides the data)
_SETTINGS = {"fit": ("epochs", "initial_epoch", "steps_per_epoch", "shuffle", "class_weight", "validation_steps",
                     "validation_freq"),
             "evaluate": ("steps",), "predict": ("steps",)}
#: the settings of the fit/evaluate/predict call running on this thread, for :func:`_agree_on_dataset`
_call = threading.local()


def _call_settings(name: str, arguments: dict[str, Any]) -> dict[str, str]:
    """The :data:`_SETTINGS` of a call (``arguments`` with Keras's defaults applied), comparable across ranks.

    ``shuffle`` counts for in-memory arrays only (Keras ignores it for a dataset).
    """
    def canonical(value: Any) -> str:
        if isinstance(value, dict):  # (class_weight: numpy keys and values compare by their numbers)
            return repr(sorted((_plain(k), _plain(v)) for k, v in value.items()))
        return repr(_plain(value))

    keys = [k for k in _SETTINGS.get(name, ()) if k != "shuffle" or _in_memory(arguments.get("x"))]
    return {k: canonical(arguments.get(k)) for k in keys}


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds (``np.int64(3)`` and ``3`` agree)."""
    return value.item() if isinstance(value, np.generic) else value


def _raise_if_settings_differ(everyone: list[tuple[str, dict[str, str]] | None]) -> None:
    """Raise, on every rank alike, naming the first argument of fit/evaluate/predict whose value differs.

    [Note: the ranks' calls agree]
    ``fit``/``evaluate``/``predict`` compare their :data:`_SETTINGS` in the exchange that already
    compares their data, so no collective is added: :func:`_agree_on_arrays` for in-memory arrays,
    and :func:`_agree_on_dataset` for anything Keras distributes as a dataset (the call's settings
    wait in ``_call.settings`` while the call runs).
    Before 2026-12-07 ranks given different ``epochs``, ``steps_per_epoch``, ``steps`` or ``shuffle``
    ran different steps and the ones that ran more waited 60 s for a ``StallError``; a different
    ``class_weight`` trained silently on a mix of the ranks' weightings (found by an audit).
    """
    if all(other == everyone[0] for other in everyone):
        return
    names = sorted({k for e in everyone if e is not None for k in e[1]})
    for key in names:
        seen = [e[1].get(key) if e is not None else None for e in everyone]
        if any(v != seen[0] for v in seen):
            what = next(e[0] for e in everyone if e is not None)
            shown = "; ".join(f"rank {r}: {v}" for r, v in enumerate(seen))
            raise ValueError(f"UnisonStrategy: {what}({key}=...) differs across the ranks ({shown}). Every rank "
                             "must run the same steps, weighted alike, on the same global batches: pass the same "
                             f"{key} on every rank")
    raise ValueError(f"UnisonStrategy: the ranks run different calls ({everyone}): call fit, evaluate and predict "
                     "alike on every rank")


def _agree_on_arrays(what: str, arguments: dict[str, Any], settings: dict[str, str]) -> None:
    """For in-memory inputs (a dataset is compared when it is distributed): every rank must pass
    the same rows, batch size and ``settings`` (:func:`_call_settings`); compared in one small
    all-gather, raised on every rank. The rows are compared by a digest (``unison.keras``'s: a
    numpy array up to 64 MiB whole, else 64 rows spread evenly): each rank's own shard of one shape
    (Horovod's habit) trained silently on half of every rank's rows before 2026-12-05, when only
    shapes were compared."""
    from unison.common.engine.objects import allgather_object
    from unison.keras.data_parallel import _rows_digest

    x = arguments.get("x")
    if not _in_memory(x):
        return
    parts = [p for p in (x, arguments.get("y"), arguments.get("sample_weight")) if p is not None]
    shapes = [f"{tuple(a.shape)} {getattr(a.dtype, 'name', a.dtype)} {_rows_digest(a)}"
              for p in parts for a in nest.flatten(p)]
    mine = f"arrays {', '.join(shapes)}, batch_size={arguments.get('batch_size')}"
    gathered = allgather_object((mine, (what, settings)), name=f"unison.UnisonStrategy.{what}.inputs")
    _raise_if_settings_differ([s for _, s in gathered])
    everyone = [d for d, _ in gathered]
    if any(other != everyone[0] for other in everyone):
        shown = "; ".join(f"rank {r}: {d}" for r, d in enumerate(everyone))
        raise ValueError(f"UnisonStrategy: the ranks' datasets differ ({shown}). Every rank feeds the same global "
                         "batches (the strategy splits each one): pass the same data and batch_size on every rank")


def _with_defaults(signature: inspect.Signature, model: Any, args: Any, kwargs: Any) -> dict[str, Any]:
    """A call's arguments bound to ``signature``, with the defaults of those it leaves out."""
    bound = signature.bind(model, *args, **kwargs)
    bound.apply_defaults()
    return {**bound.arguments.pop("kwargs", {}), **bound.arguments}


def _check_metrics(metrics: Sequence[Any], what: str) -> None:
    """Refuse, on every rank alike, metric state created outside the strategy's scope.

    A metric object built before ``with strategy.scope():`` and handed to ``compile`` keeps plain
    variables: each rank reported its own share's value while the loss was global, and a callback
    deciding on it (``EarlyStopping(monitor="auc")``) stopped some ranks only, and the others waited
    for ever. Every rank builds its metrics the same way, so every rank raises.
    """
    for metric in metrics:
        for v in getattr(metric, "variables", []):
            inner = getattr(v, "value", v)
            if getattr(v, "aggregation", None) == "sum" and isinstance(inner, tf.Variable) \
                    and not isinstance(inner, _GlobalSumVariable):
                raise ValueError(f"{what}: the metric variable {v.path!r} was created outside `with strategy."
                                 "scope():` (a metric object built before the scope), so each rank would report "
                                 "its own share and callbacks would decide differently on each rank. Create the "
                                 "metric objects inside the UnisonStrategy scope too, or pass metric names")


def _check_losses(losses: Sequence[Any]) -> None:
    """Refuse a loss whose reduction divides by each rank's own sum of sample weights.

    Keras divides a ``"mean_with_sample_weight"`` loss by this replica's sum of weights and then by
    the number of replicas, which is one process's answer only when every rank's weights sum alike:
    with sample weights, losses and weights differed from one process (measured: 3% in the weights
    after one epoch). Every rank compiles the same loss, so every rank raises.
    """
    for loss in losses:
        if getattr(loss, "reduction", None) == "mean_with_sample_weight":
            raise ValueError(f"UnisonStrategy: the loss {getattr(loss, 'name', loss)!r} uses "
                             "reduction='mean_with_sample_weight', which Keras computes per rank (each rank's "
                             "own sum of sample weights), so with sample weights the result is not one "
                             "process's. Use the default reduction 'sum_over_batch_size' (or scale the sample "
                             "weights so that they average 1)")


_shuffles = itertools.count()
_shuffle_base: list[int] = []


def _agreed_shuffle(arguments: dict[str, Any]) -> dict[str, Any] | None:
    """``fit``'s arguments with in-memory arrays and ``shuffle=True`` (Keras's default) as a dataset of
    global batches whose order every rank agrees on; None when there is nothing to rewrite.

    [Note: one shuffle for every rank] Keras shuffles arrays with ``tf.random.shuffle`` on each rank's
    own random state, and the strategy then takes each rank's share of *its* global batch: the
    ranks' shares came from different permutations, so in an epoch some rows were trained twice
    and others not at all (24 distinct rows of 32 measured at 2 ranks). Now the rows go through
    ``unison.keras``'s pipeline (:func:`unison.keras._tf_data.arrays_dataset`, one process's view:
    global batches), permuted each pass by a stateless shuffle keyed by a seed rank 0 chose (the one
    ``keras.utils.set_random_seed`` set, else fresh) and the number of ``fit`` calls so far;
    ``validation_split`` takes the last rows first and ``class_weight`` becomes sample weights, as
    Keras does. A ``tf.data`` pipeline's own ``shuffle`` needs a seed that is the same on every rank.
    """
    x = arguments.get("x")
    shuffle = arguments.get("shuffle", True)
    if not shuffle or not _in_memory(x):
        return None
    if shuffle == "batch":
        raise ValueError("UnisonStrategy: fit(shuffle='batch') shuffles within each rank's own batches; use "
                         "shuffle=True (one permutation every rank agrees on) or False")
    from unison.keras import data as ukdata
    from unison.keras._tf_data import arrays_dataset

    a = {k: v for k, v in arguments.items() if k != "self"}
    y, sample_weight = a.pop("y", None), a.pop("sample_weight", None)
    split = a.pop("validation_split", 0.0) or 0.0
    if split and a.get("validation_data") is None:
        (x, y, sample_weight), held = ukdata.split_validation((x, y, sample_weight), split)
        a["validation_data"] = tuple(v for v in held if v is not None)
    batch = a.pop("batch_size", None) or 32
    if a.get("validation_data") is not None and a.get("validation_batch_size") is None:
        a["validation_batch_size"] = batch
    seed = _shuffle_seed() + next(_shuffles)
    data = ukdata.ShardedArrays(x, y, sample_weight, batch_size=batch, rank=0, size=1, shuffle=True, seed=seed,
                                class_weight=a.pop("class_weight", None))
    pipeline = arrays_dataset(data.parts, data.plan, 0, True, seed)
    a["shuffle"] = False
    if a.get("steps_per_epoch") is None:
        a["x"], a["steps_per_epoch"] = pipeline.dataset, data.plan.steps  # (one pass after another)
    else:  # Keras's own steps: an epoch ends early where a pass runs out ([Note: a caller's
        a["x"] = pipeline.one_pass_each()  # steps_per_epoch over shuffled arrays] in unison.keras._tf_data)
    return a


def _in_memory(x: Any) -> bool:
    """Whether ``x`` is in-memory arrays (numpy, tensors), not a dataset or generator."""
    leaves = nest.flatten(x) if x is not None else []
    return bool(leaves) and all(isinstance(a, np.ndarray) or (hasattr(a, "shape") and hasattr(a, "dtype")
                                                             and not isinstance(a, tf.data.Dataset))
                                for a in leaves)


def _shuffle_seed() -> int:
    """Rank 0's shuffling seed (one broadcast, the first time): ``keras.utils.set_random_seed``'s, else fresh."""
    if not _shuffle_base:
        from unison.keras.data_parallel import _keras_global_seed

        chosen = _keras_global_seed()
        mine = np.array([(np.random.SeedSequence().entropy if chosen is None else chosen) % (2**31)], np.int64)
        _shuffle_base.append(int(np.asarray(frontend.broadcast(mine, 0, "unison.UnisonStrategy.shuffle_seed"))[0]))
    return _shuffle_base[0]


def _agree_on_dataset(dataset: Any) -> None:
    """Every rank must feed the same global batches: the ranks compare what they can see of their
    datasets (one small all-gather each time Keras distributes one) and raise on every rank when
    it differs. A rank with fewer batches finished fit silently, paired with other rows, and the
    other ranks failed or hung in the next call."""
    from unison.common.engine.objects import allgather_object

    # the settings of the fit/evaluate/predict distributing it ride along: [Note: the ranks' calls agree]
    gathered = allgather_object((_describe_dataset(dataset), getattr(_call, "settings", None)),
                                name="unison.UnisonStrategy.dataset")
    _raise_if_settings_differ([s for _, s in gathered])
    everyone = [d for d, _ in gathered]
    if (0, 0) in shuffle_seeds(dataset):  # (the same on every rank: they all describe the same chain)
        raise ValueError("UnisonStrategy: the dataset is shuffled without a seed, so each rank shuffles its own "
                         "way and the ranks' shares of a global batch come from different rows (some trained "
                         "twice, others never). Pass dataset.shuffle(buffer, seed=...) the same seed on every "
                         "rank")
    if any(other != everyone[0] for other in everyone):
        shown = "; ".join(f"rank {r}: {d}" for r, d in enumerate(everyone))
        raise ValueError(f"UnisonStrategy: the ranks' datasets differ ({shown}). Every rank feeds the same global "
                         "batches (the strategy splits each one): pass the same data and batch_size on every rank")


class UnisonExtended(distribute_lib.StrategyExtendedV1):
    """The strategy's machinery: one local CPU replica, collectives through Unison's engine."""

    def __init__(self, container_strategy: tf.distribute.Strategy, overlap_gradients: bool,
                 zero_stage: int = 0) -> None:
        super().__init__(container_strategy)
        self._overlap = overlap_gradients
        self._zero_stage = zero_stage
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
        if runtime.size() > 1 and not getattr(_rank0_only, "active", False):
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
        if runtime.size() > 1:
            _agree_on_dataset(dataset)
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
        # the first dimension stays out of the name: a share that differs there (an uneven last batch)
        # then meets the others' under one name, and the engine names the shapes on every rank
        signature = "|".join(f"{v.dtype.name}{tf.TensorShape(v.shape).as_list()[1:]}/{v.shape.rank}"
                             for v in values)
        base = f"unison.reduce.{len(values)}.{zlib.crc32(signature.encode()):08x}"
        out = grouped_sum(values, base, overlap=self._overlap)
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
        out = gather_rows(v, "unison.gather")
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

    Args:
        quiet_nonzero_ranks: hide Keras's progress output on ranks other than 0.
        overlap_gradients: reduce each gradient as soon as it is computed, while
            backward still runs (True), or all of a step's gradients together
            after backward (False). None (default): overlap when this host gives
            each local process at least two cores (see :func:`spare_cores`).
        zero_stage: 0 (default) keeps a full optimizer state on every rank; 1 shards
            the optimizer state of every optimizer created in ``scope()`` (each rank
            keeps 1/N of it); 2 also reduce-scatters the gradients so each rank keeps
            only its shard of them. Stage 3 is PyTorch-only. Every rank must pass the
            same value (checked here; a mismatch raises on every rank). See
            ``unison/tf_backend/zero.py`` and docs/zero.md.

    Raises:
        ValueError: ``zero_stage`` outside 0-2, or different on some rank.

    Example::

        strategy = UnisonStrategy()
        with strategy.scope():
            model = keras.Sequential([...])
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(dataset.batch(global_batch_size), epochs=5)
    """

    def __init__(self, quiet_nonzero_ranks: bool = True, overlap_gradients: bool | None = None,
                 zero_stage: int = 0) -> None:
        import keras

        from unison.tf_backend import zero

        if keras.backend.backend() != "tensorflow":  # (each rank alike, before any collective)
            raise ValueError(
                "UnisonStrategy is a tf.distribute strategy, so Keras must run on its TensorFlow backend, but "
                f"this process runs Keras on {keras.backend.backend()!r} (KERAS_BACKEND). Set "
                "KERAS_BACKEND=tensorflow, or use unison.keras.DataParallel, which trains on every backend "
                "(examples/keras_any_backend.py)")
        runtime.init()
        if overlap_gradients is None:
            overlap_gradients = spare_cores()
        elif not isinstance(overlap_gradients, bool):
            raise TypeError(f"overlap_gradients must be True, False or None (pick per host), "
                            f"got {overlap_gradients!r}")
        try:
            zero_stage, refused = zero.check_keras_stage(zero_stage), None
        except (TypeError, ValueError) as exc:  # raised after the agreement, on every rank (it hung the others)
            zero_stage, refused = -1, exc
        try:
            zero.agree(zero_stage, "", "UnisonStrategy(zero_stage=...)")
        except ValueError:
            if refused is not None:  # this rank's own error, the others' the disagreement
                raise refused from None
            raise
        if refused is not None:
            raise refused
        super().__init__(UnisonExtended(self, overlap_gradients, zero_stage))
        if quiet_nonzero_ranks and runtime.rank() != 0:
            keras.config.disable_interactive_logging()
        _guard_keras()


def spare_cores() -> bool:
    """Whether each process on this host has at least two cores (its affinity over local ranks)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return cores >= 2 * runtime.local_size()


_GUARDED = False
#: set while rank 0 alone saves a model: variables created meanwhile are not broadcast
_rank0_only = threading.local()


def _unison_model(model: Any) -> bool:
    """Whether ``model`` was created under a UnisonStrategy of a multi-process job."""
    return isinstance(getattr(model, "_distribute_strategy", None), UnisonStrategy) and runtime.size() > 1


_atomic_save = atomic_keras_save


def _gather_predictions(model: Any) -> None:
    """Make ``model.predict`` return the predictions of the whole global batch on every rank.

    Each rank predicts its share of every global batch (rows ``[r*n//size,
    (r+1)*n//size)``); the model's ``predict_step`` is wrapped (on this instance
    only, once) to gather those rows from all ranks in rank order, which is the
    global batch's order, so every rank gets exactly what one process returns.
    """
    if getattr(model, "_unison_gathers_predictions", False):
        return
    step = model.predict_step

    def predict_step(data: Any) -> Any:
        outputs = step(data)
        flat = nest.flatten(outputs)
        gathered = [t if tf.convert_to_tensor(t).shape.rank == 0 else gather_rows(t, f"unison.predict.{i}")
                    for i, t in enumerate(flat)]
        return nest.pack_sequence_as(outputs, gathered)

    model.predict_step = predict_step
    model._unison_gathers_predictions = True
    model.predict_function = None  # trace again, with the gather


def _build_for_predict(model: Any, x: Any) -> None:
    """Build an unbuilt model on one row of ``x`` (arrays or tensors, nested or not; zeros shaped like a
    dataset's elements), eagerly in its strategy's scope, as ``fit`` and ``evaluate`` have Keras do:
    ``predict`` first built it inside its traced step, where the strategy refuses to create variables
    (a RuntimeError on every rank where Keras without a strategy predicts, before 2026-12-05). Other
    inputs (a generator, a PyDataset, sparse or ragged tensors) are left to Keras, as before."""
    if model.built or x is None:
        return
    if isinstance(x, tf.data.Dataset):  # zeros of its elements' spec: a row taken from it would be lost to
        spec = x.element_spec           # a dataset over a shared iterator
        spec = spec[0] if isinstance(spec, tuple) and len(spec) in (1, 2, 3) else spec  # (x, y, weights)
        specs = nest.flatten(spec)
        if not specs or not all(isinstance(t, tf.TensorSpec) and t.shape.rank and
                                t.shape[1:].is_fully_defined() for t in specs):
            return
        x = nest.map_structure(lambda t: tf.zeros([1, *t.shape[1:]], t.dtype), spec)
    def usable(a: Any) -> bool:  # arrays, tensors, variables, anything numpy reads (a DataFrame)
        if isinstance(a, (tf.SparseTensor, tf.RaggedTensor)):
            return False
        return isinstance(a, (np.ndarray, tf.Tensor, tf.Variable)) or hasattr(a, "__array__")

    leaves = nest.flatten(x)
    if not leaves or not all(usable(a) for a in leaves):
        return  # (a generator, a PyDataset, sparse or ragged input: left to Keras, as before)
    x = nest.map_structure(lambda a: a if isinstance(a, (tf.Tensor, tf.Variable)) else np.asarray(a), x)
    if not all(len(a.shape) > 0 for a in nest.flatten(x)):
        return
    row = nest.map_structure(lambda a: a[:1], x)
    with model.distribute_strategy.scope():
        model(row, training=False)


def _guard_keras() -> None:
    """Adapt ``keras.Model`` methods for models created under a UnisonStrategy.

    * Refuse a model built outside ``scope()`` but compiled or fit inside it:
      Keras binds a model to the strategy current when it was created, so such a
      model would train locally on every rank and the ranks would silently
      diverge. Models used entirely outside the scope are left alone.
    * ``predict`` returns the whole global batch's predictions on every rank.
    * ``save`` and ``save_weights`` (and so Keras's ``ModelCheckpoint`` and
      ``BackupAndRestore``) write from rank 0 only, atomically and durably;
      other ranks return without writing. Every rank may call them (as Keras's callbacks
      do), or rank 0 alone: nothing in them communicates.
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

    def wrap(name: str, before: Callable[[Any], None] | None = None) -> None:
        original = getattr(keras.Model, name)

        signature = inspect.signature(original)

        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            check(self, f"model.{name}()")
            if before is not None and _unison_model(self):
                before(self)
            if name == "compile" and _unison_model(self) and runtime.size() > 1:
                given = signature.bind(self, *args, **kwargs).arguments
                _check_metrics([m for key in ("metrics", "weighted_metrics") for m in nest.flatten(given.get(key))
                                if isinstance(m, keras.metrics.Metric)], "model.compile()")
                _check_losses(nest.flatten(given.get("loss")))
                compiled = original(self, *args, **kwargs)
                _empty_share_loses_nothing(self)
                return compiled
            if name in ("fit", "evaluate", "predict") and _unison_model(self) and runtime.size() > 1:
                arguments = signature.bind(self, *args, **kwargs).arguments
                settings = _call_settings(name, _with_defaults(signature, self, args, kwargs))
                _agree_on_arrays(f"model.{name}", arguments, settings)
                outer = getattr(_call, "settings", None)
                _call.settings = (f"model.{name}", settings)  # [Note: the ranks' calls agree]
                try:
                    if name == "fit":
                        agreed = _agreed_shuffle(arguments)
                        call = agreed if agreed is not None else {k: v for k, v in arguments.items()
                                                                  if k != "self"}
                        call["callbacks"] = _with_agreement_to_stop(self, call.get("callbacks"))
                        from unison.keras.data_parallel import own_seed_streams

                        own_seed_streams(self, runtime.rank())  # [Note: each rank's own random stream]
                        return original(self, **call)
                    if name == "predict":  # (after the agreement: building broadcasts)
                        _build_for_predict(self, arguments.get("x"))
                    return original(self, *args, **kwargs)
                finally:
                    _call.settings = outer
            if name == "predict" and _unison_model(self):
                _build_for_predict(self, signature.bind(self, *args, **kwargs).arguments.get("x"))
            return original(self, *args, **kwargs)

        guarded.__doc__ = original.__doc__
        guarded.__wrapped__ = original  # type: ignore[attr-defined]  # (inspect.signature reads Keras's through it)
        # on the class that defines it: Keras's load_model compiles a loaded model from its config only
        # while ``type(model).compile is Trainer.compile`` (a compile set on keras.Model would count as
        # the user's own, and the optimizer and its state would not be restored)
        owner = next(c for c in keras.Model.__mro__ if name in c.__dict__)
        setattr(owner, name, guarded)

    def wrap_save(name: str) -> None:
        original = getattr(keras.Model, name)

        def rank0_save(self: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
            if not _unison_model(self):
                return original(self, filepath, *args, **kwargs)
            if runtime.rank() != 0:
                return None
            # Keras's saving may create variables (a throw-away optimizer); in the strategy's scope that
            # would be a collective that only rank 0 makes: those are this rank's alone
            _rank0_only.active = True
            try:
                return _atomic_save(lambda path, *a, **k: original(self, path, *a, **k), filepath, *args,
                                    **kwargs)
            finally:
                _rank0_only.active = False

        rank0_save.__doc__ = original.__doc__
        setattr(keras.Model, name, rank0_save)

    from unison.tf_backend import zero_optimizer

    def zero_stage(strategy: Any) -> int:
        return strategy.extended._zero_stage if isinstance(strategy, UnisonStrategy) else 0

    zero_optimizer.install(zero_stage)
    wrap("compile")
    wrap("fit", lambda model: zero_optimizer.check_compiled(model, zero_stage(model._distribute_strategy)))
    wrap("evaluate")
    wrap("predict", _gather_predictions)
    wrap_save("save")
    wrap_save("save_weights")
    original_pob = keras.Model.predict_on_batch

    def predict_on_batch(self: Any, x: Any) -> Any:
        """Every rank predicts its share of the (global) batch and gets the whole batch's
        predictions, as ``predict``: after ``predict`` had installed its gather, each rank's whole
        batch came back concatenated (every row ``size`` times)."""
        if not _unison_model(self) or runtime.size() == 1:
            return original_pob(self, x)
        _build_for_predict(self, x)
        _gather_predictions(self)
        r, n = runtime.rank(), runtime.size()

        def share(a: Any) -> Any:
            rows = int(a.shape[0])
            return a[(r * rows) // n:((r + 1) * rows) // n]

        return original_pob(self, nest.map_structure(share, x))

    predict_on_batch.__doc__ = original_pob.__doc__
    keras.Model.predict_on_batch = predict_on_batch
    _guard_optimizers()
    _guard_checkpoints()
    _GUARDED = True


def _empty_share_loses_nothing(model: Any) -> None:
    """Make the compiled loss of a replica's empty share a scalar 0 when it runs eagerly, as in a graph.

    [Note: an empty share's eager loss] A last global batch with fewer rows than ranks leaves some
    ranks no rows. In a graph the batch dimension is unknown and Keras reduces the empty share's loss
    to 0 (``divide_no_nan``), which the loss tracker weighs by its 0 rows; run eagerly, Keras sees the
    shape ``(0,)`` and returns the loss unreduced, and the tracker's mean of no values, NaN, was summed
    into every rank's: ``evaluate`` (and ``fit``'s logs) reported a NaN loss with ``run_eagerly=True``
    (found by an audit, before 2026-12-07). The sum of the empty loss is that 0, with zero gradients.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None:
        return
    call = compile_loss.call

    def summed_if_empty(*args: Any, **kwargs: Any) -> Any:
        loss = call(*args, **kwargs)
        if loss is not None and tuple(getattr(loss, "shape", ())) == (0,):  # (eager only: a graph's is None)
            return tf.reduce_sum(loss)
        return loss

    compile_loss.call = summed_if_empty


_optimizer_ids = itertools.count()


def _unison_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` was created under a UnisonStrategy of a multi-process job."""
    return (isinstance(getattr(optimizer, "_distribution_strategy", None), UnisonStrategy)
            and runtime.size() > 1)


def _optimizer_tag(optimizer: Any) -> str:
    """``<k>.<n>.<crc>``: the k-th optimizer to apply gradients in this process, its variables' signature.

    Every rank runs the same program, so k agrees; it keeps two optimizers with
    same-shaped variables (a GAN's) apart.
    """
    tag = getattr(optimizer, "_unison_tag", None)
    if tag is None:
        variables = optimizer._trainable_variables
        signature = "|".join(f"{tf.as_dtype(v.dtype).name}{list(v.shape)}" for v in variables)
        tag = f"{next(_optimizer_ids)}.{len(variables)}.{zlib.crc32(signature.encode()):08x}"
        optimizer._unison_tag = tag
    return tag


def _guard_optimizers() -> None:
    """Reduce the gradients of optimizers created under a UnisonStrategy by variable, never by position.

    [Note: gradients None on some ranks, under the strategy]
    Keras's ``apply`` drops the variables whose gradient is None, and its
    ``_all_reduce_sum_gradients`` hands the rest to ``replica_context.all_reduce``,
    which can only pair them by position. When a data-dependent branch leaves a
    different variable without a gradient on each rank, rank 0's gradient k would be
    summed with rank 1's gradient k of another variable (silently, when the shapes
    match) or the ranks would hang. So, for such optimizers:

    * ``apply`` first makes the ranks agree on which variables have a gradient
      anywhere (:func:`~unison.tf_backend.functions.fill_missing_gradients`); a rank
      without one contributes zeros, so every rank keeps, clips, decays and updates the
      same variables, as one process would on the global batch. (Eagerly this costs one
      small all-reduce per step; in a ``tf.function`` it runs once, while tracing: the
      None pattern is fixed then.)
    * ``_all_reduce_sum_gradients`` names the group by the variables' positions in the
      optimizer's FULL variable list.

    [Note: gradient accumulation under the strategy]
    With ``gradient_accumulation_steps=k`` Keras reduces (and clips) the gradients inside
    ``ops.cond(is_update_step, ...)``. The If op that runs the branch depends on no collective
    before it, nor any collective after it on it, so TensorFlow may run it before the loss
    metric's collective on one rank and after it on another: each rank waits on a different
    collective, for ever (3 runs of 4 at ``TF_NUM_INTEROP_THREADS=1``, before 2026-12-07; found by
    an audit). So such an optimizer sums every step's gradients over the ranks in ``apply``,
    before Keras's, outside any branch and in program order like every other collective; Keras
    then accumulates the global gradients and its own reduction and clipping sum nothing again.
    The sum is linear, so the update is one process's with the same ``k``; the price is one
    all-reduce per step instead of one per k steps.
    """
    import keras
    from keras.src import backend as keras_backend
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    from unison.tf_backend.functions import fill_missing_gradients

    apply = keras.optimizers.Optimizer.apply
    all_reduce = TFOptimizer._all_reduce_sum_gradients
    clip = BaseOptimizer._clip_gradients

    def agreeing_apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        self.__dict__.pop("_unison_summed", None)  # (a flag an interrupted apply might have left)
        if _unison_optimizer(self) and len(grads):
            if trainable_variables is not None:
                trainable_variables = list(trainable_variables)
            if not self.built and trainable_variables is not None:
                with keras_backend.name_scope(self.name, caller=self):  # as Keras's apply builds it
                    self.build(trainable_variables)
                self.built = True
            variables = (trainable_variables if trainable_variables is not None
                         else getattr(self, "_trainable_variables", []))
            if len(variables) == len(grads):  # otherwise Keras raises its own error
                grads = fill_missing_gradients(list(grads), variables, f"unison.grads.{_optimizer_tag(self)}")
                if (tf.distribute.get_replica_context() is not None
                        and not isinstance(self, keras.optimizers.LossScaleOptimizer)):  # its inner one does it
                    # [Note: float8 scales over the ranks]
                    grads = overwritten_by_max(grads, variables, f"unison.overwrite.{_optimizer_tag(self)}")
                if (self.gradient_accumulation_steps and tf.distribute.get_replica_context() is not None
                        and not getattr(self, "_unison_zero_sharded", False)):
                    grads = sum_by_variable(self, list(grads), variables)
                    self.__dict__["_unison_presummed"] = True
        try:
            return apply(self, grads, trainable_variables)
        finally:
            self.__dict__.pop("_unison_presummed", None)
            self.__dict__.pop("_unison_summed", None)

    def sum_by_variable(self: Any, grads: list[Any], variables: Sequence[Any]) -> list[Any]:
        """``grads`` summed over the ranks, in one group named by their variables' positions.

        The variables Keras overwrites with their gradient (``overwrite_with_gradient``: float8
        scales) keep theirs, as Keras's own reduction leaves them (it never sees them).
        """
        present = [i for i, (g, v) in enumerate(zip(grads, variables, strict=True))
                   if g is not None and not getattr(v, "overwrite_with_gradient", False)]
        positions = ",".join(str(self._get_variable_index(variables[i])) for i in present)
        base = f"unison.grads.{_optimizer_tag(self)}.{zlib.crc32(positions.encode()):08x}"
        # dense gradients summed, IndexedSlices gathered: [Note: sparse gradients under the strategy]
        reduced = sum_gradients([grads[i] for i in present], base,
                                overlap=self._distribution_strategy.extended._overlap)
        for i, r in zip(present, reduced, strict=True):
            grads[i] = r
        return grads

    def reducing_clip(self: Any, grads: Any) -> Any:
        # [Note: clipping the global gradient] Keras clips in apply, before _all_reduce_sum_gradients:
        # each rank would clip its share of the gradient (clipvalue letting N x the value through,
        # clipnorm/global_clipnorm measuring a share's norm). One process clips the global batch's
        # gradient, so a clipping optimizer sums first and the later all-reduce passes them through.
        if (_unison_optimizer(self) and not getattr(self, "_unison_zero_sharded", False)
                and not self.__dict__.get("_unison_presummed", False)
                and (self.clipnorm or self.global_clipnorm or self.clipvalue)
                and tf.distribute.get_replica_context() is not None):
            grads = list(grads)
            present = [i for i, g in enumerate(grads) if g is not None]
            reduced = sum_gradients([grads[i] for i in present], f"unison.clipgrads.{_optimizer_tag(self)}",
                                    overlap=self._distribution_strategy.extended._overlap)
            for i, r in zip(present, reduced, strict=True):
                grads[i] = r
            self.__dict__["_unison_summed"] = True
        return clip(self, grads)

    def all_reduce_by_variable(self: Any, grads_and_vars: Any) -> Any:
        pairs = list(grads_and_vars)
        if self.__dict__.pop("_unison_summed", False):  # summed before clipping (see reducing_clip)
            return pairs
        if self.__dict__.get("_unison_presummed", False):  # summed before accumulating (agreeing_apply)
            return pairs
        if not _unison_optimizer(self) or tf.distribute.get_replica_context() is None:
            return all_reduce(self, pairs)
        grads = sum_by_variable(self, [g for g, _ in pairs], [v for _, v in pairs])
        return list(zip(grads, [v for _, v in pairs], strict=True))

    agreeing_apply.__doc__ = apply.__doc__
    keras.optimizers.Optimizer.apply = agreeing_apply
    TFOptimizer._all_reduce_sum_gradients = all_reduce_by_variable
    BaseOptimizer._clip_gradients = reducing_clip


def _guard_checkpoints() -> None:
    """A ``tf.train.Checkpoint`` of the strategy's state writes from rank 0 only; any other on every rank.

    [Note: replicated checkpoints]
    ``save``, ``write`` and ``CheckpointManager.save`` all end in
    ``Checkpoint._write``, which also runs the bookkeeping callbacks (the
    ``checkpoint`` state file, the manager's deletion of old checkpoints). A
    checkpoint is *replicated* when something it tracks was created under a
    UnisonStrategy (a model, or a variable made in ``strategy.scope()``, such as
    the optimizer's): every rank holds the same values, so on ranks other than 0
    of a multi-process job ``_write`` returns the path it would have written and
    touches no file, and ranks sharing a folder never race. Any other checkpoint
    (a user's per-rank state, made outside the strategy's scope) writes on every
    rank, as without the strategy. Per-rank state tracked by a replicated
    checkpoint is saved from rank 0 only: keep it in a checkpoint of its own.
    (Asynchronous checkpointing, ``experimental_enable_async_checkpoint``, is not
    covered.)
    """
    original = tf.train.Checkpoint._write

    def _write(self: Any, file_prefix: Any, options: Any = None) -> Any:
        if runtime.size() > 1 and runtime.rank() != 0 and _replicated(self):
            if isinstance(file_prefix, tf.Tensor):
                file_prefix = file_prefix.numpy()
            return file_prefix.decode() if isinstance(file_prefix, bytes) else os.fspath(file_prefix)
        return original(self, file_prefix, options=options)

    _write.__doc__ = original.__doc__
    tf.train.Checkpoint._write = _write


def _replicated(checkpoint: Any) -> bool:
    """Whether ``checkpoint`` tracks anything created under a UnisonStrategy (see [Note: replicated checkpoints]).

    Keras models and TensorFlow variables record the strategy they were created
    under in ``_distribute_strategy``; a Keras variable keeps its TensorFlow
    variable in ``_value``.
    """
    for obj in tf.train.TrackableView(checkpoint).descendants():
        for candidate in (obj, getattr(obj, "_value", None)):
            if isinstance(getattr(candidate, "_distribute_strategy", None), UnisonStrategy):
                return True
    return False
