"""Every collective x op x dtype x algorithm under real mpirun at 1-4 ranks; init()'s agreement checks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import mpi_env, mpirun, run_rank_suite

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_collectives(np_, tmp_path):
    run_rank_suite(np_, "mpi_collectives.py", tmp_path)


def test_collectives_streamed_in_small_pieces(tmp_path):
    """Tiny pieces exercise piece matching when segments differ in length (n=3)."""
    run_rank_suite(3, "mpi_collectives.py", tmp_path, extra_env={"UNISON_CHUNK_BYTES": "1000"},
                   pytest_args=["-k", "not hypothesis"])


# ------------------------------------------------------------------ init(): agreement before the engine

THREAD_SCRIPT = '''
import os, sys
import mpi4py
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
if sys.argv[1] == "all" or rank == 1:
    mpi4py.rc.thread_level = "serialized"
import unison
try:
    unison.init()
except unison.UnisonError as exc:
    assert not unison.is_initialized()
    print(f"rank {rank} raised {type(exc).__name__}: {exc}", flush=True)
    sys.exit(0)
print(f"rank {rank} initialized without error", flush=True)
sys.exit(3)
'''


def _script(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _every_rank_said(proc, np_: int, text: str) -> list[str]:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    lines = [next((ln for ln in out.splitlines() if ln.startswith(f"rank {r} ")), "") for r in range(np_)]
    for r, line in enumerate(lines):
        assert text in line, f"rank {r}: {line!r}\n{out[-6000:]}"
    return lines


@pytest.mark.parametrize("np_, mode", [(2, "all"), (3, "one")])
def test_thread_level_below_multiple_raises_on_every_rank(np_, mode, tmp_path):
    """mpi4py.rc.thread_level = "serialized" (on every rank, or on rank 1 only): every rank raises."""
    proc = mpirun(np_, [sys.executable, _script(tmp_path, "threads.py", THREAD_SCRIPT), mode], timeout=240)
    for line in _every_rank_said(proc, np_, "raised UnisonError"):
        assert "rank 1: MPI_THREAD_SERIALIZED" in line and "MPI_THREAD_MULTIPLE" in line
        assert "mpi4py.rc.thread_level" in line


def test_thread_level_below_multiple_raises_in_a_single_process(tmp_path):
    proc = subprocess.run([sys.executable, _script(tmp_path, "threads.py", THREAD_SCRIPT), "all"],
                          env=mpi_env(), capture_output=True, text=True, timeout=240)
    line = _every_rank_said(proc, 1, "raised UnisonError")[0]
    assert "rank 0: MPI_THREAD_SERIALIZED" in line


SETTINGS_SCRIPT = '''
import os, sys
import numpy as np
import unison
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
size = int(os.environ["OMPI_COMM_WORLD_SIZE"])

def step(name, env, exc_type):
    saved = dict(os.environ)
    os.environ.update(env.get(rank, {}))
    try:
        unison.init()
    except exc_type as exc:
        assert not unison.is_initialized()
        print(f"rank {rank} {name} raised {type(exc).__name__}: {exc}", flush=True)
    else:
        print(f"rank {rank} {name} initialized", flush=True)
        sys.exit(3)
    finally:
        os.environ.clear()
        os.environ.update(saved)

# a malformed value on one rank only: every rank raises (none waits in a collective)
step("bad", {1: {"UNISON_CYCLE_TIME": "inf"}}, ValueError)
# per-host drift: a different fusion threshold on rank 1 (and an alias on rank 2)
step("drift", {1: {"UNISON_FUSION_THRESHOLD": "1048576"}, 2: {"HOROVOD_CYCLE_TIME": "5"}},
     unison.MismatchError)
# settings only one rank uses may differ; then init() succeeds and the job goes on
os.environ["UNISON_LOG_LEVEL"] = "ERROR" if rank == 0 else "WARNING"
unison.init(allreduce_algorithm="ring")
total = unison.allreduce(np.ones(3), op=unison.Sum, name="after-init")
assert total.tolist() == [size] * 3, total
unison.shutdown()
print(f"rank {rank} clean init ok", flush=True)
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_settings_that_must_match_are_compared_at_init(np_, tmp_path):
    proc = mpirun(np_, [sys.executable, _script(tmp_path, "settings.py", SETTINGS_SCRIPT)], timeout=240)
    out = proc.stdout + proc.stderr
    bad = _every_rank_said(proc, np_, "bad raised InvalidArgumentError")
    for line in bad:
        assert "rank 1: UNISON_CYCLE_TIME='inf' is not valid: expected a finite number in (0, 60000]" in line
    lines = [ln for ln in out.splitlines() if " drift raised " in ln]
    assert len(lines) == np_, out[-6000:]
    for line in lines:
        assert "MismatchError" in line
        assert ("UNISON_FUSION_THRESHOLD (fusion_threshold): rank 0: 134217728 (from default), "
                "rank 1: 1048576 (from UNISON_FUSION_THRESHOLD)") in line
        if np_ == 3:
            assert "rank 2: 134217728 (from default)" in line
            assert "UNISON_CYCLE_TIME (cycle_time): rank 0: 1.0 (from default), rank 1: 1.0 (from default), " \
                   "rank 2: 5.0 (from HOROVOD_CYCLE_TIME)" in line
        assert "UNISON_LOG_LEVEL" not in line
    assert sum(f"rank {r} clean init ok" in out for r in range(np_)) == np_, out[-6000:]


# ------------------------------------------------------------------ topology-aware and deterministic algorithms

@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_hierarchical_and_deterministic(np_, tmp_path):
    """Hosts simulated by splitting the ranks (r // 2, r % 2); 3 ranks make a non-homogeneous layout."""
    run_rank_suite(np_, "mpi_hierarchical.py", tmp_path)


def test_the_collectives_demo_checks_every_result_on_every_rank():
    """examples/collectives_demo.py at 3 ranks: one ``ok=`` per collective, each agreed by every rank (before
    2026-12-07 the all-gather, reduce-scatter and all-to-all lines printed no check, and the others were rank 0's
    own)."""
    from harness import ROOT

    proc = mpirun(3, [sys.executable, str(ROOT / "examples" / "collectives_demo.py"), "--size-mb", "1"],
                  timeout=240, env=mpi_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = [line for line in proc.stdout.splitlines() if "ok=" in line]
    assert len(checks) == 7 and all(line.rstrip().endswith("ok=True") for line in checks), proc.stdout
