"""unison.ps under real mpirun: the suite tests/mpi/mpi_ps.py at 4 ranks (saving), then 2 (loading) and 3."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_sharded_tables(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    for np_ in (4, 2, 3):
        run = tmp_path / f"np{np_}"
        run.mkdir()
        run_rank_suite(
            np_, "mpi_ps.py", run, timeout=240, extra_env={"PS_SHARED": str(shared) if np_ != 3 else ""}
        )
