"""Run ``mpirun`` to its end: forward stop signals, make sure they stop it, name the failed rank.

[Note: stopping a job]
``unisonrun`` forwards SIGINT, SIGTERM and SIGHUP to ``mpirun``, which then kills every rank
(measured: under half a second for ranks sleeping, in a barrier, or spinning in
``MPI_Finalize``) and exits non-zero. The forwarding handlers are installed *before* ``mpirun``
starts, so a signal that arrives while it is starting is not lost. If ``mpirun`` is still
running ``FORCE_AFTER_S`` seconds after the first signal, the signal is sent again (Open MPI
takes a second SIGINT/SIGTERM as "terminate forcibly"); after ``KILL_AFTER_S`` seconds
``mpirun`` and every process below it get SIGKILL, so no rank outlives the launcher's exit.
``unisonrun`` then exits with ``128 + signal number``, as a shell reports a job ended by that
signal.

``mpirun`` shares the launcher's process group, so a Ctrl-C typed in a terminal reaches it
twice (directly and forwarded), which Open MPI takes as the forcible stop: same outcome.

``mpirun``'s stdout and stderr are copied through to ours as they come, in whatever pieces they
come (progress bars included), and read by :class:`~unison.run.report.MpirunReport` on the way; see
[Note: naming the failed rank] in ``report.py``.

When that report names a lost host ([Note: naming a lost host] in ``report.py``), ``mpirun`` may
keep waiting for the lost host's daemon (over a downed link TCP gives no error for minutes). If
it has not exited ``HOST_LOST_GRACE_S`` seconds after the report, ``mpirun`` and every process
below it (the launch agents and, through them, the daemons and ranks it reaches) get SIGKILL,
and the job's status is ``HOST_LOST_STATUS``: a lost host never leaves the launcher waiting.

[Note: a failed job whose output stays open]
When a rank fails, ``mpirun`` kills the others, then waits until every rank's stdout and stderr
are closed. A helper that a rank started in its own session (``subprocess`` with
``start_new_session=True``, a daemonised tool) inherits them, is not killed with the ranks (it
is outside the job's process tree and its process group), and keeps ``mpirun`` waiting for as
long as it lives: measured, ``prterun`` stayed up after ``MPI_Abort`` killed both ranks, plain
``mpirun`` as well. So once the report names a failed rank (:class:`~unison.run.report.RankFailure`)
and ``mpirun`` has not exited ``RANK_FAILED_GRACE_S`` seconds later, ``mpirun`` and every process
below it get SIGKILL and the job's status is the failed rank's (``MPI_Abort``'s error code, 128 + the
signal that killed it, its exit status; else 1). The helper itself is not reached: it is no
longer below ``mpirun``; the warning names the processes that still hold the ranks' output. The
launcher does this only where a failed rank ends the job: not under ULFM (``--with-ft ulfm``),
whose survivors go on.

[Note: a prterun that outlives its ranks]
Open MPI 5.0's ``prterun`` was seen, now and then, to stay up after every rank of a ``--with-ft ulfm``
job had exited, with no process left below it, and never exit (seen after a SIGKILLed rank, and
in 2 of some 40 jobs whose ranks all exit with ``RESTART_STATUS`` because the hosts changed).
Such a job would leave the elastic driver waiting forever. So each rank of an elastic job under
the driver prints ``report.ELASTIC_EXITING`` with its exit status, its rank and the job's size
when it has nothing left to save: before it exits for a host change, once its part of the commit
is on disk (before the barrier after which ranks exit); after the training function returned, at
its exit (an ``atexit`` handler, which runs after the program's own code). Once every rank of the
job has said so and ``mpirun`` has not exited ``EXITED_GRACE_S`` seconds later, ``mpirun`` and
every process below it get SIGKILL and the job's status is the one the ranks gave.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from unison.run.report import HOST_LOST_STATUS, MpirunReport, RankFailure

__all__: list[str] = []

logger = logging.getLogger(__name__)

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FORCE_AFTER_S = 5.0
KILL_AFTER_S = 10.0
HOST_LOST_GRACE_S = 10.0
EXITED_GRACE_S = 10.0
RANK_FAILED_GRACE_S = 10.0
_READ_SIZE = 1 << 16


@dataclass
class JobResult:
    """How a job ended.

    Attributes:
        status: ``unisonrun``'s exit status: ``mpirun``'s, or ``128 + N`` when the job was
            stopped by signal ``N`` sent to the launcher.
        stop_signal: The signal that stopped the job, or ``None``.
        report: The rank failures ``mpirun`` reported.
    """

    status: int
    stop_signal: int | None = None
    report: MpirunReport = field(default_factory=MpirunReport)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first), read from ``/proc``; empty without it."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue += children.get(child, [])
    return found


class _Stopper:
    """Forwards stop signals to ``mpirun`` and escalates when it does not end; see [Note: stopping a job]."""

    def __init__(self, force_after_s: float, kill_after_s: float) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.signum: int | None = None
        self._since = 0.0
        self._stages = [(force_after_s, self._force), (kill_after_s, self._kill)]
        self._poll_s = 1.0  # how often to look for a stop: a handler cannot cut a blocking wait short

    def handle(self, signum: int, frame: object) -> None:
        """Signal handler: forward ``signum`` now (or as soon as ``mpirun`` has started)."""
        if self.signum is None:
            self.signum, self._since = signum, time.monotonic()
        self._send(signum)

    def started(self, process: subprocess.Popen[bytes]) -> None:
        """Takes the started ``mpirun``; passes on a signal that came while it was starting."""
        self.process = process
        if self.signum is not None:
            self._send(self.signum)

    def next_wakeup(self) -> float:
        """Seconds until the next escalation is due, or until the next look for a stop signal."""
        if self.signum is None or not self._stages:
            return self._poll_s
        return max(0.05, self._since + self._stages[0][0] - time.monotonic())

    def escalate(self) -> None:
        """Runs the escalations that are due."""
        while self._stages and self.signum is not None and time.monotonic() >= self._since + self._stages[0][0]:
            delay, action = self._stages.pop(0)
            action(delay)

    def _send(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            logger.info("forwarding signal %d to mpirun (pid %d)", signum, self.process.pid)
            self.process.send_signal(signum)

    def _force(self, delay: float) -> None:
        if self.signum is not None and self.process is not None and self.process.poll() is None:
            logger.warning("mpirun is still running %g s after signal %d: sending it again to force the stop",
                           delay, self.signum)
            self._send(self.signum)

    def _kill(self, delay: float) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        count = kill_tree(self.process.pid)
        logger.warning("mpirun (pid %d) was still running %g s after signal %s: killed it and the %d "
                       "process(es) below it", self.process.pid, delay, self.signum, count)


def kill_tree(pid: int) -> int:
    """SIGKILLs ``pid`` and every process below it (found first: orphans cannot be found later).

    Returns:
        How many processes below ``pid`` there were.
    """
    below = descendants(pid)
    for each in [pid, *below]:
        try:
            os.kill(each, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(below)


#: the status a failed rank gives ``mpirun`` (its ``how``, see ``report.py``): [Note: a failed job whose output
#: stays open]; ``mpirun`` exits with an ``MPI_Abort`` code or exit status modulo 256, and never 0 for a failure
_FAILURE_STATUS = (
    (re.compile(r"error code (-?\d+)"), lambda n: n % 256 or 1),
    (re.compile(r"by signal (\d+)"), lambda n: 128 + n),
    (re.compile(r"exited with status (-?\d+)"), lambda n: n % 256 or 1),
)


def failure_status(failure: RankFailure) -> int:
    """The exit status ``mpirun`` gives for ``failure`` (1 where its message gives none)."""
    for pattern, status in _FAILURE_STATUS:
        found = pattern.search(failure.how)
        if found:
            return status(int(found[1]))
    return 1


def _pipes(pid: int) -> set[str]:
    """The pipes process ``pid`` has open (``pipe:[INODE]``), read from ``/proc``; empty without it."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("pipe:"):
                found.add(link)
    except OSError:
        pass
    return found


def _holders(pipes: set[str]) -> list[str]:
    """``PID (NAME)`` of the processes but this one that hold one of ``pipes`` open."""
    found = []
    for entry in os.listdir("/proc") if pipes and os.path.isdir("/proc") else []:
        if entry.isdigit() and int(entry) != os.getpid() and _pipes(int(entry)) & pipes:
            try:
                found.append(f"{entry} ({Path(f'/proc/{entry}/comm').read_text().strip()})")
            except OSError:
                continue
    return found


def _copy_output(source: BinaryIO, sink: BinaryIO | None, report: MpirunReport, stream: str) -> None:
    """Copies ``mpirun``'s ``stream`` to ``sink`` as it arrives and feeds it to ``report``."""
    fd = source.fileno()
    while chunk := os.read(fd, _READ_SIZE):
        if sink is not None:
            try:
                sink.write(chunk)
                sink.flush()
            except (OSError, ValueError):  # our stream is gone: keep reading so mpirun never blocks
                sink = None
        report.feed(chunk.decode(errors="replace"), stream)


def _sink(stream: str) -> BinaryIO | None:
    """The binary stream under ``sys.stdout``/``sys.stderr``, or ``None`` when there is none."""
    text = getattr(sys, stream)
    return getattr(text, "buffer", None) if text is not None else None


def run_command(command: Sequence[str], env: Mapping[str, str] | None = None, *,
                force_after_s: float = FORCE_AFTER_S, kill_after_s: float = KILL_AFTER_S,
                host_lost_grace_s: float = HOST_LOST_GRACE_S,
                exited_grace_s: float = EXITED_GRACE_S,
                rank_failed_grace_s: float | None = None,
                on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
                stopped_before: Callable[[], int | None] | None = None) -> JobResult:
    """Runs ``mpirun`` (or any command) to its end; see [Note: stopping a job].

    Args:
        command: The command line to run.
        env: Its environment; this process's when ``None``.
        force_after_s: Seconds after the first stop signal at which it is sent again.
        kill_after_s: Seconds after the first stop signal at which the command and every
            process below it are killed.
        host_lost_grace_s: Seconds after a lost host is reported at which the command and
            every process below it are killed, if it is still running.
        exited_grace_s: Seconds after every rank of an elastic job said it exits at which the command
            and every process below it are killed, if it is still running (see
            [Note: a prterun that outlives its ranks]).
        rank_failed_grace_s: Seconds after the report named a failed rank at which the command and
            every process below it are killed, if it is still running (see [Note: a failed job whose
            output stays open]); ``None``: never (a ULFM job's survivors go on).
        on_start: called with the started process (the restart tier's rank watch, see rankwatch.py).
        stopped_before: Gives the stop signal that came before this call (the probe's, see
            [Note: a signal during the probe] in ``probe.py``), or ``None``; asked once the
            forwarding handlers are installed, so that no signal is lost in between. With one,
            nothing is started.

    Returns:
        How the job ended.

    Raises:
        OSError: The command cannot be started.
    """
    stopper = _Stopper(force_after_s, kill_after_s)
    report = MpirunReport()
    previous = {sig: signal.signal(sig, stopper.handle) for sig in FORWARDED_SIGNALS}
    try:
        early = None if stopped_before is None else stopped_before()
        if early is not None:
            return JobResult(128 + early, early, report)
        process = subprocess.Popen(list(command), env=None if env is None else dict(env),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stopper.started(process)
        if on_start is not None:
            on_start(process)
        copiers = [threading.Thread(target=_copy_output, args=(source, _sink(name), report, name),
                                    name=f"unisonrun-{name}", daemon=True)
                   for name, source in (("stdout", process.stdout), ("stderr", process.stderr))]
        for copier in copiers:
            copier.start()
        status, killed = _wait(process, stopper, report, host_lost_grace_s, exited_grace_s, rank_failed_grace_s)
        deadline = time.monotonic() + 5.0  # a rank that outlived mpirun may hold a pipe open: don't wait for it
        for copier in copiers:
            copier.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    status = 128 - status if status < 0 else status
    if stopper.signum is not None and status != 0:
        status = 128 + stopper.signum
    elif killed == "exited":
        status = report.exiting_status
    elif killed == "rank-failed":
        status = failure_status(report.failures[0])
    elif killed:
        status = HOST_LOST_STATUS
    else:
        status = report.status(status)
    return JobResult(status, stopper.signum, report)


def _wait(process: subprocess.Popen[bytes], stopper: _Stopper, report: MpirunReport,
          grace_s: float, exited_grace_s: float, failed_grace_s: float | None = None) -> tuple[int, str]:
    """Waits for ``process``, running the stopper's escalations while a stop is pending.

    Returns:
        The process's status, and why the launcher killed it: ``"host-lost"`` (it outlived a lost
        host's grace), ``"exited"`` (it outlived every rank of an elastic job), ``"rank-failed"`` (it
        outlived a failed rank's grace), or ``""``.
    """
    killed = ""
    failed_at: float | None = None  # when this loop first saw a failed rank in the report
    while True:
        if failed_at is None and failed_grace_s is not None and report.failures:
            failed_at = time.monotonic()
        wakeup = stopper.next_wakeup()
        deadlines = [at + grace for at, grace in ((report.host_lost_at, grace_s),
                                                  (report.all_exiting_at, exited_grace_s),
                                                  (failed_at, failed_grace_s))
                     if at is not None and grace is not None]
        if deadlines and not killed:
            wakeup = min(wakeup, max(0.05, min(deadlines) - time.monotonic()))
        try:
            return process.wait(timeout=wakeup), killed
        except subprocess.TimeoutExpired:
            stopper.escalate()
        exiting_at = report.all_exiting_at
        if exiting_at is not None and not killed and time.monotonic() >= exiting_at + exited_grace_s:
            count = kill_tree(process.pid)
            killed = "exited"
            logger.warning("mpirun was still running %g s after all %d rank(s) said they exit (status %d): killed "
                           "it and the %d process(es) below it", exited_grace_s, report.exiting_size,
                           report.exiting_status, count)
        lost_at = report.host_lost_at
        if lost_at is not None and not killed and time.monotonic() >= lost_at + grace_s:
            count = kill_tree(process.pid)
            killed = "host-lost"
            logger.warning("mpirun was still running %g s after host %s was lost: killed it and the %d "
                           "process(es) below it", grace_s, report.hosts_lost[0].host, count)
        if (failed_at is not None and failed_grace_s is not None and not killed
                and time.monotonic() >= failed_at + failed_grace_s):
            _end_failed(process, report, failed_grace_s)
            killed = "rank-failed"


def _end_failed(process: subprocess.Popen[bytes], report: MpirunReport, grace_s: float) -> None:
    """Kills an ``mpirun`` that outlived a failed rank; see [Note: a failed job whose output stays open]."""
    pipes = _pipes(process.pid)  # the ranks' output reaches mpirun through these
    count = kill_tree(process.pid)
    try:
        process.wait(timeout=1.0)  # (its pipes close as it exits)
    except subprocess.TimeoutExpired:
        pass
    holders = _holders(pipes)
    logger.warning("mpirun was still running %g s after %s: killed it and the %d process(es) below it%s", grace_s,
                   report.failures[0].describe(), count,
                   f"; the ranks' output is still held open by process(es) outside the job, e.g. a helper a rank "
                   f"started in its own session, not killed: {', '.join(holders[:8])}" if holders else "")
