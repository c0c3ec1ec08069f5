"""Helpers every benchmark script shares: units, atomic JSON, list options."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["human_bytes", "human_time", "atomic_write", "write_json", "list_choices", "selected",
           "ratio_target", "kill_group", "shown"]


def human_bytes(n: int) -> str:
    """``4096 -> "4 KiB"``; exact binary units where they divide evenly."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"


def human_time(t: float) -> str:
    """Seconds as ``"12.3 us"`` below a millisecond, else ``"4.56 ms"``."""
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def atomic_write(path: Path, write: Callable[[Any], None], mode: str) -> None:
    """Writes through a temporary file in ``path``'s directory, then renames it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, records: Sequence[Any]) -> None:
    """Write dataclass records as a JSON list, atomically."""
    atomic_write(path, lambda f: json.dump([asdict(r) for r in records], f, indent=1), "w")


def list_choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [s for s in text.split(",") if s]
        bad = [s for s in items if s not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return items
    return parse


def selected(groups: Sequence[Sequence[str]], allowed: Sequence[str]) -> list[str]:
    """The choices of a repeated :func:`list_choices` option (``nargs="+"``), once each, in ``allowed``'s order."""
    chosen = {x for group in groups for x in group}
    return [a for a in allowed if a in chosen]


def shown(value: float, ok: bool, bound: float, at_least: bool, digits: int = 2) -> str:
    """``value`` with ``digits`` decimals, or more where fewer would print it on the wrong side of ``bound``: a
    miss never shows the threshold itself (1.2496 against ">= 1.25" is "1.2496", not "1.25" or "1.250"), nor a
    pass a number that looks like a miss."""
    for d in range(digits, 9):
        text = f"{value:.{d}f}"
        printed = float(text)
        meets = printed >= bound if at_least else printed <= bound
        if meets == ok:
            return text
    return repr(value)


def ratio_target(what: str, mine: float | None, theirs: float | None, minimum: float, note: str = "") -> str:
    """A target line ``  what = 1.23  (target >= minimum)  PASS``, or "n/a   not measured"."""
    if mine is None or theirs is None:
        return f"  {what} = n/a   not measured"
    ratio = mine / theirs
    ok = ratio >= minimum
    return f"  {what} = {shown(ratio, ok, minimum, True)}  (target >= {minimum})  {'PASS' if ok else 'MISS'}{note}"


def kill_group(proc: subprocess.Popen[str]) -> None:
    """End a job started in its own process group: SIGTERM, then SIGKILL, 10 s each."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
