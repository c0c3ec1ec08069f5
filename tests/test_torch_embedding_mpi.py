"""unison.torch_backend.ShardedEmbedding under real mpirun (tests/mpi/mpi_torch_embedding.py at 1-3 ranks)."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(400)
@pytest.mark.parametrize("np_", [2, 3, 1])
def test_torch_sharded_embedding(tmp_path, np_):
    run_rank_suite(np_, "mpi_torch_embedding.py", tmp_path, timeout=300)


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_recommender_example_learns_under_ssp():
    """examples/recommender.py: two sharded tables, SSP(2); the loss falls and recall@10 beats chance (0.1)."""
    import re
    import sys

    from harness import ROOT, mpirun

    proc = mpirun(2, [sys.executable, str(ROOT / "examples" / "recommender.py"), "--consistency", "ssp",
                      "--items", "100000", "--users", "5000", "--epochs", "2"], timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    losses = [float(x) for x in re.findall(r"BPR loss ([0-9.]+)", out)]
    recall = re.findall(r"recall@10 after training: ([0-9.]+)", out)
    assert len(losses) == 2 and losses[1] < losses[0], out[-4000:]  # rank 0 logs, once per epoch
    assert len(recall) == 1 and float(recall[0]) > 0.5, out[-4000:]
    assert "cannot replicate" in out
    held = re.findall(r"item shard holds ([0-9.]+) MiB \(rows and Adagrad state; the whole table ([0-9.]+)", out)
    assert held and float(held[0][0]) <= float(held[0][1]) / 2 + 0.1, out[-4000:]  # its arrays: half the table
    staleness = re.findall(r"largest staleness (\d+)", out)
    assert staleness and int(staleness[0]) <= 2
