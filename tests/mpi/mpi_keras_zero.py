"""ZeRO stages 1 and 2 for Keras 3 under mpirun: sharded runs match one process on the global batch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import unison.tf_backend.keras as hvd  # noqa: E402
from unison.common import checkpoints as ck  # noqa: E402
from unison.tf_backend import UnisonStrategy, zero  # noqa: E402
from unison.tf_backend.zero_checkpoint import load_sharded, save_sharded  # noqa: E402

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


#: the rest of docs/zero.md's "sharded" row, each with what makes it differ from plain SGD/Adam
MORE_OPTIMIZERS = {
    "sgd_nesterov_clipvalue": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True, clipvalue=0.05),
    "adam_amsgrad": lambda: keras.optimizers.Adam(0.02, amsgrad=True),
    "adamax": lambda: keras.optimizers.Adamax(0.02),
    "nadam": lambda: keras.optimizers.Nadam(0.02),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.01),
    "lion": lambda: keras.optimizers.Lion(0.01),
    "sgd_accumulated": lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
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


@pytest.mark.parametrize("kind", sorted(MORE_OPTIMIZERS))
def test_more_optimizers_fit_like_one_process_at_stage_2(kind):
    """docs/zero.md: every optimizer the table calls elementwise gives one process's numbers sharded
    (stage 2: sharded state and reduce-scattered gradients; the four above run at both stages)."""
    strategy = UnisonStrategy(zero_stage=2)
    keras.utils.set_random_seed(7 + R)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=MORE_OPTIMIZERS[kind](), loss="mse")
    init = model.get_weights()
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH), epochs=2, verbose=0)
    assert_same_weights(model, reference(init, MORE_OPTIMIZERS[kind], 2))


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


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_mixed_precision_skips_agree(stage):
    """A NaN in the last rank's rows of batch 0 only: every rank must skip that step, as one process does.

    Stage 0 too: Keras checks the gradients before the inner optimizer all-reduces them, so without
    the agreed flag the overflowing rank would skip alone (and the others wait in its all-reduce).
    """
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
def test_float16_gradients_average_without_overflowing_where_one_process_does_not(stage):
    """Every rank's gradient is about 40000 (float16 holds it, and the average): a float16 sum overflowed to inf
    before 2026-12-05; the buckets now reduce in float32 and round once."""
    hvd.init()
    v, ref = (keras.Variable(np.zeros(2 * N + 1, "float16"), dtype="float16", name=f"w16{i}") for i in (0, 1))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1e-6), zero_stage=stage)
    opt.apply_gradients([(tf.constant(np.full(2 * N + 1, 40000 + 512 * R, "float16")), v)])
    mean = 40000 + 256 * (N - 1)  # (a float16 value: the gradients are multiples of its spacing there, 32)
    keras.optimizers.SGD(1e-6).apply_gradients([(tf.constant(np.full(2 * N + 1, mean, "float16")), ref)])
    np.testing.assert_array_equal(v.numpy(), ref.numpy())  # one process's float16 step, bit for bit


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
    # named: an unnamed stage-0 optimizer made on rank 0 only would shift that rank's automatic names, and a
    # later unnamed optimizer's reductions would then meet no partner (they hung in a later test)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), zero_stage=R % 2 + 1 if R else 0, name="mismatched")
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
    # the rest of docs/zero.md's refusals
    with strategy.scope():
        with pytest.raises(ValueError, match=r"Muon.*zero_stage=0"):
            keras.optimizers.Muon()
        with pytest.raises(ValueError, match=r"use_ema=True\) keeps a moving average"):
            keras.optimizers.Adam(use_ema=True)
    for option in ({"compression": hvd.Compression.fp16}, {"op": hvd.Sum}, {"gradient_predivide_factor": 2.0},
                   {"process_set": hvd.add_process_set(list(range(N)))}):
        with pytest.raises(ValueError, match=rf"does not support \{{'{next(iter(option))}'"):
            hvd.DistributedOptimizer(keras.optimizers.SGD(), zero_stage=1, **option)


def test_what_a_shard_cannot_honour_is_refused_when_set_late_or_through_other_doors(tmp_path_factory):
    """Found by an audit (2026-12-05): clipnorm set on the optimizer after construction (Keras reads it at
    every apply) clipped each flat shard by its own norm, silently (2.6e-3 off one process after an
    epoch); BackupAndRestore resumed a sharded optimizer with fresh moments and step count (its weights
    file holds no optimizer state), silently; DistributedOptimizer(zero_stage=1) took groups=-5, and
    register_local_var was missing. Each is now a ValueError on every rank."""
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
    strategy = UnisonStrategy(zero_stage=1)
    with strategy.scope():
        model = make_model()
        opt = keras.optimizers.SGD(0.1)
        opt.clipnorm = 0.01
        model.compile(optimizer=opt, loss="mse")
    with pytest.raises(ValueError, match=r"SGD\(clipnorm=0.01\) clips each variable by its own norm"):
        model.fit(ds, epochs=1, verbose=0)
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("backup")) if R == 0 else None)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    with pytest.raises(ValueError, match="BackupAndRestore saves the weights file.*save_sharded"):
        model.fit(ds, epochs=1, verbose=0, callbacks=[hvd.callbacks.BackupAndRestore(folder)])
    for bad in ({"groups": -5}, {"num_groups": -1}):
        with pytest.raises(ValueError, match="groups should be a non-negative integer"):
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), zero_stage=1, **bad)
    sharded = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), zero_stage=1)
    with pytest.raises(ValueError, match="register_local_var.*sharded"):
        sharded.register_local_var(model.trainable_variables[0])


def sharded_sgd_model() -> tuple[UnisonStrategy, keras.Model]:
    """A model compiled with SGD under UnisonStrategy(zero_stage=1), its optimizer built."""
    strategy = UnisonStrategy(zero_stage=1)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.optimizer.build(model.trainable_variables)
    return strategy, model


def test_a_variable_without_a_gradient_is_named():
    """docs/zero.md: every variable the sharded optimizer was built with needs a gradient."""
    strategy, model = sharded_sgd_model()
    unused = model.get_layer("head").kernel
    grads = [tf.zeros_like(v) for v in model.trainable_variables if v is not unused]
    used = [v for v in model.trainable_variables if v is not unused]
    with pytest.raises(ValueError, match=r"needs a gradient for every variable.*head/kernel.*have none"):
        strategy.run(lambda: model.optimizer.apply(grads, used))


def test_elastic_keras_state_refuses_a_zero_optimizer():
    """docs/elastic.md: a ZeRO optimizer's shards are laid out for this number of ranks."""
    from unison.tf_backend import elastic

    _, model = sharded_sgd_model()
    with pytest.raises(ValueError, match=r"ZeRO optimizer \(zero_stage=1\) is not supported"):
        elastic.KerasState(model)


# -------------------------------------------------------------------- sharded checkpoints
# tests/test_keras_zero_mpi.py runs this file at np 2, then "-k checkpoint" at np 3 and np 1 with
# UNISON_TEST_KERAS_CKPT set to one folder: np 2 and 3 save there, and each launch resumes what the
# launches before it saved at other rank counts (2 -> 3; 2, 3 -> 1). Run alone, a launch resumes its own.
CK_BATCH, CK_STEPS, CK_MORE = 12, 3, 2  # 12 rows divide among 1, 2 and 3 ranks
_ck = np.random.RandomState(17)
CX = _ck.randn(CK_BATCH * CK_STEPS, 4).astype("float32")
CY = _ck.randn(CK_BATCH * CK_STEPS, 3).astype("float32")


def ck_optimizer() -> keras.optimizers.Optimizer:
    """Adam inside a loss-scale optimizer whose scale grows every 2 steps (replicated scalars to restore)."""
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.02), initial_scale=16.0,
                                               dynamic_growth_steps=2)


def ck_root(tmp_path_factory) -> str:
    root = os.environ.get("UNISON_TEST_KERAS_CKPT")
    if root is None:
        root = WORLD.bcast(str(tmp_path_factory.mktemp("keras_ckpt")) if R == 0 else None)
    os.makedirs(root, exist_ok=True)
    return root


def ck_fit(model: keras.Model, rows: int, distributed: bool) -> None:
    x, y = CX[:rows], CY[:rows]
    if distributed:
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(CK_BATCH), epochs=1, verbose=0)
    else:
        model.fit(x, y, batch_size=CK_BATCH, epochs=1, shuffle=False, verbose=0)


def plain_state(model: keras.Model, opt: keras.optimizers.LossScaleOptimizer) -> dict[str, np.ndarray]:
    """Weights and optimizer state of a plain Keras model, named as the checkpoint names them, read
    through Keras's own per-variable indices (not through the checkpoint code)."""
    inner, out = opt.inner_optimizer, {}
    for v in model.weights:
        key = v.path.split("/", 1)[1]
        out[f"model.{key}"] = v.numpy()
        i = inner._get_variable_index(v)
        out[f"optim.{key}.momentum"] = inner._momentums[i].numpy()
        out[f"optim.{key}.velocity"] = inner._velocities[i].numpy()
    out["optim.iteration"] = inner.iterations.numpy()
    out["optim.loss_scale.dynamic_scale"] = opt.dynamic_scale.numpy()
    out["optim.loss_scale.step_counter"] = opt.step_counter.numpy()
    return out


def assert_state(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    missing = sorted(set(want) - set(got))
    assert not missing, f"{what}: no {missing}"
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(got[name]).reshape(value.shape), value, rtol=2e-5, atol=2e-6,
                                   err_msg=f"{what}: {name}")


def saved_state(path: str) -> dict[str, np.ndarray]:
    manifest = ck.read_manifest(path)
    return ck.load(path, {name: "full" for name in manifest.entries}, WORLD if N > 1 else None)


def reference_after(init: list[np.ndarray], steps_more: int) -> tuple[keras.Model, keras.optimizers.Optimizer]:
    """One process on the global batches: CK_STEPS steps, then ``steps_more`` steps on the first batches."""
    ref = make_model()
    ref.set_weights(init)
    ref.compile(optimizer=ck_optimizer(), loss="mse")
    ck_fit(ref, CK_BATCH * CK_STEPS, distributed=False)
    if steps_more:
        ck_fit(ref, CK_BATCH * steps_more, distributed=False)
    return ref, ref.optimizer


def test_checkpoint_save_holds_the_full_state(tmp_path_factory):
    """model.fit at this rank count with ZeRO, then save_sharded: the checkpoint holds exactly the
    weights and Adam moments (and step, loss scale) one process has after the same steps."""
    if N == 1 and os.environ.get("UNISON_TEST_KERAS_CKPT"):
        pytest.skip("the np 1 launch only resumes the checkpoints of np 2 and 3")
    stage = 2 if N % 2 == 0 else 1
    consolidated = N == 3
    strategy = UnisonStrategy(zero_stage=stage)
    keras.utils.set_random_seed(21 + R)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=ck_optimizer(), loss="mse")
    init = model.get_weights()
    ck_fit(model, CK_BATCH * CK_STEPS, distributed=True)
    path = os.path.join(ck_root(tmp_path_factory), f"np{N}" + (".unison" if consolidated else ""))
    meta = {"init": [w.tolist() for w in init], "stage": stage}
    save_sharded(path, model, model.optimizer, metadata=meta, consolidated=consolidated)
    manifest = ck.read_manifest(path)
    assert manifest.world == N and manifest.layout == ("consolidated" if consolidated else "sharded")
    assert manifest.metadata["user"] == meta and manifest.metadata["optimizer"]["zero_stage"] == stage
    ref, ref_opt = reference_after(init, 0)
    want = plain_state(ref, ref_opt)
    assert float(want["optim.loss_scale.dynamic_scale"]) == 32.0  # grew once in 3 steps
    assert_state(saved_state(path), want, f"saved at np {N} stage {stage}")


def test_a_checkpoint_with_weights_the_model_lacks_is_refused(tmp_path_factory):
    """The layers a model lacks were skipped without a word: a checkpoint of a larger model loaded (found by an
    audit, 2026-12-06)."""
    hvd.init()  # (the job's ranks save together: run alone, no earlier test initialized Unison)
    root = ck_root(tmp_path_factory)
    path = os.path.join(root, f"larger_np{N}")
    keras.utils.set_random_seed(5)
    larger = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a"),
                               keras.layers.Dense(2, name="b")])
    save_sharded(path, larger, None)
    smaller = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a")])
    with pytest.raises(ck.CheckpointError, match="holds weights this model does not have"):
        load_sharded(path, smaller, None)
    load_sharded(path, larger, None)  # its own model: fine


def _saved_checkpoints(root: str) -> list[str]:
    """What test_checkpoint_save_holds_the_full_state wrote in ``root`` at other rank counts (at this one
    when run alone)."""
    found = {n: os.path.join(root, n) for n in os.listdir(root) if re.fullmatch(r"np\d+(\.unison)?", n)}
    if not os.environ.get("UNISON_TEST_KERAS_CKPT"):
        return sorted(found.values())
    return sorted(p for n, p in found.items() if n.split(".")[0] != f"np{N}")


def test_checkpoint_resumes_at_this_rank_count(tmp_path_factory):
    """Every checkpoint saved before (see above) resumed here with ZeRO (the other stage) and into a
    plain Keras optimizer: 2 more steps equal one process continuing from the same state, weights and
    moments."""
    root = ck_root(tmp_path_factory)
    paths = _saved_checkpoints(root)
    if N == 2 and os.environ.get("UNISON_TEST_KERAS_CKPT"):
        pytest.skip("the np 2 launch saves first; np 3 and np 1 resume its checkpoint")
    assert paths, f"no checkpoint in {root}: test_checkpoint_save_holds_the_full_state runs first"
    for path in paths:
        meta = ck.read_manifest(path).metadata["user"]
        init = [np.asarray(w, "float32") for w in meta["init"]]
        ref, ref_opt = reference_after(init, CK_MORE)
        want = plain_state(ref, ref_opt)
        stage = 1 if meta["stage"] == 2 else 2
        strategy = UnisonStrategy(zero_stage=stage)
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=ck_optimizer(), loss="mse")
        assert load_sharded(path, model, model.optimizer) == meta  # builds the optimizer
        ck_fit(model, CK_BATCH * CK_MORE, distributed=True)
        again = os.path.join(root, f"resumed-np{N}")
        save_sharded(again, model, model.optimizer)
        assert_state(saved_state(again), want, f"{os.path.basename(path)} resumed at np {N} stage {stage}")

        plain = make_model()  # no strategy: a plain Keras model and optimizer, whole tensors
        plain.compile(optimizer=ck_optimizer(), loss="mse")
        load_sharded(path, plain, plain.optimizer)
        ck_fit(plain, CK_BATCH * CK_MORE, distributed=False)
        assert_state(plain_state(plain, plain.optimizer), want, f"{os.path.basename(path)} into plain Keras")


@pytest.mark.skipif(N == 1, reason="rank 0's shard is the whole state on one rank")
def test_tf_train_checkpoint_of_a_sharded_optimizer_raises(tmp_path_factory):
    """tf.train.Checkpoint would save rank 0's shard and restore it on every rank: refused on every rank."""
    strategy = UnisonStrategy(zero_stage=1)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH), epochs=1, verbose=0)
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("tfck")) if R == 0 else None)
    for make in (lambda: tf.train.Checkpoint(model=model), lambda: tf.train.Checkpoint(opt=model.optimizer)):
        with pytest.raises(ValueError, match="save_sharded"):
            make().save(os.path.join(folder, "ck"))
        with pytest.raises(ValueError, match="save_sharded"):
            tf.train.CheckpointManager(make(), folder, max_to_keep=1).save()
    plain = make_model()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    written = tf.train.Checkpoint(model=plain).write(os.path.join(folder, f"plain-{R}"))
    with pytest.raises(ValueError, match="save_sharded"):
        tf.train.Checkpoint(model=model).restore(written)
    assert not [n for n in os.listdir(folder) if n.startswith("ck")]  # nothing half-written


def test_checkpoint_bad_input_raises_on_every_rank(tmp_path_factory):
    model = make_model()
    path = os.path.join(ck_root(tmp_path_factory), f"weights-only-np{N}")
    save_sharded(path, model)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="renamed"), keras.layers.Dense(3)])
    with pytest.raises(ck.CheckpointError, match="no entries.*renamed"):
        load_sharded(path, other)
    with pytest.raises(ck.CheckpointError, match="holds no optimizer state"):
        load_sharded(path, make_model(), keras.optimizers.Adam())
    wrong = (f"rank {N - 1}: " if N > 1 else "") + "no checkpoint"  # one rank's path is wrong
    with pytest.raises(ck.CheckpointError, match=wrong):
        load_sharded(path + "-missing" if R == N - 1 else path, make_model())
    with pytest.raises(ck.CheckpointError, match="not built"):
        save_sharded(path, model, keras.optimizers.Adam())


def raising(error: Exception):
    def fail(*args, **kwargs):
        raise error
    return fail


def test_checkpoint_an_error_of_any_type_on_one_rank_raises_on_every_rank(tmp_path_factory, monkeypatch):
    """Before 2026-12-07 only a ValueError of a save's or load's checks was shared: a TypeError, KeyError or
    AttributeError there (a weight numpy cannot take, a layer renamed under the loader) raised on that rank
    alone while the others waited in the first collective for ever. Now every rank raises it, typed."""
    from unison.tf_backend import zero_checkpoint as zc

    hvd.init()  # (run alone, no earlier test initialized Unison)
    path = os.path.join(ck_root(tmp_path_factory), f"any-error-np{N}")
    keras.utils.set_random_seed(5)  # the same weights on every rank: rank 0 writes the replicated ones
    model, opt = make_model(), keras.optimizers.Adam(0.02)
    opt.build(model.trainable_variables)
    who, last = (f"rank {N - 1}: " if N > 1 else ""), R == N - 1
    with monkeypatch.context() as m:
        if last:
            m.setattr(zc, "_numpy", raising(TypeError("a weight numpy cannot take")))
        with pytest.raises(ck.CheckpointError, match=re.escape(f"{who}a weight numpy cannot take")):
            save_sharded(path, model, opt)
    assert not os.path.exists(path)
    save_sharded(path, model, opt)  # the ranks go on together
    fresh, fresh_opt = make_model(), keras.optimizers.Adam(0.02)
    steps = [("_keys", KeyError("hidden/kernel"), "KeyError: 'hidden/kernel'"),  # the first agreed step
             ("_optimizer_plan", AttributeError("no _momentums"), "AttributeError: no _momentums")]  # the second
    for name, error, message in steps:
        with monkeypatch.context() as m:
            if last:
                m.setattr(zc, name, raising(error))
            with pytest.raises(ck.CheckpointError, match=re.escape(f"{who}{message}")):
                load_sharded(path, fresh, fresh_opt)
    load_sharded(path, fresh, fresh_opt)
    for got, want in zip(fresh.weights, model.weights, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_each_shard_variable_is_one_bucket_segment():
    """Adam's slots are per bucket segment, never one flat shard per dtype ([Note: one shard
    variable per bucket]: one large shard variable made the np 2 step 0.65x stage 0)."""
    strategy = UnisonStrategy(zero_stage=1)
    with strategy.scope():
        model = make_model()
        opt = keras.optimizers.Adam()
        opt.build(model.trainable_variables)
    biggest = max(16, max(int(np.prod(v.shape)) for v in model.trainable_variables))
    slots = [int(np.prod(v.shape)) for v in opt.variables if len(v.shape)]
    assert slots and max(slots) <= -(-biggest // N), slots
    assert sum(slots) >= 2 * (-(-43 // N)), slots


def test_a_checkpoint_of_other_shapes_is_refused_on_every_rank(tmp_path_factory):
    """A (4, 6) kernel loaded into a (6, 4) one: the same element count, so a reshape took it in,
    scrambled, with no error (Keras's own set_weights refuses it)."""
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("shapes")) if R == 0 else None)
    saved = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="a")])
    save_sharded(os.path.join(folder, "ck"), saved)
    other = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, name="a")])
    with pytest.raises(ck.CheckpointError) as info:
        load_sharded(os.path.join(folder, "ck"), other)
    assert "'a/kernel' saved (4, 6), this model's (6, 4)" in str(info.value)
    assert len(set(WORLD.allgather(str(info.value)))) == 1


# ---------------------------------------------------------------- audit of 2026-12-05 (each failed or hung before)
def rank_rows(b: int) -> np.ndarray:
    return np.arange(b * GLOBAL_BATCH + R * 6, b * GLOBAL_BATCH + (R + 1) * 6)


@pytest.mark.parametrize("stage", [1, 2])
def test_distributed_optimizer_under_mixed_float16_skips_on_every_rank(stage):
    """Before: only zero_stage=0 agreed on the LossScaleOptimizer's skips; a rank that overflowed alone skipped
    alone and the others waited in the reduce-scatter (a hang)."""
    from keras.src.optimizers import loss_scale_optimizer as lso

    from unison.keras import optimizer as uko

    hooks, hooked = list(uko._LOSS_SCALE_AGREEMENTS), lso.LossScaleOptimizer.__init__
    uko._LOSS_SCALE_AGREEMENTS.clear()  # as in a fresh process that never wrapped at stage 0 (the hook idle)
    hvd.init()
    x = X.copy()
    x[GLOBAL_BATCH - 1] *= 1e6  # the last rank's rows of batch 0 overflow in float16
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(13)
        model = make_model()
        init = model.get_weights()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.02), zero_stage=stage),
                      loss="mse")
        rows = np.concatenate([rank_rows(b) for b in range(3)])
        model.fit(x[rows], Y[rows], batch_size=6, epochs=2, shuffle=False, verbose=0)
        ref = make_model()
        ref.set_weights(init)
        ref.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
        ref.fit(x, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
        uko._LOSS_SCALE_AGREEMENTS[:] = hooks
        lso.LossScaleOptimizer.__init__ = hooked
    assert model.optimizer.iterations.numpy() == ref.optimizer.iterations.numpy()
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("stage", [1, 2])
def test_broadcasting_the_optimizer_variables_leaves_each_ranks_shards(stage):
    """Horovod's recipe broadcasts optimizer.variables after the first step: the shards' slots have the same
    shapes on every rank, so before, every rank got rank 0's segment of Adam's moments (wrong steps after)."""
    hvd.init()
    keras.utils.set_random_seed(5)
    model = make_model()
    init = model.get_weights()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05), zero_stage=stage)
    for b in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(X[rank_rows(b)]) - Y[rank_rows(b)]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if b == 0:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
    assert_same_weights(model, reference(init, lambda: keras.optimizers.Adam(0.05), 1))
    # and through the callback, in fit
    keras.utils.set_random_seed(5)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.05), zero_stage=stage), loss="mse")
    rows = np.concatenate([rank_rows(b) for b in range(3)])
    model.fit(X[rows], Y[rows], batch_size=6, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_same_weights(model, reference(init, lambda: keras.optimizers.Adam(0.05), 2))


@pytest.mark.skipif(N == 1, reason="needs a rank without the gradient")
@pytest.mark.parametrize("stage", [1, 2])
def test_a_gradient_on_some_ranks_only_is_reduced_with_zeros(stage):
    """Before: the ranks without it raised alone and the others waited in the reduction."""
    def build():
        keras.utils.set_random_seed(8)
        inp = keras.Input((4,))
        h = keras.layers.Dense(5, name="hidden")(inp)
        return keras.Model(inp, [keras.layers.Dense(3, name="a")(h), keras.layers.Dense(3, name="b")(h)])

    def loss_of(model, x, y, uses_b):
        oa, ob = model(x)
        return tf.reduce_mean((oa - y) ** 2) + (tf.reduce_mean((ob - y) ** 2) if uses_b else 0.0)

    model, ref = build(), build()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), zero_stage=stage)
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.5)
    for b in range(2):
        with tf.GradientTape() as tape:
            loss = loss_of(model, X[rank_rows(b)], Y[rank_rows(b)], R == 0)  # only rank 0's data takes head b
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        with tf.GradientTape() as tape:  # one process: the average over the ranks' losses
            loss = sum(loss_of(ref, X[b * GLOBAL_BATCH + r * 6:b * GLOBAL_BATCH + (r + 1) * 6],
                               Y[b * GLOBAL_BATCH + r * 6:b * GLOBAL_BATCH + (r + 1) * 6], r == 0)
                       for r in range(N)) / N
        grads = tape.gradient(loss, ref.trainable_variables)
        ref_opt.apply_gradients(zip(grads, ref.trainable_variables, strict=True))
    assert_same_weights(model, ref)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_exclude_from_weight_decay_set_before_wrapping_is_kept(stage):
    """Keras's config leaves the exclusions out: before, wrapping dropped them and the biases were decayed."""
    hvd.init()
    keras.utils.set_random_seed(5)
    model = make_model()
    init = model.get_weights()
    inner = keras.optimizers.AdamW(0.02, weight_decay=0.2)
    inner.exclude_from_weight_decay(var_names=["bias"])
    model.compile(optimizer=hvd.DistributedOptimizer(inner, zero_stage=stage), loss="mse")
    rows = np.concatenate([rank_rows(b) for b in range(3)])
    model.fit(X[rows], Y[rows], batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert_same_weights(model, reference(init, lambda: keras.optimizers.AdamW(0.02, weight_decay=0.2), 2))


@pytest.mark.skipif(N == 1, reason="needs two ranks to disagree")
def test_models_that_differ_in_layer_names_only_are_told_so():
    if R == 0:
        keras.layers.Dense(1)  # one more unnamed layer on rank 0: its dense layers are numbered on from there
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(), zero_stage=1)
    with pytest.raises(ValueError, match="same variable shapes and dtypes but different variable names"):
        opt.build(model.trainable_variables)


@pytest.mark.skipif(N == 1, reason="needs two ranks to disagree")
def test_an_invalid_stage_on_one_rank_raises_on_every_rank():
    """Before: the rank with the bad value raised at once and the others waited in the agreement."""
    with pytest.raises(ValueError, match="PyTorch-only" if R == N - 1 else "same zero_stage"):
        UnisonStrategy(zero_stage=3 if R == N - 1 else 1)


def _saved_sharded_adam(tmp_path_factory, tag, leaf):
    """A zero_stage=1 strategy, its Adam model after one epoch, and the folder its sharded checkpoint went
    to (``<shared tmp>/<leaf>``)."""
    folder = WORLD.bcast(str(tmp_path_factory.mktemp(tag)) if R == 0 else None)
    strategy = UnisonStrategy(zero_stage=1)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH), epochs=1, verbose=0)
    save_sharded(os.path.join(folder, leaf), model, model.optimizer)
    return strategy, model, folder


def test_a_checkpoint_of_another_optimizer_class_is_refused_on_every_rank(tmp_path_factory):
    """Before 2026-12-05 entries matched by slot name only: Adam's first moment went into SGD's momentum
    and the saved learning rate replaced SGD's (0.1 became 0.01), with no error."""
    strategy, model, folder = _saved_sharded_adam(tmp_path_factory, "ckclass", "adam")
    with strategy.scope():
        other = make_model()
        other.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    with pytest.raises(ck.CheckpointError, match=r"state of a Adam optimizer; this one is a SGD") as info:
        load_sharded(os.path.join(folder, "adam"), other, other.optimizer)
    assert len(set(WORLD.allgather(str(info.value)))) == 1
    assert float(other.optimizer.learning_rate.numpy()) == pytest.approx(0.1)  # nothing was loaded
    plain = make_model()  # one process's optimizer (no strategy), and the loss-scale wrapper
    plain.compile(optimizer=ck_optimizer(), loss="mse")
    with pytest.raises(ck.CheckpointError, match=r"state of a Adam optimizer; this one is a LossScaleOptimizer"):
        load_sharded(os.path.join(folder, "adam"), plain, plain.optimizer)
    load_sharded(os.path.join(folder, "adam"), plain)  # the weights alone still load
    np.testing.assert_array_equal(plain.get_weights()[0], model.get_weights()[0])


@pytest.mark.skipif(N == 1, reason="needs a rank without the optimizer")
def test_a_checkpoint_load_with_the_optimizer_on_some_ranks_only_raises_on_every_rank(tmp_path_factory):
    """Before 2026-12-05 the ranks with an optimizer built it and agreed on its plan while the others went on
    to read the weights: the job hung. save_sharded already raised."""
    _, model, folder = _saved_sharded_adam(tmp_path_factory, "ckmissing", "ck")
    with pytest.raises(ck.CheckpointError, match=r"different optimizers \(rank 0: Adam, sharded; rank 1: None"):
        load_sharded(os.path.join(folder, "ck"), model, model.optimizer if R == 0 else None)
    plain = keras.optimizers.Adam(0.01)  # the same class, not sharded on the last rank
    with pytest.raises(ck.CheckpointError, match=f"rank {N - 1}: Adam, plain"):
        load_sharded(os.path.join(folder, "ck"), model, plain if R == N - 1 else model.optimizer)
    assert load_sharded(os.path.join(folder, "ck"), model, model.optimizer) == {}  # and then it loads
    # a plain optimizer on some ranks only: rank 0's None went into the manifest, the others' state into the
    # files, and the save reported success (found by an audit, 2026-12-07)
    one = make_model()
    one.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    one.optimizer.build(one.trainable_variables)
    with pytest.raises(ck.CheckpointError, match=r"save_sharded: the ranks passed different optimizers \(rank 0: "
                                                 r"None; rank 1: Adam, plain"):
        save_sharded(os.path.join(folder, "some"), one, None if R == 0 else one.optimizer)
    assert not os.path.exists(os.path.join(folder, "some", "manifest.json"))


EV = np.random.RandomState(4).randint(0, 3, size=(GLOBAL_BATCH * 3, 2)).astype("int32")  # rows repeat


def make_embedding_model() -> keras.Model:
    return keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(3, 2, name="emb"),
                             keras.layers.Flatten(), keras.layers.Dense(3, name="head")])


@pytest.mark.parametrize("stage", [1, 2])
def test_a_sparse_gradient_is_summed_densely_and_warned_about_once(stage, caplog):
    """[Note: sparse gradients at ZeRO stages 1/2]: an Embedding's rows are summed densely, exact for SGD
    (its update is linear in the gradient: the weights equal one process's) and logged once on rank 0 for
    Adam, whose sparse update in one process differs when rows repeat (before 2026-12-05: silently)."""
    def fit(make_opt):
        keras.utils.set_random_seed(9)
        with UnisonStrategy(zero_stage=stage).scope():
            model = make_embedding_model()
            model.compile(optimizer=make_opt(), loss="mse")
        init = model.get_weights()
        with caplog.at_level("WARNING", logger="unison.tf_backend.zero_optimizer"):
            caplog.clear()
            model.fit(tf.data.Dataset.from_tensor_slices((EV, Y)).batch(GLOBAL_BATCH), epochs=2, verbose=0)
        return model, init, [r.getMessage() for r in caplog.records if "IndexedSlices" in r.getMessage()]

    model, init, warned = fit(lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    assert warned == []
    ref = make_embedding_model()
    ref.set_weights(init)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    ref.fit(EV, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    assert_same_weights(model, ref)
    _, _, warned = fit(lambda: keras.optimizers.Adam(0.05))
    assert len(warned) == (1 if R == 0 else 0), warned
    assert all(f"zero_stage {stage}: Adam gets a sparse" in w for w in warned), warned


def make_float8_model() -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu", name="a"),
                              keras.layers.Dense(3, name="b")])
    model.quantize("float8")  # each Dense gets *_scale and *_amax_history: overwrite_with_gradient=True
    return model


FLOAT8_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    # decay and a clip that bites, and accumulation: Keras keeps the scales' running maximum meanwhile
    "adamw_clipped_accumulated": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.3, global_clipnorm=0.05,
                                                                gradient_accumulation_steps=2),
}


def float8_reference(init: list[np.ndarray], make_opt, rows: int, more: int = 0) -> keras.Model:
    """One process on the global batches: ``rows`` rows, then ``more`` rows again from the start."""
    ref = make_float8_model()
    ref.set_weights(init)
    ref.compile(optimizer=make_opt(), loss="mse")
    ref.fit(X[:rows], Y[:rows], batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    if more:
        ref.fit(X[:more], Y[:more], batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return ref


def overwritten(model: keras.Model) -> dict[str, np.ndarray]:
    return {v.path.split("/", 1)[1]: v.numpy() for v in model.trainable_weights if v.overwrite_with_gradient}


def assert_float8_weights(model: keras.Model, ref: keras.Model) -> None:
    """Every rank's weights alike, and one process's as closely as float8 allows: Keras's float8 Dense rounds
    its bias gradient to bfloat16 (8 bits), each rank its share's sum where one process rounds the global
    sum, so a step differs by up to ~2e-3 of itself (measured here: 6.5e-5 in a bias after 6 Adam steps of
    0.01, the same at zero_stage=0; before the fix the kernels were 1.5e-2 off and the scales 0.95)."""
    names = [v.path.split("/", 1)[1] for v in ref.weights]
    for name, w, v in zip(names, model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-3, atol=5e-4, err_msg=name)
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    assert all(np.array_equal(flat, other) for other in WORLD.allgather(flat))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("kind", sorted(FLOAT8_OPTIMIZERS))
def test_float8_scales_are_overwritten_with_the_global_batchs_as_in_one_process(stage, kind):
    """[Note: overwritten variables at ZeRO stages 1/2]: before 2026-12-07 the float8 scales and amax
    histories were laid into the shards and stepped by Adam like weights (a scale of 0.956 where one process
    had 0.0065) and the kernels drifted (1.5e-2 after 6 steps)."""
    strategy = UnisonStrategy(zero_stage=stage)
    keras.utils.set_random_seed(7 + R)
    with strategy.scope():
        model = make_float8_model()
        model.compile(optimizer=FLOAT8_OPTIMIZERS[kind](), loss="mse")
    init = model.get_weights()
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH), epochs=2, verbose=0)
    ref = float8_reference(init, FLOAT8_OPTIMIZERS[kind], len(X), len(X))
    assert all(np.all(w != 1.0) for k, w in overwritten(ref).items() if k.endswith("_scale"))  # they moved
    assert_float8_weights(model, ref)


def test_float8_scale_accumulators_save_and_resume_as_one_process(tmp_path_factory):
    """The scales' running maxima (gradient accumulation) are saved whole under the names a plain Keras
    optimizer's have, and a resumed sharded run continues as one process does."""
    make_opt = FLOAT8_OPTIMIZERS["adamw_clipped_accumulated"]
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("float8")) if R == 0 else None)
    strategy = UnisonStrategy(zero_stage=2)
    keras.utils.set_random_seed(11)
    with strategy.scope():
        model = make_float8_model()
        model.compile(optimizer=make_opt(), loss="mse")
    init = model.get_weights()
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH), epochs=1, verbose=0)  # 3 steps
    save_sharded(os.path.join(folder, "zero"), model, model.optimizer)
    ref = float8_reference(init, make_opt, len(X))
    save_sharded(os.path.join(folder, "plain"), ref, ref.optimizer)
    got, want = saved_state(os.path.join(folder, "zero")), saved_state(os.path.join(folder, "plain"))
    assert sorted(got) == sorted(want)
    acc = [k for k in want if k.endswith("_scale.gradient_accumulator")]
    assert acc and all(np.any(want[k] != 0) for k in acc)  # the odd step's maxima, pending
    for key in want:  # gradients and moments: a bias's is rounded to bfloat16 (see assert_float8_weights)
        np.testing.assert_allclose(got[key], want[key], rtol=1e-2, atol=5e-4, err_msg=key)
    with strategy.scope():
        resumed = make_float8_model()
        resumed.compile(optimizer=make_opt(), loss="mse")
    load_sharded(os.path.join(folder, "zero"), resumed, resumed.optimizer)
    resumed.fit(tf.data.Dataset.from_tensor_slices((X, Y)).take(GLOBAL_BATCH).batch(GLOBAL_BATCH), verbose=0)
    assert_float8_weights(resumed, float8_reference(init, make_opt, len(X), GLOBAL_BATCH))


def test_nadam_resumes_in_a_process_that_numbered_its_unnamed_variables_otherwise(tmp_path_factory, monkeypatch):
    """[Note: unnamed optimizer variables]: Nadam's ``_u_product`` has no name, so Keras numbers it per
    process (``variable``, ``variable_1``, ...); before 2026-12-07 it was saved as ``optim.<that name>`` and a
    process that had made one more unnamed variable refused the resume on every rank. Checkpoints keyed the
    old way still load."""
    from unison.tf_backend import zero_checkpoint

    folder = WORLD.bcast(str(tmp_path_factory.mktemp("nadam")) if R == 0 else None)
    make_opt = MORE_OPTIMIZERS["nadam"]
    keras.utils.set_random_seed(13)
    with UnisonStrategy(zero_stage=2).scope():
        model = make_model()
        model.compile(optimizer=make_opt(), loss="mse")
    init = model.get_weights()
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH), epochs=1, verbose=0)
    save_sharded(os.path.join(folder, "new"), model, model.optimizer)
    with monkeypatch.context() as m:  # the keys of a checkpoint saved before 2026-12-07
        m.setattr(zero_checkpoint, "_other_entries", lambda inner, others: {f"optim.{v.name}": v for v in others},
                  raising=False)
        save_sharded(os.path.join(folder, "old"), model, model.optimizer)
    old = ck.read_manifest(os.path.join(folder, "old")).entries
    assert any(re.fullmatch(r"optim\.variable(_\d+)?", k) for k in old), sorted(old)
    ref = reference(init, make_opt, 1)
    ref.fit(X[:GLOBAL_BATCH], Y[:GLOBAL_BATCH], batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    for leaf in ("new", "old"):
        keras.Variable(0.0)  # an unnamed variable of the user's: the next one Keras names is another
        with UnisonStrategy(zero_stage=2).scope():
            resumed = make_model()
            resumed.compile(optimizer=make_opt(), loss="mse")
        load_sharded(os.path.join(folder, leaf), resumed, resumed.optimizer)
        assert resumed.optimizer._u_product.numpy() == pytest.approx(model.optimizer._u_product.numpy())
        resumed.fit(tf.data.Dataset.from_tensor_slices((X, Y)).take(GLOBAL_BATCH).batch(GLOBAL_BATCH), verbose=0)
        assert_same_weights(resumed, ref)
    assert "optim.u_product" in ck.read_manifest(os.path.join(folder, "new")).entries
