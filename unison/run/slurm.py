"""Read the hosts and the task count of a Slurm allocation from its environment.

Inside ``salloc``/``sbatch``, Slurm describes the allocation in variables, in its compressed
forms::

    SLURM_JOB_NODELIST=node[01-03,07],gpu-a1    ->  node01 node02 node03 node07 gpu-a1
    SLURM_TASKS_PER_NODE=2(x3),1                ->  2 2 2 1
    SLURM_NTASKS=7

``unisonrun`` given no ``-H``/``--hostfile`` turns them into ``-H node01:2,...,gpu-a1:1``, and
given no ``-np`` takes ``SLURM_NTASKS`` (else the sum of the tasks per node). Parsing them here
(and not leaving it to ``mpirun``) lets ``--dry-run`` show the hosts, lets the launcher count
slots, and turns a malformed value into an error that quotes it.

[Note: Slurm's host list syntax]
A node list is a comma-separated list of names; a name may hold bracket groups, each a
comma-separated list of numbers and ``lo-hi`` ranges (``node[01-03,07]``). The numbers keep the
zero padding of the range's low end (``01-10`` gives ``01 ... 10``), as Slurm's hostlist code
does. Several groups in one name give every combination (``r[1-2]n[1-2]`` is ``r1n1 r1n2 r2n1
r2n2``). Commas inside brackets do not split names.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from itertools import product
from typing import NamedTuple

from unison.run.hosts import Host, check_host_name

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: at most this many hosts from one node list: a larger expansion is a typo (``node[1-99999999]``)
MAX_HOSTS = 100_000
NODELIST_VARIABLES = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
_NODELIST_FORM = "names separated by commas, each with optional [a-b,c] groups, e.g. 'node[01-03,07],gpu-a1'"
_TASKS_FORM = "counts separated by commas, each N or N(xR), e.g. '2(x3),1'"
_TASKS_ENTRY = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")  # (ASCII: \d takes any script's digits)
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")


class SlurmError(ValueError):
    """A Slurm variable is missing or malformed; the message quotes it and what was expected."""


class SlurmAllocation(NamedTuple):
    """The hosts of an allocation with the tasks Slurm gives each, and the total task count."""

    hosts: list[Host]
    ntasks: int


def in_allocation(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` is that of a process inside a Slurm allocation (a node list is set)."""
    return any(environ.get(name) for name in NODELIST_VARIABLES)


def _split_top_level(text: str, variable: str) -> list[str]:
    """Splits ``text`` at the commas outside brackets; refuses unbalanced brackets."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise SlurmError(f"{variable}={text!r} nests brackets; expected {_NODELIST_FORM}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"{variable}={text!r} has a ']' without its '['; expected {_NODELIST_FORM}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise SlurmError(f"{variable}={text!r} has a '[' without its ']'; expected {_NODELIST_FORM}")
    parts.append("".join(current))
    return parts


def _expand_group(group: str, variable: str, value: str) -> list[str]:
    """Expands the inside of one bracket group, e.g. ``01-03,07`` -> ``01 02 03 07``."""
    numbers = []
    for item in group.split(","):
        found = _RANGE.fullmatch(item.strip())
        if not found:
            raise SlurmError(f"{variable}={value!r}: {item!r} in [{group}] is not a number or a range "
                             f"'lo-hi'; expected {_NODELIST_FORM}")
        low, high = found[1], found[2] if found[2] is not None else found[1]
        if int(high) < int(low):
            raise SlurmError(f"{variable}={value!r}: range {item!r} ends below its start; "
                             "write it low-high, e.g. 01-03")
        if int(high) - int(low) >= MAX_HOSTS:
            raise SlurmError(f"{variable}={value!r}: range {item!r} names more than {MAX_HOSTS} hosts")
        width = len(low)
        numbers += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return numbers


def _expand_name(name: str, variable: str, value: str) -> list[str]:
    """Expands one name with bracket groups into every host name it stands for."""
    pieces = re.split(r"\[([^\]]*)\]", name)  # text, group, text, group, ..., text
    choices = [[piece] if i % 2 == 0 else _expand_group(piece, variable, value)
               for i, piece in enumerate(pieces)]
    count = 1
    for options in choices:
        count *= len(options)
    if count > MAX_HOSTS:
        raise SlurmError(f"{variable}={value!r}: {name!r} names {count} hosts, more than {MAX_HOSTS}")
    return ["".join(combination) for combination in product(*choices)]


def expand_nodelist(value: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expands a Slurm node list; see [Note: Slurm's host list syntax].

    Args:
        value: The compressed list, e.g. ``"node[01-03,07],gpu-a1"``.
        variable: The variable it came from, for error messages.

    Returns:
        The host names in order, e.g. ``["node01", "node02", "node03", "node07", "gpu-a1"]``.

    Raises:
        SlurmError: ``value`` is empty or malformed (unbalanced or nested brackets, an empty
            name, a group that is not numbers and ranges, a descending range, too many hosts),
            or a name is unsafe for a remote shell.
    """
    if not value.strip():
        raise SlurmError(f"{variable} is empty; expected {_NODELIST_FORM}")
    hosts: list[str] = []
    for name in _split_top_level(value.strip(), variable):
        if not name.strip():
            raise SlurmError(f"{variable}={value!r} has an empty name; expected {_NODELIST_FORM}")
        for host in _expand_name(name.strip(), variable, value):
            hosts.append(check_host_name(host, f"{variable}={value!r}"))
        if len(hosts) > MAX_HOSTS:
            raise SlurmError(f"{variable}={value!r} names more than {MAX_HOSTS} hosts")
    return hosts


def expand_tasks_per_node(value: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expands Slurm's tasks-per-node list, e.g. ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        SlurmError: ``value`` is empty or an entry is not ``N`` or ``N(xR)`` with N and R
            positive integers.
    """
    if not value.strip():
        raise SlurmError(f"{variable} is empty; expected {_TASKS_FORM}")
    counts: list[int] = []
    for entry in value.split(","):
        found = _TASKS_ENTRY.fullmatch(entry.strip())
        if not found or int(found[1]) < 1 or (found[2] is not None and int(found[2]) < 1):
            raise SlurmError(f"{variable}={value!r}: entry {entry!r} is not a positive count N or "
                             f"N(xR); expected {_TASKS_FORM}")
        repeat = int(found[2] or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise SlurmError(f"{variable}={value!r} covers more than {MAX_HOSTS} hosts")
        counts += [int(found[1])] * repeat
    return counts


def _positive(environ: Mapping[str, str], variable: str) -> int | None:
    """The positive integer in ``environ[variable]``, ``None`` when unset."""
    text = environ.get(variable)
    if text is None or text == "":
        return None
    if not re.fullmatch(r"[0-9]+", text.strip()) or int(text) < 1:  # (isdigit() takes '²', which int() refuses)
        raise SlurmError(f"{variable}={text!r} is not a positive integer; Slurm sets it to the "
                         "number of tasks (e.g. 8): check the salloc/sbatch --ntasks value")
    return int(text)


def read_allocation(environ: Mapping[str, str]) -> SlurmAllocation:
    """Reads the hosts and task count of the Slurm allocation described by ``environ``.

    Args:
        environ: The environment, with ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``),
            ``SLURM_TASKS_PER_NODE`` and optionally ``SLURM_NTASKS``.

    Returns:
        One host per node with the tasks Slurm gives it as slots, and ``SLURM_NTASKS`` (the sum
        of the slots when it is unset).

    Raises:
        SlurmError: a variable is missing or malformed, the two lists disagree in length, or
            ``SLURM_NTASKS`` exceeds the slots.
    """
    variable = next((name for name in NODELIST_VARIABLES if environ.get(name)), NODELIST_VARIABLES[0])
    names = expand_nodelist(environ.get(variable, ""), variable)
    if not environ.get("SLURM_TASKS_PER_NODE"):
        raise SlurmError(f"{variable} is set but SLURM_TASKS_PER_NODE is not; run inside an allocation "
                         "made with tasks (salloc/sbatch --ntasks or --ntasks-per-node), or pass -H/--hostfile")
    tasks = expand_tasks_per_node(environ["SLURM_TASKS_PER_NODE"])
    if len(tasks) != len(names):
        raise SlurmError(f"SLURM_TASKS_PER_NODE={environ['SLURM_TASKS_PER_NODE']!r} gives {len(tasks)} "
                         f"count(s) but {variable}={environ[variable]!r} names {len(names)} host(s); they "
                         "must have one entry per host: check that both come from the same allocation")
    hosts = [Host(name, count) for name, count in zip(names, tasks, strict=True)]
    slots = sum(tasks)
    ntasks = _positive(environ, "SLURM_NTASKS") or slots
    if ntasks > slots:
        raise SlurmError(f"SLURM_NTASKS={ntasks} exceeds the {slots} task(s) of SLURM_TASKS_PER_NODE="
                         f"{environ['SLURM_TASKS_PER_NODE']!r}; check that both come from the same allocation")
    logger.info("Slurm allocation: %d host(s), %d task(s)", len(hosts), ntasks)
    return SlurmAllocation(hosts, ntasks)
