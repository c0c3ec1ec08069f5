"""unison.tf_backend.ShardedEmbedding under mpirun: model.fit under UnisonStrategy matches one process.

Launched by tests/test_tf_embedding_mpi.py at 2 and 3 ranks. The reference is a plain
``keras.layers.Embedding`` with the same initial rows, trained in this process on the global batches.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import unison.ps as ps  # noqa: E402
from unison.tf_backend import ShardedEmbedding, UnisonStrategy  # noqa: E402

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
ROWS, DIM, SEQ, LR = 50, 4, 3, 0.2
GLOBAL_BATCH, STEPS = 8 * N, 4
rs = np.random.RandomState(0)
# Zipf-ish ids: many duplicates inside every batch (and inside rows)
IDS = np.minimum(rs.zipf(1.5, (GLOBAL_BATCH * STEPS, SEQ)) - 1, ROWS - 1).astype("int32")
Y = rs.randn(GLOBAL_BATCH * STEPS, 1).astype("float32")


def init_rows(keys: np.ndarray) -> np.ndarray:
    keys = np.asarray(keys)
    return (np.sin(keys[:, None] * 0.37 + np.arange(DIM)[None, :]) * 0.5).astype("float32")


def data() -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices((IDS, Y)).batch(GLOBAL_BATCH)


def make_model(embedding: keras.layers.Layer) -> keras.Model:
    return keras.Sequential([keras.Input((SEQ,), dtype="int32"), embedding,
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])


def dense_twin(model):
    """One process's twin of ``model``: a Keras ``Embedding`` starting from the table's rows, the same dense
    weights, compiled alike; returns ``(twin, its embedding)``."""
    ref_emb = keras.layers.Embedding(ROWS, DIM, embeddings_initializer=keras.initializers.Constant(
        init_rows(np.arange(ROWS))))
    ref = make_model(ref_emb)
    ref.layers[-1].set_weights(model.layers[-1].get_weights())
    ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    return ref, ref_emb


def same_everywhere(a: np.ndarray) -> bool:
    return all(np.array_equal(a, other) for other in WORLD.allgather(np.asarray(a)))


def fit_like_reference(model: keras.Model, layer: ShardedEmbedding, ref: keras.Model,
                       ref_emb: keras.layers.Layer) -> np.ndarray:
    """Fit ``model`` and the one-process ``ref`` two epochs on the global batches; the table's rows equal
    ``ref_emb``'s weights and the losses equal ``ref``'s. Returns the rows."""
    hist = model.fit(data(), epochs=2, verbose=0, shuffle=False)
    ref_hist = ref.fit(data(), epochs=2, verbose=0, shuffle=False)
    rows = layer.table.to_numpy()
    np.testing.assert_allclose(rows, ref_emb.get_weights()[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    return rows


@pytest.fixture(scope="module")
def strategy():
    return UnisonStrategy()


def test_fit_matches_one_process_dense_embedding(strategy):
    keras.utils.set_random_seed(10 + R)  # the Dense layer starts differently: the strategy broadcasts rank 0's
    with strategy.scope():
        layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(LR), initializer=init_rows)
        model = make_model(layer)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    np.testing.assert_array_equal(layer.table.to_numpy(), init_rows(np.arange(ROWS)))
    dense_init = model.layers[-1].get_weights()
    assert same_everywhere(np.concatenate([w.ravel() for w in dense_init]))

    ref, ref_emb = dense_twin(model)

    rows = fit_like_reference(model, layer, ref, ref_emb)
    assert not np.allclose(rows, init_rows(np.arange(ROWS)), atol=1e-4)  # it did train
    for w, v in zip(model.layers[-1].get_weights(), ref.layers[-1].get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    assert layer.push_anchor.numpy() == 0.0
    assert same_everywhere(rows)
    assert layer.table.stats()["pushes"] == 2 * STEPS  # one push per training step on every rank

    # (2) predict and evaluate pull without pushing: the rows stay as they are
    pushes = layer.table.stats()["pushes"]
    pred = model.predict(data(), verbose=0)
    ev = model.evaluate(data(), verbose=0, return_dict=True)
    np.testing.assert_array_equal(layer.table.to_numpy(), rows)
    assert layer.table.stats()["pushes"] == pushes
    np.testing.assert_allclose(pred, ref.predict(data(), verbose=0), rtol=1e-5, atol=1e-6)
    assert ev["loss"] == pytest.approx(ref.evaluate(data(), verbose=0, return_dict=True)["loss"], rel=1e-5)
    config = layer.get_config()
    assert (config["num_rows"], config["dim"], config["optimizer"]["name"]) == (ROWS, DIM, "SGD")
    layer.table.close()


def shared_model(embedding: keras.layers.Layer) -> keras.Model:
    """One table looked up twice per step, on overlapping rows (a table shared by two inputs)."""
    ids = keras.Input((SEQ,), dtype="int32")
    first = keras.layers.GlobalAveragePooling1D()(embedding(ids))
    second = keras.layers.GlobalAveragePooling1D()(embedding(keras.ops.mod(ids + 1, ROWS)))
    return keras.Model(ids, keras.layers.Dense(1)(first + 2.0 * second))


class OneHotEmbedding(keras.layers.Layer):
    """A dense reference: ``one_hot(ids) @ W``, whose gradient is a dense matrix (duplicates summed).
    ``keras.layers.Embedding``'s is IndexedSlices with one slice per occurrence, and Keras's Adagrad squares
    each slice (sum of squares, not the square of the sum): no dense Adagrad to compare with."""

    def build(self, input_shape: tuple) -> None:
        self.w = self.add_weight(shape=(ROWS, DIM), initializer=keras.initializers.Constant(
            init_rows(np.arange(ROWS))), name="rows")

    def call(self, ids: tf.Tensor) -> tf.Tensor:
        return keras.ops.matmul(keras.ops.one_hot(ids, ROWS), self.w)


def test_fit_with_a_table_looked_up_twice_per_step_matches_one_process_under_adagrad(strategy):
    """The layer pushes once per step, both lookups' rows together, so the table's Adagrad steps once on the
    summed gradient as Keras's does on a shared Embedding. Before 2026-12-06 each lookup pushed on its own
    and Adagrad stepped twice ([Note: one push per training step, TensorFlow] in unison/tf_backend/embedding.py).
    Both Adagrads start their sums at 0.1 with no epsilon, so they compute the same update."""
    keras.utils.set_random_seed(7)
    with strategy.scope():
        layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.Adagrad(LR, initial_accumulator_value=0.1, eps=0.0),
                                 initializer=init_rows, name="emb-shared")
        model = shared_model(layer)
        model.compile(optimizer=keras.optimizers.Adagrad(LR, initial_accumulator_value=0.1, epsilon=0.0),
                      loss="mse")
    ref_emb = OneHotEmbedding()
    ref = shared_model(ref_emb)
    ref.layers[-1].set_weights(model.layers[-1].get_weights())
    ref.compile(optimizer=keras.optimizers.Adagrad(LR, initial_accumulator_value=0.1, epsilon=0.0), loss="mse")
    rows = fit_like_reference(model, layer, ref, ref_emb)
    assert not np.allclose(rows, init_rows(np.arange(ROWS)), atol=1e-4)
    assert layer.table.stats()["pushes"] == 2 * STEPS  # one push per step, not one per lookup
    layer.table.close()


@pytest.mark.parametrize("table_optimizer", ["sgd", "adagrad"])
def test_fit_follows_the_optimizers_gradient_accumulation(strategy, table_optimizer):
    """gradient_accumulation_steps=2: the dense weights change every second step with the two steps' mean
    gradient, and so does the table (one push per two steps), equal to one process's dense reference under
    the same accumulating optimizer. Then fits of 3 and 1 steps: the table keeps the optimizer's phase across
    fit calls (the odd step waits in both). Before, the layer pushed every step ([Note: the table follows the
    optimizer's accumulation] in unison/tf_backend/embedding.py)."""
    keras.utils.set_random_seed(21)

    def optimizers() -> tuple[ps.Optimizer, keras.optimizers.Optimizer]:
        if table_optimizer == "sgd":
            return ps.SGD(LR), keras.optimizers.SGD(LR, gradient_accumulation_steps=2)
        return (ps.Adagrad(LR, initial_accumulator_value=0.1, eps=0.0),
                keras.optimizers.Adagrad(LR, initial_accumulator_value=0.1, epsilon=0.0,
                                         gradient_accumulation_steps=2))

    with strategy.scope():  # (the model's optimizer is made in the scope, as its variables must be)
        table_opt, dense_opt = optimizers()
        layer = ShardedEmbedding(ROWS, DIM, optimizer=table_opt, initializer=init_rows,
                                 name=f"emb-accumulate-{table_optimizer}")
        model = shared_model(layer)
        model.compile(optimizer=dense_opt, loss="mse")
    ref_emb = OneHotEmbedding()
    ref = shared_model(ref_emb)
    ref.layers[-1].set_weights(model.layers[-1].get_weights())
    ref.compile(optimizer=optimizers()[1], loss="mse")

    def same_as_reference(pushes: int) -> None:
        rows = layer.table.to_numpy()
        np.testing.assert_allclose(rows, ref_emb.get_weights()[0], rtol=1e-5, atol=1e-6)
        for w, v in zip(model.layers[-1].get_weights(), ref.layers[-1].get_weights(), strict=True):
            np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
        assert layer.table.stats()["pushes"] == pushes
        assert same_everywhere(rows)

    hist = model.fit(data(), epochs=2, verbose=0, shuffle=False)
    ref_hist = ref.fit(data(), epochs=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    assert not np.allclose(layer.table.to_numpy(), init_rows(np.arange(ROWS)), atol=1e-4)
    same_as_reference(STEPS)  # 2 * STEPS steps, one push per two
    for take, pushes in ((3, STEPS + 1), (1, STEPS + 2)):  # steps 9-11 (an update at 10), then 12 (an update)
        model.fit(data().take(take), epochs=1, verbose=0, shuffle=False)
        ref.fit(data().take(take), epochs=1, verbose=0, shuffle=False)
        same_as_reference(pushes)
    layer.table.close()


def test_horovod_style_fit_pushes_the_sum_its_optimizer_applies(strategy):  # (the fixture inits Unison)
    """Horovod-style ``model.fit`` (no strategy; each rank fits its rows of every global batch) with
    ``DistributedOptimizer(SGD, backward_passes_per_step=2)``, which applies the SUM of the two steps'
    averaged gradients (Horovod's default): the table gets the sum too, one push per two steps, so rows and
    weights equal one process whose SGD of twice the rate accumulates the mean of two steps."""
    from unison.tf_backend.keras import DistributedOptimizer

    keras.utils.set_random_seed(33)  # (the same Dense weights on every rank: no broadcast needed)
    layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(LR), initializer=init_rows, name="emb-horovod")
    model = shared_model(layer)
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=2),
                  loss="mse")
    ref_emb = OneHotEmbedding()
    ref = shared_model(ref_emb)
    ref.layers[-1].set_weights(model.layers[-1].get_weights())
    ref.compile(optimizer=keras.optimizers.SGD(2 * LR, gradient_accumulation_steps=2), loss="mse")
    mine = data().map(lambda x, y: (x[R * 8:(R + 1) * 8], y[R * 8:(R + 1) * 8]))
    model.fit(mine, epochs=2, verbose=0, shuffle=False)
    ref.fit(data(), epochs=2, verbose=0, shuffle=False)
    rows = layer.table.to_numpy()
    assert not np.allclose(rows, init_rows(np.arange(ROWS)), atol=1e-4)
    np.testing.assert_allclose(rows, ref_emb.get_weights()[0], rtol=1e-5, atol=1e-6)
    for w, v in zip(model.layers[-1].get_weights(), ref.layers[-1].get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    assert layer.table.stats()["pushes"] == STEPS  # 2 * STEPS steps, one push per two
    layer.table.close()


def test_follow_refuses_what_is_not_a_keras_optimizer(strategy):
    with strategy.scope():
        layer = ShardedEmbedding(ROWS, DIM, name="emb-follow")
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        layer.follow(ps.SGD(LR))
    layer.table.close()


def test_fit_with_float64_rows_matches_one_process(strategy):
    """A layer of dtype float64 (its table's rows float64) in a float32 model: Keras casts its output for the
    next layer; the rows' gradient comes back float64 and is pushed as such. Equal to a float64 Embedding."""
    keras.utils.set_random_seed(14)
    with strategy.scope():
        layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(LR), name="emb-f64", dtype="float64",
                                 initializer=lambda k: init_rows(k).astype("float64"))
        model = make_model(layer)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    assert layer.table.dtype == np.float64 and layer.table.to_numpy().dtype == np.float64
    start = keras.initializers.Constant(init_rows(np.arange(ROWS)).astype("float64"))
    ref_emb = keras.layers.Embedding(ROWS, DIM, dtype="float64", embeddings_initializer=start)
    ref = make_model(ref_emb)
    ref.layers[-1].set_weights(model.layers[-1].get_weights())
    ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    rows = fit_like_reference(model, layer, ref, ref_emb)
    assert not np.allclose(rows, init_rows(np.arange(ROWS)), atol=1e-4)
    assert same_everywhere(rows)
    layer.table.close()


def test_fit_with_several_steps_per_execution_matches_one_process(strategy):
    """steps_per_execution=2: two training steps in one tf.function call, each with its pull and its one push."""
    keras.utils.set_random_seed(12)
    with strategy.scope():
        layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(LR), initializer=init_rows, name="emb-spe")
        model = make_model(layer)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", steps_per_execution=2)
    ref, ref_emb = dense_twin(model)
    fit_like_reference(model, layer, ref, ref_emb)
    assert layer.table.stats()["pushes"] == 2 * STEPS
    layer.table.close()


def test_a_saved_model_loads_without_custom_objects_and_takes_its_rows_from_load_table(strategy, tmp_path_factory,
                                                                                         caplog):
    """keras.models.load_model failed with "could not be deserialized" (the class was not registered; an
    audit), and with custom_objects it loaded a table of initial rows silently. Now it loads, warns that the
    rows come from load_table, and with them predicts as the trained model."""
    import logging
    import os

    keras.utils.set_random_seed(4)
    with strategy.scope():
        layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(LR), initializer=init_rows, name="emb-saved")
        model = make_model(layer)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    model.fit(data(), epochs=1, verbose=0, shuffle=False)
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("saved")) if R == 0 else None, root=0)
    layer.save_table(os.path.join(folder, "table"))
    if R == 0:
        model.save(os.path.join(folder, "model.keras"))
    WORLD.Barrier()
    expected, rows = model.predict(data(), verbose=0), layer.table.to_numpy()
    layer.table.close()  # (its name is the new layer's table's)
    with caplog.at_level(logging.WARNING, logger="unison.tf_backend.embedding"):
        loaded = keras.models.load_model(os.path.join(folder, "model.keras"))
    assert "made from its configuration with a new table of initial rows" in caplog.text
    new = loaded.layers[0]
    assert isinstance(new, ShardedEmbedding) and new.table.name == "emb-saved"
    assert not np.allclose(new.table.to_numpy(), rows)  # initial rows ("uniform": a callable initializer's name)
    new.load_table(os.path.join(folder, "table"))
    np.testing.assert_allclose(loaded.predict(data(), verbose=0), expected, rtol=1e-6, atol=1e-7)
    new.table.close()


@pytest.mark.parametrize("consistency", [ps.SSP(1), ps.ASP()], ids=["ssp1", "asp"])
def test_fit_under_ssp_and_asp(strategy, consistency):
    """Stale reads are allowed, so no one-process equality: the loss falls with the exact one-process run's
    (final loss within 3%), reads stay within the bound, and once the pushes are in (barrier) every rank
    holds the same table."""
    keras.utils.set_random_seed(3)
    name = f"emb-{type(consistency).__name__.lower()}"
    with strategy.scope():
        layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(LR), initializer=init_rows, consistency=consistency,
                                 name=name)
        model = make_model(layer)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    ref = make_model(keras.layers.Embedding(ROWS, DIM, embeddings_initializer=keras.initializers.Constant(
        init_rows(np.arange(ROWS)))))
    ref.layers[-1].set_weights(model.layers[-1].get_weights())
    ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    losses = model.fit(data(), epochs=6, verbose=0, shuffle=False).history["loss"]
    exact = ref.fit(data(), epochs=6, verbose=0, shuffle=False).history["loss"]
    assert losses[-1] < losses[0] and losses[-1] == pytest.approx(exact[-1], rel=0.03), (losses, exact)
    layer.table.barrier()
    rows = layer.table.to_numpy()
    assert not np.allclose(rows, init_rows(np.arange(ROWS)), atol=1e-4) and same_everywhere(rows)
    stats = layer.table.stats()
    assert stats["pushes"] == 6 * STEPS
    if isinstance(consistency, ps.SSP):
        assert 0 <= stats["max_staleness"] <= 1, stats
    layer.table.close()


@pytest.mark.parametrize("graph", [False, True])
def test_duplicate_ids_sum_and_average_without_strategy(graph):
    """A custom loop (no strategy): duplicates' gradients are summed, then averaged over the ranks."""
    lr = 0.5
    layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(lr), initializer=init_rows)
    layer.build((None, SEQ))  # its anchor weight is made eagerly, not inside the tf.function
    every = [np.array([[1, 1, 2], [1, 7, 7]]), np.array([[3, 3, 3], [1, 2, 9]]), np.array([[5, 1, 1], [5, 5, 2]])]
    ids = tf.constant(every[R % len(every)], tf.int32)
    c = tf.constant([1.0, -2.0, 0.5, 3.0])

    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            out = layer(ids)
            loss = tf.reduce_sum(out * c)
        grads = tape.gradient(loss, layer.trainable_variables)
        return out, grads[0]

    out, anchor_grad = (tf.function(step) if graph else step)()
    before = init_rows(np.arange(ROWS))
    np.testing.assert_array_equal(out.numpy(), before[ids.numpy()])
    assert float(anchor_grad) == 0.0
    layer.synchronize()
    counts = np.zeros(ROWS)
    for r in range(N):
        np.add.at(counts, every[r % len(every)].ravel(), 1.0)
    expected = before - lr * (counts / N)[:, None] * c.numpy()[None, :]
    np.testing.assert_allclose(layer.table.to_numpy(), expected, rtol=1e-6, atol=1e-6)
    layer.table.close()


@pytest.mark.parametrize("graph", [False, True])
def test_a_custom_loop_follows_its_optimizer_and_refuses_a_step_traced_before(strategy, graph):  # (inits Unison)
    """A custom loop (no strategy) whose optimizer accumulates 2 steps: after ``follow``, the table gets one
    push per two steps, with the mean of their gradients. A tf.function traced before ``follow`` raises on
    every rank at its next step, naming the fix, instead of pushing every step."""
    lr = 0.5
    layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(lr), initializer=init_rows, name=f"emb-loop-{graph}")
    layer.build((None, SEQ))
    optimizer = keras.optimizers.SGD(lr, gradient_accumulation_steps=2)
    optimizer.build(layer.trainable_variables)
    ids = [tf.constant([[1, 1, 2]], tf.int32), tf.constant([[2, 3, 3]], tf.int32)]

    def step(i: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(tf.gather(tf.stack(ids), i)))
        variables = layer.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))

    run = tf.function(step) if graph else step
    if graph:  # traced now, before follow: the next step refuses
        run(tf.constant(0))
        layer.synchronize()
        layer.follow(optimizer)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"traced before.*layer.follow\(optimizer\)"):
            run(tf.constant(1))
        layer.follow(None)
        layer.synchronize()
        layer.table.close()
        return
    layer.follow(optimizer)
    before = init_rows(np.arange(ROWS))
    run(0)
    layer.synchronize()
    np.testing.assert_array_equal(layer.table.to_numpy(), before)  # the first step waits for the second
    run(1)
    layer.synchronize()
    counts = np.zeros(ROWS)
    np.add.at(counts, np.concatenate([i.numpy().ravel() for i in ids]), 1.0)
    np.testing.assert_allclose(layer.table.to_numpy(), before - lr * (counts / 2)[:, None], rtol=1e-6, atol=1e-6)
    assert layer.table.stats()["pushes"] == 1
    layer.table.close()


@pytest.mark.parametrize("graph", [False, True])
def test_ids_of_another_dtype_on_one_rank_raise_on_every_rank(strategy, graph):
    """Bool (or string) ids on one rank raised there alone, before any table call: the others waited in the
    pull's round for ever (before 2026-12-05). Now the table refuses them in that round, on every rank, as
    the torch layer does; in a tf.function when the step runs."""
    if N == 1:
        pytest.skip("needs two ranks")
    layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(0.1), initializer=init_rows)
    layer.build((None, SEQ))
    ids = tf.constant([[True, False, True]]) if R == 0 else tf.constant([[1, 2, 3]])
    call = tf.function(lambda: layer(ids)) if graph else (lambda: layer(ids))
    with pytest.raises(Exception, match="rank 0: .*keys must be integers; got dtype bool"):
        call()
    np.testing.assert_array_equal(layer(tf.constant([[1, 2, 3]])).numpy()[0], init_rows(np.array([1, 2, 3])))
    layer.table.close()


def test_a_mixed_precision_policy_is_refused_on_every_rank_even_when_one_rank_has_it():
    """It crashed in the first step (float16 anchor + float32 push) and would push loss-scaled gradients. Refused
    in build() on the rank that had it, after the table's collective creation, it left the others waiting in
    their first pull (before 2026-12-05); now every rank raises at construction."""
    odd = R == N - 1
    with pytest.raises(ValueError, match=rf"rank {N - 1}: ShardedEmbedding does not support the "
                                         "mixed-precision policy 'mixed_float16'"):
        ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(0.1), initializer=init_rows,
                         dtype="mixed_float16" if odd else "float32")
    layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(0.1), initializer=init_rows)  # the next table works
    layer.table.close()


def test_float_ids_are_truncated_as_keras_embedding_does(strategy):  # (the strategy initialises Unison)
    """Keras hands ids over as floats; they pick the rows keras.layers.Embedding picks (truncated:
    2.7 -> 2), where they were rounded (2.7 -> 3)."""
    layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(0.1), initializer=init_rows)
    ids = np.array([[2.7, 3.5, 4.5]], "float32")
    keras_layer = keras.layers.Embedding(ROWS, DIM)
    keras_layer.build((None, 3))
    keras_layer.set_weights([init_rows(np.arange(ROWS))])
    np.testing.assert_array_equal(layer(ids).numpy(), keras_layer(ids).numpy())
    np.testing.assert_array_equal(layer(ids).numpy()[0], init_rows(np.array([2, 3, 4])))
    layer.table.close()


def test_compile_on_a_gpu_host_does_not_pick_xla_for_the_table(monkeypatch):
    """Before: the layer did not say it cannot be compiled by XLA (its lookups are host calls), so compile's
    jit_compile="auto" picked XLA on a GPU host and fit failed in the PyFunc. A GPU is faked here."""
    real = tf.config.list_physical_devices

    class FakeGPU:
        name, device_type = "/physical_device:GPU:0", "GPU"

    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: real(kind) + ([FakeGPU()] if kind in (None, "GPU") else []))
    layer = ShardedEmbedding(10, 4, name="no-xla")
    model = keras.Sequential([keras.Input((3,), dtype="int32"), layer, keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    assert layer.supports_jit is False and model.jit_compile is False
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    plain.compile(optimizer="sgd", loss="mse")
    assert plain.jit_compile is True  # (the fake GPU is seen: a model without the table gets XLA)


@pytest.mark.parametrize("graph", [False, True])
def test_two_layers_on_one_table_push_once_per_step_as_one_process(strategy, graph):  # (inits Unison)
    """A user and an item tower: two layers given one ``table=``, Adagrad, a custom loop without a strategy.
    Until 2026-12-07 each layer kept and pushed its own rows: two pushes per step, Adagrad stepped twice.
    The reference: one process, both inputs looking up one table, Adagrad applied once per step."""
    lr, b = 0.3, 2
    table = ps.ShardedTable(ROWS, DIM, optimizer=ps.Adagrad(lr), initializer=init_rows, name=f"towers-{graph}")
    user, item = ShardedEmbedding(ROWS, DIM, table=table, name="user"), ShardedEmbedding(ROWS, DIM, table=table,
                                                                                          name="item")
    user.build((None,))
    item.build((None,))
    g = np.random.default_rng(3)
    steps = [(g.integers(0, ROWS, b * N), g.integers(0, ROWS, b * N)) for _ in range(3)]

    def step(u: tf.Tensor, i: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.reduce_sum(user(u) * item(i), -1) ** 2)
        tape.gradient(loss, user.trainable_variables + item.trainable_variables)

    run = tf.function(step) if graph else step
    part = slice(R * b, (R + 1) * b)
    for u, i in steps:
        run(tf.constant(u[part]), tf.constant(i[part]))
        user.synchronize()
    rows = table.to_numpy()
    assert table.stats()["pushes"] == len(steps)
    w, acc = init_rows(np.arange(ROWS)).astype("float64"), np.zeros((ROWS, DIM))
    for u, i in steps:
        dot = np.sum(w[u] * w[i], -1, keepdims=True)  # d mean(dot^2) / d rows, both lookups summed
        grad = np.zeros_like(w)
        np.add.at(grad, u, 2 * dot * w[i] / len(u))
        np.add.at(grad, i, 2 * dot * w[u] / len(u))
        acc += grad * grad
        w = w - lr * grad / (np.sqrt(acc) + 1e-10)
    np.testing.assert_allclose(rows, w, rtol=1e-5, atol=1e-6)
    table.close()


@pytest.mark.parametrize("graph", [False, True])
def test_lookups_with_training_false_under_a_tape_push_once_per_step_as_one_process(strategy, graph):  # (inits)
    """Two lookups per step made with ``training=False`` (Keras's fine-tuning idiom under a frozen BatchNorm),
    the gradient taken with a GradientTape, Adagrad, no synchronize between steps. Until 2026-12-07 such
    lookups were not counted, so each push callback found the count at zero and pushed alone: two pushes per
    step, Adagrad stepped twice (0.854 instead of 0.5 in the audit's case). The reference: numpy Adagrad
    stepped once per step on the ranks' mean gradient."""
    lr = 0.5
    layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.Adagrad(lr), initializer=init_rows, name=f"frozen-{graph}")
    layer.build((None,))
    every = [np.array([1, 2, 2]), np.array([2, 3, 7]), np.array([1, 1, 9])]  # overlapping rows
    c = np.array([1.0, -2.0, 0.5, 3.0], "float32")

    def step(a: tf.Tensor, b: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(a, training=False) * c) + 2.0 * tf.reduce_sum(layer(b, training=False) * c)
        tape.gradient(loss, layer.trainable_variables)

    run = tf.function(step) if graph else step
    for s in range(3):
        run(tf.constant(every[(s + R) % 3]), tf.constant(every[(s + R + 1) % 3]))
    layer.synchronize()
    assert layer.table.stats()["pushes"] == 3  # one per step
    w, acc = init_rows(np.arange(ROWS)).astype("float64"), np.zeros((ROWS, DIM))
    for s in range(3):
        counts = np.zeros(ROWS)
        for r in range(N):
            np.add.at(counts, every[(s + r) % 3], 1.0)
            np.add.at(counts, every[(s + r + 1) % 3], 2.0)
        grad = (counts / N)[:, None] * c[None, :]
        acc += grad * grad
        w = w - lr * grad / (np.sqrt(acc) + 1e-10)
    np.testing.assert_allclose(layer.table.to_numpy(), w, rtol=1e-5, atol=1e-6)
    layer.table.close()


def test_fit_evaluate_and_predict_return_with_every_step_in_the_table(strategy):
    """A lookup without a gradient (the model called on a batch outside fit, for a look) leaves the next
    step's push kept until a later pull ([Note: one push per training step, TensorFlow]). Until 2026-12-07
    fit could return with its last step's push still kept, so ``layer.table.save()`` or ``to_numpy()`` right
    after it missed that step; fit, evaluate and predict now push what is kept when they return."""
    keras.utils.set_random_seed(13)
    with strategy.scope():
        layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(LR), initializer=init_rows, name="emb-kept")
        model = make_model(layer)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    ref, ref_emb = dense_twin(model)
    model(IDS[:2])  # no gradient follows
    for _ in range(2):
        model.fit(data().take(1), epochs=1, verbose=0, shuffle=False)
        ref.fit(data().take(1), epochs=1, verbose=0, shuffle=False)
        np.testing.assert_allclose(layer.table.to_numpy(), ref_emb.get_weights()[0], rtol=1e-5, atol=1e-6)
        model.predict(data(), verbose=0)  # lookups without a gradient: counted, nothing left after them
        model.evaluate(data(), verbose=0)
    assert layer.table.stats()["pushes"] == 2 and not layer._shared.kept
    layer.table.close()
