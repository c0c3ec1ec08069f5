"""unison.keras on the active Keras backend (KERAS_BACKEND: tensorflow, jax or torch) under mpirun.

Every data-parallel result is compared with one process training the same model,
from rank 0's initial weights, on the same global batches.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import keras
import numpy as np
import pytest
from mpi4py import MPI

import unison.keras as uk
from unison.keras import data as ukdata

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
BACKEND = keras.backend.backend()
GLOBAL_BATCH = 8 * N
rs = np.random.RandomState(0)
X = rs.randn(GLOBAL_BATCH * 5 - 3, 4).astype("float32")  # the last global batch is ragged
Y = (X[:, 1:] @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.1).astype("float32")
LABELS = (X[:, 0] > 0).astype("int64") + (X[:, 1] > 0.5).astype("int64")  # 3 classes


def make_model(batchnorm: bool = False, classes: int = 0) -> keras.Model:
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="tanh")]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization())
    layers.append(keras.layers.Dense(classes or 1, activation="softmax" if classes else None))
    return keras.Sequential(layers)


def same_everywhere(arrays: list[np.ndarray]) -> bool:
    flat = np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])
    return all(np.array_equal(flat, other) for other in WORLD.allgather(flat))


def assert_weights_close(a: keras.Model, b: keras.Model, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    for w, v in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=rtol, atol=atol)


def distributed_and_reference(dp, optimizer, **model_kwargs):
    keras.utils.set_random_seed(100 + R)  # ranks start differently: the broadcast must fix it
    with dp.scope():
        model = make_model(**model_kwargs)
        model.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    ref = make_model(**model_kwargs)
    ref.set_weights(WORLD.bcast(model.get_weights()))
    ref.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    return model, ref


@pytest.fixture(scope="module", autouse=True)
def _init():
    uk.init()  # (DataParallel() also does it: a run of only the Horovod-style tests needs it here)


@pytest.fixture(scope="module")
def dp():
    return uk.DataParallel()


@pytest.mark.parametrize("optimizer", [lambda: keras.optimizers.SGD(0.05, momentum=0.5),
                                       lambda: keras.optimizers.Adam(0.01)], ids=["sgd", "adam"])
def test_fit_equals_one_process_on_the_global_batches(dp, optimizer):
    model, ref = distributed_and_reference(dp, optimizer)
    hist = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0)
    want = ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0)
    for key in ("loss", "mae"):  # global loss and metric, per epoch, on every rank
        np.testing.assert_allclose(hist.history[key], want.history[key], rtol=2e-5)
    assert_weights_close(model, ref)
    assert same_everywhere(model.get_weights())


def _numpy_values(variables) -> list[np.ndarray]:
    return [np.array(keras.ops.convert_to_numpy(v.value)) for v in variables]


def test_fit_starts_every_rank_from_rank_0s_weights_and_optimizer_state(dp):
    """broadcast_state: a second fit after the ranks' weights and Adam state (moments, iterations) drifted apart
    starts every rank from rank 0's, so the ranks end equal, and equal to one process continuing from rank 0's
    state. Every other test starts from a fresh optimizer, whose variables already agree: a broadcast that
    skipped the optimizer variables passed them all."""
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.Adam(0.01))
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    optimizer = model.optimizer
    if R != 0:  # other weights, step count, learning rate and moments than rank 0's
        model.set_weights([w + 0.5 * (R + 1) for w in model.get_weights()])
        for v, value in zip(optimizer.variables, _numpy_values(optimizer.variables), strict=True):
            other = np.full_like(value, 7 + R) if v.path.endswith("iteration") else value * 3 + 0.1 * R
            v.assign(other.astype(value.dtype))
    # the reference continues from rank 0's state exactly (its own first fit only built its optimizer)
    ref.set_weights(WORLD.bcast(model.get_weights()))
    for v, value in zip(ref.optimizer.variables, WORLD.bcast(_numpy_values(optimizer.variables)), strict=True):
        v.assign(value)
    if N > 1:
        assert not same_everywhere(_numpy_values(optimizer.variables))
    hist = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    want = ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(hist.history["loss"], want.history["loss"], rtol=2e-5)
    assert same_everywhere(model.get_weights())
    assert same_everywhere(_numpy_values(optimizer.variables))
    assert_weights_close(model, ref)
    names = [v.path for v in optimizer.variables]  # (adam/iteration, adam/learning_rate, then each moment)
    assert [n.split("/")[-1] for n in names[:2]] == ["iteration", "learning_rate"], names
    assert len(names) == 2 + 2 * len(model.weights), names
    mine, theirs = _numpy_values(optimizer.variables), _numpy_values(ref.optimizer.variables)
    for name, got, expected in zip(names, mine, theirs, strict=True):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's jitted step only")
def test_jax_step_is_two_programs_without_a_host_callback_unless_the_class_has_its_own_step(dp, monkeypatch):
    """[Note: the JAX step in two programs]: Keras's own train_step runs as two jitted programs with
    the exchanges between them (gradients and metrics' states are summed between the programs:
    no gradient goes through an io_callback) and trains as one process does, with global loss and metrics,
    ragged last batch included, also with steps_per_execution=2; a class with its own train_step
    keeps the one program with the callback and trains the same. ``evaluate`` traces no callback
    either and reports the global loss and metrics."""
    import jax.experimental

    from unison.keras import _jax_step

    traced = []
    real = jax.experimental.io_callback
    def spy(callback, specs, *args, **kwargs):
        traced.extend(tuple(a.shape) for a in args)
        return real(callback, specs, *args, **kwargs)

    monkeypatch.setattr(jax.experimental, "io_callback", spy)

    class OwnStep(keras.Sequential):
        def train_step(self, state, data):
            return super().train_step(state, data)

    for cls, callbacks, per_call in ((keras.Sequential, 0, 1), (OwnStep, 1, 1), (keras.Sequential, 0, 2)):
        keras.utils.set_random_seed(100 + R)
        traced.clear()
        with dp.scope():
            model = cls(make_model().layers)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                          steps_per_execution=per_call)
        ref = cls(make_model().layers)
        ref.set_weights(WORLD.bcast(model.get_weights()))
        ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                    steps_per_execution=per_call)
        hist = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
        want = ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
        assert _jax_step.applies(model) is (callbacks == 0)
        if callbacks:  # the gradients (the first kernel's among them) go through the step's callback
            assert (4, 8) in traced, traced
        else:  # no gradient; only scalars: Keras's one-time shape inference of the metrics (eval_shape)
            assert all(shape == () for shape in traced), traced
        for key in ("loss", "mae"):
            np.testing.assert_allclose(hist.history[key], want.history[key], rtol=2e-5)
        assert_weights_close(model, ref)
        assert same_everywhere(model.get_weights())
        traced.clear()  # evaluate: Keras's own test step with this rank's metrics, logs from the summed states
        got = model.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
        expected = ref.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
        assert traced == [], traced
        for key in ("loss", "mae"):
            np.testing.assert_allclose(got[key], expected[key], rtol=2e-5)

def test_local_metrics_report_each_ranks_own_rows_while_training_stays_global():
    """``global_metrics=False``: each rank's loss is its own rows' (they differ across ranks), the
    update is still the global batch's (weights equal one process's, the same on every rank)."""
    local = uk.DataParallel(global_metrics=False)
    model, ref = distributed_and_reference(local, lambda: keras.optimizers.SGD(0.05))
    hist = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    losses = WORLD.allgather(hist.history["loss"])
    if N > 1:
        assert not all(np.allclose(losses[0], other) for other in losses[1:]), losses
    assert_weights_close(model, ref)
    assert same_everywhere(model.get_weights())

def test_torch_streams_gradients_during_backward(dp):
    if BACKEND != "torch":
        pytest.skip("torch only: the other backends reduce in the compiled step")
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    steps = -(-len(X) // GLOBAL_BATCH)
    assert model._unison_overlap.streamed == steps * len(model.trainable_weights)
    assert_weights_close(model, ref)
    quiet = uk.DataParallel(overlap_gradients=False)  # all at once in the optimizer: the same numbers
    plain, ref2 = distributed_and_reference(quiet, lambda: keras.optimizers.SGD(0.05))
    plain.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    ref2.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert plain._unison_overlap is None
    assert_weights_close(plain, ref2)
    # compiled again (the same optimizer): the hooks stay one per parameter, each gradient sent once
    before = model._unison_overlap.streamed
    with dp.scope():
        model.compile(optimizer=model.optimizer, loss="mse", metrics=["mae"])
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert model._unison_overlap.streamed - before == steps * len(model.trainable_weights)
    assert_weights_close(model, ref)


def test_shuffled_fit_reads_the_same_global_batches_as_one_process(dp):
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0)  # shuffle=True: rank 0's seed
    # one process reading the same input with the same seed (the permutations: numpy's on JAX and torch,
    # a stateless TensorFlow shuffle on TensorFlow)
    batches = ukdata.shard_input(X, Y, None, batch_size=GLOBAL_BATCH, rank=0, size=1, shuffle=True,
                                 seed=dp.last_fit_seed, class_weight=None, what="the reference")
    if BACKEND == "tensorflow":
        ref.fit(batches.dataset, steps_per_epoch=batches.plan.steps, epochs=2, verbose=0)
    else:
        ref.fit(batches, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, ref)
    assert same_everywhere(model.get_weights())


def test_a_given_steps_per_epoch_ends_an_epoch_where_the_shuffled_pass_runs_out(dp):
    """Before (TensorFlow): with shuffle=True and a steps_per_epoch not dividing a pass's 5 batches, every epoch
    ran 3 steps through the endless pipeline (9), where Keras ends the second epoch with the pass (3 + 2 + 3)."""
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=3, steps_per_epoch=3, verbose=0)
    plain = make_model()
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    plain.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=3, steps_per_epoch=3, verbose=0)  # Keras alone
    assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 8
    batches = ukdata.shard_input(X, Y, None, batch_size=GLOBAL_BATCH, rank=0, size=1, shuffle=True,
                                 seed=dp.last_fit_seed, class_weight=None, what="the reference")
    if BACKEND == "tensorflow":  # one process reading the same passes (a new permutation each)
        ref.fit(batches.one_pass_each(), steps_per_epoch=3, epochs=3, verbose=0)
    else:
        ref.fit(batches, steps_per_epoch=3, epochs=3, shuffle=False, verbose=0)
    assert_weights_close(model, ref)
    assert same_everywhere(model.get_weights())


def _rows_read_by_fit(data, steps_per_epoch: int, epochs: int) -> list[list[int]]:
    """The rows each epoch of ``fit`` reads, on every rank together: Keras's own epoch iterator driven as
    its fit drives it (a peek at the first batch, a reset, then each epoch's steps)."""
    from keras.src.trainers.epoch_iterator import EpochIterator

    it = EpochIterator(data, steps_per_epoch=steps_per_epoch)
    for _ in it.enumerate_epoch():
        break
    it.reset()
    epochs_read = []
    for _ in range(epochs):
        mine = []
        with it.catch_stop_iteration():
            for _, _, batches in it:
                mine += [int(v) for b in batches for v in np.asarray(b[0] if isinstance(b, tuple) else b).ravel()]
        epochs_read.append(sorted(sum(WORLD.allgather(mine), [])))
    return epochs_read


def test_shuffle_with_short_epochs_reads_every_row_once_per_pass():
    """Before: with steps_per_epoch below a pass's batches, Keras kept reading the pass where the last epoch
    stopped while Unison drew a new permutation every epoch, so some rows were read twice in a pass and others
    never (one process permutes once per pass)."""
    rows = GLOBAL_BATCH * 6  # 6 batches per pass; epochs of 4 steps read 4, 2 (the pass ends), 4, 2 batches
    ids = np.arange(rows, dtype="float32").reshape(-1, 1)
    data = ukdata.ShardedArrays(ids, ids, batch_size=GLOBAL_BATCH, rank=R, size=N, shuffle=True, seed=11)
    read = _rows_read_by_fit(data, steps_per_epoch=4, epochs=4)
    assert [len(e) for e in read] == [4 * GLOBAL_BATCH, 2 * GLOBAL_BATCH] * 2
    first, second = read[0] + read[1], read[2] + read[3]
    assert sorted(first) == list(range(rows)) and sorted(second) == list(range(rows))
    order = WORLD.allgather(data.order.tolist())
    assert all(o == order[0] for o in order) and order[0] != sorted(order[0])  # shuffled, alike everywhere

    class Batches(keras.utils.PyDataset):  # a PyDataset of global batches: the batches, once per pass
        def __len__(self):
            return 6

        def __getitem__(self, i):
            block = ids[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]
            return block, block

    read = _rows_read_by_fit(ukdata.ShardedPyDataset(Batches(), R, N, shuffle=True, seed=11), 4, 4)
    assert sorted(read[0] + read[1]) == list(range(rows)) and sorted(read[2] + read[3]) == list(range(rows))


def test_broadcast_callback_syncs_a_model_built_in_the_first_step():
    """Before: on the TensorFlow backend a model without an Input is unbuilt at on_train_begin, so nothing was
    broadcast and the ranks trained apart (Horovod broadcasts after the first batch)."""
    keras.utils.set_random_seed(40 + R)  # different initial weights on each rank
    model = keras.Sequential([keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=uk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    rows = slice(R * 8, (R + 1) * 8)
    model.fit(X[rows], Y[rows], batch_size=8, epochs=2, verbose=0, shuffle=False,
              callbacks=[uk.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert same_everywhere(model.get_weights())


def test_the_shuffling_seed_follows_keras_set_random_seed():
    """Before: a seeded script drew fresh entropy for DataParallel's shuffle, so no two runs agreed."""
    keras.utils.set_random_seed(1234 + R)  # (rank 0's wins, as for any seed)
    try:
        assert uk.DataParallel().seed() == 1234
        assert uk.DataParallel(seed=7).seed() == 7
    finally:  # (no global seed again, as before this test)
        from keras.src.backend.common import global_state

        global_state.set_global_attribute("global_random_seed", None)


def test_a_stop_decided_on_one_rank_stops_every_rank(dp):
    """Before: a callback stopping training on rank 0 only (EarlyStopping on local metrics, TerminateOnNaN on a
    rank's own loss) left the other ranks waiting in the next step's exchange for ever."""

    class StopOnRank0(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if R == 0 and epoch == 1:
                self.model.stop_training = True

    model, _ = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    history = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=5, shuffle=False, verbose=0,
                        callbacks=[StopOnRank0()])
    assert len(history.history["loss"]) == 2
    assert same_everywhere(model.get_weights())


def test_predict_with_steps_predicts_those_batches_as_one_process(dp):
    """Before: the gather expected every batch's rows and raised."""
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    got = model.predict(X, batch_size=GLOBAL_BATCH, steps=2, verbose=0)
    want = ref.predict(X, batch_size=GLOBAL_BATCH, steps=2, verbose=0)
    assert got.shape == want.shape == (2 * GLOBAL_BATCH, *want.shape[1:])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.skipif(BACKEND != "torch", reason="the streamed exchange (gradients sent during backward) is torch's")
def test_streamed_gradients_that_exist_on_some_ranks_only_reduce_like_one_process():
    """Before: with overlap_gradients (the default on torch) each rank waited for its own branch's reductions
    and the job hung. Rank r's rows take branch a when their mean is positive, else branch b."""

    class Branch(keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = keras.layers.Dense(2, name="a"), keras.layers.Dense(2, name="b")

        def call(self, x):
            positive = float(keras.ops.convert_to_numpy(keras.ops.mean(x))) > 0
            return self.a(x) if positive else self.b(x)

    rs = np.random.RandomState(0)
    xs = np.concatenate([np.abs(rs.randn(4, 4)) + 0.1, -np.abs(rs.randn(4 * (N - 1), 4)) - 0.1]).astype("float32")
    ys = rs.randn(4 * N, 2).astype("float32")
    results = []
    for overlap in (True, False):
        keras.utils.set_random_seed(3)
        with uk.DataParallel(overlap_gradients=overlap).scope():
            m = Branch()
            m.a.build((None, 4))
            m.b.build((None, 4))
            m.build((None, 4))
            m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", run_eagerly=True)
        m.fit(xs, ys, batch_size=4 * N, epochs=2, shuffle=False, verbose=0)
        results.append(m.get_weights())
    from keras.src.backend.common import global_state

    global_state.set_global_attribute("global_random_seed", None)
    for streamed, gathered in zip(*results, strict=True):  # the unstreamed path reduces with zeros (tested)
        np.testing.assert_allclose(streamed, gathered, rtol=1e-6, atol=1e-7)
    assert same_everywhere(results[0])


def test_class_weight_on_a_model_with_several_outputs_is_refused_as_keras():
    with pytest.raises(ValueError, match="only supported for Models with a single output"):
        ukdata._class_weights({"a": np.zeros(3), "b": np.ones(3)}, {0: 1.0})


def test_tensorflow_shuffled_rows_are_disjoint_and_complete_each_epoch(dp):
    if BACKEND != "tensorflow":
        pytest.skip("the tf.data path of arrays")
    from unison.common.data_parallel import BatchPlan
    from unison.keras._tf_data import arrays_dataset

    plan = BatchPlan(len(X), GLOBAL_BATCH, N)
    streams = [iter(arrays_dataset((X,), plan, r, True, dp.seed()).dataset) for r in range(N)]
    orders = []
    for _epoch in range(2):
        seen = np.concatenate([next(s).numpy() for _ in range(plan.steps) for s in streams])
        assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, X.tolist()))
        orders.append(seen)
    assert not np.array_equal(orders[0], orders[1])  # a new permutation each epoch


def test_shuffled_rows_are_disjoint_and_complete(dp):
    shards = [ukdata.ShardedArrays(X, batch_size=GLOBAL_BATCH, rank=r, size=N, shuffle=True, seed=dp.seed())
              for r in range(N)]
    for _epoch in range(2):
        seen = np.concatenate([s[i] for i in range(len(shards[0])) for s in shards])
        assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, X.tolist()))
        for s in shards:
            s.on_epoch_end()


class GlobalBatches(keras.utils.PyDataset):
    """The global batches of (X, Y), as a user's PyDataset would give them."""

    def __init__(self):
        super().__init__()

    def __len__(self):
        return -(-len(X) // GLOBAL_BATCH)

    def __getitem__(self, i):
        return X[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH], Y[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]


def global_batches(kind):
    """The global batches of (X, Y) as a ``tf.data.Dataset`` or a torch ``DataLoader``."""
    if kind == "tf.data":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
    import torch

    pairs = torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))
    return torch.utils.data.DataLoader(pairs, batch_size=GLOBAL_BATCH, shuffle=False)


@pytest.mark.parametrize("kind", ["pydataset", "tf.data", "DataLoader"])
def test_dataset_inputs_of_global_batches_train_like_one_process(dp, kind):
    """Every backend takes each input type through Keras's own adapters (the JAX and cross-backend cases were
    untested, and docs/keras_backends.md's matrix listed tf.data on TensorFlow and DataLoader on torch only,
    until 2026-12-06): each rank reads its rows of each global batch, and fit and evaluate equal one process."""
    source = GlobalBatches() if kind == "pydataset" else global_batches(kind)
    # each rank reads its rows [R*m//N, (R+1)*m//N) of each global batch of m rows (the last one ragged)
    mine = ukdata.shard_input(source, None, None, batch_size=None, rank=R, size=N, shuffle=False, seed=0,
                              class_weight=None, what="the test")
    read = [mine[i] for i in range(len(mine))] if kind != "tf.data" else [
        tuple(t.numpy() for t in batch) for batch in mine]
    steps = -(-len(X) // GLOBAL_BATCH)
    assert len(read) == steps
    for i, (x, y) in enumerate(read):
        m = min(GLOBAL_BATCH, len(X) - i * GLOBAL_BATCH)
        rows = slice(i * GLOBAL_BATCH + R * m // N, i * GLOBAL_BATCH + (R + 1) * m // N)
        np.testing.assert_array_equal(np.asarray(x), X[rows])
        np.testing.assert_array_equal(np.asarray(y), Y[rows])
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    hist = model.fit(source, epochs=2, verbose=0, shuffle=False)
    want = ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(hist.history["loss"], want.history["loss"], rtol=2e-5)
    assert_weights_close(model, ref)
    got = model.evaluate(source, verbose=0, return_dict=True)
    want = ref.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    np.testing.assert_allclose([got["loss"], got["mae"]], [want["loss"], want["mae"]], rtol=1e-5)
    # predict takes the inputs fit takes (it refused all but numpy arrays before 2026-12-06): the global
    # predictions, in order, on every rank
    out = model.predict(source, verbose=0)
    assert out.shape == (len(X), 1)
    np.testing.assert_allclose(out, ref.predict(X, batch_size=GLOBAL_BATCH, verbose=0), rtol=1e-5, atol=1e-6)
    assert same_everywhere([out])


class _SmallLastBatch(keras.utils.PyDataset):
    """Global batches of X of GLOBAL_BATCH rows, the last one with fewer rows than the ranks (N > 1)."""

    def __init__(self):
        super().__init__()
        self.rows = 2 * GLOBAL_BATCH + max(N - 1, 1)

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return X[i * GLOBAL_BATCH:min((i + 1) * GLOBAL_BATCH, self.rows)]


def test_dataset_inputs_predict_a_small_last_batch_and_steps_as_one_process(dp):
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    source = _SmallLastBatch()
    x = X[:source.rows]
    out = model.predict(source, verbose=0)
    np.testing.assert_allclose(out, ref.predict(x, batch_size=GLOBAL_BATCH, verbose=0), rtol=1e-5, atol=1e-6)
    out = model.predict(source, steps=2, verbose=0)
    np.testing.assert_allclose(out, ref.predict(x[:2 * GLOBAL_BATCH], batch_size=GLOBAL_BATCH, verbose=0),
                               rtol=1e-5, atol=1e-6)
    assert same_everywhere([out])


class _LastBatchLogs(keras.callbacks.Callback):
    """Each epoch's logs of its last batch, as a batch-level callback (TensorBoard, a logger) reads them."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(self._last))

    def on_train_batch_end(self, batch, logs=None):
        self._last = {k: float(v) for k, v in (logs or {}).items()}


@pytest.mark.skipif(N == 1, reason="needs a global batch with fewer rows than ranks")
def test_a_shadow_steps_batch_logs_and_a_users_negative_zero_weights_are_one_process_s(dp):
    """A review of the shadow shares (2026-12-07): the last batch's logs, which batch-level callbacks read,
    counted the shadows' rows in the metrics (their states were put back only after the step); and a user's
    sample weights of -0.0 (a whole global batch of them here) read as a shadow share, dropping those rows
    from the gradients' denominator. Both are one process's now."""
    rows = 2 * GLOBAL_BATCH + N - 1
    x, y = X[:rows], Y[:rows]
    weights = np.ones(rows, "float32")
    weights[:GLOBAL_BATCH] = -0.0
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    mine, theirs = _LastBatchLogs(), _LastBatchLogs()
    model.fit(x, y, sample_weight=weights, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[mine])
    ref.fit(x, y, sample_weight=weights, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
            callbacks=[theirs])
    for got, want in zip(mine.logs, theirs.logs, strict=True):
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)], rtol=2e-5)
    assert_weights_close(model, ref)


@pytest.mark.skipif(N == 1, reason="needs a global batch with fewer rows than ranks")
def test_a_step_of_the_users_that_unpacks_x_and_y_still_drops_a_small_last_batch(dp, caplog):
    """Shadows give every batch sample weights; a train_step of the user's written ``x, y = data`` (Keras's
    guide's) failed on the third part (found by a review). Such a model keeps the old rule: the rows of a last
    batch smaller than the ranks are skipped, with a warning on rank 0."""

    class TwoPartStep(keras.Sequential):
        def train_step(self, *args):
            data = args[-1]
            x, y = data  # (would raise with a third part)
            return super().train_step(*args[:-1], (x, y))

    keras.utils.set_random_seed(100 + R)
    with dp.scope():
        model = TwoPartStep(make_model().layers)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    rows = 2 * GLOBAL_BATCH + N - 1
    with caplog.at_level("WARNING"):
        hist = model.fit(X[:rows], Y[:rows], batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    assert (f"{N - 1} row(s) for {N} ranks" in caplog.text) is (R == 0)


@pytest.mark.skipif(N == 1, reason="needs a global batch with fewer rows than ranks")
def test_a_two_output_models_small_last_batch_trains_as_one_process(dp):
    """[Note: a shadow's metrics]: Keras tracks each output's loss apart from the metrics; a shadow's rows
    counted there (found 2026-12-07, before this commit). On TensorFlow those per-output losses are means per
    batch, not per row, so with a ragged split they are not one process's with or without shadows
    (docs/keras_backends.md); the total loss, the metrics and the weights are."""
    rows = 2 * GLOBAL_BATCH + N - 1
    x, ys = X[:rows], [Y[:rows], Y[:rows] * 0.5 - 1.0]

    def build():
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(5)(inputs)
        outputs = [keras.layers.Dense(1, name="a")(hidden), keras.layers.Dense(1, name="b")(hidden)]
        return keras.Model(inputs, outputs)

    def compiled(model):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=["mse", "mae"], metrics=[["mae"], ["mse"]])
        return model

    keras.utils.set_random_seed(7 + R)
    with dp.scope():
        model = compiled(build())
    ref = build()
    ref.set_weights(WORLD.bcast(model.get_weights()))
    compiled(ref)
    hist = model.fit(x, ys, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    want = ref.fit(x, ys, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    per_output_losses = {"a_loss", "b_loss"} if BACKEND == "tensorflow" else set()
    for key in set(want.history) - per_output_losses:
        np.testing.assert_allclose(hist.history[key], want.history[key], rtol=2e-5, err_msg=key)
    assert_weights_close(model, ref)


@pytest.mark.skipif(N == 1, reason="needs a global batch with fewer rows than ranks")
@pytest.mark.parametrize("kind", ["pydataset", "tf.data", "DataLoader"])
def test_a_global_batch_of_a_dataset_with_fewer_rows_than_ranks_is_refused_on_every_rank(dp, kind):
    """A dataset's last global batch of N - 1 rows would leave a rank an empty batch. A PyDataset and a
    DataLoader were refused; a tf.data dataset trained on: the empty share's BatchNormalization statistics
    and loss became NaN on every rank, silently (found 2026-12-07). Now every input type is refused, on every
    rank alike, naming the fix."""
    rows = 2 * GLOBAL_BATCH + N - 1
    if kind == "pydataset":
        source = GlobalBatchesOf(X[:rows], Y[:rows])
    elif kind == "tf.data":
        import tensorflow as tf

        source = tf.data.Dataset.from_tensor_slices((X[:rows], Y[:rows])).batch(GLOBAL_BATCH)
    else:
        import torch

        pairs = torch.utils.data.TensorDataset(torch.from_numpy(X[:rows]), torch.from_numpy(Y[:rows]))
        source = torch.utils.data.DataLoader(pairs, batch_size=GLOBAL_BATCH, shuffle=False)
    with dp.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    # (a ValueError, or TensorFlow's InvalidArgumentError where the batch is read inside tf.data)
    with pytest.raises(Exception, match=f"at least {N} rows"):
        model.fit(source, epochs=1, verbose=0, shuffle=False)
    # the ranks took the same steps before it (each BatchNormalization's statistics are its rank's own)
    assert same_everywhere([np.asarray(w) for w in model.trainable_weights])


class GlobalBatchesOf(keras.utils.PyDataset):
    """The global batches of (x, y), as a user's PyDataset would give them."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return -(-len(self.x) // GLOBAL_BATCH)

    def __getitem__(self, i):
        return self.x[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH], self.y[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]


@pytest.mark.skipif(N == 1, reason="needs a global batch with fewer rows than ranks")
@pytest.mark.parametrize("optimizer,case", [
    pytest.param(lambda: keras.optimizers.SGD(0.05, momentum=0.5), "plain", id="sgd-plain"),
    pytest.param(lambda: keras.optimizers.Adam(0.01), "weighted", id="adam-weighted"),
    pytest.param(lambda: keras.optimizers.SGD(0.05, momentum=0.5), "own_step", id="sgd-own_step"),
    pytest.param(lambda: keras.optimizers.Adam(0.01), "batchnorm", id="adam-batchnorm")])
def test_a_last_batch_of_fewer_rows_than_ranks_trains_and_evaluates_as_one_process(dp, optimizer, case):
    """[Note: shadow shares]: a last global batch of N - 1 rows goes whole to every rank, rank 0's share
    counting and the others weighing nothing. Before 2026-12-07 its rows were skipped with a warning, and fit
    ended 0.245 off one process's weights (an audit's measure at np 2). Loss and metric per epoch, the weights
    and evaluate, with and without the user's sample weights; with a BatchNormalization (which normalizes
    each rank's own rows, so is not one process's) everything stays finite, the shadow's statistics too."""
    rows = 2 * GLOBAL_BATCH + N - 1
    x, y = X[:rows], Y[:rows]
    # (a step of the user's gets shadows only with weights of the user's: it may not read a third part)
    weights = np.random.default_rng(5).uniform(0.5, 2.0, rows).astype("float32") \
        if case in ("weighted", "own_step") else None
    model, ref = distributed_and_reference(dp, optimizer, batchnorm=case == "batchnorm")
    if case == "own_step":  # a class with its own train_step (JAX: the one program with the host callback)
        class OwnStep(keras.Sequential):
            def train_step(self, *args):
                return super().train_step(*args)

        with dp.scope():
            own = OwnStep(model.layers)
            own.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
        model = own
    hist = model.fit(x, y, sample_weight=weights, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    if case == "batchnorm":  # each rank normalizes its own rows, so not one process's; the shadow's are finite
        assert np.isfinite(hist.history["loss"]).all()
        assert all(np.isfinite(np.asarray(w)).all() for w in model.weights)
        assert same_everywhere([np.asarray(w) for w in model.trainable_weights])
        return
    want = ref.fit(x, y, sample_weight=weights, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(hist.history[key], want.history[key], rtol=2e-5)
    for w, v in zip(model.trainable_weights, ref.trainable_weights, strict=True):
        np.testing.assert_allclose(np.asarray(w), np.asarray(v), rtol=2e-5, atol=2e-6)
    assert same_everywhere([np.asarray(w) for w in model.trainable_weights])
    got = model.evaluate(x, y, sample_weight=weights, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    want = ref.evaluate(x, y, sample_weight=weights, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    np.testing.assert_allclose([got["loss"], got["mae"]], [want["loss"], want["mae"]], rtol=1e-5)
    if case == "plain":  # shuffled (TensorFlow: the endless tf.data pipeline), the small batch in each pass
        hist = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0)
        assert np.isfinite(hist.history["loss"]).all()
        assert same_everywhere([np.asarray(w) for w in model.weights])


class _EvaluateAtLastBatch(keras.callbacks.Callback):
    """Calls ``model.evaluate`` on ``data`` at the epoch's last training batch (fit validates right after)."""

    def __init__(self, steps, data):
        super().__init__()
        self.steps, self.data, self.got = steps, data, []

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.steps - 1:
            x, y, w = self.data
            self.got.append(self.model.evaluate(x, y, sample_weight=w, batch_size=GLOBAL_BATCH, verbose=0))


@pytest.mark.skipif(N == 1, reason="needs a global batch with fewer rows than ranks")
@pytest.mark.parametrize("small", ["training", "validation", "callback's"])
def test_an_evaluate_in_a_fits_callback_leaves_the_fit_as_one_process(dp, small):
    """data_parallel [Note: compiled steps per shadow setting]. Before 2026-12-07 an evaluate called by a fit's
    callback, with data whose shadow setting differed from the fit's, dropped the fit's train_function, which
    Keras makes once per fit: the next step failed on every backend ('NoneType' object is not callable); with
    the fit's shadow validation data, the fit's validation then ran with the evaluate's setting and counted
    the shadow's row (val_loss 0.871 against one process's 0.898, torch at np 2; an audit's)."""
    small_rows = 2 * GLOBAL_BATCH + N - 1  # a last batch of fewer rows than ranks: shadows
    train_rows = small_rows if small == "training" else 2 * GLOBAL_BATCH
    train = (X[:train_rows], Y[:train_rows])
    steps = -(-len(train[0]) // GLOBAL_BATCH)
    val_rows = small_rows if small == "validation" else GLOBAL_BATCH
    val = (X[-val_rows:], Y[-val_rows:])
    probe_rows = small_rows if small == "callback's" else GLOBAL_BATCH + N  # (no shadow: one row per rank)
    probe = (X[:probe_rows], Y[:probe_rows], np.linspace(0.5, 1.5, probe_rows).astype("float32"))
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05, momentum=0.5))
    runs = []
    for m in (model, ref):
        callback = _EvaluateAtLastBatch(steps, probe)
        hist = m.fit(*train, validation_data=val, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                     callbacks=[callback])
        runs.append((hist.history, callback.got))
    (hist, got), (want, expected) = runs
    for key in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_allclose(hist[key], want[key], rtol=2e-5, err_msg=key)
    np.testing.assert_allclose(got, expected, rtol=2e-5)
    assert_weights_close(model, ref)
    assert same_everywhere([np.asarray(w) for w in model.trainable_weights])
    assert callable(model.train_function) and callable(model.test_function)  # (the fit's, as Keras leaves them)


@pytest.mark.skipif(N == 1, reason="needs a global batch with fewer rows than ranks")
def test_steps_traced_without_shadows_are_not_reused_for_data_with_them(dp):
    """data_parallel [Note: compiled steps per shadow setting]. Before 2026-12-07 JAX's jax.jit reused the
    test step (and a class's own train step) traced while no share could be a shadow for later data with
    one, so the shadow weighed by its rows: evaluate 5.71 against one process's 6.05, and a fit of a class
    with its own train_step ended 0.059 off one process's weights (an audit's, np 2). Each data in turn,
    with sample weights (a class's own step gets shadows only with the user's weights)."""
    no_shadow = GLOBAL_BATCH + N  # (a last batch of one row per rank)
    with_shadow = 2 * GLOBAL_BATCH + 1
    parts = [(X[:rows], Y[:rows], np.linspace(0.5, 1.5, rows).astype("float32"))
             for rows in (no_shadow, with_shadow, no_shadow, with_shadow)]
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05, momentum=0.5))
    with dp.scope():
        own = OwnStepModel(model.layers)
        own.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse", metrics=["mae"])
    ref_own = OwnStepModel(ref.layers)
    ref_own.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse", metrics=["mae"])
    for x, y, w in parts:
        got = own.evaluate(x, y, sample_weight=w, batch_size=GLOBAL_BATCH, verbose=0)
        want = ref_own.evaluate(x, y, sample_weight=w, batch_size=GLOBAL_BATCH, verbose=0)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        hist = own.fit(x, y, sample_weight=w, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        want = ref_own.fit(x, y, sample_weight=w, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        np.testing.assert_allclose(hist.history["loss"], want.history["loss"], rtol=2e-5)
        assert_weights_close(own, ref_own)


def test_a_tf_data_shuffle_needs_one_seed_on_every_rank(dp):
    """An unseeded tf.data shuffle gave each rank its rows of another order's global batch, silently (50
    distinct rows of 64 in one pass at 2 ranks: found 2026-12-06); now every rank raises, as under
    UnisonStrategy. A seeded one trains like one process reading the same dataset."""
    import tensorflow as tf

    def source(seed):
        return tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(len(X), seed=seed).batch(GLOBAL_BATCH)

    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    if N > 1:
        tf.random.set_seed(None)  # (no global seed: the op's own seeds are (0, 0))
        with pytest.raises(ValueError, match="shuffled without a seed"):
            model.fit(source(None), epochs=1, verbose=0)
    hist = model.fit(source(7), epochs=2, verbose=0)
    want = ref.fit(source(7), epochs=2, verbose=0)
    np.testing.assert_allclose(hist.history["loss"], want.history["loss"], rtol=2e-5)
    assert_weights_close(model, ref)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.data is the TensorFlow backend's")
@pytest.mark.parametrize("kind", ["repeated", "filtered"])
def test_tf_data_of_unknown_or_infinite_length_trains_like_one_process(dp, kind):
    """len() of such a dataset raises, and DataParallel's comparison of the ranks' inputs called it: TypeError
    on every rank at np > 1 (before 2026-12-05), where plain Keras takes both."""
    import tensorflow as tf

    def source():
        batches = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
        return batches.repeat() if kind == "repeated" else batches.filter(lambda x, y: True)

    steps = {"steps_per_epoch": 3} if kind == "repeated" else {}  # (an epoch goes on where the last stopped)
    assert int(source().cardinality()) == (-1 if kind == "repeated" else -2)
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    hist = model.fit(source(), epochs=2, verbose=0, shuffle=False, **steps)
    want = ref.fit(source(), epochs=2, shuffle=False, verbose=0, **steps)  # one process, the same global batches
    np.testing.assert_allclose(hist.history["loss"], want.history["loss"], rtol=2e-5)
    assert_weights_close(model, ref)


class OwnStepModel(keras.Sequential):
    """A model class with its own train_step (on JAX: Keras's one jitted program, not Unison's two)."""

    def train_step(self, *args):
        return super().train_step(*args)


@pytest.mark.parametrize("variant", ["plain", "listed loss", "own train_step"])
def test_an_ignored_class_weighs_each_rank_by_its_counted_targets(dp, variant):
    """A SparseCategoricalCrossentropy with ignore_class averages over the targets it counts, which differ
    between the ranks' shares: weighted by rows, the weights were 0.12 off one process's after one step at 2
    ranks (before 2026-12-06). The reported loss is the mean over every counted target. A loss in a list of
    one was weighed by rows still, and on JAX a model with its own train_step failed in jit (a review)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
    labels = LABELS.copy()
    labels[[0, 1, 2, 3, 4, 9, 20, 21, 22, 30]] = -1  # the first global batch's first shard: mostly ignored

    def build():
        keras.utils.set_random_seed(7)
        model = make_model(classes=3)
        return OwnStepModel(model.layers) if variant == "own train_step" else model

    with dp.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=[loss] if variant == "listed loss" else loss)
    ref = build()
    ref.set_weights(WORLD.bcast(model.get_weights()))
    ref.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    model.fit(X, labels, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    ref.fit(X, labels, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, ref)
    got = model.evaluate(X, labels, batch_size=GLOBAL_BATCH, verbose=0)
    np.testing.assert_allclose(got, float(loss(labels, ref(X))), rtol=2e-5)


def refused_above_one_rank(match: str):
    """``pytest.raises(ValueError, match=match)`` at np > 1; nothing is refused at np 1, where the gradient is one
    process's own (``DataParallel.compile_args``)."""
    return pytest.raises(ValueError, match=match) if N > 1 else contextlib.nullcontext()


def test_an_ignored_class_among_several_losses_is_refused():
    """DataParallel cannot weigh one loss among several by its counted targets: refused at compile."""
    dp = uk.DataParallel()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
    inp = keras.Input((4,))
    two = keras.Model(inp, [keras.layers.Dense(3)(inp), keras.layers.Dense(1)(inp)])
    with dp.scope(), refused_above_one_rank("ignores a class, in a model with 2 losses"):
        two.compile(optimizer="sgd", loss=[loss, "mse"])


def test_losses_that_do_not_average_over_the_batch_are_refused_on_every_rank(dp):
    """DataParallel weighs each rank's gradient by its rows: a 'sum' loss trained with 1/N of one process's
    gradient, a 'mean_with_sample_weight' one divided by each rank's own sum of weights (before 2026-12-05)."""
    for reduction in ("sum", "mean_with_sample_weight"):
        with dp.scope(), refused_above_one_rank(f"uses reduction='{reduction}'; DataParallel averages"):
            make_model().compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction=reduction))
    with dp.scope():  # the default, by object or name, is fine
        make_model().compile(optimizer="sgd", loss=[keras.losses.MeanSquaredError()])


def test_statistics_of_the_whole_batch_are_refused_and_per_row_ones_train_as_one_process(dp):
    """data_parallel [Note: statistics of the whole batch]. Before 2026-12-07 Dice (axis=None, Keras's default)
    trained 0.035 off one process's weights at np 2, and a Pearson correlation along axis 0 read -0.101 for one
    process's -0.113 (an audit's): each rank's statistic of its share is not the global batch's. Refused at
    compile on every rank; per row (axis over each row's values) Dice trains as one process."""
    for loss in ("dice", keras.losses.Dice(), keras.losses.Tversky()):
        with dp.scope(), refused_above_one_rank("is one statistic of the whole batch"):
            make_model().compile(optimizer="sgd", loss=loss)
    # (along the last axis of a one-unit output: along the batch, once Keras squeezes the unit of the targets)
    for metric in (keras.metrics.PearsonCorrelation(axis=0), keras.metrics.ConcordanceCorrelation(axis=(0, 1)),
                   keras.metrics.PearsonCorrelation()):
        with dp.scope(), refused_above_one_rank("is one statistic of the whole batch"):
            make_model().compile(optimizer="sgd", loss="mse", metrics=[metric])
        with uk.DataParallel(global_metrics=False).scope():  # each rank logs its own: its choice
            make_model().compile(optimizer="sgd", loss="mse", metrics=[metric])
    with dp.scope():  # along each row of several units: accepted
        make_model(classes=3).compile(optimizer="sgd", loss="mse", metrics=[keras.metrics.PearsonCorrelation()])
    keras.utils.set_random_seed(100 + R)
    with dp.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.Dice(axis=-1))
    ref = make_model()
    ref.set_weights(WORLD.bcast(model.get_weights()))
    ref.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.Dice(axis=-1))
    target = (Y > 0).astype("float32")
    hist = model.fit(X, target, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    want = ref.fit(X, target, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(hist.history["loss"], want.history["loss"], rtol=2e-5)
    assert_weights_close(model, ref)


class _Recorder(keras.layers.Layer):
    """Passes its input through, recording the first column's values while ``recording`` is set."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen, self.recording = [], False

    def call(self, x):
        if self.recording:
            self.seen.append(keras.ops.convert_to_numpy(x)[:, 0].round().astype(int).tolist())
        return x


def _ids_loader(n, batch, **kwargs):
    import torch

    ids = torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 4)
    pairs = torch.utils.data.TensorDataset(ids, torch.zeros(n, 1))
    return torch.utils.data.DataLoader(pairs, batch_size=batch, **kwargs)


def _recording_model(dp):
    recorder = _Recorder()
    with dp.scope():
        model = keras.Sequential([keras.Input((4,)), recorder, keras.layers.Dense(1)])
        # eager, so the recorder reads its input's values on every backend (TF and JAX trace the step otherwise)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", run_eagerly=True)

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            recorder.recording = True

        def on_train_batch_end(self, batch, logs=None):
            recorder.recording = False

    return model, recorder, Record()


def test_a_shuffling_dataloader_gives_every_rank_the_same_global_batches(dp):
    """Each rank read its own copy of a shuffle=True loader with its own permutation, so rank r cut its rows
    from another global batch than the others: rows trained twice or never in a pass, silently."""
    n, epochs = 6 * GLOBAL_BATCH, 2
    model, recorder, record = _recording_model(dp)
    model.fit(_ids_loader(n, GLOBAL_BATCH, shuffle=True), epochs=epochs, verbose=0, callbacks=[record])
    steps = n // GLOBAL_BATCH
    assert len(recorder.seen) == steps * epochs
    everyone = WORLD.allgather([list(step) for step in recorder.seen])
    passes = []
    for e in range(epochs):
        rows = [v for step in range(e * steps, (e + 1) * steps) for r in range(N) for v in everyone[r][step]]
        assert sorted(rows) == list(range(n)), (e, sorted(rows))  # every row once per pass
        passes.append(rows)
    assert passes[0] != passes[1] and passes[0] != sorted(passes[0])  # shuffled, anew each pass


def test_a_dataloader_keeps_its_own_generator_and_unison_leaves_none_behind(dp):
    """A generator the user gave is theirs, with their seed's order (the first version replaced it), checked
    across ranks; a loader without one has none again after fit (it kept Unison's)."""
    import torch

    n = 4 * GLOBAL_BATCH
    mine = torch.Generator().manual_seed(42)
    loader = _ids_loader(n, GLOBAL_BATCH, shuffle=True, generator=mine)
    model, recorder, record = _recording_model(dp)
    model.fit(loader, epochs=1, verbose=0, callbacks=[record])
    everyone = WORLD.allgather([list(step) for step in recorder.seen])
    assert sorted(v for r in range(N) for step in everyone[r] for v in step) == list(range(n))  # each row once
    assert loader.sampler.generator is mine
    plain = _ids_loader(n, GLOBAL_BATCH, shuffle=True)
    model.fit(plain, epochs=1, verbose=0)
    assert plain.sampler.generator is None
    if N > 1:  # seeded per rank: refused on every rank
        with pytest.raises(ValueError, match=r"different first global batches.*seed"):
            model.fit(_ids_loader(n, GLOBAL_BATCH, shuffle=True, generator=torch.Generator().manual_seed(R)),
                      epochs=1, verbose=0)


def test_a_dataloader_whose_order_unison_cannot_seed_is_checked_across_ranks(dp):
    import torch

    class _RankOrder(torch.utils.data.Sampler):
        """A custom sampler (Unison cannot seed it): the rows in a rank-dependent order, or in one order."""

        def __init__(self, n, per_rank):
            self.n, self.per_rank = n, per_rank

        def __len__(self):
            return self.n

        def __iter__(self):
            return iter(np.random.default_rng(R if self.per_rank else 0).permutation(self.n).tolist())

    n = 4 * GLOBAL_BATCH
    model, recorder, record = _recording_model(dp)
    model.fit(_ids_loader(n, GLOBAL_BATCH, sampler=_RankOrder(n, per_rank=False)), epochs=1, verbose=0,
              callbacks=[record])
    everyone = WORLD.allgather([list(step) for step in recorder.seen])
    assert sorted(v for r in range(N) for step in everyone[r] for v in step) == list(range(n))
    if N > 1:  # a different first global batch on some rank: refused on every rank
        with pytest.raises(ValueError, match=r"different first global batches.*seed"):
            model.fit(_ids_loader(n, GLOBAL_BATCH, sampler=_RankOrder(n, per_rank=True)), epochs=1, verbose=0)


def _refused_alike(call, match):
    """``call()`` raises a ValueError matching ``match``, with one message on every rank."""
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert len(set(WORLD.allgather(str(info.value)))) == 1
    return str(info.value)


def test_each_ranks_own_shard_as_a_loader_pydataset_or_tf_data_is_refused_on_every_rank(dp):
    """Horovod's habit, each rank passing its own shard: before 2026-12-07 a DataLoader (of a sequential or a
    seeded sampler) or a PyDataset was compared by its type and length only, a tf.data dataset by its element
    specs, and each rank trained on its rows of its own shard's batches: 6 rows of 12 a pass at 2 ranks."""
    import tensorflow as tf
    import torch

    if N == 1:
        pytest.skip("one rank's shard is the whole data")
    n = 4 * GLOBAL_BATCH
    ids = np.arange(n, dtype="float32")[:, None].repeat(4, axis=1)
    mine = ids[R::N]  # this rank's shard, as a Horovod script makes it
    model, recorder, record = _recording_model(dp)

    class Shard(keras.utils.PyDataset):
        def __len__(self):
            return len(mine) // GLOBAL_BATCH

        def __getitem__(self, i):
            rows = mine[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]
            return rows, rows[:, :1]

    pairs = torch.utils.data.TensorDataset(torch.from_numpy(ids), torch.from_numpy(ids[:, :1]))
    shard = torch.utils.data.Subset(pairs, range(R, n, N))
    fix = r"gave different first global batches in pass 1 \(ranks \[1.*Pass the whole dataset, the same on every"
    for shuffle in (False, True):  # a sequential sampler, and one Unison seeds
        loader = torch.utils.data.DataLoader(shard, batch_size=GLOBAL_BATCH, shuffle=shuffle)
        message = _refused_alike(lambda: model.fit(loader, epochs=1, verbose=0),  # noqa: B023 - called at once
                                 "the ranks' DataLoaders " + fix)
        assert "seed" not in message  # (the order agrees: the data does not)
    _refused_alike(lambda: model.fit(Shard(), epochs=1, verbose=0, shuffle=False), "the ranks' PyDatasets " + fix)
    _refused_alike(lambda: model.evaluate(Shard(), verbose=0), "the ranks' PyDatasets " + fix)
    split = tf.data.Dataset.from_tensor_slices((ids, ids[:, :1])).shard(N, R).batch(GLOBAL_BATCH)
    _refused_alike(lambda: model.fit(split, epochs=1, verbose=0), r"passed different inputs.*shard\(")
    own = tf.data.Dataset.from_tensor_slices((mine, mine[:, :1])).batch(GLOBAL_BATCH)  # each rank's own rows
    _refused_alike(lambda: model.fit(own, epochs=1, verbose=0), r"passed different inputs.*whole data")

    class Noisy(torch.utils.data.Dataset):  # the whole data, augmented by each rank's own torch stream
        def __len__(self):
            return n

        def __getitem__(self, i):
            return torch.from_numpy(ids[i]) + 1e-3 * torch.rand(4), torch.from_numpy(ids[i, :1])

    loader = torch.utils.data.DataLoader(Noisy(), batch_size=GLOBAL_BATCH, shuffle=True)
    recorder.recording, recorder.seen = False, []  # (a refused fit stopped inside a recorded step)
    model.fit(loader, epochs=1, verbose=0, callbacks=[record])  # accepted: the targets agree
    everyone = WORLD.allgather([list(step) for step in recorder.seen])
    rows = sorted(round(v) for r in range(N) for step in everyone[r] for v in step)
    assert rows == list(range(n))  # every row once


def _two_inputs_model():
    a, b = keras.Input((3,)), keras.Input((2,))
    h = keras.layers.Concatenate()([a, b])
    return keras.Model([a, b], [keras.layers.Dense(1, name="o1")(h), keras.layers.Dense(1, name="o2")(h)])


@pytest.mark.parametrize("container", [list, tuple])
def test_several_inputs_and_targets_as_lists_or_tuples_work_as_in_one_process(dp, container):
    """predict of a model with several inputs read [A, B] as (x=A, y=B) and failed (every backend);
    on TensorFlow fit and evaluate failed with lists of inputs or targets (tf.data stacked them)."""
    a_in, b_in = X[:, :3], X[:, 2:] * 2.0
    xs, ys = container([a_in, b_in]), container([Y, -Y])
    keras.utils.set_random_seed(100 + R)
    with dp.scope():
        model = _two_inputs_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=["mse", "mse"])
    ref = _two_inputs_model()
    ref.set_weights(WORLD.bcast(model.get_weights()))
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss=["mse", "mse"])
    want = ref.predict(xs, batch_size=GLOBAL_BATCH, verbose=0)
    got = model.predict(xs, batch_size=GLOBAL_BATCH, verbose=0)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    got, want = (m.evaluate(xs, ys, batch_size=GLOBAL_BATCH, verbose=0) for m in (model, ref))
    kept = 1 if BACKEND == "tensorflow" else len(want)  # TF's per-output losses: docs/keras_backends.md, Known
    np.testing.assert_allclose(got[:kept], want[:kept], rtol=1e-5)
    hist = model.fit(xs, ys, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    want_hist = ref.fit(xs, ys, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(hist.history["loss"], want_hist.history["loss"], rtol=2e-5)
    assert_weights_close(model, ref)
    assert same_everywhere(model.get_weights())


class LoggedBatches(GlobalBatches):
    """GlobalBatches that records which batch each read asked for, by epoch (on_epoch_begin calls)."""

    def __init__(self, order=None):
        super().__init__()
        self.reads, self.order = [[]], order

    def __len__(self):
        return super().__len__() if self.order is None else len(self.order)

    def on_epoch_begin(self):
        self.reads.append([])

    def __getitem__(self, i):
        index = i if self.order is None else self.order[i]
        self.reads[-1].append(index)
        return super().__getitem__(index)


def test_pydataset_batches_are_shuffled_alike_on_every_rank_and_train_like_one_process(dp):
    """fit's default shuffle=True reorders a PyDataset's batches each epoch, as Keras does (it was
    dropped); every rank reads the same order, so each global batch is still split, not mixed."""
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    source = LoggedBatches()
    model.fit(source, epochs=3, verbose=0)
    n = len(source)
    orders = source.reads[-3:]  # the three epochs' reads (Keras also peeks at batches before them)
    assert all(sorted(o) == list(range(n)) for o in orders), source.reads
    assert any(o != list(range(n)) for o in orders) and orders[0] != orders[1], source.reads
    assert all(r == source.reads for r in WORLD.allgather(source.reads))  # every rank read alike
    ref.fit(LoggedBatches(order=sum(orders, [])), epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, ref)


def test_masked_outputs_and_on_batch_calls_are_refused_on_every_rank(dp):
    """Keras averages a masked loss over each rank's unmasked entries, which averaged gradients do not
    reproduce (a silent difference from one process), and *_on_batch neither splits nor broadcasts."""
    tokens = np.random.default_rng(0).integers(1, 9, (2 * N, 5))
    tokens[N:, 2:] = 0
    with dp.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Embedding(10, 3, mask_zero=True),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match=r"output carries a mask.*sample_weight of 0"):
        model.fit(tokens, np.ones((2 * N, 5, 1), "float32"), batch_size=2 * N, epochs=1, verbose=0)
    with dp.scope():  # a mask consumed before the output is fine
        pooled = keras.Sequential([keras.Input((5,)), keras.layers.Embedding(10, 3, mask_zero=True),
                                   keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        pooled.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    pooled.fit(tokens, np.ones((2 * N, 1), "float32"), batch_size=2 * N, epochs=1, verbose=0)
    assert same_everywhere(pooled.get_weights())
    for call in (lambda: pooled.train_on_batch(tokens, np.ones((2 * N, 1))), lambda: pooled.test_on_batch(tokens),
                 lambda: pooled.predict_on_batch(tokens)):
        with pytest.raises(NotImplementedError, match=r"_on_batch is not distributed.*use fit"):
            call()


def test_evaluate_and_predict_are_global(dp):
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    got = model.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    want = ref.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    assert got.keys() == want.keys()
    for key in got:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
    x = X[: GLOBAL_BATCH * 2 + N - 1] if N > 1 else X  # N>1: a last batch smaller than the ranks
    out = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    assert out.shape == (len(x), 1)
    np.testing.assert_allclose(out, ref.predict(x, batch_size=GLOBAL_BATCH, verbose=0), rtol=1e-5, atol=1e-6)
    assert same_everywhere([out])


def test_evaluate_and_predict_take_rank_0s_weights_at_every_call(dp):
    """[Note: rank 0's weights at every evaluate and predict] One rank's weights set apart after the first
    evaluate (a rank-local load_weights): the next evaluate returned a blend of the ranks' models, silently,
    before 2026-12-06 (the weights were broadcast before the first evaluate only). Now every call takes rank
    0's weights, as fit does."""
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    ref.set_weights(WORLD.bcast(model.get_weights()))
    for call in ("evaluate", "evaluate", "predict", "predict"):
        if R != 0:
            model.set_weights([w + 0.5 * R for w in model.get_weights()])
        if call == "evaluate":
            got = model.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
            want = ref.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
            np.testing.assert_allclose([got["loss"], got["mae"]], [want["loss"], want["mae"]], rtol=1e-5)
        else:
            got = model.predict(X, batch_size=GLOBAL_BATCH, verbose=0)
            np.testing.assert_allclose(got, ref.predict(X, batch_size=GLOBAL_BATCH, verbose=0), rtol=1e-5,
                                       atol=1e-6)
        assert same_everywhere(model.get_weights())
        assert_weights_close(model, ref, rtol=0, atol=0)


def test_validation_data_wins_over_validation_split_as_in_keras(dp):
    """Keras ignores validation_split when validation_data is given; DataParallel raised (before 2026-12-06)."""
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    val = (X[:GLOBAL_BATCH + N] * 2, Y[:GLOBAL_BATCH + N])
    kwargs = dict(batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, validation_split=0.25,
                  validation_data=val)
    hist, want = model.fit(X, Y, **kwargs), ref.fit(X, Y, **kwargs)
    for key in ("loss", "val_loss", "val_mae"):
        np.testing.assert_allclose(hist.history[key], want.history[key], rtol=2e-5)
    assert_weights_close(model, ref)


def test_validation_data_and_split_are_global(dp):
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    hist = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, validation_split=0.25)
    want = ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, validation_split=0.25)
    for key in ("loss", "val_loss", "val_mae"):
        np.testing.assert_allclose(hist.history[key], want.history[key], rtol=2e-5)


def test_classification_metrics_and_class_weights_are_global(dp):
    keras.utils.set_random_seed(7 + R)
    with dp.scope():
        model = make_model(classes=3)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)])
    ref = make_model(classes=3)
    ref.set_weights(WORLD.bcast(model.get_weights()))
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)])
    weights = {0: 1.0, 1: 2.0, 2: 0.5}
    hist = model.fit(X, LABELS, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, class_weight=weights)
    want = ref.fit(X, LABELS, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, class_weight=weights)
    for key in want.history:
        np.testing.assert_allclose(hist.history[key], want.history[key], rtol=2e-5, err_msg=key)
    assert_weights_close(model, ref)


def test_sample_weights_are_split_with_their_rows(dp):
    """``sample_weight`` travels with each rank's rows: loss and weights equal one process's fit."""
    keras.utils.set_random_seed(11 + R)
    with dp.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    ref = make_model()
    ref.set_weights(WORLD.bcast(model.get_weights()))
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    sw = (1.0 + np.arange(len(X)) % 4).astype("float32")  # rows weighted 1, 2, 3, 4, 1, ...
    hist = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sw)
    want = ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sw)
    np.testing.assert_allclose(hist.history["loss"], want.history["loss"], rtol=2e-5)
    assert_weights_close(model, ref)


def test_batchnorm_statistics_agree_across_ranks(dp):
    keras.utils.set_random_seed(5 + R)
    with dp.scope():
        model = make_model(batchnorm=True)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0)
    assert same_everywhere(model.get_weights())
    moving = [v for v in model.non_trainable_variables if "moving_mean" in v.path]
    assert moving and float(np.abs(keras.ops.convert_to_numpy(moving[0].value)).sum()) > 0  # it was updated


def test_validation_during_fit_uses_the_averaged_statistics(dp):
    """fit validates before each epoch ends: the moving statistics are averaged first, so the last
    epoch's val_loss is the loss evaluate() gives the trained model (each rank validated with its
    own statistics, and the summed val_loss was no model's: 1.21 against 0.11 on JAX)."""
    keras.utils.set_random_seed(6 + R)
    with dp.scope():
        model = make_model(batchnorm=True)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, validation_data=(X[:24], Y[:24]))
    assert history.history["val_loss"][-1] == pytest.approx(model.evaluate(X[:24], Y[:24], verbose=0), rel=1e-5)


def test_dropout_trains_with_each_ranks_own_masks_and_frozen_weights_stay_put(dp):
    """A model with Dropout: its seed generator's state is each rank's own (on JAX it is uint32,
    and broadcasting it failed every fit, evaluate and predict; elsewhere every rank drew rank 0's
    masks). A frozen layer's weights stay bit for bit through the averaging of the statistics.
    Seeded alike on every rank (a seeded script), the ranks still draw their own masks: before
    2026-12-07 row i of every rank's share got the same mask at every step."""
    keras.utils.set_random_seed(7)
    with dp.scope():
        frozen = keras.layers.Dense(4, name="frozen")
        model = keras.Sequential([keras.Input((4,)), frozen, keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dropout(0.5), keras.layers.Dense(1)])
        frozen.trainable = False
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    before = None
    for _ in range(3):
        model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
        if before is None:
            before = [keras.ops.convert_to_numpy(w).copy() for w in frozen.weights]
    for w, b in zip(frozen.weights, before, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(w), b)
    assert same_everywhere(model.get_weights())
    out = model.predict(X[:8], verbose=0)
    assert out.shape == (8, 1) and np.isfinite(model.evaluate(X, Y, verbose=0))
    layer = model.layers[-2]
    ones = np.ones((64, 16), "float32")
    mask = keras.ops.convert_to_numpy(layer(ones, training=True)) == 0
    masks = WORLD.allgather(mask)
    assert N == 1 or not all(np.array_equal(masks[0], m) for m in masks[1:])  # each rank its own stream


def test_only_rank_0_prints_keras_progress(dp, capsys):
    model, _ = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    capsys.readouterr()
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=1)
    model.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=1)
    printed = capsys.readouterr().out
    assert WORLD.allgather("5/5" in printed) == [r == 0 for r in range(N)], printed


def test_bad_batch_size_and_jit_compile_raise_on_every_rank(dp):
    with dp.scope():
        model = make_model()
        model.compile(optimizer="sgd", loss="mse")
    if N > 1:
        with pytest.raises(ValueError, match=f"at least one row; use batch_size >= {N}"):
            model.fit(X, Y, batch_size=N - 1, epochs=1, verbose=0)
    if BACKEND != "jax":
        with dp.scope(), pytest.raises(ValueError, match="jit_compile=True cannot call the host"):
            make_model().compile(optimizer="sgd", loss="mse", jit_compile=True)


def test_save_and_model_checkpoint_write_from_rank_0_only(dp, tmp_path_factory):
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("save")) if R == 0 else None)
    with dp.scope():
        model = make_model()
        model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(folder + "/ckpt-{epoch}.keras")])
    model.save(f"{folder}/r{R}.keras")
    model.save_weights(f"{folder}/r{R}.weights.h5")
    WORLD.Barrier()
    assert sorted(os.listdir(folder)) == ["ckpt-1.keras", "ckpt-2.keras", "r0.keras", "r0.weights.h5"]
    loaded = keras.models.load_model(f"{folder}/ckpt-2.keras")  # loads without Unison's optimizer class
    for w, v in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(w, v)
    assert type(loaded.optimizer).__module__.startswith("keras")


def test_keras_csv_logger_and_tensorboard_write_from_rank_0_only(dp, tmp_path_factory):
    """[Note: rank-0-only files under fit] every rank wrote its CSVLogger file and TensorBoard events before
    2026-12-06; with a per-rank name only rank 0's exist now, and rank 0's failure raises on every rank."""
    from unison.common.exceptions import UnisonError

    folder = WORLD.bcast(str(tmp_path_factory.mktemp("logs")) if R == 0 else None)
    with dp.scope():
        model = make_model()
        model.compile(optimizer="sgd", loss="mse")
    board = importlib.util.find_spec("tensorboard") is not None  # (Keras's TensorBoard needs the package)
    writers = [keras.callbacks.CSVLogger(f"{folder}/log{R}.csv")]
    writers += [keras.callbacks.TensorBoard(f"{folder}/tb{R}")] if board else []
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, callbacks=writers)
    WORLD.Barrier()
    assert sorted(os.listdir(folder)) == ["log0.csv"] + (["tb0"] if board else [])
    if board:  # (rank 0's events were written: the epochs' scalars)
        assert any(f.startswith("events.out.tfevents") for _, _, files in os.walk(f"{folder}/tb0") for f in files)
    with open(f"{folder}/log0.csv") as f:
        assert len(f.read().splitlines()) == 3  # header and two epochs
    with pytest.raises(UnisonError, match="CSVLogger.on_train_begin failed on rank 0"):  # (a file as folder)
        model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0,
                  callbacks=[keras.callbacks.CSVLogger(f"{folder}/log0.csv/log{R}.csv")])
    assert same_everywhere(model.get_weights())


def test_a_failed_write_of_keras_model_checkpoint_raises_on_every_rank(dp, tmp_path_factory):
    """Keras's own ModelCheckpoint raised on rank 0 alone (the others trained on into a collective rank 0
    never joined) before 2026-12-06; now a UnisonError on every rank, as unison.keras.callbacks.ModelCheckpoint."""
    from unison.common.exceptions import UnisonError

    folder = WORLD.bcast(str(tmp_path_factory.mktemp("ckpt")) if R == 0 else None)
    if R == 0:
        with open(f"{folder}/file", "w") as f:  # a file where the checkpoint's folder should be
            f.write("x")
    WORLD.Barrier()
    with dp.scope():
        model = make_model()
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(UnisonError, match="ModelCheckpoint: rank 0 could not save"):
        model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, callbacks=[
            keras.callbacks.ModelCheckpoint(folder + "/file/ckpt-{epoch}.keras")])
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)  # the ranks go on together
    assert same_everywhere(model.get_weights())


# ------------------------------------------------------------ Horovod-style pieces


def test_horovod_style_optimizer_and_callbacks_equal_one_process(tmp_path_factory):
    """Each rank feeds its own equal shard: averaged gradients are the global batch's."""
    keras.utils.set_random_seed(200 + R)
    model = make_model()
    model.compile(optimizer=uk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse", metrics=["mae"],
                  jit_compile=False)
    ref = make_model()
    ref.set_weights(WORLD.bcast(model.get_weights()))  # what BroadcastGlobalVariablesCallback will give
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    rows = GLOBAL_BATCH * 4
    mine = np.concatenate([np.arange(b + R * 8, b + (R + 1) * 8) for b in range(0, rows, GLOBAL_BATCH)])
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("hvd")) if R == 0 else None)
    hist = model.fit(X[mine], Y[mine], batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
        uk.callbacks.BroadcastGlobalVariablesCallback(0), uk.callbacks.MetricAverageCallback(),
        uk.callbacks.ModelCheckpoint(folder + "/m-{epoch}.keras")])
    want = ref.fit(X[:rows], Y[:rows], batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, ref)
    assert same_everywhere(model.get_weights())
    # MetricAverageCallback: the mean of the ranks' epoch means, which here (equal shards, equal
    # batches) is the global mean loss of each epoch
    np.testing.assert_allclose(hist.history["loss"], want.history["loss"], rtol=2e-5)
    assert same_everywhere([np.array(hist.history["loss"])])
    WORLD.Barrier()
    assert sorted(os.listdir(folder)) == ["m-1.keras", "m-2.keras"]


@pytest.mark.parametrize("average", [False, True], ids=["sum", "average_aggregated_gradients"])
def test_horovod_optimizer_keywords_and_backward_passes_per_step(average):
    # Horovod's keywords raised TypeError; backward_passes_per_step is Keras's gradient accumulation, whose
    # update is the sum of the accumulated steps' gradients as Horovod's (the mean before 2026-12-07), or
    # their mean with average_aggregated_gradients: with plain SGD the sum is the mean at twice the rate
    keras.utils.set_random_seed(300)
    model = make_model()
    model.compile(optimizer=uk.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2,
                                                    sparse_as_dense=True, device_dense="", device_sparse="",
                                                    average_aggregated_gradients=average),
                  loss="mse", jit_compile=False)
    ref = make_model()
    ref.set_weights(model.get_weights())
    ref.compile(optimizer=keras.optimizers.SGD(0.05 if average else 0.1, gradient_accumulation_steps=2),
                loss="mse")
    rows = GLOBAL_BATCH * 4
    mine = np.concatenate([np.arange(b + R * 8, b + (R + 1) * 8) for b in range(0, rows, GLOBAL_BATCH)])
    model.fit(X[mine], Y[mine], batch_size=8, epochs=1, shuffle=False, verbose=0)
    ref.fit(X[:rows], Y[:rows], batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, ref)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        uk.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)


def test_a_rank_that_retraces_alone_does_not_hang():
    # a collective at trace time (to agree which gradients exist) waited for ranks that did not retrace:
    # here only the last rank's last batch is ragged, so it alone traces the step again
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=uk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse",
                  **({} if BACKEND == "jax" else {"jit_compile": False}))
    n = 48 if R < N - 1 else 47
    model.fit(X[:n], Y[:n, :1], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert same_everywhere(model.get_weights())


def test_warmup_leaves_the_rate_to_other_callbacks_after_it():
    model = make_model()
    model.compile(optimizer=uk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=False)
    seen = []

    def halve(epoch, logs):
        if BACKEND == "jax":
            model.jax_state_sync()
            model._jax_state_synced = True
        if epoch >= 1:
            rate = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
            model.optimizer.learning_rate.assign(rate / 2)

    def record(epoch, logs):
        if BACKEND == "jax":
            model.jax_state_sync()
        seen.append(float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)))

    callbacks = [uk.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1),
                 keras.callbacks.LambdaCallback(on_epoch_begin=record, on_epoch_end=halve)]
    model.fit(X[:16], Y[:16], batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
    assert seen[1:] == pytest.approx([0.1, 0.05, 0.025])  # (reset to 0.1 at every epoch's start before)


def test_learning_rate_warmup_ramps_from_lr_over_size():
    model = make_model()
    model.compile(optimizer=uk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=False)
    seen = []

    def lr(batch, logs):
        if BACKEND == "jax":  # JAX's fit keeps the state outside the variables during an epoch
            model.jax_state_sync()
        seen.append(float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)))

    record = keras.callbacks.LambdaCallback(on_train_batch_begin=lr)
    warm = uk.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2, steps_per_epoch=4)
    model.fit(X[:32], Y[:32], batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[warm, record])
    expect = [warm.rate(e + (b + 1) / 4) for e in range(3) for b in range(4)]  # Horovod's: one step ahead
    np.testing.assert_allclose(seen, expect, rtol=1e-6)
    assert seen[0] == pytest.approx(0.1 * (0.125 * (N - 1) + 1) / N)
    assert seen[7] == pytest.approx(0.1) and seen[-1] == pytest.approx(0.1)  # the warmup's last batch: initial_lr


def test_collectives_on_backend_tensors_and_their_gradients():
    x = keras.ops.convert_to_tensor(np.arange(6, dtype="float32").reshape(2, 3) + R)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(uk.allreduce(x, op=uk.Sum)),
                               sum(np.arange(6, dtype="float32").reshape(2, 3) + r for r in range(N)))
    gathered = keras.ops.convert_to_numpy(uk.allgather(x))
    assert gathered.shape == (2 * N, 3)
    np.testing.assert_array_equal(gathered[2 * R:2 * R + 2], keras.ops.convert_to_numpy(x))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(uk.broadcast(x, root_rank=N - 1)),
                                  np.arange(6, dtype="float32").reshape(2, 3) + N - 1)
    # gradients, with weights w_r = r + 1 that differ per rank:
    # d/dx sum(w_r * allreduce_avg(x)) = mean_r(w_r); d/dx sum(w_r * allgather(x)) = sum_r(w_r) on
    # this rank's rows; d/dx sum(w_r * broadcast(x, 0)) = sum_r(w_r) on rank 0, zero elsewhere
    def weighted(f):
        def loss(t):
            y = f(t)
            return keras.ops.sum(keras.ops.full(keras.ops.shape(y), float(R + 1)) * y)
        return loss

    total = float(sum(range(1, N + 1)))
    np.testing.assert_allclose(grad_of(weighted(uk.allreduce), x), np.full((2, 3), total / N))
    np.testing.assert_allclose(grad_of(weighted(uk.allgather), x), np.full((2, 3), total))
    np.testing.assert_allclose(grad_of(weighted(lambda t: uk.broadcast(t, 0)), x),
                               np.full((2, 3), total if R == 0 else 0.0))
    # an op refused on one rank raises on every rank, and the next call pairs (before 2026-12-05 it raised
    # there alone: the others' call paired with its next one, another call's values on both, then a hang)
    # a refusal travels only when no program is being traced (the others' call runs when it does), decided
    # from the backend's state: a numpy input inside a traced function counted as eager (a deadlock at trace)
    from unison.keras import ops as ukops

    seen = []
    assert not ukops._traced(x)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.function(lambda: seen.append(ukops._traced(np.ones(2))) or tf.constant(0))()
        assert seen == [True]
    elif keras.backend.backend() == "jax":
        import jax

        jax.jit(lambda a: (seen.append(ukops._traced(np.ones(2))), a)[1])(np.ones(2))
        assert seen == [True]
    if N > 1:
        from unison.common.ops import Max

        with pytest.raises(Exception, match=r"supports Average and Sum"):
            uk.allreduce(x, op=Max if R == 0 else uk.Sum)
        np.testing.assert_allclose(keras.ops.convert_to_numpy(uk.allreduce(x, op=uk.Sum)),
                                   sum(np.arange(6, dtype="float32").reshape(2, 3) + r for r in range(N)))


def grad_of(f, x):
    """d f(x) / dx on the active backend, traced where the backend compiles (jax.jit, tf.function)."""
    if BACKEND == "jax":
        import jax

        return np.asarray(jax.jit(jax.grad(f))(x))
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function
        def g(t):
            with tf.GradientTape() as tape:
                tape.watch(t)
                y = f(t)
            return tape.gradient(y, t)

        return g(x).numpy()

    t = x.clone().requires_grad_(True)
    f(t).backward()
    return t.grad.numpy()


def test_mixed_precision_skips_the_steps_any_rank_overflowed_on_every_rank():
    # the LossScaleOptimizer around DistributedOptimizer checked each rank's own gradients before the
    # all-reduce: a rank that overflowed skipped alone and the others hung in the all-reduce (every backend)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                  keras.layers.Dense(2, dtype="float32")])
        model.compile(optimizer=uk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse",
                      **({} if BACKEND == "jax" else {"jit_compile": False}))
        x = np.array(X[:12], copy=True)
        if R == 0:
            x[:4] *= 3e4  # only rank 0's first batch overflows in float16
        model.fit(x, Y[:12, :2], batch_size=4, epochs=1, shuffle=False, verbose=0)
        flat = np.concatenate([w.ravel() for w in model.get_weights()]).astype("float32")
        every = keras.ops.convert_to_numpy(uk.allgather(keras.ops.convert_to_tensor(flat[None])))
        assert all(np.array_equal(every[0], row) for row in every)  # the ranks skipped alike
        steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        assert steps < 3 and WORLD.allgather(steps) == [steps] * N  # a step skipped, by every rank
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.skipif(BACKEND == "jax", reason="a data-dependent branch is traced once under jax.jit")
def test_a_gradient_missing_on_some_ranks_is_reduced_by_its_variable():
    # only the present gradients were reduced, by position: a's gradient on one rank met b's on another
    class Branch(keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = keras.layers.Dense(2, name="a"), keras.layers.Dense(2, name="b")

        def call(self, x):
            return self.a(x) if float(keras.ops.convert_to_numpy(keras.ops.mean(x))) > 0 else self.b(x)

    def build():
        keras.utils.set_random_seed(3)
        model = Branch()
        model.a.build((None, 4))
        model.b.build((None, 4))
        model.build((None, 4))
        return model

    data = [np.abs(X[:4]) + 0.1, -np.abs(X[4:8]) - 0.1]  # rank 0's rows take a, the others' b
    mine = data[0] if R == 0 else data[1]
    model = build()
    model.compile(optimizer=uk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", run_eagerly=True)
    model.fit(mine, Y[:4, :2], batch_size=4, epochs=1, shuffle=False, verbose=0)
    # one process: the average over ranks of each rank's gradient, zeros where a rank had none
    ref = build()
    grads = {}
    for r in range(N):
        rows = data[0] if r == 0 else data[1]
        layer = ref.a if r == 0 else ref.b
        out = rows @ keras.ops.convert_to_numpy(layer.kernel) + keras.ops.convert_to_numpy(layer.bias)
        d_out = 2 * (out - Y[:4, :2]) / out.size
        for name, g in ((f"{layer.name}/k", rows.T @ d_out), (f"{layer.name}/b", d_out.sum(0))):
            grads[name] = grads.get(name, 0) + g / N
    for layer in (model.a, model.b):
        ref_layer = ref.a if layer.name == "a" else ref.b
        want_k = keras.ops.convert_to_numpy(ref_layer.kernel) - 0.1 * grads.get(f"{layer.name}/k", 0)
        np.testing.assert_allclose(keras.ops.convert_to_numpy(layer.kernel), want_k, rtol=1e-5, atol=1e-6)


def test_ops_keep_bfloat16_and_scalars():
    # torch: bfloat16 crashed (Tensor.numpy), and 0-d tensors came back with shape (1,)
    x = keras.ops.cast(keras.ops.convert_to_tensor(np.full((3,), float(R + 1), "float32")), "bfloat16")
    out = uk.allreduce(x, op=uk.Sum)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    np.testing.assert_allclose(keras.ops.convert_to_numpy(keras.ops.cast(out, "float32")), float(N * (N + 1) / 2))
    scalar = uk.allreduce(keras.ops.convert_to_tensor(np.float32(R + 1)), op=uk.Sum)
    assert tuple(scalar.shape) == ()
    assert tuple(uk.broadcast(keras.ops.convert_to_tensor(np.float32(R)), root_rank=0).shape) == ()


def test_collectives_take_numpy_scalars_and_return_the_inputs_device():
    """torch: a numpy scalar raised AttributeError ('detach'), and results came back on the CPU whatever the
    input's device (before 2026-12-06; only the CPU is here, so the device check is CPU to CPU)."""
    np.testing.assert_allclose(keras.ops.convert_to_numpy(uk.allgather(np.float32(R))), np.arange(N))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(uk.allreduce(np.float32(R + 1), op=uk.Sum)),
                               N * (N + 1) / 2)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(uk.broadcast(np.float32(R), root_rank=0)), 0.0)
    if BACKEND == "torch":
        import torch

        x = torch.full((2,), float(R))
        for out in (uk.allreduce(x), uk.allgather(x), uk.broadcast(x, 0)):
            assert out.device == x.device


def test_metric_average_callback_averages_array_metrics():
    logs = {"loss": float(R), "f1": np.array([R, 2.0 * R]), "name": "x"}
    uk.callbacks.MetricAverageCallback().on_epoch_end(0, logs)
    mean = (N - 1) / 2
    assert logs["loss"] == pytest.approx(mean) and isinstance(logs["loss"], float)
    np.testing.assert_allclose(logs["f1"], [mean, 2 * mean])  # (left per rank before)
    assert logs["name"] == "x"


def test_broadcast_variables_sets_root_values():
    v = keras.Variable(np.full((3,), float(R), "float32"))
    uk.broadcast_variables([v], root_rank=N - 1)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(v.value), np.full((3,), float(N - 1)))


def test_keras_pipeline_says_it_is_tensorflow_only():
    if BACKEND == "tensorflow":
        pytest.skip("runs there: tests/test_keras_pipeline_mpi.py")
    from unison.tf_backend import Pipeline, PipelineError

    with pytest.raises(PipelineError, match=f"TensorFlow backend only \\(KERAS_BACKEND is '{BACKEND}'\\)"):
        Pipeline(make_model(), loss="mse", optimizer="sgd")


def test_class_weights_are_derived_as_keras_derives_them():
    """Soft or smoothed labels are rounded (a 0.9 truncated to class 0 took class 0's weight), a
    class the dict lacks weighs 1.0, and class_weight with sample_weight is refused, all as Keras."""
    from keras.src.trainers.data_adapters.data_adapter_utils import class_weight_to_sample_weights

    weights = {0: 1.0, 1: 5.0}
    for labels in (np.array([0.1, 0.9, 0.4, 1.6, 2.2]), np.array([[0.0, 1.0], [0.8, 0.2]]),
                   np.array([[0], [1], [3]])):
        np.testing.assert_allclose(ukdata._class_weights(labels, weights),
                                   np.asarray(class_weight_to_sample_weights(labels, weights)))
    with pytest.raises(ValueError, match="class_weight and sample_weight cannot both be given"):
        ukdata.ShardedArrays(X, LABELS, np.ones(len(X)), batch_size=GLOBAL_BATCH, rank=R, size=N,
                             class_weight=weights)


def test_ranks_passing_different_data_raise_on_every_rank(dp):
    """Different batch sizes or rows per rank hung fit (each rank waited in a step the others never
    took), and predict returned some rows only: the ranks compare what they passed first."""
    with dp.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rows = len(X) - (R % 2) * 8
    for call in (lambda: model.fit(X, Y, batch_size=GLOBAL_BATCH * (1 + R % 2), epochs=1, verbose=0),
                 lambda: model.fit(X[:rows], Y[:rows], batch_size=GLOBAL_BATCH, epochs=1, verbose=0),
                 lambda: model.evaluate(X[:rows], Y[:rows], batch_size=GLOBAL_BATCH, verbose=0),
                 lambda: model.predict(X[:rows], batch_size=GLOBAL_BATCH, verbose=0)):
        if N == 1:
            call()
            continue
        with pytest.raises(ValueError, match="the ranks passed different inputs") as info:
            call()
        assert len(set(WORLD.allgather(str(info.value)))) == 1
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)  # and the next call works


def test_data_differing_in_one_row_that_is_neither_first_middle_nor_last_raises_on_every_rank(dp):
    """Three rows were digested before 2026-12-05: data differing elsewhere trained silently (each rank took its
    rows of a different global batch); a numpy array is now digested whole."""
    with dp.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x = X.copy()
    if R == N - 1:
        x[5] += 1.0
    if N > 1:
        with pytest.raises(ValueError, match="the ranks passed different inputs"):
            model.fit(x, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)


def test_a_large_array_is_digested_by_sampled_rows_and_a_difference_in_one_raises_on_every_rank(dp):
    """An array over 64 MiB is digested by 64 rows spread evenly, the first and the last among them: data
    differing in the last row raises on every rank, before any training (the rows are compared, not fitted)."""
    from unison.keras import data_parallel

    rows = data_parallel._WHOLE_BYTES // (4 * 4) + 8  # float32 (rows, 4): just over 64 MiB
    big = np.zeros((rows, 4), np.float32)
    assert big.nbytes > data_parallel._WHOLE_BYTES
    same = data_parallel._rows_digest(big)
    if R == N - 1:
        big[-1, 0] = 1.0
    assert (data_parallel._rows_digest(big) == same) == (R != N - 1)
    with dp.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    if N > 1:
        with pytest.raises(ValueError, match="the ranks passed different inputs") as info:
            model.fit(big, np.zeros((rows, 1), np.float32), batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
        assert len(set(WORLD.allgather(str(info.value)))) == 1


def test_models_computing_different_functions_raise_on_every_rank(dp):
    """[Note: one function on every rank]: a model with another activation on one rank (the weights, broadcast
    from rank 0, agree) trained each rank's rows through another function, silently (before 2026-12-05); fit,
    evaluate and predict now raise on every rank, and the same model on every rank then trains."""
    if N == 1:
        pytest.skip("needs two ranks")
    with dp.scope():
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(8, activation="relu" if R == N - 1 else "tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    for call in (lambda: model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0),
                 lambda: model.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=0)):
        with pytest.raises(ValueError, match=rf"the ranks' models compute different functions.*rank {N - 1} "
                                             r"\(largest difference"):
            call()
    with dp.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def test_an_unbuilt_model_evaluates_and_predicts_with_rank_0s_weights_before_fit(dp):
    """A subclassed model is built inside its first call: with each rank's own random weights, so
    evaluate and predict before any fit mixed several models. It is built on one row and takes
    rank 0's weights first."""
    keras.utils.set_random_seed(11 + R)
    with dp.scope():
        model = Subclassed()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rows = GLOBAL_BATCH * 2
    loss = model.evaluate(X[:rows], Y[:rows], batch_size=GLOBAL_BATCH, verbose=0)
    assert same_everywhere(model.get_weights())
    ref = Subclassed()
    ref(X[:1])
    ref.set_weights(model.get_weights())
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    assert loss == pytest.approx(ref.evaluate(X[:rows], Y[:rows], batch_size=GLOBAL_BATCH, verbose=0), rel=1e-5)
    other = None
    with dp.scope():
        other = Subclassed()
        other.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    got = other.predict(X[:rows], batch_size=GLOBAL_BATCH, verbose=0)
    assert same_everywhere(other.get_weights())
    want = keras.ops.convert_to_numpy(other(X[:rows]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_keras_backup_and_restore_is_refused_on_every_rank(dp, tmp_path_factory):
    """Keras's BackupAndRestore writes and deletes its folder from every rank: rank 0's save failed
    5 times in 6 when another rank deleted the folder first."""
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("bak")) if R == 0 else None)
    with dp.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    with pytest.raises(ValueError, match="keras.callbacks.BackupAndRestore writes and deletes its backup folder"):
        model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(folder)])


# --- unison.keras audit, 2026-12-05 ------------------------------------------------------------------------------

def test_compiled_again_outside_the_scope_the_model_stays_data_parallel_with_the_users_optimizer(dp):
    """Fine-tuning: compile again after the scope, with a new optimizer. Before: a plain compile kept Unison's
    fit (each rank on its rows) with an optimizer that exchanged nothing, so the ranks trained apart (0.03-0.1);
    and the optimizer compiled was a copy, so assigning the user's learning rate did nothing."""
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    tuned = keras.optimizers.Adam(0.02)
    model.compile(optimizer=tuned, loss="mse")  # outside the scope
    ref.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    assert model.optimizer is tuned
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, ref)
    assert same_everywhere(model.get_weights()) and int(tuned.iterations.numpy()) == 2 * 5
    tuned.learning_rate.assign(0.0)  # the user's handle is the model's optimizer
    before = model.get_weights()
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    for w, v in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(w, v)


class _GlobalBatches(keras.utils.PyDataset):
    """Global batches of (X, LABELS) as a PyDataset."""

    def __len__(self):
        return 5

    def __getitem__(self, i):
        return X[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH], LABELS[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]


def test_class_weight_with_a_pydataset_and_a_first_evaluate_on_an_unbuilt_model(dp):
    """Before: class_weight was dropped for a PyDataset (each rank trained unweighted); an unbuilt model's first
    evaluate on a PyDataset ran each rank's own random weights (and left them apart)."""
    class Net(keras.Model):  # subclassed: built on its first call
        def __init__(self):
            super().__init__()
            self.hidden, self.out = keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3, "softmax")

        def call(self, x):
            return self.out(self.hidden(x))

    keras.utils.set_random_seed(300 + R)
    with dp.scope():
        model = Net()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    got = model.evaluate(_GlobalBatches(), verbose=0)
    assert same_everywhere(model.get_weights())
    ref = Net()
    ref(X[:1])
    ref.set_weights(model.get_weights())
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    np.testing.assert_allclose(got, ref.evaluate(_GlobalBatches(), verbose=0), rtol=2e-5)
    weights = {0: 1.0, 1: 4.0, 2: 0.5}
    hist = model.fit(_GlobalBatches(), epochs=2, shuffle=False, class_weight=weights, verbose=0)
    want = ref.fit(_GlobalBatches(), epochs=2, shuffle=False, class_weight=weights, verbose=0)
    np.testing.assert_allclose(hist.history["loss"], want.history["loss"], rtol=2e-5)
    assert_weights_close(model, ref)


def test_ranks_passing_different_data_or_settings_raise_on_every_rank(dp):
    """Before: each rank's own shard of the same shape trained silently on part of each rank's rows;
    validation_data on rank 0 only hung; shuffle on some ranks only split different permutations."""
    if N == 1:
        pytest.skip("needs two ranks")
    model, _ = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    mine = X[R * 8:(R + 1) * 8]  # each rank's own rows (Horovod's habit): the same shape everywhere
    with pytest.raises(ValueError, match="the ranks passed different inputs or settings"):
        model.fit(mine, Y[R * 8:(R + 1) * 8], batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="validation=given.*validation=none"):
        model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0,
                  validation_data=(X[:GLOBAL_BATCH], Y[:GLOBAL_BATCH]) if R == 0 else None)
    with pytest.raises(ValueError, match="shuffle=True.*shuffle=False"):
        model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=R == 0)
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)  # and the next call pairs
    assert same_everywhere(model.get_weights())


def test_each_fit_call_shuffles_anew_and_fewer_rows_than_ranks(dp):
    """Before: every fit call (a loop of fit(epochs=1), a resumed run) replayed the first call's permutation;
    predict of fewer rows than ranks failed inside Keras, and evaluate raised a bare StopIteration."""
    model, ref = distributed_and_reference(dp, lambda: keras.optimizers.SGD(0.05))
    seeds = []
    for _ in range(2):
        model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
        seeds.append(dp.last_fit_seed)
    assert seeds[0] != seeds[1] and WORLD.allgather(seeds) == [seeds] * N
    orders = [ukdata.ShardedArrays(X, batch_size=GLOBAL_BATCH, rank=0, size=1, shuffle=True, seed=s)[0][:, 0]
              for s in seeds]
    assert not np.array_equal(orders[0], orders[1])
    few = X[:N - 1] if N > 1 else X[:1]
    ref.set_weights(model.get_weights())
    np.testing.assert_allclose(model.predict(few, verbose=0), ref.predict(few, verbose=0), rtol=1e-6)
    if N > 1:  # (it raised a ValueError naming the rows before 2026-12-07: [Note: shadow shares])
        got = model.evaluate(few, Y[:N - 1], verbose=0, return_dict=True)
        want = ref.evaluate(few, Y[:N - 1], verbose=0, return_dict=True)
        np.testing.assert_allclose([got["loss"], got["mae"]], [want["loss"], want["mae"]], rtol=1e-5)


def test_equal_text_in_object_arrays_agrees_across_ranks():
    """Strings held in an object array (df["text"].values for a StringLookup) are compared by value: the digest
    of their bytes (pointers, another on each rank) refused equal data on every rank (found by a review)."""
    from unison.keras.data_parallel import _agree_on_inputs

    text = np.array(["a", "bb", "ccc"] * 5, dtype=object)
    _agree_on_inputs("model.fit", text, Y[:15], None, GLOBAL_BATCH)
    if N > 1:
        with pytest.raises(ValueError, match="the ranks passed different inputs"):
            _agree_on_inputs("model.fit", np.array([f"rank{R}"] * 15, dtype=object), Y[:15], None, GLOBAL_BATCH)


# ----------------------------------------------------------------- from an audit of 2026-12-07
@pytest.mark.skipif(N == 1, reason="a rank that refuses and one that does not")
def test_ops_refuse_an_input_one_rank_cannot_convert_on_every_rank():
    """A ragged list on one rank raised there alone: the others' all-reduce met its next call (101 where 200
    was right, then a hang), before 2026-12-07."""
    bad = [[1.0, 2.0], [3.0]] if R == 0 else [1.0, 1.0, 1.0, 1.0]
    with pytest.raises((ValueError, TypeError)):
        uk.allreduce(bad, op=uk.Sum)
    got = uk.allreduce(np.full(4, 100.0, np.float32), op=uk.Sum)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), np.full(4, 100.0 * N))


@pytest.mark.skipif(BACKEND != "jax" or N == 1, reason="JAX's jitted programs")
def test_an_op_refused_while_traced_raises_on_every_rank_when_the_program_runs():
    """Refused at trace time on one rank, the others' compiled call met that rank's next one (before 2026-12-07);
    the refusal is now in the program, submitted when it runs."""
    import jax

    from unison.common.ops import Max

    op = Max if R == 0 else uk.Sum
    with pytest.raises(Exception, match="supports Average and Sum"):
        jax.block_until_ready(jax.jit(lambda t: uk.allreduce(t, op=op))(np.ones(4, np.float32)))
    got = uk.allreduce(np.full(4, 100.0, np.float32), op=uk.Sum)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), np.full(4, 100.0 * N))


def test_ops_take_keras_variables_and_a_0d_allgather_differentiates():
    """A keras.Variable was refused on JAX and torch, and a 0-d all-gather failed under jax.jit and jax.grad
    (before 2026-12-07)."""
    var = keras.Variable(np.full(2, float(R + 1), np.float32))
    total = np.full(2, N * (N + 1) / 2)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(uk.allreduce(var, op=uk.Sum)), total)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(uk.broadcast(var, N - 1)), np.full(2, float(N)))
    gathered = keras.ops.convert_to_numpy(uk.allgather(var))
    np.testing.assert_allclose(gathered, np.repeat(np.arange(1.0, N + 1), 2))
    if BACKEND == "jax":
        import jax

        s = jax.numpy.float32(R + 1.0)
        np.testing.assert_allclose(np.asarray(jax.jit(uk.allgather)(s)), np.arange(1.0, N + 1))
        grad = jax.grad(lambda t: (uk.allgather(t) * (jax.numpy.arange(N) + 1.0)).sum())(s)
        assert np.shape(grad) == () and float(grad) == (R + 1) * N  # every rank's weight for this rank's row


def test_broadcast_variables_of_a_model_with_dropout():
    """JAX's seed-generator state is uint32, which the collectives refused: broadcast_variables(model.variables)
    raised for any model with Dropout (before 2026-12-07)."""
    keras.utils.set_random_seed(50 + R)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.5),
                              keras.layers.Dense(1)])
    uk.broadcast_variables(model.variables, root_rank=0)
    for v in model.variables:
        assert same_everywhere([keras.ops.convert_to_numpy(v.value)]), v.path


def test_wrapping_a_used_optimizer_keeps_its_state():
    """Wrapping an optimizer already used (a loaded model's, to resume) rebuilt it from its configuration: Adam
    restarted at iteration 0 with zero moments (before 2026-12-07)."""
    keras.utils.set_random_seed(7)
    model = make_model()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(X[:16], Y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
    used = model.optimizer
    wrapped = uk.DistributedOptimizer(used)
    assert wrapped is not used and int(keras.ops.convert_to_numpy(wrapped.iterations)) == 2
    mine = {v.path: keras.ops.convert_to_numpy(v.value) for v in wrapped.variables}
    for v in used.variables:
        np.testing.assert_array_equal(mine[v.path], keras.ops.convert_to_numpy(v.value))


def test_the_rank0_checkpoints_collective_says_every_rank_passes_the_callback(monkeypatch, tmp_path):
    """Horovod's scripts add their checkpoint callback on rank 0 only; this one is collective. The deadlock
    check's report named an unnamed broadcast (before 2026-12-07); its name now says what to do."""
    from unison.common.engine import objects

    names = []
    real = objects.broadcast_object

    def spy(obj, root_rank=0, name=None, process_set=None):
        names.append(name)
        return real(obj, root_rank, name, process_set)
    monkeypatch.setattr(objects, "broadcast_object", spy)
    from unison.keras.callbacks import rank0_saves

    rank0_saves("ModelCheckpoint", lambda: None)
    assert N == 1 or names == ["ModelCheckpoint: every rank passes this callback (rank 0 saves)"], names


def test_horovod_schedule_callback_load_model_and_group_keywords(tmp_path_factory):
    """Horovod's LearningRateScheduleCallback and load_model, and DistributedOptimizer's num_groups/groups/
    scale_local_gradients keywords (a TypeError before 2026-12-07), on every backend."""
    keras.utils.set_random_seed(9)
    model = make_model()
    model.compile(optimizer=uk.DistributedOptimizer(keras.optimizers.SGD(0.1), num_groups=2, groups=None,
                                                    scale_local_gradients=True), loss="mse")
    history = model.fit(X[:32], Y[:32], batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[
        uk.callbacks.BroadcastGlobalVariablesCallback(0),
        uk.callbacks.LearningRateScheduleCallback(0.1, multiplier=0.5, start_epoch=1)])
    # (m ** (epoch - start_epoch), as Horovod since 0.23: [0.1, 0.05, 0.025] before 2026-12-07)
    np.testing.assert_allclose(history.history["lr"], [0.1, 0.1, 0.05], rtol=1e-6)
    with pytest.raises(ValueError, match="groups"):
        uk.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=0)
    # load_model: the optimizer distributed, its state kept, and training goes on alike on every rank
    plain = make_model()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain.fit(X[:16], Y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path_factory.mktemp("uk_load") / "m.keras")
    if R == 0:
        plain.save(path)
    path = WORLD.bcast(path)
    WORLD.Barrier()
    loaded = uk.load_model(path)
    assert getattr(loaded.optimizer, "_unison_distributed", False)
    assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)) == 2
    loaded.fit(X[R * 8:(R + 1) * 8], Y[R * 8:(R + 1) * 8], batch_size=8, epochs=1, verbose=0)
    assert same_everywhere([keras.ops.convert_to_numpy(w) for w in loaded.get_weights()])


def make_float8_model() -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.quantize("float8")  # each Dense gets *_scale and *_amax_history: overwrite_with_gradient=True
    return model


@pytest.mark.parametrize("overlap", [True, False], ids=["streamed", "at_apply"])
def test_float8_scales_take_the_global_batchs_maximum_as_one_process(overlap):
    """[Note: gradients that are next values]: a float8 layer's scales and amax histories are overwritten with
    their "gradient", the history rolled with the batch's absolute maximum. Before 2026-12-07 DataParallel (and
    unison.keras's DistributedOptimizer) averaged them over the ranks: an amax history 0.33 off one process's
    at 2 ranks (an audit). Now the maximum over the ranks: after a step the inputs' and kernels' scales and
    histories are one process's over the global batch, on every rank. Not the output gradients' history: each
    rank's loss is its own rows' mean, so its output gradients are N times the global batch's share of them,
    and so is their maximum (docs/keras_backends.md); over many steps float8 then scales the backward pass
    differently from one process, and the weights drift apart by up to about 1e-2."""
    if BACKEND != "torch" and not overlap:
        pytest.skip("streaming during backward is the torch backend's only")
    keras.utils.set_random_seed(7)  # (SGD: Adam's first step moves a weight by the learning rate whatever the
    # gradient's size, so a tiny gradient whose float8 rounding differs at 3 ranks flipped a weight by 0.02)
    with uk.DataParallel(overlap_gradients=overlap).scope():
        model = make_float8_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    ref = make_float8_model()
    ref.set_weights(WORLD.bcast(model.get_weights()))
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y = X[:GLOBAL_BATCH], Y[:GLOBAL_BATCH]  # (its largest value on one rank: averaged, it was off)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert same_everywhere(model.get_weights())
    moved = 0
    for v, w, r in zip(ref.weights, model.get_weights(), ref.get_weights(), strict=True):
        if v.overwrite_with_gradient and "outputs_grad" not in v.path:
            moved += int(np.any((r != 1.0) & (r != 0.0)))
            np.testing.assert_allclose(w, r, rtol=1e-6, err_msg=v.path)
        elif not v.overwrite_with_gradient:  # (float8 e5m2 gradients keep 2 bits: at 3 ranks up to 4e-3 off)
            np.testing.assert_allclose(w, r, rtol=1e-2, atol=5e-3, err_msg=v.path)
    assert moved > 0
