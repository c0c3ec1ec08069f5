"""``unisonrun``'s elastic driver: restart the job on the current hosts when it fails or the hosts change.

[Note: the elastic driver]
With ``--elastic`` (or ``--min-np``, ``--max-np``, ``--host-discovery-script``) ``unisonrun``
supervises a sequence of MPI jobs instead of one::

    loop
        hosts  <- the discovery script's "host:slots" lines (or -H / the hostfile / this machine),
                  minus blacklisted hosts; wait up to --elastic-timeout for >= --min-np slots
        np     <- every available slot, at most --max-np (without discovery: -np)
        start  mpirun (with --with-ft ulfm in the in-place tier) with
                  UNISON_ELASTIC_STATE_DIR  the folder for each host's spilled commits
                  UNISON_ELASTIC_ATTEMPT    how many jobs ran before this one
                  UNISON_ELASTIC_NOTICE     a file this driver writes when the hosts change
        while it runs: poll the discovery script; on a change write the notice: at their next
                  commit every rank sees it, the commit is on disk, the ranks exit with status 76
        it ended: the training finished (rank 0 printed report.ELASTIC_FINISHED at its exit) and
                  mpirun's status is 0, or only ranks that died on the way failed  -> done, status 0
                  a rank failed after its training function returned  -> done, that status
                  status 0, no rank named failed and none of this host's ranks died in its
                  training (a script without elastic.run)            -> done, status 0
                  (see [Note: the driver's verdict])
                  unisonrun was stopped (Ctrl-C, SIGTERM)              -> stop, no restart
                  status 76 (the hosts changed)                        -> start again (a reset)
                  status 77 (the job's resets in place went past its share of --reset-limit,
                  UNISON_ELASTIC_RESET_LIMIT; [Note: --reset-limit in place])   -> give up
                  anything else (a rank or host died, and the in-place tier could not carry on,
                  or this is the restart tier)                         -> count a failure
                  against each host mpirun named; a host that failed --blacklist-after times
                  is left out for --blacklist-cooldown seconds; start again unless
                  --max-restarts failures or --reset-limit resets were used up

Each new job resumes from the newest commit any host still holds ([Note: the restart tier's
commits] in unison/common/elastic/store.py). The tier: ``--elastic-mode inplace`` (ULFM: a rank's
death is survived inside the job; the driver steps in only for host changes and jobs that end
anyway), ``restart`` (no ULFM: every failure restarts), ``auto`` (inplace when ``ompi_info`` says
"FT MPI support: yes", else restart, and the log says which).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from unison.run.hosts import Host, parse_hosts
from unison.run.rankwatch import read_records, records_folder
from unison.run.report import RESET_LIMIT_STATUS, RESTART_STATUS

__all__ = ["ElasticOptions", "Driver", "JobEnd", "discover", "fixed_hosts_error", "has_ulfm", "RESTART_STATUS",
           "ELASTIC_MPI_ARGS", "DETECTOR_MPI_ARGS"]

logger = logging.getLogger("unison.run.elastic")

#: mpirun arguments of the in-place tier: ULFM, and no fence in ``MPI_Finalize`` (with a rank dead,
#: Open MPI 5.0's fence at finalize hung in about 1 run of 20 after a recovery, also without
#: Unison; none in 60 runs without it; see docs/elastic.md)
ELASTIC_MPI_ARGS = ("--with-ft", "ulfm", "--mca", "async_mpi_finalize", "1")
#: ULFM's failure detector, added by ``unisonrun`` to an in-place job that spans hosts: see
#: [Note: a lost host in the in-place tier] in launcher.py
DETECTOR_PERIOD_S, DETECTOR_TIMEOUT_S = 0.5, 3.0
DETECTOR_MPI_ARGS = ("--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "true",
                     "--mca", "mpi_ft_detector_period", f"{DETECTOR_PERIOD_S:g}",
                     "--mca", "mpi_ft_detector_timeout", f"{DETECTOR_TIMEOUT_S:g}")
_FT = re.compile(r"FT MPI support:\s*yes", re.IGNORECASE)


class JobEnd(NamedTuple):
    """How one MPI job of the elastic run ended."""

    status: int
    #: hosts of the ranks mpirun named as failed
    failed: tuple[str, ...] = ()
    #: hosts the job lost (the heartbeat's or mpirun's report)
    lost: tuple[str, ...] = ()
    #: the training function returned (rank 0 printed report.ELASTIC_FINISHED)
    finished: bool = False
    #: unisonrun itself was stopped by a signal (Ctrl-C, the scheduler's SIGTERM): do not restart
    stopped: bool = False
    #: mpirun reported a rank that failed (MPI_Abort, a signal), named host or not
    rank_failed: bool = False
    #: how many ranks left the job on the losing side of a split (report.ELASTIC_LEFT)
    left: int = 0
    #: the resets the job made in place (rank 0's report.ELASTIC_RESET lines)
    resets: int = 0
    #: the status the ranks said they exit with (report.ELASTIC_EXITING lines), else 0
    exiting: int = 0


@dataclasses.dataclass
class ElasticOptions:
    """What ``unisonrun``'s elastic flags asked for (see ``unisonrun --help``)."""

    np: int | None = None
    min_np: int = 1
    max_np: int | None = None
    discovery_script: str | None = None
    elastic_timeout_s: float = 600.0
    max_restarts: int = 3
    reset_limit: int | None = None
    mode: str = "auto"
    blacklist_after: int = 2
    blacklist_cooldown_s: float = 300.0
    poll_s: float = 2.0

    def check(self) -> None:
        """Raises ValueError naming the flag when a value makes no sense."""
        if self.min_np < 1:
            raise ValueError(f"--min-np {self.min_np} must be >= 1")
        if self.max_np is not None and self.max_np < self.min_np:
            raise ValueError(f"--max-np {self.max_np} is below --min-np {self.min_np}")
        if self.np is not None and self.np < self.min_np:
            raise ValueError(f"-np {self.np} is below --min-np {self.min_np}")
        if self.np is not None and self.max_np is not None and self.np > self.max_np:  # (before 2026-12-05 -np
            raise ValueError(f"-np {self.np} is above --max-np {self.max_np}: give -np at most "  # was ignored)
                             f"{self.max_np}, or raise --max-np")
        seconds = (self.elastic_timeout_s, self.poll_s, self.blacklist_cooldown_s)
        if not all(math.isfinite(x) for x in seconds) or self.elastic_timeout_s < 0 or self.poll_s <= 0 \
                or self.blacklist_cooldown_s < 0:  # (nan polled in a busy loop; inf killed the watcher thread)
            raise ValueError(f"--elastic-timeout {self.elastic_timeout_s!r} and --blacklist-cooldown "
                             f"{self.blacklist_cooldown_s!r} must be finite numbers >= 0, --discovery-interval "
                             f"{self.poll_s!r} a finite number > 0")
        if self.max_restarts < 0 or (self.reset_limit is not None and self.reset_limit < 0):
            raise ValueError("--max-restarts and --reset-limit must be >= 0")
        if self.blacklist_after < 1:
            raise ValueError(f"--blacklist-after {self.blacklist_after} must be >= 1")
        if self.mode not in ("auto", "inplace", "restart"):
            raise ValueError(f"--elastic-mode {self.mode!r}: use auto, inplace or restart")


def _slots(options: ElasticOptions, hosts: list[Host] | None) -> int:
    if hosts is None:  # this machine alone: -np ranks
        return options.np or options.max_np or options.min_np
    return sum(h.slots for h in hosts)


def planned_np(options: ElasticOptions, hosts: list[Host] | None,
               blacklist: Collection[str] = ()) -> int:
    """How many ranks a job of the elastic run starts on ``hosts`` (None: this machine alone)."""
    available = _slots(options, hosts)
    if options.discovery_script is None and options.np is not None:
        wanted = options.np  # (at most --max-np, see check(); before 2026-12-05 --max-np raised it)
        if not blacklist:  # the hosts the user gave, all there: -np as asked (mpirun may oversubscribe)
            return wanted
        if wanted > available:
            logger.warning("-np %d exceeds the %d slot(s) left without the blacklisted host(s) %s: "
                           "starting %d", wanted, available, ", ".join(sorted(blacklist)), available)
    else:
        wanted = options.max_np if options.max_np is not None else available
    return min(wanted, available)


def discover(script: str, timeout_s: float = 30.0) -> list[Host]:
    """Run the host discovery script; its ``host:slots`` (or ``host``) lines, blank and ``#`` lines skipped.

    The script runs in a session of its own, so a stop signal typed at the terminal reaches unisonrun (which
    ends the run) and not the script, and a script that outlives ``timeout_s`` is killed with every process
    it started. Its output goes to unnamed temporary files, read once the script itself has exited: a child
    it leaves running in the background (a daemon it starts, ``cmd &``) may keep the output open without
    holding the poll up (before 2026-12-07 it was read through pipes, so such a child made every poll wait
    out the timeout and fail).

    Raises:
        RuntimeError: the script failed, timed out, printed a malformed line or output that is not UTF-8
            text (before 2026-12-07 a UnicodeDecodeError, which ended unisonrun with a traceback before the
            first job and killed the watcher that notices host changes during one).
    """
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        try:
            child = subprocess.Popen([script], stdin=subprocess.DEVNULL, stdout=out_file, stderr=err_file,
                                     start_new_session=True)
        except OSError as error:
            raise RuntimeError(f"host discovery script {script!r} could not run: {error}") from error
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            _kill_group(child)
            raise RuntimeError(f"host discovery script {script!r} could not run: it did not finish within "
                               f"{timeout_s:g} s") from error
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
    if child.returncode != 0:
        raise RuntimeError(f"host discovery script {script!r} exited with status {child.returncode}: "
                           f"{err.decode('utf-8', 'replace').strip()[-300:]}")
    try:
        text = out.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RuntimeError(f"host discovery script {script!r} printed a bad line: its output is not UTF-8 text "
                           f"({error}); print one host:slots per line") from error
    entries = [line.strip() for line in text.splitlines()
               if line.strip() and not line.strip().startswith("#")]  # (an indented comment too)
    if not entries:
        return []
    try:
        return parse_hosts(",".join(entries))
    except ValueError as error:
        raise RuntimeError(f"host discovery script {script!r} printed a bad line: {error}") from error


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    """Kills ``child`` and every process of its session, then reaps it."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:  # (gone already)
        child.kill()
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:  # (not reaped after SIGKILL: uninterruptible; leave it)
        pass


def has_ulfm(mpirun: str) -> bool:
    """Whether the Open MPI next to ``mpirun`` was built with ULFM (``ompi_info``: "FT MPI support: yes")."""
    info = Path(mpirun).with_name("ompi_info")
    program = str(info) if info.exists() else shutil.which("ompi_info")
    if program is None:
        return False
    try:
        out = subprocess.run([program], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(_FT.search(out))


class _Stopped(Exception):
    """A stop signal came while the driver was outside a job."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def fixed_hosts_error(options: ElasticOptions, hosts: list[Host] | None) -> str:
    """Why the user's own hosts (no discovery script) cannot start a job of --min-np ranks."""
    return (f"--min-np {options.min_np} needs more than the {_slots(options, hosts)} slot(s) of the hosts given "
            f"({_listing(hosts) or 'this machine'}), which do not change without --host-discovery-script: give "
            f"hosts with at least {options.min_np} slots, -np {options.min_np} (mpirun oversubscribes them), "
            "or a lower --min-np")


class Driver:
    """Runs MPI jobs until the training finishes (see [Note: the elastic driver]).

    Args:
        options: the elastic flags.
        static_hosts: the hosts of -H / the hostfile, or None for this machine alone.
        start: ``start(np, hosts or None, environ) -> JobEnd`` runs one job.
        environ: the base environment of every job.
        state_dir: the commits' folder (default: a new folder under the temporary directory).
        sleep: waits between polls for hosts; the launcher's wakes at a stop signal.
        stop_signal: the stop signal unisonrun received outside a job, or None; asked before each job and
            while waiting for hosts (a signal during a job reaches ``start``'s mpirun instead).
    """

    def __init__(self, options: ElasticOptions, static_hosts: list[Host] | None,
                 start: Callable[[int, list[Host] | None, Mapping[str, str]], JobEnd],
                 environ: Mapping[str, str], state_dir: str | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 discover_hosts: Callable[[str], list[Host]] = discover,
                 stop_signal: Callable[[], int | None] = lambda: None) -> None:
        options.check()
        self.options = options
        self.static_hosts = static_hosts
        self.start = start
        self.environ = dict(environ)
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="unison-elastic-")
        self._own_dir = state_dir is None
        self.clock, self.sleep, self._discover = clock, sleep, discover_hosts
        self._stop_signal = stop_signal  # a stop signal that came between jobs (see run())
        self.failures: dict[str, int] = {}
        self.blacklist: dict[str, float] = {}  # host -> when it may return
        self._started = False  # whether a job was started
        self._discovery_error: str | None = None  # the discovery script's last error, while it fails

    # ------------------------------------------------------------------ hosts
    def _hosts(self, previous: list[Host] | None) -> list[Host] | None:
        if self.options.discovery_script is None:
            return self.static_hosts
        try:
            found = self._discover(self.options.discovery_script)
        except RuntimeError as error:
            if not self._started:  # a script that cannot work (missing, not executable, bad output): say so at
                raise  # once (before 2026-12-05 the driver waited out --elastic-timeout with no hosts)
            self._discovery_error = str(error)
            logger.warning("%s; keeping the last hosts", error)
            return previous if previous is not None else []
        self._discovery_error = None
        return found

    def _usable(self, hosts: list[Host] | None) -> list[Host] | None:
        if hosts is None:
            return None
        now = self.clock()
        for name, until in list(self.blacklist.items()):
            if self.options.blacklist_cooldown_s > 0 and now >= until:
                logger.warning("host %s leaves the blacklist (cooldown over)", name)
                del self.blacklist[name]
                self.failures.pop(name, None)
        return [h for h in hosts if h.name not in self.blacklist]

    def _np(self, hosts: list[Host] | None) -> int:
        return planned_np(self.options, hosts, self.blacklist)

    def _needed(self) -> int:
        """The slots a job waits for: --min-np, and before the first job with discovery -np too (Horovod's
        rule: -np slots before the run starts, then every slot up to --max-np)."""
        if self.options.discovery_script is not None and not self._started and self.options.np is not None:
            return max(self.options.min_np, self.options.np)
        return self.options.min_np

    def _wait_for_hosts(self, previous: list[Host] | None) -> list[Host] | None:
        """Hosts with the slots a job needs (:meth:`_needed`), polling up to --elastic-timeout.

        Raises:
            RuntimeError: not enough slots by the deadline, or at once where the user's fixed hosts, all
                there, cannot give them (before 2026-12-07 that waited out --elastic-timeout, 600 s).
            _Stopped: a stop signal came meanwhile.
        """
        deadline = self.clock() + self.options.elastic_timeout_s
        needed = self._needed()
        while True:
            self._check_stop()
            hosts = self._usable(self._hosts(previous))
            if _slots(self.options, hosts) >= needed or (
                    self.options.discovery_script is None and not self.blacklist and self._np(hosts) >= needed):
                return hosts  # (the user's fixed hosts with -np: mpirun oversubscribes them, as without --elastic)
            if self.options.discovery_script is None and not self.blacklist:
                raise RuntimeError(fixed_hosts_error(self.options, hosts))
            if self.clock() >= deadline:
                listing = _listing(hosts) or "none"
                black = f"; blacklisted: {', '.join(sorted(self.blacklist))}" if self.blacklist else ""
                slots = _slots(self.options, hosts)
                why = f"; the last discovery failed: {self._discovery_error}" if self._discovery_error else ""
                wants = f"--min-np is {needed}" if needed == self.options.min_np else \
                    f"the first job waits for -np {needed}"
                raise RuntimeError(f"only {slots} slot(s) available (hosts: {listing}{black}) but "
                                   f"{wants}; waited "
                                   f"{self.options.elastic_timeout_s:g} s (--elastic-timeout){why}")
            self.sleep(min(self.options.poll_s, max(0.0, deadline - self.clock())))

    def _check_stop(self) -> None:
        signum = self._stop_signal()
        if signum is not None:
            raise _Stopped(signum)

    # ------------------------------------------------------------------ one job
    def _placement(self, hosts: list[Host] | None) -> tuple[int, list[tuple[str, int]]]:
        """The planned number of ranks on ``hosts`` and how many of them each host runs (mpirun fills the
        hosts in order)."""
        np_ = self._np(hosts)
        left, placed = np_, []
        for h in hosts or []:
            if left <= 0:
                break
            placed.append((h.name, min(h.slots, left)))
            left -= h.slots
        return np_, placed

    def _watch(self, hosts: list[Host] | None, notice: str, stop: threading.Event) -> None:
        """While a job runs: poll discovery; write ``notice`` once the job's planned ranks or their placement
        differ from those on ``hosts`` (before 2026-12-05 any change of the hosts did, even one that starts
        the same ranks in the same places, such as a slot added beyond --max-np)."""
        before = self._placement(hosts)
        while not stop.wait(self.options.poll_s):
            try:
                now = self._usable(self._hosts(hosts))
            except Exception as error:  # noqa: BLE001 (the watcher must outlive any one poll: before 2026-12-07
                # an exception ended it, and no later host change reached the job)
                logger.warning("host discovery failed (%s: %s); keeping the last hosts", type(error).__name__,
                               error)
                continue
            if self._placement(now) != before:
                logger.warning("the hosts changed (%s -> %s): asking the job to stop at its next commit",
                               _listing(hosts), _listing(now))
                Path(notice).write_text(f"{time.time()}\n")
                return

    def _run_once(self, attempt: int, hosts: list[Host] | None, resets: int = 0) -> JobEnd:
        np_ = self._np(hosts)
        notice = os.path.join(self.state_dir, f"hosts-changed-{attempt}")
        env = {**self.environ, "UNISON_ELASTIC": "1", "UNISON_ELASTIC_STATE_DIR": self.state_dir,
               "UNISON_ELASTIC_ATTEMPT": str(attempt), "UNISON_ELASTIC_NOTICE": notice,
               "UNISON_ELASTIC_MIN_NP": str(self.options.min_np)}
        if self.options.reset_limit is not None:  # the job's share ([Note: --reset-limit in place] in runner.py)
            env["UNISON_ELASTIC_RESET_LIMIT"] = str(max(0, self.options.reset_limit - resets))
        logger.warning("starting job %d: %d rank(s) on %s", attempt, np_, _listing(hosts))
        here = socket.gethostname()
        if (self.options.discovery_script is not None and hosts is not None
                and not any(h.name in (here, "localhost") or h.name.startswith(here + ".") for h in hosts)):
            logger.warning("this host (%s) runs none of the job's ranks: host changes reach the job through a "
                           "file here (%s), so only ranks on a host that shares this folder see them",
                           here, notice)
        self._started = True
        stop = threading.Event()
        watcher = None
        if self.options.discovery_script is not None:
            watcher = threading.Thread(target=self._watch, args=(hosts, notice, stop), daemon=True,
                                       name="unisonrun-discovery")
            watcher.start()
        try:
            end = self.start(np_, hosts, env)
        finally:
            stop.set()
            if watcher is not None:
                watcher.join(timeout=5)
        return end

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Run jobs until the training finishes; returns 0, or the last job's status when giving up."""
        restarts = resets = attempt = 0
        hosts = None
        try:
            while True:
                try:
                    hosts = self._wait_for_hosts(hosts)
                    self._check_stop()
                except _Stopped as stopped:  # between jobs: no job to stop, none started
                    return 128 + stopped.signum
                except RuntimeError as error:
                    signum = self._stop_signal()
                    if signum is not None:  # (a signal that came while the discovery script ran)
                        return 128 + signum
                    logger.error("%s", error)
                    return 1
                end = self._run_once(attempt, hosts, resets)
                ranks = self._ranks_ended(attempt)
                status, failed, lost = end.status, end.failed, end.lost
                attempt += 1
                resets += end.resets
                if end.stopped:
                    logger.warning("unisonrun was stopped (status %d): not starting the job again", status)
                    return status
                # (by the ranks' word too: mpirun's own status may be a killed rank's, or its own when the
                # launcher ended it after every rank said it exits)
                if RESET_LIMIT_STATUS in (status, end.exiting) and not end.finished:
                    logger.error("giving up: the job reset in place %d time(s), %d reset(s) in all exceed "
                                 "--reset-limit %s", end.resets, resets, self.options.reset_limit)
                    return RESET_LIMIT_STATUS
                final = _final_status(end, ranks)
                if final is not None:
                    return final
                if status == 0:  # ULFM's mpirun exits 0 after ranks called MPI_Abort, left a split job, all died
                    logger.warning("mpirun exited with status 0, but the training function did not return and %s: "
                                   "counting the job as failed", f"{end.left} rank(s) left the job on the losing "
                                   "side of a split (or the rest died)" if end.left else
                                   "mpirun reported failed rank(s)" if failed or lost or end.rank_failed else
                                   f"rank(s) {_ranks(ranks.died)} of this host died")
                    status = 1
                resets += 1
                if status == RESTART_STATUS:
                    logger.warning("the job stopped at a commit because the hosts changed; starting it again")
                else:
                    restarts += 1
                    self._count_failures(failed, lost)
                    if restarts > self.options.max_restarts:
                        logger.error("giving up: the job failed %d time(s) (--max-restarts %d)", restarts,
                                     self.options.max_restarts)
                        return status
                    logger.warning("the job failed (status %d; hosts of failed ranks: %s; hosts lost: %s): "
                                   "restart %d of at most %d", status, ", ".join(failed) or "not named",
                                   ", ".join(lost) or "none", restarts, self.options.max_restarts)
                if self.options.reset_limit is not None and resets > self.options.reset_limit:
                    logger.error("giving up: %d reset(s) exceed --reset-limit %d", resets,
                                 self.options.reset_limit)
                    return status
        finally:
            if self._own_dir:
                shutil.rmtree(self.state_dir, ignore_errors=True)

    def _ranks_ended(self, attempt: int) -> RanksEnded:
        """How the ranks of job ``attempt`` on this host ended, by their records (then removed)."""
        path = records_folder(self.state_dir, attempt)
        records = read_records(path)
        shutil.rmtree(path, ignore_errors=True)
        return RanksEnded.of(records)

    def _count_failures(self, failed: Sequence[str], lost: Sequence[str] = ()) -> None:
        """A host that failed ``--blacklist-after`` jobs is left out; a host the job lost (its daemon or
        its link gone, see report.py) at once: it would fail the next job's launch."""
        for name in set(lost):
            self.failures[name] = max(self.failures.get(name, 0) + 1, self.options.blacklist_after)
        for name in set(failed) - set(lost):
            self.failures[name] = self.failures.get(name, 0) + 1
        for name in set(failed) | set(lost):
            if self.failures[name] >= self.options.blacklist_after and name not in self.blacklist:
                self.blacklist[name] = self.clock() + self.options.blacklist_cooldown_s
                why = "was lost" if name in lost else f"failed {self.failures[name]} time(s)"
                logger.warning("host %s %s: blacklisted%s", name, why,
                               f" for {self.options.blacklist_cooldown_s:g} s" if self.options.blacklist_cooldown_s
                               else "")


class RanksEnded(NamedTuple):
    """How the ranks of a job that ran on the driver's host ended, by their records (see [Note: how a rank's
    job ended] in unison/common/liveness.py)."""

    #: ranks that died before their training was done (a record left at "started" or "training")
    died: tuple[int, ...] = ()
    #: ranks that ended without a normal exit after their training function returned
    after: tuple[int, ...] = ()
    #: the hosts of the records (this host, as the ranks name it), empty when no rank ran here
    hosts: frozenset[str] = frozenset()

    @classmethod
    def of(cls, records: Mapping[tuple[str, int], tuple[str, int]]) -> RanksEnded:
        died = sorted(rank for phase, rank in records.values() if phase in ("started", "training"))
        after = sorted(rank for phase, rank in records.values() if phase == "returned")
        return cls(tuple(died), tuple(after), frozenset(host for host, _ in records))


def _final_status(end: JobEnd, ranks: RanksEnded) -> int | None:
    """unisonrun's status when ``end`` ends the elastic run; None when the job is to start again.

    [Note: the driver's verdict]
    The training finished (rank 0 said so at its exit, see store.py) and mpirun's status is 0: done.
    With another status, the status is forgiven only for ranks that died on the way (in the in-place
    tier the job carried on without them): a rank of this host whose record shows it died in its
    training, or, where the records cannot tell (mpirun named only other hosts' ranks, or no rank ran
    here), as before. A rank that ended without a normal exit after its training function returned
    (a crash in the program's last steps, an uncaught exception's ``MPI_Abort``), or a status no death
    on the way explains (``sys.exit(3)`` after the training), is a failure: unisonrun exits with the
    status and does not start the job again, which would only repeat those steps. Before 2026-12-05
    every job with the finished line ended with status 0.

    Without the finished line: a job in which a rank of this host died in its training failed, even
    when mpirun's status is 0 (ULFM's mpirun exits 0 when every rank was killed; before 2026-12-05
    unisonrun then exited 0 without a restart); one in which ranks failed only after their training
    function returned ends with that failure; status 0 with nothing reported is done (a script
    without ``elastic.run``, or one that leaves by ``os._exit(0)`` after its training).
    """
    status = end.status
    if status == RESTART_STATUS:
        return None
    if end.finished:
        if status == 0:
            return 0
        if not ranks.after and (ranks.died or not _ours(end, ranks)):
            logger.warning("the training finished (mpirun's status %d counts ranks that died on the way)", status)
            return 0
        logger.error("the training finished, but then %s (mpirun's status %d): not starting the job again",
                     f"rank(s) {_ranks(ranks.after)} ended without a normal exit" if ranks.after else
                     "a rank failed", status)
        return status
    reported = bool(end.failed or end.lost or end.rank_failed or end.left)
    if ranks.after and not ranks.died and (status != 0 or reported):
        logger.error("rank(s) %s ended without a normal exit after their training function returned (mpirun's "
                     "status %d): a failure of the program's last steps; not starting the job again",
                     _ranks(ranks.after), status)
        return status or 1
    if status == 0 and not reported and not ranks.died:
        return 0
    return None


def _ours(end: JobEnd, ranks: RanksEnded) -> bool:
    """Whether the failures of ``end`` are all of ranks whose records the driver read."""
    if not ranks.hosts:
        return False
    short = {h.split(".")[0] for h in ranks.hosts}
    return all(h.split(".")[0] in short for h in end.failed)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _listing(hosts: list[Host] | None) -> str:
    return ", ".join(f"{h.name}:{h.slots}" for h in hosts) if hosts is not None else "this machine"
