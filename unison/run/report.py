"""Read ``mpirun``'s own failure messages and say in one line which rank failed and how.

[Note: naming the failed rank]
When a rank fails, Open MPI 5 (PRRTE) prints a boxed message on ``mpirun``'s stderr. Most
name the rank plainly, e.g.::

    prterun noticed that process rank 1 with PID 8211 on node vm exited on
    signal 9 (Killed).

but one does not: for a rank that exits with a non-zero status it prints only
``Process name: [prterun-vm-7915@1,0]`` (job 1, rank 0), and the boxes sit among every rank's
output. ``unisonrun`` copies ``mpirun``'s stderr through unchanged and feeds it to
:class:`MpirunReport`, which recognises these boxes; after a failed job the launcher prints one
closing line such as::

    unisonrun: the job failed (exit status 137): rank 1 (PID 8211 on vm) was killed by signal 9 (SIGKILL)

The patterns below were taken from PRRTE 3.0 (Open MPI 5.0) messages; text they do not match
is passed through all the same, and the closing line then gives only the exit status.

[Note: naming a lost host]
A job across hosts can also lose a whole host. Three messages say so, and name it:

* Unison's heartbeat line (``unison/common/heartbeat.py``), written by a rank on a healthy host
  when a neighbour on another host has been silent for ``UNISON_HOST_TIMEOUT_SECONDS``;
* PRRTE's box "A daemon failed to report back ... Remote host: NAME", which ``mpirun`` prints
  when the daemon of a host dies, also mid-job (measured: every process of a test host killed;
  ``mpirun`` then exits within a second, with status 0);
* PRRTE's boxes "PRTE has lost communication with a remote daemon ... on node NAME" and "PRTE is
  unable to establish a communication connection ... target node: NAME".

The closing line then starts with the host, e.g.::

    unisonrun: the job failed (exit status 75): host node7 stopped answering: rank 1 (on node3) heard
    nothing from rank 2 for 30.4 s (UNISON_HOST_TIMEOUT_SECONDS); check that host and its network link

and the status is never 0: :data:`HOST_LOST_STATUS` when ``mpirun``'s is 0, or when the
launcher had to kill ``mpirun`` (see [Note: stopping a job] in ``supervise.py``).
"""

from __future__ import annotations

import re
import signal
import time
from typing import NamedTuple

__all__: list[str] = []

_BOX_EDGE = re.compile(r"-{20,}")
_MAX_BOX_LINES = 60  # a box longer than this is not one of the failure messages


#: exit status for a job that lost a host when ``mpirun`` gave none (0, or killed by the launcher);
#: the same as ``unison.common.heartbeat.ABORT_CODE`` (sysexits.h ``EX_TEMPFAIL``; a test checks)
HOST_LOST_STATUS = 75


#: the line rank 0 prints when an elastic job's training function returned (unison.common.elastic.runner):
#: it reaches unisonrun through mpirun's output from any host
ELASTIC_FINISHED = "[unison] elastic: the training function returned"

#: the start of the line each rank of an in-place elastic job prints when it leaves the job because it is on the
#: side of a split that may not go on ([Note: a partitioned job] in unison/common/elastic/recovery.py): the job
#: did not finish unless another side's rank 0 says :data:`ELASTIC_FINISHED`
ELASTIC_LEFT = "[unison] elastic: leaving the job"

#: the status every rank of an elastic job exits with when the hosts changed and the commit is on disk;
#: ``unisonrun``'s driver then starts the job on the new hosts (unison.common.elastic.runner)
RESTART_STATUS = 76

#: the status every rank of an elastic job exits with when its in-place resets went past the driver's
#: ``--reset-limit`` (the job's share of it: ``UNISON_ELASTIC_RESET_LIMIT``); the driver gives up
RESET_LIMIT_STATUS = 77

#: the line rank 0 of an elastic job prints after each reset in place, followed by `` <n>``: the job's resets
#: so far, which the driver adds to its count for ``--reset-limit``
ELASTIC_RESET = "[unison] elastic: reset in place, number"
_RESET = re.compile(re.escape(ELASTIC_RESET) + r" (?P<n>\d+)")

#: the line each rank of an elastic job prints when it is about to exit and has nothing left to save, followed
#: by ``<status>, rank <rank> of <size>``: once its part of the commit is on disk before it exits with
#: :data:`RESTART_STATUS`, or at its exit after the training function returned (status 0); see
#: [Note: a prterun that outlives its ranks] in supervise.py
ELASTIC_EXITING = "[unison] elastic: exiting with status"
_EXITING = re.compile(re.escape(ELASTIC_EXITING) + r" (?P<status>\d+), rank (?P<rank>\d+) of (?P<size>\d+)")


def exiting_line(status: int, rank: int, size: int) -> str:
    """The :data:`ELASTIC_EXITING` line of ``rank`` of ``size`` that exits with ``status``."""
    return f"{ELASTIC_EXITING} {status}, rank {rank} of {size}"


class HostFailure(NamedTuple):
    """A host the job lost, as a rank's heartbeat or ``mpirun`` reported it."""

    host: str
    how: str

    def describe(self) -> str:
        """``host node7 stopped answering: ...; check that host and its network link``."""
        return f"host {self.host} {self.how}; check that host and its network link"


class RankFailure(NamedTuple):
    """One rank's failure as ``mpirun`` reported it."""

    rank: int
    how: str
    pid: int | None = None
    node: str | None = None

    def describe(self) -> str:
        """``rank 1 (PID 8211 on vm) was killed by signal 9 (SIGKILL)``."""
        where = []
        if self.pid:  # PRRTE prints PID 0 when it does not know it
            where.append(f"PID {self.pid}")
        if self.node:
            where.append(f"on {self.node}")
        return f"rank {self.rank}" + (f" ({' '.join(where)})" if where else "") + f" {self.how}"


def _signal_name(number: int) -> str:
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def _killed(m: re.Match[str]) -> RankFailure:
    return RankFailure(int(m["rank"]), f"was killed by {_signal_name(int(m['sig']))}", int(m["pid"]), m["node"])


def _improper(m: re.Match[str]) -> RankFailure:
    return RankFailure(int(m["rank"]), "exited without calling MPI_Finalize (a crash, or os._exit)",
                       int(m["pid"]), m["node"])


def _abort_call(m: re.Match[str]) -> RankFailure:
    return RankFailure(int(m["rank"]), "called MPI_Abort (see its output above)", int(m["pid"]), m["node"])


def _abort_code(m: re.Match[str]) -> RankFailure:
    return RankFailure(int(m["rank"]), f"called MPI_Abort with error code {m['code']} (see its output above)")


def _nonzero(m: re.Match[str]) -> RankFailure:
    return RankFailure(int(m["rank"]), f"exited with status {m['code']}")


def _no_executable(m: re.Match[str]) -> RankFailure:
    return RankFailure(int(m["rank"]), f"could not start {m['exe']}: not found, or not executable there "
                       "(give its full path, or chmod +x it)", node=m["node"])


_PROC = r"process rank (?P<rank>\d+) with PID (?P<pid>\d+) on node (?P<node>\S+)"
_PATTERNS = (
    (re.compile(_PROC + r" exited on signal (?P<sig>\d+)"), _killed),
    (re.compile(_PROC + r" exiting improperly"), _improper),
    (re.compile(_PROC + r' calling "abort"'), _abort_call),
    (re.compile(r"MPI_ABORT was invoked on rank (?P<rank>\d+) .*?Errorcode: (?P<code>-?\d+)"), _abort_code),
    (re.compile(r"non-zero status.*?Process name: \[\S*?,(?P<rank>\d+)\]\s*Exit code: (?P<code>-?\d+)"),
     _nonzero),
    (re.compile(r"unable to launch the specified application as it could not access an executable: "
                r"Executable: (?P<exe>\S+) Node: (?P<node>\S+) while attempting to start process rank "
                r"(?P<rank>\d+)"), _no_executable),
)


_HEARTBEAT = re.compile(
    r"\[unison\] host (?P<host>\S+) is not answering: rank (?P<rank>\d+) \(on (?P<me>\S+)\) has heard "
    r"nothing from rank (?P<peer>\d+) on \S+ for (?P<seconds>[\d.]+) s \(UNISON_(?P<env>\w+)=")
_HOST_BOXES = (
    (re.compile(r"daemon failed to report back.*?Remote host: (?P<host>\S+)(?:.*?Daemon exit status: "
                r"(?P<code>-?\d+))?"), "lost its Open MPI daemon (it died, or could not connect back to mpirun)"),
    (re.compile(r"lost communication with a remote daemon.*?Remote daemon: \S+ on node (?P<host>\S+)"),
     "lost its connection to mpirun (mpirun lost communication with its daemon)"),
    (re.compile(r"unable to establish a communication connection.*?target node: (?P<host>\S+)"),
     "could not be reached by mpirun's daemons"),
)


def parse_heartbeat(line: str) -> HostFailure | None:
    """Recognises the line a rank's heartbeat writes before aborting (see [Note: naming a lost host])."""
    found = _HEARTBEAT.search(line)
    if not found:
        return None
    return HostFailure(found["host"], f"stopped answering: rank {found['rank']} (on {found['me']}) heard "
                       f"nothing from rank {found['peer']} for {found['seconds']} s (UNISON_{found['env']})")


def parse_host_box(text: str) -> HostFailure | None:
    """Recognises one of ``mpirun``'s boxed messages about a lost host, in any line wrapping."""
    flat = " ".join(text.split())
    for pattern, how in _HOST_BOXES:
        found = pattern.search(flat)
        if found:
            return HostFailure(found["host"], how)
    return None


_TIME_LIMIT = re.compile(r"time limit for job execution has been reached: Timeout: (?P<limit>\S+ \S+)")


def parse_box(text: str) -> RankFailure | None:
    """Recognises one of ``mpirun``'s boxed failure messages.

    Args:
        text: The lines between two edges of dashes, in any line wrapping.

    Returns:
        The failure it reports, or ``None`` for any other message.
    """
    flat = " ".join(text.split())
    for pattern, make in _PATTERNS:
        found = pattern.search(flat)
        if found:
            return make(found)
    return None


class _Stream:
    """The unfinished line and the open box of one of ``mpirun``'s output streams."""

    def __init__(self) -> None:
        self.tail = ""
        self.box: list[str] | None = None


class MpirunReport:
    """Collects the failures ``mpirun`` reports, from its output fed in pieces of any size.

    ``mpirun`` prints most boxes on stderr but some (a lost daemon) on stdout, so both are fed,
    each as its own stream: lines and boxes never mix across them.
    """

    def __init__(self) -> None:
        self.failures: list[RankFailure] = []
        #: hosts the job lost, first report first (see [Note: naming a lost host])
        self.hosts_lost: list[HostFailure] = []
        #: ``time.monotonic()`` when the first lost host was reported, else ``None``
        self.host_lost_at: float | None = None
        #: mpirun's time limit (``--timeout``, ``MPIEXEC_TIMEOUT``) when it ended the job, e.g. "60 seconds"
        self.time_limit: str | None = None
        #: whether a rank printed :data:`ELASTIC_FINISHED` (the elastic training function returned)
        self.elastic_finished = False
        #: how many ranks printed :data:`ELASTIC_LEFT` (left the job on the losing side of a split)
        self.elastic_left = 0
        #: the status each rank gave in its :data:`ELASTIC_EXITING` line, and the job's size they gave
        self.exiting: dict[int, int] = {}
        self.exiting_size: int | None = None
        #: ``time.monotonic()`` when every rank had printed :data:`ELASTIC_EXITING`, else ``None``
        self.all_exiting_at: float | None = None
        #: the job's resets in place (the largest number an :data:`ELASTIC_RESET` line gave)
        self.elastic_resets = 0
        self._streams = {"stderr": _Stream(), "stdout": _Stream()}

    def feed(self, text: str, stream: str = "stderr") -> None:
        """Takes the next piece of ``mpirun``'s ``stream`` (``"stderr"`` or ``"stdout"``)."""
        state = self._streams[stream]
        lines = (state.tail + text).split("\n")
        state.tail = lines.pop()[-4096:]  # an unfinished line (a progress bar never ends one)
        for line in lines:
            self._line(line, state)

    def _line(self, line: str, state: _Stream) -> None:
        if ELASTIC_FINISHED in line:
            self.elastic_finished = True
        if ELASTIC_LEFT in line:
            self.elastic_left += 1
        reset = _RESET.search(line)
        if reset is not None:
            self.elastic_resets = max(self.elastic_resets, int(reset["n"]))
        exiting = _EXITING.search(line)
        if exiting is not None:
            self.exiting[int(exiting["rank"])] = int(exiting["status"])
            self.exiting_size = int(exiting["size"])
            if len(self.exiting) >= self.exiting_size and self.all_exiting_at is None:
                self.all_exiting_at = time.monotonic()
        self._add_host(parse_heartbeat(line))
        if _BOX_EDGE.fullmatch(line.strip()):
            if state.box:
                text = "\n".join(state.box)
                self._add(parse_box(text))
                self._add_host(parse_host_box(text))
                limit = _TIME_LIMIT.search(" ".join(text.split()))
                self.time_limit = limit["limit"] if limit else self.time_limit
            state.box = []  # an edge closes one box and may open the next
        elif state.box is not None:
            state.box.append(line)
            if len(state.box) > _MAX_BOX_LINES:
                state.box = None

    @property
    def exiting_status(self) -> int:
        """The status the ranks said they exit with (the largest, should they differ)."""
        return max(self.exiting.values(), default=0)

    def _add_host(self, failure: HostFailure | None) -> None:
        if failure is None or any(known.host == failure.host for known in self.hosts_lost):
            return
        self.hosts_lost.append(failure)
        if self.host_lost_at is None:
            self.host_lost_at = time.monotonic()

    def _add(self, failure: RankFailure | None) -> None:
        if failure is None:
            return
        known = next((i for i, f in enumerate(self.failures) if f.rank == failure.rank), None)
        if known is None:
            self.failures.append(failure)
            return
        first = self.failures[known]  # a later box about the same rank may add where it ran
        self.failures[known] = first._replace(pid=first.pid or failure.pid or None,
                                              node=first.node or failure.node)

    @property
    def mid_line(self) -> bool:
        """Whether the text fed so far ends inside a line (a closing line must start a new one)."""
        return bool(self._streams["stderr"].tail)

    def status(self, mpirun_status: int) -> int:
        """``unisonrun``'s exit status for ``mpirun``'s: never 0 once a host was lost or a rank failed
        (``mpirun`` exits with an ``MPI_Abort`` error code modulo 256: ``Abort(256)`` gave 0)."""
        if self.hosts_lost and mpirun_status == 0:
            return HOST_LOST_STATUS
        if self.failures and mpirun_status == 0:
            return 1
        return mpirun_status

    def summary(self, status: int) -> str:
        """The closing line for a job that ended with ``status`` (non-zero)."""
        head = f"the job failed (exit status {status})"
        if self.time_limit and not self.failures and not self.hosts_lost:
            return f"{head}: it reached mpirun's time limit (--timeout, MPIEXEC_TIMEOUT) of {self.time_limit}"
        described = [f.describe() for f in self.hosts_lost] + [f.describe() for f in self.failures]
        if not described:
            return head + "; mpirun named no failed rank: see the messages above"
        text = f"{head}: {described[0]}"
        if described[1:]:
            text += "; then " + "; ".join(described[1:])
        return text
