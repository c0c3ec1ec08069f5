"""``DistributedOptimizer`` for Keras 3 on any backend: gradients combined over the ranks, then applied.

The wrapped optimizer is an instance of a subclass of the original's class (same
config, serialized as the original: a saved model loads without Unison), whose
``apply`` combines the step's gradients in one fused host call (see
:mod:`unison.keras._host`) before updating the variables. It is the only place the
gradients cross ranks, so it works wherever Keras calls ``optimizer.apply``: inside
``jax.jit`` (JAX), a ``tf.function`` (TensorFlow) or eagerly (torch), in ``model.fit``
or a custom loop.

Under ``DataParallel`` the step's batch rows are known (see :func:`batch_rows`) and the
gradients are weighed by them: the result is the gradient of the mean loss over the
global batch, also for a last batch split unevenly. Without it (a Horovod-style script
that feeds each rank its own data) the gradients are averaged, as Horovod does.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from unison.common.compression import Compression
from unison.common.data_parallel import average_gradients
from unison.common.ops import Average, parse_op
from unison.keras import _host

__all__ = ["DistributedOptimizer"]

_ROWS: contextvars.ContextVar[Any] = contextvars.ContextVar("unison_keras_rows", default=None)


@contextlib.contextmanager
def batch_rows(rows: Any) -> Iterator[None]:
    """Within the block, optimizers weigh this rank's gradients by ``rows`` (its batch rows)."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,  # noqa: N802
                         compression: Any = Compression.none, op: Any = Average,
                         gradient_predivide_factor: float = 1.0) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so each step's gradients are combined over the ranks before the update.

    Horovod's ``DistributedOptimizer`` on every Keras backend.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` (not already wrapped, not yet used).
        name: accepted for Horovod's signature (the engine names the grouped call).
        compression: ``Compression.none`` or ``Compression.fp16`` / ``.bf16`` on the wire.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: divide by this before the sum and multiply after
            (``Average`` only).

    Returns:
        The wrapped optimizer (a new object; the original is left as it was).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: already wrapped, or a predivide factor with an op other than Average.
    """
    del name
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer needs a keras.optimizers.Optimizer; got "
                        f"{type(optimizer).__name__}. Pass e.g. keras.optimizers.SGD(0.01)")
    if getattr(optimizer, "_unison_distributed", False):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the original once")
    rop = parse_op(op)
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} must be > 0")
    if gradient_predivide_factor != 1.0 and rop is not Average:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} only applies to op=Average")
    base = type(optimizer)

    def combine(arrays: list[np.ndarray], rows: int | None) -> list[np.ndarray]:
        return average_gradients(arrays, rows, rop, compression, 1.0 / gradient_predivide_factor,
                                 gradient_predivide_factor)

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        pending = self.__dict__.pop("_unison_pending", None)  # started during backward (torch hooks)
        if pending is not None:
            reduced = pending(present)
        else:
            reduced = _host.host_call(combine, [grads[i] for i in present], _ROWS.get())
        for i, g in zip(present, reduced, strict=True):
            grads[i] = g
        return super(cls, self).apply(grads, trainable_variables)

    cls = type(base.__name__, (base,), {"apply": apply, "_unison_distributed": True,
                                        "__module__": base.__module__, "__qualname__": base.__qualname__,
                                        "_unison_settings": (rop, compression, 1.0 / gradient_predivide_factor,
                                                             gradient_predivide_factor)})
    return cls.from_config(optimizer.get_config())
