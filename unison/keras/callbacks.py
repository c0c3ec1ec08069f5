"""Horovod's Keras callbacks for Keras 3 on every backend (``unison.keras.callbacks``).

For scripts that feed each rank its own data (Horovod's style) rather than using
``DataParallel`` (which does all of this itself):

* :class:`BroadcastGlobalVariablesCallback`: every rank starts from the root's model
  and optimizer variables.
* :class:`MetricAverageCallback`: the epoch's logged metrics averaged over the ranks.
* :class:`LearningRateWarmupCallback`: the learning rate ramps from ``initial_lr / size``
  to ``initial_lr`` over the first epochs (Goyal et al., "Accurate, Large Minibatch SGD").
* :class:`ModelCheckpoint`: Keras's, writing from rank 0 only, atomically and durably.

On the JAX backend Keras keeps the training state outside the variables during an
epoch; a callback that sets a variable between steps first brings the state back
(``model.jax_state_sync()``) and marks it to be read again, so the change takes effect
on the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import keras
import numpy as np

from unison.common import runtime
from unison.common.engine import frontend, objects
from unison.common.exceptions import MismatchError, UnisonError
from unison.common.files import atomic_keras_save
from unison.common.ops import Average
from unison.keras.data_parallel import without_seed_states
from unison.keras.ops import broadcast_variables
from unison.keras.optimizer import run_deferred_agreement

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "MetricAverageCallback", "ModelCheckpoint"]


def _sync_jax(model: Any) -> None:
    """On JAX, put the trainer's state back into the variables and have the next step read them again."""
    if keras.backend.backend() == "jax" and hasattr(model, "jax_state_sync"):
        model.jax_state_sync()
        model._jax_state_synced = True


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Every rank starts training from ``root_rank``'s model and optimizer variables.

    Args:
        root_rank: the rank whose values everyone takes (a rank of the job, in ``process_set``).
        device: accepted for Horovod's signature; the broadcast runs on host memory.
        process_set: broadcast within this set only: a model with tensor-parallel layers (each
            rank of a tensor group holds other shards) passes its data-parallel group, so each
            rank takes the values of its own shard's replica.

    Raises:
        ValueError: at ``fit``, on every rank, when the model holds layers split over a tensor
            group of several ranks and no ``process_set`` is given (rank 0's shards would
            overwrite every other rank's).
    """

    def __init__(self, root_rank: int = 0, device: str = "", process_set: Any = None) -> None:
        super().__init__()
        if not isinstance(root_rank, int) or not 0 <= root_rank < runtime.size():
            raise ValueError(f"BroadcastGlobalVariablesCallback(root_rank={root_rank!r}): pick a rank in "
                             f"[0, {runtime.size()})")
        self.root_rank, self.device, self.process_set = root_rank, device, process_set
        self._pending = False

    def on_train_begin(self, logs: Any = None) -> None:
        check_broadcast_target(self.model, self.root_rank, self.process_set)
        # a model without an Input is still unbuilt here on the TensorFlow backend (Keras builds it in the
        # first step there): it is broadcast after that step, as Horovod does (before 2026-12-05 nothing
        # was broadcast and the ranks trained apart)
        self._pending = not self._broadcast("unison.keras.BroadcastGlobalVariables")

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._pending:
            self._pending = False
            self._broadcast("unison.keras.BroadcastGlobalVariables.built")

    def _broadcast(self, name: str) -> bool:
        """Broadcast the model's and optimizer's variables, unless some rank's model is still unbuilt."""
        optimizer_variables = agreed_optimizer_variables(self.model, self.process_set, name)
        if optimizer_variables is None:
            return False
        variables = without_seed_states(self.model, list(self.model.variables))  # random state stays each rank's
        broadcast_variables(variables + optimizer_variables, self.root_rank, self.process_set)
        return True


def agreed_optimizer_variables(model: Any, process_set: Any, name: str) -> list[Any] | None:
    """What both broadcast callbacks send with ``model``'s variables, the same on every rank (collective):
    None while some rank's model is still unbuilt (broadcast after the first step), no variable while no
    rank's optimizer is built (the first step builds them alike from the same weights), else every rank's
    optimizer variables, built where they were not.

    [Note: ranks that restored alone]
    Horovod's resume pattern restores the checkpoint on rank 0 alone (``if rank == 0: model =
    hvd.load_model(path)``): rank 0's optimizer is built, holding its state, the others' are not (on
    TensorFlow Keras builds it in the first step). Before 2026-12-07 the ranks then sent different lists
    of variables (a ``MismatchError`` blaming the model), or the model was broadcast at once and the
    optimizer only after the first step, which ran rank 0's moments against fresh ones elsewhere (the
    ranks' weights ended apart). The ranks compare, every rank builds its optimizer over the model's
    trainable variables where some rank's is built, and the model and optimizer go together.

    Raises:
        ValueError: on every rank, when some ranks' optimizer is built and other ranks' model has none.
    """
    optimizer = getattr(model, "optimizer", None)
    mine = (bool(model.variables), optimizer is not None, bool(optimizer is not None and optimizer.built))
    everyone = objects.allgather_object(mine, name, process_set)
    if not all(built_model for built_model, _, _ in everyone):
        return None
    if not any(built for _, _, built in everyone):
        return []
    lacking = [r for r, (_, has, _) in enumerate(everyone) if not has]
    if lacking:
        raise ValueError(f"BroadcastGlobalVariablesCallback: the model has no optimizer on ranks {lacking} (of "
                         f"the set) while others hold one with its state to broadcast; compile the model on every "
                         "rank (with the same optimizer) before fit")
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    run_deferred_agreement(optimizer)  # where the others' builds just ran theirs (tf_backend's optimizer)
    return list(optimizer.variables)


def check_broadcast_target(model: Any, root_rank: int, process_set: Any) -> None:
    """What both broadcast callbacks check before broadcasting ``model``'s variables: a model
    with tensor-parallel layers needs a ``process_set`` (its data-parallel group), and the root
    must be in every rank's set; raised on every rank."""
    split = split_layers(model)
    if split and process_set is None:
        raise ValueError(f"BroadcastGlobalVariablesCallback: the model's layers {split[:3]} are split over "
                         f"a tensor group, so each rank holds other shards and rank {root_rank}'s would "
                         "overwrite them; pass process_set= the data-parallel group (e.g. "
                         "Grid(...).register().dp), whose ranks hold the same shards")
    if process_set is not None:
        check_root_everywhere(root_rank, process_set, "BroadcastGlobalVariablesCallback")


def check_root_everywhere(root_rank: int, process_set: Any, what: str) -> None:
    """Raise on every rank when ``root_rank`` is not in some rank's ``process_set`` (each rank may
    pass its own set: the ranks whose set holds the root would go on and wait for the others)."""
    from unison.common.engine.objects import allgather_object

    ranks = getattr(process_set, "ranks", None)
    mine = None if ranks is None or root_rank in ranks else (
        f"root_rank={root_rank} is not a member of its {process_set!r}")
    everyone = allgather_object(mine, name=f"unison.keras.{what}.root")
    bad = [(r, p) for r, p in enumerate(everyone) if p]
    if bad:
        raise ValueError(f"{what}: rank {bad[0][0]}: {bad[0][1]} (ranks {[r for r, _ in bad]}); as in Horovod, "
                         "root_rank is a rank of the job that belongs to the process set each rank passes, "
                         "e.g. sets.dp.ranks[0]")


def split_layers(model: Any) -> list[str]:
    """Names of ``model``'s layers that hold one shard of a layer split over several ranks (the
    tensor-parallel layers: a ``process_set`` and a group size ``tp`` above 1). The same list on
    every rank (the model is built alike everywhere)."""
    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=False)) if flatten is not None else []
    return [layer.name for layer in layers
            if getattr(layer, "process_set", None) is not None and int(getattr(layer, "tp", 1) or 1) > 1]


class MetricAverageCallback(keras.callbacks.Callback):
    """Average each epoch's logged metrics over the ranks, so every rank logs the same numbers.

    Args:
        device: accepted for Horovod's signature; the average runs on host memory.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = logs if logs is not None else {}
        # every numeric value, arrays too (F1Score(average=None) logs one per class: they were left
        # per rank), in one all-reduce, after every rank has checked that all log the same ones
        values = {k: _numeric(v) for k, v in logs.items()}
        keys = sorted(k for k, v in values.items() if v is not None)
        check_same_metrics({k: list(values[k].shape) for k in keys}, epoch)
        if not keys:
            return
        flat = np.concatenate([values[k].reshape(-1) for k in keys]).astype(np.float64)
        averaged = np.asarray(frontend.allreduce(flat, Average, f"MetricAverage.{epoch}"))
        start = 0
        for key in keys:
            shape, size = values[key].shape, values[key].size
            part = averaged[start:start + size].reshape(shape)
            logs[key] = float(part) if not shape and isinstance(logs[key], (int, float, np.number)) else part
            start += size


def check_same_metrics(shapes: dict[str, list[int]], epoch: int) -> None:
    """Raise on every rank unless every rank logs the metrics ``shapes`` names, each of that shape.

    The values are averaged as one vector, by position: before 2026-12-05 ranks with as many metrics
    but different names (``mae`` here, ``mse`` there) averaged different metrics together silently.

    Raises:
        MismatchError: the ranks' metric names or shapes differ (each rank's are named).
    """
    every = objects.allgather_object(shapes, f"MetricAverage.{epoch}.keys")
    if any(other != shapes for other in every):
        views = "; ".join(f"rank {r}: {sorted(k)}" for r, k in enumerate(every))
        raise MismatchError(f"MetricAverageCallback averages the same metrics on every rank, but the ranks "
                            f"logged different ones at epoch {epoch} ({views}; shapes {every}); compile every "
                            "rank's model with the same metrics")


def _numeric(value: Any) -> np.ndarray | None:
    """A logged value as a float array (a number, a numpy array or a backend tensor); None otherwise."""
    if isinstance(value, (bool, str, bytes)) or value is None:
        return None
    try:
        arr = np.asarray(value if isinstance(value, (int, float, np.generic, np.ndarray))
                         else keras.ops.convert_to_numpy(value))
    except (TypeError, ValueError):
        return None
    return arr if arr.dtype.kind in "fiu" else None


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from about ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    ``lr(e) = initial_lr * (e * (size - 1) / warmup_epochs + 1) / size`` for the fractional epoch
    ``e < warmup_epochs``, then ``initial_lr``. As Horovod's: with ``steps_per_epoch`` (given, or read
    from ``fit``'s parameters) the rate is set before every batch ``b`` of epoch ``E`` at
    ``e = E + (b + 1) / steps_per_epoch``, so the last batch of epoch ``warmup_epochs - 1`` runs at
    ``initial_lr`` (the formula without the step reached it one step late: a checkpoint at the end of
    the warmup held a lower rate); without it, at every epoch's start at ``e = E + 1``. Epoch
    ``warmup_epochs`` starts at ``initial_lr``; later epochs are left to other callbacks.

    Args:
        initial_lr: the learning rate after the warmup (usually size x one process's).
        warmup_epochs: epochs the ramp lasts.
        momentum_correction: accepted for Horovod's signature. Keras 3 optimizers compile
            their momentum into the step as a constant, so it is not rescaled.
        steps_per_epoch: batches per epoch (default: ``fit``'s, when it knows them).
        verbose: print (rank 0) when the warmup ends.

    At each epoch's end ``logs["lr"]`` holds the rate, as Horovod's.

    Raises:
        ValueError: at construction, for ``warmup_epochs`` not above 0 or ``steps_per_epoch`` below 1.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__()
        check_warmup_arguments(warmup_epochs, steps_per_epoch)
        self.initial_lr, self.warmup_epochs = float(initial_lr), warmup_epochs
        self.momentum_correction, self.steps_per_epoch = momentum_correction, steps_per_epoch
        self.verbose = verbose
        self._epoch = 0
        self._steps: int | None = steps_per_epoch

    def rate(self, epoch: float) -> float:
        """The learning rate at (fractional) ``epoch``."""
        if epoch >= self.warmup_epochs:
            return self.initial_lr
        size = runtime.size()
        return self.initial_lr * (epoch * (size - 1) / self.warmup_epochs + 1) / size

    def _set(self, epoch: float) -> None:
        _sync_jax(self.model)
        self.model.optimizer.learning_rate.assign(self.rate(epoch))

    def on_train_begin(self, logs: Any = None) -> None:
        self._steps = self.steps_per_epoch or (self.params or {}).get("steps") or None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch
        if epoch == self.warmup_epochs:
            self._set(epoch)  # initial_lr, once: later changes (a decay, ReduceLROnPlateau) are the user's
        elif epoch < self.warmup_epochs and not self._steps:
            self._set(epoch + 1)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self._steps and self._epoch < self.warmup_epochs:
            self._set(self._epoch + (batch + 1) / self._steps)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:  # as Horovod's (History shows it): before 2026-12-07 this one did not log it
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if epoch == self.warmup_epochs - 1 and self.verbose and runtime.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished learning-rate warmup to {self.initial_lr:g}.")


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod 0.28's schedule, on every backend: ``lr = initial_lr * multiplier(epoch)`` while
    ``start_epoch <= epoch < end_epoch`` (outside that range the rate is left as it is).

    A number ``multiplier`` m means ``m ** (epoch - start_epoch)`` (exponential decay from ``initial_lr`` at
    ``start_epoch``, as Horovod since 0.23; before 2026-12-07 ``m ** epoch``, so a schedule starting at
    epoch 2 started at ``initial_lr * m ** 2``); a function gets the epoch. With
    ``staircase`` the rate is set at the first batch of each epoch; otherwise at every batch, from the
    fractional epoch ``epoch + batch / steps_per_epoch`` (``steps_per_epoch`` read from ``fit`` when not
    given). At each epoch's end ``logs["lr"]`` holds the rate. ``momentum_correction`` is accepted for
    Horovod's signature and not applied: a Keras 3 optimizer compiles its momentum into the step.

    Raises:
        ValueError: at construction, for an ``initial_lr`` of None, a ``multiplier`` neither a number nor a
            function, an ``end_epoch`` before ``start_epoch`` or a ``steps_per_epoch`` below 1.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("LearningRateScheduleCallback needs initial_lr (the rate the multiplier scales)")
        check_schedule_arguments(multiplier, start_epoch, end_epoch, steps_per_epoch)
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (
            lambda epoch: multiplier ** (epoch - start_epoch))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(f"{type(self).__name__}: fit() did not say how many steps an epoch has; "
                                 "pass steps_per_epoch=")
            self.steps_per_epoch = steps

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch

    def _set(self, epoch: float) -> None:
        _sync_jax(self.model)
        self.model.optimizer.learning_rate.assign(self.initial_lr * self.multiplier(epoch))

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = self._epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set(epoch)
        else:
            self._set(epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


def _real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_steps(what: str, steps_per_epoch: Any) -> None:
    if steps_per_epoch is not None and (not isinstance(steps_per_epoch, (int, np.integer))
                                        or isinstance(steps_per_epoch, bool) or steps_per_epoch < 1):
        raise ValueError(f"{what}(steps_per_epoch={steps_per_epoch!r}): pass the number of batches of an epoch "
                         "(an int >= 1), or None to read it from fit")


def check_warmup_arguments(warmup_epochs: Any, steps_per_epoch: Any) -> None:
    """Refuse at construction what both warmup callbacks cannot ramp over (before 2026-12-07
    ``unison.tf_backend.keras``'s took ``warmup_epochs=0`` or ``-1``, silently no warmup, and a negative
    ``steps_per_epoch``, under which the rate rose past ``initial_lr``)."""
    if not _real(warmup_epochs) or not warmup_epochs > 0:
        raise ValueError(f"LearningRateWarmupCallback(warmup_epochs={warmup_epochs!r}): pass the number of "
                         "epochs the ramp lasts, a number > 0 (leave the callback out for no warmup)")
    _check_steps("LearningRateWarmupCallback", steps_per_epoch)


def check_schedule_arguments(multiplier: Any, start_epoch: Any, end_epoch: Any, steps_per_epoch: Any) -> None:
    """Refuse at construction what the schedule cannot follow (before 2026-12-07 taken: a ``multiplier``
    of None or ``"0.5"`` failed at the first batch, ``end_epoch`` before ``start_epoch`` did nothing)."""
    what = "LearningRateScheduleCallback"
    if not callable(multiplier) and not _real(multiplier):
        raise ValueError(f"{what}(multiplier={multiplier!r}): pass a number m (the rate decays as "
                         "m ** (epoch - start_epoch)) or a function of the epoch")
    if not _real(start_epoch):
        raise ValueError(f"{what}(start_epoch={start_epoch!r}): pass the epoch the schedule starts at (a number)")
    if end_epoch is not None and (not _real(end_epoch) or end_epoch < start_epoch):
        raise ValueError(f"{what}(start_epoch={start_epoch!r}, end_epoch={end_epoch!r}): end_epoch is the epoch "
                         "the schedule stops before: pass one >= start_epoch, or None to run to the end")
    _check_steps(what, steps_per_epoch)


@contextmanager
def _atomic_saves(model: Any) -> Iterator[None]:
    """Within the block, ``model.save``/``save_weights`` to a path write atomically and durably."""
    originals: dict[str, Callable[..., Any]] = {}
    for name in ("save", "save_weights"):
        original = getattr(model, name)
        originals[name] = original

        def atomic(filepath: Any, *args: Any, _save: Callable[..., Any] = original, **kwargs: Any) -> Any:
            return atomic_keras_save(_save, filepath, *args, **kwargs)

        object.__setattr__(model, name, atomic)
    try:
        yield
    finally:
        for name, original in originals.items():
            if getattr(original, "__self__", None) is model and original.__func__ is getattr(type(model), name):
                object.__delattr__(model, name)  # it was the class's method: drop the instance override
            else:
                object.__setattr__(model, name, original)


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ``ModelCheckpoint``, written by rank 0 only, atomically and durably; other ranks do nothing.

    Every argument is Keras's. With ``save_best_only`` the monitored value is rank 0's
    (global under ``DataParallel``; use :class:`MetricAverageCallback` before this one
    otherwise).
    """

    def _save_model(self, *args: Any, **kwargs: Any) -> Any:
        def save() -> Any:
            with _atomic_saves(self.model):
                return super(ModelCheckpoint, self)._save_model(*args, **kwargs)

        return rank0_saves("ModelCheckpoint", save)


def rank0_saves(what: str, save: Callable[[], Any]) -> Any:
    """``save()`` on rank 0, its outcome shared with every rank (collective: every rank calls it at the same
    point): a failure raises a ``UnisonError`` on every rank. Rank 0 alone raising (a full disk) left the
    others training on into a collective it never joined, or ending with the engine's "rank 0 shut down"
    instead of the reason (before 2026-12-06; found by an audit)."""
    from unison.keras._rank0 import shared_outcome

    # named for the deadlock check's report: Horovod's scripts add their checkpoint callback on rank 0 alone,
    # and this one must be on every rank (before 2026-12-07 the report named an unnamed broadcast)
    result, error, cause = shared_outcome(save, f"{what}: every rank passes this callback (rank 0 saves)")
    if error is not None:
        raise UnisonError(f"{what}: rank 0 could not save ({error}); every rank stops so that none goes on "
                          "without the checkpoint: give it a path rank 0 can write, with free space") from cause
    return result
