"""Broadcasting variables and ``DistributedGradientTape``.

[Note: gradients that are None on some ranks]
A data-dependent branch can leave a variable without a gradient on one rank
while another rank has one. Every reduction is therefore named by the
variable's position in the FULL list of gradients (never by its position among
the non-None ones), and before reducing, the ranks agree on what each variable
has: nothing anywhere (it stays None on every rank), a dense gradient somewhere
(ranks without one contribute zeros), or only ``IndexedSlices`` (ranks without
one contribute empty slices). Every rank thus ends with the gradient one
process would compute for the mean (or sum) of all ranks' losses. This differs
from Horovod's TensorFlow API, which reduces only the non-None gradients (a
mismatch there hangs or pairs the wrong tensors); it matches Horovod's PyTorch
optimizer, which reduces zeros for parameters without a gradient.

The agreement is one small all-reduce of per-variable flags. Eagerly it runs on
every call. Inside a ``tf.function`` the None pattern is fixed when the function
is traced, so it runs while tracing and is remembered per (traced function,
name, variables, local pattern): a rank that retraces for another reason (a new
batch shape) does not exchange again. The traced function is part of the key
since 2026-12-05: before, the first tape of every function had the same name,
so a second function could find the first one's entry on the ranks whose local
pattern matched it and skip the exchange the others waited in (a hang). A
function whose pattern changes between its traces on some ranks only (a Python
argument read on one rank) still finds its old entry on the others: the
exchange can run only while tracing, when a rank cannot know what the others
trace, so keep each rank's None pattern a function of what every rank traces.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from unison.common.compression import Compression
from unison.common.engine import frontend, objects
from unison.common.engine.process_sets import ProcessSet, global_process_set, set_size
from unison.common.ops import Average, ReduceOp, Sum, parse_op
from unison.tf_backend import host_ops
from unison.tf_backend.mpi_ops import _name, allgather, broadcast, size_now
from unison.tf_backend.op_base import call_name, dense_gradient, traced_function_path

__all__ = ["broadcast_variables", "DistributedGradientTape", "PartialDistributedGradientTape", "reduce_gradients",
           "reduce_partial", "fill_missing_gradients", "check_groups", "local_layer_variables", "source_key"]

#: per-variable kinds exchanged before a reduction
_NONE, _DENSE, _SPARSE = 0, 1, 2
#: agreed kinds of traced (graph-mode) reductions, by (traced function, name, variables, this rank's kinds)
_agreed_in_graphs: dict[tuple[Any, ...], tuple[int, ...]] = {}


def broadcast_variables(variables: Iterable[tf.Variable], root_rank: int,
                        process_set: ProcessSet | None = None) -> Any:
    """Assign ``root_rank``'s values to every rank's variables.

    Eagerly and in a ``tf.function`` the assignments run as they are made (None is returned,
    as Horovod does eagerly); in a TF1 graph nothing runs until the session runs it, so the
    assignments come back as one op to run, as Horovod's.

    A sharded optimizer's shards and their slots (``zero_stage`` 1/2: each rank's own segment)
    are left out ([Note: a sharded optimizer's state is not broadcast] in
    ``unison/tf_backend/zero_optimizer.py``).
    """
    variables = without_rank_local(variables)
    if tf.executing_eagerly():  # (one named broadcast per variable: one more on a rank waited for ever there)
        objects.agree_on_names("broadcast_variables", [f"{i}.{v.name}" for i, v in enumerate(variables)],
                               process_set=None if process_set is global_process_set else process_set)
    with host_ops.isolated():  # a TF1 training step's collectives do not run these (host_ops' Note)
        assigns = [var.assign(broadcast(var, root_rank, name=f"broadcast_variables.{i}.{var.name}",
                                        process_set=process_set))
                   for i, var in enumerate(variables)]
    if tf.executing_eagerly() or tf.inside_function():
        return None
    return tf.group(*assigns, name="broadcast_variables")


def without_rank_local(variables: Iterable[Any]) -> list[Any]:
    """``variables`` less the live sharded optimizers' per-rank shards and slots, which a broadcast
    must not overwrite ([Note: a sharded optimizer's state is not broadcast] in ``zero_optimizer.py``)."""
    variables = list(variables)
    sharded = sys.modules.get("unison.tf_backend.zero_optimizer")  # (none before it is imported)
    own = sharded.rank_local_keys() if sharded is not None else set()
    return [v for v in variables if source_key(v) not in own] if own else variables


def source_key(source: Any) -> Any:
    """A hashable key of a variable (Keras or TensorFlow) or watched tensor: the same object, the same key."""
    inner = getattr(source, "value", None)
    if isinstance(inner, tf.Variable):  # a Keras variable keeps its TensorFlow variable in ``value``
        source = inner
    return source.ref() if hasattr(source, "ref") else id(source)


def check_groups(num_groups: int, groups: Any) -> Any:
    """Horovod's checks of ``num_groups`` (deprecated) and ``groups``; the groups to use.

    ``groups`` only decides how Horovod fuses its allreduces; here every dense
    gradient of a step goes to the engine in one grouped call whatever it says, so
    the numbers are the same. It is validated as Horovod does.

    Raises:
        ValueError: ``groups`` is neither a positive integer nor a list of lists of variables.
    """
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, list):
        for group in groups:
            if not isinstance(group, (list, tuple)) or not all(_is_variable(v) for v in group):
                raise ValueError(f"groups must be a positive integer or a list of lists of variables; got the "
                                 f"group {group!r}")
        return groups
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise ValueError(f"groups should be a non-negative integer or a list of list of tf.Variable; got "
                         f"{groups!r}")
    return groups


def _is_variable(v: Any) -> bool:
    return isinstance(v, tf.Variable) or isinstance(getattr(v, "value", None), tf.Variable)


def local_layer_variables(local_layers: Any) -> list[Any]:
    """The trainable variables of ``local_layers`` (None, one Keras layer, or a collection of them).

    Raises:
        ValueError: an entry is not a Keras layer (Horovod's error).
    """
    import keras

    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    layers = list(local_layers)
    bad = [layer for layer in layers if not isinstance(layer, keras.layers.Layer)]
    if bad:
        raise ValueError(f"All local layers must be of tf.keras.layers.Layer type; got {bad!r}")
    return [v for layer in layers for v in layer.trainable_weights]


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients averaged over the ranks.

    All of a step's dense gradients are reduced in one host callback (one fused
    engine group), so op ordering can never deadlock ranks. A gradient that is
    None on some ranks only is reduced with zeros from those ranks; see
    [Note: gradients that are None on some ranks]. Sources registered with
    :meth:`register_local_source` keep their local gradient (divided by the
    process set's size when ``scale_local_gradients``), as Horovod's.

    ``device_dense`` and ``device_sparse`` are accepted for Horovod's signature and
    ignored (CPU tensors); ``groups`` is validated and does not change the numbers
    (see :func:`check_groups`).
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 process_set: ProcessSet | None = None, scale_local_gradients: bool = True) -> None:
        self._tape = gradtape
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = parse_op(op)
        if gradient_predivide_factor != 1.0 and self._op != Average:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} only applies to "
                             f"op=Average; got op={self._op!r}")
        self._groups = check_groups(num_groups, groups)
        self._pre = 1.0 / gradient_predivide_factor
        self._post = gradient_predivide_factor
        self._process_set = process_set
        self._scale_local = bool(scale_local_gradients)
        self._local_sources: set[Any] = set()
        # eager tapes take the next unnamed-call name; one built while tracing takes none, so that a rank that
        # retraces alone does not move its counter ahead of the others' (see call_name)
        # (the set's own counter: [Note: a counter per process set]; a tape of a subset's ranks left the other
        # ranks' next tape a number behind, its reductions under another name: a hang, before 2026-12-07)
        self._name = _name("DistributedGradientTape", None, process_set) if tf.executing_eagerly() else None

    def __getattr__(self, item: str) -> Any:
        return getattr(self._tape, item)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local: never reduced over the ranks (scaled, see the class)."""
        self._local_sources.add(source_key(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False,
                 **kwargs: Any) -> Any:
        """``tf.GradientTape.gradient``, averaged over the ranks. ``use_generic_names``: Horovod's (it names
        its ops after the variables unless set); accepted, and no difference here: reductions are named by
        position (before 2026-12-07 it was passed on to TensorFlow, which refused it)."""
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        variables = tf.nest.flatten(sources)
        if tf.executing_eagerly():
            self._name = self._name or _name("DistributedGradientTape", None, self._process_set)
            name = self._name
        else:
            name = call_name("DistributedGradientTape")
        reduced = reduce_partial(flat, variables, self._local_sources, self._scale_local, self._op, self._pre,
                                 self._post, self._compression, self._sparse_as_dense, name,
                                 self._process_set)
        return tf.nest.pack_sequence_as(grads, reduced)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",  # noqa: N802
                                   device_sparse: str = "", compression: Any = Compression.none,
                                   sparse_as_dense: bool = False, op: Any = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None, process_set: ProcessSet | None = None,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> DistributedGradientTape:
    """A :class:`DistributedGradientTape` whose ``local_layers``' variables keep their local gradients.

    Without ``local_layers`` it is a plain ``DistributedGradientTape``.

    Raises:
        ValueError: an entry of ``local_layers`` is not a Keras layer.
    """
    local = local_layer_variables(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    for var in local:
        tape.register_local_source(var)
    return tape


def reduce_partial(grads: list[Any], variables: Sequence[Any], local: set[Any], scale_local: bool, op: Any,
                   pre: float, post: float, compression: Any, sparse_as_dense: bool, name: str,
                   process_set: ProcessSet | None, local_factor: float = 1.0) -> list[Any]:
    """:func:`reduce_gradients`, except for the variables whose :func:`source_key` is in ``local``.

    Those keep this rank's gradient, divided by the process set's size when
    ``scale_local`` (Horovod's scaling: the others are averaged over the set), and
    multiplied by ``local_factor``. They are left out of the reduction as a None
    (so the others keep their positions, and names, in the full list).
    """
    if not local:
        return reduce_gradients(grads, op, pre, post, compression, sparse_as_dense, name, process_set, variables)
    is_local = [source_key(v) in local for v in variables]
    masked = [None if loc else g for g, loc in zip(grads, is_local, strict=True)]
    out = reduce_gradients(masked, op, pre, post, compression, sparse_as_dense, name, process_set, variables)
    for i, loc in enumerate(is_local):
        if loc and grads[i] is not None:  # (the size read when it runs: see size_now)
            factor = local_factor / size_now(process_set, _dtype_of(grads[i])) if scale_local else local_factor
            out[i] = _scaled(grads[i], factor)
    return out


def _dtype_of(g: Any) -> Any:
    return g.values.dtype if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g).dtype


def _scaled(g: Any, factor: Any) -> Any:
    if g is None or (isinstance(factor, float) and factor == 1.0):
        return g
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape)
    g = tf.convert_to_tensor(g)
    return g * tf.cast(factor, g.dtype)


def reduce_gradients(grads: list[Any], op: Any, pre: float, post: float, compression: Any,
                     sparse_as_dense: bool, name: str, process_set: ProcessSet | None,
                     variables: Sequence[Any] | None = None) -> list[Any]:
    """Reduce a step's gradients over the ranks; see [Note: gradients that are None on some ranks].

    Args:
        grads: one entry per variable: a tensor, ``tf.IndexedSlices`` or None.
        op, pre, post, compression, process_set: as for ``grouped_allreduce``.
        sparse_as_dense: reduce ``IndexedSlices`` densely.
        name: base of the engine names; variable ``i`` is reduced as ``f"{name}.{i}"``.
        variables: the variables (or sources) ``grads`` belong to, in the same order: they give
            the shape and dtype of the zeros a rank without a gradient contributes.

    Returns:
        The reduced gradients, in order; None only where no rank has a gradient.

    Raises:
        ValueError: ``variables`` does not match ``grads`` in length.
    """
    if variables is not None and len(variables) != len(grads):
        raise ValueError(f"reduce_gradients got {len(grads)} gradients but {len(variables)} variables; "
                         "pass one variable per gradient, in the same order")
    if process_set is not None and not process_set.included():
        # Horovod's reduction is the identity on a rank outside the set (its _allreduce_cond): the rank keeps
        # its own gradients (before 2026-12-07 it raised, and the set's ranks waited for it in their step)
        return list(grads)
    grads = [tf.convert_to_tensor(g) if sparse_as_dense and isinstance(g, tf.IndexedSlices) else g
             for g in grads]
    kinds = _agree_kinds(grads, name, process_set, variables)
    out: list[Any] = [None] * len(grads)
    dense_idx = [i for i, k in enumerate(kinds) if k == _DENSE]
    for i, k in enumerate(kinds):
        if k == _SPARSE:
            g = grads[i] if grads[i] is not None else _empty_slices(_variable(variables, i, name))
            out[i] = _reduce_sparse(g, op, pre * post, f"{name}.sparse.{i}", process_set)
    if dense_idx:
        dense = [_dense(grads[i], variables, i, name) for i in dense_idx]
        reduced = _grouped_by_name(dense, f"{name}.dense", parse_op(op), pre, post, compression, process_set)
        for i, r in zip(dense_idx, reduced, strict=True):
            out[i] = r
    return out


def fill_missing_gradients(grads: Sequence[Any], variables: Sequence[Any], name: str,
                           process_set: ProcessSet | None = None) -> list[Any]:
    """Give every rank the same set of gradients: zeros where only other ranks have one.

    For a reduction that names gradients by their position among the non-None
    ones (Keras's ``replica_context.all_reduce`` path): afterwards every rank has a
    gradient for exactly the variables that have one on some rank, so the filtered
    lists agree everywhere. See [Note: gradients that are None on some ranks].

    Args:
        grads: one entry per variable: a tensor, ``tf.IndexedSlices`` or None.
        variables: the variables ``grads`` belong to, in the same order.
        name: engine name of the agreement; the same on every rank for the same call site.
        process_set: the ranks that reduce together.

    Returns:
        ``grads`` with dense zeros (or empty ``IndexedSlices``, where every other rank has
        only slices) in place of None where another rank has a gradient.

    Raises:
        ValueError: ``variables`` does not match ``grads`` in length.
    """
    grads = list(grads)
    if len(variables) != len(grads):
        raise ValueError(f"fill_missing_gradients got {len(grads)} gradients but {len(variables)} variables; "
                         "pass one variable per gradient, in the same order")
    kinds = _agree_kinds(grads, name, process_set, variables)
    out = list(grads)
    for i, (g, k) in enumerate(zip(grads, kinds, strict=True)):
        if g is None and k == _DENSE:
            out[i] = _dense(None, variables, i, name)
        elif g is None and k == _SPARSE:
            out[i] = _empty_slices(variables[i])
    return out


def _local_kind(g: Any) -> int:
    if g is None:
        return _NONE
    return _SPARSE if isinstance(g, tf.IndexedSlices) else _DENSE


def _agree_kinds(grads: list[Any], name: str, process_set: ProcessSet | None,
                 variables: Sequence[Any] | None = None) -> tuple[int, ...]:
    """Every rank's view of each variable: None nowhere-else, dense anywhere, or only sparse."""
    local = tuple(_local_kind(g) for g in grads)
    if set_size(process_set) == 1:
        return local
    if tf.executing_eagerly():
        return _exchange_kinds(local, name, process_set)
    # [Note: gradients that are None on some ranks]: ``name`` alone is the same in every function
    # (``DistributedGradientTape``), so the function being traced and the variables are in the key too
    function = traced_function_path(tf.compat.v1.get_default_graph())
    key = (function, name, _variable_keys(variables), local)
    if key not in _agreed_in_graphs:
        _agreed_in_graphs[key] = _exchange_kinds(local, name, process_set)
    return _agreed_in_graphs[key]


def _variable_keys(variables: Sequence[Any] | None) -> tuple[Any, ...]:
    """What tells the variables of one reduction from another's: each TensorFlow variable's unique id
    (a string, unique in the process: the cache holds no variable, where ``source_key``'s ``ref()``
    kept every traced model's variables alive for good), a watched tensor (new at every trace) only
    by its place, so that a retrace still finds the entry."""
    if variables is None:
        return ()
    return tuple(_variable_id(v) if _is_variable(v) else None for v in variables)


def _variable_id(variable: Any) -> Any:
    inner = getattr(variable, "value", None)
    if isinstance(inner, tf.Variable):  # a Keras variable keeps its TensorFlow variable in ``value``
        variable = inner
    unique = getattr(variable, "_unique_id", None)
    return unique if isinstance(unique, str) else source_key(variable)


@tf.autograph.experimental.do_not_convert  # runs while tracing: plain Python, not graph code
def _exchange_kinds(local: tuple[int, ...], name: str, process_set: ProcessSet | None) -> tuple[int, ...]:
    flags = np.zeros((2, len(local)), np.int64)
    for i, k in enumerate(local):
        if k != _NONE:
            flags[0 if k == _DENSE else 1, i] = 1
    counts = frontend.allreduce(flags, Sum, f"{name}.present", process_set=process_set)
    return tuple(_DENSE if counts[0, i] else (_SPARSE if counts[1, i] else _NONE)
                 for i in range(len(local)))


def _variable(variables: Sequence[Any] | None, i: int, name: str) -> Any:
    if variables is None:
        raise ValueError(f"gradient {i} of {name!r} is None on this rank but not on another; pass the "
                         "variables to reduce_gradients so this rank can contribute zeros")
    return variables[i]


def _dense(g: Any, variables: Sequence[Any] | None, i: int, name: str) -> tf.Tensor:
    """This rank's dense contribution for variable ``i``: its gradient, or zeros."""
    if g is None:
        var = _variable(variables, i, name)
        return tf.zeros(var.shape, var.dtype)
    return tf.convert_to_tensor(g)


def _empty_slices(var: Any) -> tf.IndexedSlices:
    shape = tf.TensorShape(var.shape)
    values = tf.zeros([0] + shape[1:].as_list(), var.dtype)
    return tf.IndexedSlices(values, tf.zeros([0], tf.int64), tf.constant(shape.as_list(), tf.int64))


def _reduce_sparse(g: tf.IndexedSlices, op: Any, scale: float, name: str,
                   process_set: ProcessSet | None) -> tf.IndexedSlices:
    """Horovod's reduction of ``IndexedSlices``: gather every rank's rows (and indices, as int64)."""
    if parse_op(op) not in (Sum, Average):
        raise NotImplementedError(f"IndexedSlices gradients reduce with op=Sum or Average only (as Horovod's: "
                                  f"NotImplementedError); got {op!r}. Pass sparse_as_dense=True to reduce them "
                                  "densely")
    values = allgather(g.values, name=f"{name}.values", process_set=process_set)
    indices = allgather(tf.cast(g.indices, tf.int64), name=f"{name}.indices", process_set=process_set)
    if parse_op(op) == Average:
        values = values / size_now(process_set, values.dtype)
    if scale != 1.0:
        values = values * tf.cast(scale, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=g.dense_shape)


def _grouped_by_name(tensors: list[tf.Tensor], name: str, op: ReduceOp, pre: float, post: float,
                     compression: Any, process_set: ProcessSet | None) -> list[tf.Tensor]:
    """All-reduce ``tensors`` as one grouped engine request named ``name``, as one collective op."""
    wires = [compression.compress(t) for t in tensors]
    reduced = _reduce_named([w for w, _ in wires], name, op, pre, post, process_set)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, wires, strict=True)]


def _reduce_named(xs: list[tf.Tensor], name: str, op: ReduceOp, pre: float, post: float,
                  process_set: ProcessSet | None) -> list[tf.Tensor]:
    """One submit/collect pair (see ``host_ops``) for the whole group; differentiable."""

    @dense_gradient
    def reduce(*ts: tf.Tensor) -> Any:
        def submit(arrays: list[np.ndarray]) -> Any:
            return frontend.grouped_allreduce_async([host_ops.to_wire(a, True) for a in arrays], op, name, pre,
                                                    post, process_set)

        ys = host_ops.run_grouped(submit, ts, name)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return _reduce_named(list(dys), name + ".grad", op, pre, post, process_set)

        return list(ys), grad

    return list(reduce(*xs))
