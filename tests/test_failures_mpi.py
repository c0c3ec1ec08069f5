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


TORCH_SCRIPT = """
import torch, torch.distributed as dist
import unison.torch_backend
dist.init_process_group("unison")   # installs torch's own excepthook, which captures stderr around ours
if dist.get_rank() == 1:
    raise RuntimeError("boom on rank 1")
dist.barrier()
"""


def test_raising_rank_after_init_process_group_prints_its_traceback(tmp_path):
    """torch.distributed's excepthook calls ours with stderr redirected to a StringIO it prints
    afterwards; we abort before that, so ours must write to the process's stderr itself."""
    script = tmp_path / "fail_torch.py"
    script.write_text(TORCH_SCRIPT)
    proc = mpirun(2, [sys.executable, str(script)], timeout=120)
    assert proc.returncode != 0
    assert "boom on rank 1" in proc.stderr and "rank 1 of 2 failed; aborting the job" in proc.stderr, \
        proc.stderr[-3000:]
