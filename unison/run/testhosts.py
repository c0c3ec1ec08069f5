"""Test hosts on one machine: N network namespaces that Open MPI treats as N nodes.

``python -m unison.run.testhosts up --hosts 2 --slots 2 [--rate 1gbit]`` builds::

    root namespace                          namespace unison-h1 (hostname unison-h1)
    bridge unbr0  198.18.0.1/24 --- unv0x1 ==== eth0 198.18.0.11/24   [tbf RATE both ways]
                                 \\-- unv0x2 ==== eth0 198.18.0.12/24   (namespace unison-h2)

and writes a hostfile (``unison-h1 slots=2`` ...) whose last lines tell ``unisonrun`` how to
reach the hosts (see [Note: test hosts in a hostfile]); its path is the last line printed.
``... down`` removes every namespace, link, bridge, ``/etc/hosts`` line and file of every instance
(``--instance K``: of one), also the leftovers of a run killed half way (it looks for them by name,
not in a state file), lists only what is really gone, and fails naming any step that did not work.

[Note: reaching a namespace without ssh]
``mpirun`` starts its daemon (``prted``) on a remote node by running ``AGENT HOST COMMAND`` where
AGENT is ``ssh`` by default. Open MPI 5 takes another agent with ``--prtemca plm_ssh_agent``; ours
(:data:`AGENT_SCRIPT`, written next to the hostfile) skips ssh-style options, then runs the command
string with ``ip netns exec HOST unshare --uts`` after setting the hostname, so each daemon and its
ranks see their own hostname (without that, every daemon reports the same node and the job never
starts) and their own network stack. The environment passes through unchanged, as with a local
launch.

[Note: the addresses test hosts use]
Every address comes from the benchmarking range 198.18.0.0/15 (RFC 2544): instance K uses the
subnet 198.18.K.0/24 alone. Its hosts' addresses (198.18.K.11 and up) sit on ``eth0`` inside their
namespaces; its bridge's address, 198.18.K.1, sits in the root namespace, on the bridge, because
``mpirun`` runs there and its daemons in the hosts must reach it (Open MPI's out-of-band wire, and
the probe's connection back). Nothing else is added to the root namespace: no route beyond that
subnet's own, no forwarding or NAT, so no address outside the range is used and the test subnet
reaches no other network. The hostfile pins Open MPI's TCP to the subnet.

[Note: no shared memory between test hosts]
The namespaces share one kernel, so ``/dev/shm`` is visible from all of them. Open MPI uses its
shared-memory transport only between ranks that PMIx places on the same node, and the daemons
report distinct hostnames, so between test hosts traffic goes through TCP on the veth links. The
test suite proves it: a cross-host transfer on a link limited to R takes at least ``bytes / R``.

Needs root, ``ip`` (iproute2), ``unshare`` and, for ``--rate``, ``tc``. ``--delay``/``--loss``
need the ``netem`` queueing discipline, which some kernels lack; the command then exits naming it.
The hostname is set for what the agent starts (``mpirun``'s daemons and their ranks): a process
started with ``ip netns exec unison-h1 ...`` alone has the host's network but the machine's name.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from unison.common.files import atomic_path

__all__ = ["Names", "TestHosts", "TestHostsError", "available", "current", "down", "hostfile_options",
           "mpirun_arguments", "up"]

logger = logging.getLogger(__name__)

STATE_ROOT = Path("/run/unison-testhosts")
HOSTS_TAG = "# unison-testhosts"
MAX_INSTANCE = 99
#: hostfile comment lines ``unisonrun`` reads; Open MPI ignores comments
OPTION_PREFIX = "# unison:"
MAX_HOSTS = 200
AGENT_SCRIPT = r"""#!/bin/sh
# unison test-host launch agent: called by mpirun as `AGENT [ssh options] HOST COMMAND...`
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
exec ip netns exec "$host" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$host" "$*"
"""


@dataclass(frozen=True)
class Names:
    """Names and addresses of one set of test hosts; ``instance`` K lets several sets coexist.

    Instance 0 is ``unison-h1...`` on 198.18.0.0/24 with bridge ``unbr0``; instance K is
    ``unisonK-h1...`` on 198.18.K.0/24 with bridge ``unbrK``.
    """

    instance: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.instance <= MAX_INSTANCE:
            raise ValueError(f"--instance {self.instance} must be between 0 and {MAX_INSTANCE}")

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"198.18.{self.instance}.0/24")

    @property
    def ns_prefix(self) -> str:
        return "unison-h" if self.instance == 0 else f"unison{self.instance}-h"

    @property
    def bridge(self) -> str:
        return f"unbr{self.instance}"

    @property
    def veth_prefix(self) -> str:
        return f"unv{self.instance}x"

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT if self.instance == 0 else STATE_ROOT / str(self.instance)

    @property
    def tag(self) -> str:
        return f"{HOSTS_TAG}-{self.instance}"

    def host(self, i: int) -> str:
        return f"{self.ns_prefix}{i}"

    def address(self, i: int) -> str:
        return str(self.subnet.network_address + 10 + i)


class TestHostsError(RuntimeError):
    """The machine cannot make test hosts (no root, no ``ip``), or a step failed."""


@dataclass(frozen=True)
class TestHosts:
    """What ``up`` made: host names, addresses, slots, link rate, and the files it wrote."""

    hosts: tuple[str, ...]
    addresses: tuple[str, ...]
    slots: int
    rate: str | None
    hostfile: str
    agent: str
    subnet: str
    instance: int = 0


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    logger.debug("$ %s", " ".join(args))
    proc = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise TestHostsError(f"{' '.join(args)!r} failed (exit {proc.returncode}): "
                             f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def check_machine(need_tc: bool = False) -> None:
    """Raises ``TestHostsError`` naming what is missing to make test hosts here.

    Raises:
        TestHostsError: not root, or ``ip``/``unshare`` (``tc`` with ``need_tc``) not found, or
            network namespaces cannot be made.
    """
    if os.geteuid() != 0:
        raise TestHostsError("test hosts need root (network namespaces); run as root or skip them")
    for tool in ("ip", "unshare") + (("tc",) if need_tc else ()):
        if shutil.which(tool) is None:
            raise TestHostsError(f"test hosts need {tool!r} on PATH (package iproute2/util-linux)")


def available() -> str | None:
    """``None`` when this machine can make test hosts, else the reason it cannot."""
    try:
        check_machine(need_tc=True)
    except TestHostsError as exc:
        return str(exc)
    probe = "unison-probe"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"'ip netns add' failed here: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _check_rate(rate: str | None) -> None:
    if rate is not None and not re.fullmatch(r"\d+(\.\d+)?([kmg]?bit|[kmg]?bps)", rate, re.IGNORECASE):
        raise ValueError(f"--rate {rate!r} is not a tc rate; give e.g. 1gbit, 500mbit or 100mbit")


def _netem_available() -> bool:
    """Whether this kernel has netem, probed on the loopback of a throwaway network namespace (``unshare
    -n``: nothing to name or remove; before 2026-12-06 on the machine's own ``lo``, whose traffic the
    probe briefly passed through netem)."""
    return _run(["unshare", "-n", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"],
                check=False).returncode == 0


def _shape(device: str, rate: str, namespace: str | None) -> None:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    _run(prefix + ["tc", "qdisc", "replace", "dev", device, "root", "handle", "1:", "tbf", "rate", rate,
                   "burst", "256kb", "latency", "10ms"])


def netem_command(rate: str | None, delay: str | None, loss: str | None) -> list[str]:
    """The ``tc`` arguments that add ``--delay``/``--loss`` to a host's ``eth0``: under the host's ``tbf``
    (its one class, ``1:1``) when it has a ``--rate``, so both apply, else at the root. (Before
    2026-12-06 netem replaced the root ``tbf``, and the host sent at the link's full speed.)"""
    where = ["parent", "1:1", "handle", "10:"] if rate else ["root"]
    return (["tc", "qdisc", "replace", "dev", "eth0"] + where + ["netem"]
            + (["delay", delay] if delay else []) + (["loss", loss] if loss else []))


def _add_host(n: Names, i: int, slots: int, rate: str | None) -> None:
    name, outer, inner = n.host(i), f"{n.veth_prefix}{i}", f"{n.veth_prefix}{i}p"
    _run(["ip", "netns", "add", name])
    _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
    _run(["ip", "link", "set", inner, "netns", name])
    _run(["ip", "link", "set", outer, "master", n.bridge])
    _run(["ip", "link", "set", outer, "up"])
    inside = ["ip", "netns", "exec", name]
    _run(inside + ["ip", "link", "set", inner, "name", "eth0"])
    _run(inside + ["ip", "addr", "add", f"{n.address(i)}/{n.subnet.prefixlen}", "dev", "eth0"])
    _run(inside + ["ip", "link", "set", "eth0", "up"])
    _run(inside + ["ip", "link", "set", "lo", "up"])
    if rate:
        _shape("eth0", rate, name)  # what the host sends
        _shape(outer, rate, None)   # what it receives
    logger.info("test host %s at %s (%d slots%s)", name, n.address(i), slots,
                f", {rate} each way" if rate else "")


def _edit_etc_hosts(tag: str | Callable[[str], bool], lines: list[str]) -> None:
    """Replaces the lines tagged ``tag`` in ``/etc/hosts`` by ``lines`` (each tagged), atomically;
    ``tag`` may instead be a test of which lines to drop (then ``lines`` must be empty).

    The new file keeps the old one's mode and owner: before 2026-12-05 it got its mode from the
    umask (0600 under ``umask 077``), and then no one but root could resolve a name.
    """
    path = Path("/etc/hosts")
    ours = tag if callable(tag) else (lambda line: line.endswith(tag))
    kept = [ln for ln in path.read_text().splitlines() if not ours(ln)]
    text = "\n".join(kept + [f"{ln} {tag}" for ln in lines]) + "\n"
    old = path.stat()
    try:
        with atomic_path(path) as tmp:
            Path(tmp).write_text(text)
            os.chmod(tmp, stat.S_IMODE(old.st_mode))
            if (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
                os.chown(tmp, old.st_uid, old.st_gid)
    except OSError:  # /etc/hosts may be a bind mount that cannot be replaced: write in place
        path.write_text(text)


def hostfile_options(hostfile: str | Path) -> dict[str, str]:
    """The ``# unison: key=value`` options of a hostfile (empty for a plain Open MPI hostfile).

    [Note: test hosts in a hostfile]
    ``up`` ends its hostfile with ``# unison: launch-agent=PATH`` and ``# unison:
    tcp-include=198.18.0.0/24``; ``unisonrun --hostfile F`` turns them into the ``mpirun`` flags
    that reach the namespaces, so the user passes no other flag. Open MPI skips comment lines.
    """
    options = {}
    for line in Path(hostfile).read_text().splitlines():
        line = line.strip()  # (an indented option line is still one)
        if line.startswith(OPTION_PREFIX):
            key, _, value = line[len(OPTION_PREFIX):].strip().partition("=")
            options[key.strip()] = value.strip()
    return options


def mpirun_arguments(made: TestHosts) -> list[str]:
    """The ``mpirun`` arguments that place a job on the test hosts ``made``.

    The hostfile, plus what ``unisonrun --hostfile`` reads from its ``# unison:`` lines (built by
    the launcher's own :func:`unison.run.placement.network_arguments`), for callers that run
    ``mpirun`` themselves (the test harness, ``benchmarks/hosts.py``).
    """
    from unison.run.placement import network_arguments  # the launcher imports this module lazily

    return ["--hostfile", made.hostfile] + network_arguments(made.agent, [made.subnet])


def _write_files(n: Names, made: TestHosts, netem: bool) -> None:
    n.state_dir.mkdir(parents=True, exist_ok=True)
    agent = Path(made.agent)
    with atomic_path(agent) as tmp:
        Path(tmp).write_text(AGENT_SCRIPT)
        os.chmod(tmp, 0o755)
    lines = [f"{h} slots={made.slots}" for h in made.hosts]
    lines += [f"{OPTION_PREFIX} launch-agent={made.agent}", f"{OPTION_PREFIX} tcp-include={made.subnet}"]
    with atomic_path(made.hostfile) as tmp:
        Path(tmp).write_text("\n".join(lines) + "\n")
    with atomic_path(n.state_dir / "state.json") as tmp:
        Path(tmp).write_text(json.dumps({**asdict(made), "netem": netem}, indent=1))


def current(instance: int = 0) -> TestHosts | None:
    """The test hosts of ``instance`` that are up (from its state file), or ``None``.

    Up means whole: every host's namespace, its link and the bridge, its ``/etc/hosts``
    line and the files, and nothing else of the instance's (a set with a piece removed
    by hand, or left half made, is not up: ``up`` makes it again), and every link up with
    its address (a host whose link a killed test run left down, or that lost its address, is not
    up either: before 2026-12-05 ``up`` called such a set "already up" and the next launch could
    not reach the host). A set made with netem's ``--delay``/``--loss`` is never taken for a
    plain request.
    """
    n = Names(instance)
    try:
        data = json.loads((n.state_dir / "state.json").read_text())
        made = TestHosts(hosts=tuple(data["hosts"]), addresses=tuple(data["addresses"]),
                         slots=int(data["slots"]), rate=data["rate"], hostfile=str(data["hostfile"]),
                         agent=str(data["agent"]), subnet=str(data["subnet"]),
                         instance=int(data["instance"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    spaces, links = _leftovers(n)
    tagged = [ln for ln in Path("/etc/hosts").read_text().splitlines() if ln.endswith(n.tag)]
    whole = (set(spaces) == set(made.hosts)
             and set(links) == {n.bridge} | {f"{n.veth_prefix}{i}" for i in range(1, len(made.hosts) + 1)}
             and sorted(tagged) == sorted(f"{a} {h} {n.tag}" for a, h in zip(made.addresses, made.hosts,
                                                                                strict=True))
             and Path(made.hostfile).is_file() and Path(made.agent).is_file())
    return made if whole and not data.get("netem") and _links_up(n, made) else None


def _link_up(device: str, address: str | None = None, namespace: str | None = None) -> bool:
    """Whether ``device`` (inside ``namespace``) is administratively up, holding ``address`` when given."""
    inside = [] if namespace is None else ["ip", "netns", "exec", namespace]
    flags = re.search(r"<([^>]*)>", _run([*inside, "ip", "-o", "link", "show", "dev", device], check=False).stdout)
    if flags is None or "UP" not in flags.group(1).split(","):
        return False
    if address is None:
        return True
    shown = _run([*inside, "ip", "-o", "addr", "show", "dev", device], check=False).stdout
    return re.search(rf"\binet {re.escape(address)}/", shown) is not None


def _links_up(n: Names, made: TestHosts) -> bool:
    """Every link of the set is up: the bridge with the subnet's first address, each host's outer end, and
    inside each host ``eth0`` with the host's address."""
    return (_link_up(n.bridge, str(n.subnet.network_address + 1))
            and all(_link_up(f"{n.veth_prefix}{i}") for i in range(1, len(made.hosts) + 1))
            and all(_link_up("eth0", address, host) for host, address in zip(made.hosts, made.addresses,
                                                                            strict=True)))


def up(hosts: int, slots: int = 2, rate: str | None = None, delay: str | None = None,
       loss: str | None = None, instance: int = 0) -> TestHosts:
    """Makes ``hosts`` test hosts (idempotent: the same request again returns what is up).

    Args:
        hosts: How many hosts, 1 to 200.
        slots: MPI slots per host, written to the hostfile.
        rate: ``tc`` rate limit of each host's link, each way (``"1gbit"``), or ``None``.
        delay, loss: ``netem`` delay and loss; refused where the kernel has no ``netem``.
        instance: Which set of test hosts (0-99), so that several can be up at once.

    Returns:
        What is up, with the hostfile's path.

    Raises:
        ValueError: a bad count, slot number or rate.
        TestHostsError: the machine cannot make test hosts, or a step failed (everything made
            so far is removed again).
    """
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"--hosts {hosts} must be between 1 and {MAX_HOSTS}")
    if slots < 1:
        raise ValueError(f"--slots {slots} must be at least 1")
    _check_rate(rate)
    check_machine(need_tc=rate is not None or bool(delay or loss))
    if (delay or loss) and not _netem_available():
        raise TestHostsError("--delay/--loss need the netem queueing discipline, which this kernel "
                             "lacks (tc: 'Specified qdisc kind is unknown'); drop them, or use "
                             "--rate alone")
    n = Names(instance)
    names = tuple(n.host(i) for i in range(1, hosts + 1))
    wanted = TestHosts(names, tuple(n.address(i) for i in range(1, hosts + 1)), slots, rate,
                       str(n.state_dir / "hostfile"), str(n.state_dir / "agent.sh"), str(n.subnet),
                       instance)
    if current(instance) == wanted and not (delay or loss):
        logger.info("test hosts already up: %s", ", ".join(names))
        return wanted
    down(instance)
    try:
        _run(["ip", "link", "add", n.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{n.subnet.network_address + 1}/{n.subnet.prefixlen}", "dev",
              n.bridge])
        _run(["ip", "link", "set", n.bridge, "up"])
        for i in range(1, hosts + 1):
            _add_host(n, i, slots, rate)
            if delay or loss:
                _run(["ip", "netns", "exec", n.host(i)] + netem_command(rate, delay, loss))
        _edit_etc_hosts(n.tag, [f"{a} {h}" for a, h in zip(wanted.addresses, names, strict=True)])
        _write_files(n, wanted, netem=bool(delay or loss))
    except BaseException:
        try:
            down(instance)
        except TestHostsError as error:  # (the first failure is the one to report)
            logger.warning("%s", error)
        raise
    return wanted


class _Match:
    """What of the test hosts ``down`` looks for, by name: one instance's, or every instance's (``None``)."""

    def __init__(self, instance: int | None) -> None:
        n = None if instance is None else Names(instance)
        self.namespace = r"unison\d*-h\d+" if n is None else re.escape(n.ns_prefix) + r"\d+"
        self.link = r"unbr\d+|unv\d+x\d+" if n is None else rf"{n.bridge}|{n.veth_prefix}\d+"
        self.tag = re.escape(HOSTS_TAG) + r"-\d+" if n is None else re.escape(n.tag)
        self.state_dirs = ([STATE_ROOT, *sorted(p for p in STATE_ROOT.glob("*") if p.name.isdigit())]
                           if n is None else [n.state_dir])

    def tagged(self, line: str) -> bool:
        return re.search(rf"\s{self.tag}$", line) is not None


def _namespaces(match: _Match) -> list[str]:
    listed = _run(["ip", "netns", "list"], check=False).stdout.splitlines()
    return [ln.split()[0] for ln in listed if ln.split() and re.fullmatch(match.namespace, ln.split()[0])]


def _links(match: _Match) -> list[str]:
    """The matching links of the root namespace, veths before bridges."""
    shown = _run(["ip", "-o", "link", "show"], check=False).stdout
    found = re.findall(rf"^\d+: ({match.link})[@:]", shown, re.M)
    return sorted(found, key=lambda name: (name.startswith("unbr"), name))


def _leftovers(n: Names) -> tuple[list[str], list[str]]:
    match = _Match(n.instance)
    return _namespaces(match), _links(match)


def _kill_namespace_processes(namespace: str) -> None:
    pids = _run(["ip", "netns", "pids", namespace], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


class _Removal:
    """What ``down`` removed, and the steps that failed (each a command or file and its error)."""

    def __init__(self) -> None:
        self.removed: list[str] = []
        self.failed: list[str] = []

    def run(self, item: str, args: list[str], name: str, listed: Callable[[], list[str]]) -> None:
        """Runs ``args`` to remove ``item``; it counts as removed when ``name`` is no longer ``listed()``
        afterwards (a veth goes with its namespace's end, so its own ``ip link del`` may find nothing left)."""
        proc = _run(args, check=False)
        if name not in listed():
            self.removed.append(item)
        else:
            said = (proc.stderr or proc.stdout).strip() or "no message"
            self.failed.append(f"{' '.join(args)!r} (exit {proc.returncode}): {said}")

    def file(self, item: str, action: Callable[[], object]) -> None:
        try:
            action()
        except OSError as error:
            self.failed.append(f"{item}: {error}")
        else:
            self.removed.append(item)


def down(instance: int | None = None) -> list[str]:
    """Removes the test hosts of ``instance``, or of every instance when ``None`` (the command's default):
    namespaces, links, bridges, ``/etc/hosts`` lines and files, found by name, so also what a run killed
    half way left behind (before 2026-12-06 the command removed instance 0's alone, and reported a step
    as done whether or not it was).

    Processes still running inside a test host are killed first. Safe to call when nothing is up.

    Returns:
        What was removed, one item per entry; only what is really gone.

    Raises:
        TestHostsError: not root or no ``ip`` (see :func:`check_machine`), or a step failed; the message
            names each failed step and what was removed.
    """
    check_machine()
    match, done = _Match(instance), _Removal()
    for ns in _namespaces(match):
        _kill_namespace_processes(ns)
        done.run(f"namespace {ns}", ["ip", "netns", "del", ns], ns, lambda: _namespaces(match))
    for link in _links(match):
        kind = "bridge" if link.startswith("unbr") else "link"
        done.run(f"{kind} {link}", ["ip", "link", "del", link], link, lambda: _links(match))
    tags = sorted({line.split()[-1] for line in Path("/etc/hosts").read_text().splitlines() if match.tagged(line)})
    if tags:
        done.file(f"/etc/hosts lines tagged {', '.join('# ' + t for t in tags)}",
                  lambda: _edit_etc_hosts(match.tagged, []))
    for folder in match.state_dirs:
        for name in ("state.json", "hostfile", "agent.sh"):
            if (folder / name).exists():
                done.file(str(folder / name), (folder / name).unlink)
        with contextlib.suppress(OSError):  # absent, or holding something not ours (another instance's)
            folder.rmdir()
    with contextlib.suppress(OSError):
        STATE_ROOT.rmdir()
    if done.failed:
        raise TestHostsError(f"down could not remove everything: {'; '.join(done.failed)} (removed: "
                             f"{', '.join(done.removed) or 'nothing'}); remove those by hand, or run it again")
    return done.removed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m unison.run.testhosts",
        description="Make N test hosts on this machine (network namespaces that Open MPI sees as "
        "N nodes), or remove them. Needs root.",
        epilog="Example: python -m unison.run.testhosts up --hosts 2 --slots 2 --rate 1gbit; "
        "unisonrun --hostfile /run/unison-testhosts/hostfile -np 4 python train.py; "
        "python -m unison.run.testhosts down")
    sub = parser.add_subparsers(dest="action", required=True)
    make = sub.add_parser("up", help="make the hosts (again) and print the hostfile's path last")
    make.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    make.add_argument("--slots", type=int, default=2, help="MPI slots per host (default 2)")
    make.add_argument("--rate", help="limit each host's link to this rate each way, e.g. 1gbit")
    make.add_argument("--delay", help="netem delay, e.g. 1ms (only where netem exists)")
    make.add_argument("--loss", help="netem loss, e.g. 0.1%% (only where netem exists)")
    gone = sub.add_parser("down", help="remove every test host of every instance and what came with it "
                          "(also what a killed run left), or with --instance those of one instance")
    show = sub.add_parser("status", help="print the hostfile of the hosts that are up, or nothing")
    for each in (make, show):
        each.add_argument("--instance", type=int, default=0,
                          help="which set of test hosts, 0-99, so several can be up (default 0)")
    gone.add_argument("--instance", type=int, default=None,
                      help="remove only this set of test hosts, 0-99 (default: every set)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 for bad input or an unfit machine)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="testhosts: %(message)s")
    try:
        if args.action == "up":
            made = up(args.hosts, args.slots, args.rate, args.delay, args.loss, args.instance)
            for name, address in zip(made.hosts, made.addresses, strict=True):
                print(f"{name} {address} slots={made.slots}")
            print(made.hostfile)
        elif args.action == "down":
            for item in down(args.instance):
                print(f"removed {item}")
        else:
            running = current(args.instance)
            if running is not None:
                print(running.hostfile)
    except (ValueError, TestHostsError) as exc:
        print(f"testhosts: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
