"""Where a ``unisonrun`` job runs: hosts, process count, launch agent, TCP pinning, environment.

:func:`resolve_placement` turns what the user asked for (:class:`LaunchConfig`), the hostfile's
``# unison:`` options and a Slurm allocation into a :class:`Placement`; the launcher turns that
into ``mpirun`` arguments. Hosts come from ``-H`` and ``--hostfile``; without both, inside a Slurm
allocation, from Slurm (``slurm.py``). A launch agent and TCP include list given as options win
over the hostfile's.

[Note: the environment across hosts]
Ranks on this machine inherit ``mpirun``'s whole environment; ranks that a daemon starts on
another host get only what ``-x`` forwards (over ``ssh`` the daemon starts in a login
environment; measured on test hosts with an agent that clears the environment as ``ssh`` does:
a variable not named by ``-x`` did not arrive). So that a rank sees the same environment wherever
it runs, a job with hosts forwards every variable, as Horovod's launcher does, except those that
describe this machine or session (``HOSTNAME``, ``PWD``, ``SSH_*``, ``XDG_*``...), inside a Slurm
allocation its devices (``CUDA_VISIBLE_DEVICES`` and the like, which Slurm sets on each node to
that node's allocated GPUs: until 2026-12-07 this machine's list was forced onto the others,
which on a shared node would name another job's GPUs; without a batch system the user's export is
meant for every host and goes), those MPI and Slurm set themselves on each host (``OMPI_*``,
``PMIX_*``, ``PRTE_*``, ``SLURM_*``; ``mpirun`` carries the user's ``OMPI_MCA_*`` itself), shell
functions, and names that are not identifiers.
A job on this machine alone forwards Unison's selection only: the rest arrives anyway.

[Note: a launch agent Open MPI would split]
Open MPI (PRRTE 3) reads ``plm_ssh_agent`` as a list of alternatives separated by ``:`` and
splits each at spaces, with no shell quoting: ``ssh -o ProxyJump=jump:2222`` ran as ``ssh -o
ProxyJump=jump`` (the rest silently dropped), and a quoted path with spaces was looked up in
pieces (``mpirun`` exit status 250), while the probe (``probe.py``) ran the agent as the shell
words it is. So an agent with a ``:`` in it, or whose shell words differ from its pieces between
spaces, is given to both as the path of a wrapper script, ``exec WORDS "$@"``
(:func:`write_agent_wrapper`), in a private folder that ``unisonrun`` removes at its exit; the
agent then gets the same arguments from both. The wrapper exists on this machine only, so such a
job also passes ``plm_ssh_no_tree_spawn 1``: with tree spawn (Open MPI's default) a daemon may
start the daemons of other hosts, through the agent, on its own host (beyond 64 hosts).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from unison.run.hosts import (
    MAX_SLOTS,
    Host,
    most_processes,
    parse_hosts,
    parse_tcp_include,
    read_hostfile,
    read_hostfile_options,
    total_slots,
)
from unison.run.slurm import in_allocation, read_allocation

__all__ = ["LaunchConfig", "Placement", "agent_needs_wrapper", "forwarded_environment", "needs_oversubscribe",
           "network_arguments", "resolve_placement", "write_agent_wrapper"]

logger = logging.getLogger(__name__)

FORWARDED_PREFIXES = ("UNISON_", "HOROVOD_")
FORWARDED_NAMES = (
    "MKL_NUM_THREADS",
    "OMP_NUM_THREADS",
    "PYTHONPATH",
    "TF_NUM_INTEROP_THREADS",
    "TF_NUM_INTRAOP_THREADS",
)
#: not forwarded to other hosts: see [Note: the environment across hosts]
HOST_SPECIFIC_NAMES = frozenset({"HOSTNAME", "HOST", "PWD", "OLDPWD", "SHLVL", "_", "DISPLAY", "XAUTHORITY",
                                 "TERMCAP", "PS1", "PS2", "PROMPT_COMMAND"})
#: a node's own devices, which a batch system sets on each node: not forwarded inside an allocation
NODE_DEVICE_NAMES = frozenset({"CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                               "GPU_DEVICE_ORDINAL", "ZE_AFFINITY_MASK"})
HOST_SPECIFIC_PREFIXES = ("SSH_", "XDG_", "OMPI_", "PMIX_", "PRTE_", "OPAL_", "SLURM_", "BASH_FUNC_")
#: Variables the ranks get with these values unless the environment sets them (then its value goes):
#: see [Note: huge pages for PyTorch's tensors]
RANK_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: the file name of the launch agent wrapper: see [Note: a launch agent Open MPI would split]
AGENT_WRAPPER_NAME = "unisonrun-launch-agent"


@dataclass(frozen=True)
class LaunchConfig:
    """What the user asked ``unisonrun`` for.

    Attributes:
        command: The program to run on every rank, with its arguments.
        np: Number of processes (ranks), at least 1; ``None``: ``SLURM_NTASKS`` when the hosts
            come from a Slurm allocation, else 1.
        hosts: The ``-H`` value, e.g. ``"localhost:2,node7:2"``, or ``None``.
        hostfile: Path of an Open MPI hostfile, or ``None``.
        launch_agent: Command that starts the daemons on other hosts instead of ``ssh``, or
            ``None`` (then the hostfile's ``launch-agent`` option, if any).
        tcp_include: Subnets (``"10.0.0.0/24"``, comma-separated) to pin TCP to, or ``None``.
        network_interface: Interface names (``"eth1"``, comma-separated) to pin TCP to, or
            ``None``. With ``tcp_include`` both apply; either replaces the hostfile's.
        bind_to: Value for ``mpirun --bind-to``.
        oversubscribe: ``True`` forces ``--oversubscribe``, ``None`` adds it when ``np`` exceeds
            the slots.
        abort_on_exception: Run Python commands through ``python -m mpi4py``.
        mpi_args: Extra arguments for ``mpirun``, placed before the command.
        detect_lost_hosts: With ULFM across hosts, turn on ULFM's failure detector (see
            [Note: a lost host in the in-place tier] in launcher.py).
    """

    command: tuple[str, ...]
    np: int | None = None
    hosts: str | None = None
    hostfile: str | None = None
    launch_agent: str | None = None
    tcp_include: str | None = None
    network_interface: str | None = None
    bind_to: str = "none"
    oversubscribe: bool | None = None
    abort_on_exception: bool = True
    mpi_args: tuple[str, ...] = ()
    detect_lost_hosts: bool = False


@dataclass(frozen=True)
class Placement:
    """Where the job runs, resolved from the options, the hostfile and Slurm.

    Attributes:
        np: Number of processes.
        hosts: The hosts with their slots; ``None`` for this machine alone.
        slurm_hosts: The ``-H`` value made from a Slurm allocation, or ``None``.
        launch_agent: The daemons' launch agent, or ``None`` for Open MPI's (``ssh``, or the
            batch system's).
        tcp_include: Subnets and interfaces TCP is pinned to (empty: not pinned).
        in_slurm: Whether the launcher runs inside a Slurm allocation (Open MPI then starts its
            daemons through ``srun`` unless a launch agent is given).
    """

    np: int
    hosts: list[Host] | None
    slurm_hosts: str | None = None
    launch_agent: str | None = None
    tcp_include: tuple[str, ...] = ()
    in_slurm: bool = False

    @property
    def uses_ssh(self) -> bool:
        """Whether ``mpirun`` starts daemons on other hosts through ``ssh`` or the launch agent."""
        return self.hosts is not None and (not self.in_slurm or self.launch_agent is not None)


def _explicit_include(config: LaunchConfig) -> list[str] | None:
    """The TCP include items given as options, or ``None`` when neither option was given."""
    if config.tcp_include is None and config.network_interface is None:
        return None
    items = []
    if config.tcp_include is not None:
        items += parse_tcp_include(config.tcp_include, "--tcp-include")
    if config.network_interface is not None:
        items += parse_tcp_include(config.network_interface, "--network-interface")
    return items


def _hostfile_network(config: LaunchConfig) -> tuple[str | None, list[str]]:
    """The launch agent and TCP include list: the options', else the hostfile's."""
    options = read_hostfile_options(config.hostfile) if config.hostfile is not None else {}
    agent = config.launch_agent if config.launch_agent is not None else options.get("launch-agent")
    if agent is not None and not agent.strip():
        raise ValueError("--launch-agent is empty; give a command such as 'ssh -p 2222' or a script path")
    include = _explicit_include(config)
    if include is None:
        include = []
        for key in ("tcp-include", "network-interface"):
            if key in options:
                include += parse_tcp_include(options[key], f"hostfile {config.hostfile!r} option {key}")
    return agent, include


def resolve_placement(config: LaunchConfig, environ: Mapping[str, str]) -> Placement:
    """Resolves hosts, process count, launch agent and TCP pinning for ``config``.

    ``-H`` and ``--hostfile`` give the hosts; without both, inside a Slurm allocation the hosts
    (and, without ``-np``, the process count) come from Slurm (see ``slurm.py``).

    Raises:
        ValueError: ``np`` is below 1, or a host list, hostfile option, TCP include item or
            Slurm variable is malformed.
        FileNotFoundError: The hostfile does not exist.
    """
    hosts: list[Host] | None = None
    slurm_hosts = None
    np = config.np
    if config.hosts is not None and config.hostfile is not None:
        raise ValueError("-H and --hostfile were both given; Open MPI then uses -H only to choose among the "
                         "hostfile's hosts, so their slots do not add up. Give one of them: list every host "
                         "and its slots in the hostfile, or on the command line with -H")
    if config.hosts is not None or config.hostfile is not None:
        hosts = (parse_hosts(config.hosts) if config.hosts is not None else []) + (
            read_hostfile(config.hostfile, counted=np is None) if config.hostfile is not None else [])
    elif in_allocation(environ):
        allocation = read_allocation(environ)
        hosts = allocation.hosts
        slurm_hosts = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        np = allocation.ntasks if np is None else np
    if np is None:  # every slot of the hosts given, as mpirun itself (before: 1 rank on a 2 x 4-slot -H)
        np = total_slots(hosts) if hosts and slurm_hosts is None else 1
    if np < 1:
        raise ValueError(f"-np must be at least 1; received {np}; pass e.g. -np 2")
    if np > MAX_SLOTS:  # (Open MPI reads it as a C int)
        raise ValueError(f"-np {np} is more than Open MPI can count ({MAX_SLOTS}); give the number of processes")
    agent, include = _hostfile_network(config)
    return Placement(np, hosts, slurm_hosts, agent, tuple(dict.fromkeys(include)), in_allocation(environ))


def needs_oversubscribe(config: LaunchConfig, placement: Placement, cpu_count: int) -> bool:
    """Tells whether ``np`` exceeds the slots of the hosts, or of this machine without hosts.

    Raises:
        ValueError: ``np`` exceeds the sum of the hostfile's ``max_slots`` (every host giving one): Open MPI 5
            then loops for ever at full CPU with ``--oversubscribe`` (before 2026-12-07 unisonrun added it).
    """
    cap = None if placement.hosts is None else most_processes(placement.hosts)
    if cap is not None and placement.np > cap:
        raise ValueError(f"-np {placement.np} is more than the hosts may take: their max_slots add up to {cap}; "
                         f"give -np {cap} or less, or raise max_slots in the hostfile")
    if config.oversubscribe is not None:
        return config.oversubscribe
    slots = cpu_count if placement.hosts is None else total_slots(placement.hosts)
    if placement.np > slots:
        logger.info("-np %d exceeds %d slot(s): adding --oversubscribe", placement.np, slots)
        return True
    return False


def network_arguments(launch_agent: str | None, tcp_include: Sequence[str]) -> list[str]:
    """The ``mpirun`` arguments for a launch agent and for pinning TCP to ``tcp_include``.

    Args:
        launch_agent: The command that starts Open MPI's daemons on other hosts, or ``None``
            for ``ssh``.
        tcp_include: Subnets (or interface names) MPI's and its daemons' TCP may use; empty: any.
    """
    arguments = []
    if launch_agent is not None:
        arguments += ["--prtemca", "plm", "ssh", "--prtemca", "plm_ssh_agent", launch_agent]
        if Path(launch_agent).name == AGENT_WRAPPER_NAME:  # [Note: a launch agent Open MPI would split]
            arguments += ["--prtemca", "plm_ssh_no_tree_spawn", "1"]
    if tcp_include:
        include = ",".join(tcp_include)
        arguments += ["--mca", "btl_tcp_if_include", include, "--prtemca", "oob_tcp_if_include", include]
    return arguments


def agent_words(agent: str) -> list[str]:
    """The launch agent's shell words (``shlex.split``), as the probe runs it.

    Raises:
        ValueError: ``agent`` does not parse as shell words (an unclosed quote).
    """
    try:
        return shlex.split(agent)
    except ValueError as error:
        raise ValueError(f"launch agent {agent!r}: {error}; give it as shell words, e.g. "
                         "--launch-agent 'ssh -p 2222'") from None


def agent_needs_wrapper(agent: str) -> bool:
    """Whether Open MPI would run ``agent`` other than as its shell words (a ``:`` in it, or quoting);
    see [Note: a launch agent Open MPI would split].

    Raises:
        ValueError: ``agent`` does not parse as shell words.
    """
    return ":" in agent or agent_words(agent) != [piece for piece in agent.split(" ") if piece]


def write_agent_wrapper(agent: str, folder: str | os.PathLike[str]) -> str:
    """Writes the script that runs ``agent``'s shell words with the arguments it is given.

    Args:
        agent: The launch agent, as given (shell words).
        folder: A private folder (the caller creates it, mode 0700, and removes it).

    Returns:
        The script's path (mode 0700), to give Open MPI and the probe instead of ``agent``.

    Raises:
        ValueError: ``agent`` does not parse as shell words.
    """
    script = Path(folder, AGENT_WRAPPER_NAME)
    script.write_text(f"#!/bin/sh\n# unisonrun's launch agent: {agent!r} (see docs/run.md)\n"
                      f"exec {shlex.join(agent_words(agent))} \"$@\"\n")
    script.chmod(0o700)
    return str(script)


def _forwarded_across_hosts(name: str) -> bool:
    """Whether a job with hosts forwards ``name``; see [Note: the environment across hosts]."""
    return (_VARIABLE_NAME.fullmatch(name) is not None and name not in HOST_SPECIFIC_NAMES
            and not name.startswith(HOST_SPECIFIC_PREFIXES))


def forwarded_environment(environ: Mapping[str, str], executable: str, every: bool = False,
                          batch: bool = False) -> list[str]:
    """Builds the ``-x`` arguments that carry the environment to the ranks.

    Args:
        environ: The environment ``mpirun`` will run in.
        executable: The Python interpreter in use; its directory goes first on the ranks' ``PATH``.
        every: Forward every variable but the host-specific ones (a job with hosts; see
            [Note: the environment across hosts]) instead of Unison's selection.
        batch: The job runs inside a batch system's allocation, which sets each node's devices
            (:data:`NODE_DEVICE_NAMES` are then not forwarded).

    Returns:
        ``["-x", "NAME", ...]`` sorted by name. ``PATH`` is given with its value
        (``-x PATH=...``), and so is each of :data:`RANK_DEFAULTS` the environment leaves unset;
        the others are forwarded by name, with the value ``mpirun`` sees. Unset variables are
        left out (Open MPI warns about them).

    [Note: huge pages for PyTorch's tensors]
    ``THP_MEM_ALLOC_ENABLE=1`` makes PyTorch's CPU allocator ask for transparent huge pages on
    its blocks of 2 MiB and more (``madvise(MADV_HUGEPAGE)``), as numpy does for its own large
    arrays. Gradients, DDP's buckets and activations then take one TLB entry per 2 MiB instead
    of 512, which makes memory-bound passes over them faster: a 29 MiB all-reduce of a torch
    tensor at np 2 here took 4.8-6.6 ms on 4 KiB pages and 3.5-4.4 ms on huge pages (numpy's
    own arrays: 3.2-4.9 ms). In whole training steps (benchmarks/ddp_breakdown.py, three runs
    each way, alternated) the gain stayed inside this machine's run-to-run spread, so none is
    claimed there. PyTorch reads the variable once, at its first allocation, so it must be in
    the environment before the program starts: the launcher's job. A large block's resident
    memory may round up to whole 2 MiB pages; set ``THP_MEM_ALLOC_ENABLE=0`` to keep 4 KiB
    pages. Programs that do not use PyTorch ignore it; a kernel with transparent huge pages
    set to ``never`` ignores the request.
    """
    names = {
        name for name in environ
        if (every and _forwarded_across_hosts(name) and not (batch and name in NODE_DEVICE_NAMES))
        or name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES
    }
    entries = {name: name for name in names}
    for name, value in RANK_DEFAULTS.items():
        entries[name] = name if name in environ else f"{name}={value}"
    bin_dir = str(Path(executable).parent)
    path = [part for part in environ.get("PATH", "").split(os.pathsep) if part]
    if path[:1] != [bin_dir]:
        path.insert(0, bin_dir)
    entries["PATH"] = "PATH=" + os.pathsep.join(path)
    arguments = []
    for name in sorted(entries):
        arguments += ["-x", entries[name]]
    return arguments
