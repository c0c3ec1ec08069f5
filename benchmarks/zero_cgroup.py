"""Per-rank memory caps for ``benchmarks/zero.py``: one memory cgroup per rank, removed afterwards.

Why cgroups: Linux does not enforce ``RLIMIT_RSS``, and ``RLIMIT_AS`` trips on address-space
reservations (a TensorFlow or PyTorch process reserves far more than it touches), so the only cap
that behaves like "this rank has N bytes of memory" is a memory cgroup: a process whose charged
memory passes the limit (and cannot be reclaimed: there is no swap here) is OOM-killed.

Layout: the cgroups are children of the cgroup this (driver) process is in, named
``unison-zero-<driver pid>-<tag>-r<rank>``; the driver makes them with the limit, each rank
moves itself in at start (``zero_worker.join_cgroup``, before the frameworks allocate; memory
charged before the move stays with the old cgroup, so it must be first), and the driver reads the
OOM-kill count and removes them when the launch has ended, also on an error.

cgroup v1 (this machine: the ``memory`` controller at ``/sys/fs/cgroup/memory``): the limit is
``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap accounting exists), the
kill count the ``oom_kill`` line of ``memory.oom_control``, the peak ``memory.max_usage_in_bytes``.
cgroup v2: ``memory.max`` and ``memory.swap.max = 0``, kills in ``memory.events``, the peak in
``memory.peak``; v2 lets a cgroup with processes of its own have no children with controllers,
so there it works only where the driver's cgroup allows it (the error says so).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import TracebackType

V1_MOUNT = Path("/sys/fs/cgroup/memory")
V2_MOUNT = Path("/sys/fs/cgroup")


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here; the message says why."""


def _own_path(controller_field: str) -> str:
    """This process's cgroup path for a ``/proc/self/cgroup`` controller field (``memory`` or ``""``)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller_field in controllers.split(",") or controllers == controller_field:
            return path
    raise CgroupUnavailable(f"/proc/self/cgroup has no {controller_field or 'v2'} line")


def _v2_has_memory() -> bool:
    controllers = V2_MOUNT / "cgroup.controllers"
    return controllers.exists() and "memory" in controllers.read_text().split()


def memory_cgroup_base() -> tuple[int, Path]:
    """``(version, the folder to make child cgroups in)``.

    Raises:
        CgroupUnavailable: no memory controller, or its folder is not writable (run as root).
    """
    if (V1_MOUNT / "memory.limit_in_bytes").exists():
        base = V1_MOUNT / _own_path("memory").lstrip("/")
        version = 1
    elif _v2_has_memory():
        base = V2_MOUNT / _own_path("").lstrip("/")
        version = 2
    else:
        raise CgroupUnavailable("no memory cgroup controller (neither /sys/fs/cgroup/memory nor a cgroup v2 "
                                "mount with the memory controller)")
    if not os.access(base, os.W_OK):
        raise CgroupUnavailable(f"cannot make cgroups in {base} (not writable: run as root)")
    return version, base


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _oom_kills(path: Path, version: int) -> int:
    name = "memory.oom_control" if version == 1 else "memory.events"
    try:
        lines = (path / name).read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1]) for line in lines if line.startswith("oom_kill "))


class RankCaps:
    """``ranks`` memory cgroups of ``limit_bytes`` each, for one launch; use as a context manager.

    Attributes:
        prefix: what the workers get as ``--cgroup`` (rank r joins ``prefix-r<r>``).
    """

    def __init__(self, ranks: int, limit_bytes: int, tag: str) -> None:
        self.version, base = memory_cgroup_base()
        self.prefix = str(base / f"unison-zero-{os.getpid()}-{tag}")
        self.paths = [Path(f"{self.prefix}-r{r}") for r in range(ranks)]
        self.limit_bytes = int(limit_bytes)

    def __enter__(self) -> RankCaps:
        try:
            for path in self.paths:
                path.mkdir()
                self._limit(path)
        except OSError as exc:
            self.remove()
            raise CgroupUnavailable(f"cannot make or limit cgroup {path}: {exc}") from exc
        return self

    def _limit(self, path: Path) -> None:
        if self.version == 1:
            _write(path / "memory.limit_in_bytes", str(self.limit_bytes))
            if (path / "memory.memsw.limit_in_bytes").exists():
                _write(path / "memory.memsw.limit_in_bytes", str(self.limit_bytes))
            return
        _write(path / "memory.max", str(self.limit_bytes))
        if (path / "memory.swap.max").exists():
            _write(path / "memory.swap.max", "0")

    def oom_kills(self) -> list[int]:
        """OOM kills so far, per rank's cgroup."""
        return [_oom_kills(p, self.version) for p in self.paths]

    def peak_bytes(self) -> list[int]:
        """The most memory each rank's cgroup was charged (page cache included), per rank; 0 if unknown."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        out = []
        for p in self.paths:
            try:
                out.append(int((p / name).read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                out.append(0)
        return out

    def remove(self, wait_s: float = 10.0) -> list[str]:
        """Removes the cgroups (waiting up to ``wait_s`` for exiting ranks); returns what stayed."""
        deadline = time.monotonic() + wait_s
        left = [p for p in self.paths if p.exists()]
        while left:
            for p in list(left):
                try:
                    p.rmdir()
                    left.remove(p)
                except OSError:
                    pass
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return [str(p) for p in left]

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()
