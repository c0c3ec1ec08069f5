"""Collectives on the active Keras backend's tensors, differentiable where the backend traces them.

``allreduce``, ``allgather`` and ``broadcast`` take a backend tensor (or a numpy
array) and return one of the same backend, from eager code or from inside the
backend's compiled step (see :mod:`unison.keras._host`). Their gradients are the
collectives' own adjoints, as in Horovod: an all-reduce's gradient is the all-reduce
(same op) of the incoming gradient; an all-gather's is this rank's rows of the summed
gradient; a broadcast's is the summed gradient on the root and zeros elsewhere.
``broadcast_variables`` sets Keras variables to the root's values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from unison.common import runtime
from unison.common.data_parallel import broadcast_arrays
from unison.common.engine import frontend
from unison.common.ops import Average, Sum, parse_op
from unison.keras import _host

__all__ = ["allgather", "allreduce", "broadcast", "broadcast_variables"]

Fn = Callable[[np.ndarray], np.ndarray]


Shape = Callable[[Any], Any]


def _differentiable(forward: Fn, backward: Fn, out_like: Shape | None = None,
                    in_like: Shape | None = None) -> Callable[[Any], Any]:
    """``forward`` on the host as a backend function whose gradient is ``backward`` on the host.

    ``out_like`` / ``in_like`` map the input's shape to the output's and back (None: the same shape).
    """
    name = _host.backend()
    if name == "jax":
        import jax

        @jax.custom_vjp
        def f(x: Any) -> Any:
            return _jax_shaped(forward, x, out_like or (lambda shape: shape))

        f.defvjp(lambda x: (f(x), None), lambda _res, g: (_jax_shaped(backward, g, in_like or (lambda s: s)),))
        return f
    if name == "tensorflow":
        import tensorflow as tf

        @tf.custom_gradient
        def g(x: Any) -> Any:
            out = _tf_shaped(forward, x, out_like)
            return out, lambda dy: _tf_shaped(backward, dy, None if out_like is None else (lambda _s: x.shape))

        return g
    import torch

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:  # (bfloat16 and 0-d tensors kept: _host's conversions)
            # on the input's device (a CUDA tensor came back on the CPU before 2026-12-06)
            return _host.torch_from_numpy(forward(_host.torch_to_numpy(x))).to(x.device)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            return _host.torch_from_numpy(backward(_host.torch_to_numpy(dy))).to(dy.device)

    return _Fn.apply


def _jax_shaped(fn: Fn, x: Any, out_like: Callable[[Any], Any]) -> Any:
    import jax
    from jax.experimental import io_callback

    if not isinstance(x, jax.core.Tracer):
        return jax.numpy.asarray(fn(np.asarray(x)))
    spec = jax.ShapeDtypeStruct(tuple(out_like(tuple(x.shape))), x.dtype)
    return io_callback(lambda a: np.asarray(fn(np.asarray(a)), dtype=spec.dtype), spec, x, ordered=True)


def _tf_shaped(fn: Fn, x: Any, out_like: Callable[[Any], Any] | None) -> Any:
    import tensorflow as tf

    if tf.executing_eagerly():
        return tf.convert_to_tensor(fn(x.numpy()))
    shape = x.shape if out_like is None else tf.TensorShape(out_like(tuple(x.shape)))
    # a 0-d result leaves the callback as one element: TensorFlow leaks about 32 bytes for each 0-d value a
    # callback returns (unison.tf_backend.host_ops [Note: a callback's key is not 0-d])
    scalar = shape.rank == 0
    out = tf.numpy_function(lambda a: _one_if_scalar(np.asarray(fn(a), dtype=a.dtype), scalar), [x], x.dtype,
                            stateful=True)
    out = tf.reshape(out, []) if scalar else out
    out.set_shape(shape)
    return out


def _one_if_scalar(a: np.ndarray, scalar: bool) -> np.ndarray:
    return a.reshape(1) if scalar else a


def _tensor(x: Any) -> Any:
    """``x`` as a backend tensor where it is host data (numpy arrays and scalars such as ``np.float32(3)``,
    which failed on torch before 2026-12-06, lists, Python numbers) or a Keras variable (its value: JAX and
    torch refused the variable itself, before 2026-12-07)."""
    if isinstance(x, keras.Variable):
        return x.value
    return keras.ops.convert_to_tensor(x) if isinstance(x, (np.ndarray, np.generic, list, float, int)) else x


def _input(x: Any, submit: Callable[[Any], Any]) -> Any:
    """``_tensor(x)``; an input this rank cannot convert (a ragged list) is refused under the call the
    others make (``submit``), so that every rank raises (before 2026-12-07 this rank raised alone and the
    others' call met its next one: another call's values on both, then a hang)."""
    try:
        return _tensor(x)
    except (TypeError, ValueError) as exc:
        _refuse_on_every_rank(exc, submit, None)
        raise


def _refusing(error: Exception, submit: Callable[[Any], Any]) -> Fn:
    """A host function that submits ``error``'s refusal under the others' call and so raises, on every rank:
    what a check that failed while a program was traced puts into the program (raised at trace time, on
    this rank alone, the others' compiled call met this rank's next one, before 2026-12-07)."""
    def refuse(_a: np.ndarray) -> np.ndarray:
        submit(frontend.Refused(error))
        raise error  # (the refusal raised already: the engine's words naming this rank)
    return refuse


def _traced(x: Any) -> bool:
    """Whether a program is being traced now (``tf.function``, ``jax.jit``, ``torch.compile``): its
    collectives run later, when the program does. Decided from the backend's own state, not from ``x``
    (a Keras variable or a numpy array inside a traced function is no tracer)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return not tf.executing_eagerly()
    if backend == "jax":
        import jax

        return isinstance(x, jax.core.Tracer) or isinstance(jax.numpy.zeros(()), jax.core.Tracer)
    if backend == "torch":
        import torch

        return bool(torch.compiler.is_compiling())
    return False


def _refuse_on_every_rank(error: Exception, submit: Callable[[Any], Any], x: Any) -> None:
    """A check this rank alone failed: submit the refusal under the call the others make, so that theirs
    raises too (raised here alone, the others' call paired with this rank's next one: another call's values
    on both, then a hang; before 2026-12-05). Not while a program is traced: the others' call runs later."""
    if frontend.running_engine() is not None and not _traced(x):
        try:
            submit(frontend.Refused(error))
        except Exception:  # noqa: BLE001, S110 - the same refusal in the engine's words; this rank raises its own
            pass


def allreduce(x: Any, op: Any = Average) -> Any:
    """``x`` reduced over every rank (``Average`` or ``Sum``); differentiable."""
    def submit(refused: Any) -> Any:
        return frontend.allreduce(refused)
    t = _input(x, submit)
    try:
        rop = parse_op(op)
        if rop not in (Average, Sum):
            raise ValueError(f"unison.keras.allreduce(op={op!r}) supports Average and Sum")
    except ValueError as exc:
        if frontend.running_engine() is not None and _traced(t):
            refuse = _refusing(exc, submit)
            return _differentiable(refuse, refuse)(t)
        _refuse_on_every_rank(exc, submit, t)
        raise

    def reduce(a: np.ndarray) -> np.ndarray:
        return np.asarray(frontend.allreduce(np.ascontiguousarray(a), op=rop), dtype=a.dtype).reshape(a.shape)

    return _differentiable(reduce, reduce)(t)


def allgather(x: Any) -> Any:
    """The ranks' ``x`` stacked along the first dimension, in rank order; differentiable.

    On the JAX backend, inside ``jax.jit``, every rank's first dimension must be the
    same (the result's shape is fixed when the step is traced).
    """
    size, rank = runtime.size(), runtime.rank()
    rows: dict[str, int] = {}
    t = _input(x, lambda refused: frontend.allgather(refused))
    scalar = len(tuple(t.shape)) == 0  # one row each: (size,) gathered, and a 0-d gradient back

    def gather(a: np.ndarray) -> np.ndarray:
        counts = frontend.allgather(np.array([a.shape[0] if a.ndim else 1], np.int64))
        rows["start"], rows["stop"] = int(counts[:rank].sum()), int(counts[:rank + 1].sum())
        return np.asarray(frontend.allgather(np.ascontiguousarray(a)))

    def mine(g: np.ndarray) -> np.ndarray:
        summed = np.asarray(frontend.allreduce(np.ascontiguousarray(g), op=Sum), dtype=g.dtype)
        own = summed[rows["start"]:rows["stop"]]
        return own.reshape(()).copy() if scalar else np.ascontiguousarray(own)  # (ascontiguousarray makes 0-d 1-d)

    # (a 0-d input under jax.jit or jax.grad failed before 2026-12-07: its shape has no first dimension)
    def gathered_shape(shape: Sequence[Any]) -> tuple[Any, ...]:
        if scalar:
            return (size,)
        return (None if shape[0] is None else shape[0] * size, *shape[1:])

    def own_shape(shape: Sequence[Any]) -> tuple[Any, ...]:  # jax: every rank has the same rows
        return () if scalar else (shape[0] // size, *shape[1:])

    return _differentiable(gather, mine, gathered_shape, own_shape)(t)


def broadcast(x: Any, root_rank: int = 0) -> Any:
    """``root_rank``'s ``x`` on every rank; differentiable (the root gets the summed gradient)."""
    rank = runtime.rank()

    def forward(a: np.ndarray) -> np.ndarray:
        return np.asarray(frontend.broadcast(np.ascontiguousarray(a), root_rank), dtype=a.dtype).reshape(a.shape)

    def backward(g: np.ndarray) -> np.ndarray:
        summed = np.asarray(frontend.allreduce(np.ascontiguousarray(g), op=Sum), dtype=g.dtype).reshape(g.shape)
        return summed if rank == root_rank else np.zeros_like(summed)

    return _differentiable(forward, backward)(_input(x, lambda refused: frontend.broadcast(refused, root_rank)))


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, process_set: Any = None) -> None:
    """Assign ``root_rank``'s values to Keras ``variables`` on every rank (of ``process_set``; one call
    per variable, all at once). ``root_rank`` is a rank of the job, in the set (Horovod's rule)."""
    variables = list(variables)
    for var, value in zip(variables, broadcast_arrays([_host.to_numpy(v) for v in variables], root_rank,
                                                      process_set, "broadcast_variables"), strict=True):
        var.assign(value)
