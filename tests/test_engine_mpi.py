"""The engine under real mpirun at 2-4 ranks, plus stalls and shutdown in their own jobs."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
from harness import mpi_env, mpirun, run_rank_suite

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]


def run_script(tmp_path, text: str, np_: int = 2, args: tuple = (), timeout: int = 120, **env: str) -> str:
    """Run ``text`` as a script under mpirun with the ``UNISON_*`` settings ``env``; return its output,
    having checked that the job exited 0."""
    script = tmp_path / "script.py"
    script.write_text(text)
    proc = mpirun(np_, [sys.executable, str(script), *args], timeout=timeout, env=mpi_env(**env))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_engine(np_, tmp_path):
    run_rank_suite(np_, "mpi_engine.py", tmp_path)


STALL = """
import time, numpy as np, unison
from mpi4py import MPI
unison.init()
if unison.rank() == 1:
    t0 = time.monotonic()
    h = unison.allreduce_async(np.ones(3), name="grad/stuck")
    try:
        unison.synchronize(h)
        print("NO ERROR")
    except unison.StallError as e:
        print(f"rank 1 got StallError after {time.monotonic() - t0:.1f}s:", e, flush=True)
    MPI.COMM_WORLD.send("failed", dest=0)
else:
    MPI.COMM_WORLD.recv(source=1)   # (instead of a sleep: the same order at any machine load)
    # rank 0 never submitted it while it stalled: it is told, its late submission fails at once
    t0 = time.monotonic()
    try:
        unison.allreduce(np.ones(3), name="grad/stuck")
        print("NO ERROR ON RANK 0")
    except unison.StallError as e:
        print(f"rank 0 got StallError after {time.monotonic() - t0:.2f}s:", e, flush=True)
unison.allreduce(np.ones(1), name="after")
print(f"rank {unison.rank()} finished", flush=True)
"""


@pytest.mark.parametrize("check", ["1", "60"])
def test_stall_warning_names_tensor_and_missing_rank(tmp_path, check):
    """check 60: a shutdown time below the check time still fails the stalled collective at the shutdown
    time (before 2026-12-05 nothing happened until the check time)."""
    script = tmp_path / "stall.py"
    script.write_text(STALL)
    env = mpi_env(UNISON_STALL_CHECK_TIME_SECONDS=check, UNISON_STALL_SHUTDOWN_TIME_SECONDS="3")
    proc = mpirun(2, [sys.executable, str(script)], timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "stalled collectives: 'grad/stuck'" in out and "missing on rank(s) [0]" in out, out
    failed = next(line for line in out.splitlines() if line.startswith("rank 1 got StallError after"))
    assert "stalled for more than UNISON_STALL_SHUTDOWN_TIME_SECONDS=3" in failed, out
    assert float(failed.split("after ")[1].split("s:")[0]) < 30, failed
    assert "NO ERROR" not in out
    assert "rank 0 finished" in out and "rank 1 finished" in out
    # the stall inspector's decision reaches the rank that never submitted the name
    told = [line for line in out.splitlines() if "rank 0 got StallError after" in line]
    assert told and "UNISON_STALL_SHUTDOWN_TIME_SECONDS=3" in told[0] and "'grad/stuck'" in told[0], out
    assert float(told[0].split("after ")[1].split("s:")[0]) < 1.0, told


LATE = """
import time, numpy as np, unison
from mpi4py import MPI
unison.init()
r = unison.rank()
if r == 1:
    MPI.COMM_WORLD.recv(source=0)  # late: after rank 0's step 1 failed
for step in (1, 2):
    handles = {}
    for n in ("x", "y"):
        if r == 0 and step == 1 and n == "y":
            time.sleep(1.5)  # 'y' is younger than the limit when the stall round fails the step
        handles[n] = unison.allreduce_async(np.full(2, 10.0 ** step), op=unison.Sum, name=n)
    for n, h in handles.items():
        try:
            print(f"rank {r} step {step} {n} {unison.synchronize(h).tolist()}", flush=True)
        except unison.StallError:
            print(f"rank {r} step {step} {n} StallError", flush=True)
    if r == 0 and step == 1:
        MPI.COMM_WORLD.send("failed", dest=1)
print(f"rank {r} finished", flush=True)
"""


def test_a_stall_shutdown_leaves_no_late_call_to_pair_with_the_next_step(tmp_path):
    """Past the shutdown time every pending handle fails; a late rank's own calls of every one of those
    names fail at once, the young ones too. Before 2026-12-05 only names older than the limit were
    remembered: the late rank's step-1 'y' paired with rank 0's step-2 'y' (110 for 200), silently."""
    out = run_script(tmp_path, LATE, UNISON_STALL_CHECK_TIME_SECONDS="60", UNISON_STALL_SHUTDOWN_TIME_SECONDS="3")
    for r in (0, 1):
        assert f"rank {r} step 1 x StallError" in out and f"rank {r} step 1 y StallError" in out, out
        assert f"rank {r} step 2 x [200.0, 200.0]" in out and f"rank {r} step 2 y [200.0, 200.0]" in out, out
        assert f"rank {r} finished" in out, out


ABANDON = """
import numpy as np, unison
from mpi4py import MPI
from unison.common.engine import frontend
unison.init()
r = unison.rank()
eng = frontend.running_engine()
if r == 0:  # gives up on step 1: never submits 'g'
    eng.abandon("stage 0 raised ValueError")
else:
    try:
        unison.allreduce(np.ones(3), op=unison.Sum, name="g")
    except unison.StallError:
        print(f"rank {r} step 1 g StallError", flush=True)
MPI.COMM_WORLD.Barrier()  # the end-of-step agreement
if r == 0:
    eng.abandon(None)
print(f"rank {r} step 2 g {unison.allreduce(np.ones(3), op=unison.Sum, name='g').tolist()}", flush=True)
"""


def test_an_abandoned_step_leaves_the_next_steps_names_usable(tmp_path):
    """Before 2026-12-05 the abandoning rank remembered 'g' (pending on its peer) as stalled, so its
    step-2 'g' failed at once and the peer's waited: a deadlock, ended here by the collective timeout."""
    out = run_script(tmp_path, ABANDON, UNISON_COLLECTIVE_TIMEOUT_SECONDS="20")
    assert "rank 1 step 1 g StallError" in out, out
    assert "rank 0 step 2 g [2.0, 2.0, 2.0]" in out and "rank 1 step 2 g [2.0, 2.0, 2.0]" in out, out


SETS = """
import numpy as np, unison
from mpi4py import MPI
r = unison.rank
# 0. an init() whose sets cannot be registered leaves Unison stopped (a corrected init() ignored its sets)
try:
    unison.init(process_sets=[unison.ProcessSet([0, 5])])
except ValueError:
    print(f"rank {MPI.COMM_WORLD.Get_rank()} bad set refused, initialized: {unison.is_initialized()}", flush=True)
# 1. a set's id from an engine before a shutdown is not reused: it named another set of the new engine
pair = unison.ProcessSet([0, 1])
unison.init(process_sets=[pair])
unison.shutdown()
trio = unison.ProcessSet([0, 1, 2])
unison.init(process_sets=[trio, pair])
if r() < 2:
    out = unison.allreduce(np.full(2, 10.0 ** r()), op=unison.Sum, name="x", process_set=pair)
    print(f"rank {r()} pair sum {out.tolist()}", flush=True)
out = unison.allreduce(np.full(2, 10.0 ** r()), op=unison.Sum, name="y", process_set=trio)
print(f"rank {r()} trio sum {out.tolist()}", flush=True)
try:
    unison.init(process_sets=[unison.ProcessSet([1, 2])])  # initialized already: the set was ignored
except ValueError as e:
    print(f"rank {r()} second init: {e}", flush=True)
# 2. lists of one length with other ranks: every rank is told (members hung in the group's creation)
try:
    unison.add_process_set([0, 1] if r() == 0 else [0, 2])
    print(f"rank {r()} added a set it disagrees on", flush=True)
except unison.MismatchError as e:
    print(f"rank {r()} MismatchError: {e}", flush=True)
# 3. a stall on an added set: reported with the job's ranks, its failed request no longer in flight
late = unison.add_process_set([1, 2])
if r() == 1:
    try:
        unison.allreduce(np.ones(3), name="stuck.ps", process_set=late)
    except unison.StallError as e:
        print(f"rank 1 StallError: {e}", flush=True)
    MPI.COMM_WORLD.send("failed", dest=2)
    h = unison.allreduce_async(np.ones(3), name="stuck.ps", process_set=late)  # (DuplicateNameError before)
    print(f"rank 1 again {unison.synchronize(h).tolist()}", flush=True)
elif r() == 2:
    MPI.COMM_WORLD.recv(source=1)
    try:
        unison.allreduce(np.ones(3), name="stuck.ps", process_set=late)
    except unison.StallError:
        print("rank 2 told of the stall", flush=True)
    unison.allreduce(np.ones(3), name="stuck.ps", process_set=late)
MPI.COMM_WORLD.Barrier()  # (rank 0 waits outside the engine: an engine call would stall meanwhile)
unison.allreduce(np.ones(1), name="after")
print(f"rank {r()} finished", flush=True)
"""


def test_process_sets_agree_on_ranks_and_ids_and_their_stalls_name_job_ranks(tmp_path):
    out = run_script(tmp_path, SETS, 3, UNISON_STALL_CHECK_TIME_SECONDS="1",
                     UNISON_STALL_SHUTDOWN_TIME_SECONDS="2")
    assert "rank 0 pair sum [11.0, 11.0]" in out and "rank 1 pair sum [11.0, 11.0]" in out, out  # (111 before)
    assert all(f"rank {i} trio sum [111.0, 111.0]" in out for i in range(3)), out
    assert all(f"rank {i} bad set refused, initialized: False" in out for i in range(3)), out
    assert out.count("second init: init(process_sets=") == 3 and "already initialized" in out, out
    assert out.count("MismatchError: unison.add_process_set: the ranks passed different rank lists") == 3, out
    assert "added a set it disagrees on" not in out
    stall = next(line for line in out.splitlines() if line.startswith("rank 1 StallError"))
    assert "'stuck.ps'" in stall and "missing on rank(s) [2]" in stall, out  # (the set's rank 1 before)
    assert "rank 2 told of the stall" in out and "rank 1 again [1.0, 1.0, 1.0]" in out, out
    assert all(f"rank {i} finished" in out for i in range(3)), out


BAD_TIMELINE = """
import unison
try:
    unison.init()
    print(f"rank {unison.rank()} init ok", flush=True)
except unison.InvalidArgumentError as e:
    print("init refused:", e, flush=True)
"""


def test_a_timeline_path_rank_0_cannot_write_fails_init_on_every_rank(tmp_path):
    # it failed in rank 0's engine alone (a FileExistsError naming no variable); the others waited
    (tmp_path / "afile").write_text("")
    script = tmp_path / "bad_timeline.py"
    script.write_text(BAD_TIMELINE)
    env = mpi_env(UNISON_TIMELINE=str(tmp_path / "afile" / "tl.json"), UNISON_ABORT_ON_ERROR="0")
    proc = mpirun(2, [sys.executable, str(script)], timeout=60, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("init refused:") == 2 and "init ok" not in out, out
    assert "UNISON_TIMELINE=" in out and "cannot be written on rank 0" in out, out


BAD_ELASTIC_ON_ONE_RANK = """
import os
from mpi4py import MPI
if MPI.COMM_WORLD.Get_rank() == 1:
    os.environ["UNISON_ELASTIC_MIN_NP"] = "0"
import unison
try:
    unison.init()
    print("init ok", flush=True)
except unison.InvalidArgumentError as e:
    print(f"rank {MPI.COMM_WORLD.Get_rank()} init refused:", e, flush=True)
"""


def test_a_bad_elastic_variable_on_one_rank_fails_init_on_every_rank(tmp_path):
    """The elastic variables were parsed again for the ranks' comparison, raising a bare ValueError on that rank
    alone while the others waited in the exchange for ever (found by an audit, 2026-12-05)."""
    script = tmp_path / "bad_elastic.py"
    script.write_text(BAD_ELASTIC_ON_ONE_RANK)
    proc = mpirun(2, [sys.executable, str(script)], timeout=60, env=mpi_env(UNISON_ABORT_ON_ERROR="0"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert all(f"rank {r} init refused: unison.init(): settings are not valid on 1 of 2 rank(s): rank 1: "
               "UNISON_ELASTIC_MIN_NP='0'" in out for r in (0, 1)), out

SHUTDOWN = """
import time, numpy as np, unison
unison.init()
if unison.rank() == 0:
    h = unison.allreduce_async(np.ones(3), name="never")
    t0 = time.monotonic()
    try:
        unison.synchronize(h)
    except unison.ShutdownError as e:
        print(f"rank 0 ShutdownError after {time.monotonic() - t0:.1f}s:", e, flush=True)
    try:
        unison.allreduce(np.ones(1), name="later")
    except unison.ShutdownError as e:
        print("rank 0 later call refused:", e, flush=True)
else:
    time.sleep(1)
    unison.shutdown()
    print("rank 1 shut down", flush=True)
"""


def test_shutdown_fails_pending_handles_promptly(tmp_path):
    script = tmp_path / "shutdown.py"
    script.write_text(SHUTDOWN)
    start = time.monotonic()
    proc = mpirun(2, [sys.executable, str(script)], timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "rank 0 ShutdownError after" in out and "rank 0 later call refused" in out, out
    assert "rank 1 shut down" in out
    # the error names the rank that shut down, in the pending handle's error and in later calls'
    named = "rank 1 shut down (unison.shutdown() or the process exited) while this collective was pending"
    failed = next(line for line in out.splitlines() if line.startswith("rank 0 ShutdownError after"))
    refused = next(line for line in out.splitlines() if line.startswith("rank 0 later call refused"))
    assert named in failed and named in refused, out
    assert time.monotonic() - start < 30


#: steps of eight all-reduces until every rank's autotune is done
TUNE_LOOP = """
for step in range(400):
    hs = [unison.allreduce_async(np.ones(16384, np.float32), op=unison.Sum, name=f"w{i}") for i in range(8)]
    for h in hs:
        assert unison.synchronize(h)[0] == unison.size()
    if MPI.COMM_WORLD.allreduce(int(tuner.done), op=MPI.MIN):
        break
"""

AUTOTUNE = """
import numpy as np, unison
from mpi4py import MPI
from unison.common.engine import frontend
unison.init()
eng = frontend.engine()
tuner = eng.autotuner
""" + TUNE_LOOP + """histories = MPI.COMM_WORLD.allgather(list(tuner.history))
# the engine thread goes on cycling while each rank reads: a rank may hold one later entry (the final
# setting again); every entry both hold must agree (same values at the same cycles)
n = min(map(len, histories))
assert n > 0 and all(h[:n] == histories[0][:n] for h in histories), histories
settings = {(t, c) for _, t, c in tuner.history}
print(f"rank {unison.rank()} done={tuner.done} settings={len(settings)} "
      f"final={(eng.fusion_threshold, eng.cycle_time)}", flush=True)
"""


def test_autotune_moves_parameters_and_keeps_ranks_consistent(tmp_path):
    script = tmp_path / "tune.py"
    script.write_text(AUTOTUNE)
    log = tmp_path / "autotune.csv"
    env = mpi_env(UNISON_AUTOTUNE="1", UNISON_AUTOTUNE_LOG=str(log), UNISON_AUTOTUNE_STEPS_PER_SAMPLE="3")
    proc = mpirun(2, [sys.executable, str(script)], timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("done=True") == 2, out
    settings = {line.split("settings=")[1].split()[0] for line in out.splitlines() if "settings=" in line}
    assert all(int(s) >= 5 for s in settings), out
    finals = {line.split("final=")[1] for line in out.splitlines() if "final=" in line}
    assert len(finals) == 1, finals
    import csv

    rows = list(csv.DictReader(open(log)))
    assert len(rows) >= 8
    assert len({r["fusion_threshold_bytes"] for r in rows}) >= 5
    assert len({r["cycle_time_ms"] for r in rows}) >= 3
    assert all(float(r["bytes_per_s"]) > 0 for r in rows)


AUTOTUNE_KEEPS = """
import sys, numpy as np, unison
from mpi4py import MPI
from unison.common.engine import frontend
try:
    unison.init()
except unison.MismatchError as exc:
    print(f"rank {MPI.COMM_WORLD.Get_rank()} refused: {exc}", flush=True)
    sys.exit(0)
eng = frontend.engine()
tuner = eng.autotuner
""" + TUNE_LOOP + """thresholds = sorted({t for _, t, _ in tuner.history})
cycles = sorted({c for _, _, c in tuner.history})
print(f"rank {unison.rank()} done={tuner.done} thresholds={thresholds} cycles={cycles} "
      f"final={(eng.fusion_threshold, eng.cycle_time)}", flush=True)
"""


@pytest.mark.parametrize("case", ["threshold", "cycle", "both", "one-rank"])
def test_autotune_keeps_the_settings_that_were_set(case, tmp_path):
    """Horovod's autotune leaves a fusion threshold or cycle time the user set as it is. Before 2026-12-07
    Unison tried every candidate over it: UNISON_FUSION_THRESHOLD=0 (fusion off) ended fused."""
    script = tmp_path / "keeps.py"
    script.write_text(AUTOTUNE_KEEPS)
    log = tmp_path / "autotune.csv"
    env = mpi_env(UNISON_AUTOTUNE="1", UNISON_AUTOTUNE_LOG=str(log), UNISON_AUTOTUNE_STEPS_PER_SAMPLE="3")
    command = [sys.executable, str(script)]
    if case == "threshold":
        env["UNISON_FUSION_THRESHOLD"] = "0"
    elif case == "cycle":
        env["HOROVOD_CYCLE_TIME"] = "2"
    elif case == "both":
        env.update(UNISON_FUSION_THRESHOLD="0", UNISON_CYCLE_TIME="2")
    else:  # rank 1 alone sets the default's own value: equal values, but its autotune would keep it
        command = ["sh", "-c", f'[ "$OMPI_COMM_WORLD_RANK" = 1 ] && export UNISON_FUSION_THRESHOLD={128 << 20}; '
                   f'exec "$0" "$1"', *command]
    proc = mpirun(2, command, timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    if case == "one-rank":
        for r in (0, 1):
            assert f"rank {r} refused:" in out and "autotune keeps" in out and "'fusion_threshold'" in out, out
        return
    assert out.count("done=True") == 2, out
    finals = {line.split("final=")[1] for line in out.splitlines() if "final=" in line}
    assert len(finals) == 1, out
    if case == "both":
        assert finals == {"(0, 0.002)"} and "thresholds=[] cycles=[]" in out, out  # (seconds)
        assert not log.exists() and "tunes nothing" in out, out
        return
    import csv

    rows = list(csv.DictReader(open(log)))
    assert len(rows) >= 4, rows
    if case == "threshold":
        assert {r["fusion_threshold_bytes"] for r in rows} == {"0"}, rows
        assert len({r["cycle_time_ms"] for r in rows}) >= 4, rows
        assert "thresholds=[0]" in out and finals.pop().startswith("(0,"), out
    else:
        assert {float(r["cycle_time_ms"]) for r in rows} == {2.0}, rows
        assert len({r["fusion_threshold_bytes"] for r in rows}) >= 5, rows
        assert "cycles=[2.0]" in out and finals.pop().endswith(", 0.002)"), out


AUTOTUNE_SET = """
import time, numpy as np, unison
from mpi4py import MPI
from unison.common.engine import frontend
unison.init()
eng = frontend.engine()
tuner = eng.autotuner
default = eng.fusion_threshold
time.sleep(0.3)  # idle cycles with no warm-up sample: nothing applied before bytes flow
assert eng.fusion_threshold == default and not tuner.history, (eng.fusion_threshold, tuner.history)
every = unison.add_process_set(list(range(unison.size())))  # every gradient through a set of all ranks
for step in range(400):
    hs = [unison.allreduce_async(np.ones(16384, np.float32), op=unison.Sum, name=f"w{i}", process_set=every)
          for i in range(8)]
    for h in hs:
        assert unison.synchronize(h)[0] == unison.size()
    if MPI.COMM_WORLD.allreduce(int(tuner.done), op=MPI.MIN):
        break
settings = {(t, c) for _, t, c in tuner.history}
print(f"rank {unison.rank()} done={tuner.done} settings={len(settings)}", flush=True)
"""


def test_autotune_counts_a_process_set_of_every_rank_and_waits_for_bytes(tmp_path):
    """Before: only the global set's bytes counted, so a job reducing through a set of all ranks never
    tuned; and with no warm-up sample the first candidate (fusion threshold 0) was applied at the first
    cycle and kept for good."""
    script = tmp_path / "tune_set.py"
    script.write_text(AUTOTUNE_SET)
    env = mpi_env(UNISON_AUTOTUNE="1", UNISON_AUTOTUNE_STEPS_PER_SAMPLE="3", UNISON_AUTOTUNE_WARMUP_SAMPLES="0")
    proc = mpirun(2, [sys.executable, str(script)], timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("done=True") == 2, out
    settings = {line.split("settings=")[1].split()[0] for line in out.splitlines() if "settings=" in line}
    assert all(int(s) >= 5 for s in settings), out


SHUTDOWN_RACE = """
import collections, sys, time, numpy as np, unison
from mpi4py import MPI
TRIALS = 7   # the last time rank 1 exits instead (unison.shutdown() at interpreter exit)
for trial in range(TRIALS):
    unison.init()
    if unison.rank() == 1:
        time.sleep(0.05 + 0.05 * trial)
        if trial == TRIALS - 1:
            sys.exit(0)
        unison.shutdown()   # while rank 0 keeps submitting
    else:
        handles, i = [], 0
        while True:
            try:
                handles.append(unison.allreduce_async(np.ones(4), name=f"t{trial}.{i}"))
            except unison.ShutdownError:
                break
            i += 1
            if i % 8 == 0:
                time.sleep(0.0005)
        t0 = time.monotonic()
        outcomes = collections.Counter()
        for h in handles:
            try:
                h.wait(timeout=max(0.01, 10 - (time.monotonic() - t0)))
                outcomes["result"] += 1
            except unison.ShutdownError:
                outcomes["ShutdownError"] += 1
            except TimeoutError:
                outcomes["hung"] += 1
        try:
            unison.join()
            outcomes["join returned"] += 1
        except unison.ShutdownError:
            outcomes["join ShutdownError"] += 1
        print(f"trial {trial}: {len(handles)} handles, {dict(outcomes)} in {time.monotonic() - t0:.2f}s",
              flush=True)
        unison.shutdown()
    if trial < TRIALS - 1:
        MPI.COMM_WORLD.Barrier()
"""


def test_peer_shutdown_fails_every_pending_handle_every_time(tmp_path):
    script = tmp_path / "race.py"
    script.write_text(SHUTDOWN_RACE)
    proc = mpirun(2, [sys.executable, str(script)], timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    trials = [line for line in out.splitlines() if line.startswith("trial ")]
    assert len(trials) == 7, out
    for line in trials:
        handles = int(line.split(": ")[1].split(" handles")[0])
        assert f"'ShutdownError': {handles}" in line or handles == 0, line
        assert "hung" not in line and "'join ShutdownError': 1" in line, line
        assert float(line.rsplit(" in ", 1)[1].rstrip("s")) < 10.0, line


FORGOTTEN_JOIN = """
import numpy as np, unison
unison.init()
steps = 3 if unison.rank() == 1 else 1_000_000
for s in range(steps):
    unison.allreduce(np.ones(8), name=f"g{s % 4}")
print(f"rank {unison.rank()} finished its loop", flush=True)
"""


def test_rank_that_exits_early_ends_the_job_with_an_error(tmp_path):
    script = tmp_path / "forgot_join.py"
    script.write_text(FORGOTTEN_JOIN)
    start = time.monotonic()
    proc = mpirun(2, [sys.executable, str(script)], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "rank 1 finished its loop" in out and "rank 0 finished its loop" not in out, out
    assert "ShutdownError" in out, out
    assert "rank 1 shut down (unison.shutdown() or the process exited)" in out, out  # names who left
    assert time.monotonic() - start < 60


AUTOTUNE_UNEVEN = """
import numpy as np, unison
from mpi4py import MPI
from unison.common.engine import frontend
unison.init()
eng = frontend.engine()
tuner = eng.autotuner
n, r = unison.size(), unison.rank()
splits = [4096 if d == 0 else 1 for d in range(n)]   # rank 0 receives far more than the others
for step in range(150):
    out, _ = unison.alltoall(np.ones((sum(splits), 64), np.float32), splits=splits, name="a2a")
    assert out.shape == (splits[r] * n, 64)
    rs = unison.reducescatter(np.ones((2 * n + 1, 16384), np.float32), op=unison.Sum, name="rs")
    assert rs.shape[0] == (3 if r == 0 else 2) and np.all(rs == n)
    if MPI.COMM_WORLD.allreduce(int(len(tuner.history) >= 6), op=MPI.MIN):
        break
histories = MPI.COMM_WORLD.allgather(list(tuner.history))
n = min(map(len, histories))  # a rank may hold one later entry (see above)
assert n > 0 and all(h[:n] == histories[0][:n] for h in histories), histories
print(f"rank {r} changes={len(tuner.history)}", flush=True)
"""


def test_autotune_with_uneven_alltoall_and_reducescatter_does_not_deadlock(tmp_path):
    script = tmp_path / "tune_uneven.py"
    script.write_text(AUTOTUNE_UNEVEN)
    env = mpi_env(UNISON_AUTOTUNE="1", UNISON_AUTOTUNE_STEPS_PER_SAMPLE="2",
                  UNISON_AUTOTUNE_LOG=str(tmp_path / "tune.csv"))
    proc = mpirun(2, [sys.executable, str(script)], timeout=180, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    changes = [int(line.split("changes=")[1]) for line in out.splitlines() if "changes=" in line]
    assert len(changes) == 2 and min(changes) >= 6, out


COLLECTIVE_TIMEOUT = """
import os, sys, time, numpy as np, unison
from unison.common.engine import watchdog
unison.init()
case = sys.argv[1]
if unison.rank() == 1:
    if case == "engine-failure":
        from unison.collectives import kernels

        def boom(*args, **kwargs):
            raise RuntimeError("injected failure in rank 1's engine")

        kernels.allreduce = boom
        try:
            unison.allreduce(np.ones(4), name="grad/a")
        except RuntimeError as e:
            print("rank 1 caught:", e, flush=True)
    time.sleep(100)   # stopped taking part, without exiting
else:
    if case == "hook":
        def on_timeout(engine, report):
            print("HOOK CALLED:", report, flush=True)
            os._exit(7)

        watchdog.on_collective_timeout = on_timeout
    unison.allreduce(np.ones(4), name="grad/a")   # "missing": rank 1 never submits it
print("NOT ABORTED", flush=True)
"""


@pytest.mark.parametrize("case", ["missing", "engine-failure", "hook"])
def test_collective_timeout_ends_the_job_with_a_report(case, tmp_path):
    script = tmp_path / "timeout.py"
    script.write_text(COLLECTIVE_TIMEOUT)
    trace = tmp_path / "traces" / "tl.json"
    env = mpi_env(UNISON_COLLECTIVE_TIMEOUT_SECONDS="3", UNISON_TIMELINE=str(trace))
    start = time.monotonic()
    proc = mpirun(2, [sys.executable, str(script), case], timeout=90, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert time.monotonic() - start < 60, out
    assert "NOT ABORTED" not in out, out
    assert "UNISON_COLLECTIVE_TIMEOUT_SECONDS=3" in out and "'grad/a'" in out, out
    if case == "missing":
        assert "not submitted by rank(s) [1]" in out, out
        # the timeline is closed before the abort, its open slice ended (before 2026-12-05: no file at the
        # path, only an empty hidden temporary one beside it)
        events = json.loads(trace.read_text())
        assert [e["name"] for e in events if e["name"].startswith("job aborted")] == [
            "job aborted: the collective timeout (UNISON_COLLECTIVE_TIMEOUT_SECONDS)"], events
        slices = [e["ph"] for e in events if e.get("name") == "NEGOTIATE_ALLREDUCE"]
        assert slices == ["B", "E"], events
        assert sorted(p.name for p in trace.parent.iterdir()) == ["tl.json"]
    if case == "engine-failure":
        assert "rank 1 caught: injected failure" in out, out
        assert "submitted by every rank" in out, out
    if case == "hook":
        assert "HOOK CALLED:" in out, out


IDLE_BUSY_PEER = """
import sys, time, numpy as np, unison
unison.init()
submit_after = float(sys.argv[1])
if unison.rank() == 1:
    sys.setswitchinterval(100.0)  # this loop keeps the GIL: the engine thread here cannot answer a cycle
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        pass
    sys.setswitchinterval(0.005)
else:
    time.sleep(submit_after)  # nothing submitted meanwhile: the engine's idle cycle waits on rank 1
print(unison.rank(), unison.allreduce(np.ones(2), op=unison.Sum, name="after").tolist(), "NOT ABORTED", flush=True)
"""


@pytest.mark.parametrize("submit_after", ["5", "2.5"])
def test_collective_timeout_times_a_wait_from_its_request(tmp_path, submit_after):
    """Limit 4 s; rank 1 keeps its GIL for 5 s, so rank 0's idle cycle cannot end. Before 2026-12-05 that
    idle cycle counted as a collective past the limit and ended the job, with nothing pending (5), and
    when rank 0 then submitted at 2.5 s its request was timed from the cycle's start (4 s, not 2.5)."""
    out = run_script(tmp_path, IDLE_BUSY_PEER, args=(submit_after,), timeout=90,
                     UNISON_COLLECTIVE_TIMEOUT_SECONDS="4")
    assert out.count("[2.0, 2.0] NOT ABORTED") == 2, out


LATE_PEER = """
import time, numpy as np, unison
unison.init()
r = unison.rank()
took = []
for step in range(4):
    if r == 1:
        time.sleep(0.05)  # the late rank: idle while rank 0 waits
    t = time.monotonic()
    handles = [unison.allreduce_async(np.ones(100, np.float32), name=f"late.{j}") for j in range(3)]
    for h in handles:
        unison.synchronize(h)
    took.append(time.monotonic() - t)
print(f"rank {r} took {max(took[1:]):.3f}", flush=True)
"""


def test_asynchronous_calls_with_a_late_rank_take_less_than_a_cycle_time(tmp_path):
    """[Note: a peer with nothing to offer] Cycle time 400 ms, rank 1 submitting 50 ms late: before 2026-12-07
    a step took two cycle times (0.8 s), the late rank's submission missing the round it sat in; now rank 0
    waits for rank 1 (about 50 ms) and rank 1 for nothing."""
    out = run_script(tmp_path, LATE_PEER, timeout=90, UNISON_CYCLE_TIME="400")
    took = {int(line.split()[1]): float(line.split()[3]) for line in out.splitlines() if " took " in line}
    assert sorted(took) == [0, 1], out
    assert took[0] < 0.3 and took[1] < 0.25, out


def test_a_stall_round_is_due_at_the_shutdown_time_between_two_checks():
    """Check 2 s, shutdown 3 s: the rounds came every 2 s from the last one, so the handles failed at 4 s
    (check 60, shutdown 90: at 120 s) before 2026-12-05."""
    from types import SimpleNamespace

    from unison.common.engine.controller import FLAG_STALL_CHECK
    from unison.common.engine.stalls import stall_flags

    cfg = SimpleNamespace(stall_check_disable=False, stall_check_time_seconds=2.0, stall_shutdown_time_seconds=3.0,
                          deadlock_time_seconds=0.0)
    now = time.monotonic()
    ctl = SimpleNamespace(pending={"x": SimpleNamespace(submitted=now - 3.05)})
    assert stall_flags(ctl, cfg, last_report=now - 1.0) == FLAG_STALL_CHECK  # round at 2 s; 3 s passed since
    assert stall_flags(ctl, cfg, last_report=now - 0.01) == 0  # that round came after 3 s: judged already
    young = SimpleNamespace(pending={"x": SimpleNamespace(submitted=now - 2.5)})
    assert stall_flags(young, cfg, last_report=now - 0.5) == 0


def test_a_deadlock_round_is_due_once_a_thread_has_been_blocked_that_long():
    """The deadlock check raises a round only for a thread blocked on one of the set's pending requests,
    that long, with nothing submitted meanwhile, and once per such spell."""
    from types import SimpleNamespace

    from unison.common.engine import handles
    from unison.common.engine.controller import FLAG_STALL_CHECK
    from unison.common.engine.stalls import stall_flags

    cfg = SimpleNamespace(stall_check_disable=False, stall_check_time_seconds=60.0,
                          stall_shutdown_time_seconds=0.0, deadlock_time_seconds=2.0)
    now = time.monotonic()
    h = handles.Handle("x")
    ctl = SimpleNamespace(pending={"x": SimpleNamespace(submitted=now - 3.0, handle=h)}, last_add=now - 3.0,
                          set_id=0)
    assert stall_flags(ctl, cfg, last_report=0.0) == 0  # nobody waits on it: a slow rank, not a deadlock
    with handles._completion:
        handles._waiting[-1] = ((handles.Handle("other"),), now - 2.5)  # blocked, on another request
    try:
        assert stall_flags(ctl, cfg, last_report=0.0) == 0
        with handles._completion:
            handles._waiting[-1] = ((h,), now - 2.5)
        assert stall_flags(ctl, cfg, last_report=0.0) == FLAG_STALL_CHECK
        assert stall_flags(ctl, cfg, last_report=now - 0.1) == 0  # judged in this spell already
        ctl.last_add = now - 1.0  # something submitted a second ago: not quiet
        assert stall_flags(ctl, cfg, last_report=0.0) == 0
        ctl.last_add = now - 3.0
        with handles._completion:
            handles._waiting[-1] = ((h,), now - 1.5)  # blocked, but not for long enough
        assert stall_flags(ctl, cfg, last_report=0.0) == 0
        off = SimpleNamespace(**{**vars(cfg), "deadlock_time_seconds": 0.0})
        with handles._completion:
            handles._waiting[-1] = ((h,), now - 2.5)
        assert stall_flags(ctl, off, last_report=0.0) == 0
    finally:
        with handles._completion:
            del handles._waiting[-1]


DEADLOCK = """
import sys, time, numpy as np, unison
unison.init()
r = unison.rank()
mine = "b" if r == 2 else "a"
t0 = time.monotonic()
try:
    out = unison.allreduce(np.ones(3), name=mine)
    print(f"rank {r} NO ERROR {out}", flush=True)
except unison.StallError as e:
    print(f"rank {r} StallError after {time.monotonic() - t0:.1f}s: {e}", flush=True)
# the name this rank never submitted, late: it fails at once instead of pairing with a later call
t0 = time.monotonic()
try:
    unison.allreduce(np.ones(3), name="a" if r == 2 else "b")
    print(f"rank {r} late NO ERROR", flush=True)
except unison.StallError:
    print(f"rank {r} late StallError after {time.monotonic() - t0:.2f}s", flush=True)
# a rank that is busy (not waiting on a collective) for longer than the limit is not deadlocked
if r == 1:
    time.sleep(float(sys.argv[1]) * 2)
print(f"rank {r} slow {unison.allreduce(np.ones(2), op=unison.Sum, name='slow').tolist()}", flush=True)
"""


@pytest.mark.parametrize("limit", ["2", "0"])
def test_ranks_that_wait_on_collectives_nobody_else_submits_fail_instead_of_hanging(tmp_path, limit):
    """Ranks 0 and 1 wait for 'a', rank 2 for 'b': no rank can make progress. Before 2026-12-06 they waited
    for ever (the stall inspector only warned, unless a stall shutdown time was set); now every rank raises a
    StallError naming what each waits for after UNISON_DEADLOCK_TIME_SECONDS. 0 turns that off: here the
    stall shutdown (6 s) ends it instead."""
    out = run_script(tmp_path, DEADLOCK, np_=3, args=(limit if limit != "0" else "1",), timeout=120,
                     UNISON_DEADLOCK_TIME_SECONDS=limit, UNISON_STALL_SHUTDOWN_TIME_SECONDS="6")
    failed = {r: next(line for line in out.splitlines() if line.startswith(f"rank {r} StallError after"))
              for r in range(3)}
    for r, line in failed.items():
        took = float(line.split("after ")[1].split("s:")[0])
        if limit == "2":
            assert "deadlock: every rank of the job has waited at least 2 s" in line, out
            assert "rank 0 waits for 'a'" in line and "rank 1 waits for 'a'" in line, out
            assert "which rank(s) [2] never submitted" in line and "rank 2 waits for 'b'" in line, out
            assert "which rank(s) [0, 1] never submitted" in line, out
            assert 1.9 < took < 5.9, line  # (before the stall shutdown could have ended it)
        else:
            assert "stalled for more than UNISON_STALL_SHUTDOWN_TIME_SECONDS=6" in line and took >= 5.9, line
        assert f"rank {r} late StallError after 0.0" in out, out
        assert f"rank {r} slow [3.0, 3.0]" in out, out
    assert "NO ERROR" not in out, out


def test_a_wait_nested_on_one_thread_keeps_the_outer_waits_entry():
    """A collective run inside a wait on the same thread (a signal handler's checkpoint) replaced the outer
    wait's entry and deleted it on the way out: the outer wait was no longer counted, and its own exit raised
    KeyError in place of the collective's result (found by a review, 2026-12-06)."""
    from unison.common.engine import handles

    outer, inner = handles.Handle("outer"), handles.Handle("inner")
    me = threading.get_ident()
    seen = []

    def finish_inner():
        while handles._waiting.get(me, ((),))[0][:1] != (inner,):
            time.sleep(0.01)
        seen.append([h.name for h, _ in handles.blocked_waits()])
        inner.set_result("i")
        handles.wake_waiters()

    helper = threading.Thread(target=finish_inner)
    helper.start()
    with handles.waiting_on([outer]):  # (the outer wait, as a torch.distributed Work waits)
        assert inner.wait() == "i"  # (raised KeyError before)
        assert [h.name for h, _ in handles.blocked_waits()] == ["outer"]  # (empty before)
    helper.join()
    assert seen == [["inner", "outer"]]
    assert me not in handles._waiting


ACROSS_SETS = """
import time, numpy as np, unison
from mpi4py import MPI
unison.init()
r = unison.rank()
pair, low = unison.add_process_set([2, 3]), unison.add_process_set([0, 1])
def attempt(label, fn):
    t0 = time.monotonic()
    try:
        fn()
        print(f"rank {r} {label} NO ERROR", flush=True)
    except unison.StallError as e:
        print(f"rank {r} {label} StallError after {time.monotonic() - t0:.1f}s: {e}", flush=True)
# 1. across sets: ranks 0, 1, 3 wait in the job's set for rank 2, which waits in [2, 3] for rank 3
if r == 2:
    attempt("across", lambda: unison.allreduce(np.ones(2), name="b", process_set=pair))
else:
    attempt("across", lambda: unison.allreduce(np.ones(2), name="g"))
if r == 3:  # 'b' was pending on its set when the round failed it: rank 3's late call fails at once
    attempt("late b", lambda: unison.allreduce(np.ones(2), name="b", process_set=pair))
MPI.COMM_WORLD.Barrier()
# 2. one set stuck while the other ranks are elsewhere (an MPI barrier of their own)
if r < 2:
    attempt("pair", lambda: unison.allreduce(np.ones(2), name="x" if r == 0 else "y", process_set=low))
MPI.COMM_WORLD.Barrier()
# 2b. a wait with a timeout returns to other work: rank 0 is not blocked while the others wait for 'tb'
if r == 0:
    h = unison.allreduce_async(np.ones(2), op=unison.Sum, name="ta")
    try:
        h.wait(timeout=4.0)
    except TimeoutError:
        unison.allreduce(np.ones(2), name="tb")
    print(f"rank 0 timed {unison.synchronize(h).tolist()}", flush=True)
else:
    attempt("timed", lambda: unison.allreduce(np.ones(2), name="tb"))
    unison.allreduce(np.ones(2), op=unison.Sum, name="ta")
MPI.COMM_WORLD.Barrier()
# 3. rank 3 joined (it waits in join() for the others): the others' deadlock is judged without it
if r == 3:
    print(f"rank 3 join returned {unison.join()}", flush=True)
else:
    attempt("joined", lambda: unison.allreduce(np.ones(2), name="q" if r == 1 else "p"))
    unison.join()
MPI.COMM_WORLD.Barrier()
print(f"rank {r} after {unison.allreduce(np.ones(2), op=unison.Sum, name='after').tolist()}", flush=True)
"""


def test_a_deadlock_across_process_sets_and_one_inside_a_set_fail_on_their_ranks(tmp_path):
    """No set sees all of its ranks blocked on its own collectives when rank 2 waits in [2, 3] and the others
    in the job's set: the job-wide check fails both sets' pending handles. A set whose ranks are all blocked
    ends on its own while the other ranks are elsewhere. A joined rank waits in join(): the others' deadlock
    is judged without it, and a wait with a timeout does not count as blocked (its thread returns to other
    work: the first version failed this program; both found by an audit of it)."""
    out = run_script(tmp_path, ACROSS_SETS, np_=4, timeout=120, UNISON_DEADLOCK_TIME_SECONDS="2")
    lines = {r: next(x for x in out.splitlines() if x.startswith(f"rank {r} across StallError")) for r in range(4)}
    for line in lines.values():
        assert "rank 0 waits for 'g' (" in line and "rank 1 waits for 'g' (" in line, out
        assert "rank 3 waits for 'g' (" in line and "which rank(s) [2] never submitted" in line, out
        assert "rank 2 waits for 'b' on process set" in line and "(ranks [2, 3])" in line, out
        assert "which rank(s) [3] never submitted" in line, out
        assert float(line.split("after ")[1].split("s:")[0]) < 15, line
    assert "rank 3 late b StallError after 0.0" in out, out
    for r in (0, 1):
        line = next(x for x in out.splitlines() if x.startswith(f"rank {r} pair StallError"))
        assert "rank 0 waits for 'x'" in line and "rank 1 waits for 'y'" in line, out
        assert "deadlock: every rank of process set 2 (ranks [0, 1]) has waited" in line, out
    for r in range(3):
        line = next(x for x in out.splitlines() if x.startswith(f"rank {r} joined StallError"))
        assert "rank 0 waits for 'p'" in line and "rank 2 waits for 'p'" in line, out
        assert "rank(s) [1] never" in line, out
        assert "rank 1 waits for 'q'" in line and "rank(s) [0, 2] never" in line, out
        assert line.endswith("rank(s) [3] joined. Every rank must run the same collectives (names, and the order "
                             "it waits on them); a rank that runs out of batches before the others calls join(). "
                             "UNISON_DEADLOCK_TIME_SECONDS sets this limit (0: never fail, only warn)"), line
    assert "rank 3 join returned" in out, out
    assert "rank 0 timed [4.0, 4.0]" in out and all(f"rank {r} timed NO ERROR" in out for r in (1, 2, 3)), out
    for r in range(4):
        assert f"rank {r} after [4.0, 4.0]" in out, out
    assert out.count("NO ERROR") == 3, out  # (the timed case's)


BAD_OUTPUTS = """
import os, sys, numpy as np, unison
from unison.common.engine import frontend
folder = sys.argv[1]
os.environ["UNISON_TIMELINE"] = folder  # an existing folder: the rename onto it failed on rank 0 alone
try:
    unison.init()
    print(f"rank {unison.rank()} init ok", flush=True)
except ValueError as e:
    print(f"rank init refused: {e}", flush=True)
del os.environ["UNISON_TIMELINE"]
unison.init()
r = unison.rank()
try:
    unison.start_timeline(folder)
    print(f"rank {r} start ok", flush=True)
except OSError as e:
    print(f"rank {r} start refused: {e}", flush=True)
eng = frontend.running_engine()
print(f"rank {r} recording {eng.timeline.active}", flush=True)
print(f"rank {r} after {unison.allreduce(np.ones(1), op=unison.Sum, name='after').tolist()}", flush=True)
unison.shutdown()
print(f"rank {r} leftovers {sorted(n for n in os.listdir(os.path.dirname(folder)) if n.startswith('.'))}")
"""


def test_a_timeline_path_that_cannot_be_written_is_refused_on_every_rank(tmp_path):
    """A folder as UNISON_TIMELINE passed init's check and failed on rank 0 alone (the others hung in their
    first collective); start_timeline raised on rank 0 only and kept recording into a hidden file."""
    folder = tmp_path / "out" / "trace"
    folder.mkdir(parents=True)
    out = run_script(tmp_path, BAD_OUTPUTS, args=(str(folder),))
    assert out.count("rank init refused: unison.init(): settings are not valid") == 2 and "is a folder" in out, out
    assert "init ok" not in out, out
    for r in (0, 1):
        assert f"rank {r} start refused: rank 0 could not start the timeline" in out, out
        assert f"rank {r} recording False" in out and f"rank {r} after [2.0]" in out, out
        assert f"rank {r} leftovers []" in out, out
