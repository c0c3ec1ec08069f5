"""Checkpoints (BackupAndRestore, tf.train.Checkpoint) under real mpirun at 1-3 ranks."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(900)
@pytest.mark.parametrize("np_", [3])  # 1 and 2 ranks: test_sharded_checkpoint, the ZeRO suites (suite budget)
def test_checkpoints(np_, tmp_path):
    run_rank_suite(np_, "mpi_checkpoint.py", tmp_path, timeout=600)
