"""unison.tf_backend.ShardedEmbedding (a Keras layer over unison.ps) under real mpirun at 2 and 3 ranks."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(400)
@pytest.mark.parametrize("np_", [2, 3])
def test_tf_sharded_embedding(tmp_path, np_):
    run_rank_suite(np_, "mpi_tf_embedding.py", tmp_path, timeout=380)


@pytest.mark.mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("np_", [2, 3])
def test_tf_sharded_embedding_under_data_parallel(tmp_path, np_):
    """tests/mpi/mpi_keras_dp_embedding.py: the layer under unison.keras.DataParallel, a ragged last batch."""
    run_rank_suite(np_, "mpi_keras_dp_embedding.py", tmp_path, timeout=180)
