"""Unison's settings: one typed object, built once per ``init()``.

Precedence for every setting: explicit argument > ``UNISON_<NAME>`` environment
variable > ``HOROVOD_<NAME>`` (so existing Horovod job scripts keep working) >
default. A variable that is empty (or only blanks) counts as unset, for every
type: ``UNISON_AUTOTUNE=`` means the default, never "off" by accident.

Every value is checked against its type and range -- finite, within bounds --
and a bad one raises ``ValueError`` naming the variable (or argument), the
value and the valid range; nothing malformed reaches the engine thread, where
the error would surface late and on one rank only. An unknown ``UNISON_*``
variable is most likely a typo, so it is logged as a warning with the list of
known names.

Some settings change which MPI calls a rank makes (chunk sizes, fusion,
algorithms, the response cache, autotuning), so they must be equal on every
rank; :func:`mismatch_report` describes any difference and ``init()`` raises it
on every rank. docs/settings.md is the table of all of them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

__all__ = ["Config", "ALGORITHMS", "SETTINGS", "Setting", "load_config", "mismatch_report",
           "must_match_values"]

logger = logging.getLogger(__name__)

#: Allreduce algorithms a user can force. ``auto`` picks by size and rank count.
ALGORITHMS = ("auto", "ring", "rhd", "hierarchical", "mpi")
ALLGATHER_ALGORITHMS = ("auto", "ring", "hierarchical", "mpi")
BROADCAST_ALGORITHMS = ("auto", "tree", "hierarchical", "mpi")
REDUCESCATTER_ALGORITHMS = ("auto", "ring", "mpi")
ALLTOALL_ALGORITHMS = ("auto", "pairwise", "mpi")
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: Prefixes read, in this order (the second is the Horovod alias).
PREFIXES = ("UNISON_", "HOROVOD_")

# Environment variable names (without the UNISON_/HOROVOD_ prefix).
ENV_ALLREDUCE_ALGORITHM = "ALLREDUCE_ALGORITHM"
ENV_ALLGATHER_ALGORITHM = "ALLGATHER_ALGORITHM"
ENV_BROADCAST_ALGORITHM = "BROADCAST_ALGORITHM"
ENV_REDUCESCATTER_ALGORITHM = "REDUCESCATTER_ALGORITHM"
ENV_ALLTOALL_ALGORITHM = "ALLTOALL_ALGORITHM"
ENV_CHUNK_BYTES = "CHUNK_BYTES"
ENV_LOG_LEVEL = "LOG_LEVEL"
ENV_ABORT_ON_ERROR = "ABORT_ON_ERROR"
ENV_FUSION_THRESHOLD = "FUSION_THRESHOLD"
ENV_CYCLE_TIME = "CYCLE_TIME"
ENV_CACHE_CAPACITY = "CACHE_CAPACITY"
ENV_STALL_CHECK_TIME = "STALL_CHECK_TIME_SECONDS"
ENV_STALL_SHUTDOWN_TIME = "STALL_SHUTDOWN_TIME_SECONDS"
ENV_STALL_CHECK_DISABLE = "STALL_CHECK_DISABLE"
ENV_DEADLOCK_TIME = "DEADLOCK_TIME_SECONDS"
ENV_TIMELINE = "TIMELINE"
ENV_AUTOTUNE = "AUTOTUNE"
ENV_AUTOTUNE_LOG = "AUTOTUNE_LOG"
ENV_AUTOTUNE_WARMUP = "AUTOTUNE_WARMUP_SAMPLES"
ENV_AUTOTUNE_STEPS = "AUTOTUNE_STEPS_PER_SAMPLE"
ENV_MALLOC_CACHE = "MALLOC_CACHE"
ENV_COLLECTIVE_TIMEOUT = "COLLECTIVE_TIMEOUT_SECONDS"
ENV_HIERARCHICAL_ALLREDUCE = "HIERARCHICAL_ALLREDUCE"
ENV_HIERARCHICAL_ALLGATHER = "HIERARCHICAL_ALLGATHER"
ENV_DETERMINISTIC = "DETERMINISTIC"
ENV_HOST_TIMEOUT = "HOST_TIMEOUT_SECONDS"
ENV_GC_FREEZE = "GC_FREEZE"
ENV_CROSS_PIECE_BYTES = "CROSS_PIECE_BYTES"

#: Bounds. One MPI message carries at most a C ``int`` count; integers travel as int64;
#: waits longer than this many seconds are a mistake (0 is the way to say "never").
MPI_COUNT_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_SECONDS = 30 * 86400.0
#: A negotiation cycle longer than a minute would make every collective wait that long.
MAX_CYCLE_MS = 60_000.0

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Spec(Protocol):
    """How one setting is parsed from text and checked as a value."""

    def describe(self) -> str: ...

    def parse(self, raw: str) -> Any: ...

    def check(self, value: Any) -> Any: ...


def _invalid(spec: Spec) -> ValueError:
    return ValueError(f"expected {spec.describe()}")


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of a fixed set of names (case-insensitive)."""

    choices: tuple[str, ...]
    #: other names taken for a choice: (alias, choice) pairs
    aliases: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        return "one of " + ", ".join(self.choices)

    def parse(self, raw: str) -> str:
        value = raw.strip()
        value = value.upper() if self.choices[0].isupper() else value.lower()
        return self.check(dict(self.aliases).get(value, value))

    def check(self, value: Any) -> str:
        if not isinstance(value, str) or value not in self.choices:
            raise _invalid(self)
        return value


@dataclasses.dataclass(frozen=True)
class IntRange:
    """An integer in ``[low, high]`` -- the one integer check every setting uses."""

    low: int
    high: int

    def describe(self) -> str:
        return f"an integer in [{self.low}, {self.high}]"

    def parse(self, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise _invalid(self) from None
        return self.check(value)

    def check(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
                or not self.low <= int(value) <= self.high:
            raise _invalid(self)
        return int(value)


@dataclasses.dataclass(frozen=True)
class FloatRange:
    """A finite number in ``[low, high]`` (``(low, high]`` with ``open_low``)."""

    low: float
    high: float
    open_low: bool = False

    def describe(self) -> str:
        return f"a finite number in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}]"

    def parse(self, raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise _invalid(self) from None
        return self.check(value)

    def check(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _invalid(self)
        value = float(value)
        above = value > self.low if self.open_low else value >= self.low
        if not (math.isfinite(value) and above and value <= self.high):
            raise _invalid(self)
        return value


@dataclasses.dataclass(frozen=True)
class Flag:
    """A boolean: 1/0, true/false, yes/no, on/off (case-insensitive)."""

    def describe(self) -> str:
        return "one of " + ", ".join(_TRUE + _FALSE)

    def parse(self, raw: str) -> bool:
        value = raw.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise _invalid(self)

    def check(self, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        return self.parse(str(value))


@dataclasses.dataclass(frozen=True)
class FilePath:
    """A file path; empty means off."""

    def describe(self) -> str:
        return "a file path (empty: off)"

    def parse(self, raw: str) -> str:
        return self.check(raw.strip())

    def check(self, value: Any) -> str:
        if not isinstance(value, str) or "\0" in value:
            raise _invalid(self)
        return value


@dataclasses.dataclass(frozen=True)
class Config:
    """All of Unison's settings, with their defaults (docs/settings.md has the table).

    Building one checks every value (:class:`ValueError` naming the field, the value
    and the valid range), so a ``Config`` never holds garbage.
    """

    allreduce_algorithm: str = "auto"
    allgather_algorithm: str = "auto"
    broadcast_algorithm: str = "auto"
    reducescatter_algorithm: str = "auto"
    alltoall_algorithm: str = "auto"
    #: Largest message our point-to-point algorithms send at once; bigger
    #: transfers are streamed in pieces of this size so they stay in cache.
    chunk_bytes: int = 1 << 20
    log_level: str = "WARNING"
    #: Abort the MPI job when a rank dies of an uncaught exception.
    abort_on_error: bool = True
    #: Engine: fuse ready all-reduces into buffers of at most this many bytes (0: no fusion).
    fusion_threshold: int = 128 << 20
    #: Engine: milliseconds between negotiation cycles while requests are pending.
    cycle_time: float = 1.0
    #: Engine: names whose negotiation is remembered (response cache; 0 disables it).
    cache_capacity: int = 4096
    #: Engine: warn about tensors some ranks submitted and others not after this many seconds.
    stall_check_time_seconds: float = 60.0
    #: Engine: fail such tensors' handles on every rank after this many seconds (0: never).
    stall_shutdown_time_seconds: float = 0.0
    stall_check_disable: bool = False
    #: Engine: fail the pending handles of a process set on every rank once every rank has been
    #: blocked this many seconds waiting on a collective another rank has not submitted, and none
    #: submitted anything meanwhile (a deadlock; 0: never). See docs/engine.md "Deadlocks".
    deadlock_time_seconds: float = 60.0
    #: Engine: rank 0 writes a Chrome-trace timeline to this path ("" = off).
    timeline: str = ""
    #: Engine: tune fusion threshold and cycle time online.
    autotune: bool = False
    #: Engine: CSV log of autotune trials ("" = none).
    autotune_log: str = ""
    #: Engine: autotune samples discarded at the start (the first steps negotiate names in full).
    autotune_warmup_samples: int = 1
    #: Engine: cycles (at least) per autotune sample.
    autotune_steps_per_sample: int = 20
    #: Keep freed large blocks in the process instead of returning them to the OS
    #: (glibc ``mallopt``), so a training step does not page-fault its buffers anew.
    malloc_cache: bool = True
    #: Move the objects alive at ``import unison`` and at ``init()`` (the frameworks' modules:
    #: some 170k objects under PyTorch, never garbage) to the garbage collector's permanent
    #: generation, so its full passes skip them (see runtime.freeze_gc).
    gc_freeze: bool = True
    #: Engine: a collective wait longer than this many seconds ends the job (0: no limit).
    collective_timeout_seconds: float = 0.0
    #: Force the hierarchical all-reduce (within hosts, then across) whenever the job spans
    #: hosts (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``); ``auto`` already picks it by size.
    hierarchical_allreduce: bool = False
    #: Force the hierarchical all-gather (and broadcast) whenever the job spans hosts.
    hierarchical_allgather: bool = False
    #: Reduce every element in rank order, whatever the fusion, autotune or timing, so that
    #: runs and restarts reproduce bit for bit (costs speed: no hierarchy, no MPI reductions).
    deterministic: bool = False
    #: Bytes per message in the steps across hosts (hierarchical all-reduce, all-gather and
    #: broadcast; the flat ring across hosts). 0: chosen from the link's speed, measured once
    #: per communicator.
    cross_piece_bytes: int = 0
    #: A job spanning hosts ends, naming the host, when a host stops answering for this many
    #: seconds (a heartbeat between ranks; 0 turns it off).
    host_timeout_seconds: float = 30.0
    #: Where each value came from: an argument, a variable's name, or "default".
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for setting in SETTINGS:
            value = getattr(self, setting.field)
            try:
                setting.spec.check(value)
            except ValueError as exc:
                raise ValueError(f"Config({setting.field}={value!r}) is not valid: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the settings table."""

    field: str
    suffix: str
    spec: Spec
    #: Whether every rank must use the same value (it changes which MPI calls a rank makes).
    must_match: bool

    @property
    def variable(self) -> str:
        return PREFIXES[0] + self.suffix


SETTINGS: tuple[Setting, ...] = (
    Setting("allreduce_algorithm", ENV_ALLREDUCE_ALGORITHM, Choice(ALGORITHMS), True),
    Setting("allgather_algorithm", ENV_ALLGATHER_ALGORITHM, Choice(ALLGATHER_ALGORITHMS), True),
    Setting("broadcast_algorithm", ENV_BROADCAST_ALGORITHM, Choice(BROADCAST_ALGORITHMS), True),
    Setting("reducescatter_algorithm", ENV_REDUCESCATTER_ALGORITHM, Choice(REDUCESCATTER_ALGORITHMS), True),
    Setting("alltoall_algorithm", ENV_ALLTOALL_ALGORITHM, Choice(ALLTOALL_ALGORITHMS), True),
    Setting("chunk_bytes", ENV_CHUNK_BYTES, IntRange(1, MPI_COUNT_MAX), True),
    Setting("log_level", ENV_LOG_LEVEL, Choice(LOG_LEVELS, (("FATAL", "CRITICAL"), ("WARN", "WARNING"))), False),
    Setting("abort_on_error", ENV_ABORT_ON_ERROR, Flag(), True),
    Setting("fusion_threshold", ENV_FUSION_THRESHOLD, IntRange(0, INT64_MAX), True),
    Setting("cycle_time", ENV_CYCLE_TIME, FloatRange(0.0, MAX_CYCLE_MS, open_low=True), True),
    Setting("cache_capacity", ENV_CACHE_CAPACITY, IntRange(0, INT64_MAX), True),
    Setting("stall_check_time_seconds", ENV_STALL_CHECK_TIME, FloatRange(0.0, MAX_SECONDS), True),
    Setting("stall_shutdown_time_seconds", ENV_STALL_SHUTDOWN_TIME, FloatRange(0.0, MAX_SECONDS), True),
    Setting("stall_check_disable", ENV_STALL_CHECK_DISABLE, Flag(), True),
    Setting("deadlock_time_seconds", ENV_DEADLOCK_TIME, FloatRange(0.0, MAX_SECONDS), True),
    Setting("timeline", ENV_TIMELINE, FilePath(), False),
    Setting("autotune", ENV_AUTOTUNE, Flag(), True),
    Setting("autotune_log", ENV_AUTOTUNE_LOG, FilePath(), False),
    Setting("autotune_warmup_samples", ENV_AUTOTUNE_WARMUP, IntRange(0, INT64_MAX), True),
    Setting("autotune_steps_per_sample", ENV_AUTOTUNE_STEPS, IntRange(1, INT64_MAX), True),
    Setting("malloc_cache", ENV_MALLOC_CACHE, Flag(), False),
    Setting("gc_freeze", ENV_GC_FREEZE, Flag(), False),
    Setting("collective_timeout_seconds", ENV_COLLECTIVE_TIMEOUT, FloatRange(0.0, MAX_SECONDS), True),
    Setting("hierarchical_allreduce", ENV_HIERARCHICAL_ALLREDUCE, Flag(), True),
    Setting("hierarchical_allgather", ENV_HIERARCHICAL_ALLGATHER, Flag(), True),
    Setting("deterministic", ENV_DETERMINISTIC, Flag(), True),
    Setting("host_timeout_seconds", ENV_HOST_TIMEOUT, FloatRange(0.0, MAX_SECONDS), True),
    Setting("cross_piece_bytes", ENV_CROSS_PIECE_BYTES, IntRange(0, MPI_COUNT_MAX), True),
)
_BY_FIELD = {s.field: s for s in SETTINGS}

#: ``UNISON_ELASTIC`` (``HOROVOD_ELASTIC``): 1 turns elastic mode on (``unisonrun --elastic``)
ENV_ELASTIC = "ELASTIC"
#: ``UNISON_ELASTIC_MIN_NP``: fewer surviving ranks than this end the job (``unisonrun --min-np``)
ENV_ELASTIC_MIN_NP = "ELASTIC_MIN_NP"
#: ``UNISON_ELASTIC_QUORUM``: when the survivors of a failure must be a majority of the world to go on
#: (auto: when the job spans hosts; see [Note: a partitioned job] in unison/common/elastic/recovery.py)
ENV_ELASTIC_QUORUM = "ELASTIC_QUORUM"
#: Variables read from the environment where they are used (elastic recovery,
#: unison/common/elastic/recovery.py), not ``init()`` arguments. :func:`load_config` checks
#: their values like the settings' and :func:`must_match_values` has the ranks compare them
#: at ``init()``: some ranks recovering from a failure while others end would hang the rest.
#: suffix -> (the value's type and range, its value when unset)
ENV_ONLY: dict[str, tuple[Flag | IntRange | Choice, Any]] = {ENV_ELASTIC: (Flag(), False),
                                                     ENV_ELASTIC_MIN_NP: (IntRange(1, 1 << 30), 1),
                                                     ENV_ELASTIC_QUORUM: (Choice(("auto", "on", "off")), "auto")}

#: Suffixes Unison reads itself plus those read by other parts (engine, backends)
#: registered through :func:`register_env`.
_KNOWN_SUFFIXES: set[str] = {s.suffix for s in SETTINGS} | set(ENV_ONLY) | {
    "ELASTIC_NOTICE"}  # (set by unisonrun's elastic driver; read by unison.common.elastic, imported later)


def register_env(*suffixes: str) -> None:
    """Declare extra ``UNISON_*`` suffixes read elsewhere, so they are not flagged as typos."""
    _KNOWN_SUFFIXES.update(suffixes)


def env_value(suffix: str, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """Return ``(variable name, raw value)`` for a setting, UNISON_ first, else HOROVOD_.

    A variable holding an empty (or blank) value counts as unset.
    """
    env = os.environ if environ is None else environ
    for prefix in PREFIXES:
        name = prefix + suffix
        if env.get(name, "").strip():
            return name, env[name]
    return None


def parse_env(suffix: str, parse: Callable[[str], Any], default: Any,
              environ: Mapping[str, str] | None = None) -> Any:
    """Read one setting from the environment through ``parse``.

    Raises:
        ValueError: the variable is set to a value ``parse`` refuses; the message
            names the variable, the value and what ``parse`` accepts.
    """
    found = env_value(suffix, environ)
    if found is None:
        return default
    name, raw = found
    try:
        return parse(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not valid: {exc}") from None


def validate_algorithm(field: str, value: str) -> str:
    """Check a per-call ``algorithm=`` keyword against the choices of ``field``."""
    spec = _BY_FIELD[field].spec
    try:
        return spec.parse(value)
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"algorithm={value!r} is not valid: {exc}") from None


def _from_argument(setting: Setting, raw: Any) -> Any:
    try:
        return setting.spec.parse(raw) if isinstance(raw, str) else setting.spec.check(raw)
    except ValueError as exc:
        raise ValueError(f"{setting.field}={raw!r} is not valid: {exc}") from None


def _is_unset(raw: Any) -> bool:
    return raw is None or (isinstance(raw, str) and not raw.strip())


def load_config(environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
    """Build the :class:`Config` from ``overrides`` > environment > defaults.

    An override of ``None`` or an empty string, like an empty variable, means "unset".

    Raises:
        ValueError: a variable or override is malformed or out of range, or an
            override names no setting.
    """
    env = os.environ if environ is None else environ
    unknown = sorted(set(overrides) - set(_BY_FIELD))
    if unknown:
        raise ValueError(f"unknown Unison setting(s) {unknown}; known settings: {', '.join(_BY_FIELD)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        raw = overrides.get(setting.field)
        found = env_value(setting.suffix, env)
        if not _is_unset(raw):
            values[setting.field] = _from_argument(setting, raw)
            sources[setting.field] = f"init({setting.field}=...)"
        elif found is not None:
            values[setting.field] = parse_env(setting.suffix, setting.spec.parse, None, env)
            sources[setting.field] = found[0]
        else:
            sources[setting.field] = "default"
    for suffix in ENV_ONLY:
        env_only_value(suffix, env)  # a malformed value raises here, at init(), not at the first failure
    _warn_unknown(env)
    return Config(**values, sources=sources)


def env_only_value(suffix: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of one of :data:`ENV_ONLY`'s variables (its default when unset).

    Raises:
        ValueError: the variable is malformed (its name, value and what is accepted).
    """
    spec, default = ENV_ONLY[suffix]
    return parse_env(suffix, spec.parse, default, environ)


def _warn_unknown(env: Mapping[str, str]) -> None:
    for name in env:
        if name.startswith(PREFIXES[0]) and name[len(PREFIXES[0]):] not in _KNOWN_SUFFIXES:
            logger.warning("%s is not a Unison setting and is ignored; known: %s", name,
                           ", ".join(PREFIXES[0] + s for s in sorted(_KNOWN_SUFFIXES)))
    # a Horovod job script's settings that have no Unison counterpart: said once, so that nobody expects
    # them to act (before 2026-12-07 ignored silently: HOROVOD_DISABLE_GROUP_FUSION=0, which Unison cannot
    # honour, or HOROVOD_TIMELINE_MARK_CYCLES)
    ignored = sorted(name for name in env if name.startswith(PREFIXES[1]) and env[name].strip()
                     and name[len(PREFIXES[1]):] not in _KNOWN_SUFFIXES)
    if ignored and tuple(ignored) != _told_ignored[0]:
        _told_ignored[0] = tuple(ignored)
        logger.warning("%s: Horovod setting(s) with no Unison counterpart, ignored (the ones Unison reads are "
                       "listed in docs/settings.md)", ", ".join(ignored))


_told_ignored: list[tuple[str, ...]] = [()]


# ------------------------------------------------------------------ cross-rank agreement

#: :func:`must_match_values`' key for the tuned settings set explicitly (with autotune on)
AUTOTUNE_FIXED = "autotune keeps"
#: what autotune tunes (``Config`` fields)
AUTOTUNED = ("fusion_threshold", "cycle_time")


def autotune_fixed(config: Config) -> list[str]:
    """The tuned settings ``config`` has explicitly (an ``init()`` argument or a variable), which
    autotune keeps as they are.

    [Note: autotune keeps what was set] As Horovod's parameter manager does with
    ``HOROVOD_FUSION_THRESHOLD`` and ``HOROVOD_CYCLE_TIME``: a value the user set is a decision, not
    a starting point. Before 2026-12-07 autotune tried every candidate over it (a job with fusion
    turned off, ``UNISON_FUSION_THRESHOLD=0``, ended fused at whatever scored best). The trial
    boundaries follow the candidate lists, so every rank must fix the same settings: ``init()``
    compares the lists with the other settings that must match.
    """
    return [f for f in AUTOTUNED if config.sources.get(f, "default") != "default"]


def must_match_values(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings that must be equal on every rank, as plain JSON-able values: the
    must-match fields of ``config`` and :data:`ENV_ONLY`'s variables (keyed by their names)."""
    values = {s.field: getattr(config, s.field) for s in SETTINGS if s.must_match}
    for suffix in ENV_ONLY:
        values[PREFIXES[0] + suffix] = env_only_value(suffix, environ)
    if config.autotune:  # which tuned settings were set: autotune's trials depend on it
        values[AUTOTUNE_FIXED] = autotune_fixed(config)
    return values


def mismatch_report(per_rank: Sequence[Mapping[str, Any]],
                    sources: Sequence[Mapping[str, str]] | None = None) -> str | None:
    """Describe the must-match settings that differ between ranks, or None when all agree.

    Args:
        per_rank: each rank's :func:`must_match_values`, in rank order.
        sources: each rank's ``Config.sources`` (where its values came from), if known.
    """
    lines = []
    for setting in SETTINGS:
        if not setting.must_match or setting.field not in per_rank[0]:
            continue
        values = [v.get(setting.field) for v in per_rank]
        if all(v == values[0] for v in values):
            continue
        ranks = ", ".join(
            f"rank {r}: {v!r}" + (f" (from {sources[r].get(setting.field, 'default')})" if sources else "")
            for r, v in enumerate(values))
        lines.append(f"{setting.variable} ({setting.field}): {ranks}")
    for key in (PREFIXES[0] + suffix for suffix in ENV_ONLY):
        values = [v.get(key) for v in per_rank]
        if key in per_rank[0] and any(v != values[0] for v in values):
            lines.append(f"{key}: " + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values)))
    fixed = [v.get(AUTOTUNE_FIXED) for v in per_rank]
    if any(f != fixed[0] for f in fixed):
        lines.append("settings autotune keeps because they were set (it tunes the rest, so every rank must "
                     "set the same ones): " + ", ".join(f"rank {r}: {f!r}" for r, f in enumerate(fixed)))
    if not lines:
        return None
    return ("settings that must be equal on every rank differ between ranks -- "
            + "; ".join(lines)
            + ". Set each variable listed to one value for every rank (for example export it in the "
              "job script or pass it with unisonrun/mpirun -x), or pass the same init(...) "
              "arguments on every rank; see docs/settings.md.")


def gc_freeze_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """``UNISON_GC_FREEZE`` as read before ``init()``: on unless set to a false value (a malformed value
    counts as on here; ``init()`` then raises naming it)."""
    found = env_value(ENV_GC_FREEZE, environ)
    return found is None or found[1].strip().lower() not in _FALSE
