"""ZeRO stages 1 and 2 for Keras 3 under mpirun: sharded runs match one process on the global batch."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import unison.tf_backend.keras as hvd  # noqa: E402
from unison.tf_backend import UnisonStrategy, zero  # noqa: E402

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
GLOBAL_BATCH = 6 * N
rs = np.random.RandomState(3)
X = rs.randn(GLOBAL_BATCH * 3, 4).astype("float32")
Y = rs.randn(GLOBAL_BATCH * 3, 3).astype("float32")
# 4*5+5 + 5*3+3 = 43 parameters (prime): no bucket divides by 2 or 3
zero.BUCKET_BYTES = 64  # several buckets per dtype: a bucket holds at most 16 float32 elements


def make_model(f64_head: bool = False) -> keras.Model:
    head = keras.layers.Dense(3, dtype="float64" if f64_head else None, name="head")
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh", name="hidden"), head])


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.02),
    # the clip is below the gradient norm here
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.02, global_clipnorm=0.05),
    "adamw": lambda: keras.optimizers.AdamW(keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5),
                                            weight_decay=0.2),
}


def reference(init: list[np.ndarray], make_opt, epochs: int, f64_head: bool = False) -> keras.Model:
    ref = make_model(f64_head)
    ref.set_weights(init)
    opt = make_opt()
    if isinstance(opt, keras.optimizers.AdamW):
        opt.exclude_from_weight_decay(var_names=["bias"])
    ref.compile(optimizer=opt, loss="mse")
    ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return ref


def assert_same_weights(model: keras.Model, ref: keras.Model) -> None:
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=2e-5, atol=2e-6)
    flat = np.concatenate([w.ravel().astype("float64") for w in model.get_weights()])
    assert all(np.array_equal(flat, other) for other in WORLD.allgather(flat))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_fit_matches_one_process(stage, kind):
    strategy = UnisonStrategy(zero_stage=stage)
    keras.utils.set_random_seed(7 + R)  # differently on every rank: the strategy broadcasts rank 0's
    f64 = kind == "adamw"  # a second dtype: two shard variables
    with strategy.scope():
        model = make_model(f64)
        opt = OPTIMIZERS[kind]()
        if isinstance(opt, keras.optimizers.AdamW):
            opt.exclude_from_weight_decay(var_names=["bias"])
        model.compile(optimizer=opt, loss="mse")
    init = model.get_weights()
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH), epochs=2, verbose=0)
    assert model.optimizer.iterations.numpy() == 6
    assert_same_weights(model, reference(init, OPTIMIZERS[kind], 2, f64))


@pytest.mark.parametrize("stage", [1, 2])
def test_custom_loop_matches_one_process(stage):
    strategy = UnisonStrategy(zero_stage=stage)
    keras.utils.set_random_seed(11)
    with strategy.scope():
        model = make_model()
        opt = keras.optimizers.Adam(0.05)
        opt.build(model.trainable_variables)
    init = model.get_weights()
    loss_fn = keras.losses.MeanSquaredError(reduction="sum")

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x)) / (GLOBAL_BATCH * 3)  # mean over the global batch
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        strategy.run(replica, args=(x, y))

    for x, y in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y))
                                                         .batch(GLOBAL_BATCH)):
        step(x, y)
    ref = make_model()
    ref.set_weights(init)
    ref_opt = keras.optimizers.Adam(0.05)
    for i in range(3):
        xb, yb = X[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH], Y[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, ref(xb)) / (GLOBAL_BATCH * 3)
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables,
                                    strict=True))
    assert_same_weights(model, ref)


@pytest.mark.parametrize("stage", [1, 2])
def test_distributed_optimizer_fit_matches_one_process(stage):
    hvd.init()
    keras.utils.set_random_seed(5)  # the same initial weights everywhere (no strategy to broadcast)
    model = make_model()
    init = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                     zero_stage=stage), loss="mse")
    rows = np.concatenate([np.arange(b * GLOBAL_BATCH + R * 6, b * GLOBAL_BATCH + (R + 1) * 6) for b in range(3)])
    model.fit(X[rows], Y[rows], batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert_same_weights(model, reference(init, OPTIMIZERS["sgd_momentum"], 2))


@pytest.mark.parametrize("stage", [1, 2])
def test_mixed_precision_skips_agree(stage):
    """A NaN in the last rank's rows of batch 0 only: every rank must skip that step, as one process does."""
    x = X.copy()
    x[GLOBAL_BATCH - 1] *= 1e6  # inf once cast to float16: the loss (and gradients) of this rank turn NaN
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        strategy = UnisonStrategy(zero_stage=stage)
        keras.utils.set_random_seed(13)
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.02),
                                                                        initial_scale=2.0 ** 8), loss="mse")
        init = model.get_weights()
        model.fit(tf.data.Dataset.from_tensor_slices((x, Y)).batch(GLOBAL_BATCH), epochs=2, verbose=0)
        ref = make_model()
        ref.set_weights(init)
        ref.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.02),
                                                                  initial_scale=2.0 ** 8), loss="mse")
        ref.fit(x, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert float(model.optimizer.dynamic_scale.numpy()) == float(ref.optimizer.dynamic_scale.numpy()) == 2.0 ** 6
    assert model.optimizer.iterations.numpy() == ref.optimizer.iterations.numpy() == 4  # 2 of 6 steps skipped
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):  # float16 sums differ a little
        np.testing.assert_allclose(w, v, rtol=1e-2, atol=2e-3)
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    assert all(np.array_equal(flat, other) for other in WORLD.allgather(flat))


def count(variables) -> int:
    return sum(int(np.prod(v.shape)) for v in variables)


@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_state_is_one_nth(stage):
    """Measured: Adam's variables on each rank hold ~1/N of the unsharded optimizer's elements."""
    saved, zero.BUCKET_BYTES = zero.BUCKET_BYTES, None  # one bucket per dtype: padding < N
    try:
        strategy = UnisonStrategy(zero_stage=stage)
        with strategy.scope():
            big = keras.Sequential([keras.Input((64,)), keras.layers.Dense(301), keras.layers.Dense(7)])
            opt = keras.optimizers.Adam()
            opt.build(big.trainable_variables)
        plain = keras.optimizers.Adam()
        plain.build(big.trainable_variables)
    finally:
        zero.BUCKET_BYTES = saved
    params = count(big.trainable_variables)
    scalars = count([v for v in opt.variables if len(v.shape) == 0])
    sharded, full = count(opt.variables) - scalars, count(plain.variables) - scalars
    assert full == 2 * params
    assert sharded == 2 * (-(-params // N))  # Adam's two moments, for this rank's segment only
    total = sum(WORLD.allgather(sharded))
    assert 2 * params <= total < 2 * params + 2 * N  # the ranks together hold one copy (plus padding)
    if R == 0:
        print(f"\nzero stage {stage}, N={N}: Adam state elements per rank {sharded + scalars} "
              f"vs unsharded {full + scalars} (ratio {(sharded + scalars) / (full + scalars):.4f})")


def test_saved_model_loads_in_plain_keras(tmp_path_factory):
    strategy = UnisonStrategy(zero_stage=2)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH), epochs=1, verbose=0)
    path = WORLD.bcast(str(tmp_path_factory.mktemp("zero") / "model.keras") if R == 0 else None)
    model.save(path)
    WORLD.Barrier()
    ok = None
    if R == 0:
        out = path + ".npz"
        code = ("import os; os.environ['KERAS_BACKEND']='tensorflow'; import keras, numpy as np, sys; "
                "m = keras.models.load_model(sys.argv[1]); "
                "m.predict(np.zeros((1, 4), 'float32'), verbose=0); "
                "np.savez(sys.argv[2], *m.get_weights()); print(type(m.optimizer).__module__)")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE"))}
        proc = subprocess.run([sys.executable, "-c", code, path, out], capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip().splitlines()[-1].startswith("keras.")  # a plain Keras optimizer
        loaded = np.load(out)
        ok = all(np.array_equal(loaded[f"arr_{i}"], w) for i, w in enumerate(model.get_weights()))
    assert WORLD.bcast(ok)


def test_bad_stage_values_raise():
    for bad in (5, -1, "1", 1.0, True):
        with pytest.raises(ValueError, match="zero_stage"):
            UnisonStrategy(zero_stage=bad)
        with pytest.raises(ValueError, match="zero_stage"):
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), zero_stage=bad)
    with pytest.raises(ValueError, match="PyTorch-only"):
        UnisonStrategy(zero_stage=3)
    with pytest.raises(ValueError, match="PyTorch-only"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), zero_stage=3)


@pytest.mark.skipif(N == 1, reason="needs two ranks to disagree")
def test_mismatched_stages_raise_on_every_rank():
    with pytest.raises(ValueError, match="same zero_stage"):
        UnisonStrategy(zero_stage=R % 2)
    model = make_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), zero_stage=R % 2 + 1 if R else 0)
    with pytest.raises(ValueError, match="same zero_stage"):
        opt.build(model.trainable_variables)


@pytest.mark.skipif(N == 1, reason="needs two ranks to disagree")
def test_mismatched_models_raise_on_every_rank():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3 + R)])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(), zero_stage=1)
    with pytest.raises(ValueError, match="ShardPlan signature"):
        opt.build(model.trainable_variables)


def test_optimizers_that_cannot_be_sharded_raise():
    strategy = UnisonStrategy(zero_stage=1)
    with strategy.scope():
        for make in (keras.optimizers.Adafactor, keras.optimizers.Lamb):
            with pytest.raises(ValueError, match=f"{make.__name__}.*zero_stage=0"):
                make()
        with pytest.raises(ValueError, match="clipnorm"):
            keras.optimizers.Adam(clipnorm=1.0)
    with pytest.raises(ValueError, match="Adafactor"):
        hvd.DistributedOptimizer(keras.optimizers.Adafactor(), zero_stage=2)
    with pytest.raises(ValueError, match="does not support"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), zero_stage=1, backward_passes_per_step=2)
