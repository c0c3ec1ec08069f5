"""horovod.tensorflow(.keras) parity, part 2 (docs/horovod.md) under real mpirun at 3 ranks."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(700)
@pytest.mark.parametrize("np_", [3])  # 2 ranks: test_keras_hvd_mpi, the examples (suite budget)
def test_tf_parity2(np_, tmp_path):
    run_rank_suite(np_, "mpi_tf_parity2.py", tmp_path, timeout=600, extra_env={"TEST_HANG_DUMP_S": "540"})
