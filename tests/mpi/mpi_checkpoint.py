"""Checkpoints under mpirun: BackupAndRestore's manifest and agreement, per-rank tf.train.Checkpoint."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

from unison.common.exceptions import UnisonError  # noqa: E402
from unison.tf_backend import UnisonStrategy  # noqa: E402
from unison.tf_backend.keras import callbacks  # noqa: E402

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
GLOBAL_BATCH = 4 * N
EPOCHS = 4
rs = np.random.RandomState(0)
X = rs.randn(GLOBAL_BATCH * 3, 4).astype("float32")
Y = (X[:, 1:] @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.1).astype("float32")


@pytest.fixture(scope="module")
def strategy():
    return UnisonStrategy()


@pytest.fixture
def shared(tmp_path_factory):
    """A folder every rank reads (one machine: rank 0's temporary folder)."""
    return WORLD.bcast(str(tmp_path_factory.mktemp("shared")) if R == 0 else None)


def data() -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)


def fresh(strategy) -> keras.Model:
    keras.utils.set_random_seed(5 + R)  # ranks differ: the strategy broadcasts rank 0's values
    with strategy.scope():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return m


def same_everywhere(weights: list[np.ndarray]) -> bool:
    flat = np.concatenate([w.ravel() for w in weights])
    return all(np.array_equal(flat, other) for other in WORLD.allgather(flat))


def assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for w, v in zip(got, want, strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)


class Record(keras.callbacks.Callback):
    """Weights after each epoch, and the epochs run and the weights they start from."""

    def __init__(self):
        super().__init__()
        self.after, self.epochs, self.start = {}, [], None

    def on_epoch_begin(self, epoch, logs=None):
        if not self.epochs:
            self.start = self.model.get_weights()
        self.epochs.append(epoch)

    def on_epoch_end(self, epoch, logs=None):
        self.after[epoch] = self.model.get_weights()


class Interrupt(keras.callbacks.Callback):
    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError("simulated crash")


@pytest.fixture(scope="module")
def straight(strategy):
    """The uninterrupted run: weights after each epoch."""
    rec = Record()
    fresh(strategy).fit(data(), epochs=EPOCHS, verbose=0, callbacks=[rec])
    return rec.after


def interrupted_backup(strategy, folder, at=1, **kwargs):
    """Fit until the end of epoch ``at`` (backed up), then crash."""
    with pytest.raises(RuntimeError, match="simulated crash"):
        fresh(strategy).fit(data(), epochs=EPOCHS, verbose=0,
                            callbacks=[callbacks.BackupAndRestore(folder, **kwargs), Interrupt(at)])


def test_crash_between_weights_and_manifest_resumes_old_weights_at_old_epoch(strategy, shared, straight,
                                                                             monkeypatch):
    real, markers = callbacks.atomic_path, []

    @contextlib.contextmanager
    def crash_before_second_marker(path):
        if not os.fspath(path).endswith(".weights.h5"):  # the epoch marker / manifest
            markers.append(path)
            if len(markers) == 2:  # epoch 1's: its weights are already written
                raise OSError("simulated crash before the marker")
        with real(path) as tmp:
            yield tmp

    monkeypatch.setattr(callbacks, "atomic_path", crash_before_second_marker)
    with pytest.raises(Exception, match="simulated crash before the marker") as info:
        fresh(strategy).fit(data(), epochs=EPOCHS, verbose=0, callbacks=[callbacks.BackupAndRestore(shared)])
    monkeypatch.undo()
    rec = Record()
    resumed = fresh(strategy)
    resumed.fit(data(), epochs=EPOCHS, verbose=0,
                callbacks=[callbacks.BackupAndRestore(shared, delete_checkpoint=False), rec])
    assert rec.epochs == [1, 2, 3]  # the old epoch (epoch 0's backup) ...
    assert_close(rec.start, straight[0])  # ... with the old weights
    assert_close(resumed.get_weights(), straight[EPOCHS - 1])
    assert same_everywhere(resumed.get_weights())
    # rank 0's failure reached every rank as one error naming the folder and the reason
    assert isinstance(info.value, UnisonError), repr(info.value)
    message = str(info.value)
    assert "rank 0 could not save the backup of epoch 2" in message and repr(shared) in message
    assert all(m == message for m in WORLD.allgather(message))
    WORLD.Barrier()
    # only the manifest and the weights it names are left (the cut-short save's weights are gone)
    names = sorted(os.listdir(shared))
    assert len(names) == 2 and names[1] == "unison-backup.json", names
    assert names[0].startswith(f"backup-e{EPOCHS}-") and names[0].endswith(".weights.h5"), names


def test_rank0_save_failure_raises_the_same_error_on_every_rank(strategy, shared):
    blocker = os.path.join(shared, "a-file")
    if R == 0:
        with open(blocker, "w") as f:
            f.write("not a folder")
    WORLD.Barrier()
    folder = os.path.join(blocker, "backup") if R == 0 else os.path.join(shared, "backup")  # rank 0's fails
    with pytest.raises(UnisonError, match="rank 0 could not save the backup of epoch 1") as info:
        fresh(strategy).fit(data(), epochs=2, verbose=0, callbacks=[callbacks.BackupAndRestore(folder)])
    message = str(info.value)
    assert repr(os.path.join(blocker, "backup")) in message and "NotADirectoryError" in message
    assert all(m == message for m in WORLD.allgather(message))


def test_per_rank_folders_raise_on_every_rank(strategy, tmp_path):
    folder = str(tmp_path / f"backup-rank{R}")  # not shared: each rank its own
    cb = callbacks.BackupAndRestore(folder)
    if N == 1:
        fresh(strategy).fit(data(), epochs=1, verbose=0, callbacks=[cb])
        return
    with pytest.raises(UnisonError, match="cannot see the backup rank 0 just wrote") as info:
        fresh(strategy).fit(data(), epochs=2, verbose=0, callbacks=[cb])
    blind = list(range(1, N))
    assert (f"rank {blind[0]}" if N == 2 else f"ranks {blind}") in str(info.value)
    assert "folder every rank can read" in str(info.value)
    assert len(set(WORLD.allgather(str(info.value)))) == 1


def test_ranks_that_find_different_backups_raise_on_every_rank(strategy, shared, tmp_path):
    interrupted_backup(strategy, shared)
    folder = shared if R == 0 else str(tmp_path / "empty")  # the others look elsewhere
    with contextlib.ExitStack() as stack:
        if N > 1:
            info = stack.enter_context(pytest.raises(UnisonError, match="found different backups"))
        fresh(strategy).fit(data(), epochs=EPOCHS, verbose=0, callbacks=[callbacks.BackupAndRestore(folder)])
    if N > 1:
        message = str(info.value)
        assert "rank 0 sees the backup of epoch 2" in message and "no backup" in message
        assert "shared filesystem" in message


def test_double_checkpoint_restores_the_previous_backup_when_the_current_fails(strategy, shared, straight):
    interrupted_backup(strategy, shared, at=2, double_checkpoint=True)
    import json

    with open(os.path.join(shared, "unison-backup.json")) as f:
        manifest = json.load(f)
    assert [manifest["current"]["epoch"], manifest["previous"]["epoch"]] == [3, 2]
    if R == 0:  # damage the current weights, keeping their size
        path = os.path.join(shared, manifest["current"]["weights"])
        size = os.path.getsize(path)
        with open(path, "wb") as f:
            f.write(b"\0" * size)
    WORLD.Barrier()
    with pytest.raises(UnisonError, match="cannot resume from the backup") as info:
        fresh(strategy).fit(data(), epochs=EPOCHS, verbose=0, callbacks=[callbacks.BackupAndRestore(shared)])
    assert "rank 0 could not load" in str(info.value) and "double_checkpoint=True" in str(info.value)
    rec = Record()
    resumed = fresh(strategy)
    resumed.fit(data(), epochs=EPOCHS, verbose=0,
                callbacks=[callbacks.BackupAndRestore(shared, double_checkpoint=True), rec])
    assert rec.epochs == [2, 3]
    assert_close(rec.start, straight[1])
    assert_close(resumed.get_weights(), straight[EPOCHS - 1])
    assert same_everywhere(resumed.get_weights())
    WORLD.Barrier()
    assert not os.path.exists(shared)  # deleted at the end, as Keras does


def test_per_rank_checkpoint_outside_the_strategy_writes_on_every_rank(strategy, shared):
    step = tf.Variable(10 + R)  # per-rank state, made outside strategy.scope()
    mine = tf.train.Checkpoint(step=step)
    path = mine.write(os.path.join(shared, f"rank{R}", "state"))
    manager = tf.train.CheckpointManager(mine, os.path.join(shared, f"managed{R}"), max_to_keep=1)
    managed = manager.save()
    WORLD.Barrier()
    assert os.path.exists(path + ".index") and os.path.exists(managed + ".index")
    step.assign(0)
    mine.read(path).expect_partial()  # written before the manager added save_counter
    assert int(step.numpy()) == 10 + R
    with strategy.scope():
        replicated = tf.Variable(1.0)  # made under the strategy: the same on every rank
    shared_ckpt = tf.train.Checkpoint(v=replicated)
    assert shared_ckpt.write(os.path.join(shared, f"replicated{R}")) == os.path.join(shared, f"replicated{R}")
    WORLD.Barrier()
    written = sorted(n for n in os.listdir(shared) if n.startswith("replicated"))
    assert written == ["replicated0.data-00000-of-00001", "replicated0.index"]


def test_backup_without_a_strategy_resumes_every_rank_alike(shared):
    """The Horovod-style path: a plain model (rank 0's weights broadcast), no strategy."""
    import unison.tf_backend.keras as hvd

    def plain():
        keras.utils.set_random_seed(11 + R)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
        hvd.broadcast_variables(m.variables, root_rank=0)
        return m

    with pytest.raises(RuntimeError, match="simulated crash"):
        plain().fit(X, Y, batch_size=4, epochs=3, verbose=0, shuffle=False,
                    callbacks=[callbacks.BackupAndRestore(shared), Interrupt(0)])
    rec = Record()
    plain().fit(X, Y, batch_size=4, epochs=3, verbose=0, shuffle=False,
                callbacks=[callbacks.BackupAndRestore(shared), rec])
    assert rec.epochs == [1, 2]
    assert same_everywhere(rec.start)
