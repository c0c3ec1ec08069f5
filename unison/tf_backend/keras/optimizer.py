"""Horovod-style Keras ``DistributedOptimizer`` for Keras 3 optimizers, with plain ``model.fit``.

The wrapped optimizer is an instance of a subclass of the original optimizer's
class (same config), whose ``apply`` first averages the step's gradients over
the ranks in one grouped call (see :func:`unison.tf_backend.functions.reduce_gradients`),
then applies them. No strategy is involved: each rank feeds its own shard of
data, as in a Horovod Keras script.
"""

from __future__ import annotations

from typing import Any

import keras

from unison.common.compression import Compression
from unison.common.engine import frontend
from unison.common.ops import Average, parse_op
from unison.tf_backend.functions import reduce_gradients

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,  # noqa: N802
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         sparse_as_dense: bool = False, process_set: Any = None) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so gradients are averaged across ranks before each update.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` (not already wrapped).
        compression: ``Compression.none`` / ``.fp16`` for the wire.
        backward_passes_per_step: gradients of this many steps are accumulated (with
            Keras's own ``gradient_accumulation_steps``) before the variables change.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: divide before the sum, the rest after (Average only).
        sparse_as_dense: reduce ``IndexedSlices`` densely instead of by all-gather.

    Raises:
        ValueError: already wrapped, or a predivide factor with an op other than Average.
    """
    if getattr(optimizer, "_unison_distributed", False):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the original once")
    rop = parse_op(op)
    if gradient_predivide_factor != 1.0 and rop != Average:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} only applies to op=Average")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
    base = name or frontend._auto_name("keras.DistributedOptimizer", None)
    pre, post = 1.0 / gradient_predivide_factor, gradient_predivide_factor

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        reduced = reduce_gradients(list(grads), rop, pre, post, compression, sparse_as_dense, base,
                                   process_set)
        return super(cls, self).apply(reduced, trainable_variables)

    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {"apply": apply, "_unison_distributed": True})
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = backward_passes_per_step
    return cls.from_config(config)
