"""horovod.tensorflow parity (docs/horovod.md) under real mpirun at 3 ranks (2 ranks: the Keras suites)."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(900)
@pytest.mark.parametrize("np_", [3])  # 2 ranks: test_keras_hvd_mpi, test_keras_backends_mpi (suite budget)
def test_tf_parity(np_, tmp_path):
    # the suite runs ~100 tests (several minutes at np 3 on a loaded machine); each hang test has its own limit
    run_rank_suite(np_, "mpi_tf_parity.py", tmp_path, timeout=840, extra_env={"TEST_HANG_DUMP_S": "780"})


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_tf_parity_no_hang_with_two_interop_threads(tmp_path):
    """The graph-deadlock rows again with TF_NUM_INTEROP_THREADS=2 (the suite above runs with 1)."""
    run_rank_suite(3, "mpi_tf_parity.py", tmp_path, timeout=540,
                   extra_env={"TF_NUM_INTEROP_THREADS": "2", "TEST_HANG_DUMP_S": "500"},
                   pytest_args=["-k", "hang or in_one_graph or tf1"])
