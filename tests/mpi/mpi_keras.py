"""UnisonStrategy under mpirun: Keras 3 model.fit and custom loops match one process."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

from unison.tf_backend import UnisonStrategy  # noqa: E402

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
GLOBAL_BATCH = 8 * N
rs = np.random.RandomState(0)
X = rs.randn(GLOBAL_BATCH * 5, 4).astype("float32")
Y = (X[:, 1:] @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.1).astype("float32")


@pytest.fixture(scope="module")
def strategy():
    return UnisonStrategy()


def data() -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)


def make_model() -> keras.Model:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def same_everywhere(weights: list[np.ndarray]) -> bool:
    flat = np.concatenate([w.ravel() for w in weights])
    return all(np.array_equal(flat, other) for other in WORLD.allgather(flat))


def test_replicas_and_data_split(strategy):
    assert strategy.num_replicas_in_sync == N
    rows = [b[0].numpy() for b in strategy.experimental_distribute_dataset(data())]
    assert len(rows) == 5 and all(r.shape == (8, 4) for r in rows)
    everyone = WORLD.allgather(np.concatenate(rows))
    seen = np.concatenate(everyone)
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, X.tolist()))  # disjoint, complete


@pytest.mark.parametrize("overlap", [False, True])
def test_fit_matches_one_process_on_global_batches(overlap):
    strategy = UnisonStrategy(overlap_gradients=overlap)  # each gradient reduced as computed, or all at once
    keras.utils.set_random_seed(100 + R)  # ranks initialise differently: the broadcast must fix it
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    init = model.get_weights()
    assert same_everywhere(init)
    hist = model.fit(data(), epochs=3, verbose=0)
    ref = make_model()
    ref.set_weights(init)
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    ref_hist = ref.fit(data(), epochs=3, verbose=0, shuffle=False)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(hist.history["mae"], ref_hist.history["mae"], rtol=1e-5)
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    assert same_everywhere(model.get_weights())
    ev = model.evaluate(data(), verbose=0, return_dict=True)
    ref_ev = ref.evaluate(data(), verbose=0, return_dict=True)
    assert ev["loss"] == pytest.approx(ref_ev["loss"], rel=1e-5)
    reported = WORLD.allgather(ev["loss"])
    assert all(v == reported[0] for v in reported)  # the same number on every rank


@pytest.mark.parametrize("clip", [{"clipvalue": 0.05}, {"clipnorm": 0.5}, {"global_clipnorm": 0.5}],
                         ids=["clipvalue", "clipnorm", "global_clipnorm"])
def test_optimizer_clipping_clips_the_global_gradient(strategy, clip):
    """[Note: clipping the global gradient]: one process clips the global batch's gradient; each rank
    used to clip its own share before the sum (clipvalue let N x the value through)."""
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1, **clip), loss="mse")
    init = model.get_weights()
    model.fit(data(), epochs=2, verbose=0)
    ref = make_model()
    ref.set_weights(init)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, **clip), loss="mse")
    ref.fit(data(), epochs=2, verbose=0, shuffle=False)
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    assert same_everywhere(model.get_weights())


def test_load_model_restores_the_optimizer_under_the_strategy(strategy, tmp_path_factory):
    """The strategy guards model.compile on Keras's own class: load_model then still compiles a loaded
    model from its config (with a compile set on keras.Model it took it for the user's own and
    restored no optimizer, so a resumed ModelCheckpoint file lost Adam's slots and step count)."""
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("load_model")) if R == 0 else None)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        model.fit(data(), epochs=1, verbose=0)
        model.save(f"{folder}/m.keras")  # rank 0 writes
        WORLD.Barrier()
        loaded = keras.models.load_model(f"{folder}/m.keras")
    assert loaded.optimizer is not None
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 5
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fit_with_numpy_arrays(strategy):
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    assert same_everywhere(model.get_weights())


@pytest.mark.parametrize("overlap", [False, True])
def test_custom_training_loop_matches_one_process(overlap):
    strategy = UnisonStrategy(overlap_gradients=overlap)
    keras.utils.set_random_seed(7 + R)
    with strategy.scope():
        model = make_model()
        opt = keras.optimizers.SGD(0.05)
        opt.build(model.trainable_variables)
    ref = make_model()
    ref.set_weights(model.get_weights())
    ref_opt = keras.optimizers.SGD(0.05)
    dist = strategy.experimental_distribute_dataset(data())

    @tf.function
    def step(batch):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean((model(x) - y) ** 2, axis=1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables, strict=True))
            return loss
        per_replica = strategy.run(replica_step, args=batch)
        return strategy.reduce("SUM", per_replica, axis=None)

    losses = [float(step(b)) for b in dist]
    ref_losses = []
    for x, y in data():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((ref(x) - y) ** 2)
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables,
                                    strict=True))
        ref_losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)


def test_datasets_from_function_and_gather(strategy):
    seen = []

    def dataset_fn(ctx):
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id))
        return tf.data.Dataset.from_tensor_slices(X).batch(ctx.get_per_replica_batch_size(GLOBAL_BATCH))

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    first = next(iter(dist))
    assert seen == [(N, R)] and first.shape[0] == 8
    gathered = strategy.gather(strategy.run(lambda: tf.fill([2], float(R))), axis=0)
    np.testing.assert_array_equal(gathered.numpy(), np.repeat(np.arange(N, dtype=np.float32), 2))
    local = strategy.experimental_local_results(strategy.run(lambda: tf.constant(1.0)))
    assert len(local) == 1


def test_reduce_of_shares_whose_shapes_differ_raises_on_every_rank(strategy):
    """axis=None over per-replica values of different first dimensions (an uneven last batch): the
    engine's mismatch error names the shapes on every rank (the shapes were in the collective's name,
    so each rank waited under another name for ever)."""
    if N == 1:
        pytest.skip("needs ranks whose shares differ")
    value = strategy.run(lambda: tf.ones([2 + R, 2]))
    with pytest.raises(tf.errors.FailedPreconditionError, match=r"shape=\(2, 2\).*shape=\(3, 2\)"):
        strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=0)  # along the batch: fine
    np.testing.assert_array_equal(total.numpy(), np.full([2], sum(2 + r for r in range(N)), np.float32))


def test_unbatched_dataset_is_refused(strategy):
    with pytest.raises(ValueError, match="batched dataset"):
        strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(np.arange(4.0)))


def test_backup_and_restore_resumes_interrupted_fit(strategy, tmp_path_factory):
    from unison.tf_backend.keras import callbacks

    backup = WORLD.bcast(str(tmp_path_factory.mktemp("backup")) if R == 0 else None)
    ckpt = WORLD.bcast(str(tmp_path_factory.mktemp("ckpt")) if R == 0 else None)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("simulated crash")

    def fresh():
        keras.utils.set_random_seed(5)
        with strategy.scope():
            m = make_model()
            m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return m

    straight = fresh()
    straight.fit(data(), epochs=4, verbose=0)
    first = fresh()
    with pytest.raises(RuntimeError, match="simulated crash"):
        first.fit(data(), epochs=4, verbose=0,
                  callbacks=[callbacks.BackupAndRestore(backup),
                             callbacks.ModelCheckpoint(ckpt + "/m-{epoch}.weights.h5", save_weights_only=True),
                             Interrupt()])
    resumed = fresh()
    seen = []

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(epoch)

    resumed.fit(data(), epochs=4, verbose=0, callbacks=[callbacks.BackupAndRestore(backup), Epochs()])
    assert seen == [2, 3]
    for w, v in zip(resumed.get_weights(), straight.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    assert same_everywhere(resumed.get_weights())
    if R == 0:
        assert sorted(os.listdir(ckpt)) == ["m-1.weights.h5", "m-2.weights.h5"]


def test_model_built_outside_scope_is_refused_inside_it(strategy):
    outside = make_model()
    with strategy.scope(), pytest.raises(ValueError, match="created outside `with strategy.scope"):
        outside.compile(optimizer="sgd", loss="mse")
    outside.compile(optimizer="sgd", loss="mse")  # entirely outside: a local model, allowed
    with strategy.scope(), pytest.raises(ValueError, match="would diverge"):
        outside.fit(data(), epochs=1, verbose=0)


def test_only_rank_0_prints_keras_progress_unless_asked(capsys):
    """Keras's progress bar on rank 0 only; ``quiet_nonzero_ranks=False`` leaves every rank's."""
    try:
        keras.config.enable_interactive_logging()
        strategy = UnisonStrategy()
        assert keras.config.is_interactive_logging_enabled() == (R == 0)
        with strategy.scope():
            model = make_model()
            model.compile(optimizer="sgd", loss="mse")
        capsys.readouterr()
        model.fit(data(), epochs=1, verbose=1, shuffle=False)
        printed = capsys.readouterr().out
        assert WORLD.allgather("5/5" in printed) == [r == 0 for r in range(N)]

        keras.config.enable_interactive_logging()
        UnisonStrategy(quiet_nonzero_ranks=False)
        assert keras.config.is_interactive_logging_enabled()
        model.fit(data(), epochs=1, verbose=1, shuffle=False)
        assert all(WORLD.allgather("5/5" in capsys.readouterr().out))
    finally:
        keras.config.enable_interactive_logging()
        if R != 0:  # as the module's other strategies left it
            keras.config.disable_interactive_logging()


def test_overlap_gradients_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="overlap_gradients must be True, False or None"):
        UnisonStrategy(overlap_gradients="yes")


def test_predict_returns_the_global_predictions_on_every_rank(strategy):
    keras.utils.set_random_seed(3 + R)
    with strategy.scope():
        model = make_model()
    ref = make_model()
    ref.set_weights(model.get_weights())
    x = X[:-3]  # the last global batch is partial: ranks get unequal shares of it
    out = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    assert out.shape == (len(x), 1)
    # float32 matmuls over a share of the rows round differently from the whole batch: atol
    np.testing.assert_allclose(out, ref.predict(x, batch_size=GLOBAL_BATCH, verbose=0), rtol=1e-6, atol=1e-6)
    from_dataset = model.predict(tf.data.Dataset.from_tensor_slices(x).batch(GLOBAL_BATCH), verbose=0)
    np.testing.assert_allclose(from_dataset, out, rtol=1e-6)
    assert same_everywhere([out])


@pytest.mark.parametrize("how", ["arrays", "dataset", "on_batch"])
def test_predict_builds_an_unbuilt_model_as_keras_does(strategy, how):
    """Keras builds an unbuilt model in predict; under the strategy that happened inside the traced step,
    which refuses new variables (a RuntimeError on every rank, before 2026-12-05)."""
    keras.utils.set_random_seed(5 + R)
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(2)])
    x = X[:8]
    if how == "arrays":
        out = model.predict(x, verbose=0)
    elif how == "dataset":
        out = model.predict(tf.data.Dataset.from_tensor_slices((x, Y[:8])).batch(4), verbose=0)
    else:
        out = model.predict_on_batch(x)
    assert out.shape == (8, 2) and same_everywhere([out] + model.get_weights())
    np.testing.assert_allclose(out, x @ model.get_weights()[0] + model.get_weights()[1], rtol=1e-5, atol=1e-5)


def shared_dir(tmp_path_factory, name):
    return WORLD.bcast(str(tmp_path_factory.mktemp(name)) if R == 0 else None)


def test_save_and_keras_model_checkpoint_write_from_rank_0_only(strategy, tmp_path_factory):
    folder = shared_dir(tmp_path_factory, "save")
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="sgd", loss="mse")
    assert model.save(f"{folder}/r{R}.keras") is None
    model.save_weights(f"{folder}/r{R}.weights.h5")
    model.fit(data(), epochs=2, verbose=0, callbacks=[  # Keras's own callback, on every rank
        keras.callbacks.ModelCheckpoint(folder + "/ckpt-{epoch}.keras")])
    WORLD.Barrier()
    assert sorted(os.listdir(folder)) == ["ckpt-1.keras", "ckpt-2.keras", "r0.keras", "r0.weights.h5"]
    loaded = keras.models.load_model(f"{folder}/ckpt-2.keras")
    for w, v in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(w, v)


def test_tf_train_checkpoint_writes_from_rank_0_only(strategy, tmp_path_factory):
    folder = shared_dir(tmp_path_factory, "tfckpt")
    with strategy.scope():
        model = make_model()
    ckpt = tf.train.Checkpoint(model=model)
    assert ckpt.write(f"{folder}/w{R}") == f"{folder}/w{R}"
    manager = tf.train.CheckpointManager(ckpt, f"{folder}/managed", max_to_keep=2)
    paths = [manager.save() for _ in range(3)]
    assert paths == [f"{folder}/managed/ckpt-{i}" for i in (1, 2, 3)]
    WORLD.Barrier()
    assert sorted(p for p in os.listdir(folder) if p != "managed") == ["w0.data-00000-of-00001", "w0.index"]
    assert sorted(os.listdir(f"{folder}/managed")) == [
        "checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index", "ckpt-3.data-00000-of-00001",
        "ckpt-3.index"]
    saved = [w.copy() for w in model.get_weights()]
    model.set_weights([np.zeros_like(w) for w in saved])
    ckpt.restore(tf.train.latest_checkpoint(f"{folder}/managed")).assert_consumed()
    for w, v in zip(model.get_weights(), saved, strict=True):
        np.testing.assert_array_equal(w, v)


def test_reductions_of_constants_in_a_tf_function_run_every_call(strategy):
    # grappler folds a stateless callback of constants at optimisation time: it would run once
    @tf.function
    def step(k):
        total = strategy.reduce("SUM", strategy.run(lambda: tf.constant([1.0, 2.0])), axis=None)
        mine = strategy.reduce("SUM", strategy.run(lambda: tf.cast(k, tf.float32) * (R + 1)), axis=None)
        return total, mine

    for k in range(3):
        total, mine = step(tf.constant(k))
        np.testing.assert_array_equal(total.numpy(), [N * 1.0, N * 2.0])
        assert float(mine) == k * N * (N + 1) / 2


class TwoBranches(keras.Model):
    """Two same-shaped Dense branches; ``use_a`` picks one (a Python constant: fixed when traced)."""

    def __init__(self, use_a: bool) -> None:
        super().__init__()
        self.use_a = use_a
        self.a = keras.layers.Dense(3, activation="tanh")
        self.b = keras.layers.Dense(3, activation="tanh")
        self.head = keras.layers.Dense(1)

    def build(self, input_shape):
        # every rank creates every variable, in the same order (UnisonStrategy broadcasts each)
        self.a.build(input_shape)
        self.b.build(input_shape)
        self.head.build((None, 3))

    def call(self, x):
        return self.head(self.a(x) if self.use_a else self.b(x))


@pytest.mark.parametrize("how", ["fit", "fit_overlap", "eager_loop"])
def test_gradients_of_branches_unused_on_some_ranks_pair_by_variable(how):
    # issue 10 item 3 (strategy path): rank r's data goes through branch a (r even) or b (r odd), so
    # Keras drops different None gradients per rank; they were then paired by position among the rest
    # (a's kernel summed with b's: same shapes), instead of by variable
    strategy = UnisonStrategy(overlap_gradients=how == "fit_overlap")
    keras.utils.set_random_seed(11)
    with strategy.scope():
        model = TwoBranches(use_a=R % 2 == 0)
        model.build((None, 4))
        opt = keras.optimizers.SGD(0.1)
        model.compile(optimizer=opt, loss="mse")
    init = model.get_weights()
    steps = 2
    if how.startswith("fit"):
        model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).take(steps * GLOBAL_BATCH).batch(GLOBAL_BATCH),
                  epochs=1, verbose=0)
    else:
        opt.build(model.trainable_variables)
        dist = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((X, Y)).take(steps * GLOBAL_BATCH).batch(GLOBAL_BATCH))

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2) / N
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        for batch in dist:
            strategy.run(replica_step, args=batch)
    # one process: the mean over the ranks' shards of each shard's loss through that rank's branch
    ref = TwoBranches(use_a=True)
    ref.build((None, 4))
    ref.set_weights(init)
    ref_opt = keras.optimizers.SGD(0.1)
    for s in range(steps):
        with tf.GradientTape() as tape:
            losses = []
            for r in range(N):
                rows = slice(s * GLOBAL_BATCH + r * 8, s * GLOBAL_BATCH + (r + 1) * 8)
                ref.use_a = r % 2 == 0
                losses.append(tf.reduce_mean((ref(X[rows]) - Y[rows]) ** 2))
            loss = tf.add_n(losses) / N
        grads = tape.gradient(loss, ref.trainable_variables)
        ref_opt.apply_gradients([(g, v) for g, v in zip(grads, ref.trainable_variables, strict=True)
                                 if g is not None])
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    assert same_everywhere(model.get_weights())


def test_ranks_feeding_different_data_raise_on_every_rank(strategy):
    """A rank with fewer global batches (or another batch size) finished fit silently, its steps
    paired with other ranks' rows, and the others failed or hung in the next call."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(0).standard_normal((48, 4)).astype("float32")
    y = x[:, :1].copy()
    rows = 48 if R == 0 else 32
    for call in (lambda: model.fit(x[:rows], y[:rows], batch_size=8, epochs=1, verbose=0),
                 lambda: model.fit(x, y, batch_size=8 if R == 0 else 12, epochs=1, verbose=0),
                 lambda: model.evaluate(x[:rows], y[:rows], batch_size=8, verbose=0)):
        if N == 1:
            call()
            continue
        with pytest.raises(ValueError, match="UnisonStrategy: the ranks' datasets differ") as info:
            call()
        assert len(set(WORLD.allgather(str(info.value)))) == 1
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # the next call works


def test_each_ranks_own_shard_of_one_shape_is_refused_on_every_rank(strategy):
    """Horovod's habit, each rank passing its own part of the data: the shapes agree, so only shapes compared
    (before 2026-12-05), each rank trained silently on its share of its own batches (half of every part)."""
    if N == 1:
        pytest.skip("one rank's data is the whole data")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(0).standard_normal((16 * N, 4)).astype("float32")
    mine = x[16 * R:16 * (R + 1)]
    for call in (lambda: model.fit(mine, mine[:, :1], batch_size=8, epochs=1, verbose=0),
                 lambda: model.evaluate(mine, mine[:, :1], batch_size=8, verbose=0)):
        with pytest.raises(ValueError, match="UnisonStrategy: the ranks' datasets differ") as info:
            call()
        assert len(set(WORLD.allgather(str(info.value)))) == 1
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)  # the whole data on every rank works


class _StopOnOneRank(keras.callbacks.Callback):
    def __init__(self, when: str) -> None:
        super().__init__()
        self.when = when

    def on_train_batch_end(self, batch, logs=None):
        if self.when == "batch" and R == N - 1 and batch == 1:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self.when == "epoch" and R == N - 1 and epoch == 0:
            self.model.stop_training = True


@pytest.mark.parametrize("when", ["batch", "epoch"])
def test_a_stop_set_on_one_rank_stops_every_rank_at_the_same_step(strategy, when):
    """A callback stopping training on one rank (a time limit, a rule on its own values) let that rank return
    from fit while the others waited in the next step's gradient exchange for ever (before 2026-12-05)."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    stop = _StopOnOneRank(when)  # (alone, not in a list, at epoch ends: Keras takes both)
    history = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=3, verbose=0, shuffle=False,
                        callbacks=[stop] if when == "batch" else stop)
    steps = int(model.optimizer.iterations.numpy())
    expected = (2, 1) if when == "batch" else (5, 1)  # (steps, epochs) on every rank
    assert (steps, len(history.history["loss"])) == expected
    assert WORLD.allgather((steps, len(history.history["loss"]))) == [expected] * N
    assert same_everywhere(model.get_weights())


def test_predict_on_batch_returns_the_batchs_predictions_before_and_after_predict(strategy):
    """predict_on_batch after predict returned each rank's whole batch concatenated (every row
    size times): it now predicts this rank's share and gathers, as predict does."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(3).standard_normal((5, 4)).astype("float32")
    want = keras.ops.convert_to_numpy(model(x))
    first = np.asarray(model.predict_on_batch(x))
    model.predict(x, batch_size=5, verbose=0)
    again = np.asarray(model.predict_on_batch(x))
    for got in (first, again):
        assert got.shape == (5, 1)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- audit of 2026-12-05 (each failed or hung before)
class RowRecorder(keras.Sequential):
    """Records the first feature (a row id) of every row each rank trains on."""

    seen: list[np.ndarray] = []

    def train_step(self, data):
        x = data[0]
        tf.numpy_function(lambda a: RowRecorder.seen.append(a.copy()) or np.int64(0), [x[:, 0]], tf.int64)
        return super().train_step(data)


def test_fit_on_arrays_shuffles_alike_on_every_rank(strategy):
    """Before: fit's default shuffle=True permuted the arrays with each rank's own random state, and each rank
    took its share of its own permutation's batch: 24 distinct rows of 32 in an epoch at 2 ranks."""
    keras.utils.set_random_seed(300 + R)  # the ranks' random states differ, as in any job
    ids = np.zeros((GLOBAL_BATCH * 4, 4), "float32")
    ids[:, 0] = np.arange(len(ids))
    with strategy.scope():
        model = RowRecorder([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse", run_eagerly=True)
    RowRecorder.seen = []
    model.fit(ids, np.zeros((len(ids), 1), "float32"), batch_size=GLOBAL_BATCH, epochs=2, verbose=0)
    mine = np.concatenate(RowRecorder.seen).astype(int)
    every = np.stack(WORLD.allgather(mine.reshape(2, -1)))  # (rank, epoch, rows)
    for epoch in range(2):
        assert sorted(every[:, epoch].ravel().tolist()) == list(range(len(ids))), epoch  # each row once
    assert every[:, 0].ravel().tolist() != every[:, 1].ravel().tolist()  # a new order each epoch
    assert same_everywhere(model.get_weights())
    # validation_split still takes the last rows (before shuffling), class weights still weigh
    RowRecorder.seen = []
    hist = model.fit(ids, np.zeros((len(ids), 1), "float32"), batch_size=GLOBAL_BATCH, epochs=1, verbose=0,
                     validation_split=0.25)
    trained = np.concatenate(WORLD.allgather(np.concatenate(RowRecorder.seen).astype(int)))
    assert sorted(trained.tolist()) == list(range(GLOBAL_BATCH * 3)) and "val_loss" in hist.history


def test_fit_with_steps_per_epoch_ends_an_epoch_where_the_shuffled_pass_runs_out(strategy):
    """Before: with shuffle=True and a steps_per_epoch not dividing a pass's batches, every epoch ran that many
    steps through the endless pipeline (9 here), where Keras alone ends an epoch with the pass (3 + 1 + 3) and
    reshuffles for the next."""
    ids = np.zeros((GLOBAL_BATCH * 4 - 3, 4), "float32")  # 4 batches a pass, the last one short
    ids[:, 0] = np.arange(len(ids))
    zeros = np.zeros((len(ids), 1), "float32")
    with strategy.scope():
        model = RowRecorder([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse", run_eagerly=True)
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    plain.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse")
    want = plain.fit(ids, zeros, batch_size=GLOBAL_BATCH, epochs=3, steps_per_epoch=3, verbose=0)
    RowRecorder.seen = []
    got = model.fit(ids, zeros, batch_size=GLOBAL_BATCH, epochs=3, steps_per_epoch=3, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 7
    assert len(got.history["loss"]) == len(want.history["loss"]) == 3
    steps = [np.concatenate(WORLD.allgather(b.astype(int))) for b in RowRecorder.seen]  # each step's rows
    assert len(steps) == 7
    assert sorted(np.concatenate(steps[:4]).tolist()) == list(range(len(ids)))  # one pass: each row once
    assert len(set(np.concatenate(steps[4:]).tolist())) == 3 * GLOBAL_BATCH  # the next pass, begun anew
    assert np.concatenate(steps[4:]).tolist() != np.concatenate(steps[:3]).tolist()  # reshuffled
    assert same_everywhere(model.get_weights())


def test_dropout_draws_each_ranks_own_masks_in_fit_when_every_rank_is_seeded_alike(strategy):
    """Before: with keras.utils.set_random_seed(42) on every rank (a seeded script), every rank's Dropout drew the
    same masks at every step, so row i of every rank's share got the same one (one process draws a mask per
    row); now each rank but 0 moves its seed generators to a stream of its own when fit starts."""
    keras.utils.set_random_seed(42)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(X, X[:, :1], batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    mask = keras.ops.convert_to_numpy(model.layers[0](np.ones((64, 8), "float32"), training=True)) == 0
    masks = WORLD.allgather(mask)
    assert N == 1 or not any(np.array_equal(masks[0], m) for m in masks[1:])
    assert same_everywhere(model.get_weights())


def test_an_unseeded_dataset_shuffle_raises_on_every_rank(strategy):
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    tf.random.set_seed(7 + R)  # an op seed derived from each rank's own global seed: compared, and refused
    shuffled = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(len(X)).batch(GLOBAL_BATCH)
    if N > 1:  # (one rank has nothing to differ from)
        with pytest.raises(ValueError, match=r"datasets differ .*shuffled with seeds"):
            model.fit(shuffled, epochs=1, verbose=0)
    tf.random.set_seed(None)  # no seed at all: each rank shuffles from its own entropy
    shuffled = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(len(X)).batch(GLOBAL_BATCH)
    with pytest.raises(ValueError, match="shuffled without a seed"):
        model.fit(shuffled, epochs=1, verbose=0)
    seeded = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(len(X), seed=4).batch(GLOBAL_BATCH)
    model.fit(seeded, epochs=1, verbose=0)
    assert same_everywhere(model.get_weights())


def test_metric_objects_made_outside_the_scope_and_per_rank_loss_reductions_are_refused(strategy):
    """Before: an AUC built before the scope reported each rank's own share (EarlyStopping on it stopped some
    ranks only: a hang), and reduction='mean_with_sample_weight' divided by each rank's own weights."""
    auc = keras.metrics.AUC(name="outside_auc")
    with strategy.scope():
        model = make_model()
        with pytest.raises(ValueError, match="created outside `with strategy.scope"):
            model.compile(optimizer="sgd", loss="mse", metrics=[auc])
        with pytest.raises(ValueError, match="mean_with_sample_weight"):
            model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
        model.compile(optimizer="sgd", loss="mse", metrics=[keras.metrics.AUC(name="inside_auc")])  # fine


def test_broadcast_callback_syncs_a_model_built_in_the_first_step():
    """Before: a model without an Input has no variables at on_train_begin, so nothing was broadcast and the
    ranks trained apart (Horovod broadcasts the model after the first batch)."""
    import unison.tf_backend.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(40 + R)  # different initial weights on each rank
    model = keras.Sequential([keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    rows = np.arange(R * 8, (R + 1) * 8)
    model.fit(X[rows], Y[rows], batch_size=8, epochs=2, verbose=0, shuffle=False,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert same_everywhere(model.get_weights())


def test_model_checkpoint_keeps_the_last_good_file_when_a_save_fails(tmp_path_factory):
    """Before: outside a strategy, rank 0 let Keras write the file in place, so a save that failed part-way
    destroyed the previous checkpoint. And rank 0 raised alone, the others going on into a collective it never
    joined (before 2026-12-06; found by an audit): every rank raises now, naming rank 0's error."""
    import unison.tf_backend.keras as hvd

    hvd.init()

    class Flaky(keras.layers.Dense):
        saves = 0

        def save_own_variables(self, store):
            Flaky.saves += 1
            if Flaky.saves == 2:
                raise OSError("simulated: the disk filled during the save")
            super().save_own_variables(store)

    folder = WORLD.bcast(str(tmp_path_factory.mktemp("atomic_ckpt")) if R == 0 else None)
    path = os.path.join(folder, "model.keras")
    model = keras.Sequential([keras.Input((4,)), Flaky(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    with pytest.raises(hvd.UnisonError, match="ModelCheckpoint: rank 0 could not save") as info:
        model.fit(X[:32], Y[:32], epochs=2, verbose=0, callbacks=[hvd.callbacks.ModelCheckpoint(path)])
    assert "simulated: the disk filled during the save" in str(info.value)
    assert len(set(WORLD.allgather(str(info.value)))) == 1
    WORLD.Barrier()
    if R == 0:
        keras.models.load_model(path, custom_objects={"Flaky": Flaky})  # the epoch-1 file, whole
        assert os.listdir(folder) == ["model.keras"]


EX = np.random.RandomState(4).randint(0, 3, size=(GLOBAL_BATCH * 3, 2)).astype("int32")  # rows repeat in a batch
EY = np.random.RandomState(5).randn(GLOBAL_BATCH * 3, 2).astype("float32")


@pytest.mark.parametrize("overlap, clip", [(False, {}), (True, {}), (False, {"clipnorm": 0.05})])
def test_embedding_rows_reach_adam_as_in_one_process(overlap, clip):
    """[Note: sparse gradients under the strategy]: an Embedding's tf.IndexedSlices are gathered, so Adam
    squares each looked-up row as one process does. Before 2026-12-05 they were summed densely (the square
    of the sum for a repeated row): 0.10 off one process after 3 steps."""
    def make():
        return keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(3, 2, name="emb"),
                                 keras.layers.Flatten(), keras.layers.Dense(2, name="d")])

    keras.utils.set_random_seed(3)
    with UnisonStrategy(overlap_gradients=overlap).scope():
        model = make()
        model.compile(optimizer=keras.optimizers.Adam(0.05, **clip), loss="mse")
    init = model.get_weights()
    model.fit(tf.data.Dataset.from_tensor_slices((EX, EY)).batch(GLOBAL_BATCH), epochs=1, verbose=0)
    ref = make()
    ref.set_weights(init)
    ref.compile(optimizer=keras.optimizers.Adam(0.05, **clip), loss="mse")
    ref.fit(EX, EY, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    assert same_everywhere(model.get_weights())


def collectives_inside_branches(graph: tf.Graph) -> tuple[list[str], list[str]]:
    """The names of the engine's collect ops at the top of ``graph`` (run in program order) and inside the
    functions of its control flow (the branches of an If op: TensorFlow orders those by nothing)."""
    def collects(nodes: list) -> list[str]:
        return [n.name for n in nodes if n.op in ("PyFunc", "EagerPyFunc") and n.name.endswith("collect")]

    graph_def = graph.as_graph_def()
    return collects(graph_def.node), [c for f in graph_def.library.function for c in collects(f.node_def)]


@pytest.mark.parametrize("clip", [{}, {"clipnorm": 0.3}], ids=["plain", "clipnorm"])
def test_gradient_accumulation_reduces_outside_keras_cond_and_matches_one_process(strategy, clip):
    """[Note: gradient accumulation under the strategy]: Keras reduced (and clipped) the gradients inside
    ``ops.cond(is_update_step, ...)``, an If op ordered after no collective, so ranks ran it and the loss
    metric's collective in different orders and hung (3 runs of 4 at TF_NUM_INTEROP_THREADS=1, before
    2026-12-07). Now every collective of a step is at the top of the graph, and fit equals one process."""
    def optimizer():
        return keras.optimizers.SGD(0.2, gradient_accumulation_steps=2, **clip)

    with strategy.scope():
        model = make_model()
        opt = optimizer()
        opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        def one(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y)) / N
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        strategy.run(one, args=(x, y))

    spec = tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None, 1], tf.float32)
    top, inside = collectives_inside_branches(step.get_concrete_function(*spec).graph)
    if N > 1:
        assert top and not inside, (top, inside)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=optimizer(), loss="mse")
    init = model.get_weights()
    hist = model.fit(data(), epochs=3, verbose=0)
    ref = make_model()
    ref.set_weights(init)
    ref.compile(optimizer=optimizer(), loss="mse")
    ref_hist = ref.fit(data(), epochs=3, verbose=0, shuffle=False)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    assert same_everywhere(model.get_weights())


def test_predict_keeps_a_multi_input_models_inputs_together(strategy):
    """[Note: the element's structure]: Keras's element ``((a, b),)`` for ``predict([a, b])`` was unwrapped
    to ``(a, b)``, read as x=a, y=b: predict on a two-input model raised (before 2026-12-07)."""
    def make():
        a, b = keras.Input((3,)), keras.Input((2,))
        return keras.Model([a, b], keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))

    rng = np.random.default_rng(1)
    xa, xb = rng.standard_normal((2 * GLOBAL_BATCH, 3), "float32"), rng.standard_normal((2 * GLOBAL_BATCH, 2),
                                                                                          "float32")
    with strategy.scope():
        model = make()
    ref = make()
    ref.set_weights(model.get_weights())
    expected = ref.predict([xa, xb], batch_size=GLOBAL_BATCH, verbose=0)
    for x in ([xa, xb], (xa, xb), tf.data.Dataset.from_tensor_slices(((xa, xb),)).batch(GLOBAL_BATCH)):
        batch = None if isinstance(x, tf.data.Dataset) else GLOBAL_BATCH
        np.testing.assert_allclose(model.predict(x, batch_size=batch, verbose=0), expected, rtol=1e-5, atol=1e-6)


def test_sparse_and_ragged_inputs_split_by_rows_as_one_process(strategy):
    """A ``tf.SparseTensor`` input raised "'SparseTensor' object is not subscriptable" on every rank
    (before 2026-12-07); its rows are split with ``tf.sparse.slice`` and fit equals one process."""
    rng = np.random.RandomState(0)
    rows = 4 * GLOBAL_BATCH
    dense = (rng.rand(rows, 6) > 0.6).astype("float32") * rng.randn(rows, 6).astype("float32")
    target = (dense @ rng.randn(6, 1)).astype("float32")

    def make():
        model = keras.Sequential([keras.Input((6,), sparse=True), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    def sparse_data():
        return tf.data.Dataset.from_tensor_slices((tf.sparse.from_dense(dense), target)).batch(GLOBAL_BATCH)

    shares = [tf.sparse.to_dense(b[0]).numpy() for b in strategy.experimental_distribute_dataset(sparse_data())]
    np.testing.assert_array_equal(np.concatenate([np.concatenate(WORLD.allgather(s)) for s in shares]), dense)
    with strategy.scope():
        model = make()
    ref = make()
    ref.set_weights(model.get_weights())
    hist = model.fit(sparse_data(), epochs=2, verbose=0)
    ref_hist = ref.fit(sparse_data(), epochs=2, verbose=0)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    ragged = tf.ragged.constant([[float(i)] * (i % 3 + 1) for i in range(2 * GLOBAL_BATCH + 3)])
    batches = tf.data.Dataset.from_tensor_slices(ragged).batch(GLOBAL_BATCH)
    seen = [r for b in strategy.experimental_distribute_dataset(batches) for share in WORLD.allgather(b.to_list())
            for r in share]
    assert seen == ragged.to_list()


def test_on_read_sum_variable_sums_assign_add_and_assign_sub_over_the_ranks(strategy):
    """A raw ON_READ/SUM variable inside ``strategy.run`` reads as MirroredStrategy's: every replica's updates
    summed. ``assign`` was summed but ``assign_add``/``assign_sub`` stayed per rank (2, not 4, at 2 ranks)."""
    def variable():
        return tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=tf.VariableAggregation.SUM)

    with strategy.scope():
        added, assigned, subtracted = variable(), variable(), variable()

    def step():
        added.assign_add(1.0)
        assigned.assign(assigned + 1.0)
        subtracted.assign_sub(1.0)

    strategy.run(step)
    tf.function(lambda: strategy.run(step))()
    assert [float(added.numpy()), float(assigned.numpy()), float(subtracted.numpy())] == [2.0 * N, 2.0 * N,
                                                                                          -2.0 * N]


YC = (X[:, :1] > 0).astype("float32")  # (two classes, for class_weight)
SETTINGS = {  # argument: (how this rank calls, the argument the error names)
    "class_weight": (lambda m: m.fit(X, YC, batch_size=8, epochs=1, verbose=0, shuffle=False,
                                     class_weight={0: 1.0, 1: 1.0 + R}), "class_weight"),
    "class_weight_shuffled": (lambda m: m.fit(X, YC, batch_size=8, epochs=1, verbose=0,
                                              class_weight={0: 1.0, 1: 1.0 + R}), "class_weight"),
    "epochs": (lambda m: m.fit(X, Y, batch_size=8, epochs=1 + R, verbose=0, shuffle=False), "epochs"),
    "epochs_dataset": (lambda m: m.fit(data(), epochs=1 + R, verbose=0), "epochs"),
    "steps_per_epoch": (lambda m: m.fit(X, Y, batch_size=8, epochs=1, steps_per_epoch=3 + R, verbose=0,
                                        shuffle=False), "steps_per_epoch"),
    "shuffle": (lambda m: m.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=R == 0), "shuffle"),
    "validation_steps": (lambda m: m.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                                         validation_data=(X, Y), validation_steps=1 + R), "validation_steps"),
    "evaluate_steps": (lambda m: m.evaluate(X, Y, batch_size=8, steps=3 + R, verbose=0), "steps"),
    "evaluate_steps_dataset": (lambda m: m.evaluate(data(), steps=3 + R, verbose=0), "steps"),
}


@pytest.mark.parametrize("case", list(SETTINGS))
def test_ranks_passing_different_settings_raise_on_every_rank(strategy, case):
    """[Note: the ranks' calls agree]: a ``class_weight`` that differed on one rank trained silently on a mix of
    the ranks' weightings; different ``epochs``/``steps_per_epoch``/``shuffle``/``steps`` ran different steps and
    the ranks waited 60 s for a StallError (before 2026-12-07). Now every rank raises, naming the argument."""
    if N == 1:
        pytest.skip("one rank passes one value")
    call, argument = SETTINGS[case]
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=rf"\({argument}=\.\.\.\) differs across the ranks") as info:
        call(model)
    assert len(set(WORLD.allgather(str(info.value)))) == 1
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)  # the next call works


def make_float8_model() -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu", name="a"),
                              keras.layers.Dense(1, name="b")])
    model.quantize("float8")  # each Dense gets *_scale and *_amax_history: overwrite_with_gradient=True
    return model


@pytest.mark.parametrize("accumulate", [None, 2], ids=["every_step", "accumulated"])
def test_float8_scales_take_the_global_batchs_maximum_on_every_rank(strategy, accumulate):
    """[Note: float8 scales over the ranks]: Keras overwrites a float8 layer's scales and amax histories with
    their gradient before any reduction, so each rank kept its own share's maximum: the ranks' weights drifted
    apart and an inputs_scale was 2.3e-4 off one process's (before 2026-12-07). Now every rank has the same
    weights, the scales and histories one process's over the global batch; the other weights as closely as
    float8 allows (Keras's float8 Dense rounds its bias gradient to bfloat16: each rank its share's sum)."""
    def optimizer():
        return keras.optimizers.Adam(0.01, gradient_accumulation_steps=accumulate)

    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = make_float8_model()
        model.compile(optimizer=optimizer(), loss="mse")
    init = model.get_weights()
    model.fit(data(), epochs=2, verbose=0)
    ref = make_float8_model()
    ref.set_weights(init)
    ref.compile(optimizer=optimizer(), loss="mse")
    ref.fit(data(), epochs=2, verbose=0, shuffle=False)
    assert same_everywhere(model.get_weights())
    for v, w, r in zip(ref.weights, model.get_weights(), ref.get_weights(), strict=True):
        if v.overwrite_with_gradient:
            assert not (v.path.endswith("_scale") and r == 1.0), v.path  # it moved
            np.testing.assert_allclose(w, r, rtol=1e-4, err_msg=v.path)
        else:
            np.testing.assert_allclose(w, r, rtol=1e-3, atol=5e-4, err_msg=v.path)


@pytest.mark.parametrize("regularizer", [None, 0.01], ids=["plain", "regularized"])
def test_an_eager_step_on_a_share_with_no_rows_counts_nothing_as_in_a_graph(strategy, regularizer):
    """A last global batch of fewer rows than ranks leaves some ranks no rows. Before 2026-12-07, with
    run_eagerly=True, Keras left such a share's loss unreduced (shape (0,)) and its loss tracker summed NaN into
    every rank's: evaluate and fit reported a NaN loss (in a graph the share's loss is 0, weighed by 0 rows);
    with a regularization loss beside it, adding the two raised "Shapes of all inputs must match"."""
    batch = N + 1
    x = np.arange(3 * batch + 1, dtype="float32")[:, None] / 10  # the last global batch: 1 row
    y = 2 * x + 1

    def build():
        inp = keras.Input((1,))
        dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(0.3),
                                   kernel_regularizer=regularizer and keras.regularizers.L2(regularizer))
        return keras.Model(inp, dense(inp))

    ref = build()
    ref.compile(loss="mse", metrics=["mae"])
    want = ref.evaluate(x, y, batch_size=batch, verbose=0)
    fitted = []
    for eager in (False, True):
        with strategy.scope():
            model = build()
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"], run_eagerly=eager)
        np.testing.assert_allclose(model.evaluate(x, y, batch_size=batch, verbose=0), want, rtol=1e-5)
        fitted.append((model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0).history["loss"],
                       model.get_weights()))
    (graph_loss, graph_weights), (eager_loss, eager_weights) = fitted
    assert np.all(np.isfinite(eager_loss))
    np.testing.assert_allclose(eager_loss, graph_loss, rtol=1e-5)
    for a, b in zip(eager_weights, graph_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
