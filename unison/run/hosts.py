"""Parse the host lists given to ``unisonrun`` (``-H`` and ``--hostfile``).

The launcher only needs the host lists for two things: to reject malformed input early, with a
message that names the bad value (``mpirun``'s own errors arrive late and are long), and to count
the slots, so it can decide whether ``-np`` asks for more processes than there are slots
(``--oversubscribe``). The lists themselves are handed to ``mpirun`` unchanged.

Accepted forms, following Open MPI:

* ``-H``: comma-separated ``host:slots`` entries, e.g. ``localhost:2,node7:4``. A bare ``host``
  means one slot, as it does for ``mpirun -H``.
* ``--hostfile``: one host per line, ``host [slots=N] [max_slots=M] [username=U] [port=P]``;
  ``#`` starts a comment. The keys and counts are read as Open MPI reads them (see [Note: a
  hostfile's slot counts] at :func:`read_hostfile`), and what it refuses is refused here, before
  anything starts. A host named on a single line without a count gets one rank per core from
  Open MPI, which ``unisonrun`` cannot see before the launch: without ``-np`` such a file is
  refused (give ``-np`` or ``slots=N``); with ``-np`` the line counts one slot, a lower bound, so
  at worst ``unisonrun`` adds an unneeded ``--oversubscribe``. (Until 2026-12-05 such a line
  counted one slot without ``-np`` too: ``localhost`` alone ran one rank where ``mpirun`` ran one
  per core.)

[Note: hostfile lines unisonrun does not read] Open MPI's hostfile reader also takes C-style
comments (``//``, ``/* */``) and ``^host`` lines, which exclude a host. Read as host lines they
gave wrong counts (``// rack A`` a host named ``//``; ``^b`` one more slot, and a host to probe), so
they are refused, naming the line and the fix, until ``unisonrun`` reads them as Open MPI does.
A host's ``max_slots`` bounds ``-np``: Open MPI 5 given more processes than the hosts' ``max_slots``
with ``--oversubscribe`` loops at full CPU for ever instead of failing, so ``unisonrun`` refuses it.
Its ``username=`` and ``port=`` reach the probe's agent as Open MPI gives them to any agent
(``AGENT USER@HOST -p PORT ...``): without them a host that takes ssh on another port failed the
probe, and nothing was launched.

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
#: the most slots a count may give: Open MPI reads a count as a C int
MAX_SLOTS = 2**31 - 1


class Host(NamedTuple):
    """One host and the number of MPI slots (processes) it offers; from a hostfile also the most it may take
    (``max_slots``) and the ssh user and port it gives (``username=``, ``port=``)."""

    name: str
    slots: int
    most: int | None = None
    user: str | None = None
    port: int | None = None


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
    if slots > MAX_SLOTS:  # (Open MPI reads counts as a C int)
        raise ValueError(f"slots {text!r} in {where} is more than Open MPI can count ({MAX_SLOTS}); give the "
                         f"host's real slot count ({form})")
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
        name, slots_text = name.strip(), slots_text.strip()  # ('a :2' as 'a:2', as ' a:2 ' is)
        if not name or ":" in name:
            hint = (" (an IPv6 address cannot go in -H, whose ':' gives the slots: use --hostfile, or the "
                    "host's name)" if name.count(":") >= 1 or "[" in entry else "")
            raise ValueError(f"malformed -H entry {entry!r} in {value!r}: expected {_HOST_FORM}{hint}")
        where = f"-H entry {entry!r}"
        check_host_name(name, where)
        hosts.append(Host(name, _parse_slots(slots_text, where, _HOST_FORM)))
    return hosts


#: the keys of a hostfile line that Open MPI (PRRTE's hostfile lexer) reads, each with what it gives
_HOSTFILE_KEYS = {
    **dict.fromkeys(("slots", "count", "cpu"), "slots"),
    **dict.fromkeys(("max_slots", "max-slots", "slots_max", "slots-max", "cpu_max", "cpu-max", "max_cpu",
                     "max-cpu", "count_max", "count-max", "max_count", "max-count"), "max_slots"),
    **dict.fromkeys(("username", "user_name", "user-name"), "username"),
    "port": "port",
}


def read_hostfile(path: str | Path, counted: bool = False) -> list[Host]:
    """Reads an Open MPI hostfile as Open MPI (PRRTE) does.

    [Note: a hostfile's slot counts] A line's count is ``slots=`` (or ``count=``/``cpu=``), else
    ``max_slots=`` (and its spellings); a host named on several lines without a count gets one slot
    per line, and one named on a single bare line as many as it has cores, which only Open MPI sees
    (it then starts one rank per core). A count given twice for a host (on a line, on two lines, or
    after a bare line) is refused, as Open MPI refuses it after starting; bare words are ignored, as
    Open MPI ignores them (with a warning here: ``node1 2`` was surely meant as ``slots=2``).

    Args:
        path: The hostfile; lines look like ``node7 slots=4``, ``#`` starts a comment.
        counted: The caller needs every host's slot count (``unisonrun`` without ``-np``): a
            host named on one bare line only is refused (Open MPI would count its cores).

    Returns:
        The hosts listed, a line each, with one slot for a line that gives no count (the least
        Open MPI gives it).

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a file.
        ValueError: A host name is unsafe (see ``check_host_name``), a count is not a positive
            integer, a line uses ``-H``'s ``host:slots`` form, a ``key=value`` field's key is not
            one Open MPI reads, a host's count is given twice, ``max_slots`` after ``slots`` is
            below it, the file lists no host or is not UTF-8 text; with ``counted``, a host has
            no count.
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
    sized: dict[str, int] = {}  # host -> the line that gave its slot count
    bare: dict[str, list[int]] = {}  # host -> its lines without one
    most: dict[str, int] = {}  # host -> its max_slots
    login: dict[str, tuple[str | None, int | None]] = {}  # host -> (username, port)
    for number, line in enumerate(text.splitlines(), start=1):
        fields = re.sub(r"\s*=\s*", "=", line.split("#", 1)[0]).split()  # Open MPI takes "slots = 2" too
        if not fields:
            continue
        where = f"hostfile {str(path)!r} line {number}"
        if fields[0].startswith(("//", "/*", "^")):  # [Note: hostfile lines unisonrun does not read]
            raise ValueError(f"{where}: {line.strip()!r}: unisonrun reads '#' comments and host lines only (Open "
                             "MPI also reads C-style comments and '^host' exclusions, whose slots unisonrun would "
                             "count wrongly); write the comment after '#', and leave an excluded host out")
        if re.fullmatch(r"[^:]+:\d+", fields[0]):  # -H's form; a hostfile gives slots with slots=N
            name, _, count = fields[0].partition(":")
            raise ValueError(f"{where}: {fields[0]!r} is -H's host:slots form; a hostfile line is "
                             f"'{name} slots={count}' ({_HOSTFILE_FORM})")
        name = check_host_name(fields[0], where)
        slots = cap = user = port = None
        for field in fields[1:]:
            key, eq, value = field.partition("=")
            if not eq and key in _HOSTFILE_KEYS:
                raise ValueError(f"{where}: {field!r} has no value (Open MPI refuses it); give {key}=N")
            if not eq:
                logger.warning("%s: %r is ignored (Open MPI ignores a word without '='); give slots=N for a "
                               "slot count", where, field)
                continue
            meaning = _HOSTFILE_KEYS.get(key)
            if meaning is None:
                raise ValueError(f"{where}: {field!r} is not a hostfile field Open MPI reads; give key=value "
                                 f"with a key of {', '.join(_HOSTFILE_KEYS)} ({_HOSTFILE_FORM})")
            if meaning == "slots":
                if slots is not None:
                    raise ValueError(f"{where}: {field!r} gives the slot count a second time on the line (Open "
                                     f"MPI refuses it); keep one of them ({_HOSTFILE_FORM})")
                slots = _parse_slots(value, where, _HOSTFILE_FORM)
            elif meaning == "max_slots":
                cap = _parse_slots(value, where, _HOSTFILE_FORM)
                if slots is not None and cap < slots:  # (before slots=, Open MPI raises max_slots instead)
                    raise ValueError(f"{where}: {field!r} is below slots={slots} (Open MPI refuses it); raise "
                                     "max_slots or lower slots")
            elif meaning == "port":
                if not re.fullmatch(r"[0-9]{1,5}", value) or not 0 < int(value) < 65536:
                    raise ValueError(f"{where}: {field!r} is not a port number (1 to 65535); give e.g. port=22")
                port = int(value)
            elif meaning == "username":
                user = check_host_name(value, f"{where} (username=)")
        if cap is not None:  # a max_slots= before the line's slots= is raised to it, as Open MPI does (it was
            # kept as given, and a line Open MPI runs refused: 'localhost max_slots=1 slots=2'; before 2026-12-07)
            most[name] = max(cap, slots) if slots is not None else cap
        if user is not None or port is not None:
            known = login.get(name, (None, None))
            login[name] = (user or known[0], port or known[1])
        # max_slots alone counts for a host's first line, as Open MPI takes it; on a later line it only sets
        # the most (not a second count)
        seen = name in sized or name in bare
        given = slots if slots is not None else (cap if not seen else None)
        if given is None:
            bare.setdefault(name, []).append(number)
        elif seen:
            first = sized.get(name) or bare[name][0]
            raise ValueError(f"{where}: host {name!r} is counted on line {first} already (Open MPI refuses a "
                             f"second count for a host); list it once with its total, e.g. '{name} slots=N'")
        else:
            sized[name] = number
        hosts.append(Host(name, 1 if given is None else given))
    hosts = [host._replace(most=most.get(host.name), user=login.get(host.name, (None, None))[0],
                           port=login.get(host.name, (None, None))[1]) for host in hosts]
    if not hosts:
        raise ValueError(f"hostfile {str(path)!r} lists no hosts (only blank lines or comments); give one host "
                         f"per line ({_HOSTFILE_FORM})")
    uncounted = [f"{name!r} (line {lines[0]})" for name, lines in bare.items()
                 if name not in sized and len(lines) == 1]  # (named on several bare lines: a slot per line)
    if counted and uncounted:
        raise ValueError(f"hostfile {str(path)!r} gives no slot count for {', '.join(uncounted)}: Open MPI then "
                         "starts one rank per core of the host, which unisonrun cannot count before the launch. "
                         "Give -np N, or slots=N on the host's line")
    logger.debug("hostfile %s lists %d host(s)", path, len(hosts))
    return hosts


def total_slots(hosts: list[Host]) -> int:
    """Returns the number of slots offered by ``hosts`` altogether."""
    return sum(host.slots for host in hosts)


def most_processes(hosts: list[Host]) -> int | None:
    """The most processes ``hosts`` may take with ``--oversubscribe``: the sum of their ``max_slots`` when every
    host gives one, else None (no bound). (A host on several lines counts its ``max_slots`` once.)"""
    caps: dict[str, int | None] = {}
    for host in hosts:
        caps[host.name] = host.most
    if any(cap is None for cap in caps.values()):
        return None
    return sum(cap for cap in caps.values() if cap is not None)


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
                network = ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{flag} {value!r}: {item!r} is not a subnet in CIDR form; give e.g. "
                                 "10.0.0.0/24 (several separated by commas)") from None
            if network.version != 4:  # (accepted before 2026-12-07, then every launch across hosts was refused:
                # the host check looks for this machine's IPv4 addresses only; found by an audit)
                raise ValueError(f"{flag} {value!r}: {item!r} is an IPv6 subnet; unisonrun's host check and TCP "
                                 "pinning take IPv4 subnets: give the hosts' IPv4 subnet, e.g. 10.0.0.0/24, or "
                                 "pin by interface with --network-interface")
            items.append(str(network))
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
