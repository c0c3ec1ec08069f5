"""Fault injection through ``unisonrun``: a killed rank, a rank that leaves early, a stopped launcher.

Every job is ``unisonrun -np 2 python tests/faults/fault_job.py KIND WORKDIR MARKER`` (see that
script for the faults). Outside elastic mode, each fault must end the whole job non-zero within
``LIMIT_S`` seconds of the fault, name the rank at fault, and leave no process behind: no rank and
no ``mpirun``, found by the job's unique ``MARKER`` on their command lines in ``/proc``. A test
that fails still kills everything it started (the launcher's session, then anything carrying the
marker).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from harness import ROOT, mpi_env

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

SCRIPT = ROOT / "tests" / "faults" / "fault_job.py"
LIMIT_S = 30.0  # from the fault to the end of the job
JOB_TIMEOUT_S = 150.0  # the outer limit of one job, start-up included (torch imports are slow here)
FAULT_STEP = 3  # tests/faults/fault_job.py: the step at which the faulty rank acts


def marked_processes(marker: str) -> list[int]:
    """Pids of the live processes whose command line holds ``marker`` (not this one)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
            state = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def wait_gone(marker: str, within_s: float) -> list[int]:
    """Waits up to ``within_s`` for every process of the job to end; returns those still there."""
    deadline = time.monotonic() + within_s
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


class Job:
    """``unisonrun -np 2 fault_job.py KIND`` in its own session, its output in files."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind, self.workdir = kind, tmp_path / "work"
        self.workdir.mkdir()
        self.marker = f"unison-fault-{uuid.uuid4().hex}"
        self.out_path, self.err_path = tmp_path / "stdout", tmp_path / "stderr"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Job:
        command = [sys.executable, "-m", "unison.run", "-np", "2", sys.executable, str(SCRIPT), self.kind,
                   str(self.workdir), self.marker]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.process = subprocess.Popen(command, stdout=out, stderr=err, env=mpi_env(), cwd=ROOT,
                                            start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        """Kills whatever is left, passing or failing: the launcher's session, then the marked processes."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        for pid in marked_processes(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> int:
        """Waits for the launcher to exit; a job still running after ``timeout`` fails the test."""
        assert self.process is not None
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.kind} job still running after {timeout:.0f} s{self.output()}")

    def output(self) -> str:
        out = self.out_path.read_text(errors="replace")[-4000:]
        err = self.err_path.read_text(errors="replace")[-8000:]
        return f"\n--- stdout ---\n{out}\n--- stderr ---\n{err}"

    def last_line(self) -> str:
        lines = self.err_path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""

    def wait_for_ranks(self, timeout: float = JOB_TIMEOUT_S) -> list[int]:
        """Waits until both ranks have started; returns their pids."""
        files = [self.workdir / "rank0.pid", self.workdir / "rank1.pid"]
        deadline = time.monotonic() + timeout
        while not all(f.is_file() and f.read_text() for f in files):
            if self.process is not None and self.process.poll() is not None:
                pytest.fail(f"the {self.kind} job ended before its ranks started{self.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks of the {self.kind} job did not start in {timeout:.0f} s{self.output()}")
            time.sleep(0.1)
        return [int(f.read_text()) for f in files]


def assert_no_leftovers(job: Job) -> None:
    left = wait_gone(job.marker, within_s=5.0)
    assert not left, f"processes left behind after the job ended: {left}{job.output()}"


@pytest.mark.parametrize("kind", ["allreduce", "optimizer", "pipeline", "checkpoint"])
def test_killed_rank_ends_the_job(kind, tmp_path):
    with Job(kind, tmp_path) as job:
        status = job.wait()
        ended = time.time()
        killed_file = job.workdir / "killed.json"
        assert killed_file.is_file(), f"no rank reached the fault{job.output()}"
        killed = json.loads(killed_file.read_text())
        assert status == 128 + signal.SIGKILL, f"exit status {status}{job.output()}"
        assert ended - killed["time"] < LIMIT_S, f"the job took {ended - killed['time']:.1f} s to end"
        named = f"rank {killed['rank']} (PID {killed['pid']} on "
        assert job.last_line().startswith("unisonrun: the job failed (exit status 137): " + named), job.output()
        assert job.last_line().endswith("was killed by signal 9 (SIGKILL)"), job.output()
        assert_no_leftovers(job)
        if kind == "checkpoint":
            assert_last_complete_checkpoint_loads(job.workdir)


def assert_last_complete_checkpoint_loads(workdir: Path) -> None:
    """The save of step FAULT_STEP died half-way: the file still holds step FAULT_STEP - 1, whole."""
    state = np.load(workdir / "state.npy")
    assert state.shape == (2 << 20,)
    np.testing.assert_array_equal(state, np.full(state.shape, float(FAULT_STEP - 1)))


def test_rank_returning_early_ends_the_job(tmp_path):
    """Rank 1 returns from the script without ``join`` while rank 0 keeps all-reducing: an error, no hang."""
    with Job("early_exit", tmp_path) as job:
        status = job.wait()
        ended = time.time()
        returned = job.workdir / "returned"
        assert returned.is_file(), f"rank 1 never returned{job.output()}"
        assert status != 0, f"exit status 0{job.output()}"
        assert ended - float(returned.read_text()) < LIMIT_S
        output = job.output()
        assert "ShutdownError" in output, output
        summary = r"unisonrun: the job failed \(exit status \d+\): rank 0 .*MPI_Abort"
        assert re.search(summary, job.last_line()), output
        assert_no_leftovers(job)


@pytest.mark.parametrize("kind,named", [
    ("hard_exit", r"rank 1 \(PID \d+ on .*\) exited without calling MPI_Finalize"),
    ("raise", r"rank 1 \(on .*\) called MPI_Abort with error code 1"),
    ("exit3", r"rank 1 \(on .*\) called MPI_Abort with error code 3"),  # [Note: a rank that exits with a status]
], ids=["os._exit(0)", "raises", "sys.exit(3)"])
def test_rank_ending_abnormally_ends_the_job(kind, named, tmp_path):
    """docs/run.md, "Failures": a rank that exits 0 without MPI_Finalize, or raises, ends the job."""
    with Job(kind, tmp_path) as job:
        status = job.wait()
        ended = time.time()
        returned = job.workdir / "returned"
        assert returned.is_file(), f"rank 1 did not reach the fault{job.output()}"
        assert ended - float(returned.read_text()) < LIMIT_S, "the job took too long to end"
        assert status != 0, f"exit status 0{job.output()}"
        failed = r"^unisonrun: the job failed \(exit status \d+\): "
        assert re.search(failed + named, job.last_line()), job.output()
        if kind == "raise":
            assert "fault_job: rank 1 raises on purpose" in job.output()
        if kind == "exit3":
            assert status == 3, f"exit status {status}{job.output()}"
        assert_no_leftovers(job)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_stop_signal_to_unisonrun_ends_every_rank(signum, tmp_path):
    with Job("loop", tmp_path) as job:
        job.wait_for_ranks()
        assert job.process is not None
        job.process.send_signal(signum)
        start = time.monotonic()
        status = job.wait()
        assert time.monotonic() - start < 15, f"the job took {time.monotonic() - start:.1f} s to stop"
        assert status == 128 + signum, f"exit status {status}{job.output()}"
        name = signal.Signals(signum).name
        assert job.last_line() == f"unisonrun: the job was stopped by {name} (exit status {status})", job.output()
        assert_no_leftovers(job)
