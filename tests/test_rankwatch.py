"""The restart tier's watch over this host's ranks (unison/run/rankwatch.py, unison/common/liveness.py).

A rank under the elastic driver leaves ``<state dir>/ranks-<attempt>/<host>.<pid>`` from ``init()``
to its normal exit; the driver's watch ends the job when a rank ends with its file still there,
and leaves it alone when the file went first.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from unison.run import rankwatch
from unison.run.rankwatch import RankWatch, folder, marker_name, parse_marker_name

pytestmark = pytest.mark.skipif(not rankwatch.available(), reason="needs pidfd_open (Linux 5.3)")

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _spawn(tmp: Path, rank: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(SLEEPER)
    (tmp / marker_name("hostA", proc.pid)).write_text(f"{rank}\n")
    return proc


def test_marker_names_round_trip() -> None:
    assert parse_marker_name(marker_name("node-1.example.org", 4242)) == ("node-1.example.org", 4242)
    assert parse_marker_name("notes.txt") is None and parse_marker_name("12345") is None
    assert folder("/x", 3) == Path("/x/ranks-000003")


def test_a_rank_killed_with_its_file_there_is_reported_at_once(tmp_path: Path) -> None:
    procs = [_spawn(tmp_path, r) for r in range(3)]
    deaths: list[tuple[int, int]] = []
    fired = threading.Event()
    watch = RankWatch(tmp_path, lambda rank, pid: (deaths.append((rank, pid)), fired.set()), host="hostA",
                      poll_s=0.02)
    watch.start()
    try:
        time.sleep(0.3)  # the watch has opened its pidfds
        begin = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        assert fired.wait(5), "the watch did not see the killed rank"
        assert time.monotonic() - begin < 1.0
        assert deaths == [(1, procs[1].pid)] and watch.died == (1, procs[1].pid)
    finally:
        watch.stop()
        for p in procs:
            p.kill()
            p.wait()


def test_a_rank_whose_file_went_first_is_an_exit_and_other_hosts_are_not_ours(tmp_path: Path) -> None:
    procs = [_spawn(tmp_path, r) for r in range(2)]
    other = subprocess.Popen(SLEEPER)
    (tmp_path / marker_name("hostB", other.pid)).write_text("2\n")  # another host's rank: not watched
    deaths: list[tuple[int, int]] = []
    watch = RankWatch(tmp_path, lambda rank, pid: deaths.append((rank, pid)), host="hostA", poll_s=0.02)
    watch.start()
    try:
        time.sleep(0.3)
        (tmp_path / marker_name("hostA", procs[0].pid)).unlink()  # a normal exit removes the file first
        procs[0].terminate()
        procs[0].wait()
        other.kill()
        other.wait()
        time.sleep(0.5)
        assert deaths == [] and watch.died is None
        procs[1].kill()  # a rank that ended before the watch saw its file still counts
        procs[1].wait()
        late = subprocess.Popen(SLEEPER)
        late.kill()
        late.wait()
        (tmp_path / marker_name("hostA", late.pid)).write_text("5\n")
        deadline = time.monotonic() + 5
        while watch.died is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watch.died in ((1, procs[1].pid), (5, late.pid))
    finally:
        watch.stop()
        for p in (*procs, other):
            p.kill()
            p.wait()


def test_watch_kills_the_job_it_watches(tmp_path: Path) -> None:
    """``watch(process)``: the first death kills ``process`` and everything below it."""
    job = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                            "print(c.pid, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    child = int(job.stdout.readline())
    (tmp_path / marker_name("hostA", child)).write_text("0\n")
    watch = RankWatch(tmp_path, host="hostA", poll_s=0.02)
    watch.watch(job)
    try:
        time.sleep(0.3)
        os.kill(child, signal.SIGKILL)
        assert job.wait(timeout=5) == -signal.SIGKILL
        assert watch.died == (0, child) and watch.mpirun_pid == job.pid
    finally:
        watch.stop()
        job.kill()
        job.wait()


@pytest.mark.parametrize("ending, stays", [("pass", False), ("raise SystemExit(76)", False),
                                           ("raise RuntimeError('boom')", False), ("os._exit(0)", True),
                                           ("os.kill(os.getpid(), 9)", True),
                                           # the training function returned: leaving by os._exit is no death
                                           ("from unison.common import liveness; liveness.release(); os._exit(0)",
                                            False)])
def test_a_rank_leaves_its_file_from_init_to_a_normal_exit(tmp_path: Path, ending: str, stays: bool) -> None:
    code = ("import json, os, socket, unison; unison.init(); "
            "print(json.dumps(sorted(os.listdir(os.environ['UNISON_ELASTIC_STATE_DIR'] + '/ranks-000004'))), "
            f"flush=True); {ending}")
    env = {**os.environ, "UNISON_ELASTIC_STATE_DIR": str(tmp_path), "UNISON_ELASTIC_ATTEMPT": "4"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out, err = proc.communicate(timeout=120)
    names = json.loads(out.splitlines()[0])
    assert names == [marker_name(socket.gethostname(), proc.pid)], err
    left = sorted(os.listdir(tmp_path / "ranks-000004"))
    assert (left == names) is stays, (ending, left, err)
