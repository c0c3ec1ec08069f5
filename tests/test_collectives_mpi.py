"""Every collective x op x dtype x algorithm under real mpirun at 1-4 ranks."""

from __future__ import annotations

import pytest
from harness import run_rank_suite

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_collectives(np_, tmp_path):
    run_rank_suite(np_, "mpi_collectives.py", tmp_path)


def test_collectives_streamed_in_small_pieces(tmp_path):
    """Tiny pieces exercise piece matching when segments differ in length (n=3)."""
    run_rank_suite(3, "mpi_collectives.py", tmp_path, extra_env={"UNISON_CHUNK_BYTES": "1000"},
                   pytest_args=["-k", "not hypothesis"])
