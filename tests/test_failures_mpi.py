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


INTERRUPTED_CYCLE = """
import sys, threading, time, numpy as np, unison
from unison.common.engine import controller
unison.init()
r = unison.rank()
how = sys.argv[1]
if r == 0:  # a Ctrl-C (or a SIGTERM handler's sys.exit) that lands while the main thread waits in its own cycle
    real, calls = controller.wait, [0]
    def wait(req, check=None):
        if threading.current_thread() is threading.main_thread():
            calls[0] += 1
            if calls[0] == 5:
                raise KeyboardInterrupt() if how == "interrupt" else SystemExit(0)
        return real(req, check)
    controller.wait = wait
try:
    for step in range(1000):
        if r == 1:
            time.sleep(0.05)
        unison.allreduce(np.ones(4), name="grad")
    print(f"rank {r} NO INTERRUPT", flush=True)
except (KeyboardInterrupt, SystemExit) as e:
    print(f"rank {r} caught {type(e).__name__}: saving and leaving", flush=True)
    sys.exit(0)  # a program that handles the interrupt and exits normally
"""


@pytest.mark.parametrize("how", ["interrupt", "sigterm-exit"])
def test_an_interrupt_inside_a_waiters_cycle_ends_the_job_instead_of_hanging_the_others(how, tmp_path):
    """Found by an audit (2026-12-06): the interrupt left rank 0's cycle half done (its negotiation posted), its
    engine ended without the cycle that tells the others, and they waited in theirs for ever, under plain
    mpirun and unisonrun alike, whether the program died of it or caught it and exited 0. Such a rank now
    aborts the job when it exits, saying why."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED_CYCLE)
    start = time.monotonic()
    proc = mpirun(2, [sys.executable, str(script), how], timeout=90)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert "rank 0 caught" in proc.stdout, out[-3000:]
    assert "rank 0: its Unison engine stopped inside a collective cycle" in proc.stderr, out[-3000:]
    assert "the job is aborted (status 130)" in proc.stderr if how == "interrupt" else "(status 1)" in proc.stderr
    assert proc.returncode != 0 and elapsed < 30, (elapsed, out[-3000:])
