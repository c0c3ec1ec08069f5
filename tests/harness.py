"""Helpers for the tests that launch real mpirun jobs, each under a timeout."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
MPIRUN = str(VENV_BIN / "mpirun") if (VENV_BIN / "mpirun").exists() else "mpirun"

#: prepended to a rank script that expects deadlocks: ``attempt(label, fn)`` prints how ``fn`` ended on rank
#: ``r`` (a global of the script): "NO ERROR", or the engine's StallError and how long it took
ATTEMPT = """
import time as _time
from unison.common.engine.errors import StallError as _StallError
def attempt(label, fn):
    t0 = _time.monotonic()
    try:
        fn()
        print(f"rank {r} {label} NO ERROR", flush=True)
    except _StallError as e:
        print(f"rank {r} {label} StallError after {_time.monotonic() - t0:.1f}s: {e}", flush=True)
"""

# [Note: a temporary folder per launch]
# Open MPI keeps each launch's session folder, with PMIx's rendezvous files, in
# $TMPDIR/ompi.<mpirun's pid>; a launch that is killed leaves it behind. Over a long test run
# (TensorFlow's and torch's threads use up process ids quickly) a later mpirun can get a pid
# whose stale folder is still there, and PMIx then fails before any rank starts ("The PMIx
# server's listener thread failed to start"; seen once in CI). Each environment made here
# gets a folder of its own under one root that is removed when the tests end, so no launch
# can meet another's leftovers. The path stays short: PMIx's socket paths must fit in 108 bytes.
_TMP_ROOT = tempfile.mkdtemp(prefix="unison-t-", dir="/tmp" if os.path.isdir("/tmp") else None)
atexit.register(shutil.rmtree, _TMP_ROOT, True)


def mpi_env(**extra: str) -> dict[str, str]:
    """Environment for ranks: one thread per pool (several ranks share 2 cores) and a
    temporary folder of the launch's own (see [Note: a temporary folder per launch])."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
               MKL_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1",
               TMPDIR=tempfile.mkdtemp(prefix="", dir=_TMP_ROOT),
               PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    env.update(extra)
    return env


@contextlib.contextmanager
def hosts_for_test(instance: int, hosts: int = 2, slots: int = 2, rate: str | None = None) -> Iterator[Any]:
    """Test hosts of ``instance`` for the ``with`` block, always torn down; skips the test (saying
    why) on a machine that cannot make them (not root, no ``ip netns``)."""
    from unison.run import testhosts

    reason = testhosts.available()
    if reason is not None:
        print(f"\ntest hosts cannot be made here, skipping: {reason}")
        pytest.skip(f"test hosts cannot be made here: {reason}")
    made = testhosts.up(hosts, slots=slots, rate=rate, instance=instance)
    try:
        yield made
    finally:
        testhosts.down(instance)


def host_flags(hosts: Any) -> list[str]:
    """mpirun flags that place ranks on the test hosts ``hosts`` (a ``testhosts.TestHosts``).

    ``--map-by slot`` fills each host before the next (ranks 0-1 on the first host of two);
    TCP (and PRRTE's own wire) is pinned to the test subnet, so nothing between hosts can take
    another road; shared memory is used only within a host (see [Note: no shared memory between
    test hosts] in ``unison/run/testhosts.py``).
    """
    from unison.run import testhosts

    return testhosts.mpirun_arguments(hosts) + ["--map-by", "slot", "--mca", "btl", "tcp,sm,self"]


def mpirun(np_: int, args: list[str], timeout: float = 240, env: dict[str, str] | None = None,
           cwd: Path = ROOT, hosts: Any = None, linger_ok: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``args`` on ``np_`` ranks with the venv's mpirun; a hang fails after ``timeout`` s.

    With ``hosts`` (test hosts made by ``unison.run.testhosts``) the ranks run across them.
    ``linger_ok``: return the output so far (exit status -9) instead of failing when mpirun is
    still running at the timeout. For jobs that end by a rank's SIGKILL under ``--with-ft ulfm``:
    Open MPI 5.0's prterun was seen, rarely, to outlive every rank of such a job (no process of
    the job left) and never exit; the test then judges what the ranks printed.
    """
    cmd = [MPIRUN, "-np", str(np_), "--bind-to", "none", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if hosts is not None:
        cmd += host_flags(hosts)
    else:  # as unisonrun does on one host: [Note: the libfabric BTL on one host] in unison/run/launcher.py
        cmd += ["--mca", "btl", "^ofi"]
    try:
        return subprocess.run(cmd + args, env=env or mpi_env(), cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        if linger_ok:
            err += f"\n[mpirun still running after {timeout}s]"
            return subprocess.CompletedProcess(cmd + args, -9, out, err)
        pytest.fail(f"mpirun -np {np_} {' '.join(args)} hung for {timeout}s\n{out[-4000:]}\n{err[-4000:]}")


def run_rank_suite(np_: int, suite: str, tmp_path: Path, timeout: float = 240,
                   extra_env: dict[str, str] | None = None, pytest_args: list[str] | None = None,
                   hosts: Any = None) -> None:
    """Run the pytest file ``tests/mpi/<suite>`` on every rank and check all ranks agree.

    Each rank writes its own JUnit XML; the job passes when every rank ran the same
    tests and every one of them passed on every rank.
    """
    env = mpi_env(**(extra_env or {}))
    runner = str(ROOT / "tests" / "mpi" / "run_suite.py")
    proc = mpirun(np_, [sys.executable, runner, str(tmp_path), str(ROOT / "tests" / "mpi" / suite)]
                  + (pytest_args or []), timeout=timeout, env=env, hosts=hosts)
    reports = sorted(tmp_path.glob("junit-rank-*.xml"))
    detail = f"\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"mpirun exited {proc.returncode}" + detail
    assert len(reports) == np_, f"expected {np_} JUnit reports, found {len(reports)}" + detail
    outcomes = []
    for report in reports:
        suite_el = ET.parse(report).getroot()
        suite_el = suite_el if suite_el.tag == "testsuite" else suite_el.find("testsuite")
        assert suite_el is not None
        counts = {k: int(suite_el.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        assert counts["failures"] == 0 and counts["errors"] == 0, f"{report.name}: {counts}" + detail
        outcomes.append(counts)
    assert all(o == outcomes[0] for o in outcomes), f"ranks disagree: {outcomes}" + detail
    assert outcomes[0]["tests"] > outcomes[0]["skipped"], "no test ran" + detail
