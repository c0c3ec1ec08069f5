"""ZeRO stage 3 for PyTorch (``shard_module``) under real mpirun: one launch per rank count."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(660)
@pytest.mark.parametrize("np_", [3])  # 3 divides none of the test models' sizes; np 2 and 4 by hand
def test_torch_zero3(np_, tmp_path):
    # the machine running the suite may be loaded: a rank dumps its stacks only after 500 s
    run_rank_suite(np_, "mpi_torch_zero3.py", tmp_path, timeout=600, extra_env={"TEST_HANG_DUMP_S": "500"})
