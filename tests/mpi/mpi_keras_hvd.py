"""Horovod-style Keras API (no strategy): DistributedOptimizer with plain fit, and the callbacks."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import unison.tf_backend.keras as hvd  # noqa: E402

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
B = 6  # per-rank batch
rs = np.random.RandomState(1)
X = rs.randn(B * N * 4, 3).astype("float32")
Y = (X @ np.array([[0.5], [-1.0], [2.0]], "float32")).astype("float32")


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    yield


def shard(a: np.ndarray) -> np.ndarray:
    """This rank's rows of every global batch of B * N rows."""
    g = a.reshape(-1, N, B, *a.shape[1:])
    return g[:, R].reshape(-1, *a.shape[1:])


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def test_distributed_optimizer_plain_fit_matches_one_process():
    model = make_model(10 + R)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.02)), loss="mse")
    init = None

    class Grab(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            nonlocal init
            init = [w.copy() for w in self.model.get_weights()]

    model.fit(shard(X), shard(Y), batch_size=B, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Grab()])
    ref = make_model(0)
    ref.set_weights(init)  # rank 0's initial weights, as broadcast
    ref.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    ref.fit(X, Y, batch_size=B * N, epochs=2, shuffle=False, verbose=0)
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    assert all(np.array_equal(flat, f) for f in WORLD.allgather(flat))
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(model.optimizer)


def test_metric_average_and_learning_rate_callbacks():
    model = make_model(3)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    lrs, losses = [], []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            lrs.append(float(self.model.optimizer.learning_rate.numpy()))

        def on_epoch_end(self, epoch, logs=None):
            losses.append(logs["loss"])

    steps = len(shard(X)) // B
    model.fit(shard(X) * (R + 1), shard(Y), batch_size=B, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2, steps_per_epoch=steps),
                         hvd.callbacks.MetricAverageCallback(), Record()])
    def horovod_warmup(epoch: float) -> float:  # Horovod 0.28's rate at a fractional epoch
        epoch += 1.0 / steps
        return 0.1 * (epoch * (N - 1) / 2 + 1) / N

    want = [horovod_warmup(e + b / steps) for e in range(2) for b in range(steps)]
    np.testing.assert_allclose(lrs[:2 * steps], want, rtol=1e-6)
    assert lrs[2 * steps - 1] == pytest.approx(0.1)  # the warmup ends on initial_lr
    assert lrs[2 * steps:] == pytest.approx([0.1] * steps)  # and leaves it there
    everyone = WORLD.allgather(losses)
    assert all(np.allclose(e, everyone[0]) for e in everyone)  # averaged: the same on every rank

    for multiplier in (lambda epoch: 0.1 ** epoch, 0.1):  # a number m is m ** epoch, as Horovod's
        model.optimizer.learning_rate.assign(1.0)
        seen, logged = [], []

        class Lr(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None, seen=seen):
                if batch == 0:
                    seen.append(float(self.model.optimizer.learning_rate.numpy()))

            def on_epoch_end(self, epoch, logs=None, logged=logged):
                logged.append(logs["lr"])

        sched = hvd.callbacks.LearningRateScheduleCallback(0.5, multiplier=multiplier)
        model.fit(shard(X), shard(Y), batch_size=B, epochs=3, verbose=0, callbacks=[sched, Lr()])
        assert seen == pytest.approx([0.5, 0.05, 0.005]) and logged == pytest.approx(seen)

    model.optimizer.learning_rate.assign(1.0)  # no steps_per_epoch: read from fit, still ends on initial_lr
    warm, lrs = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1), []
    model.fit(shard(X), shard(Y), batch_size=B, epochs=1, verbose=0, callbacks=[warm, Record()])
    assert lrs[-1] == pytest.approx(0.1) and lrs[0] == pytest.approx(0.1 * ((N - 1) / steps + 1) / N)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_distributed_optimizer_gradient_none_on_some_ranks(graph):
    """Issue 10 item 3: rank r has a gradient for ``a`` (even r) or ``b`` (odd r), none for ``c``."""
    import tensorflow as tf

    a, b = keras.Variable(np.zeros((3, 2), "float32")), keras.Variable(np.zeros((3, 2), "float32"))
    c = keras.Variable(np.zeros((2,), "float32"))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt.build([a, b, c])
    mine = tf.fill((3, 2), float(R + 1))
    grads = [mine if R % 2 == 0 else None, mine if R % 2 == 1 else None, None]

    def apply():
        opt.apply(grads, [a, b, c])

    (tf.function(apply) if graph else apply)()
    want_a = -sum(r + 1 for r in range(N) if r % 2 == 0) / N
    want_b = -sum(r + 1 for r in range(N) if r % 2 == 1) / N
    np.testing.assert_allclose(a.numpy(), np.full((3, 2), want_a), rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), np.full((3, 2), want_b), rtol=1e-6)
    np.testing.assert_array_equal(c.numpy(), np.zeros(2))


def test_default_jit_compile_trains_and_explicit_xla_is_refused_clearly():
    """Keras's default jit_compile="auto" is False on CPU, so fit runs our host collectives;
    jit_compile=True cannot compile them: a ValueError naming the fix, on every rank (no opaque graph error)."""
    model = make_model(3)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    assert model.jit_compile is False
    model.fit(shard(X), shard(Y), batch_size=B, epochs=1, verbose=0, shuffle=False,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    weights = WORLD.allgather(model.get_weights()[0])
    assert all(np.array_equal(w, weights[0]) for w in weights)
    xla = make_model(3)
    xla.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse", jit_compile=True)
    with pytest.raises(ValueError, match="XLA-compiled function .*jit_compile=False"):
        xla.fit(shard(X), shard(Y), batch_size=B, epochs=1, verbose=0, shuffle=False)


def test_mixed_precision_loss_scale_skips_are_agreed_by_every_rank():
    """compile wraps a DistributedOptimizer in a LossScaleOptimizer under mixed_float16; a batch that
    overflows on one rank only must make every rank skip that step (the rank skipped alone, and the
    others then waited in an all-reduce it never joined)."""
    if N == 1:
        pytest.skip("needs a rank whose batch overflows alone")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        rs = np.random.RandomState(0)
        x = 1e-3 * rs.randn(32, 4).astype("float32")
        y = x.sum(1, keepdims=True).astype("float32")
        if R == N - 1:
            x[:8] *= 3e7  # this rank's first batch overflows in float16 once the loss is scaled
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        scales = WORLD.allgather(float(model.optimizer.dynamic_scale.numpy()))
        steps = WORLD.allgather(int(model.optimizer.inner_optimizer.iterations.numpy()))
        assert len(set(scales)) == 1 and scales[0] < 32768.0  # every rank halved its scale once
        assert steps == [3] * N  # and every rank skipped the same step
        weights = np.concatenate([w.ravel() for w in model.get_weights()])
        assert all(np.array_equal(weights, w) for w in WORLD.allgather(weights))
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ---------------------------------------------------------------------------------------------- audit 2026-12-05
@pytest.mark.parametrize("op", ["Adasum", "Min", "Max", "Product"])
def test_distributed_optimizer_takes_only_average_and_sum_as_horovod(op):
    """Horovod's Keras DistributedOptimizer: ValueError('op currently only supports Average and Sum'). Before,
    these were taken: Adasum with backward_passes_per_step=2 applied the sum of per-step Adasums."""
    for options in ({}, {"backward_passes_per_step": 2}, {"average_aggregated_gradients": True}):
        with pytest.raises(ValueError, match="op currently only supports Average and Sum"):
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=getattr(hvd, op), **options)
        with pytest.raises(ValueError, match="op currently only supports Average and Sum"):
            hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), op=getattr(hvd, op), **options)
    for fine in (hvd.Average, hvd.Sum):
        assert isinstance(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=fine), keras.optimizers.SGD)


def test_metric_average_refuses_ranks_with_different_metric_names():
    """Before: the values were averaged by position, so rank 0's 'mae' and rank 1's 'mse' (as many metrics)
    were averaged together silently. Now every rank raises, naming each rank's metrics."""
    model = make_model(5)
    metric = "mae" if R == 0 else "mse"
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse", metrics=[metric])
    logged = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logged.append(dict(logs))

    callbacks = [hvd.callbacks.MetricAverageCallback(), Record()]
    if N == 1:  # one rank: nothing to disagree with; its own numbers
        model.fit(shard(X), shard(Y), batch_size=B, epochs=1, verbose=0, callbacks=callbacks)
        assert set(logged[0]) == {"loss", "mae"}
        return
    with pytest.raises(ValueError, match=r"rank 0: \['loss', 'mae'\]; rank 1: \['loss', 'mse'\]"):
        model.fit(shard(X), shard(Y), batch_size=B, epochs=1, verbose=0, callbacks=callbacks)
    assert logged == []


# ---------------------------------------------------------------------------------------------- audit 2026-12-07
def _module(which: str):
    import unison.keras as uk

    return hvd if which == "tf" else uk


def shared_dir() -> str:
    return WORLD.bcast(tempfile.mkdtemp(prefix="unison-hvd-") if R == 0 else None, root=0)


def test_a_backup_whose_tidy_up_fails_is_kept_and_training_goes_on(caplog):
    """Removing older backup files is tidying up after the manifest named the new one: before 2026-12-07 an
    error there other than a missing file (a directory where a stale weights file was expected) stopped every
    rank with "could not save the backup", although the backup had been saved. Now it is logged."""
    folder = shared_dir()
    blocked, stale = (os.path.join(folder, f"backup-e0-b0-{n}.weights.h5") for n in ("blocked", "stale"))
    if R == 0:
        os.makedirs(blocked)  # os.remove refuses a directory
        open(stale, "wb").close()
    WORLD.Barrier()
    model = make_model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    with caplog.at_level(logging.WARNING, logger="unison"):
        model.fit(shard(X), shard(Y), batch_size=B, epochs=2, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BackupAndRestore(folder, delete_checkpoint=False)])
    with open(os.path.join(folder, "unison-backup.json"), encoding="utf-8") as f:
        current = json.load(f)["current"]
    assert current["epoch"] == 2  # (epochs done)
    saved = make_model(1)
    saved.load_weights(os.path.join(folder, current["weights"]))
    for w, v in zip(saved.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(w, v)
    assert os.path.isdir(blocked) and not os.path.exists(stale)  # the other stale file went
    if R == 0:
        assert "is saved, but removing older backup files failed (IsADirectoryError" in caplog.text, caplog.text
    WORLD.Barrier()
    if R == 0:
        shutil.rmtree(folder)


@pytest.mark.parametrize("staircase", [True, False], ids=["staircase", "smooth"])
@pytest.mark.parametrize("which", ["tf", "uk"])
def test_a_number_multiplier_decays_from_start_epoch_as_horovod(which, staircase):
    """Horovod (since 0.23) decays a number multiplier m as m ** (epoch - start_epoch): the schedule starts at
    initial_lr. Before 2026-12-07 m ** epoch: with start_epoch=2 it started at initial_lr * m ** 2."""
    mod = _module(which)
    lr0, m, start, end, epochs = 0.1, 0.5, 2, 4, 5
    steps = len(shard(X)) // B
    model = make_model(3)
    model.compile(optimizer=mod.DistributedOptimizer(keras.optimizers.SGD(0.3)), loss="mse")
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    sched = mod.callbacks.LearningRateScheduleCallback(lr0, m, start_epoch=start, end_epoch=end,
                                                       staircase=staircase)
    model.fit(shard(X), shard(Y), batch_size=B, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[sched, Record()])
    want, lr = [], 0.3  # before start_epoch the optimizer's own rate; after end_epoch the last one set
    for e in range(epochs):
        for b in range(steps):
            if start <= e < end:
                lr = lr0 * m ** (e - start + (0 if staircase else b / steps))
            want.append(lr)
    np.testing.assert_allclose(seen, want, rtol=1e-6)
    assert seen[start * steps] == pytest.approx(lr0)  # the schedule starts at initial_lr


def _restored_everywhere(which: str, how: str, path: str) -> keras.Model:
    """Horovod's resume: rank 0 alone restores ``path`` (its weights and Adam state), the others build anew."""
    mod = _module(which)
    if how == "load_model" and R == 0:
        return mod.load_model(path)
    model = make_model(20 + R)
    model.compile(optimizer=mod.DistributedOptimizer(keras.optimizers.Adam(0.05)), loss="mse")
    if how == "assigned":
        model.optimizer.build(model.trainable_variables)
        if R == 0:
            saved = keras.models.load_model(path)
            model.set_weights(saved.get_weights())
            for mine, theirs in zip(model.optimizer.variables, saved.optimizer.variables, strict=True):
                mine.assign(keras.ops.convert_to_numpy(theirs))
    return model


@pytest.mark.parametrize("how", ["assigned", "load_model"])
@pytest.mark.parametrize("which", ["tf", "uk"])
def test_ranks_resumed_from_rank_0s_checkpoint_train_as_one_process_from_it(which, how):
    """Rank 0 alone restores weights and Adam state; BroadcastGlobalVariablesCallback must leave every rank
    where one process resuming from that checkpoint goes. Before 2026-12-07: unison.tf_backend.keras's callback
    sent the model at once and the optimizer after the first step, which ran rank 0's moments against fresh ones
    elsewhere (weights 0.07 apart); with hvd.load_model on rank 0 alone its optimizer's build waited for the
    others (StallError after 60 s), and unison.keras's callback sent the optimizer from rank 0 only
    (MismatchError)."""
    path = os.path.join(shared_dir(), "resume.keras")
    if R == 0:
        trained = make_model(0)
        trained.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        trained.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        trained.save(path)
    WORLD.Barrier()
    model = _restored_everywhere(which, how, path)
    model.fit(shard(X), shard(Y), batch_size=B, epochs=2, shuffle=False, verbose=0,
              callbacks=[_module(which).callbacks.BroadcastGlobalVariablesCallback(0)])
    ref = keras.models.load_model(path)  # one process goes on from the checkpoint over the global batches
    ref.fit(X, Y, batch_size=B * N, epochs=2, shuffle=False, verbose=0)
    WORLD.Barrier()
    if R == 0:
        shutil.rmtree(os.path.dirname(path))
    for w, v in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    state = np.concatenate([np.ravel(keras.ops.convert_to_numpy(v)) for v in model.optimizer.variables])
    assert all(np.array_equal(state, s) for s in WORLD.allgather(state))
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == int(
        keras.ops.convert_to_numpy(ref.optimizer.iterations))


def _custom_loss(y_true, y_pred):
    return keras.ops.mean(keras.ops.abs(y_true - y_pred) ** 1.5)


@pytest.mark.parametrize("which", ["tf", "uk"])
def test_load_model_finds_a_custom_loss_in_custom_objects(which, tmp_path_factory):
    """Horovod passes custom_objects to the loader; the model is compiled again from its compile config, which
    names the loss. Before 2026-12-07 that config was read without them: TypeError "Could not locate function
    '_custom_loss'" where keras.models.load_model loaded the model."""
    model = make_model(4)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=_custom_loss)
    model.fit(X[:12], Y[:12], batch_size=6, epochs=1, verbose=0)
    path = str(tmp_path_factory.mktemp("custom") / f"m{R}.keras")
    model.save(path)
    loaded = _module(which).load_model(path, custom_objects={"_custom_loss": _custom_loss})
    assert loaded.loss is _custom_loss and getattr(loaded.optimizer, "_unison_distributed", False)
    assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)) == 2
    want = float(keras.ops.convert_to_numpy(_custom_loss(Y[:12], model.predict(X[:12], verbose=0))))
    assert loaded.evaluate(X[:12], Y[:12], verbose=0) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("which", ["tf", "uk"])
def test_schedule_and_warmup_refuse_bad_arguments_at_construction(which):
    """Before 2026-12-07 unison.tf_backend.keras took warmup_epochs 0 or -1 (no warmup, silently), a multiplier
    None or "0.5" (failing at the first batch), end_epoch before start_epoch (nothing done) and a negative
    steps_per_epoch (the rate rose)."""
    cb = _module(which).callbacks
    for kwargs, named in (({"warmup_epochs": -1}, "warmup_epochs=-1"), ({"warmup_epochs": 0}, "warmup_epochs=0"),
                          ({"warmup_epochs": "2"}, "warmup_epochs='2'"),
                          ({"steps_per_epoch": -2}, "steps_per_epoch=-2")):
        with pytest.raises(ValueError, match=f"LearningRateWarmupCallback\\({named}\\)"):
            cb.LearningRateWarmupCallback(0.1, **kwargs)
    for kwargs, named in (({"multiplier": None}, "multiplier=None"), ({"multiplier": "0.5"}, "multiplier='0.5'"),
                          ({"multiplier": 0.5, "start_epoch": 3, "end_epoch": 1}, "start_epoch=3, end_epoch=1"),
                          ({"multiplier": 0.5, "staircase": False, "steps_per_epoch": -2}, "steps_per_epoch=-2"),
                          ({"multiplier": 0.5, "steps_per_epoch": 1.5}, "steps_per_epoch=1.5")):
        with pytest.raises(ValueError, match=f"LearningRateScheduleCallback\\({named}\\)"):
            cb.LearningRateScheduleCallback(0.1, **kwargs)
    # what stays accepted: a function or a number, an empty range, steps from fit
    cb.LearningRateScheduleCallback(0.1, lambda e: 1.0, start_epoch=1, end_epoch=1)
    cb.LearningRateScheduleCallback(0.1, np.float32(0.5), steps_per_epoch=np.int64(3))
    cb.LearningRateWarmupCallback(0.1, warmup_epochs=2.5, steps_per_epoch=None)


@pytest.mark.parametrize("which", ["tf", "uk"])
def test_warmup_logs_the_rate_at_each_epoch_end_as_horovod(which):
    """Horovod's warmup (a schedule callback) logs logs['lr']; unison.keras's did not before 2026-12-07."""
    mod = _module(which)
    model = make_model(3)
    model.compile(optimizer=mod.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    history = model.fit(shard(X), shard(Y), batch_size=B, epochs=3, shuffle=False, verbose=0,
                        callbacks=[mod.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2)])
    # each epoch's last batch runs at the fractional epoch e + 1: Horovod's rate there
    want = [0.1 * ((e + 1) * (N - 1) / 2 + 1) / N if e < 2 else 0.1 for e in range(3)]
    np.testing.assert_allclose(history.history["lr"], want, rtol=1e-6)
