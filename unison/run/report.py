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
"""

from __future__ import annotations

import re
import signal
from typing import NamedTuple

__all__: list[str] = []

_BOX_EDGE = re.compile(r"-{20,}")
_MAX_BOX_LINES = 60  # a box longer than this is not one of the failure messages


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


_PROC = r"process rank (?P<rank>\d+) with PID (?P<pid>\d+) on node (?P<node>\S+)"
_PATTERNS = (
    (re.compile(_PROC + r" exited on signal (?P<sig>\d+)"), _killed),
    (re.compile(_PROC + r" exiting improperly"), _improper),
    (re.compile(_PROC + r' calling "abort"'), _abort_call),
    (re.compile(r"MPI_ABORT was invoked on rank (?P<rank>\d+) .*?Errorcode: (?P<code>-?\d+)"), _abort_code),
    (re.compile(r"non-zero status.*?Process name: \[\S*?,(?P<rank>\d+)\]\s*Exit code: (?P<code>-?\d+)"),
     _nonzero),
)


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


class MpirunReport:
    """Collects the rank failures ``mpirun`` reports, from its stderr fed in pieces of any size."""

    def __init__(self) -> None:
        self.failures: list[RankFailure] = []
        #: mpirun's time limit (``--timeout``, ``MPIEXEC_TIMEOUT``) when it ended the job, e.g. "60 seconds"
        self.time_limit: str | None = None
        self._tail = ""
        self._box: list[str] | None = None

    def feed(self, text: str) -> None:
        """Takes the next piece of ``mpirun``'s stderr."""
        lines = (self._tail + text).split("\n")
        self._tail = lines.pop()[-4096:]  # an unfinished line (a progress bar never ends one)
        for line in lines:
            self._line(line)

    def _line(self, line: str) -> None:
        if _BOX_EDGE.fullmatch(line.strip()):
            if self._box:
                text = "\n".join(self._box)
                self._add(parse_box(text))
                limit = _TIME_LIMIT.search(" ".join(text.split()))
                self.time_limit = limit["limit"] if limit else self.time_limit
            self._box = []  # an edge closes one box and may open the next
        elif self._box is not None:
            self._box.append(line)
            if len(self._box) > _MAX_BOX_LINES:
                self._box = None

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
        return bool(self._tail)

    def summary(self, status: int) -> str:
        """The closing line for a job that ended with ``status`` (non-zero)."""
        head = f"the job failed (exit status {status})"
        if self.time_limit and not self.failures:
            return f"{head}: it reached mpirun's time limit (--timeout, MPIEXEC_TIMEOUT) of {self.time_limit}"
        if not self.failures:
            return head + "; mpirun named no failed rank: see the messages above"
        first, *others = self.failures
        text = f"{head}: {first.describe()}"
        if others:
            text += "; then " + "; ".join(f.describe() for f in others)
        return text
