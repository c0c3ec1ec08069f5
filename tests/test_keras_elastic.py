"""The elastic Keras state and callbacks in one process (the multi-rank recovery is in
tests/test_elastic_mpi.py::test_keras_fit_loses_a_rank_twice)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")

from unison.tf_backend import elastic  # noqa: E402


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    net.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    return net


def _state(net: keras.Model, **values: int) -> elastic.KerasState:
    state = elastic.KerasState(net, **values)
    state._bcast_object = lambda obj, root_rank=0: obj  # one process: nothing to broadcast
    return state


def _fit(net: keras.Model, callbacks: list, **kwargs: int) -> None:
    x = np.arange(24, dtype="float32").reshape(8, 3) / 10
    net.fit(x, x[:, :2], batch_size=2, shuffle=False, verbose=0, callbacks=callbacks, **kwargs)


def test_commit_and_restore_cover_the_model_and_the_optimizer_slots() -> None:
    net = _model()
    state = _state(net, epoch=0, batch=0)
    assert len(net.optimizer.variables) > 2  # built when the state was made: slots exist
    before_w = [w.copy() for w in net.get_weights()]
    before_opt = [v.numpy().copy() for v in net.optimizer.variables]
    _fit(net, [], epochs=1)
    assert not np.allclose(before_w[0], net.get_weights()[0])
    state.restore()
    for got, want in zip(net.get_weights(), before_w, strict=True):
        np.testing.assert_array_equal(got, want)
    for var, want in zip(net.optimizer.variables, before_opt, strict=True):
        np.testing.assert_array_equal(var.numpy(), want)  # iterations and Adam's moments too


def test_a_commit_copies_into_the_last_commits_arrays() -> None:
    net = _model()
    state = _state(net, epoch=0, batch=0)
    first_model, first_opt = list(state._saved_model), list(state._saved_optimizer)
    _fit(net, [], epochs=1)
    state.commit()
    assert all(a is b for a, b in zip(state._saved_model, first_model, strict=True))  # no fresh memory
    assert all(a is b for a, b in zip(state._saved_optimizer, first_opt, strict=True))
    committed = [w.copy() for w in net.get_weights()]
    for got, want in zip(state._saved_model, committed, strict=True):
        np.testing.assert_array_equal(got, want)
    _fit(net, [], epochs=1)  # training after the commit leaves it alone
    np.testing.assert_array_equal(state._saved_model[0], committed[0])
    state.restore()
    for got, want in zip(net.get_weights(), committed, strict=True):
        np.testing.assert_array_equal(got, want)


def _record_commits(state) -> list[tuple[int, int]]:
    """The (epoch, batch) of every commit ``state`` makes from now on."""
    commits: list[tuple[int, int]] = []
    save = state.save
    state.save = lambda: (commits.append((state.epoch, state.batch)), save())[1]
    return commits


def _commit_callbacks(state, batches_per_commit: int) -> list:
    return [elastic.UpdateBatchStateCallback(state), elastic.UpdateEpochStateCallback(state),
            elastic.CommitStateCallback(state, batches_per_commit=batches_per_commit)]


def test_callbacks_count_batches_and_epochs_and_commit() -> None:
    net = _model()
    state = _state(net, epoch=0, batch=0)
    commits = _record_commits(state)
    callbacks = _commit_callbacks(state, 3)
    _fit(net, callbacks, epochs=2)  # 4 batches an epoch
    assert (state.epoch, state.batch) == (2, 0)
    # at epoch ends, and 3 batches after the last commit
    assert commits == [(0, 3), (1, 0), (1, 3), (2, 0)]


def test_commits_count_batches_with_several_steps_per_execution() -> None:
    # Keras calls the batch callbacks once per execution: counting calls committed every
    # steps_per_execution * batches_per_commit batches
    net = _model()
    net.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse", steps_per_execution=2)
    state = _state(net, epoch=0, batch=0)
    commits = _record_commits(state)
    callbacks = _commit_callbacks(state, 2)
    _fit(net, callbacks, epochs=1)  # 4 batches, in 2 executions
    assert commits == [(0, 2), (1, 0)]  # (none at the epoch's last batch: see the next test)


def test_no_commit_at_an_epochs_last_batch_only_at_its_end() -> None:
    """Before: with 4 batches an epoch and a commit every 2, batch 4 committed (epoch 0, batch 4); a failure before
    the epoch's end resumed into an empty fit of the epoch's rest, which Keras counts as one more step."""
    net = _model()
    state = _state(net, epoch=0, batch=0)
    commits = _record_commits(state)
    callbacks = _commit_callbacks(state, 2)
    _fit(net, callbacks, epochs=2)  # 4 batches an epoch
    assert commits == [(0, 2), (1, 0), (1, 2), (2, 0)]


@pytest.mark.parametrize("style", ["relative", "initial_epoch"])
def test_a_resumed_fit_continues_the_counts(style: str) -> None:
    """After a reset at epoch 1, batch 2: the rest of the epoch, then the last epoch, either way
    of counting epochs that Keras allows."""
    net = _model()
    state = _state(net, epoch=1, batch=2)
    callbacks = [elastic.UpdateBatchStateCallback(state), elastic.UpdateEpochStateCallback(state)]
    seen = []
    callbacks.append(keras.callbacks.LambdaCallback(on_batch_end=lambda b, logs: seen.append(
        (state.epoch, state.batch))))
    x = np.zeros((8, 3), "float32")
    rest = {"relative": {"epochs": 1}, "initial_epoch": {"initial_epoch": 1, "epochs": 2}}[style]
    net.fit(x[4:], x[4:, :2], batch_size=2, verbose=0, callbacks=callbacks, **rest)
    assert seen == [(1, 3), (1, 4)] and (state.epoch, state.batch) == (2, 0)
    last = {"relative": {"epochs": 1}, "initial_epoch": {"initial_epoch": 2, "epochs": 3}}[style]
    net.fit(x, x[:, :2], batch_size=2, verbose=0, callbacks=callbacks, **last)
    assert (state.epoch, state.batch) == (3, 0)


def test_reset_drops_the_traced_step_functions() -> None:
    net = _model()
    state = _state(net, epoch=0)
    _fit(net, [], epochs=1)
    assert net.train_function is not None
    state.reset()
    assert net.train_function is None and net.predict_function is None


def test_a_state_made_before_compile_commits_the_optimizer_compile_gives() -> None:
    # it kept model.optimizer as it was when made (None): no optimizer variable was ever committed,
    # so a restore left Adam's moments and step count where the failed steps took them
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    state = _state(net, epoch=0)
    net.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    _fit(net, [], epochs=1)
    state.commit()
    committed = [v.numpy().copy() for v in net.optimizer.variables]
    assert int(net.optimizer.iterations.numpy()) == 4
    _fit(net, [], epochs=1)
    state.restore()
    assert int(net.optimizer.iterations.numpy()) == 4
    for var, want in zip(net.optimizer.variables, committed, strict=True):
        np.testing.assert_array_equal(var.numpy(), want)
    net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")  # another optimizer after the commit
    with pytest.raises(ValueError, match="compiled with another optimizer after the last commit"):
        state.restore()
    state.commit()
    state.restore()


def test_horovods_backend_argument_is_accepted() -> None:
    """Before: Horovod's ``TensorFlowKerasState(model, optimizer, backend=...)`` took the module for a value to
    commit, and failed copying it."""
    net = _model()
    state = elastic.TensorFlowKerasState(net, net.optimizer, backend=keras.backend, epoch=3)
    assert state.epoch == 3 and not hasattr(state, "backend")
    state.save()
    state.epoch = 4
    state.restore()
    assert state.epoch == 3
    variables = elastic.TensorFlowState(net.weights, session=None, step=1)  # Horovod's TF1 argument, unused
    assert variables.step == 1 and not hasattr(variables, "session")
    with pytest.raises(ValueError, match="session"):
        elastic.TensorFlowState(net.weights, session=object())


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="batches_per_commit must be a positive int; got 0"):
        elastic.CommitStateCallback(elastic.ObjectState(), batches_per_commit=0)
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="is not built.*model.build"):
        elastic.KerasState(unbuilt)
