"""JAX: a data-parallel train step compiled as two ``jax.jit`` programs with the exchange between.

[Note: the JAX step in two programs] Inside one jitted step the gradients can reach the host
only through ``jax.experimental.io_callback``, and on the CPU backend that round trip cost 4-8
ms for 16.8 MB of gradients even with a callback that did nothing (the arguments and the results
are copied between XLA's buffers and numpy's, and the ordered effect serializes the program):
Keras's train step under ``DataParallel`` took 18 ms at one rank, with nothing to exchange,
against 9.7 ms without it. So for a model that keeps Keras's own ``train_step`` this module
compiles the step as Keras does, cut in two where the gradients are combined:

1. ``grads``: the loss, its gradients and the auxiliary outputs (``jax.value_and_grad`` of
   ``compute_loss_and_updates``, as Keras's JAX trainer calls it);
2. on the host, between the programs: ``np.asarray`` of a CPU array is a view (no copy), the
   gradients are combined over the ranks (one grouped all-reduce, weighed by the batch rows as
   the optimizer's own exchange does), and ``jax.device_put`` adopts the results' aligned
   memory (no copy on the CPU backend);
3. ``apply``: the optimizer's update, which takes the combined gradients instead of exchanging
   them again, and the metrics' states; it donates the state, as Keras's jitted step does;
4. with global metrics (the default), the metrics' states are summed over the ranks on the host
   (one small grouped all-reduce) and a third jitted program computes the logs from the sums;
   inside the step that sum was a second ``io_callback``, ~2 ms of a 10 ms step at one rank.

A model whose class overrides ``train_step``, a model that runs eagerly or with
``jit_compile=False``, and non-CPU devices keep the single program with the callback.

``evaluate`` gets step 4 alone (:func:`with_global_logs`): Keras's own jitted test step runs with
this rank's metrics, and the logs are computed from the states summed over the ranks after it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from unison.common.data_parallel import average_gradients, max_overwritten

__all__ = ["applies", "make_train_step", "keeps_test_step", "with_global_logs"]


#: The arguments :func:`make_train_step` passes to ``compute_loss_and_updates`` (Keras 3.x's JAX trainer)
_LOSS_ARGS = ("trainable_variables", "non_trainable_variables", "metrics_variables", "x", "y", "sample_weight",
              "training", "optimizer_variables")


def applies(model: Any) -> bool:
    """Whether ``model``'s jitted train step can run as two programs (see the Note): Keras's own
    ``train_step`` and ``compute_loss_and_updates`` as this module knows them, compiled, on the CPU."""
    import jax

    try:
        params = tuple(inspect.signature(model.compute_loss_and_updates).parameters)
    except (TypeError, ValueError):  # another Keras layout: keep the one-program step
        return False
    return (not model.run_eagerly and bool(model.jit_compile) and _keras_own(model, "train_step")
            and params[:len(_LOSS_ARGS)] == _LOSS_ARGS
            and all(d.platform == "cpu" for d in jax.devices())
            and getattr(model.optimizer, "_unison_settings", None) is not None)


def _keras_own(model: Any, step: str) -> bool:
    """Whether ``model``'s class keeps Keras's own JAX ``step`` (``"train_step"``, ``"test_step"``)."""
    try:
        from keras.src.backend.jax.trainer import JAXTrainer
    except ImportError:  # another Keras layout
        return False
    return getattr(getattr(type(model), step), "__code__", None) is getattr(JAXTrainer, step).__code__


def _global_logs(model: Any) -> Callable[[Any], Any]:
    """``states -> logs``: the metrics' states summed over the ranks on the host, then each metric's
    result computed from the sums in a small jitted program (step 4 of the Note)."""
    import jax

    from unison.common.data_parallel import sum_states
    from unison.keras.data_parallel import metrics_results

    results = jax.jit(lambda states: metrics_results(list(model.metrics), states))

    def logs_of(states: Any) -> Any:
        return results([jax.device_put(s) for s in sum_states([np.asarray(v) for v in states])])

    return logs_of


def make_train_step(model: Any) -> Callable[[Any, Any], Any]:
    """``(state, data) -> (logs, state)`` for Keras's ``_make_function``: two jitted programs and the
    exchange between them."""
    import jax

    from unison.keras.data_parallel import (
        batch_weight_of,
        local_metrics,
        loss_weighted_by,
        shadow_share,
        tracker_weight,
    )

    rop, compression, pre, post = model.optimizer._unison_settings
    maxed = max_overwritten(model.trainable_variables)  # ([Note: gradients that are next values])
    dp = getattr(model, "_unison_dp", None)
    logs_of = _global_logs(model) if dp is not None and dp.global_metrics else None

    def grads_program(state: Any, data: Any) -> Any:
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
        (_, aux), grads = grad_fn(trainable, non_trainable, metrics_vars, x, y, sample_weight,
                                  training=True, optimizer_variables=optimizer_vars)
        return grads, aux

    def apply_program(state: Any, grads: Any, aux: Any, data: Any) -> Any:
        trainable, _, optimizer_vars, _ = state
        unscaled_loss, y_pred, non_trainable, metrics_vars = aux
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        optimizer = model.optimizer
        def pending(given: list[Any]) -> tuple[list[int], list[Any]]:  # already combined (every rank alike)
            keys = [i for i, g in enumerate(given) if g is not None]
            return keys, [grads[i] for i in keys]

        optimizer._unison_pending = pending
        try:
            trainable, optimizer_vars = optimizer.stateless_apply(optimizer_vars, grads, trainable)
        finally:
            optimizer.__dict__.pop("_unison_pending", None)
        # (the metrics' states are summed over the ranks after this program)
        with local_metrics(), loss_weighted_by(model, tracker_weight(model, data)):
            logs, metrics_vars = model._update_metrics_variables(metrics_vars, unscaled_loss, x, y, y_pred,
                                                                 sample_weight)
        return logs, (trainable, non_trainable, optimizer_vars, metrics_vars)

    compute = jax.jit(grads_program)
    apply = jax.jit(apply_program, donate_argnums=0)

    def train_step(state: Any, data: Any) -> Any:
        grads, aux = compute(state, data)
        shadow = shadow_share(model, data)
        # (rows, or counted targets: [Note: targets a loss does not count]; 0 for a shadow share)
        weight = batch_weight_of(model, data, shadow)
        combined = average_gradients([np.asarray(g) for g in grads], None if weight is None else int(weight), rop,
                                     compression, pre, post, maxed)
        # a shadow share's metrics' states stay as they were ([Note: a shadow's metrics] in data_parallel;
        # copied: apply donates the state)
        kept = [jax.numpy.array(v, copy=True) for v in state[3]] if shadow is True else None
        logs, state = apply(state, [jax.device_put(g) for g in combined], aux, data)
        if kept is not None:
            state = (*state[:3], kept)
        return (logs if logs_of is None else logs_of(state[3])), state

    return train_step


def keeps_test_step(model: Any) -> bool:
    """Whether ``model``'s class keeps Keras's own JAX ``test_step`` (its logs are its metrics' results)."""
    return _keras_own(model, "test_step")


def with_global_logs(model: Any, function: Callable[[Any, Any], Any], index: int) -> Callable[[Any, Any], Any]:
    """``function`` (Keras's ``(state, data) -> (logs, state)``) run with this rank's metrics, its logs
    then computed from the metrics' states (``state[index]``) summed over the ranks (see the Note)."""
    from unison.keras.data_parallel import local_metrics

    logs_of = _global_logs(model)

    def run(state: Any, data: Any) -> Any:
        with local_metrics():
            _, state = function(state, data)
        return logs_of(state[index]), state

    return run
