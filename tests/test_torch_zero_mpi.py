"""ZeRO stages 1 and 2 for PyTorch under real mpirun (tests/mpi/mpi_torch_zero.py).

The np 4 launch trains and saves a consolidated checkpoint; the np 1, 2 and 3 launches load it
and must continue exactly as one process does (issue 14: saved at N=4, resumed at 2, 3 and 1).
"""

from __future__ import annotations

import sys

import pytest
from harness import ATTEMPT, mpi_env, mpirun, run_rank_suite


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero_ckpt")


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("np_", [4, 3, 2, 1])
def test_torch_zero(np_, tmp_path, ckpt_dir):
    # every test at 4 ranks; at 3, 2 and 1 the resumes (and, at 3, the grad scaler: uneven shards)
    args = [] if np_ == 4 else ["-k", "checkpoint or grad_scaler" if np_ == 3 else "checkpoint"]
    run_rank_suite(np_, "mpi_torch_zero.py", tmp_path, timeout=500, pytest_args=args,
                   extra_env={"ZERO_CKPT_DIR": str(ckpt_dir), "TEST_HANG_DUMP_S": "450"})


SAVE_ON_SOME_RANKS = ATTEMPT + """
import sys, torch
import unison.torch_backend as hvd
hvd.init()
r = hvd.rank()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
def step():
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
step()
hvd.save_sharded(sys.argv[1], model, opt)  # every rank: the usual path
# Horovod's habit, a save on rank 0 alone, while the others go on to the next step
attempt("save", lambda: hvd.save_sharded(sys.argv[1], model, opt) if r == 0 else step())
# a load that rank 1 alone makes, while the others all-reduce something else
attempt("load", lambda: hvd.load_sharded(sys.argv[1], model, opt) if r == 1 else
        hvd.allreduce(torch.ones(1), name="other"))
print(f"rank {r} after {hvd.allreduce(torch.ones(1), op=hvd.Sum, name='after').tolist()}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_save_or_load_that_some_ranks_skip_fails_on_every_rank(tmp_path):
    """A sharded save is collective; rank 0 alone calling it (as Horovod programs save) blocked it in MPI's own
    calls for ever while the others waited for its gradients, and so did a load on one rank (before 2026-12-06).
    The save now enters through a named engine collective, so the engine's deadlock check fails both sides on
    every rank, naming the save."""
    script = tmp_path / "save.py"
    script.write_text(SAVE_ON_SOME_RANKS)
    proc = mpirun(3, [sys.executable, str(script), str(tmp_path / "ckpt")], timeout=200,
                  env=mpi_env(UNISON_DEADLOCK_TIME_SECONDS="2"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for r in range(3):
        save = next((x for x in proc.stdout.splitlines() if x.startswith(f"rank {r} save StallError")), None)
        assert save is not None and "rank 0 waits for 'checkpoint.save_sharded'" in save, out[-4000:]
        assert "which rank(s) [1, 2] never submitted" in save and "rank 1 waits for" in save, save
        load = next((x for x in proc.stdout.splitlines() if x.startswith(f"rank {r} load StallError")), None)
        assert load is not None and "rank 1 waits for 'checkpoint.load_sharded'" in load, out[-4000:]
        assert "rank 0 waits for 'other'" in load and "rank 2 waits for 'other'" in load, load
        for line in (save, load):
            assert float(line.split("after ")[1].split("s:")[0]) < 15, line
        assert f"rank {r} after [3.0]" in proc.stdout, out[-4000:]
    assert "NO ERROR" not in proc.stdout, out[-4000:]
