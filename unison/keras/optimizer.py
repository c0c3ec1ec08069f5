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
import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np

from unison.common.compression import Compression
from unison.common.data_parallel import average_gradients, max_overwritten
from unison.common.engine import frontend
from unison.common.ops import Average, Sum, parse_op
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
                         gradient_predivide_factor: float = 1.0, backward_passes_per_step: int = 1,
                         sparse_as_dense: bool = False, device_dense: str = "", device_sparse: str = "",
                         process_set: Any = None, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, scale_local_gradients: bool = True, *,
                         _in_place: bool = False) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so each step's gradients are combined over the ranks before the update.

    Horovod's ``DistributedOptimizer`` on every Keras backend.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` (not already wrapped, not yet used).
        name: accepted for Horovod's signature (the engine names the grouped call).
        compression: ``Compression.none`` or ``Compression.fp16`` / ``.bf16`` on the wire.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: divide by this before the sum and multiply after
            (``Average`` only).
        backward_passes_per_step: apply the update every this many steps (Keras's
            ``gradient_accumulation_steps``; each step's gradients are still reduced as they come), on
            the sum of their gradients, as Horovod does, or their mean with ``average_aggregated_gradients``.
        sparse_as_dense, device_dense, device_sparse: accepted for Horovod's signature (gradients
            are reduced densely, on the host; see docs/keras_backends.md).
        process_set: the global set only (None or ``global_process_set``).
        average_aggregated_gradients: with ``backward_passes_per_step`` > 1, apply the mean of the
            accumulated gradients instead of their sum (Horovod's keyword and default).
        num_groups, groups: Horovod's fusion groups: checked (a number of groups, or lists of variables),
            then left to the engine, which fuses a step's gradients in one call whatever they say.
        scale_local_gradients: accepted for Horovod's signature (this wrapper has no local variables).

    Returns:
        The wrapped optimizer: a new object, the original left as it was (Horovod's way). (``DataParallel``'s
        ``compile`` passes ``_in_place``: the object given becomes the distributed one, so the model's
        optimizer is the user's.)

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: already wrapped, an op other than Average or Sum (Horovod's error), a predivide
            factor with an op other than Average, or ``backward_passes_per_step`` below 1.
        NotImplementedError: a process set other than the global one.
    """
    del name, sparse_as_dense, device_dense, device_sparse, scale_local_gradients
    _check_groups(num_groups, groups)
    if process_set is not None and getattr(process_set, "ranks", None) is not None:
        raise NotImplementedError(f"unison.keras.DistributedOptimizer(process_set={process_set!r}): only the "
                                  "global set; use unison.tf_backend.keras.DistributedOptimizer on TensorFlow")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer needs a keras.optimizers.Optimizer; got "
                        f"{type(optimizer).__name__}. Pass e.g. keras.optimizers.SGD(0.01)")
    if getattr(optimizer, "_unison_distributed", False):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the original once")
    rop = parse_op(op)
    if rop not in (Average, Sum):  # Horovod's check (before 2026-12-07 Min, Max, Product and Adasum were taken)
        raise ValueError(f"op currently only supports Average and Sum; got op={op!r}. Pass op=unison.Average or "
                         "op=unison.Sum, as Horovod's DistributedOptimizer requires")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} must be > 0")
    if gradient_predivide_factor != 1.0 and rop is not Average:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} only applies to op=Average")
    base = type(optimizer)
    # [Note: the sum of the accumulated steps] Keras's accumulation applies the mean of the k steps'
    # gradients; Horovod applies their sum unless average_aggregated_gradients: each step's reduced gradients
    # are scaled by k for that (before 2026-12-07 the mean: a Horovod script took updates k times smaller)
    factor = 1.0 if average_aggregated_gradients else float(backward_passes_per_step)
    post = gradient_predivide_factor * factor

    def combine(arrays: list[np.ndarray], rows: int | None, maxed: Sequence[int] = ()) -> list[np.ndarray]:
        # (maxed: [Note: gradients that are next values] in unison/common/data_parallel.py)
        return average_gradients(arrays, rows, rop, compression, 1.0 / gradient_predivide_factor, post, maxed)

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        pending = self.__dict__.pop("_unison_pending", None)  # started during backward (torch hooks)
        if pending is None:
            return super(cls, self).apply(_agreed(self, grads, trainable_variables), trainable_variables)
        keys, reduced = pending(grads)  # (every variable with a gradient on some rank: see _torch_overlap.py)
        for i, g in zip(keys, reduced, strict=True):
            grads[i] = g
        return super(cls, self).apply(grads, trainable_variables)

    def _agreed(self: Any, grads: list[Any], trainable_variables: Any) -> list[Any]:
        """[Note: gradients missing on some ranks] A gradient None on some ranks only (a branch taken by
        some ranks' data) was left out of the reduction, which then paired the other variables'
        gradients by position across ranks (wrong weights, silently). Eagerly, every variable's
        gradient is reduced (zeros from the ranks without one: one process's answer) with a presence
        vector in the same reduction; the ones absent on every rank stay None. In a traced step (which
        gradients exist is fixed by the trace, and ranks may retrace at different steps, so no
        collective can run at trace time) the present ones are reduced with the presence vector and
        its complement beside them, and the step fails on every rank when the ranks' patterns differ
        (a group of another length is refused by the reduction itself)."""
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        local = np.array([g is not None for g in grads], dtype=np.float32)
        maxed = set(max_overwritten(variables))
        if _host.traced([g for g in grads if g is not None]):
            keep = [i for i in range(len(grads)) if local[i]]
            marks = [keras.ops.convert_to_tensor(local), keras.ops.convert_to_tensor(1.0 - local)]
            kept_maxed = [k for k, i in enumerate(keep) if i in maxed]
            reduced = _host.host_call(functools.partial(checked, maxed=kept_maxed),
                                      [grads[i] for i in keep] + marks, _ROWS.get())[:-2]
            out: list[Any] = [None] * len(grads)
            for i, g in zip(keep, reduced, strict=True):
                out[i] = g
            return out
        filled = [g if g is not None else keras.ops.zeros(v.shape, dtype=v.dtype)
                  for g, v in zip(grads, variables, strict=True)]
        reduced = _host.host_call(functools.partial(combine, maxed=sorted(maxed)),
                                  filled + [keras.ops.convert_to_tensor(local)], _ROWS.get())
        presence = _host.to_numpy(reduced[-1])
        return [g if presence[i] > 0 else None for i, g in enumerate(reduced[:-1])]

    def checked(arrays: list[np.ndarray], rows: int | None, maxed: Sequence[int] = ()) -> list[np.ndarray]:
        out = combine(arrays, rows, maxed)
        have, lack = out[-2], out[-1]
        mixed = np.flatnonzero((have > 0) & (lack > 0))
        if mixed.size:
            raise ValueError(f"the gradients of the trainable variables at positions {mixed.tolist()} exist on "
                             "some ranks and not on others in this traced step; make every rank's step use the "
                             "same variables (run_eagerly=True reduces them with zeros from the ranks without)")
        return out

    def stateless_apply(self: Any, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        # JAX's trainer calls this; a LossScaleOptimizer's goes to its inner optimizer's without calling
        # apply (so nothing was reduced: the ranks drifted apart). Reduce here (unless DataParallel's step
        # combined them already), then Keras checks and applies
        pending = self.__dict__.pop("_unison_pending", None)
        grads = list(grads)
        if pending is None:
            grads = _agreed(self, grads, trainable_variables)
        return super(cls, self).stateless_apply(optimizer_variables, grads, trainable_variables)

    members: dict[str, Any] = {"apply": apply, "_unison_distributed": True, "_unison_keras_distributed": True,
                               "__module__": base.__module__, "__qualname__": base.__qualname__,
                               "_unison_settings": (rop, compression, 1.0 / gradient_predivide_factor, post)}
    if issubclass(base, keras.optimizers.LossScaleOptimizer):
        members["stateless_apply"] = stateless_apply
    cls = type(base.__name__, (base,), members)
    _agree_on_loss_scale_skips()
    if _in_place and backward_passes_per_step == 1:
        optimizer.__class__ = cls
        return optimizer
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = backward_passes_per_step
    return rebuilt(cls, optimizer, config)


def rebuilt(cls: type, optimizer: Any, config: dict[str, Any]) -> Any:
    """``cls.from_config(config)``, with what Keras's config leaves out of ``optimizer``: the variables
    and name patterns of ``exclude_from_weight_decay`` (dropped before 2026-12-05, so biases and norms
    excluded before wrapping were decayed)."""
    new = cls.from_config(config)
    for attr in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        if attr in optimizer.__dict__:
            setattr(new, attr, copy.copy(optimizer.__dict__[attr]))
    if getattr(optimizer, "built", False):
        _carry_state(optimizer, new)
    return new


def _check_groups(num_groups: Any, groups: Any) -> None:
    """Horovod's ``num_groups``/``groups`` shapes: a count >= 0, None, a positive count, or lists of variables."""
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 0:
        raise ValueError(f"num_groups={num_groups!r} must be a number of groups >= 0")
    if groups is None:
        return
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 1:
            raise ValueError(f"groups={groups} must be a positive number of groups, or lists of variables")
        return
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
        raise ValueError(f"groups={groups!r} must be a positive number or a list of lists of variables")


def recompiled(model: Any, wrapped: Any, custom_objects: dict | None = None) -> Any:
    """``model`` compiled again as it was saved, with ``wrapped`` (its loaded optimizer made distributed,
    state carried over: :func:`_carry_state`) as its optimizer. ``custom_objects``: the loader's, which the
    compile config may name (a loss of the user's: before 2026-12-07 it could not be found, "Could not locate
    function 'my_loss'", where ``keras.models.load_model`` had loaded it)."""
    with keras.saving.custom_object_scope(custom_objects or {}):
        config = keras.saving.deserialize_keras_object(model.get_compile_config() or {})
    config["optimizer"] = wrapped
    model.compile(**config)
    return model


def load_model(filepath: Any, custom_optimizers: Any = None, custom_objects: dict | None = None,
               compression: Any = Compression.none) -> keras.Model:
    """Load a saved Keras model whose optimizer becomes a :func:`DistributedOptimizer`, its state (iterations,
    slots) kept: Horovod's ``load_model``, on every backend. ``custom_optimizers`` (optimizer classes) are made
    known to the loader like ``custom_objects``. Call it on every rank."""
    return load_wrapped(filepath, custom_optimizers, custom_objects,
                        lambda loaded: DistributedOptimizer(loaded, compression=compression))


def load_wrapped(filepath: Any, custom_optimizers: Any, custom_objects: dict | None,
                 wrap: Callable[[Any], Any]) -> keras.Model:
    """``keras.models.load_model``, the loaded optimizer (unless it is distributed already) replaced by
    ``wrap(optimizer)``, the model compiled again as it was saved."""
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or []})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    loaded = getattr(model, "optimizer", None)
    if loaded is None or getattr(loaded, "_unison_distributed", False):
        return model
    return recompiled(model, wrap(loaded), objects)


def _carry_state(old: Any, new: Any) -> None:
    """Build ``new`` over ``old``'s variables and give it ``old``'s state (iterations, moments), matched by
    path: wrapping an optimizer already used (one a loaded model brought, to resume) threw its state away,
    silently, before 2026-12-07 (Adam restarted its moments and its step count at 0).

    Raises:
        ValueError: a variable of ``old`` that ``new`` has not, or of another shape.
    """
    token = _DEFER_AGREEMENT.set(True)  # (one rank's act, maybe: [Note: a build check left for later])
    try:
        new.build(list(getattr(old, "_trainable_variables", None) or []))
    finally:
        _DEFER_AGREEMENT.reset(token)
    mine = {v.path: v for v in new.variables}
    lost = []
    for v in old.variables:
        target = mine.get(v.path)
        if target is None or tuple(target.shape) != tuple(v.shape):
            lost.append(v.path)
        else:
            target.assign(v.value)
    if lost:
        raise ValueError(f"DistributedOptimizer: the optimizer was already used and its state {lost[:4]} has no "
                         "place in the wrapped one; wrap it before training, or load the model with the "
                         "distributed optimizer's load_model")


_DEFER_AGREEMENT: contextvars.ContextVar[bool] = contextvars.ContextVar("unison_keras_defer", default=False)


def agree_at_build(optimizer: Any, check: Callable[[], None]) -> None:
    """Run ``check`` (a collective over every rank that an optimizer's ``build`` makes) now, or, for a build
    that :func:`_carry_state` makes, keep it for :func:`run_deferred_agreement`.

    [Note: a build check left for later]
    Wrapping an optimizer already used builds the new one at once, and that may be one rank's act:
    Horovod's resume pattern loads the checkpoint on rank 0 alone (``if rank == 0: model =
    hvd.load_model(path)``), the other ranks building a fresh model. A check across every rank in that
    build waited for ranks that build their optimizer only at their first step (a ``StallError`` after
    60 s, before 2026-12-07). The check is kept on the optimizer and runs where every rank meets: the
    broadcast callback (which builds the others' optimizers at the same point) or else the first
    ``apply``, at the place where an unbuilt optimizer builds.
    """
    if _DEFER_AGREEMENT.get():
        optimizer.__dict__["_unison_deferred_agreement"] = check
    else:
        check()


def run_deferred_agreement(optimizer: Any) -> None:
    """Run the check a build of ``optimizer`` (or of the optimizer it wraps) kept for later, once."""
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        check = opt.__dict__.pop("_unison_deferred_agreement", None) if opt is not None else None
        if check is not None:
            check()


#: (which inner optimizers, the agreeing LossScaleOptimizer class for a class): registered by
#: :func:`agree_on_loss_scale_skips`; the first whose test takes the inner optimizer applies
_LOSS_SCALE_AGREEMENTS: list[tuple[Callable[[Any], bool], Callable[[type], type]]] = []
_agreeing: dict[type, type] = {}


def _agree_on_loss_scale_skips() -> None:
    """[Note: agreed loss-scale skips on every backend] A ``LossScaleOptimizer`` around a
    ``DistributedOptimizer`` (``compile`` adds one under a ``mixed_float16`` policy) checks this
    rank's own gradients, before the all-reduce inside the inner optimizer: a rank whose gradients
    overflowed skipped the step alone, and the others waited in the all-reduce it never joined (a
    hang on every backend). Its check becomes every rank's: any rank's overflow skips the step
    everywhere."""
    agree_on_loss_scale_skips(lambda inner: getattr(inner, "_unison_keras_distributed", False), _agreeing_class)


def agree_on_loss_scale_skips(takes: Callable[[Any], bool], agreeing: Callable[[type], type]) -> None:
    """Make every ``LossScaleOptimizer`` whose inner optimizer ``takes`` accepts an instance of
    ``agreeing(its class)`` from then on (one hook on its ``__init__``, shared by ``unison.keras`` and
    ``unison.tf_backend.keras``; registering the same pair again does nothing)."""
    if any(a is agreeing for _, a in _LOSS_SCALE_AGREEMENTS):
        return
    if not _LOSS_SCALE_AGREEMENTS:
        original = keras.optimizers.LossScaleOptimizer.__init__

        def __init__(self: Any, inner_optimizer: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            original(self, inner_optimizer, *args, **kwargs)
            for test, make in _LOSS_SCALE_AGREEMENTS:
                if test(inner_optimizer):
                    self.__class__ = make(type(self))
                    return

        keras.optimizers.LossScaleOptimizer.__init__ = __init__
    _LOSS_SCALE_AGREEMENTS.append((takes, agreeing))


def _agreeing_class(base: type) -> type:
    if base in _agreeing or getattr(base, "_unison_agrees_on_skips", False):
        return _agreeing.get(base, base)

    def check_finite(self: Any, grads: Any) -> Any:
        """Keras's check on this rank's gradients, then true only where every rank's was."""
        finite = base.check_finite(self, grads)
        overflowed = keras.ops.reshape(keras.ops.cast(keras.ops.logical_not(finite), "float32"), (1,))
        total = _host.host_call(lambda arrays, rows: [frontend.allreduce(arrays[0], op=Sum)], [overflowed])[0]
        return keras.ops.equal(keras.ops.sum(total), 0.0)

    cls = type(base.__name__, (base,), {"check_finite": check_finite, "_unison_agrees_on_skips": True,
                                        "__module__": base.__module__, "__qualname__": base.__qualname__})
    _agreeing[base] = cls
    return cls
