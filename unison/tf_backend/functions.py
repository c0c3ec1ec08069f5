"""Broadcasting variables and ``DistributedGradientTape``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from unison.common.compression import Compression
from unison.common.engine.process_sets import ProcessSet
from unison.common.ops import Average, parse_op
from unison.tf_backend.mpi_ops import _name, broadcast, grouped_allreduce

__all__ = ["broadcast_variables", "DistributedGradientTape"]


def broadcast_variables(variables: Iterable[tf.Variable], root_rank: int,
                        process_set: ProcessSet | None = None) -> None:
    """Assign ``root_rank``'s values to every rank's variables (eager or in a ``tf.function``)."""
    for i, var in enumerate(variables):
        var.assign(broadcast(var, root_rank, name=f"broadcast_variables.{i}.{var.name}",
                             process_set=process_set))


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients averaged over the ranks.

    All of a step's gradients are reduced in one grouped call (one host callback,
    one fused engine group), so op ordering can never deadlock ranks.
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 process_set: ProcessSet | None = None) -> None:
        self._tape = gradtape
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = parse_op(op)
        if gradient_predivide_factor != 1.0 and self._op != Average:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} only applies to "
                             f"op=Average; got op={self._op!r}")
        self._pre = 1.0 / gradient_predivide_factor
        self._post = gradient_predivide_factor
        self._process_set = process_set
        self._name = _name("DistributedGradientTape", None)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._tape, item)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, **kwargs: Any) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        reduced = reduce_gradients(flat, self._op, self._pre, self._post, self._compression,
                                   self._sparse_as_dense, self._name, self._process_set)
        return tf.nest.pack_sequence_as(grads, reduced)


def reduce_gradients(grads: list[Any], op: Any, pre: float, post: float, compression: Any,
                     sparse_as_dense: bool, name: str, process_set: ProcessSet | None) -> list[Any]:
    """Reduce a step's gradients in one grouped call; None stays None, IndexedSlices are handled."""
    from unison.tf_backend.mpi_ops import allreduce

    out: list[Any] = list(grads)
    dense_idx, dense = [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                g = tf.convert_to_tensor(g)
            else:
                out[i] = allreduce(g, op=op, prescale_factor=pre, postscale_factor=post,
                                   name=f"{name}.sparse.{i}", process_set=process_set)
                continue
        dense_idx.append(i)
        dense.append(g)
    if dense:
        for i, r in zip(dense_idx, grouped_allreduce(dense, op=op, prescale_factor=pre,
                                                    postscale_factor=post, name=name,
                                                    compression=compression,
                                                    process_set=process_set), strict=True):
            out[i] = r
    return out
