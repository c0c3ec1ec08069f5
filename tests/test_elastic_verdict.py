"""unisonrun's verdict on an elastic job, end to end: which deaths restart it, which end it, with what status.

See [Note: the driver's verdict] in unison/run/elastic_driver.py and [Note: how a rank's job ended] in
unison/common/liveness.py. Each test runs ``unisonrun --elastic-mode ...`` on 2 ranks with a short
program written here (a few seconds each); the stand-in-job checks of the same rules are in
tests/test_elastic_driver.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT, mpi_env

#: the head of every program: 2 ranks, an elastic state, one all-reduce per step
HEAD = """
import json, os, sys, time
import torch
import unison.torch_backend as hvd
from unison.torch_backend import elastic
OUT, ATTEMPT = sys.argv[1], int(os.environ["UNISON_ELASTIC_ATTEMPT"])
hvd.init()
"""

#: called once per epoch (a training function that returns many times), then a second phase with a state
#: of its own; in the first job rank 1 dies in the second epoch's call
TWO_PHASES = HEAD + """
s1 = elastic.ObjectState(epoch=0, step=0)
s2 = elastic.ObjectState(b=100)

@elastic.run
def train_epoch(s):
    while s.step < 3:
        hvd.allreduce(torch.ones(1), name=f"e{s.epoch}s{s.step}")
        s.step += 1
        s.commit()
        if ATTEMPT == 0 and s.epoch == 1 and s.step == 2 and hvd.rank() == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), 9)
    s.epoch, s.step = s.epoch + 1, 0
    s.commit()

@elastic.run
def phase2(s):
    s.b += 1
    s.commit()
    s.b = 999
    s.restore()  # what the run wrapper does after a failure: back to this state's own commit
    return s.b

while s1.epoch < 3:
    train_epoch(s1)
b = phase2(s2)
with open(f"{OUT}/rank{hvd.rank()}-{ATTEMPT}.json", "w") as f:
    json.dump({"epoch": s1.epoch, "b": b, "s2_names": sorted(vars(s2)), "size": hvd.size()}, f)
"""

#: every rank SIGKILLs itself inside its training in the first job
ALL_DIE = HEAD + """
state = elastic.ObjectState(step=0)

@elastic.run
def train(s):
    while s.step < 4:
        hvd.allreduce(torch.ones(1), name=f"s{s.step}")
        s.step += 1
        s.commit()
        if s.step == 2 and ATTEMPT == 0:
            time.sleep(0.5)
            os.kill(os.getpid(), 9)

train(state)
with open(f"{OUT}/rank{hvd.rank()}-{ATTEMPT}.json", "w") as f:
    json.dump({"step": state.step}, f)
"""

#: the training returns; then rank 0's last step (exporting the model, say) fails
AFTER = HEAD + """
state = elastic.ObjectState(step=0)

@elastic.run
def train(s):
    while s.step < 2:
        hvd.allreduce(torch.ones(1), name=f"s{s.step}")
        s.step += 1
        s.commit()

train(state)
open(f"{OUT}/returned{hvd.rank()}-{ATTEMPT}", "w").close()
if hvd.rank() == 0:
    ENDING
hvd.shutdown()
"""


def _unisonrun(tmp_path: Path, program: str, mode: str, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    """``unisonrun -np 2 --elastic-mode MODE python PROGRAM OUT`` to its end (a hang fails the test)."""
    script, out = tmp_path / "prog.py", tmp_path / "out"
    script.write_text(program)
    out.mkdir()
    cmd = [sys.executable, "-m", "unison.run", "-np", "2", "--elastic-mode", mode, "--max-restarts", "2",
           sys.executable, str(script), str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(),
                            cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"unisonrun hung for {timeout} s\n--- stderr ---\n{stderr[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _detail(proc: subprocess.CompletedProcess[str]) -> str:
    return (f"\nexit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n"
            f"--- stderr ---\n{proc.stderr[-5000:]}")


def _outcomes(tmp_path: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("*.json"))}


@pytest.mark.parametrize("mode", ["restart", "inplace"])
def test_a_rank_that_dies_in_a_later_call_of_the_training_function_is_recovered(tmp_path: Path, mode: str) -> None:
    """Before 2026-12-05 the first epoch's return told the driver the training finished: rank 1's death in the
    second epoch ended the restart tier's job with status 0, no restart and the epochs left undone. And
    the second phase's state resumed from the first state's commit, so its own value was never restored."""
    proc = _unisonrun(tmp_path, TWO_PHASES, mode)
    detail = _detail(proc)
    assert proc.returncode == 0, detail
    got = _outcomes(tmp_path)
    if mode == "restart":  # a second job, from the commit in epoch 1, on 2 ranks
        assert "starting job 1: 2 rank(s)" in proc.stderr and "resumed from commit 6" in proc.stderr, detail
        assert sorted(got) == ["rank0-1", "rank1-1"], detail
    else:  # rank 0 goes on alone in the same job
        assert "starting job 1" not in proc.stderr, detail
        assert sorted(got) == ["rank0-0"] and got["rank0-0"]["size"] == 1, detail
    for outcome in got.values():
        assert outcome["epoch"] == 3, detail  # every epoch trained
        assert outcome["b"] == 101, detail  # the second state's restore brought back its own commit
        assert "epoch" not in outcome["s2_names"] and "step" not in outcome["s2_names"], detail
    assert proc.stdout.count("[unison] elastic: the training function returned") == 1, detail  # once, at the end


def test_every_rank_killed_in_the_in_place_tier_restarts_the_job(tmp_path: Path) -> None:
    """ULFM's mpirun exits 0 when every rank was killed; before 2026-12-05 unisonrun exited 0 with no restart."""
    proc = _unisonrun(tmp_path, ALL_DIE, "inplace")
    detail = _detail(proc)
    assert proc.returncode == 0, detail
    assert "rank(s) 0, 1 of this host died" in proc.stderr and "starting job 1" in proc.stderr, detail
    assert _outcomes(tmp_path) == {"rank0-1": {"step": 4}, "rank1-1": {"step": 4}}, detail


@pytest.mark.parametrize("mode, ending, status", [
    ("restart", "raise OSError('could not write the final model')", 1),
    ("inplace", "raise OSError('could not write the final model')", 1),
    ("restart", "sys.exit(3)", 3),
])
def test_a_failure_after_the_training_returned_fails_unisonrun_without_a_restart(
        tmp_path: Path, mode: str, ending: str, status: int) -> None:
    """Before 2026-12-05 the finished line made unisonrun exit 0 whatever happened after it."""
    proc = _unisonrun(tmp_path, AFTER.replace("ENDING", ending), mode)
    detail = _detail(proc)
    assert proc.returncode == status, detail
    assert "starting job 1" not in proc.stderr, detail  # a restart would only repeat the failing step
    assert (tmp_path / "out" / "returned0-0").exists(), detail  # (it failed after the training, as meant)
