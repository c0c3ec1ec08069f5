"""The Keras pipeline under mpirun: the same weights as one process, and errors on every rank."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import unison.tf_backend as hvd  # noqa: E402
from unison.common.pipeline import simulate  # noqa: E402
from unison.tf_backend.pipeline import Pipeline, PipelineError, pipeline_grid  # noqa: E402

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
CHUNKS, BATCH, STEPS = 4, 8, 3
LR, MOMENTUM = 0.1, 0.9
# all four schedules at 2 ranks; one, with the interleaved layout's 8 stages, at 4 ranks
CASES = ([(name, ck) for name in ("gpipe", "1f1b", "interleaved", "zb-h1") for ck in ("never", "always")]
         + [("1f1b", "except_last")]) if N <= 2 else [("interleaved", "always")]


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    yield
    hvd.shutdown()


def make_model(dropout=False, seed=0):
    """Eight layers (enough for 8 stages), built with the same seed on every rank; a Dropout as layer 3."""
    keras.utils.set_random_seed(seed)
    def dense(units):
        return keras.layers.Dense(units, activation="tanh")

    return keras.Sequential([
        keras.Input((6,)), dense(16), dense(16), dense(16),
        keras.layers.Dropout(0.3, seed=11) if dropout else dense(16),
        dense(8), dense(8), dense(4), keras.layers.Dense(1)])


def sgd():
    return keras.optimizers.SGD(LR, momentum=MOMENTUM)


def batch(step, replica=0):
    g = np.random.default_rng(100 * replica + step)
    return g.standard_normal((BATCH, 6)).astype("float32"), g.standard_normal((BATCH, 1)).astype("float32")


def reference(model, batches, chunks=None):
    """Train ``model`` in this process; ``chunks`` None: whole batches, else microbatch by microbatch.

    Microbatches draw dropout masks one microbatch at a time in microbatch order, as the
    pipeline's dropout stage does, so with the same seed both draw the same masks.
    """
    opt, losses, mse = sgd(), [], keras.losses.MeanSquaredError()
    for x, y in batches:
        parts = [(x, y)] if chunks is None else list(zip(np.split(x, chunks), np.split(y, chunks), strict=True))
        grads, total = None, 0.0
        for xs, ys in parts:
            with tf.GradientTape() as tape:
                loss = mse(ys, model(xs, training=True)) / len(parts)
            g = tape.gradient(loss, model.trainable_variables)
            grads = g if grads is None else [a + b for a, b in zip(grads, g, strict=True)]
            total += float(loss)
        opt.apply(grads, model.trainable_variables)
        losses.append(total)
    return losses


def assert_same(pipe, ref, losses, ref_losses):
    for mine, theirs in zip(pipe.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert all(e == losses for e in WORLD.allgather(losses))  # the loss reaches every rank


def raised_everywhere(fn):
    """Run ``fn``, which must raise PipelineError here; return the message, identical on every rank."""
    with pytest.raises(PipelineError) as info:
        fn()
    message = str(info.value)
    everyone = WORLD.allgather(message)
    assert all(e == message for e in everyone), everyone
    return message


@pytest.mark.parametrize("schedule, checkpoint", CASES)
def test_every_schedule_trains_like_one_process(schedule, checkpoint):
    v = 2 if schedule == "interleaved" else 1
    pipe = Pipeline(make_model(), chunks=CHUNKS, schedule=schedule, virtual_stages=v, checkpoint=checkpoint,
                    loss="mse", optimizer=sgd)
    batches = [batch(k) for k in range(STEPS)]
    losses = [pipe.train_step(x if pipe.holds_first else None, y if pipe.holds_last else None)
              for x, y in batches]
    ref = make_model()
    assert_same(pipe, ref, losses, reference(ref, batches))
    sim = simulate(pipe.schedule)
    assert pipe.stats.peak_per_stage == {s: sim.peak_activations[s] for s in pipe.stages}
    pipe.close()


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_dropout_recompute_draws_the_masks_of_the_first_forward(checkpoint):
    """Checkpointing replays each Dropout mask: the same weights as keeping the activations, and as
    one process running the microbatches in order; without replay the recompute would draw anew."""
    pipe = Pipeline(make_model(dropout=True), chunks=CHUNKS, schedule="zb-h1", checkpoint=checkpoint, loss="mse",
                    optimizer=sgd)
    batches = [batch(k) for k in range(STEPS)]
    losses = [pipe.train_step(x, y) for x, y in batches]
    ref = make_model(dropout=True)
    assert_same(pipe, ref, losses, reference(ref, batches, chunks=CHUNKS))
    pipe.close()


# every schedule and checkpoint mode on a 2 x 2 grid; at other sizes the 1f1b case only
GRID_CASES = [("1f1b", "never")] + ([(name, ck) for name in ("gpipe", "interleaved", "zb-h1")
                                     for ck in ("never", "always")] if N == 4 else [])


def both_batches(steps, dp=2):
    """Step k's batches of every replica, concatenated: what one process trains on."""
    return [tuple(np.concatenate(parts) for parts in zip(*(batch(k, d) for d in range(dp)), strict=True))
            for k in range(steps)]


@pytest.mark.parametrize("schedule, checkpoint", GRID_CASES)
def test_data_x_pipeline_grid_trains_like_one_process_on_both_batches(schedule, checkpoint):
    dp, steps = 2, 2
    grid = pipeline_grid(dp=dp)
    assert (grid.pp, grid.dp) == (N // dp, dp) and grid.pipeline_ranks[grid.position] == R
    v = 2 if schedule == "interleaved" else 1
    keras.utils.set_random_seed(R)  # replicas built differently: pipeline 0's weights are broadcast
    model = make_model(seed=0 if grid.pipeline == 0 else 5)
    if len(model.layers) < grid.pp * v:
        pytest.skip(f"{len(model.layers)} layers are too few for {grid.pp * v} stages")
    pipe = Pipeline(model, chunks=2, schedule=schedule, virtual_stages=v, checkpoint=checkpoint, loss="mse",
                    optimizer=sgd, grid=grid)
    mine = [batch(k, grid.pipeline) for k in range(steps)]
    losses = [pipe.train_step(x, y) for x, y in mine]
    ref = make_model()
    assert_same(pipe, ref, losses, reference(ref, both_batches(steps, dp)))
    pipe.close()


class Tripwire(keras.layers.Layer):
    """Passes its input on, and fails (in the compiled graph) on a microbatch holding a value of 50 or more."""

    def call(self, x):
        with tf.control_dependencies([tf.debugging.assert_less(tf.reduce_max(x), 50.0, message="tripwire")]):
            return tf.identity(x)


@pytest.mark.skipif(N % 2, reason="a grid of 2 pipelines needs an even number of ranks")
def test_a_stage_that_fails_on_one_rank_of_a_grid_raises_on_every_rank_and_the_next_step_trains():
    grid = pipeline_grid(dp=2)
    def model():
        return keras.Sequential([keras.Input((6,)), Tripwire(), *make_model().layers])

    pipe = Pipeline(model(), balance=[5, 4] if grid.pp == 2 else None, chunks=2, loss="mse", optimizer=sgd,
                    grid=grid)
    x, y = batch(0, grid.pipeline)
    if grid.pipeline == 1:
        x[BATCH // 2, 0] = 100.0  # pipeline 1's microbatch 1 trips its stage 0
    culprit = WORLD.allgather((grid.pipeline, grid.position)).index((1, 0))
    msg = raised_everywhere(lambda: pipe.train_step(x, y))
    assert msg.startswith(f"pipeline step failed on rank {culprit} at F1@s0 (forward of stage 0, microbatch 1): "
                          "InvalidArgumentError") and "tripwire" in msg
    losses = [pipe.train_step(*batch(0, grid.pipeline))]  # nothing of the failed step is left behind
    ref = model()
    assert_same(pipe, ref, losses, reference(ref, both_batches(1)))
    pipe.close()


def test_fit_evaluate_and_predict(capsys):
    rs = np.random.default_rng(3)
    x, y = rs.standard_normal((40, 6)).astype("float32"), rs.standard_normal((40, 1)).astype("float32")
    pipe = Pipeline(make_model(), chunks=2, loss=keras.losses.MeanSquaredError(), optimizer=sgd)
    history = pipe.fit(x, y, batch_size=BATCH, epochs=2, verbose=1, seed=4)
    shown = capsys.readouterr().out
    ref = make_model()
    ref_losses = reference(ref, [(x[rows], y[rows]) for epoch in range(2)
                                 for rows in np.split(np.random.default_rng([4, epoch]).permutation(40), 5)])
    np.testing.assert_allclose(history, [np.mean(ref_losses[:5]), np.mean(ref_losses[5:])], rtol=1e-5)
    assert ("Epoch 2/2" in shown and "loss:" in shown) == (R == 0)  # the progress bar on rank 0 only
    assert pipe.evaluate(x[:8], y[:8]) == pytest.approx(float(keras.losses.MeanSquaredError()(y[:8], ref(x[:8]))),
                                                        rel=1e-5)
    out = pipe.predict(x[:8])
    if pipe.holds_last:
        np.testing.assert_allclose(out, ref(x[:8]).numpy(), rtol=1e-5, atol=1e-6)
    else:
        assert out is None
    # a second fit goes on to the third epoch's order (before 2026-12-07 it repeated the first epoch's)
    again = pipe.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, seed=4)
    third = np.split(np.random.default_rng([4, 2]).permutation(40), 5)
    more = reference(ref, [(x[rows], y[rows]) for rows in third])
    np.testing.assert_allclose(again, [np.mean(more)], rtol=1e-3)  # (15 steps of float32 apart by now)
    pipe.close()


class Wobbly(keras.layers.Layer):
    """Returns 5 columns for a microbatch whose first value is positive, else 4: a data-dependent shape."""

    def call(self, x):
        return x[:, :4 + tf.cast(x[0, 0] > 0, tf.int32)]

    def compute_output_shape(self, shape):
        return (shape[0], None)


def test_bad_input_raises_the_same_error_on_every_rank():
    ok = {"loss": "mse", "optimizer": sgd}
    msg = raised_everywhere(lambda: Pipeline(make_model(), balance=[3] * N, **ok))
    assert (f"balance {[3] * N} sums to {3 * N} but the model has 8 layers; give p={N} stage sizes that sum "
            "to 8") in msg
    if N > 1:
        msg = raised_everywhere(lambda: Pipeline(make_model().layers[:1], **ok))
        assert msg.startswith(f"rank 0: the model has 1 layers, too few for {N} stages (p={N} ranks x v=1); use "
                              "fewer ranks or virtual stages, or split the model into more layers")
    msg = raised_everywhere(lambda: pipeline_grid(pp=N + 1))
    assert f"needs pp * dp = {N + 1} ranks, more than the job's {N}" in msg
    msg = raised_everywhere(lambda: Pipeline(make_model(), chunks=3, schedule="interleaved", virtual_stages=2,
                                             **ok))
    if N > 1:
        assert "interleaved needs num_microbatches (3) to be a multiple of the number of ranks" in msg
    msg = raised_everywhere(lambda: Pipeline([keras.layers.Dense(4) for _ in range(N)], **ok))
    assert "are not built; start the Sequential with keras.Input(shape), or pass input_shape" in msg

    msg = raised_everywhere(lambda: Pipeline(make_model(), loss="mse", optimizer=sgd()))
    assert "optimizer must be a factory, not an optimizer instance: each stage needs its own" in msg

    def fails_on_the_last_rank():
        if R == N - 1:
            raise RuntimeError("no optimizer here")
        return sgd()

    with pytest.raises(PipelineError) as info:
        Pipeline(make_model(), loss="mse", optimizer=fails_on_the_last_rank)
    assert all(m == str(info.value) for m in WORLD.allgather(str(info.value)))
    assert str(info.value) == f"rank {N - 1}: optimizer() for stages [{N - 1}] failed: RuntimeError: no " \
                              "optimizer here"
    assert isinstance(info.value.__cause__, RuntimeError) == (R == N - 1)

    pipe = Pipeline(make_model(), chunks=CHUNKS, **ok)
    x, y = batch(0)
    msg = raised_everywhere(lambda: pipe.train_step(x[:7], y[:7]))
    assert "has a batch of 7 rows, which 4 microbatches (chunks=4) do not divide; use a batch that is a " \
           "multiple of 4 (e.g. 4 or 8)" in msg
    msg = raised_everywhere(lambda: pipe.train_step(None, y))
    assert msg.startswith("rank 0: x must be a batch (an array or tensor) on the rank holding stage 0; received "
                          "None")
    assert pipe.train_step(x, y) == pytest.approx(reference(make_model(), [(x, y)])[0], rel=1e-5)  # still fine
    pipe.close()


@pytest.mark.skipif(N < 2, reason="inputs and targets on one rank: the pre-flight check compares their rows")
def test_targets_with_fewer_rows_than_inputs_raise_on_every_rank():
    pipe = Pipeline(make_model(), chunks=2, loss="mse", optimizer=sgd)
    x, y = batch(0)
    msg = raised_everywhere(lambda: pipe.train_step(x, y[:4]))
    last = N - 1
    assert msg == (f"pipeline step failed on rank {last} at F0@s{last} (forward of stage {last}, microbatch 0): "
                   f"ValueError: microbatch 0 of y has 2 rows but the activation reaching the last stage ({last}) "
                   "has 4: y has 4 rows for the 8 of x; pass y with as many rows as x")
    assert "y has 4 rows for the 8 of x" in raised_everywhere(lambda: pipe.evaluate(x, y[:4]))
    assert pipe.train_step(x, y) == pytest.approx(reference(make_model(), [(x, y)])[0], rel=1e-5)  # still fine
    pipe.close()


class Shaped:
    """Claims a shape, but numpy sees a single object in it."""

    shape = (BATCH, 6)


def test_batches_that_are_not_arrays_raise_on_every_rank():
    pipe = Pipeline(make_model(), chunks=2, loss="mse", optimizer=sgd)
    x, y = batch(0)
    msg = raised_everywhere(lambda: pipe.train_step(x.tolist(), y))
    assert msg.startswith("rank 0: x must be a batch (an array or tensor) on the rank holding stage 0; received "
                          "list without a batch dimension")
    msg = raised_everywhere(lambda: pipe.train_step(x, 3.0))
    assert msg.startswith(f"rank {N - 1}: y must be a batch (an array or tensor) on the rank holding the last "
                          f"stage ({N - 1}); received float without a batch dimension")
    msg = raised_everywhere(lambda: pipe.train_step(Shaped(), y))
    assert msg.startswith("rank 0: this rank's batch does not split into 2 microbatches (ValueError: x (Shaped, "
                          "shape (8, 6)) converts to a numpy array without a batch dimension); pass numpy arrays")
    assert "received int without a batch dimension" in raised_everywhere(lambda: pipe.predict(7))
    assert pipe.train_step(x, y) == pytest.approx(reference(make_model(), [(x, y)])[0], rel=1e-5)  # still fine
    pipe.close()


@pytest.mark.skipif(N < 2, reason="one stage sends nothing")
def test_a_stage_output_that_changes_shape_raises_on_every_rank():
    total = keras.layers.Lambda(lambda t: tf.reduce_sum(t, axis=1, keepdims=True))
    layers = [Wobbly(), total] + [keras.layers.Dense(1) for _ in range(N - 1)]
    pipe = Pipeline(layers, balance=[1, 2] + [1] * (N - 2), chunks=2, loss="mse", optimizer=sgd, input_shape=(6,))
    x, y = batch(0)
    x[0, 0], x[4, 0] = 1.0, -1.0  # microbatch 0 gives 5 columns, microbatch 1 gives 4
    msg = raised_everywhere(lambda: pipe.train_step(x, y))
    assert ("at F1@s0 (forward of stage 0, microbatch 1): the output of stage 0 for microbatch 1 is (4, 4) "
            "float32 but microbatch 0 gave (4, 5) float32 in this step") in msg
    pipe.close()


@pytest.mark.skipif(N == 1, reason="needs ranks that disagree")
def test_arguments_that_differ_between_ranks_raise_on_every_rank():
    mine = [1] * (N - 1) + [9 - N] if R == 0 else [2] + [1] * (N - 2) + [8 - N]
    msg = raised_everywhere(lambda: Pipeline(make_model(), balance=mine, loss="mse", optimizer=sgd))
    assert "built with different arguments on different ranks" in msg
    assert f"balance: rank 0 {[1] * (N - 1) + [9 - N]!r}, rank 1 {[2] + [1] * (N - 2) + [8 - N]!r}" in msg


def test_balance_by_time_is_the_same_on_every_rank():
    layers = list(make_model().layers)
    if R == 1:  # slower here only
        layers[0] = keras.Sequential([keras.Input((6,)), *[keras.layers.Dense(6) for _ in range(100)], layers[0]])
    balance = hvd.balance_by_time(layers, np.ones((4, 6), "float32"), N)
    assert WORLD.allgather(balance) == [balance] * N and sum(balance) == 8


def test_balance_by_time_changes_nothing_it_measures():
    """Measuring trains each layer's forward: BatchNormalization's moving statistics and the
    Dropout's seed generator are put back (before: the statistics moved)."""
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.5, seed=3), keras.layers.Dense(1)])
    before = [v.numpy().copy() for v in model.non_trainable_variables]
    assert len(before) >= 3  # the two statistics and the seed generator's state
    balance = hvd.balance_by_time(model, np.random.default_rng(1).standard_normal((4, 6)).astype("float32"),
                                  min(N, 4))
    assert sum(balance) == 4
    for a, v in zip(before, model.non_trainable_variables, strict=True):
        np.testing.assert_array_equal(a, v.numpy(), err_msg=v.path)


def test_fit_refuses_x_and_y_of_different_lengths_on_every_rank():
    """A y shorter than x hung the job (the last stage indexed past y's end while rank 0 waited);
    a longer one was cut silently."""
    rs = np.random.default_rng(3)
    x, y = rs.standard_normal((40, 6)).astype("float32"), rs.standard_normal((30, 1)).astype("float32")
    pipe = Pipeline(make_model(), chunks=2, loss=keras.losses.MeanSquaredError(), optimizer=sgd)
    for short in (y, np.concatenate([y, y])):
        msg = raised_everywhere(lambda short=short: pipe.fit(x, short, batch_size=BATCH, verbose=0))
        assert f"x and y must have the same number of rows on every rank that passes them; rows passed: " \
               f"rank 0: x 40, y {len(short)}" in msg, msg
    assert len(pipe.fit(x, y[:10].repeat(4, axis=0), batch_size=BATCH, epochs=1, verbose=0)) == 1
    # a list's rows were not counted (read by shape alone): a shorter list x raised on one rank, the others hung
    msg = raised_everywhere(lambda: pipe.fit(x[:24].tolist(), y, batch_size=BATCH, verbose=0))
    assert "rows passed: rank 0: x 24" in msg, msg
    pipe.close()


def test_a_loss_scale_optimizer_is_refused_on_every_rank():
    """The stages never multiply the loss by the scale, so a LossScaleOptimizer divided every update
    by it (32768): refused, naming what to use instead."""
    msg = raised_everywhere(lambda: Pipeline(make_model(), chunks=2, loss="mse",
                                             optimizer=lambda: keras.optimizers.LossScaleOptimizer(sgd())))
    assert "returned a LossScaleOptimizer, which the pipeline does not support" in msg
    assert "'mixed_bfloat16'" in msg


@pytest.mark.skipif(N % 2, reason="a grid of 2 pipelines needs an even number of ranks")
def test_replicas_with_different_batch_sizes_train_on_the_mean_over_every_row():
    """Before 2026-12-05 each replica's mean counted alike (a mean of means), whatever its rows."""
    grid = pipeline_grid(dp=2)
    pipe = Pipeline(make_model(), chunks=2, loss="mse", optimizer=sgd, grid=grid)
    rows = 8 if grid.pipeline == 0 else 4
    mine = [tuple(a[:rows] for a in batch(k, grid.pipeline)) for k in range(2)]
    losses = [pipe.train_step(x, y) for x, y in mine]
    whole = [tuple(np.concatenate([a[:8], b[:4]]) for a, b in zip(batch(k, 0), batch(k, 1), strict=True))
             for k in range(2)]
    ref = make_model()
    assert_same(pipe, ref, losses, reference(ref, whole))
    pipe.close()


def test_a_float64_model_trains_at_float64_precision():
    """The microbatch loss was cast to float32 before the 1/chunks scale: a float64 model's loss came out
    3.5e-8 off one process, its weights 1.9e-9 after 3 steps (found by an audit, 2026-12-05)."""
    policy = keras.config.dtype_policy()  # (once a layer exists, Keras keeps its policy whatever floatx says)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        def model():
            keras.utils.set_random_seed(0)
            return keras.Sequential([keras.Input((5,))] + [keras.layers.Dense(5, activation="tanh")
                                                           for _ in range(3)] + [keras.layers.Dense(3)])

        pipe = Pipeline(model(), chunks=3, loss="mse", optimizer=lambda: keras.optimizers.SGD(0.1))
        ref, opt, g = model(), keras.optimizers.SGD(0.1), np.random.default_rng(0)
        for _ in range(3):
            x, y = g.standard_normal((6, 5)), g.standard_normal((6, 3))
            loss = pipe.train_step(x, y)
            with tf.GradientTape() as tape:
                ref_loss = keras.losses.MeanSquaredError()(y, ref(x, training=True))
            opt.apply(tape.gradient(ref_loss, ref.trainable_variables), ref.trainable_variables)
            assert abs(loss - float(ref_loss)) <= 1e-13 * abs(float(ref_loss))
        for mine, theirs in zip(pipe.get_weights(), ref.get_weights(), strict=True):
            assert mine.dtype == np.float64
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-13)
        pipe.close()
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy(policy)


def test_what_the_pipeline_cannot_train_exactly_is_refused_on_every_rank():
    """Before 2026-12-05: a regularizer's penalty was left out of the loss and the gradients, a layer in
    stages on two ranks was trained as two copies, and an optimizer failing on one rank left the others
    waiting for ever."""
    keras.utils.set_random_seed(0)
    regularized = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, kernel_regularizer="l2"),
                                    *[keras.layers.Dense(8) for _ in range(6)], keras.layers.Dense(1)])
    msg = raised_everywhere(lambda: Pipeline(regularized, chunks=2, loss="mse", optimizer=sgd))
    assert "kernel_regularizer" in msg and "loss=" in msg
    if N > 1:
        shared = keras.layers.Dense(6, activation="tanh")
        tied = keras.Sequential([keras.Input((6,)), shared, *[keras.layers.Dense(6) for _ in range(6)], shared,
                                 keras.layers.Dense(1)])
        msg = raised_everywhere(lambda: Pipeline(tied, chunks=2, loss="mse", optimizer=sgd))
        assert "share the variable" in msg and "tied weights" in msg

    class Picky(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            if R == N - 1:
                raise ValueError("picky optimizer")
            return super().update_step(gradient, variable, learning_rate)

    pipe = Pipeline(make_model(), chunks=2, loss="mse", optimizer=lambda: Picky(0.1))
    msg = raised_everywhere(lambda: pipe.train_step(*batch(0)))
    assert "apply()" in msg and "picky optimizer" in msg
    pipe.close()


def test_a_layer_in_two_stages_of_one_rank_is_stepped_once_by_adam():
    """Interleaved: the shared layer sits in stages 0 and pp of rank 0. Each stage's own optimizer stepped it
    with its part of the gradient before 2026-12-05 (Adam: loss 0.574 for 0.533, weights 0.19 off)."""
    def tied(seed=0):
        keras.utils.set_random_seed(seed)
        shared = keras.layers.Dense(6, activation="tanh")
        inner = [keras.layers.Dense(6, activation="tanh") for _ in range(6)]
        return keras.Sequential([keras.Input((6,)), shared, *inner[:3], shared, *inner[3:], keras.layers.Dense(1)])

    def adam():
        return keras.optimizers.Adam(0.05)

    if N > 4 or CHUNKS % N:
        pytest.skip("layers 0-3 fill the first N stages; interleaved needs chunks a multiple of the ranks")

    def split(k, n):
        return [k // n + (i < k % n) for i in range(n)]

    balance = split(4, N) + split(5, N)  # 9 layers (the shared one counts twice); index 4 starts stage N: rank 0's
    pipe = Pipeline(tied(), balance=balance, chunks=CHUNKS, schedule="interleaved", virtual_stages=2, loss="mse",
                    optimizer=adam)
    batches = [batch(k) for k in range(STEPS)]
    losses = [pipe.train_step(x if pipe.holds_first else None, y if pipe.holds_last else None)
              for x, y in batches]
    ref, opt, ref_losses = tied(), adam(), []
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, ref(x, training=True))
        opt.apply(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables)
        ref_losses.append(float(loss))
    assert_same(pipe, ref, losses, ref_losses)
    pipe.close()
    if N > 1:  # the norm of one rank's gradients is not the model's
        msg = raised_everywhere(lambda: Pipeline(make_model(), chunks=2, loss="mse",
                                                 optimizer=lambda: keras.optimizers.Adam(global_clipnorm=1.0)))
        assert "global_clipnorm=1.0" in msg and "clipnorm=" in msg


def _classifier():
    keras.utils.set_random_seed(4)
    return keras.Sequential([keras.Input((6,)), *[keras.layers.Dense(16, activation="tanh") for _ in range(7)],
                             keras.layers.Dense(3)])


@pytest.mark.parametrize("schedule, checkpoint", [("1f1b", "never"), ("zb-h1", "always")])
def test_a_cross_entropy_with_an_ignored_class_trains_like_one_process(schedule, checkpoint):
    """Keras's mean over the targets other than ``ignore_class`` divides by their count, which differs between
    microbatches: scaled by 1/chunks the gradients were up to 62% off one process's (an audit, 2026-12-06).
    Microbatch 1 here is all padding."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
    pipe = Pipeline(_classifier(), chunks=CHUNKS, schedule=schedule, checkpoint=checkpoint, loss=loss,
                    optimizer=sgd)
    ref, opt = _classifier(), sgd()
    losses, ref_losses = [], []
    for k in range(2):
        g = np.random.default_rng(300 + k)
        x, t = g.standard_normal((BATCH, 6)).astype("float32"), g.integers(0, 3, BATCH)
        t[[0, 2, 3, 7]] = -1
        losses.append(pipe.train_step(x, t))
        with tf.GradientTape() as tape:
            want = loss(t, ref(x, training=True))
        opt.apply(tape.gradient(want, ref.trainable_variables), ref.trainable_variables)
        ref_losses.append(float(want))
        assert pipe.evaluate(x, t) == pytest.approx(float(loss(t, ref(x))), rel=1e-5)
    assert_same(pipe, ref, losses, ref_losses)
    pipe.close()


@pytest.mark.skipif(N % 2, reason="a tensor group of 2 needs an even number of ranks")
def test_fit_on_a_grid_with_tensor_groups_gives_a_groups_shards_the_same_rows():
    """The rows of a replica were cut by the pipeline's number (replica * tp + shard): a tensor group's second
    shard read the next replica's rows, silently (found by an audit, 2026-12-06)."""
    from unison.common.tensor_parallel import Grid, grid_pipeline

    grid = Grid(dp=N // 2, pp=1, tp=2)
    layout = grid_pipeline(grid)
    pipe = Pipeline(make_model(), chunks=2, loss="mse", optimizer=sgd, grid=layout)
    seen = []
    step = pipe.train_step

    def spy(x, y):
        seen.append(None if x is None else x[:, 0].tolist())
        return step(x, y)

    pipe.train_step = spy
    rs = np.random.default_rng(8)
    x, y = rs.standard_normal((4 * N, 6)).astype("float32"), rs.standard_normal((4 * N, 1)).astype("float32")
    pipe.fit(x, y, batch_size=2 * N, epochs=1, shuffle=False, verbose=0)
    everyone = WORLD.allgather((grid.coords(R).dp, seen))
    by_replica = {}
    for replica, rows in everyone:
        assert by_replica.setdefault(replica, rows) == rows  # a group's shards read the same rows
    steps = list(zip(*(by_replica[d] for d in sorted(by_replica)), strict=True))
    for k, parts in enumerate(steps):  # the replicas' rows make the step's global batch, each row once
        assert sorted(v for part in parts for v in part) == sorted(x[2 * N * k:2 * N * (k + 1), 0].tolist())
    pipe.close()


def _ids_model():
    """A Dense whose output is cast to token ids for an Embedding: the boundary between them carries integers."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(3),
                             keras.layers.Lambda(lambda t: tf.cast(tf.abs(t) * 3, "int32") % 10),
                             keras.layers.Embedding(10, 4), keras.layers.Flatten(), keras.layers.Dense(2)])


@pytest.mark.skipif(N != 2, reason="two stages, one per rank")
@pytest.mark.parametrize("schedule, checkpoint", [("1f1b", "never"), ("zb-h1", "always"), ("gpipe", "always")])
def test_an_integer_stage_boundary_trains_as_one_process(schedule, checkpoint):
    """[Note: no gradient through integers] The integer input was differentiated and stage 0 failed in
    tape.gradient on every rank with TensorFlow's bare "'str' object has no attribute '_type_enum'" (found by
    an audit, 2026-12-07). Now the layers upstream get no gradient, as in one process: AdamW's weight decay
    leaves them alone (zeros would have decayed them), and the rest trains alike."""
    def adamw():
        return keras.optimizers.AdamW(0.05, weight_decay=0.5)

    rng = np.random.default_rng(3)
    data = [(rng.standard_normal((4, 3)).astype("float32"), rng.standard_normal((4, 2)).astype("float32"))
            for _ in range(2)]
    ref, opt, mse = _ids_model(), adamw(), keras.losses.MeanSquaredError()
    first = [w.copy() for w in ref.layers[0].get_weights()]
    ref_losses = []
    for x, y in data:
        with tf.GradientTape() as tape:
            loss = mse(y, ref(x, training=True))
        grads = tape.gradient(loss, ref.trainable_variables)
        kept = [(tf.convert_to_tensor(g), v) for g, v in zip(grads, ref.trainable_variables, strict=True)
                if g is not None]  # (the pipeline sums an embedding's sparse gradient densely over microbatches)
        opt.apply([g for g, _ in kept], [v for _, v in kept])
        ref_losses.append(float(loss))
    assert all(np.array_equal(a, b) for a, b in zip(ref.layers[0].get_weights(), first, strict=True))
    pipe = Pipeline(_ids_model(), balance=[2, 3], chunks=2, loss="mse", optimizer=adamw, schedule=schedule,
                    checkpoint=checkpoint)
    losses = [pipe.train_step(x, y) for x, y in data]
    assert_same(pipe, ref, losses, ref_losses)
    pipe.close()


def _bn_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(momentum=0.5),
                             keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


@pytest.mark.skipif(N % 2, reason="a grid of 2 pipelines needs an even number of ranks")
def test_a_grids_replicas_average_their_moving_statistics_like_one_process():
    """Before 2026-12-07 only the gradients were averaged: each replica's BatchNormalization statistics followed
    its own rows, evaluate averaged the losses of different models (0.376, where the model get_weights returned
    gave 0.108), and get_weights returned replica 0's statistics (found by an audit). The replicas' rows here have
    the same column means, so the averaged moving mean and (biased) variance are one process's on the global
    batch."""
    grid = pipeline_grid(dp=2)
    pipe = Pipeline(_bn_model(), balance=[1, 2] if grid.pp == 2 else None, chunks=1, loss="mse", optimizer=sgd,
                    grid=grid)
    rs, centre = np.random.default_rng(4), np.array([1.0, -2.0, 0.5, 3.0])
    ref_bn = keras.layers.BatchNormalization(momentum=0.5)  # one process on the global batch
    for _ in range(2):
        z = rs.standard_normal((4, 4))
        z -= z.mean(axis=0)
        parts = [(centre + z).astype("float32"), (centre + 3 * z).astype("float32")]  # the second spreads 3x wider
        y = rs.standard_normal((4, 1)).astype("float32")
        pipe.train_step(parts[grid.pipeline], y)
        ref_bn(np.concatenate(parts), training=True)
    want = [ref_bn.moving_mean.numpy(), ref_bn.moving_variance.numpy()]
    bn = pipe._layers[0]
    held = [bn.moving_mean.numpy(), bn.moving_variance.numpy()] if 0 in pipe.stages else None
    for theirs in WORLD.allgather(held):
        if theirs is not None:  # every replica holding the layer
            for got, expected in zip(theirs, want, strict=True):
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    weights = pipe.get_weights()
    np.testing.assert_allclose(weights[2], want[0], rtol=1e-5, atol=1e-6)  # gamma, beta, moving mean, variance
    np.testing.assert_allclose(weights[3], want[1], rtol=1e-5, atol=1e-6)
    x, y = rs.standard_normal((4, 4)).astype("float32"), rs.standard_normal((4, 1)).astype("float32")
    model = _bn_model()
    model.set_weights(weights)
    loss = pipe.evaluate(x, y)  # the same batch on every replica: the loss of the model get_weights returns
    assert loss == pytest.approx(float(keras.losses.MeanSquaredError()(y, model(x, training=False))), rel=1e-5)
    pipe.close()


def _dropout_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dropout(0.5), keras.layers.Dense(1)])


@pytest.mark.skipif(N % 2, reason="a grid of 2 pipelines needs an even number of ranks")
def test_data_parallel_replicas_draw_their_own_dropout_masks():
    """Before 2026-12-07 the replicas' seed generators started alike (left out of the broadcast, seeded alike):
    global rows i and i + B / dp drew the same Dropout mask at every step, where one process draws independent
    masks (found by an audit). Replica 0 draws what one process draws, the shards of a tensor group (4 ranks:
    dp x tp = 2 x 2) draw alike, and a second build draws the same masks again (a seeded run is reproducible)."""
    from unison.common.tensor_parallel import Grid, grid_pipeline

    grid = pipeline_grid(pp=1, dp=2) if N == 2 else grid_pipeline(Grid(dp=2, pp=1, tp=2))
    replica = grid.pipeline // grid.tp
    ones = tf.ones((8, 16))
    drawn = []
    for _ in range(2):
        pipe = Pipeline(_dropout_model(), chunks=1, loss="mse", optimizer=sgd, grid=grid)
        drawn.append(pipe.stages[0].layers[0](ones, training=True).numpy() != 0)  # the stage's Dropout
        pipe.close()
    np.testing.assert_array_equal(drawn[0], drawn[1])
    one_process = _dropout_model().layers[0](ones, training=True).numpy() != 0
    if replica == 0:
        np.testing.assert_array_equal(drawn[0], one_process)
    masks = {}
    for theirs, mask in WORLD.allgather((replica, drawn[0])):
        np.testing.assert_array_equal(masks.setdefault(theirs, mask), mask)  # a tensor group's shards agree
    assert np.mean(masks[0] == masks[1]) < 0.8, "the replicas drew the same dropout mask"


@pytest.mark.skipif(N % 2, reason="a tensor group of 2 needs an even number of ranks")
def test_get_weights_on_a_tensor_parallel_grid_is_refused_on_every_rank():
    """Before 2026-12-07 every rank got shard 0 of each split layer (pipeline 0 is replica 0's shard 0), which
    fits no unsplit model (found by an audit)."""
    from unison.common.tensor_parallel import Grid, grid_pipeline

    layout = grid_pipeline(Grid(dp=N // 2, pp=1, tp=2))
    pipe = Pipeline(make_model(), chunks=2, loss="mse", optimizer=sgd, grid=layout)
    msg = raised_everywhere(pipe.get_weights)
    assert msg.startswith("get_weights() cannot gather a tensor-parallel pipeline (tp=2)")
    assert "unison.tf_backend.save_tensor_parallel" in msg and "load_tensor_parallel" in msg
    pipe.close()


class _Pair(keras.layers.Layer):
    def call(self, x):
        return x, x * 2

    def compute_output_shape(self, shape):
        return shape, shape


class _Sum(keras.layers.Layer):
    def call(self, xs):
        return xs[0] + xs[1]


@pytest.mark.skipif(N not in (2, 4), reason="a stage per rank over four layers")
def test_a_stage_that_returns_a_tuple_raises_on_every_rank_naming_the_stage():
    """Before 2026-12-07 every rank got "AttributeError: 'tuple' object has no attribute 'numpy'" (found by an
    audit); the PyTorch executor named the stage and the fix."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(4), _Pair(name="pair"), _Sum(), keras.layers.Dense(1)]
    pipe = Pipeline(layers, balance=[2, 2] if N == 2 else [1] * 4, chunks=2, loss="mse", optimizer=sgd,
                    input_shape=(4,))
    culprit = 0 if N == 2 else 1
    x, y = np.ones((4, 4), "float32"), np.ones((4, 1), "float32")
    for step in (lambda: pipe.train_step(x, y), lambda: pipe.predict(x)):
        msg = raised_everywhere(step)
        assert (f"TypeError: stage {culprit} returned a tuple (from its last layer, 'pair' (_Pair)); what crosses "
                "a stage boundary is one tensor. Make the stage's last layer return a single tensor") in msg
    pipe.close()


def test_a_tensor_grid_passed_as_grid_is_refused_on_every_rank():
    """Before 2026-12-07 the tensor-parallel Grid got as far as splitting the job's communicator and raised
    AttributeError "'Grid' object has no attribute 'pipeline'" (found by an audit)."""
    from unison.common.tensor_parallel import Grid

    msg = raised_everywhere(lambda: Pipeline(make_model(), loss="mse", optimizer=sgd, grid=Grid(pp=N)))
    assert f"received the tensor-parallel Grid(dp=1, pp={N}, tp=1). Pass grid=grid_pipeline(grid, sets)" in msg
    msg = raised_everywhere(lambda: Pipeline(make_model(), loss="mse", optimizer=sgd, grid=N))
    assert f"grid= takes a PipelineGrid: hvd.pipeline_grid(pp, dp), or grid_pipeline(grid, sets) for a " \
           f"tensor-parallel Grid; received int {N}" in msg


@pytest.mark.skipif(N != 2, reason="one tensor group over both ranks of a two-stage pipeline")
def test_tensor_parallel_layers_on_another_group_than_the_grids_are_refused_on_every_rank():
    """Layers on the default (every-rank) set in a pp=2 pipeline: before 2026-12-07 construction accepted them
    and the first step stalled until the engine's timeout (found by an audit)."""
    keras.utils.set_random_seed(0)
    layers = [hvd.ColumnParallelLinear(4, 8, activation="tanh"), hvd.RowParallelLinear(8, 2)]
    msg = raised_everywhere(lambda: Pipeline(layers, balance=[1, 1], chunks=2, loss="mse", optimizer=sgd,
                                             input_shape=(4,)))
    assert msg.startswith("rank 0: layer 0 (") and "stage 0) holds the tensor-parallel ColumnParallelLinear" in msg
    assert "split over ranks [0, 1] (its process_set), but the grid's tensor group of this rank is ranks [0]" \
        in msg
    assert "process_set=sets.tp) and pass grid=grid_pipeline(grid, sets)" in msg
