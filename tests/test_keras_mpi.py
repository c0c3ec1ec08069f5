"""UnisonStrategy with Keras 3 under real mpirun at 1-3 ranks."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(900)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_keras_strategy(np_, tmp_path):
    run_rank_suite(np_, "mpi_keras.py", tmp_path, timeout=600)
