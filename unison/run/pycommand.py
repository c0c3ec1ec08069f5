"""Run Python ranks through ``python -m mpi4py`` so that one failing rank ends the whole job.

[Note: a raising rank hangs Open MPI 5]
Open MPI kills a job as soon as one rank *exits* with a non-zero status, but a Python rank that
raises does not exit at once: mpi4py finalizes MPI at interpreter exit, and ``MPI_Finalize`` waits
for every other rank. If rank 1 raises while rank 0 sits in ``Barrier()``, both wait for each other
forever; if rank 0 is busy for a minute, the job takes a minute to fail. ``python -m mpi4py`` runs
the program under a handler that calls ``MPI_Abort`` instead of ``MPI_Finalize`` after an uncaught
exception (or ``sys.exit`` with a non-zero code), so Open MPI kills the other ranks within a second
and ``mpirun`` exits with that rank's status, the traceback already printed.

``unisonrun`` therefore rewrites a command that starts with a Python interpreter::

    python -u train.py --lr 0.1   ->   python -u -m mpi4py train.py --lr 0.1
    python -c CODE                ->   python -m mpi4py -c CODE
    python -m pkg.tool ARGS       ->   python -m mpi4py -m pkg.tool ARGS

Interpreter options stay in front of ``-m mpi4py``; everything from the program on is unchanged.
Commands that are not a Python interpreter, already run ``-m mpi4py``, or give no program
(interactive) are left alone.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import PurePath

__all__: list[str] = []

logger = logging.getLogger(__name__)

_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)*)?")
_VALUE_OPTIONS = "WX"  # -W arg, -X opt: the value is the rest of the token or the next token
_PROGRAM_OPTIONS = "cm"  # -c cmd, -m mod: the program, the last interpreter option
_WRAPPER = ["-m", "mpi4py"]


def is_python(executable: str) -> bool:
    """Tells whether ``executable`` names a Python interpreter (``python``, ``python3.11``...)."""
    return _PYTHON_NAME.fullmatch(PurePath(executable).name) is not None


def _program_start(command: Sequence[str]) -> tuple[int, list[str]] | None:
    """Finds where the program starts in a Python command line.

    Args:
        command: A command line whose first item is a Python interpreter.

    Returns:
        ``(index, program)``: ``command[index:]`` is the part holding the program and its
        arguments, and ``program`` is how it starts once split out of an option cluster
        (``-uc CODE`` gives ``program == ["-c"]`` with ``-u`` kept). ``None`` when the command
        gives no program or uses an option this parser does not know.
    """
    index = 1
    while index < len(command):
        token = command[index]
        if token == "-" or not token.startswith("-"):
            return index, []
        if token.startswith("--"):
            if token == "--check-hash-based-pycs":
                index += 2
                continue
            return None  # "--", "--help", "--version"...: nothing sensible to wrap
        step = 1
        for position, letter in enumerate(token[1:], start=1):
            if letter in _PROGRAM_OPTIONS:
                return index, [token[:position], f"-{letter}", token[position + 1 :]]
            if letter in _VALUE_OPTIONS:
                step = 1 if token[position + 1 :] else 2
                break
        index += step
    return None


def wrap_python_command(command: Sequence[str]) -> list[str]:
    """Inserts ``-m mpi4py`` into a Python command; see [Note: a raising rank hangs Open MPI 5].

    Args:
        command: The user's command line, e.g. ``["python", "train.py", "--lr", "0.1"]``.

    Returns:
        A new command line: wrapped when ``command`` runs a Python program, else a copy.
    """
    command = list(command)
    if not command or not is_python(command[0]):
        return command
    found = _program_start(command)
    if found is None:
        logger.debug("not wrapping %s: no program found to run under mpi4py", command)
        return command
    index, split = found
    if split:
        cluster, option, attached = split
        head = [cluster] if cluster != "-" else []
        program = [option] + ([attached] if attached else []) + command[index + 1 :]
    else:
        head, program = [], command[index:]
    if program[:1] == ["-m"] and len(program) > 1 and program[1].split(".")[0] == "mpi4py":
        return command
    return command[:index] + head + _WRAPPER + program
