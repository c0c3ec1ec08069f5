"""ZeRO stages 1 and 2 for Keras 3 (UnisonStrategy and DistributedOptimizer) under real mpirun.

The whole suite runs at 2 ranks (np 3 passes too: run by hand, 195 s); then its checkpoint tests run
at 3 ranks and at 1, on one shared folder: np 2 and np 3 save a checkpoint there, and np 3 resumes
np 2's, np 1 both (ZeRO N -> M and into a plain Keras optimizer).
"""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(1500)
def test_keras_zero(tmp_path):
    env = {"TEST_HANG_DUMP_S": "850", "UNISON_TEST_KERAS_CKPT": str(tmp_path / "checkpoints")}
    run_rank_suite(2, "mpi_keras_zero.py", tmp_path / "np2", timeout=900, extra_env=env)
    env["TEST_HANG_DUMP_S"] = "250"
    for np_ in (3, 1):
        run_rank_suite(np_, "mpi_keras_zero.py", tmp_path / f"np{np_}", timeout=300, extra_env=env,
                       pytest_args=["-k", "checkpoint"])
