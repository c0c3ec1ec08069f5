"""Tensor-parallel Keras 3 layers under real mpirun (tests/mpi/mpi_keras_tensor_parallel.py).

One np 4 launch covers tp = 1, 2, 3 (rank 3 idle) and 4 with process sets.
"""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(660)
def test_keras_tensor_parallel(tmp_path):
    run_rank_suite(4, "mpi_keras_tensor_parallel.py", tmp_path, timeout=600,
                   extra_env={"TEST_HANG_DUMP_S": "540"})
