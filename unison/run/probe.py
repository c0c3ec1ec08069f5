"""Check, before launching, that every host can be reached and can reach back.

[Note: probing the hosts]
``mpirun`` starts one daemon (``prted``) per host through the launch agent (``ssh`` by default),
and each daemon must open a TCP connection back to ``mpirun``. When a host is down, ``ssh`` may
wait minutes for its connection to time out; when a host is up but cannot route back (a downed
link, a firewall, the wrong interface), the daemon may fail with a long message about libraries
and firewalls, or wait. So before launching, ``unisonrun`` probes every host that is not this
machine, all at once and under one deadline for the whole probe (:data:`PROBE_DEADLINE_S`):

1. it listens on a free TCP port of this machine;
2. through the same agent ``mpirun`` will use, it runs on the host the same Python as the
   launcher's (the ranks need it there too), which connects back to that port on this machine's
   addresses in the TCP subnet (``--tcp-include``/``--network-interface``; every non-loopback
   IPv4 address without them), as ``prted`` must, and sends a token naming the host;
3. a host passes when the agent exits 0 and its token arrived.

A host that fails is named with the reason (no answer within the deadline, the agent's own
error such as "Could not resolve hostname", or the connection back that failed) and nothing is
launched. ``--skip-host-check`` turns the probe off. Hosts that are this machine
(``localhost``, its hostname) are not probed.

[Note: one deadline for the whole probe]
The launch must fail within 30 s naming every unreachable host, at any host count. Before
2026-12-06 a pool of 64 threads gave each host its own 20 s, so hosts past the 64th queued behind
the others: 65 dead hosts took 40 s, 130 took 60 s. Now every agent starts at once (a pipe each,
read through one selector in the calling thread) and the whole probe has one deadline, 25 s by
default; when it passes, the session of every agent still running is killed and each host not
answered by then is reported as "no answer". Only the limit on open files (``RLIMIT_NOFILE``,
:func:`_agent_limit`) makes agents wait for a free slot, and one that has not started by the
deadline is reported the same way.

[Note: a signal during the probe]
Each agent runs in its own session, so that a deadline kills everything it started (``ssh``, a
``ProxyCommand``); a Ctrl-C typed in a terminal therefore does not reach them, and before
2026-12-05 a SIGTERM to ``unisonrun`` while it probed left them running, and a SIGINT waited
for them (17 s) and ended with a traceback. The launcher now installs its stop handlers before
the probe and passes an :class:`Agents`; a signal calls :meth:`Agents.stop`, which kills the
session of every agent running and keeps new ones from starting, so the probe ends at once and
the launcher exits with ``128 + N`` (see [Note: stopping a job] in ``supervise.py``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import resource
import secrets
import selectors
import shlex
import signal
import socket
import struct
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import IO, NamedTuple, cast

__all__: list[str] = []

logger = logging.getLogger(__name__)

PROBE_DEADLINE_S = 25.0  # the whole probe's, at any host count: [Note: one deadline for the whole probe]
CONNECT_BUDGET_S = 12.0
TOKEN_GRACE_S = 2.0  # how long a token may trail its agent's exit 0
MAX_AGENTS = 1024  # agents running at once, at most (also bounded by the open-file limit)
_OUTPUT_KEPT = 65536  # bytes of an agent's output kept (its last line is what is reported)
DEFAULT_AGENT = ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
_SIOCGIFADDR = 0x8915
_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "127.0.0.1", "::1"})
_REMOTE_CODE = """\
import socket, sys
addresses, port, token, wait = sys.argv[1].split(','), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
errors = []
for address in addresses:
    try:
        with socket.create_connection((address, port), wait) as connection:
            connection.sendall(token.encode())
        sys.exit(0)
    except OSError as error:
        errors.append(f'{address}:{port}: {error.strerror or error}')
print('cannot connect back to ' + '; '.join(errors))
sys.exit(3)
"""


class HostUnreachableError(RuntimeError):
    """One or more hosts failed the probe; the message names each and why."""


class ProbeResult(NamedTuple):
    """How one host answered the probe: ``reason`` is ``None`` when it passed."""

    host: str
    reason: str | None
    seconds: float


def is_local(name: str, addresses: dict[str, str] | None = None) -> bool:
    """Whether ``name`` is this machine, which ``mpirun`` starts ranks on without an agent.

    ``localhost``, a loopback address, this machine's hostname, or one of ``addresses`` (by
    interface). No name is looked up in DNS here: this machine named by another alias is probed
    like any other host.
    """
    if name in _LOCAL_NAMES or name.startswith("127."):
        return True
    here = socket.gethostname()
    return name in (here, here.split(".")[0]) or name in (addresses or {}).values()


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` on Linux, or ``None``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def local_addresses() -> dict[str, str]:
    """This machine's IPv4 addresses by interface, loopback excluded (empty where unknown)."""
    found = {}
    for _, name in socket.if_nameindex():
        address = interface_address(name)
        if address and not address.startswith("127."):
            found[name] = address
    return found


def reach_back_addresses(include: Sequence[str], addresses: dict[str, str] | None = None) -> list[str]:
    """The addresses of this machine the hosts must reach, as ``prted`` will.

    Args:
        include: The ``btl_tcp_if_include`` items (subnets such as ``10.0.0.0/24`` or interface
            names); empty for every interface.
        addresses: This machine's addresses by interface; :func:`local_addresses` when ``None``.

    Returns:
        The matching addresses, sorted.

    Raises:
        HostUnreachableError: ``include`` is given but no address of this machine matches it.
    """
    addresses = local_addresses() if addresses is None else addresses
    if not include:
        return sorted(set(addresses.values()))
    chosen = set()
    for item in include:
        if "/" in item:
            network = ipaddress.ip_network(item, strict=False)
            chosen |= {a for a in addresses.values() if ipaddress.ip_address(a) in network}
        elif item in addresses:
            chosen.add(addresses[item])
    if not chosen:
        mine = ", ".join(f"{n} {a}" for n, a in sorted(addresses.items())) or "none found"
        raise HostUnreachableError(
            f"no address of this machine is in the TCP include list {','.join(include)!r} (its "
            f"addresses: {mine}); the hosts could not connect back to mpirun: give --tcp-include a "
            "subnet or --network-interface an interface of this machine")
    return sorted(chosen)


class _Listener:
    """A TCP port on this machine that records the probe tokens the hosts send back."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.reached: set[str] = set()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.listen(128)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="unisonrun-probe", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._sock.accept()
            except OSError:
                continue
            with connection:
                connection.settimeout(2.0)
                try:
                    token = connection.recv(512).decode(errors="replace")
                except OSError:
                    continue
            secret, _, host = token.partition(":")
            if secret == self.secret:
                self.reached.add(host)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(1.0)
        self._sock.close()


class Agents:
    """The probe's running launch agents, so that a stop signal can end them; see
    [Note: a signal during the probe]."""

    def __init__(self) -> None:
        self._running: set[subprocess.Popen[bytes]] = set()
        self.stopped = False

    def stop(self) -> None:
        """Kills the session of every agent running, and of every agent started from now on.

        Safe in a signal handler: it takes no lock (an agent registers itself, then checks
        ``stopped``; this sets ``stopped``, then kills what is registered: none is missed).
        """
        self.stopped = True
        for process in list(self._running):
            _kill_session(process)

    def start(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """Starts ``argv`` in its own session, unless the probe was stopped (then killed at once)."""
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self._running.add(process)
        if self.stopped:
            _kill_session(process)
        return process

    def done(self, process: subprocess.Popen[bytes]) -> None:
        self._running.discard(process)


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # (its session's id is its pid: start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class _Outcome(NamedTuple):
    """How one host's agent ended: ``status`` is ``None`` when it gave no answer by the deadline."""

    status: int | None
    output: str
    seconds: float
    error: OSError | None = None


class _Running:
    """One host's agent while it runs: its process and what it printed so far."""

    def __init__(self, host: str, process: subprocess.Popen[bytes]) -> None:
        self.host, self.process = host, process
        self.pipe = cast(IO[bytes], process.stdout)  # (stdout=PIPE)
        self.started = time.monotonic()
        self.output = b""
        self.closed = False  # its output reached end of file

    def read(self, selector: selectors.BaseSelector) -> None:
        data = os.read(self.pipe.fileno(), 65536)
        self.output = (self.output + data)[-_OUTPUT_KEPT:]
        if not data:
            self.closed = True
            selector.unregister(self.pipe)

    def finished(self) -> bool:
        return self.closed and self.process.poll() is not None

    def outcome(self, answered: bool) -> _Outcome:
        return _Outcome(self.process.returncode if answered else None, self.output.decode(errors="replace"),
                        time.monotonic() - self.started)

    def end(self, agents: Agents) -> None:
        """Kills its session unless it finished, reaps it and closes its pipe."""
        if not self.finished():
            _kill_session(self.process)
        self.process.wait()
        self.pipe.close()
        agents.done(self.process)


def _agent_limit() -> int:
    """How many agents may run at once: each holds a pipe here, and Popen briefly four more
    descriptors, under ``RLIMIT_NOFILE`` (64 are left for the rest of the launcher)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_AGENTS
    return max(1, min(MAX_AGENTS, (soft - 64) // 2))


def _start(host: str, argv: list[str], agents: Agents,
           selector: selectors.BaseSelector) -> _Running | _Outcome:
    """Starts ``host``'s agent in its own session, its output read through ``selector``."""
    try:
        process = agents.start(argv)
    except OSError as error:
        return _Outcome(None, "", 0.0, error)
    running = _Running(host, process)
    selector.register(running.pipe, selectors.EVENT_READ, running)
    return running


def _run_agents(commands: dict[str, list[str]], end: float, agents: Agents) -> dict[str, _Outcome]:
    """Runs every host's agent at once (up to :func:`_agent_limit`) until all finish, the
    monotonic time ``end`` passes or ``agents`` is stopped; see [Note: one deadline for the whole
    probe]. A host whose agent was still running then, or never started, gets status ``None``."""
    waiting = deque(commands)
    running: dict[str, _Running] = {}
    outcomes: dict[str, _Outcome] = {}
    limit = _agent_limit()
    with selectors.DefaultSelector() as selector:
        try:
            while (waiting or running) and not agents.stopped and time.monotonic() < end:
                while waiting and len(running) < limit and not agents.stopped and time.monotonic() < end:
                    host = waiting.popleft()
                    started = _start(host, commands[host], agents, selector)
                    if isinstance(started, _Outcome):
                        outcomes[host] = started
                    else:
                        running[host] = started
                for key, _ in selector.select(max(0.0, min(0.05, end - time.monotonic()))):
                    key.data.read(selector)
                for host in [h for h, r in running.items() if r.finished()]:
                    agent = running.pop(host)
                    agent.end(agents)
                    outcomes[host] = agent.outcome(answered=True)
        finally:
            for agent in running.values():
                agent.end(agents)
    outcomes.update({host: agent.outcome(answered=False) for host, agent in running.items()})
    outcomes.update({host: _Outcome(None, "", 0.0) for host in waiting})
    return outcomes


def _reason(host: str, outcome: _Outcome, reached: set[str], agent_name: str, python: str,
            deadline: float) -> str | None:
    """Why ``host`` failed the probe, or ``None`` when it passed; see [Note: probing the hosts]."""
    if outcome.error is not None:
        return (f"cannot start the launch agent {agent_name!r}: {outcome.error.strerror or outcome.error}; "
                "install it, or give one with --launch-agent")
    if outcome.status is None:
        return (f"no answer through {agent_name!r} within the probe's {deadline:g} s (the host is down, or "
                "its network does not answer)")
    if outcome.status == 3:
        return ("it could not open a TCP connection back to this machine, as Open MPI's daemon must: "
                f"{_last_line(outcome.output)}")
    if outcome.status != 0:
        said = _last_line(outcome.output) or "no message"
        return f"{agent_name!r} failed to run {python!r} there (exit status {outcome.status}): {said}"
    if host not in reached:
        return "its connection back to this machine did not arrive"
    return None


def _remote_command(host: str, python: str, addresses: list[str], listener: _Listener) -> str:
    """The command the agent runs on ``host``: connect back to ``listener`` and send the token."""
    wait = max(1.0, min(5.0, CONNECT_BUDGET_S / max(1, len(addresses))))
    return shlex.join([python, "-I", "-S", "-c", _REMOTE_CODE, ",".join(addresses), str(listener.port),
                       f"{listener.secret}:{host}", f"{wait:g}"])


def _await_tokens(hosts: list[str], outcomes: dict[str, _Outcome], listener: _Listener, end: float,
                  agents: Agents) -> None:
    """Waits (up to :data:`TOKEN_GRACE_S`, never past ``end``) for the tokens of hosts whose agent
    exited 0 and whose token has not arrived yet."""
    until = min(end, time.monotonic() + TOKEN_GRACE_S)
    missing = [h for h in hosts if outcomes[h].status == 0]
    while any(h not in listener.reached for h in missing) and time.monotonic() < until and not agents.stopped:
        time.sleep(0.02)


def _target(host: str, login: tuple[str | None, int | None] | None) -> list[str]:
    """The agent's arguments naming ``host``: ``USER@HOST`` and ``-p PORT`` after it where the hostfile gives them,
    as PRRTE's ssh launcher writes them for whatever agent it runs."""
    user, port = login or (None, None)
    return [f"{user}@{host}" if user else host, *(["-p", str(port)] if port else [])]


def probe_hosts(hosts: Sequence[str], *, agent: Sequence[str], python: str, include: Sequence[str] = (),
                deadline: float = PROBE_DEADLINE_S, addresses: dict[str, str] | None = None,
                agents: Agents | None = None, label: str | None = None,
                logins: Mapping[str, tuple[str | None, int | None]] | None = None) -> list[ProbeResult]:
    """Probes every host that is not this machine, all at once; see [Note: probing the hosts].

    Args:
        hosts: Host names (repeats and local names are skipped).
        agent: The launch agent's command, e.g. ``["ssh"]``; it is called as ``AGENT HOST COMMAND``.
        python: The interpreter to run on each host (the launcher's own).
        include: The TCP include list (subnets or interface names) the job will use.
        deadline: Seconds the whole probe may take, however many hosts there are (see [Note: one
            deadline for the whole probe]); a host not answered by then is reported as "no answer".
        addresses: This machine's addresses by interface; :func:`local_addresses` when ``None``.
        agents: Where the running agents are kept, so that a signal handler can stop them
            (:meth:`Agents.stop`); a private one when ``None``.
        label: How messages name the agent (the user's agent when ``agent`` is its wrapper,
            see [Note: a launch agent Open MPI would split] in ``placement.py``); ``agent``'s
            words when ``None``.

        logins: Each host's ``(username, port)`` from the hostfile, given to the agent as Open MPI
            (PRRTE's ssh launcher) gives them to any agent: ``AGENT USER@HOST -p PORT COMMAND``.

    Returns:
        One result per probed host, in the order given.

    Raises:
        HostUnreachableError: ``include`` matches no address of this machine.
    """
    end = time.monotonic() + deadline
    addresses = local_addresses() if addresses is None else addresses
    names = list(dict.fromkeys(h for h in hosts if not is_local(h, addresses)))
    if not names:
        return []
    back = reach_back_addresses(include, addresses)
    listener = _Listener(secrets.token_hex(8))
    running = Agents() if agents is None else agents
    try:
        commands = {h: [*agent, *_target(h, (logins or {}).get(h)), _remote_command(h, python, back, listener)]
                    for h in names}
        outcomes = _run_agents(commands, end, running)
        _await_tokens(names, outcomes, listener, end, running)
    finally:
        listener.close()
    agent_name = label or shlex.join(agent)
    results = []
    for host in names:
        outcome = outcomes[host]
        reason = "the probe was stopped by a signal" if running.stopped else _reason(
            host, outcome, listener.reached, agent_name, python, deadline)
        results.append(ProbeResult(host, reason, outcome.seconds))
        logger.info("probe %s: %s (%.2f s)", host, reason or "ok", outcome.seconds)
    return results


def check_hosts(hosts: Sequence[str], *, agent: Sequence[str], python: str, include: Sequence[str] = (),
                deadline: float = PROBE_DEADLINE_S, addresses: dict[str, str] | None = None,
                agents: Agents | None = None, label: str | None = None,
                logins: Mapping[str, tuple[str | None, int | None]] | None = None) -> None:
    """Raises, naming each host and why, unless every host passes :func:`probe_hosts` (same arguments).

    Raises:
        HostUnreachableError: a host failed the probe, or ``include`` matches no address here.
    """
    results = probe_hosts(hosts, agent=agent, python=python, include=include, deadline=deadline,
                          addresses=addresses, agents=agents, label=label, logins=logins)
    failed = [r for r in results if r.reason is not None]
    if failed:
        details = "; ".join(f"host {r.host}: {r.reason}" for r in failed)
        raise HostUnreachableError(
            f"cannot reach {len(failed)} of {len(results)} host(s), so nothing was launched: {details}; "
            "check those hosts and their network, fix the host list, or pass --skip-host-check")
