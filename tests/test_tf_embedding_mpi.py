"""unison.tf_backend.ShardedEmbedding (a Keras layer over unison.ps) under real mpirun at 2 ranks."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_tf_sharded_embedding(tmp_path):
    run_rank_suite(2, "mpi_tf_embedding.py", tmp_path, timeout=280)
