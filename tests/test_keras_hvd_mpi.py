"""Horovod-style Keras API under real mpirun at 1-2 ranks."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(900)
@pytest.mark.parametrize("np_", [1, 2])
def test_keras_horovod_api(np_, tmp_path):
    run_rank_suite(np_, "mpi_keras_hvd.py", tmp_path, timeout=600, extra_env={"TEST_HANG_DUMP_S": "560"})
