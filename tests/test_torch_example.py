"""``examples/torch_train.py`` under real mpirun: it learns, checkpoints, and resumes exactly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT, mpi_env, mpirun

pytest.importorskip("torch")
pytest.importorskip("sklearn")

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

SCRIPT = str(ROOT / "examples" / "torch_train.py")
FINAL = re.compile(r"^final validation accuracy: (\d+\.\d+)$", re.MULTILINE)


def train(tmp_path: Path, checkpoint: Path, *extra: str, np_: int = 2,
          timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Runs the example on ``np_`` ranks in ``tmp_path``; fails the test unless it exits 0."""
    proc = mpirun(np_, [sys.executable, SCRIPT, "--checkpoint", str(checkpoint), *extra],
                  timeout=timeout, env=mpi_env(), cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def final_accuracy(stdout: str) -> float:
    """The accuracy on the final line; checks that exactly one rank printed it, last."""
    found = FINAL.findall(stdout)
    assert len(found) == 1, f"expected one final line (rank 0 only), found {len(found)}:\n{stdout}"
    assert stdout.strip().splitlines()[-1].startswith("final validation accuracy: "), stdout
    return float(found[0])


def epoch_line(stdout: str, epoch: int, epochs: int) -> str:
    """The metrics line of one epoch, e.g. ``epoch 3/3: train loss ..., validation accuracy ...``."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(f"epoch {epoch}/{epochs}: ")]
    assert len(lines) == 1, f"expected one line for epoch {epoch}/{epochs}, found {lines}:\n{stdout}"
    return lines[0]


def saved_epoch(checkpoint: Path) -> int:
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert set(state) >= {"epoch", "model", "optimizer"}, sorted(state)
    return int(state["epoch"])


def test_trains_and_checkpoints(tmp_path):
    checkpoint = tmp_path / "ckpt" / "digits.pt"
    proc = train(tmp_path, checkpoint, "--epochs", "3")
    accuracy = final_accuracy(proc.stdout)
    assert accuracy > 0.85, proc.stdout
    for epoch in (1, 2, 3):
        epoch_line(proc.stdout, epoch, 3)
    assert checkpoint.is_file()
    assert saved_epoch(checkpoint) == 3
    assert not list(checkpoint.parent.glob("*.tmp")), "a temporary checkpoint file was left behind"


def test_resume_continues_where_it_stopped(tmp_path):
    checkpoint = tmp_path / "resumed.pt"
    first = train(tmp_path, checkpoint, "--epochs", "2")
    assert "resuming" not in first.stdout
    assert saved_epoch(checkpoint) == 2

    resumed = train(tmp_path, checkpoint, "--resume", "--epochs", "3")
    assert "resuming from epoch 2" in resumed.stdout, resumed.stdout
    assert not re.search(r"^epoch [12]/3: ", resumed.stdout, re.MULTILINE), resumed.stdout
    assert saved_epoch(checkpoint) == 3
    accuracy = final_accuracy(resumed.stdout)

    # Two epochs plus a resumed third must match three epochs in one go: weights, momentum
    # buffers and the shuffling order are all restored, and two ranks sum in a fixed order.
    straight = train(tmp_path, tmp_path / "straight.pt", "--epochs", "3")
    assert epoch_line(resumed.stdout, 3, 3) == epoch_line(straight.stdout, 3, 3)
    assert accuracy == final_accuracy(straight.stdout)


def test_resume_without_checkpoint_fails_on_every_rank(tmp_path):
    proc = mpirun(2, [sys.executable, SCRIPT, "--checkpoint", str(tmp_path / "missing.pt"), "--resume"],
                  timeout=120, env=mpi_env(), cwd=tmp_path)
    assert proc.returncode != 0
    assert "cannot resume from" in proc.stderr, proc.stderr
    assert "final validation accuracy" not in proc.stdout


def test_help():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True,
                          timeout=120, env=mpi_env())
    assert proc.returncode == 0, proc.stderr
    for option in ("--epochs", "--batch-size", "--lr", "--seed", "--checkpoint", "--resume"):
        assert option in proc.stdout
