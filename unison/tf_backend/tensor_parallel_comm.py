"""The four communication operators of Megatron-style tensor parallelism, as TensorFlow custom gradients.

The same operators as the PyTorch backend's ``tensor_parallel_comm.py`` (see its docstring and
[Note: why g's backward is the identity]), over the ranks of the tensor group (a process set)::

    operator              forward                              backward
    copy_to_group   (f)   identity                             all-reduce (sum) of the gradient
    reduce_from_group (g) all-reduce (sum)                     identity
    gather_from_group     all-gather along the last dim        this shard's slice of the gradient
    scatter_to_group      this shard's slice of the last dim   all-gather of the gradient

and the three sequence-parallel operators over dimension 1 of ``(batch, seq, hidden)``
(``scatter_to_sequence``, ``gather_from_sequence``, ``reduce_scatter_to_sequence``; see the
PyTorch module's docstring).

Each is a ``tf.custom_gradient`` around Unison's TensorFlow collectives restricted to the group
(``allreduce`` / ``allgather`` with ``process_set=``), so they work eagerly, under
``tf.GradientTape`` and inside ``tf.function``. The collectives' own gradients (Horovod's: an
average over ranks) are replaced by the conjugates above. On a group of one rank every operator
is the identity and nothing is sent.

The calls are named from a counter per process set, eagerly and inside ``tf.function`` alike
(see [Note: tensor-parallel names come from the set's counter] below). The ranks of a group must
run (and trace) the same layers in the same order.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from unison.common.engine.process_sets import ProcessSet, set_rank, set_size
from unison.common.ops import Max, Sum
from unison.common.tensor_parallel.groups import call_site, input_sample, start_input_agreement
from unison.common.tensor_parallel.sequence import check_gathered_sequence, sequence_problem
from unison.tf_backend import host_ops
from unison.tf_backend.gather_ops import allgather
from unison.tf_backend.mpi_ops import allreduce, reducescatter
from unison.tf_backend.op_base import _name, dense_gradient

__all__ = ["copy_to_group", "reduce_from_group", "gather_from_group", "scatter_to_group",
           "allreduce_max_no_grad", "scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence",
           "input_check", "agree_on_input_once"]


def _named(kind: str, group: ProcessSet) -> dict[str, Any]:
    """The name arguments of a call: the next name of ``group``'s counter, without the name scope.

    [Note: tensor-parallel names come from the set's counter] Inside ``tf.function`` Unison's ops
    are named after their input tensors and name scopes by default, and those carry Keras's
    per-process layer names (``column_parallel_linear_7/...``), which differ between ranks that
    built different layers before (a rank idle at tp = 3 builds none): their calls would never
    match. The per-set counter (frontend [Note: a counter per process set]) counts only the calls
    the group's ranks make together, so it agrees at trace time too.
    """
    return {"name": _name(kind, None, group), "ignore_name_scope": True, "process_set": group}


def _sum(tensor: tf.Tensor, group: ProcessSet) -> tf.Tensor:
    return tensor if set_size(group) == 1 else allreduce(tensor, op=Sum, **_named("allreduce", group))


def _gather_last(tensor: tf.Tensor, group: ProcessSet) -> tf.Tensor:
    """Every shard's ``tensor`` concatenated along the last dimension, in shard order."""
    parts = set_size(group)
    if parts == 1:
        return tensor
    rank = tensor.shape.rank
    stacked = allgather(tf.expand_dims(tensor, 0), **_named("allgather", group))  # (parts, ..., piece)
    moved = tf.transpose(stacked, [*range(1, rank), 0, rank])  # (..., parts, piece)
    shape = tf.shape(tensor)
    out = tf.reshape(moved, tf.concat([shape[:-1], [parts * shape[-1]]], 0))
    width = tensor.shape[-1]
    out.set_shape(tensor.shape[:-1].concatenate([None if width is None else parts * width]))
    return out


def _my_slice(tensor: tf.Tensor, group: ProcessSet) -> tf.Tensor:
    """This shard's equal piece of ``tensor``'s last dimension."""
    parts = set_size(group)
    if parts == 1:
        return tensor
    width = tensor.shape[-1]
    if width is None:
        raise ValueError("scatter_to_group needs a statically known last dimension; received shape "
                         f"{tensor.shape}. Give the input a fixed feature size")
    if width % parts:
        raise ValueError(f"scatter_to_group: the last dimension ({width}) is not divisible by the tensor group "
                         f"size ({parts}); pad it to a multiple of {parts}")
    piece = width // parts
    start = set_rank(group) * piece
    return tensor[..., start:start + piece]


def copy_to_group(tensor: Any, group: ProcessSet) -> tf.Tensor:
    """``f``: identity forward, gradient summed over ``group`` backward (enter a parallel region)."""
    @dense_gradient
    def f(x: tf.Tensor) -> Any:
        return tf.identity(x), lambda dy: _sum(dy, group)

    return f(tf.convert_to_tensor(tensor))


def reduce_from_group(tensor: Any, group: ProcessSet) -> tf.Tensor:
    """``g``: sum over ``group`` forward, identity backward (leave a parallel region)."""
    @dense_gradient
    def g(x: tf.Tensor) -> Any:
        return tf.identity(_sum(x, group)), tf.identity

    return g(tf.convert_to_tensor(tensor))


def gather_from_group(tensor: Any, group: ProcessSet) -> tf.Tensor:
    """Concatenate the shards' last dimensions forward; keep this shard's slice of the gradient backward."""
    @dense_gradient
    def gather(x: tf.Tensor) -> Any:
        return tf.identity(_gather_last(x, group)), lambda dy: _my_slice(dy, group)

    return gather(tf.convert_to_tensor(tensor))


def scatter_to_group(tensor: Any, group: ProcessSet) -> tf.Tensor:
    """Keep this shard's slice of the last dimension forward; all-gather the gradient backward."""
    @dense_gradient
    def scatter(x: tf.Tensor) -> Any:
        return tf.identity(_my_slice(x, group)), lambda dy: _gather_last(dy, group)

    return scatter(tf.convert_to_tensor(tensor))


def allreduce_max_no_grad(tensor: Any, group: ProcessSet) -> tf.Tensor:
    """The element-wise maximum over ``group`` of a tensor that carries no gradient."""
    x = tf.stop_gradient(tf.convert_to_tensor(tensor))
    return x if set_size(group) == 1 else tf.stop_gradient(allreduce(x, op=Max, **_named("allreduce", group)))


# ----------------------------------------------------------------- one input per tensor group

#: the states of a layer's input check: not started, its all-gather sent (graph), agreed
_UNCHECKED, _SENT, _AGREED = 0, 1, 2


def input_check(layer: Any, process_set: ProcessSet) -> None:
    """Give ``layer`` the state :func:`agree_on_input_once` keeps: an int32 variable that Keras does not track
    (not a weight, not saved), made only where the group has more than one rank."""
    if set_size(process_set) > 1:
        # a plain resource variable on the CPU, made outside any tf.distribute strategy's variable creators (a
        # mirrored one refuses assign() in a replica context) and read on the host (no device copy per step)
        with tf.init_scope(), tf.device("/CPU:0"):
            layer.__dict__["_unison_input_agreed"] = resource_variable_ops.ResourceVariable(
                _UNCHECKED, dtype=tf.int32, trainable=False, name="unison_input_agreed")
        layer.__dict__["_unison_input_sent"] = []  # the sent all-gather: (handle, judge)


def agree_on_input_once(layer: Any, inputs: Any, owner: str, process_set: ProcessSet) -> tf.Tensor:
    """``inputs`` as a tensor, after checking once that every rank of the group was given the same one ([Note:
    one input per tensor group] in ``unison/common/tensor_parallel/groups.py``): a ``MismatchError`` on every
    rank of the group otherwise (inside a graph TensorFlow's ``FailedPreconditionError``).

    [Note: the Keras layers check their input in two runs inside a graph] A Keras step is traced once and run
    many times, and a trace has no values, so the check is part of the graph: a ``tf.cond`` on the layer's
    state runs a host callback while the check is not done, and later runs only read the state. The first
    run's callback sends the input's sample (an all-gather, named when the layer was traced, from the
    group's counter as the layer's other collectives are) and returns without waiting; the second run's
    waits for it, by then sent by every rank in its first run, and judges it. Waiting in the first run was
    a deadlock: the checks of layers fed one input (query, key and value projections) are branches of the
    graph that TensorFlow runs in any order, and a callback waiting for its collective holds a thread that
    another rank's check needs (rank 0 waited in one check while rank 1 waited in another: found by a
    review, 2026-12-06). So inside a graph the mismatch is raised at the second run (the first step has
    trained on the mixed inputs by then); eagerly at the first call.
    """
    x = tf.convert_to_tensor(inputs)
    state = layer.__dict__.get("_unison_input_agreed")
    if state is None or (tf.executing_eagerly() and int(state.numpy()) == _AGREED):  # (a group of one, or done)
        return x
    name = _name("agree_on_input", None, process_set)
    dtype, sent = x.dtype.name, layer.__dict__["_unison_input_sent"]

    def advance(values: np.ndarray, now: Any, in_graph: bool = True) -> np.ndarray:
        try:
            if int(np.asarray(now).reshape(-1)[0]) == _UNCHECKED:
                if not sent:  # (another call of this layer in the same run sent it already)
                    sent.append(start_input_agreement(owner, process_set, values.shape, dtype,
                                                      input_sample(values), name))
                return np.array([_SENT], np.int32)
            if sent:
                handle, judge = sent.pop()
                judge(handle.wait())
            return np.array([_AGREED], np.int32)
        except Exception as exc:  # noqa: BLE001 - reported as TensorFlow reports a collective's errors
            if not in_graph:
                raise
            raise host_ops._GraphOpError(host_ops.to_tf_error(exc)) from exc  # noqa: SLF001

    if tf.executing_eagerly():
        values = x.numpy()
        advance(values, advance(values, [_UNCHECKED], in_graph=False), in_graph=False)  # (sent, then judged)
        state.assign(_AGREED)
        return x

    def check() -> tf.Tensor:
        now = state.read_value()
        after = tf.reshape(tf.numpy_function(advance, [x, now], tf.int32, stateful=True,
                                             name="unison_agree_on_input"), [])
        with tf.control_dependencies([state.assign(after, read_value=False)]):
            return tf.identity(after)

    ran = tf.cond(state.read_value() < _AGREED, check, lambda: tf.constant(_AGREED, tf.int32))
    with tf.control_dependencies([ran]):
        return tf.identity(x)


#: per tensor group, the holder of each call site of :func:`scatter_to_sequence` that checks its input
_SITES: weakref.WeakKeyDictionary[ProcessSet, dict[tuple, SimpleNamespace]] = weakref.WeakKeyDictionary()


def _call_site_holder(group: ProcessSet) -> SimpleNamespace:
    """The holder (with :func:`input_check`'s state) of the code that called this function's caller. Inside
    ``tf.function`` that is the traced (AutoGraph-converted) code, past AutoGraph's own frames."""
    sites = _SITES.setdefault(group, {})
    site = call_site(2, skip=("tensorflow.",))
    if site not in sites:
        sites[site] = SimpleNamespace()
        input_check(sites[site], group)
    return sites[site]


# ----------------------------------------------------------------- sequence parallelism

def check_sequence(tensor: tf.Tensor, group: ProcessSet, what: str, whole: bool) -> None:
    """Raise unless ``tensor`` is ``(batch, seq, ...)`` with a static sequence the group divides (``whole``)."""
    shape = None if tensor.shape.rank is None else tuple(tensor.shape)
    problem = sequence_problem(shape, set_size(group), what, whole)
    if problem:
        raise ValueError(problem)


def _to_front(tensor: tf.Tensor) -> tf.Tensor:
    rank = tensor.shape.rank
    return tf.transpose(tensor, [1, 0, *range(2, rank)])


def _with_seq(out: tf.Tensor, given: tf.Tensor, times: int, divide: int) -> tf.Tensor:
    """``out`` with ``given``'s static shape, its sequence length times ``times`` over ``divide``
    (the collectives' dimension 0 is unknown at trace time)."""
    seq = given.shape[1]
    out.set_shape(given.shape[:1].concatenate([None if seq is None else seq * times // divide])
                  .concatenate(given.shape[2:]))
    return out


def _gather_seq(tensor: tf.Tensor, group: ProcessSet, check: bool = False) -> tf.Tensor:
    """Every shard's positions concatenated along the sequence, in shard order; with ``check``, raise
    when the ranks held different numbers of positions (see ``check_gathered_sequence``)."""
    parts = set_size(group)
    if parts == 1:
        return tensor
    out = _to_front(allgather(_to_front(tensor), **_named("allgather", group)))
    if check and tf.executing_eagerly():
        check_gathered_sequence(int(out.shape[1]), int(tensor.shape[1]), parts, "gather_from_sequence")
    elif check:  # traced: the gathered length is known only when the step runs
        ok = tf.debugging.assert_equal(
            tf.shape(out)[1], tf.shape(tensor)[1] * parts,
            message=f"gather_from_sequence: the {parts} ranks of the tensor group hold different numbers of "
                    "sequence positions; every rank of the group must hold the same number")
        with tf.control_dependencies([ok]):
            out = tf.identity(out)
    return _with_seq(out, tensor, parts, 1)


def _seq_slice(tensor: tf.Tensor, group: ProcessSet) -> tf.Tensor:
    """This shard's equal piece of the sequence."""
    parts = set_size(group)
    if parts == 1:
        return tensor
    piece = tensor.shape[1] // parts
    start = set_rank(group) * piece
    return tensor[:, start:start + piece]


def _reduce_scatter_seq(tensor: tf.Tensor, group: ProcessSet) -> tf.Tensor:
    """The sum over the group, this shard's positions of it."""
    parts = set_size(group)
    if parts == 1:
        return tensor
    out = _to_front(reducescatter(_to_front(tensor), op=Sum, **_named("reducescatter", group)))
    return _with_seq(out, tensor, 1, parts)


def scatter_to_sequence(tensor: Any, group: ProcessSet) -> tf.Tensor:
    """This shard's ``seq / tp`` positions of a replicated ``(batch, seq, ...)`` tensor; backward all-gathers.

    The replicated tensor is compared over the group, whole, at the first call of each call site (the
    PyTorch module's [Note: a sequence split is checked where it starts]; in a graph as the layers check
    theirs, [Note: the Keras layers check their input in two runs inside a graph]).

    Raises:
        ValueError: fewer than 2 dimensions, or a sequence the group does not divide.
        MismatchError: the ranks of the group passed different tensors (eagerly, on every rank of the
            group; inside ``tf.function`` TensorFlow's ``FailedPreconditionError``, at the second run).
    """
    x = tf.convert_to_tensor(tensor)
    check_sequence(x, group, "scatter_to_sequence", whole=True)
    if set_size(group) > 1:
        x = agree_on_input_once(_call_site_holder(group), x, "scatter_to_sequence", group)

    @dense_gradient
    def scatter(t: tf.Tensor) -> Any:
        return tf.identity(_seq_slice(t, group)), lambda dy: _gather_seq(dy, group)

    return scatter(x)


def gather_from_sequence(tensor: Any, group: ProcessSet, to_parallel: bool = True) -> tf.Tensor:
    """All the shards' positions, concatenated along the sequence (dimension 1).

    Args:
        to_parallel: the result feeds a tensor-parallel layer (backward reduce-scatters the
            partial gradients); False when it feeds computation replicated on every rank
            (backward keeps this shard's positions of the whole gradient).
    """
    x = tf.convert_to_tensor(tensor)
    check_sequence(x, group, "gather_from_sequence", whole=False)

    def back(dy: tf.Tensor) -> tf.Tensor:
        return _reduce_scatter_seq(dy, group) if to_parallel else _seq_slice(dy, group)

    @dense_gradient
    def gather(t: tf.Tensor) -> Any:
        return tf.identity(_gather_seq(t, group, check=True)), back

    return gather(x)


def reduce_scatter_to_sequence(tensor: Any, group: ProcessSet) -> tf.Tensor:
    """The sum over the group of ``(batch, seq, ...)`` partial results, this shard's positions of it.

    A row layer's exit under sequence parallelism; backward all-gathers the gradient.
    """
    x = tf.convert_to_tensor(tensor)
    check_sequence(x, group, "reduce_scatter_to_sequence", whole=True)

    @dense_gradient
    def reduce_scatter(t: tf.Tensor) -> Any:
        return tf.identity(_reduce_scatter_seq(t, group)), lambda dy: _gather_seq(dy, group)

    return reduce_scatter(x)
