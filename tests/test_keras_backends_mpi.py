"""unison.keras (DataParallel and the Horovod-style pieces) on each Keras 3 backend, under real mpirun."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend,np_", [("jax", 2), ("torch", 2), ("tensorflow", 2)])  # 3 ranks: budget
def test_keras_backends(backend, np_, tmp_path):
    run_rank_suite(np_, "mpi_keras_backends.py", tmp_path, timeout=600, extra_env={"KERAS_BACKEND": backend})
