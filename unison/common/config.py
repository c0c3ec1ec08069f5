"""Unison's settings: one typed object, built once per ``init()``.

Precedence for every setting: explicit argument > ``UNISON_<NAME>`` environment
variable > ``HOROVOD_<NAME>`` (so existing Horovod job scripts keep working) >
default. A malformed value raises ``ValueError`` naming the variable, the value
and what would be accepted. An unknown ``UNISON_*`` variable is most likely a
typo, so it is logged as a warning with the list of known names.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Config", "ALGORITHMS", "load_config"]

logger = logging.getLogger(__name__)

#: Allreduce algorithms a user can force. ``auto`` picks by size and rank count.
ALGORITHMS = ("auto", "ring", "rhd", "mpi")
ALLGATHER_ALGORITHMS = ("auto", "ring", "mpi")
BROADCAST_ALGORITHMS = ("auto", "tree", "mpi")
REDUCESCATTER_ALGORITHMS = ("auto", "ring", "mpi")
ALLTOALL_ALGORITHMS = ("auto", "pairwise", "mpi")
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

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
ENV_TIMELINE = "TIMELINE"
ENV_AUTOTUNE = "AUTOTUNE"
ENV_AUTOTUNE_LOG = "AUTOTUNE_LOG"
ENV_AUTOTUNE_WARMUP = "AUTOTUNE_WARMUP_SAMPLES"
ENV_AUTOTUNE_STEPS = "AUTOTUNE_STEPS_PER_SAMPLE"
ENV_MALLOC_CACHE = "MALLOC_CACHE"


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"valid choices are {', '.join(choices)}")
        return value

    return parse


def _level(raw: str) -> str:
    value = raw.strip().upper()
    if value not in LOG_LEVELS:
        raise ValueError(f"valid choices are {', '.join(LOG_LEVELS)}")
    return value


def _positive_int(raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError("expected a positive integer") from None
    if value <= 0:
        raise ValueError("expected a positive integer")
    return value


def _non_negative_int(raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError("expected a non-negative integer") from None
    if value < 0:
        raise ValueError("expected a non-negative integer")
    return value


def _non_negative_float(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("expected a non-negative number") from None
    if not value >= 0:
        raise ValueError("expected a non-negative number")
    return value


def _positive_float(raw: str) -> float:
    value = _non_negative_float(raw)
    if value == 0:
        raise ValueError("expected a positive number")
    return value


def _path(raw: str) -> str:
    return raw.strip()


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected one of 1, 0, true, false")


@dataclasses.dataclass(frozen=True)
class Config:
    """All of Unison's settings, with their defaults."""

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


# field name -> (env suffix, parser)
_FIELDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "allreduce_algorithm": (ENV_ALLREDUCE_ALGORITHM, _choice(ALGORITHMS)),
    "allgather_algorithm": (ENV_ALLGATHER_ALGORITHM, _choice(ALLGATHER_ALGORITHMS)),
    "broadcast_algorithm": (ENV_BROADCAST_ALGORITHM, _choice(BROADCAST_ALGORITHMS)),
    "reducescatter_algorithm": (ENV_REDUCESCATTER_ALGORITHM, _choice(REDUCESCATTER_ALGORITHMS)),
    "alltoall_algorithm": (ENV_ALLTOALL_ALGORITHM, _choice(ALLTOALL_ALGORITHMS)),
    "chunk_bytes": (ENV_CHUNK_BYTES, _positive_int),
    "log_level": (ENV_LOG_LEVEL, _level),
    "abort_on_error": (ENV_ABORT_ON_ERROR, _flag),
    "fusion_threshold": (ENV_FUSION_THRESHOLD, _non_negative_int),
    "cycle_time": (ENV_CYCLE_TIME, _positive_float),
    "cache_capacity": (ENV_CACHE_CAPACITY, _non_negative_int),
    "stall_check_time_seconds": (ENV_STALL_CHECK_TIME, _non_negative_float),
    "stall_shutdown_time_seconds": (ENV_STALL_SHUTDOWN_TIME, _non_negative_float),
    "stall_check_disable": (ENV_STALL_CHECK_DISABLE, _flag),
    "timeline": (ENV_TIMELINE, _path),
    "autotune": (ENV_AUTOTUNE, _flag),
    "autotune_log": (ENV_AUTOTUNE_LOG, _path),
    "autotune_warmup_samples": (ENV_AUTOTUNE_WARMUP, _non_negative_int),
    "autotune_steps_per_sample": (ENV_AUTOTUNE_STEPS, _positive_int),
    "malloc_cache": (ENV_MALLOC_CACHE, _flag),
}

#: Suffixes Unison reads itself plus those read by other parts (engine, backends)
#: registered through :func:`register_env`.
_KNOWN_SUFFIXES: set[str] = {suffix for suffix, _ in _FIELDS.values()}


def register_env(*suffixes: str) -> None:
    """Declare extra ``UNISON_*`` suffixes read elsewhere, so they are not flagged as typos."""
    _KNOWN_SUFFIXES.update(suffixes)


def env_value(suffix: str, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """Return ``(variable name, raw value)`` for a setting, UNISON_ first, else HOROVOD_."""
    env = os.environ if environ is None else environ
    for prefix in ("UNISON_", "HOROVOD_"):
        name = prefix + suffix
        if name in env:
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
    parse = _FIELDS[field][1]
    try:
        return parse(value)
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"algorithm={value!r} is not valid: {exc}") from None


def load_config(environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
    """Build the :class:`Config` from ``overrides`` > environment > defaults.

    Raises:
        ValueError: a variable or override is malformed, or an override names no setting.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field, (suffix, parse) in _FIELDS.items():
        if field in overrides and overrides[field] is not None:
            raw = overrides.pop(field)
            try:
                values[field] = parse(str(raw))
            except ValueError as exc:
                raise ValueError(f"{field}={raw!r} is not valid: {exc}") from None
        else:
            overrides.pop(field, None)
            values[field] = parse_env(suffix, parse, getattr(Config, field), env)
    if overrides:
        known = ", ".join(_FIELDS)
        raise ValueError(f"unknown Unison setting(s) {sorted(overrides)}; known settings: {known}")
    for name in env:
        if name.startswith("UNISON_") and name[len("UNISON_"):] not in _KNOWN_SUFFIXES:
            logger.warning("%s is not a Unison setting and is ignored; known: %s", name,
                           ", ".join("UNISON_" + s for s in sorted(_KNOWN_SUFFIXES)))
    return Config(**values)
