"""unison.tf_backend.ShardedEmbedding under ``unison.keras.DataParallel`` (TensorFlow backend), under mpirun.

Launched by tests/test_tf_embedding_mpi.py at 2 and 3 ranks (its own processes: DataParallel and
UnisonStrategy are not mixed in one). DataParallel weighs each rank's gradient by its rows, so a last
global batch that splits unevenly still gives one process's update; the table's pushes are weighed the
same way ([Note: the table weighs ranks by their rows] in unison/tf_backend/embedding.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import unison.keras as uk  # noqa: E402
import unison.ps as ps  # noqa: E402
from unison.tf_backend import ShardedEmbedding  # noqa: E402

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()
ROWS, DIM, SEQ, LR = 30, 4, 3, 0.2


def init_rows(keys: np.ndarray) -> np.ndarray:
    keys = np.asarray(keys)
    return (np.sin(keys[:, None] * 0.37 + np.arange(DIM)[None, :]) * 0.5).astype("float32")


def make_model(embedding: keras.layers.Layer) -> keras.Model:
    return keras.Sequential([keras.Input((SEQ,), dtype="int32"), embedding,
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])


@pytest.fixture(scope="module")
def dp():
    return uk.DataParallel()


@pytest.mark.parametrize("samples", [8 * 3, 8 * 3 - 3], ids=["even", "ragged"])
def test_fit_under_data_parallel_equals_one_process(dp, samples):
    """Global batches of 8 rows; with 21 rows the last one has 5, split 2/3 (2 ranks) or 1/2/2 (3 ranks):
    the table's rows, the Dense weights and the losses equal one process's after two epochs."""
    rs = np.random.RandomState(0)
    x = rs.randint(0, ROWS, (samples, SEQ)).astype("int32")
    y = rs.randn(samples, 1).astype("float32")
    with dp.scope():
        keras.utils.set_random_seed(3)
        layer = ShardedEmbedding(ROWS, DIM, optimizer=ps.SGD(LR), initializer=init_rows, name=f"dp-{samples}")
        model = make_model(layer)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    ref_emb = keras.layers.Embedding(ROWS, DIM, embeddings_initializer=keras.initializers.Constant(
        init_rows(np.arange(ROWS))))
    ref = make_model(ref_emb)
    ref.layers[-1].set_weights(model.layers[-1].get_weights())
    ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    hist = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    ref_hist = ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    rows = layer.table.to_numpy()
    assert not np.allclose(rows, init_rows(np.arange(ROWS)), atol=1e-4)
    np.testing.assert_allclose(rows, ref_emb.get_weights()[0], rtol=1e-5, atol=1e-6)
    for w, v in zip(model.layers[-1].get_weights(), ref.layers[-1].get_weights(), strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    assert all(np.array_equal(rows, other) for other in WORLD.allgather(rows))
    assert layer.table.stats()["pushes"] == 2 * 3
    layer.table.close()
