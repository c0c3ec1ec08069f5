"""``examples/gpt_tp.py`` (dp 2 x tp 2) and ``examples/keras_gpt_tp.py`` (tp 2) under real mpirun: they learn."""

from __future__ import annotations

import re
import sys

import pytest
from harness import ROOT, mpi_env, mpirun

pytest.importorskip("torch")

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(400)]

SCRIPT = str(ROOT / "examples" / "gpt_tp.py")
STEP = re.compile(r"^step +(\d+)  loss (\d+\.\d+)$", re.MULTILINE)
VALID = re.compile(r"^validation loss: (\d+\.\d+) \(uniform guessing: 5\.545\)$", re.MULTILINE)


def test_dp2_x_tp2_with_sequence_parallelism_and_dropout_learns(tmp_path):
    proc = mpirun(4, [sys.executable, SCRIPT, "--tp", "2", "--steps", "120", "--log-every", "30",
                      "--sequence-parallel", "--dropout", "0.1", "--hidden", "64", "--sample-bytes", "40"],
                  timeout=330, env=mpi_env(), cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    out = proc.stdout
    assert "Grid(dp=2, pp=1, tp=2)" in out
    losses = [float(v) for _, v in STEP.findall(out)]
    assert len(losses) == 5, out  # steps 0, 30, 60, 90, 119, printed by rank 0 only
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 2.0, losses  # starts at ~ln 256, falls
    valid = VALID.findall(out)
    assert len(valid) == 1 and float(valid[0]) < 3.3, out
    sample = out.split("sample:\n", 1)[1]
    assert sample.startswith("def ") and len(sample.encode()) >= 40, sample


KERAS_SCRIPT = str(ROOT / "examples" / "keras_gpt_tp.py")
KERAS_STEP = re.compile(r"step +(\d+)  loss (\d+\.\d+)$", re.MULTILINE)  # may follow Keras's progress bar


def test_keras_tp2_learns(tmp_path):
    pytest.importorskip("tensorflow")
    proc = mpirun(2, [sys.executable, KERAS_SCRIPT, "--steps", "60", "--log-every", "20", "--hidden", "64",
                      "--sample-bytes", "20"], timeout=330, env=mpi_env(), cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    out = proc.stdout
    assert "Grid(dp=1, pp=1, tp=2)" in out
    losses = [float(v) for _, v in KERAS_STEP.findall(out)]
    assert len(losses) == 4, out  # steps 0, 20, 40, 59, printed by rank 0 only
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 2.0, losses
    valid = VALID.findall(out)
    assert len(valid) == 1 and float(valid[0]) < 3.5, out
    assert out.split("sample:\n", 1)[1].startswith("def "), out
