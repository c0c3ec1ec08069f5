"""Horovod's elastic API for TensorFlow and Keras 3 (``hvd.elastic``): in-place recovery on ULFM.

    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @hvd.elastic.run
    def train(state):
        if state.batch:                       # finish the epoch a failure cut short
            model.fit(dataset.skip(state.batch).take(steps - state.batch), epochs=1,
                      callbacks=callbacks)
        model.fit(dataset.take(steps), epochs=epochs - state.epoch, callbacks=callbacks)

    train(state)

When a rank dies (``unisonrun --elastic``), the survivors' pending collectives fail inside
the training step; TensorFlow hands that on as an ``OpError``, which :func:`run` turns back
into :class:`UnisonInternalError`. ``run`` then restores the last commit, rebuilds Unison
on the survivors (``unison.common.elastic.recover``), broadcasts the state from the new
rank 0, forgets the model's traced step functions (they hold the old number of ranks) and
calls ``train`` again. See docs/elastic.md ([Note: elastic Keras]).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from unison.common import runtime
from unison.common.elastic import ObjectState, agree_structure, recover, run_fn
from unison.common.elastic import State as _State
from unison.common.engine import frontend
from unison.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt, UnisonInternalError

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "KerasState",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "UnisonInternalError", "HorovodInternalError", "HostsUpdatedInterrupt"]

logger = logging.getLogger(__name__)

State = _State

# [Note: elastic Keras]
# A peer's death reaches the training step inside TensorFlow: the collective's numpy_function
# raises UnisonInternalError, and TensorFlow re-raises it as an OpError (UnknownError) with the
# original type only in its text. ``run`` asks the engine instead of parsing text: an engine
# that stopped because a rank failed says so (its exit error is a UnisonInternalError).
# A traced train step (model.fit's train_function, a tf.function of the user's) holds the
# number of ranks it was traced with (the average's divisor, the strategy's split of each
# global batch), so after a reset the model's step functions are dropped and traced again.


def _engine_failure() -> UnisonInternalError | None:
    """The engine's reason for stopping, when a rank's failure stopped it; else None."""
    st = runtime._state
    eng = st.cache.get("engine") if st is not None else None
    if eng is None or eng.alive():
        return None
    error = eng.exit_error()
    return error if isinstance(error, UnisonInternalError) else None


def _translated(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with an ``OpError`` caused by a failed rank raised as :class:`UnisonInternalError`."""

    @functools.wraps(func)
    def call(state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            failure = _engine_failure()
            if failure is None and "UnisonInternalError" not in str(exc):
                raise
            error = failure or UnisonInternalError(f"a rank of the job failed: {exc.message}")
            raise error from exc

    return call


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``func(state, ...)`` and recover in place when a rank fails (Horovod's ``run``)."""
    return run_fn(_translated(func), recover)


def _numpy(variables: Iterable[Any], saved: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Host copies of the variables' values, written into ``saved``'s arrays where shape and dtype match.

    As the torch backend's commits (``_copy_into`` there): fresh memory for every commit is paid in
    page faults; copying into the last commit's arrays is not. The caller makes sure nothing still
    reads ``saved`` (the background spill of the last commit).
    """
    out = []
    for i, var in enumerate(variables):
        value = np.asarray(var.numpy())
        old = saved[i] if saved is not None and i < len(saved) else None
        if (isinstance(old, np.ndarray) and old.shape == value.shape and old.dtype == value.dtype
                and old.flags.writeable and old.flags.c_contiguous and not np.shares_memory(old, value)):
            np.copyto(old, value)
            out.append(old)
        else:
            out.append(np.array(value, copy=True))
    return out


def _assign(variables: list[Any], values: list[np.ndarray], what: str) -> None:
    if len(variables) != len(values):
        raise ValueError(f"elastic: the {what} has {len(variables)} variables but its commit holds "
                         f"{len(values)}; variables were created after the commit. Build the model and "
                         "its optimizer before creating the state (model.build / optimizer.build)")
    for var, value in zip(variables, values, strict=True):
        var.assign(value)


def _broadcast(variables: list[Any], tag: str) -> None:
    """Rank 0's values to every rank, one named broadcast per variable, once every rank has been seen
    to hold as many variables of the same shapes and dtypes (by position: Keras's generated names
    may differ between processes)."""
    agree_structure(tag, [(i, tuple(var.shape), str(var.dtype)) for i, var in enumerate(variables)])
    for i, var in enumerate(variables):
        value = frontend.broadcast(np.asarray(var.numpy()), 0, f"elastic.{tag}.{i}")
        var.assign(np.asarray(value).reshape(var.shape))


class TensorFlowState(ObjectState):
    """TensorFlow variables and picklable values, committed in memory (Horovod's name).

    Args:
        variables: the ``tf.Variable`` s to commit (all of ``tf.compat.v1`` global variables
            has no meaning in TF 2: pass them).
        session: Horovod's TF1 session argument: None (TensorFlow 2 runs eagerly); a session is
            refused.
        **kwargs: picklable values, kept as attributes.
    """

    def __init__(self, variables: Iterable[Any] | None = None, session: Any = None, **kwargs: Any) -> None:
        if session is not None:
            raise ValueError(f"TensorFlowState(session={session!r}): TensorFlow 1 sessions are not supported; "
                             "run eagerly (TensorFlow 2) and leave session=None")
        self.variables = list(variables or [])
        self._saved_variables = _numpy(self.variables)
        super().__init__(**kwargs)

    def save(self) -> None:
        self.wait_for_spill()
        self._saved_variables = _numpy(self.variables, self._saved_variables)
        super().save()

    def restore(self) -> None:
        _assign(self.variables, self._saved_variables, "state")
        super().restore()

    def sync(self) -> None:
        self.agree_before_sync()
        _broadcast(self.variables, "variables")
        self._sync_values()
        self.save()

    def commit_payload(self) -> dict[str, Any]:
        return {**super().commit_payload(), "variables": self._saved_variables}

    def load_commit(self, payload: dict[str, Any]) -> None:
        super().load_commit(payload)
        self._saved_variables = payload["variables"]


class TensorFlowKerasState(ObjectState):
    """A Keras model, its optimizer and picklable values, committed in memory (Horovod's name).

    ``commit()`` copies every weight of the model and every variable of the optimizer
    (its step count and slots) to host memory; ``restore()`` assigns the copies back;
    ``sync()`` broadcasts rank 0's values. The optimizer is built on the model's trainable
    weights when the state is made (Keras would build it at the first step), so a commit
    made before training holds its slots too. A ``reset`` drops the model's traced step
    functions ([Note: elastic Keras]).

    Args:
        model: a built Keras model.
        optimizer: its optimizer; when None, ``model.optimizer`` as it is at each commit, restore
            and sync (so a state made before ``compile`` commits the optimizer compile gives).
        backend: Horovod's argument (the Keras backend module, which Horovod's uses for TF1
            sessions); accepted and not needed: Keras 3 reads and assigns the variables itself.
            (Before 2026-12-07 it was taken for a value to commit, and the module could not be copied.)
        **kwargs: picklable values, kept as attributes (``epoch=0, batch=0``).

    Raises:
        ValueError: the model is not built, or its optimizer is a ZeRO optimizer (its shards
            are laid out for the old number of ranks).
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not model.built:
            raise ValueError(f"elastic: the model {model.name!r} is not built, so it has no weights to "
                             "commit; call model.build(input_shape) (or run it once) before the state")
        self.model = model
        #: no optimizer given: the model's, looked up at every commit (a compile after the state was
        #: made, or a new one, gives it another; the commit then holds the new one's variables)
        self._follows_model = optimizer is None
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._check_optimizer()
        self._saved_model = _numpy(model.weights)
        self._saved_optimizer = _numpy(self._optimizer_variables())
        self._saved_for = self.optimizer  # the optimizer whose variables _saved_optimizer holds
        super().__init__(**kwargs)

    def _check_optimizer(self) -> None:
        from unison.tf_backend import zero_optimizer

        stage = zero_optimizer.stage_of(self.optimizer)
        if stage:
            raise ValueError(f"elastic training with a ZeRO optimizer (zero_stage={stage}) "
                             "is not supported: its shards are laid out for the old number of ranks. Use "
                             "zero_stage=0 with hvd.elastic, or resume from hvd.save_sharded checkpoints")
        self._build_optimizer()

    def _follow(self) -> None:
        """Take up the model's optimizer when it is another one than the state knows (see __init__)."""
        if self._follows_model:
            current = getattr(self.model, "optimizer", None)
            if current is not self.optimizer:
                self.optimizer = current
                self._check_optimizer()

    def _build_optimizer(self) -> None:
        opt = self.optimizer
        if opt is None or getattr(opt, "built", True):
            return
        strategy = getattr(self.model, "_distribute_strategy", None)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            opt.build(self.model.trainable_variables)

    def _optimizer_variables(self) -> list[Any]:
        return list(self.optimizer.variables) if self.optimizer is not None else []

    def save(self) -> None:
        self.wait_for_spill()
        self._follow()
        self._saved_model = _numpy(self.model.weights, self._saved_model)
        self._saved_optimizer = _numpy(self._optimizer_variables(),
                                       self._saved_optimizer if self._saved_for is self.optimizer else None)
        self._saved_for = self.optimizer
        super().save()

    def restore(self) -> None:
        self._follow()
        if self._saved_for is not self.optimizer:
            raise ValueError("elastic: the model was compiled with another optimizer after the last commit, "
                             "so the commit holds none of its variables; commit after compiling")
        _assign(list(self.model.weights), self._saved_model, "model")
        _assign(self._optimizer_variables(), self._saved_optimizer, "optimizer")
        super().restore()

    def sync(self) -> None:
        self._follow()
        self.agree_before_sync()
        _broadcast(list(self.model.weights), "model")
        _broadcast(self._optimizer_variables(), "optimizer")
        self._sync_values()
        self.save()

    def commit_payload(self) -> dict[str, Any]:
        return {**super().commit_payload(), "model": self._saved_model, "optimizer": self._saved_optimizer}

    def load_commit(self, payload: dict[str, Any]) -> None:
        super().load_commit(payload)
        self._follow()
        self._saved_model, self._saved_optimizer = payload["model"], payload["optimizer"]
        self._saved_for = self.optimizer

    def reset(self) -> None:
        for name in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, name):
                setattr(self.model, name, None)


KerasState = TensorFlowKerasState


class CommitStateCallback(keras.callbacks.Callback):
    """Commit the state at every epoch's end and every ``batches_per_commit`` batches after the
    last commit (the count restarts at each ``fit`` and each epoch).

    Put it after :class:`UpdateBatchStateCallback` and :class:`UpdateEpochStateCallback` in
    the callback list (Keras calls them in order), so a commit holds the updated counters.
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be a positive int; got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._committed_at = 0  # batches of this epoch (in this fit) done at the last commit

    def on_train_begin(self, logs: Any = None) -> None:
        self._committed_at = 0  # every rank counts from the same point after a reset

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        # counted from the batch index Keras reports, not from the calls: with steps_per_execution=k
        # Keras calls once per k batches (reporting the last one), and a count of calls committed
        # every k * batches_per_commit batches
        done = batch + 1
        if done == (self.params or {}).get("steps"):
            # the epoch's end commits next, with the epoch counted; a commit here held a finished epoch as
            # "state.batch = every batch", and a resume then ran an empty fit (which Keras still counts as a step)
            return
        if done - self._committed_at >= self.batches_per_commit:
            self.state.commit()
            self._committed_at = done

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()
        self._committed_at = 0  # the next commit is batches_per_commit after this one


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` = the batches of the current epoch finished so far.

    A ``fit`` that starts while ``state.batch > 0`` is taken to run the rest of that epoch
    (the dataset given to it skips the ``state.batch`` batches already done), so the count
    goes on from there. ``state.batch`` is back to 0 at the epoch's end. (Horovod's callback
    stores the last batch's index instead; the count is what a resume needs.)
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self._offset = 0

    def on_train_begin(self, logs: Any = None) -> None:
        self._offset = int(self.state.batch)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = self._offset + batch + 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0
        self._offset = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` = the epochs finished, across resets.

    Works whether ``fit`` counts epochs from 0 (``epochs=total - state.epoch``, as in Horovod's
    examples) or from the state (``initial_epoch=state.epoch, epochs=total``): the first epoch
    Keras reports is matched to ``state.epoch``.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self._offset: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self._offset = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self._offset is None:
            self._offset = int(self.state.epoch) - epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = (self._offset or 0) + epoch + 1
