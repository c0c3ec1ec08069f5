"""UnisonStrategy with Keras 3 under real mpirun at 1-3 ranks."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(900)
@pytest.mark.parametrize("np_", [3])  # 1 and 2 ranks: test_keras_hvd_mpi, the examples (suite budget)
def test_keras_strategy(np_, tmp_path):
    run_rank_suite(np_, "mpi_keras.py", tmp_path, timeout=600)


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_keras_fit_example_learns_digits(tmp_path):
    import re
    import sys

    from harness import ROOT, mpirun

    target = tmp_path / "model.keras"
    proc = mpirun(2, [sys.executable, str(ROOT / "examples" / "keras_fit.py"), "--epochs", "6",
                      "--save", str(target)], timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    found = re.findall(r"final validation accuracy: ([0-9.]+)", proc.stdout)
    assert len(found) == 1, out  # rank 0 only
    assert float(found[0]) > 0.9, out
    assert target.exists() and not list(tmp_path.glob(".*tmp*"))
    assert proc.stdout.count("Epoch 1/6") == 1  # one progress log, from rank 0


SIZE_ONE = r'''
import numpy as np, keras
from unison.tf_backend import UnisonStrategy
rs = np.random.RandomState(0)
x = rs.randn(37, 4).astype("float32")
y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], "float32")).astype("float32")
def build():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model
def fit(strategy):
    keras.utils.set_random_seed(3)
    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    hist = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    return hist.history["loss"], model.get_weights()
strategy = UnisonStrategy()
assert strategy.num_replicas_in_sync == 1
(l1, w1), (l0, w0) = fit(strategy), fit(None)
np.testing.assert_allclose(l1, l0, rtol=1e-5)
for a, b in zip(w1, w0):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
print("size one ok", l1[-1])
'''


@pytest.mark.timeout(300)
def test_strategy_at_size_one_without_mpirun_fits_like_no_strategy(tmp_path):
    """docs/keras.md: a script run as plain ``python`` (a singleton MPI job) under UnisonStrategy
    fits exactly like Keras without a strategy."""
    import subprocess
    import sys

    from harness import mpi_env

    proc = subprocess.run([sys.executable, "-c", SIZE_ONE], capture_output=True, text=True, timeout=240,
                          env=mpi_env(), cwd=tmp_path)
    assert proc.returncode == 0 and "size one ok" in proc.stdout, proc.stdout + proc.stderr
