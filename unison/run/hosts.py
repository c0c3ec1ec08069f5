"""Parse the host lists given to ``unisonrun`` (``-H`` and ``--hostfile``).

The launcher only needs the host lists for two things: to reject malformed input early, with a
message that names the bad value (``mpirun``'s own errors arrive late and are long), and to count
the slots, so it can decide whether ``-np`` asks for more processes than there are slots
(``--oversubscribe``). The lists themselves are handed to ``mpirun`` unchanged.

Accepted forms, following Open MPI:

* ``-H``: comma-separated ``host:slots`` entries, e.g. ``localhost:2,node7:4``. A bare ``host``
  means one slot, as it does for ``mpirun -H``.
* ``--hostfile``: one host per line, ``host [slots=N] [max_slots=M]``; ``#`` starts a comment.
  A line without ``slots=`` is counted as one slot here. Open MPI itself gives such a host as many
  slots as it has cores, so the count is a lower bound and at worst ``unisonrun`` adds an
  unneeded ``--oversubscribe``.

A hostfile may end with ``# unison: key=value`` lines (Open MPI skips them as comments) that
stand for ``unisonrun`` flags: ``launch-agent``, ``tcp-include`` and ``network-interface``;
``python -m unison.run.testhosts up`` writes them so that its hostfile needs no other flag. A
flag given on the command line wins over the hostfile's.

Host names are checked before anything runs: ``mpirun`` starts its daemons on other hosts
through ``ssh`` and a remote shell, so a name that begins with ``-`` would be read as an option
(``-oProxyCommand=...`` runs a command) and a name holding a shell metacharacter (``;``, ``$``,
a backquote...) could run one on the far side. Such names are refused with the name, where it
came from and why.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from pathlib import Path
from typing import NamedTuple

__all__: list[str] = []

logger = logging.getLogger(__name__)

_HOST_FORM = "'host:slots' with slots a positive integer, e.g. 'localhost:2'"
_HOSTFILE_FORM = "'host slots=N' with N a positive integer, e.g. 'node7 slots=4'"
#: characters a POSIX shell treats specially, and quotes: never part of a real host name
SHELL_METACHARACTERS = frozenset("|&;<>()$`\\\"' \t\n*?[]#~{}!")
_NAME_FORM = "letters, digits, '.', '-' and '_' (e.g. 'node-7.cluster'), not starting with '-'"


class Host(NamedTuple):
    """One host and the number of MPI slots (processes) it offers."""

    name: str
    slots: int


def _parse_slots(text: str, where: str, form: str) -> int:
    """Parses a slot count, which must be a positive integer.

    Args:
        text: The slot count as written by the user.
        where: Describes where ``text`` came from, for the error message.
        form: The expected form of the whole entry, for the error message.

    Returns:
        The slot count.

    Raises:
        ValueError: ``text`` is not a positive integer in ASCII digits (``int`` would also take
            ``1_0`` or full-width digits, which Open MPI reads differently or not at all).
    """
    slots = int(text) if re.fullmatch(r"[0-9]+", text) else 0
    if slots < 1:
        raise ValueError(
            f"slots must be a positive integer; received {text!r} in {where}; expected {form}"
        )
    return slots


def check_host_name(name: str, where: str) -> str:
    """Refuses a host name that ``mpirun`` or a remote shell would read as more than a name.

    Args:
        name: The host name as written by the user.
        where: Describes where ``name`` came from, for the error message.

    Returns:
        ``name``, unchanged.

    Raises:
        ValueError: ``name`` begins with ``-``, or holds a shell metacharacter, a quote,
            whitespace or a control character.
    """
    if name.startswith("-"):
        reason = "begins with '-', so mpirun and ssh would read it as an option"
    else:
        bad = next((c for c in name if c in SHELL_METACHARACTERS or not c.isprintable()), None)
        if bad is None:
            return name
        reason = f"holds {bad!r}, which a shell treats specially (mpirun starts remote daemons through one)"
    raise ValueError(f"host name {name!r} in {where} {reason}; host names are {_NAME_FORM}")


def parse_hosts(value: str) -> list[Host]:
    """Parses a ``-H`` value such as ``"localhost:2,node7:4"``.

    Args:
        value: Comma-separated ``host:slots`` entries; a bare ``host`` counts as one slot.

    Returns:
        The hosts in the order given.

    Raises:
        ValueError: An entry is empty, has an empty or unsafe host name (see
            ``check_host_name``), or a slot count that is not a positive integer.
    """
    hosts = []
    for entry in value.split(","):
        name, sep, slots_text = entry.strip().rpartition(":")
        if not sep:
            name, slots_text = slots_text, "1"
        if not name or ":" in name:
            raise ValueError(f"malformed -H entry {entry!r} in {value!r}: expected {_HOST_FORM}")
        where = f"-H entry {entry!r}"
        check_host_name(name, where)
        hosts.append(Host(name, _parse_slots(slots_text, where, _HOST_FORM)))
    return hosts


def read_hostfile(path: str | Path) -> list[Host]:
    """Reads an Open MPI hostfile.

    Args:
        path: The hostfile; lines look like ``node7 slots=4``, ``#`` starts a comment.

    Returns:
        The hosts listed, with one slot for a line that gives no ``slots=``.

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a file.
        ValueError: A host name is unsafe (see ``check_host_name``), a ``slots=`` value is
            not a positive integer, a line uses ``-H``'s ``host:slots`` form, the file lists no
            host or is not UTF-8 text.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"hostfile not found: {str(path)!r}; pass the path of an existing file to --hostfile"
        )
    try:
        text = path.read_text()
    except UnicodeDecodeError as error:
        raise ValueError(f"hostfile {str(path)!r} is not UTF-8 text ({error}); write it as plain text, "
                         f"one host per line ({_HOSTFILE_FORM})") from None
    hosts = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = re.sub(r"\s*=\s*", "=", line.split("#", 1)[0]).split()  # Open MPI takes "slots = 2" too
        if not fields:
            continue
        where = f"hostfile {str(path)!r} line {number}"
        if re.fullmatch(r"[^:]+:\d+", fields[0]):  # -H's form; a hostfile gives slots with slots=N
            name, _, count = fields[0].partition(":")
            raise ValueError(f"{where}: {fields[0]!r} is -H's host:slots form; a hostfile line is "
                             f"'{name} slots={count}' ({_HOSTFILE_FORM})")
        check_host_name(fields[0], where)
        slots = 1
        for field in fields[1:]:
            key, _, text = field.partition("=")
            if key == "slots":
                slots = _parse_slots(text, where, _HOSTFILE_FORM)
        hosts.append(Host(fields[0], slots))
    if not hosts:
        raise ValueError(f"hostfile {str(path)!r} lists no hosts (only blank lines or comments); give one host "
                         f"per line ({_HOSTFILE_FORM})")
    logger.debug("hostfile %s lists %d host(s)", path, len(hosts))
    return hosts


def total_slots(hosts: list[Host]) -> int:
    """Returns the number of slots offered by ``hosts`` altogether."""
    return sum(host.slots for host in hosts)


#: the ``# unison:`` hostfile options ``unisonrun`` knows (see [Note: test hosts in a hostfile] in
#: ``testhosts.py``), with the flag each stands for
HOSTFILE_OPTIONS = {"launch-agent": "--launch-agent", "tcp-include": "--tcp-include",
                    "network-interface": "--network-interface"}
_INTERFACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}")


def parse_tcp_include(value: str, flag: str) -> list[str]:
    """Checks a TCP include list: subnets (``--tcp-include``) or interface names (``--network-interface``).

    Args:
        value: Comma-separated items, e.g. ``"10.0.0.0/24"`` or ``"eth1,ib0"``.
        flag: The flag (or hostfile option) it came from, for error messages.

    Returns:
        The items; subnets in network form (``10.0.0.7/24`` gives ``10.0.0.0/24``).

    Raises:
        ValueError: an item is empty, not a subnet in CIDR form (``--tcp-include``) or not an
            interface name (``--network-interface``).
    """
    items = []
    for item in value.split(","):
        item = item.strip()
        if flag.endswith("tcp-include"):
            try:
                if "/" not in item:
                    raise ValueError(item)
                items.append(str(ipaddress.ip_network(item, strict=False)))
            except ValueError:
                raise ValueError(f"{flag} {value!r}: {item!r} is not a subnet in CIDR form; give e.g. "
                                 "10.0.0.0/24 (several separated by commas)") from None
        elif _INTERFACE.fullmatch(item):
            items.append(item)
        else:
            raise ValueError(f"{flag} {value!r}: {item!r} is not a network interface name; give e.g. "
                             "eth1 or ib0 (several separated by commas; see 'ip link')")
    return items


def read_hostfile_options(path: str | Path) -> dict[str, str]:
    """The ``# unison: key=value`` options of a hostfile, checked (empty for a plain hostfile).

    Raises:
        ValueError: an option is not one of :data:`HOSTFILE_OPTIONS` or has no value.
    """
    # imported here, not at the top: ``unison.run`` imports this module, and ``python -m
    # unison.run.testhosts`` warns when its module is already imported before it runs
    from unison.run.testhosts import hostfile_options

    options = hostfile_options(path)
    for key, value in options.items():
        if key not in HOSTFILE_OPTIONS:
            raise ValueError(f"hostfile {str(path)!r} has an unknown option line '# unison: {key}={value}'; "
                             f"known options: {', '.join(sorted(HOSTFILE_OPTIONS))}")
        if not value:
            raise ValueError(f"hostfile {str(path)!r} option '# unison: {key}=' has no value; "
                             f"give it as for {HOSTFILE_OPTIONS[key]}")
    return options
