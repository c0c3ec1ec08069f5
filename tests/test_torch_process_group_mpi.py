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
