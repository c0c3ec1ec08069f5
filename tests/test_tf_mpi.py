"""The Horovod-compatible TensorFlow API under real mpirun at 1-3 ranks."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(660)
@pytest.mark.parametrize("np_", [3])  # 1 and 2 ranks: test_keras_hvd_mpi (the same TF API); suite budget
def test_tf_backend(np_, tmp_path):
    # the machine running the suite may be loaded: a rank dumps its stacks only after 500 s
    run_rank_suite(np_, "mpi_tf.py", tmp_path, timeout=540, extra_env={"TEST_HANG_DUMP_S": "500"})
