"""Run numpy code on the host from inside the active Keras backend's train step.

The same three function names for every backend (Keras's own pattern of backend
modules with one interface), chosen by ``keras.backend.backend()``:

* ``host_call(fn, tensors, rows)``: ``fn(arrays, rows) -> arrays`` (same shapes and
  dtypes) applied to ``tensors``, returning backend tensors. JAX's trainer compiles the
  step with ``jax.jit``: the call is a ``jax.experimental.io_callback`` with
  ``ordered=True``, so every rank runs its host calls in program order and the ranks'
  collectives line up (never ``run_eagerly``). TensorFlow's trainer traces a
  ``tf.function``: a stateful ``tf.numpy_function``, kept in program order by
  tf.function's automatic control dependencies. Torch's trainer runs eagerly: a plain
  call on the tensors' memory. Outside a trace every backend calls ``fn`` directly.
* ``rows_of(tensor)``: the batch rows of ``tensor`` (a Python int where the shape is
  static, a scalar tensor inside a TensorFlow graph with an unknown batch dimension).
* ``to_numpy(value)``: a variable's or tensor's value as a numpy array.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from unison.common.dtypes import bfloat16_dtype, is_bfloat16

__all__: list[str] = []

HostFn = Callable[[list[np.ndarray], "int | None"], list[np.ndarray]]


def backend() -> str:
    """The active Keras backend's name."""
    return keras.backend.backend()


def host_call(fn: HostFn, tensors: Sequence[Any], rows: Any = None) -> list[Any]:
    """``fn`` on the host, on ``tensors``' values, from eager or traced code of the active backend."""
    tensors = list(tensors)
    if not tensors:
        return []
    name = backend()
    if name == "jax":
        return _jax_call(fn, tensors, rows)
    if name == "tensorflow":
        return _tf_call(fn, tensors, rows)
    if name == "torch":
        return _torch_call(fn, tensors, rows)
    raise NotImplementedError(f"unison.keras runs on the tensorflow, jax and torch backends of Keras; "
                              f"KERAS_BACKEND is {name!r}. Set KERAS_BACKEND to one of them")


def _cast_like(outs: Sequence[np.ndarray], likes: Sequence[Any]) -> list[np.ndarray]:
    # np.ascontiguousarray would turn a 0-d array into shape (1,)
    return [np.require(np.asarray(o, dtype=like.dtype).reshape(like.shape), requirements="C")
            for o, like in zip(outs, likes, strict=True)]


def _jax_call(fn: HostFn, tensors: list[Any], rows: Any) -> list[Any]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    if not any(isinstance(t, jax.core.Tracer) for t in tensors):
        arrays = [np.asarray(t) for t in tensors]
        return [jnp.asarray(o) for o in _cast_like(fn(arrays, None if rows is None else int(rows)), arrays)]
    specs = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tensors]
    if isinstance(rows, jax.core.Tracer):
        # a count computed in the step (the targets an ignore_class loss counts: data_parallel [Note: targets a
        # loss does not count]) reaches the host as one more operand; int() of it failed inside jit
        def counted(*arrays: Any) -> list[np.ndarray]:
            return _cast_like(fn([np.asarray(a) for a in arrays[:-1]], int(np.asarray(arrays[-1]))), specs)

        return list(io_callback(counted, specs, *tensors, jnp.asarray(rows), ordered=True))
    static_rows = None if rows is None else int(rows)  # jax shapes are static: rows is a Python int

    def callback(*arrays: Any) -> list[np.ndarray]:
        return _cast_like(fn([np.asarray(a) for a in arrays], static_rows), specs)

    return list(io_callback(callback, specs, *tensors, ordered=True))


def _tf_call(fn: HostFn, tensors: list[Any], rows: Any) -> list[Any]:
    import tensorflow as tf

    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if tf.executing_eagerly():
        arrays = [t.numpy() for t in tensors]
        outs = fn(arrays, None if rows is None else int(rows))
        return [tf.convert_to_tensor(o) for o in _cast_like(outs, arrays)]
    has_rows = rows is not None
    inputs = tensors + ([tf.cast(rows, tf.int64)] if has_rows else [])

    def callback(*arrays: Any) -> list[np.ndarray]:
        values = list(arrays[:-1]) if has_rows else list(arrays)
        outs = _cast_like(fn(values, int(arrays[-1]) if has_rows else None), values)
        # a 0-d result leaves as one element, reshaped in the graph: TensorFlow leaks about 32 bytes for each
        # 0-d value a callback returns (unison.tf_backend.host_ops [Note: a callback's key is not 0-d])
        return [o.reshape(1) if o.ndim == 0 else o for o in outs]

    outs = tf.numpy_function(callback, inputs, [t.dtype for t in tensors], stateful=True)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    shaped = []
    for out, t in zip(outs, tensors, strict=True):
        if t.shape.rank == 0:
            out = tf.reshape(out, [])
        elif t.shape.rank is None:  # (a 0-d one came back as one element)
            out = tf.reshape(out, tf.shape(t))
        out.set_shape(t.shape)
        shaped.append(out)
    return shaped


def _torch_call(fn: HostFn, tensors: list[Any], rows: Any) -> list[Any]:
    arrays = [torch_to_numpy(t) for t in tensors]
    outs = _cast_like(fn(arrays, None if rows is None else int(rows)), arrays)
    return [torch_from_numpy(o).to(t.device) for o, t in zip(outs, tensors, strict=True)]


def torch_to_numpy(tensor: Any) -> np.ndarray:
    """A CPU torch tensor's values as numpy (bfloat16, which ``Tensor.numpy`` refuses, as the core's)."""
    import torch

    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16_dtype())
    return t.numpy()


def torch_from_numpy(array: np.ndarray) -> Any:
    """The inverse of :func:`torch_to_numpy` (0-d arrays stay 0-d)."""
    import torch

    arr = np.require(array, requirements="C")
    if is_bfloat16(arr.dtype):
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def traced(tensors: Sequence[Any]) -> bool:
    """Whether ``tensors`` belong to a program being traced (``jax.jit``, a ``tf.function``), where values
    are not known yet and Python runs once per trace; False when they are concrete (eager)."""
    name = backend()
    if name == "jax":
        import jax

        return any(isinstance(t, jax.core.Tracer) for t in tensors)
    if name == "tensorflow":
        import tensorflow as tf

        return not tf.executing_eagerly()
    return False


def rows_of(tensor: Any) -> Any:
    """Rows (first dimension) of ``tensor``: an int, or a scalar tensor in a TensorFlow graph."""
    return keras.ops.shape(tensor)[0]


def to_numpy(value: Any) -> np.ndarray:
    """A numpy copy-free view (where the backend allows) of a variable's or tensor's value."""
    if isinstance(value, keras.Variable):
        value = value.value
    if backend() == "torch":
        return torch_to_numpy(value)
    return np.asarray(keras.ops.convert_to_numpy(value))
