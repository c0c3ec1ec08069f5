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

from typing import Any

import tensorflow as tf

from unison.common.engine.process_sets import ProcessSet, set_rank, set_size
from unison.common.ops import Max, Sum
from unison.common.tensor_parallel.sequence import check_gathered_sequence, sequence_problem
from unison.tf_backend.gather_ops import allgather
from unison.tf_backend.mpi_ops import allreduce, reducescatter
from unison.tf_backend.op_base import _name, dense_gradient

__all__ = ["copy_to_group", "reduce_from_group", "gather_from_group", "scatter_to_group",
           "allreduce_max_no_grad", "scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence"]


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

    Raises:
        ValueError: fewer than 2 dimensions, or a sequence the group does not divide.
    """
    x = tf.convert_to_tensor(tensor)
    check_sequence(x, group, "scatter_to_sequence", whole=True)

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
