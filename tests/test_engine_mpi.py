"""The engine under real mpirun at 2-4 ranks, plus stalls and shutdown in their own jobs."""

from __future__ import annotations

import sys
import time

import pytest
from harness import mpi_env, mpirun, run_rank_suite

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_engine(np_, tmp_path):
    run_rank_suite(np_, "mpi_engine.py", tmp_path)


STALL = """
import time, numpy as np, unison
unison.init()
if unison.rank() == 1:
    h = unison.allreduce_async(np.ones(3), name="grad/stuck")
    try:
        unison.synchronize(h)
        print("NO ERROR")
    except unison.StallError as e:
        print("rank 1 got StallError:", e, flush=True)
else:
    time.sleep(6)
unison.allreduce(np.ones(1), name="after")
print(f"rank {unison.rank()} finished", flush=True)
"""


def test_stall_warning_names_tensor_and_missing_rank(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(STALL)
    env = mpi_env(UNISON_STALL_CHECK_TIME_SECONDS="1", UNISON_STALL_SHUTDOWN_TIME_SECONDS="3")
    proc = mpirun(2, [sys.executable, str(script)], timeout=90, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "stalled collectives: 'grad/stuck'" in out and "missing on rank(s) [0]" in out, out
    assert "rank 1 got StallError: stalled for more than UNISON_STALL_SHUTDOWN_TIME_SECONDS=3" in out
    assert "NO ERROR" not in out
    assert "rank 0 finished" in out and "rank 1 finished" in out


SHUTDOWN = """
import time, numpy as np, unison
unison.init()
if unison.rank() == 0:
    h = unison.allreduce_async(np.ones(3), name="never")
    t0 = time.monotonic()
    try:
        unison.synchronize(h)
    except unison.ShutdownError as e:
        print(f"rank 0 ShutdownError after {time.monotonic() - t0:.1f}s:", e, flush=True)
    try:
        unison.allreduce(np.ones(1), name="later")
    except unison.ShutdownError:
        print("rank 0 later call refused", flush=True)
else:
    time.sleep(1)
    unison.shutdown()
    print("rank 1 shut down", flush=True)
"""


def test_shutdown_fails_pending_handles_promptly(tmp_path):
    script = tmp_path / "shutdown.py"
    script.write_text(SHUTDOWN)
    start = time.monotonic()
    proc = mpirun(2, [sys.executable, str(script)], timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "rank 0 ShutdownError after" in out and "rank 0 later call refused" in out, out
    assert "rank 1 shut down" in out
    assert time.monotonic() - start < 30


AUTOTUNE = """
import numpy as np, unison
from mpi4py import MPI
from unison.common.engine import frontend
unison.init()
eng = frontend.engine()
tuner = eng.autotuner
for step in range(400):
    hs = [unison.allreduce_async(np.ones(16384, np.float32), op=unison.Sum, name=f"w{i}") for i in range(8)]
    for h in hs:
        assert unison.synchronize(h)[0] == unison.size()
    if MPI.COMM_WORLD.allreduce(int(tuner.done), op=MPI.MIN):
        break
histories = MPI.COMM_WORLD.allgather(tuner.history)
assert all(h == histories[0] for h in histories), histories   # same values at the same cycles
settings = {(t, c) for _, t, c in tuner.history}
print(f"rank {unison.rank()} done={tuner.done} settings={len(settings)} "
      f"final={(eng.fusion_threshold, eng.cycle_time)}", flush=True)
"""


def test_autotune_moves_parameters_and_keeps_ranks_consistent(tmp_path):
    script = tmp_path / "tune.py"
    script.write_text(AUTOTUNE)
    log = tmp_path / "autotune.csv"
    env = mpi_env(UNISON_AUTOTUNE="1", UNISON_AUTOTUNE_LOG=str(log), UNISON_AUTOTUNE_STEPS_PER_SAMPLE="3")
    proc = mpirun(2, [sys.executable, str(script)], timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("done=True") == 2, out
    settings = {line.split("settings=")[1].split()[0] for line in out.splitlines() if "settings=" in line}
    assert all(int(s) >= 5 for s in settings), out
    finals = {line.split("final=")[1] for line in out.splitlines() if "final=" in line}
    assert len(finals) == 1, finals
    import csv

    rows = list(csv.DictReader(open(log)))
    assert len(rows) >= 8
    assert len({r["fusion_threshold_bytes"] for r in rows}) >= 5
    assert len({r["cycle_time_ms"] for r in rows}) >= 3
    assert all(float(r["bytes_per_s"]) > 0 for r in rows)
