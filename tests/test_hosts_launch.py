"""``unisonrun`` across test hosts (network namespaces, instance 1), and the host heartbeat.

The first part needs nothing: the heartbeat thread against an in-process fake network. The second
makes two test hosts with ``unison.run.testhosts`` (root and ``ip netns``; skipped with the reason
elsewhere) and launches real jobs across them with ``unisonrun --hostfile F`` and no other flag:
4 ranks on 2 hosts, a host that cannot be reached at launch, and a host that dies mid-job (its
processes killed, or its link taken down). Every launch runs under a timeout, and the time limits
asserted are the ones promised in docs/run.md ("Across hosts").
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict, deque
from pathlib import Path

import numpy as np
import pytest
from harness import hosts_for_test

from unison.common import heartbeat

ROOT = Path(__file__).resolve().parent.parent
INSTANCE = 1
UNREACHABLE_LIMIT_S = 30.0
LOST_HOST_LIMIT_S = 60.0


# --- the heartbeat in one process, on a fake network -------------------------------------------


class FakeNetwork:
    """Messages between fake ranks; none pass between ``cut`` ranks and the others (a downed link)."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int], deque[int]] = defaultdict(deque)
        self.cut: set[int] = set()
        self.lock = threading.Lock()


class FakeRequest:
    def __init__(self, done=None) -> None:
        self._done, self.cancelled = done or (lambda: True), False

    def Test(self) -> bool:  # noqa: N802 (mpi4py's name)
        return self.cancelled or self._done()

    def Cancel(self) -> None:  # noqa: N802
        self.cancelled = True


class FakeComm:
    """The few calls the heartbeat makes, between ranks of one :class:`FakeNetwork`."""

    def __init__(self, net: FakeNetwork, rank: int, size: int) -> None:
        self.net, self.rank, self.size = net, rank, size

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Isend(self, buffer, dest, tag):  # noqa: N802
        with self.net.lock:
            if (self.rank in self.net.cut) == (dest in self.net.cut):
                self.net.queues[(self.rank, dest)].append(int(buffer[0]))
        return FakeRequest()

    def Irecv(self, buffer, source, tag):  # noqa: N802
        def arrived() -> bool:
            with self.net.lock:
                queue = self.net.queues[(source, self.rank)]
                if not queue:
                    return False
                buffer[0] = queue.popleft()
                return True

        return FakeRequest(arrived)


def fake_ring(size: int, timeout: float, net: FakeNetwork | None = None):
    """``size`` heartbeats on one fake network; each records the lines it would abort with."""
    net = net or FakeNetwork()
    lost: dict[int, list[str]] = defaultdict(list)
    hosts = [f"host{r // 2}" for r in range(size)]  # two ranks per host
    beats = [heartbeat.Heartbeat(FakeComm(net, r, size), None, hosts, timeout, on_lost=lost[r].append)
             for r in range(size)]
    return net, beats, lost


def test_timings_and_neighbours():
    assert heartbeat.timings(30.0) == (5.0, 1.0)  # sends every 5 s, looks every second
    assert heartbeat.timings(3.0) == (0.5, 0.15)
    assert heartbeat.ring_neighbours(0, 4) == [1, 3]
    assert heartbeat.ring_neighbours(1, 2) == [0]
    assert heartbeat.ring_neighbours(0, 1) == []


def test_heartbeats_that_hear_each_other_never_report():
    net, beats, lost = fake_ring(4, timeout=0.6)
    for beat in beats:
        beat.start()
    time.sleep(2.0)  # more than three timeouts
    assert all(beat.stop() for beat in beats)
    assert not any(lost.values()), dict(lost)


def test_a_silent_host_is_named_after_the_timeout_and_not_before():
    net, beats, lost = fake_ring(4, timeout=0.6)
    for beat in beats:
        beat.start()
    time.sleep(0.3)
    net.cut |= {2, 3}  # host1 (ranks 2 and 3) loses its link
    cut_at = time.monotonic()
    while not lost[1] and time.monotonic() - cut_at < 10:
        time.sleep(0.01)
    seconds = time.monotonic() - cut_at
    while not (lost[0] and (lost[2] or lost[3])) and time.monotonic() - cut_at < 10:
        time.sleep(0.01)
    for beat in beats:
        beat.stop()
    assert lost[1] and lost[0], dict(lost)  # rank 1 watches rank 2, rank 0 watches rank 3
    assert lost[1][0].startswith("[unison] host host1 is not answering: rank 1 (on host0) has heard nothing "
                                 "from rank 2 on host1 for ")
    assert 0.6 - heartbeat.timings(0.6)[0] <= seconds < 0.6 + 1.0, seconds
    assert "host host0" in (lost[2] + lost[3])[0]  # the cut-off side blames the other: its line never arrives


def test_a_rank_that_says_goodbye_is_not_a_lost_host():
    net, beats, lost = fake_ring(2, timeout=0.5)
    for beat in beats:
        beat.start()
    time.sleep(0.2)
    assert beats[1].stop()  # rank 1 shut down early
    time.sleep(1.5)
    assert beats[0].stop()
    assert not lost[0], lost[0]


def test_a_watcher_that_stalls_blames_no_healthy_neighbour_and_a_stopping_one_reports_nobody():
    """[Note: only a neighbour's silence counts] Rank 0's look stalls for 1 s (an MPI_Test held up on a loaded
    host) while rank 1 keeps beating, and rank 0 is stopped during the stall. Silence was measured to the end of
    the look, so rank 0 reported rank 1's host lost after the job had finished (an audit's reproduction of
    the hosts test's exit 75, 2026-12-06)."""
    net, beats, lost = fake_ring(2, timeout=0.6)
    stall = threading.Event()
    receive = beats[0].comm.Irecv

    def slow_irecv(buffer, source, tag):
        request = receive(buffer, source, tag)
        arrived = request._done

        def done():
            if stall.is_set():
                stall.clear()
                time.sleep(1.0)
            return arrived()

        request._done = done
        return request

    beats[0].comm.Irecv = slow_irecv
    for beat in beats:
        beat.start()
    time.sleep(0.3)
    stall.set()
    time.sleep(0.2)
    assert beats[0].stop()  # (asked while stalled)
    beats[1].stop()
    # rank 0 blames nobody; rank 1 may rightly report rank 0, which sent nothing for longer than the limit
    assert not lost[0], dict(lost)


def test_a_goodbye_goes_out_behind_a_heartbeat_still_on_its_way():
    """A goodbye was skipped when the last heartbeat to that neighbour had not completed within the stop's wait,
    so the neighbour watched a rank that had finished and reported its host lost."""
    net, beats, lost = fake_ring(2, timeout=0.5)
    send, holding = beats[1].comm.Isend, threading.Event()

    def held_isend(buffer, dest, tag):
        request = send(buffer, dest, tag)  # (delivered, but not complete on the sender while held)
        return FakeRequest(lambda: not holding.is_set()) if holding.is_set() and buffer[0] != heartbeat.BYE \
            else request

    beats[1].comm.Isend = held_isend
    for beat in beats:
        beat.start()
    time.sleep(0.2)
    holding.set()
    time.sleep(0.3)
    stop_wait, heartbeat.STOP_WAIT_S = heartbeat.STOP_WAIT_S, 0.2
    try:
        beats[1].stop()
    finally:
        heartbeat.STOP_WAIT_S = stop_wait
    holding.clear()
    time.sleep(1.5)  # three timeouts: rank 0 would report rank 1 had its goodbye been dropped
    assert beats[0].stop()
    assert not lost[0], lost[0]


def test_the_heartbeat_thread_sleeps_between_looks():
    net, beats, lost = fake_ring(2, timeout=2.0)
    before = resource.getrusage(resource.RUSAGE_SELF)
    for beat in beats:
        beat.start()
    time.sleep(2.0)
    for beat in beats:
        beat.stop()
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert cpu < 0.2, f"two heartbeat threads used {cpu:.3f} s of CPU in 2 s"


def test_import_unison_registers_the_heartbeat():
    """A program that only does ``import unison`` gets the heartbeat: the init hook is registered."""
    code = ("import unison\nfrom unison.common import runtime\n"
            "print(any(getattr(h, '__module__', '') == 'unison.common.heartbeat' for h in runtime._init_hooks))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.stdout.strip() == "True", (
        "unison/__init__.py must import unison.common.heartbeat (it registers the init hook that starts "
        "the host heartbeat); " + result.stderr[-2000:])


# --- real jobs across two test hosts ------------------------------------------------------------

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys, time
    import numpy as np
    import unison
    import unison.common.heartbeat as heartbeat  # also imported by unison itself once wired

    unison.init()
    rank = unison.rank()
    total = unison.allreduce(np.arange(5.0) * (rank + 1), op=unison.Sum, name="check")
    print("RANK " + json.dumps({
        "rank": rank, "size": unison.size(), "host": socket.gethostname(),
        "local_rank": unison.local_rank(), "local_size": unison.local_size(),
        "cross_rank": unison.cross_rank(), "cross_size": unison.cross_size(),
        "sum": total.tolist(), "env": os.environ.get("UNISON_TEST_MARKER"),
        "user": os.environ.get("SOME_USER_SETTING"), "spaced": os.environ.get("SOME_SPACED_SETTING"),
        "heartbeat": heartbeat.running()}), flush=True)
    if sys.argv[1:] == ["train"]:
        step = 0
        while True:  # until a host dies
            unison.allreduce(np.ones(1000), name=f"step{step % 4}")
            step += 1
            if step == 10 and rank == 0:
                print("TRAINING", flush=True)
            time.sleep(0.05)
    if sys.argv[1:] == ["finish"]:  # the job's last seconds: no collective pending (saving), then exit
        for step in range(10):
            unison.allreduce(np.ones(1000), name=f"step{step % 4}")
        if rank == 0:
            print("TRAINING", flush=True)
        time.sleep(10)
    """
)


@pytest.fixture(scope="module")
def hosts():
    """Two test hosts with two slots each (instance 1), always torn down."""
    with hosts_for_test(INSTANCE) as made:
        yield made


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "ranks.py"
    path.write_text(RANK_SCRIPT)
    return str(path)


def launch_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.update(extra)
    return env


def unisonrun(args: list[str], timeout: float, **extra: str) -> subprocess.CompletedProcess[str]:
    """``python -m unison.run ARGS`` under ``timeout`` (a hang fails the test)."""
    try:
        return subprocess.run([sys.executable, "-m", "unison.run", *args], capture_output=True, text=True,
                              timeout=timeout, env=launch_env(**extra), cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"unisonrun {' '.join(args)} still running after {timeout} s: {exc.stderr!r}")


def ranks(stdout: str) -> list[dict]:
    return sorted((json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("RANK ")),
                  key=lambda r: r["rank"])


def last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_four_ranks_on_two_hosts_with_the_hostfile_alone(hosts, script):
    result = unisonrun(["--hostfile", hosts.hostfile, "-np", "4", sys.executable, script], timeout=180,
                       UNISON_TEST_MARKER="from-the-launcher")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    seen = ranks(result.stdout)
    expected_sum = sum(np.arange(5.0) * (r + 1) for r in range(4)).tolist()
    assert [r["host"] for r in seen] == [hosts.hosts[0]] * 2 + [hosts.hosts[1]] * 2
    assert [(r["local_rank"], r["local_size"]) for r in seen] == [(0, 2), (1, 2)] * 2
    assert [(r["cross_rank"], r["cross_size"]) for r in seen] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert all(r["sum"] == expected_sum and r["size"] == 4 for r in seen), seen
    assert all(r["env"] == "from-the-launcher" for r in seen), seen
    assert all(r["heartbeat"] for r in seen), "the heartbeat runs on every rank of a job across hosts"


SPACED_VALUE = "two words, a 'quote' and a \"double\" one; $HOME stays as written\nand a second line"


def test_environment_reaches_ranks_started_in_a_login_environment(hosts, script, tmp_path):
    """Over ssh a daemon starts with a clean environment: only what unisonrun forwards reaches the ranks.
    The user's own variables arrive on every rank, on both hosts, with their values as set (one with spaces,
    quotes and a newline); before 2026-12-06 the test set such a variable but never looked at it."""
    agent = tmp_path / "clean-agent.sh"
    agent.write_text(f"#!/bin/sh\nexec env -i HOME=/root PATH=/usr/bin:/bin {hosts.agent} \"$@\"\n")
    agent.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(Path(hosts.hostfile).read_text().replace(hosts.agent, str(agent)))
    result = unisonrun(["--hostfile", str(hostfile), "-np", "4", sys.executable, script], timeout=180,
                       UNISON_TEST_MARKER="x", SOME_USER_SETTING="kept", SOME_SPACED_SETTING=SPACED_VALUE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    seen = ranks(result.stdout)
    assert [r["host"] for r in seen] == [hosts.hosts[0]] * 2 + [hosts.hosts[1]] * 2, seen
    assert all(r["env"] == "x" and r["user"] == "kept" for r in seen), seen
    assert all(r["spaced"] == SPACED_VALUE for r in seen), seen


@pytest.fixture()
def link_down(hosts):
    """Takes the second test host's link down for the test; always brings it back."""
    namespace = hosts.hosts[1]
    switch = ["ip", "netns", "exec", namespace, "ip", "link", "set", "eth0"]
    subprocess.run([*switch, "down"], check=True, timeout=30)
    try:
        yield namespace
    finally:
        subprocess.run([*switch, "up"], check=True, timeout=30)


@pytest.mark.parametrize("fault", ["no-such-host", "link-down"])
def test_an_unreachable_host_fails_the_launch_naming_it(hosts, script, tmp_path, request, fault):
    if fault == "link-down":
        bad = request.getfixturevalue("link_down")
        hostfile = hosts.hostfile
    else:
        bad = "unison-no-such-host"
        hostfile = tmp_path / "hostfile"
        text = Path(hosts.hostfile).read_text().replace(f"{hosts.hosts[1]} ", f"{bad} ")
        hostfile.write_text(text)
    start = time.monotonic()
    result = unisonrun(["--hostfile", str(hostfile), "-np", "4", sys.executable, script], timeout=90)
    seconds = time.monotonic() - start
    assert result.returncode == 69, result.stdout[-2000:] + result.stderr[-2000:]
    assert seconds < UNREACHABLE_LIMIT_S, seconds
    line = last_line(result.stderr)
    assert line.startswith("unisonrun: error: cannot reach 1 of 2 host(s), so nothing was launched: "
                           f"host {bad}: "), line
    assert hosts.hosts[0] + ":" not in line and "RANK" not in result.stdout
    print(f"{fault}: launch failed after {seconds:.1f} s: {line}")


def kill_host(namespace: str) -> None:
    """Kills every process of a test host, as a crashed machine would lose them."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                          timeout=30).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


def cut_link(namespace: str) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, "ip", "link", "set", "eth0", "down"], check=True,
                   timeout=30)


@pytest.mark.parametrize("fault", ["kill", "link-down", "link-down-at-the-end"])
def test_a_host_dying_mid_job_ends_it_naming_the_host(hosts, script, fault):
    """``link-down-at-the-end``: the link goes down while the ranks do their last work without collectives, and
    they reach shutdown() meanwhile: before 2026-12-07 the heartbeat stopped first, and the job waited in
    MPI_Finalize for ever, naming nobody (an audit: still running 134 s after the fault)."""
    victim = hosts.hosts[1]
    mode = "finish" if fault == "link-down-at-the-end" else "train"
    fault = "link-down" if fault == "link-down-at-the-end" else fault
    process = subprocess.Popen([sys.executable, "-m", "unison.run", "--hostfile", hosts.hostfile, "-np", "4",
                                sys.executable, script, mode], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=launch_env(), cwd=ROOT)
    try:
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.extend(process.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + 180
        while not any(line.startswith("TRAINING") for line in out) and time.monotonic() < deadline:
            assert process.poll() is None, f"the job ended before the fault: {process.stderr.read()[-3000:]}"
            time.sleep(0.1)
        assert any(line.startswith("TRAINING") for line in out), "the job did not start training in 180 s"
        (kill_host if fault == "kill" else cut_link)(victim)
        fault_at = time.monotonic()
        try:
            stderr = process.communicate(timeout=LOST_HOST_LIMIT_S + 30)[1]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still ran {LOST_HOST_LIMIT_S + 30:g} s after host {victim} died ({fault})")
        seconds = time.monotonic() - fault_at
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if fault == "link-down":
            subprocess.run(["ip", "netns", "exec", victim, "ip", "link", "set", "eth0", "up"], timeout=30)
        kill_host(victim)  # nothing left behind on the lost host either
    line = last_line(stderr)
    print(f"{fault}: the job ended {seconds:.1f} s after the fault: {line}")
    assert process.returncode == 75, stderr[-3000:]
    assert seconds < LOST_HOST_LIMIT_S, seconds
    assert line.startswith(f"unisonrun: the job failed (exit status 75): host {victim} "), line
    if fault == "link-down":
        assert f"[unison] host {victim} is not answering" in stderr
        assert "stopped answering" in line and "UNISON_HOST_TIMEOUT_SECONDS" in line
    deadline = time.monotonic() + 10
    while True:
        survivors = subprocess.run(["ip", "netns", "pids", hosts.hosts[0]], capture_output=True, text=True,
                                   timeout=30).stdout.split()
        if not survivors or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not survivors, f"processes left on {hosts.hosts[0]}: {survivors}"


@pytest.mark.parametrize("tier", ["restart", "inplace"])
def test_a_host_whose_link_goes_down_under_the_elastic_driver_costs_a_restart_not_the_run(hosts, tmp_path, tier):
    """4 ranks on 2 test hosts train elastically; the second host's link goes down mid-epoch.

    Restart tier: the heartbeat ends the job naming the host, the driver leaves that host out and starts the
    job on the first host's 2 slots, which resumes from the commit on its disk. In-place tier with
    ``--detect-lost-hosts``: ULFM's failure detector declares the silent host's ranks failed, the 2 survivors
    shrink and roll back to their last commit in memory, no process restarts.
    Either way the run finishes like a replay."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_elastic_mpi import SCRIPT, job, reference_weights

    victim = hosts.hosts[1]
    out = tmp_path / "out"
    out.mkdir()
    # the restart tier's heartbeat ends the job after 6 s of silence; in place the detector (3 s) comes first
    timeout_s = "6" if tier == "restart" else "30"
    process = subprocess.Popen(
        [sys.executable, "-m", "unison.run", "--hostfile", hosts.hostfile, "-np", "4", "--elastic-mode", tier,
         "--min-np", "2", *(["--detect-lost-hosts"] if tier == "inplace" else []), sys.executable, SCRIPT,
         str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=launch_env(ELASTIC_STEP_SLEEP="0.3", UNISON_HOST_TIMEOUT_SECONDS=timeout_s), cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        progress = out / "progress0"
        while time.monotonic() < deadline and not (progress.exists() and progress.read_text().strip()
                                                   and int(progress.read_text()) >= 5):
            assert process.poll() is None, f"the job ended before the fault: {process.stderr.read()[-3000:]}"
            time.sleep(0.1)
        assert progress.exists(), "the job did not start training in 180 s"
        cut_at = time.time()
        cut_link(victim)
        try:
            stdout, stderr = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the elastic run still ran 300 s after host {victim}'s link went down")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        subprocess.run(["ip", "netns", "exec", victim, "ip", "link", "set", "eth0", "up"], timeout=30)
        kill_host(victim)
    detail = stderr[-5000:]
    print("\n".join(line for line in stderr.splitlines() if line.startswith(("unisonrun:", "elastic:"))))
    assert process.returncode == 0, detail
    outcomes = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if tier == "restart":
        assert f"host {victim}" in stderr and "starting job 1: 2 rank(s) on " + hosts.hosts[0] in stderr, detail
        assert [(r["rank"], r["size"], r["attempt"]) for r in outcomes] == [(0, 2, 1), (1, 2, 1)], detail
    else:
        assert "starting job 1" not in stderr and "recovered after a failure" in stderr, detail
        # both sides of the cut declared the other's ranks failed; only the side with a quorum (half, with rank 0)
        # may go on: the victim's ranks left the job instead of training beside it ([Note: a partitioned job])
        went_on = sorted(p.name[len("reset."):].rpartition(".")[0] for p in out.glob("reset.*"))
        assert went_on == [hosts.hosts[0]] * 2, f"{went_on}\n{detail}"
        assert [(r["rank"], r["size"], r["attempt"]) for r in outcomes] == [(0, 2, 0), (1, 2, 0)], detail
        for r in outcomes:
            assert [x["size"] for x in r["resets"]] == [2], detail
            took = r["resets"][0]["first_step_at"] - cut_at
            print(f"rank {r['rank']}: link cut -> next completed step {took:.2f} s, "
                  f"recover() {r['recovery_seconds']:.2f} s")
    steps = [(e, batch) for e, _, _, batch in outcomes[0]["log"]]
    sizes = [len(batch) for _, batch in steps]
    cut = sizes.index(2)
    assert cut % job.COMMIT_EVERY == 0 and set(sizes[:cut]) == {4} and set(sizes[cut:]) == {2}, sizes
    for got, want in zip(outcomes[0]["weights"], reference_weights(steps), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    assert outcomes[0]["weights"] == outcomes[1]["weights"]
    epoch0 = [i for e, batch in steps if e == 0 for rank in batch for i in rank]
    assert sorted(epoch0) == list(range(job.N)), "every sample of the interrupted epoch once"
