"""``dist.init_process_group("unison")`` under real mpirun (docs/torch_distributed.md)."""

from __future__ import annotations

import pytest
from harness import run_rank_suite

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]


@pytest.mark.parametrize("np_", [3, 1])
def test_torch_process_group(np_, tmp_path):
    run_rank_suite(np_, "mpi_torch_process_group.py", tmp_path, timeout=400)


def test_torch_process_group_agreement(tmp_path):
    """Coalesced calls, and counts, shapes and dtypes that differ across ranks, on the default group and a
    sub-group of 2 of the 3 ranks: tests/mpi/mpi_torch_process_group_agreement.py."""
    run_rank_suite(3, "mpi_torch_process_group_agreement.py", tmp_path, timeout=300)


def test_torch_sub_groups(tmp_path):
    """dist.new_group pairs, an ordered group, a 2-D DeviceMesh: tests/mpi/mpi_torch_subgroups.py at 4 ranks."""
    run_rank_suite(4, "mpi_torch_subgroups.py", tmp_path, timeout=400)


def test_dcp_saved_on_4_ranks_loads_on_2(tmp_path):
    """torch.distributed.checkpoint through the unison backend's collectives: save at 4, load at 2."""
    import sys

    from harness import ROOT, mpirun

    script = str(ROOT / "tests" / "mpi" / "mpi_torch_dcp.py")
    folder = str(tmp_path / "ckpt")
    for np_, mode in ((4, "save"), (2, "load")):
        proc = mpirun(np_, [sys.executable, script, folder, mode], timeout=200)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        assert sorted(line for line in proc.stdout.splitlines() if line.endswith(": ok")) == \
            [f"rank {r}: ok" for r in range(np_)], out[-4000:]


MISMATCHED = """
import os, sys
import torch.distributed as dist
import unison.torch_backend  # noqa: F401
r, n = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
for kwargs in (dict(rank=(r + 1) % n, world_size=n), dict(rank=r, world_size=n + 1)):
    try:
        dist.init_process_group("unison", **kwargs)
        print(f"rank {r}: accepted {kwargs}", flush=True)
        dist.destroy_process_group()
    except ValueError as e:
        print(f"rank {r}: refused: {e}", flush=True)
"""


def test_a_rank_or_world_size_that_disagrees_with_mpi_is_refused(tmp_path):
    """Before 2026-12-05 the MPI launch's rendezvous dropped them silently (rank=5, world_size=7 at 2 ranks ran
    as 0 and 1 of 2), though the docs said they raise."""
    import sys

    from harness import mpirun

    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCHED)
    proc = mpirun(2, [sys.executable, str(script)], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    refused = [line for line in proc.stdout.splitlines() if ": refused: " in line]
    assert len(refused) == 4 and "accepted" not in proc.stdout, out[-4000:]
    assert any("got rank=1 but MPI says this process's rank is 0" in line for line in refused), refused
    assert any("got world_size=3 but MPI says this process's world_size is 2" in line for line in refused), refused


DIFFERENT_COLLECTIVES = """
import time, torch, torch.distributed as dist
import unison.torch_backend  # noqa: F401
dist.init_process_group("unison")
r = dist.get_rank()
t0 = time.monotonic()
try:
    if r == 0:
        dist.all_reduce(torch.ones(3))
    else:
        dist.broadcast(torch.ones(3), src=0)
    print(f"rank {r} NO ERROR", flush=True)
except Exception as e:
    print(f"rank {r} {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
"""


def test_ranks_running_different_collectives_raise_instead_of_waiting_out_the_timeout(tmp_path):
    """Rank 0 all-reduces while the others broadcast: each waits in ``Work.wait`` (on an event, not on the
    engine's handle), which the engine's deadlock check did not see when it was added; they waited out the
    group's timeout (30 minutes by default). Now every rank raises once all have waited
    UNISON_DEADLOCK_TIME_SECONDS (2 s here)."""
    import sys

    from harness import mpi_env, mpirun

    script = tmp_path / "different.py"
    script.write_text(DIFFERENT_COLLECTIVES)
    proc = mpirun(3, [sys.executable, str(script)], timeout=120, env=mpi_env(UNISON_DEADLOCK_TIME_SECONDS="2"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for r in range(3):
        line = next(x for x in out.splitlines() if x.startswith(f"rank {r} "))
        assert line.startswith(f"rank {r} StallError after"), out
        assert float(line.split("after ")[1].split(" s:")[0]) < 20, line
        assert "rank 0 waits for 'allreduce.noname.0'" in line and "rank 1 waits for 'broadcast.noname.0'" in line
