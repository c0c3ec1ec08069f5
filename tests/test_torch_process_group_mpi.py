"""``dist.init_process_group("unison")`` under real mpirun (docs/torch_distributed.md)."""

from __future__ import annotations

import pytest
from harness import run_rank_suite

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]


@pytest.mark.parametrize("np_", [3, 1])
def test_torch_process_group(np_, tmp_path):
    run_rank_suite(np_, "mpi_torch_process_group.py", tmp_path, timeout=400)


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
