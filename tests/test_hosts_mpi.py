"""Jobs across test hosts: 2 network namespaces x 2 ranks that Open MPI treats as 2 nodes.

The collectives, engine, torch and Keras suites run again with their ranks on two hosts; the
links between hosts are TCP over veth pairs (proved below: a rate limit on the link bounds a
cross-host transfer), shared memory is used only within a host. Needs root and ``ip netns``;
elsewhere every test here is skipped with the reason printed.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from harness import ROOT, hosts_for_test, mpi_env, mpirun, run_rank_suite

from unison.run import testhosts

#: a loaded machine runs these suites slower across hosts: a rank dumps its stacks after 500 s
SLOW = {"TEST_HANG_DUMP_S": "500"}

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(900)]

INSTANCE = 7  # its own namespaces and subnet (198.18.7.0/24), apart from a user's instance 0
SHAPED_INSTANCE = 8


def _skip_reason() -> str | None:
    reason = testhosts.available()
    if reason is not None:
        print(f"\ntests/test_hosts_mpi.py skipped: test hosts cannot be made here: {reason}")
    return reason


@pytest.fixture(scope="module")
def hosts():
    with hosts_for_test(INSTANCE) as made:
        yield made


TOPOLOGY = '''
import socket, sys, time
import numpy as np
import unison
from mpi4py import MPI
unison.init()
r = unison.rank()
print(f"rank {r} host {socket.gethostname()} local {unison.local_rank()}/{unison.local_size()} "
      f"cross {unison.cross_rank()}/{unison.cross_size()}", flush=True)
w = MPI.COMM_WORLD
buf = np.zeros(int(sys.argv[1]), np.uint8)
for peer in (1, 2):  # rank 1 shares rank 0's host, rank 2 does not
    w.Barrier()
    t = time.perf_counter()
    if r == 0:
        w.Send(buf, peer)
    elif r == peer:
        w.Recv(buf, 0)
    w.Barrier()
    if r == 0:
        print(f"to {peer}: {time.perf_counter() - t:.4f} s", flush=True)
unison.shutdown()
'''


@pytest.mark.parametrize("launcher", ["mpirun", "unisonrun"])
def test_topology_and_links_are_tcp_between_hosts_only(tmp_path, launcher):
    """local/cross ranks follow the hosts; a cross-host transfer is bounded by the link's rate.

    If Open MPI used shared memory between the namespaces, 8 MiB would cross in milliseconds;
    at 100 Mbit/s each way it needs at least 0.67 s on the wire. Checked under the harness's own
    mpirun flags and under ``unisonrun --hostfile`` alone, the path users take (it pins no BTL list:
    before 2026-12-06 only the harness's flags were checked; an audit).
    """
    script = tmp_path / "topology.py"
    script.write_text(TOPOLOGY)
    with hosts_for_test(SHAPED_INSTANCE, rate="100mbit") as shaped:
        if launcher == "mpirun":
            proc = mpirun(4, [sys.executable, str(script), str(8 << 20)], timeout=180, hosts=shaped)
        else:
            proc = subprocess.run([sys.executable, "-m", "unison.run", "--hostfile", shaped.hostfile, "-np", "4",
                                   sys.executable, str(script), str(8 << 20)], capture_output=True, text=True,
                                  timeout=180, env=mpi_env(), cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for r in range(4):
        host = shaped.hosts[r // 2]
        want = f"rank {r} host {host} local {r % 2}/2 cross {r // 2}/2"
        assert want in out, f"{want!r} not in:\n{out[-4000:]}"
    local = float(out.split("to 1: ")[1].split()[0])
    remote = float(out.split("to 2: ")[1].split()[0])
    assert remote >= 0.6, f"8 MiB crossed a 100 Mbit/s link in {remote:.3f} s: not over TCP\n{out}"
    assert local < remote / 4, f"within a host {local:.3f} s vs across {remote:.3f} s\n{out}"


def test_collectives_suite_across_hosts(hosts, tmp_path):
    """Every collective, op and algorithm (the narrow dtypes are left to the one-host runs)."""
    run_rank_suite(4, "mpi_collectives.py", tmp_path, timeout=600, hosts=hosts, extra_env=SLOW,
                   pytest_args=["-k", "not hypothesis and not float16 and not int8 and not int16"])


def test_hierarchical_suite_across_hosts(hosts, tmp_path):
    """Topology, hierarchical and host-ordered algorithms, deterministic mode, on real hosts
    (its last tests shut Unison down and start it again: the heartbeat must survive that)."""
    run_rank_suite(4, "mpi_hierarchical.py", tmp_path, timeout=600, hosts=hosts, extra_env=SLOW)


def test_engine_suite_across_hosts(hosts, tmp_path):
    run_rank_suite(4, "mpi_engine.py", tmp_path, timeout=600, hosts=hosts, extra_env=SLOW)


def test_torch_training_equivalence_across_hosts(hosts, tmp_path):
    run_rank_suite(4, "mpi_torch.py", tmp_path, timeout=600, hosts=hosts, extra_env=SLOW,
                   pytest_args=["-k", "global_batch or accumulates or optimizer_state"])


def test_keras_training_equivalence_across_hosts(hosts, tmp_path):
    run_rank_suite(4, "mpi_keras.py", tmp_path, timeout=600, hosts=hosts, extra_env=SLOW,
                   pytest_args=["-k", "fit_matches_one_process"])


def _results(tmp_path: Path, tag: str, hosts=None, mode: str = "collectives",
             **env: str) -> list[dict[str, np.ndarray]]:
    """Every rank's results of ``tests/hosts/reproduce.py`` in ``mode``, run on 4 ranks: on one host, or on
    ``hosts`` (2 x 2)."""
    out = tmp_path / tag
    out.mkdir()
    proc = mpirun(4, [sys.executable, str(ROOT / "tests" / "hosts" / "reproduce.py"), str(out), mode],
                  timeout=300, env=mpi_env(**env), hosts=hosts)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [dict(np.load(out / f"rank-{r}.npz")) for r in range(4)]


def _bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_results_across_hosts_match_one_host(hosts, tmp_path):
    """A forced algorithm gives the same bits on 2 hosts as on one, directly and through the engine one
    tensor at a time; ``auto`` agrees to tolerance
    (across hosts it may switch to the hierarchical all-reduce, another summation order); with
    ``UNISON_DETERMINISTIC=1`` everything, fused or not, one host or two, gives the same bits."""
    one = _results(tmp_path, "one-host")
    two = _results(tmp_path, "two-hosts", hosts=hosts)
    for r in range(4):
        for key, value in one[r].items():
            other = two[r][key]
            assert _bitwise_equal(other, two[0][key]), f"rank {r} and 0 differ on {key} (two hosts)"
            if key.startswith(("direct.ring", "direct.rhd", "engine.ring", "engine.rhd")):
                assert _bitwise_equal(value, other), f"{key}: one host vs two hosts differ"
            else:
                np.testing.assert_allclose(other, value, rtol=1e-5, atol=1e-4, err_msg=key)
    det_one = _results(tmp_path, "det-one-host", UNISON_DETERMINISTIC="1")
    det_two = _results(tmp_path, "det-two-hosts", hosts=hosts, UNISON_DETERMINISTIC="1")
    reference = [sum(x.astype(np.float32) for x in inputs_of_every_rank(i)) for i in range(5)]
    for results in (det_one[0], det_two[0], det_two[3]):
        for i in range(5):
            for key in (f"engine.fused.{i}", f"engine.single.{i}", f"direct.auto.{i}"):
                assert _bitwise_equal(results[key], det_one[0][f"engine.fused.{i}"]), key
            # rank order: ((x0 + x1) + x2) + x3 in float32, exactly
            assert _bitwise_equal(results[f"engine.fused.{i}"], reference[i]), f"tensor {i}"


def _reproduce():
    sys.path.insert(0, str(ROOT / "tests" / "hosts"))
    try:
        import reproduce
    finally:
        sys.path.pop(0)
    return reproduce


def inputs_of_every_rank(i: int) -> list[np.ndarray]:
    return [_reproduce().inputs(r)[i] for r in range(4)]


#: autotune's trials as short as they go (a new setting after every cycle that reduced 1 MiB), over the ring:
#: there, without deterministic mode, a tensor's bits depend on where it sits in a fused buffer
TUNED_RING = {"UNISON_AUTOTUNE": "1", "UNISON_AUTOTUNE_WARMUP_SAMPLES": "0",
              "UNISON_AUTOTUNE_STEPS_PER_SAMPLE": "1", "UNISON_ALLREDUCE_ALGORITHM": "ring"}


def test_deterministic_results_depend_on_neither_autotune_nor_hosts(hosts, tmp_path):
    """Issue 12: with ``UNISON_DETERMINISTIC=1`` "the reduction order depends on neither fusion, autotune nor
    timing". Autotune's trials change the fusion threshold (0 to 128 MiB: every tensor alone, some fused, all
    in one buffer) and then the cycle time, between and within the rounds; every round, on one host and on two,
    gives the bits of the rank-order sum. Without deterministic mode the same runs' rounds disagree (the check
    can fail). (Before 2026-12-06 autotune was left out of these tests.)"""
    reference = [sum(x.astype(np.float32) for x in inputs_of_every_rank(i)) for i in range(5)]
    rounds = _reproduce().ROUNDS
    control = _results(tmp_path, "tuned-ring", mode="rounds", **TUNED_RING)
    distinct = [len({control[0][f"engine.tuned.{k}.{i}"].tobytes() for k in range(rounds)}) for i in range(5)]
    assert max(distinct) > 1, "without UNISON_DETERMINISTIC autotune changed no bits: this test could not fail"
    for tag, where in (("one-host", None), ("two-hosts", hosts)):
        log = tmp_path / f"autotune-{tag}.csv"
        results = _results(tmp_path, f"det-tuned-{tag}", hosts=where, mode="rounds", UNISON_DETERMINISTIC="1",
                           UNISON_AUTOTUNE_LOG=str(log), **TUNED_RING)
        with log.open() as f:
            tried = {int(row["fusion_threshold_bytes"]) for row in csv.DictReader(f)}
        assert len(tried) >= 3, f"{tag}: autotune tried the fusion thresholds {tried} only"
        for r in range(4):
            for k in range(rounds):
                for i in range(5):
                    key = f"engine.tuned.{k}.{i}"
                    assert _bitwise_equal(results[r][key], reference[i]), f"{tag}, rank {r}: {key}"


def test_training_across_hosts_matches_one_host_bit_for_bit(hosts, tmp_path):
    """Issue 12: torch training on 2 test hosts x 2 ranks gives one host's weights bit for bit with the
    algorithm forced: ``DistributedOptimizer`` steps of a seeded MLP, each rank on its own batches. Forced to
    the ring with fusion off (which tensors share a fused buffer depends on timing, and moves their elements
    to other ring segments, whose sums start at other ranks), and in deterministic mode with fusion on."""
    for tag, env in (("ring", {"UNISON_ALLREDUCE_ALGORITHM": "ring", "UNISON_FUSION_THRESHOLD": "0"}),
                     ("deterministic", {"UNISON_DETERMINISTIC": "1"})):
        one = _results(tmp_path, f"train-{tag}-one-host", mode="train", **env)
        two = _results(tmp_path, f"train-{tag}-two-hosts", hosts=hosts, mode="train", **env)
        assert len(one[0]) == 6, sorted(one[0])  # (3 layers' weights and biases)
        for r in range(4):
            for key, value in one[r].items():
                assert _bitwise_equal(value, one[0][key]), f"{tag}: rank {r} and 0 differ on {key} (one host)"
                assert _bitwise_equal(two[r][key], value), f"{tag}, rank {r}: {key}: one host vs two hosts differ"


def test_down_removes_everything_even_after_a_crash():
    """``down`` finds leftovers by name: a half-made host set (no state file) is removed."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    names = testhosts.Names(9)
    subprocess.run(["ip", "link", "add", names.bridge, "type", "bridge"], check=True)
    subprocess.run(["ip", "netns", "add", names.host(1)], check=True)
    subprocess.run(["ip", "link", "add", f"{names.veth_prefix}1", "type", "veth", "peer", "name",
                    f"{names.veth_prefix}1p"], check=True)
    removed = testhosts.down(9)
    assert f"namespace {names.host(1)}" in removed and f"bridge {names.bridge}" in removed, removed
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert names.host(1) not in listed and names.bridge not in links and names.veth_prefix not in links
    assert testhosts.down(9) == []


#: leftovers of killed runs of two instances (9 and 0), in a sandbox: its own mount namespace (a tmpfs on /run,
#: so its own ``ip netns`` list and test-host state, and a copy of /etc/hosts) and network namespace, so that
#: a plain ``down`` there cannot touch the machine's test hosts, nor those of tests running beside it
SANDBOX = r"""
set -e
mount -t tmpfs unison-test-run /run
printf '127.0.0.1 localhost\n198.18.9.11 unison9-h1 # unison-testhosts-9\n' > "$1/hosts"
printf '198.18.200.7 kept-host # unison-testhosts-x\n198.18.0.12 unison-h2 # unison-testhosts-0\n' >> "$1/hosts"
mount --bind "$1/hosts" /etc/hosts
ip netns add unison9-h1; ip netns add unison-h2; ip netns add other-h1
ip link add unbr9 type bridge; ip link add unv9x1 type veth peer name unv9x1p
ip link add unv0x2 type veth peer name unv0x2p; ip link set unv0x2p netns unison-h2
ip netns exec unison9-h1 ip addr add 198.18.9.11/24 dev lo
ip netns exec unison9-h1 sleep 300 >/dev/null 2>&1 &
echo $! > "$1/pid"
mkdir -p /run/unison-testhosts/9; touch /run/unison-testhosts/9/state.json /run/unison-testhosts/hostfile
"$2" -m unison.run.testhosts down > "$1/first"
"$2" -m unison.run.testhosts down > "$1/second"
ip netns list | cut -d' ' -f1 > "$1/netns"
ip -o link show > "$1/links"
cp /etc/hosts "$1/hosts-after"
ls -A /run > "$1/run"
"""


def test_plain_down_removes_every_instances_leftovers_and_only_reports_what_it_removed(tmp_path):
    """Before 2026-12-06 ``down`` without ``--instance`` removed instance 0's alone (a killed benchmark's
    instance 3, a killed test's 1, 7, 8 or 9 stayed), and listed a step as done whether or not it was."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        proc = subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", "sh", "-c", SANDBOX,
                               "sandbox", str(tmp_path), sys.executable], capture_output=True, text=True,
                              timeout=120, env=mpi_env())
    finally:
        pid = tmp_path / "pid"
        if pid.is_file():
            subprocess.run(["kill", "-9", pid.read_text().strip()], capture_output=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = set((tmp_path / "first").read_text().splitlines())
    want = {"removed namespace unison9-h1", "removed namespace unison-h2", "removed link unv9x1",
            "removed bridge unbr9", "removed /etc/hosts lines tagged # unison-testhosts-0, # unison-testhosts-9",
            "removed /run/unison-testhosts/hostfile", "removed /run/unison-testhosts/9/state.json"}
    # (unv0x2 goes with its peer in unison-h2, at once or when the kernel frees the namespace: listed if
    # it was still there to remove)
    assert want <= first <= want | {"removed link unv0x2"}, first
    assert (tmp_path / "second").read_text() == ""
    assert (tmp_path / "netns").read_text().split() == ["other-h1"]
    assert re.findall(r"^\d+: ([^:@]+)", (tmp_path / "links").read_text(), re.M) == ["lo"]
    kept = "127.0.0.1 localhost\n198.18.200.7 kept-host # unison-testhosts-x\n"  # (no instance's tag)
    assert (tmp_path / "hosts-after").read_text() == kept
    assert "unison-testhosts" not in (tmp_path / "run").read_text().split()
    stat = Path(f"/proc/{(tmp_path / 'pid').read_text().strip()}/stat")  # (killed: gone, or a zombie)
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_down_names_a_step_that_failed_and_checks_the_machine(tmp_path, monkeypatch, capsys):
    """Before: ``down`` ignored what ``ip netns del``/``ip link del`` said and listed the item as removed, and
    a non-root user was told the items were removed."""
    run = testhosts._run

    def failing(args, check=True):
        if args[:3] == ["ip", "netns", "list"]:
            return subprocess.CompletedProcess(args, 0, "unison9-h1 (id: 3)\n", "")
        if args[:3] in (["ip", "netns", "del"], ["ip", "netns", "pids"]) or args[:3] == ["ip", "-o", "link"]:
            failed = args[2] == "del"
            return subprocess.CompletedProcess(args, int(failed), "", "Device or resource busy" if failed else "")
        return run(args, check)

    monkeypatch.setattr(testhosts, "_run", failing)
    monkeypatch.setattr(testhosts, "STATE_ROOT", tmp_path / "state")
    monkeypatch.setattr(testhosts, "check_machine", lambda need_tc=False: None)
    assert testhosts.main(["down", "--instance", "9"]) == 2
    captured = capsys.readouterr()
    assert "removed" not in captured.out
    assert captured.err.startswith("testhosts: error: down could not remove everything: 'ip netns del unison9-h1' "
                                   "(exit 1): Device or resource busy (removed: nothing)"), captured.err
    monkeypatch.undo()
    monkeypatch.setattr(testhosts.os, "geteuid", lambda: 1000)
    assert testhosts.main(["down"]) == 2
    assert "testhosts: error: test hosts need root" in capsys.readouterr().err


def _tcp_round_trip(server_host: str, address: str, client_host: str) -> None:
    """A TCP connection from ``client_host`` to ``address`` on ``server_host`` carries a byte each way."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", server_host, sys.executable, "-c",
         "import socket; s = socket.create_server(('0.0.0.0', 47011)); print('ready', flush=True); "
         "c, _ = s.accept(); c.sendall(c.recv(1))"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        client = subprocess.run(
            ["ip", "netns", "exec", client_host, sys.executable, "-c",
             f"import socket; c = socket.create_connection(({address!r}, 47011), timeout=5); c.sendall(b'x'); "
             "assert c.recv(1) == b'x'"], capture_output=True, text=True, timeout=30)
        assert client.returncode == 0, client.stderr
    finally:
        server.kill()
        server.wait()


def _ip(*args: str, namespace: str | None = None) -> str:
    inside = [] if namespace is None else ["ip", "netns", "exec", namespace]
    return subprocess.run([*inside, "ip", *args], capture_output=True, text=True, check=True).stdout


def _assert_addresses_as_documented(made) -> None:
    """[Note: the addresses test hosts use] in testhosts.py: the root namespace gets the bridge's 198.18.K.1
    and that subnet's route alone; each host its own address and that route alone."""
    bridge = testhosts.Names(made.instance).bridge
    assert re.findall(r"inet (\S+)", _ip("-o", "addr", "show", "dev", bridge)) == [f"198.18.{made.instance}.1/24"]
    assert [ln.split()[0] for ln in _ip("route", "show", "dev", bridge).splitlines()] == [made.subnet]
    for host, address in zip(made.hosts, made.addresses, strict=True):
        assert re.findall(r"inet (\S+)", _ip("-o", "addr", namespace=host)) == ["127.0.0.1/8", f"{address}/24"]
        assert [ln.split()[0] for ln in _ip("route", namespace=host).splitlines()] == [made.subnet]


def test_up_is_idempotent_and_writes_a_hostfile_unisonrun_reads():
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        # the command line, as a user runs it: the hostfile's path is the last line printed
        cli = subprocess.run([sys.executable, "-m", "unison.run.testhosts", "up", "--hosts", "2", "--slots", "3",
                              "--instance", "9"], capture_output=True, text=True, timeout=120, env=mpi_env())
        assert cli.returncode == 0, cli.stderr
        first = testhosts.current(9)
        assert first is not None and cli.stdout.splitlines()[-1] == first.hostfile, cli.stdout
        started = time.perf_counter()
        again = testhosts.up(2, slots=3, instance=9)
        assert again == first and time.perf_counter() - started < 5
        lines = Path(first.hostfile).read_text().splitlines()
        assert lines[:2] == [f"{first.hosts[0]} slots=3", f"{first.hosts[1]} slots=3"]
        options = testhosts.hostfile_options(first.hostfile)
        assert options == {"launch-agent": first.agent, "tcp-include": "198.18.9.0/24"}
        assert Path(first.agent).stat().st_mode & 0o111
        hosts_file = Path("/etc/hosts").read_text()
        assert f"{first.addresses[0]} {first.hosts[0]}" in hosts_file
        _assert_addresses_as_documented(first)
        bigger = testhosts.up(3, slots=1, instance=9)  # another request replaces the set
        assert len(bigger.hosts) == 3 and testhosts.current(9) == bigger
        # a set with a piece gone is not up: the same request makes it whole again (it said "already up")
        names = testhosts.Names(9)
        subprocess.run(["ip", "link", "del", names.bridge], check=True)
        assert testhosts.current(9) is None
        assert testhosts.up(3, slots=1, instance=9) == bigger
        assert testhosts.current(9) == bigger
        hosts_file = Path("/etc/hosts").read_text()
        Path("/etc/hosts").write_text("".join(ln + "\n" for ln in hosts_file.splitlines()
                                              if not ln.startswith(bigger.addresses[1] + " ")))
        assert testhosts.current(9) is None
        assert testhosts.up(3, slots=1, instance=9) == bigger
        assert f"{bigger.addresses[1]} {bigger.hosts[1]}" in Path("/etc/hosts").read_text()
        # a host link a killed test run left down (tests/test_hosts_launch.py's link_down), or an address
        # lost: not up (before 2026-12-05 "already up", and the next launch could not reach the host)
        inside = ["ip", "netns", "exec", bigger.hosts[1], "ip"]
        for breaking in ([*inside, "link", "set", "eth0", "down"],
                         [*inside, "addr", "del", f"{bigger.addresses[2 - 1]}/24", "dev", "eth0"]):
            subprocess.run(breaking, check=True)
            assert testhosts.current(9) is None
            assert testhosts.up(3, slots=1, instance=9) == bigger and testhosts.current(9) == bigger
            _tcp_round_trip(bigger.hosts[1], bigger.addresses[1], bigger.hosts[0])
    finally:
        cli = subprocess.run([sys.executable, "-m", "unison.run.testhosts", "down", "--instance", "9"],
                             capture_output=True, text=True, timeout=120, env=mpi_env())
        testhosts.down(9)  # (whatever the command left, so that a failure here leaves nothing behind)
    assert cli.returncode == 0 and "removed namespace" in cli.stdout, (cli.stdout, cli.stderr)
    assert testhosts.current(9) is None
    assert "unison-testhosts-9" not in Path("/etc/hosts").read_text()
    state_root = testhosts.STATE_ROOT  # nothing of the instance is left, its folder's parent neither when empty
    assert not testhosts.Names(9).state_dir.exists()
    assert not state_root.exists() or any(state_root.iterdir())


def test_delay_and_loss_sit_under_the_rate_limit_and_need_netem():
    """``--delay``/``--loss`` go under a host's ``tbf`` (before 2026-12-06 netem replaced it, and the host's
    sending was no longer limited); where the kernel has no netem (this machine's), ``up`` refuses them
    naming it, and its probe leaves nothing behind (it ran on the machine's own ``lo`` before)."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    assert testhosts.netem_command("1gbit", "5ms", "1%") == [
        "tc", "qdisc", "replace", "dev", "eth0", "parent", "1:1", "handle", "10:", "netem", "delay", "5ms",
        "loss", "1%"]
    assert testhosts.netem_command(None, "5ms", None)[5:] == ["root", "netem", "delay", "5ms"]
    # that place in the tree takes a child under the host's tbf (pfifo standing in for netem, which
    # this kernel may lack), and the tbf stays at the root
    space = "unison-test-tbf"
    subprocess.run(["ip", "netns", "del", space], capture_output=True)  # (a killed run's leftover)
    subprocess.run(["ip", "netns", "add", space], check=True)
    try:
        inside = ["ip", "netns", "exec", space]
        subprocess.run([*inside, "ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1"], check=True)
        subprocess.run([*inside, "ip", "link", "set", "d0", "up"], check=True)
        testhosts._shape("d0", "1gbit", space)
        child = testhosts.netem_command("1gbit", "5ms", None)
        child = child[:child.index("netem")] + ["pfifo"]
        subprocess.run([*inside, *[("d0" if a == "eth0" else a) for a in child]], check=True)
        shown = subprocess.run([*inside, "tc", "qdisc", "show", "dev", "d0"], capture_output=True, text=True,
                               check=True).stdout
        assert "qdisc tbf 1: root" in shown and "qdisc pfifo 10: parent 1:1" in shown, shown
    finally:
        subprocess.run(["ip", "netns", "del", space], check=False)
    if testhosts._netem_available():
        return
    with pytest.raises(testhosts.TestHostsError, match="--delay/--loss need the netem queueing discipline"):
        testhosts.up(2, delay="5ms", instance=9)
    assert testhosts.current(9) is None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "unison-test-tbf" not in listed and "netem" not in subprocess.run(
        ["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout


def test_a_machine_that_cannot_make_test_hosts_gets_exit_2_and_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(testhosts.os, "geteuid", lambda: 1000)
    assert testhosts.available() is not None and "root" in testhosts.available()
    assert testhosts.main(["up", "--hosts", "2"]) == 2
    assert "testhosts: error: test hosts need root" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["up", "--hosts", "0"], "--hosts 0 must be between 1 and 200"),
    (["up", "--rate", "fast"], "--rate 'fast' is not a tc rate"),
    (["up", "--slots", "0"], "--slots 0 must be at least 1"),
    (["up", "--instance", "100"], "--instance 100 must be between 0 and 99"),
])
def test_bad_arguments_exit_2_naming_the_value(args, message):
    proc = subprocess.run([sys.executable, "-m", "unison.run.testhosts"] + args, capture_output=True,
                          text=True, timeout=60, env=mpi_env())
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
