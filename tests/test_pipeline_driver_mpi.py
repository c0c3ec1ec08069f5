"""The framework-neutral pipeline driver under real mpirun at 1-4 ranks (tests/mpi/mpi_pipeline_driver.py)."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_pipeline_driver(np_, tmp_path):
    run_rank_suite(np_, "mpi_pipeline_driver.py", tmp_path, timeout=250,
                   extra_env={"TEST_HANG_DUMP_S": "220"})
