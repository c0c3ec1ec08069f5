"""unison.common.checkpoints under real mpirun: saved at 4 ranks, loaded at 4, 3, 2 and 1.

Four launches of tests/mpi/mpi_sharded_checkpoint.py sharing one folder: the 4-rank launch
saves (sharded and consolidated) and reloads exactly, then 3, 2 and 1 ranks load what it saved.
Each launch also checks that a failure or a mismatch on one rank raises on every rank.
"""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_saved_at_4_loads_at_4_3_2_1(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    env = {"CK_SHARED": str(shared), "TEST_HANG_DUMP_S": "150"}
    for np_ in (4, 3, 2, 1):
        run_rank_suite(np_, "mpi_sharded_checkpoint.py", tmp_path / f"np{np_}", timeout=200, extra_env=env)
