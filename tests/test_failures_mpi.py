"""A rank that raises ends the whole job quickly, under plain mpirun too."""

from __future__ import annotations

import sys
import time

import pytest
from harness import mpirun

pytestmark = pytest.mark.mpi

SCRIPT = """
import numpy as np, unison
unison.init()
unison.allreduce(np.ones(4))
if unison.rank() == 1:
    raise RuntimeError("boom on rank 1")
unison.barrier()   # the other ranks wait here forever unless the job is aborted
"""


@pytest.mark.parametrize("np_", [2, 3])
def test_raising_rank_ends_plain_mpirun_job(np_, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    proc = mpirun(np_, [sys.executable, str(script)], timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "boom on rank 1" in proc.stderr
    assert "rank 1 of" in proc.stderr and "aborting the job" in proc.stderr
    assert elapsed < 30, f"job took {elapsed:.1f}s to end"
