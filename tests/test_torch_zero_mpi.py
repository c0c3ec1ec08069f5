"""ZeRO stages 1 and 2 for PyTorch under real mpirun (tests/mpi/mpi_torch_zero.py).

The np 4 launch trains and saves a consolidated checkpoint; the np 1, 2 and 3 launches load it
and must continue exactly as one process does (issue 14: saved at N=4, resumed at 2, 3 and 1).
"""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero_ckpt")


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("np_", [4, 3, 2, 1])
def test_torch_zero(np_, tmp_path, ckpt_dir):
    # every test at 4 ranks; at 3, 2 and 1 the resumes (and, at 3, the grad scaler: uneven shards)
    args = [] if np_ == 4 else ["-k", "checkpoint or grad_scaler" if np_ == 3 else "checkpoint"]
    run_rank_suite(np_, "mpi_torch_zero.py", tmp_path, timeout=500, pytest_args=args,
                   extra_env={"ZERO_CKPT_DIR": str(ckpt_dir), "TEST_HANG_DUMP_S": "450"})
