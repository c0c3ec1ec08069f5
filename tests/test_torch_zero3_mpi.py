"""ZeRO stage 3 for PyTorch (``shard_module``) under real mpirun: one launch per rank count.

np 3 runs the whole suite (3 divides none of the test models' sizes). The checkpoint test runs
at 4 first (it trains, saves with ``hvd.save_sharded`` and writes the reference state), then
resumes at 3 (in the full launch), 2 and 1, each continuing like one process.
"""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero3_ckpt")


@pytest.mark.mpi
@pytest.mark.timeout(660)
@pytest.mark.parametrize("np_", [4, 3, 2, 1])
def test_torch_zero3(np_, tmp_path, ckpt_dir):
    args = [] if np_ == 3 else ["-k", "checkpoint"]
    # the machine running the suite may be loaded: a rank dumps its stacks only after 500 s
    run_rank_suite(np_, "mpi_torch_zero3.py", tmp_path, timeout=600, pytest_args=args,
                   extra_env={"ZERO_CKPT_DIR": str(ckpt_dir), "TEST_HANG_DUMP_S": "500"})
