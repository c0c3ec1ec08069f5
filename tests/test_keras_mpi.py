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
