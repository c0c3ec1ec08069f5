"""unison.keras (DataParallel and the Horovod-style pieces) on each Keras 3 backend, under real mpirun."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend,np_", [("jax", 2), ("torch", 3), ("tensorflow", 2)])
def test_keras_backends(backend, np_, tmp_path):
    run_rank_suite(np_, "mpi_keras_backends.py", tmp_path, timeout=600, extra_env={"KERAS_BACKEND": backend})


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_any_backend_example_learns_digits_on_jax(tmp_path):
    """The example on the backend no other multi-process Keras option covers (the rest: the suite above)."""
    import re
    import sys

    from harness import ROOT, mpi_env, mpirun

    target = tmp_path / "model.keras"
    proc = mpirun(2, [sys.executable, str(ROOT / "examples" / "keras_any_backend.py"), "--epochs", "6",
                      "--save", str(target)], timeout=400, env=mpi_env(KERAS_BACKEND="jax"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    found = re.findall(r"final validation accuracy: ([0-9.]+) \(jax\)", proc.stdout)
    assert len(found) == 1, out  # rank 0 only
    assert float(found[0]) > 0.93, out
    assert target.exists() and not list(tmp_path.glob(".*tmp*"))
    assert proc.stdout.count("Epoch 1/6") == 1  # one progress log, from rank 0
