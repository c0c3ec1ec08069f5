"""Benchmark Unison's collectives against MPI's own and against torch.distributed's gloo.

Run it inside one MPI job; every rank runs the same cases in the same order::

    unisonrun -np 4 python benchmarks/collectives.py --json out.json

Why it exists: ``algorithm="auto"`` (see :mod:`unison.collectives.select`) picks
an algorithm by message size and rank count, and the issue that introduced it
set targets against the two obvious alternatives a user could run instead. This
script measures all of them on the same data, in one job, and prints the targets
with PASS/MISS so a threshold change can be judged by one command.

What is measured, for each (op, impl, size):

* ``impl`` is one of :data:`IMPLS`. ``unison-*`` calls the algorithm-level
  ``unison.collectives.<op>(..., algorithm=...)`` with the algorithm
  :data:`UNISON_ALGORITHMS` maps it to (a missing entry means the op has no such
  algorithm and the case is skipped). The top-level ``unison.<op>`` calls go
  through the engine (naming, negotiation, fusion), which is not measured here.
  ``mpi-native`` calls mpi4py's ``Allreduce``/``Allgather``/``Reduce_scatter_block``/
  ``Bcast``/``Alltoall`` on preallocated numpy buffers over a ``Dup`` of ``COMM_WORLD``, the
  communicator type Unison itself uses. ``mpi+agree`` makes the same call after an all-gather of
  the block Unison's agreement exchanges (512 bytes per rank), in raw mpi4py with no Python of
  Unison's: the floor of any design that agrees on every call in an exchange of its own before
  MPI's call (see [Note: the agreement's floor]). ``gloo`` calls torch.distributed with the
  gloo backend, initialised inside the same job over TCP on 127.0.0.1 (so only
  for single-host jobs). Unison's calls return a new array, as its API does; the
  other two write into preallocated buffers, as theirs do.
* ``bytes`` is the size of each rank's float32 *input*, for every op, allgather
  included (its output is ``np`` times larger). Reducescatter and alltoall round it down to a
  multiple of ``4 * np`` so that it splits evenly; the record holds the bytes used.
* Each case is warmed up, then timed ``repeats`` times, each call alone between a
  ``COMM_WORLD`` barrier and the clock. An iteration's time is its maximum over
  ranks; the reported time is the median iteration. Unless ``--repeats`` is
  given, repeats = clamp(``--budget-s`` / warm-up time, 3, 50).
* Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``), in GB/s of 1e9 bytes:
  ``algbw = S / time`` and ``busbw = algbw * factor`` with

  ============= ===================================== ================
  op            S                                     factor
  ============= ===================================== ================
  allreduce     per-rank input                        2 (n - 1) / n
  allgather     total gathered output = input * n     (n - 1) / n
  reducescatter per-rank input (= the whole vector)   (n - 1) / n
  broadcast     per-rank input                        1
  alltoall      per-rank input (n equal pieces)       (n - 1) / n
  ============= ===================================== ================

* Memory bandwidth is measured once by rank 0 (the others wait at a barrier
  that sleeps rather than spins): the best of several ``np.copyto`` of 256 MiB of
  float32, counting read plus write (2 x size). No collective's busbw can reach it:
  a rank must read and write several bytes per byte of busbw. The table prints
  every busbw as a share of the op's *memory bound* instead
  (:func:`memory_bound_busbw`: the bytes each rank must read plus write per call,
  at that bandwidth), and the plot draws that bound dashed.
  Messages that fit in cache can exceed 100%.
* Each case's last result is checked against the known answer; a wrong answer is
  reported as a failure (every rank agrees on it) and left out of the outputs.

Outputs: a table and summaries on rank 0's stdout; with ``--json``, a list of
records ``{op, impl, np, bytes, time_s, busbw_gbps, membw_gbps}``; a PNG of busbw
against size (``--png``, by default next to the JSON).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from benchutil import atomic_write, human_bytes, human_time, list_choices, selected, shown, write_json

logger = logging.getLogger("benchmarks.collectives")

OPS = ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall")
IMPLS = ("unison-auto", "unison-ring", "unison-rhd", "mpi-native", "mpi+agree", "gloo")
#: The ``algorithm=`` each ``unison-*`` impl passes, per op. ``unison-ring`` means the
#: ring for allreduce, allgather and reducescatter and the binomial tree for broadcast
#: (Unison has no ring broadcast); ``unison-rhd`` (recursive halving/doubling) exists
#: for allreduce only.
UNISON_ALGORITHMS: dict[str, dict[str, str]] = {
    "unison-auto": {op: "auto" for op in OPS},
    "unison-ring": {"allreduce": "ring", "allgather": "ring", "reducescatter": "ring",
                    "broadcast": "tree"},
    "unison-rhd": {"allreduce": "rhd"},
}
#: nccl-tests' busbw factors, by op, as a function of the rank count.
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "alltoall": lambda n: (n - 1) / n,
}
#: Bytes each rank must read plus write per byte of its input, on one host, when every rank
#: reads the others' buffers directly (one copy; see :func:`memory_bound_busbw`).
RANK_TRAFFIC: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 3 - 1 / n,  # reduce S/n from n inputs (read S, write S/n), gather the rest
    "allgather": lambda n: 2 * n,      # read every rank's S, write n S
    "reducescatter": lambda n: 1 + 1 / n,  # read n pieces of S/n, write S/n
    "broadcast": lambda n: 2,          # a receiver reads the root's S and writes S
    "alltoall": lambda n: 2,           # read S in n pieces, write S
}
#: (op, bytes, metric, other impl, comparison, bound) for the issues' targets (issue 19: the direct
#: collectives within 1.5x of MPI's own call's time at 4 KiB, 64 KiB and 1 MiB).
TARGETS = (
    ("allreduce", 64 << 20, "busbw", "mpi-native", ">=", 0.9),
    ("allreduce", 64 << 20, "busbw", "gloo", ">=", 1.2),
    *((op, nbytes, "time", "mpi-native", "<=", 1.5) for op in OPS for nbytes in (4 << 10, 64 << 10, 1 << 20)),
)
#: Issue 19: where ``auto`` picks MPI's own call, unison-auto's time within this factor of mpi-native's.
AUTO_MPI_BOUND = 1.2
MIN_REPEATS, MAX_REPEATS = 3, 50
#: Cases up to this size are timed in ``--rounds`` interleaved rounds (see :func:`schedule`).
ROUND_BYTES = 1 << 20
WARMUP_BUDGET_S = 0.2
MEMBW_BYTES = 256 << 20
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class WrongResultError(RuntimeError):
    """A collective returned a wrong answer on some rank; raised on every rank alike."""


@dataclass
class Record:
    """One measured case, as written to the JSON file."""

    op: str
    impl: str
    np: int
    bytes: int
    time_s: float
    busbw_gbps: float
    membw_gbps: float
    rounds: int = 1  #: how many interleaved rounds timed this case (``time_s`` is the fastest round's median)


def parse_bytes(text: str) -> int:
    """Parses ``"4096"``, ``"4K"``, ``"16MiB"`` or ``"1G"`` (binary units) into bytes.

    Raises:
        argparse.ArgumentTypeError: the text is not a positive size.
    """
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if m is None or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 4096, 4K, 16M or 1G")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def size_range(lo: int, hi: int) -> list[int]:
    """The message sizes ``lo, 4 lo, 16 lo, ...`` up to ``hi`` inclusive."""
    sizes = []
    while lo <= hi:
        sizes.append(lo)
        lo *= 4
    return sizes


def memory_bound_busbw(op: str, n: int, membw: float) -> float:
    """The busbw (GB/s) ``op`` would reach if each rank moved only its necessary bytes at ``membw``.

    ``membw`` counts read plus write bytes per second (see :func:`measure_membw`);
    :data:`RANK_TRAFFIC` gives the bytes a rank must read plus write per byte of its
    input when it reads the other ranks' buffers directly (one copy, no staging), so
    the fastest possible call takes ``S * RANK_TRAFFIC / membw`` and this is its busbw.
    Messages that fit in cache can beat it; no busbw reaches ``membw`` itself.
    """
    per_byte = 1 / RANK_TRAFFIC[op](n) * (n if op == "allgather" else 1)  # algbw over membw
    return membw * per_byte * BUS_FACTOR[op](n)


def busbw_gbps(op: str, nbytes: int, n: int, t: float) -> float:
    """nccl-tests' bus bandwidth in GB/s for ``nbytes`` of per-rank input moved in ``t`` s."""
    size = nbytes * n if op == "allgather" else nbytes
    return size / t * BUS_FACTOR[op](n) / 1e9


def quiet_barrier(comm: Any, poll_s: float = 0.005) -> None:
    """A barrier that sleeps while it waits, so waiting ranks leave the CPUs alone."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def measure_membw(comm: Any, nbytes: int = MEMBW_BYTES, tries: int = 5) -> float:
    """Rank 0's copy bandwidth in GB/s (read + write), shared with all ranks."""
    gbps = 0.0
    if comm.Get_rank() == 0:
        src = np.ones(nbytes // 4, dtype=np.float32)
        dst = np.zeros_like(src)
        best = math.inf
        for _ in range(tries):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
        gbps = 2 * nbytes / best / 1e9
        logger.info("memory bandwidth: %.2f GB/s (best of %d copies of %s)", gbps, tries,
                    human_bytes(nbytes))
    quiet_barrier(comm)
    return float(comm.bcast(gbps, root=0))


# --- one collective call per impl -------------------------------------------------------------
# Each *_call builder returns call(), which runs the collective once on preallocated input
# and returns its output. _checker's check(output) raises ValueError unless the output is
# the known answer for inputs filled with rank + 1 (or 0 where gloo accumulates in place).


def _checker(op: str, n: int, fills: np.ndarray) -> Callable[[Any], None]:
    expect = {"allreduce": fills.sum(), "reducescatter": fills.sum(), "broadcast": fills[0]}

    def check(out: Any) -> None:
        arr = np.asarray(out.numpy() if hasattr(out, "numpy") else out)
        if op in ("allgather", "alltoall"):  # rank r's row of each source, in source order
            good = bool((arr.reshape(n, -1) == fills[:, None]).all())
        else:
            good = bool((arr == expect[op]).all())
        if not good:
            raise ValueError(f"wrong {op} result: got values {np.unique(arr)[:8].tolist()}, "
                             f"expected {fills.tolist() if op in ('allgather', 'alltoall') else expect[op]}")
    return check


def unison_call(op: str, algorithm: str, x: np.ndarray) -> Callable[[], Any]:
    import unison
    from unison import collectives as coll

    if op == "allreduce":
        return lambda: coll.allreduce(x, op=unison.Sum, algorithm=algorithm)
    if op == "allgather":
        return lambda: coll.allgather(x, algorithm=algorithm)
    if op == "reducescatter":
        return lambda: coll.reducescatter(x, op=unison.Sum, algorithm=algorithm)
    if op == "alltoall":
        return lambda: coll.alltoall(x, algorithm=algorithm)[0]
    return lambda: coll.broadcast(x, root_rank=0, algorithm=algorithm)


def agreed_call(comm: Any, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` after the all-gather of one agreement block per rank (the ``mpi+agree`` impl).

    [Note: the agreement's floor] Every direct Unison collective first all-gathers a fixed block
    describing the call, so that a mismatch raises on every rank instead of hanging or computing
    on garbage (:mod:`unison.collectives.header`). This impl times that exchange and MPI's own
    call with nothing else, so its ratio to ``mpi-native`` is what the check alone costs, and
    ``unison-auto``'s ratio to it what Unison's Python adds. A target of ``<= 1.5x mpi-native``
    below this floor cannot be met by any design that agrees in an exchange of its own.
    """
    from unison.collectives.header import HEADER_BYTES, INLINE_BYTES

    block = np.zeros(HEADER_BYTES + INLINE_BYTES, np.uint8)
    gathered = np.empty(block.size * comm.Get_size(), np.uint8)

    def agreed() -> Any:
        comm.Allgather(block, gathered)
        return call()

    return agreed


def mpi_call(op: str, comm: Any, x: np.ndarray) -> Callable[[], Any]:
    from mpi4py import MPI

    n = comm.Get_size()
    if op == "broadcast":
        return lambda: (comm.Bcast(x, root=0), x)[1]
    out = np.empty(x.size * n if op == "allgather" else
                   x.size // n if op == "reducescatter" else x.size, dtype=x.dtype)
    if op == "allreduce":
        return lambda: (comm.Allreduce(x, out, op=MPI.SUM), out)[1]
    if op == "allgather":
        return lambda: (comm.Allgather(x, out), out)[1]
    if op == "alltoall":
        return lambda: (comm.Alltoall(x, out), out)[1]
    return lambda: (comm.Reduce_scatter_block(x, out, op=MPI.SUM), out)[1]


class Gloo:
    """torch.distributed with the gloo backend, started inside this MPI job."""

    def __init__(self, world: Any) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        torch.set_num_threads(1)
        port = None
        if world.Get_rank() == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = world.bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=world.Get_rank(), world_size=world.Get_size())
        n = world.Get_size()
        self.fns: dict[str, Callable[..., Any] | None] = {
            "allreduce": dist.all_reduce,
            "allgather": getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
            "reducescatter": (getattr(dist, "reduce_scatter_single", None)
                              or getattr(dist, "reduce_scatter_tensor", None)),
            "broadcast": dist.broadcast,
            "alltoall": getattr(dist, "all_to_all_single", None),
        }
        self.missing: dict[str, str] = {}
        for op in OPS:
            err = self._probe(op, n)
            errs = world.allgather(err)
            if any(errs):
                self.missing[op] = next(e for e in errs if e)

    def _probe(self, op: str, n: int) -> str:
        """Runs ``op`` once on a tiny tensor; returns why it failed, or "" if it worked."""
        try:
            self.call(op, np.ones(n, dtype=np.float32))()
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        return ""

    def call(self, op: str, x: np.ndarray) -> Callable[[], Any]:
        """A call of ``op`` on a tensor sharing ``x``'s memory, into a preallocated output.

        Raises:
            NotImplementedError: this torch has no single-tensor form of ``op``.
        """
        f = self.fns[op]
        if f is None:
            raise NotImplementedError(f"torch.distributed has no {op} into a single tensor")
        t, n = self.torch.from_numpy(x), self.dist.get_world_size()
        if op == "allreduce":
            return lambda: (f(t), t)[1]  # in place
        if op == "broadcast":
            return lambda: (f(t, src=0), t)[1]  # in place
        out = self.torch.empty(x.size * n if op == "allgather" else x.size if op == "alltoall"
                               else x.size // n, dtype=self.torch.float32)
        return lambda: (f(out, t), out)[1]

    def close(self) -> None:
        self.dist.destroy_process_group()


# --- timing -----------------------------------------------------------------------------------


def time_case(world: Any, call: Callable[[], Any], repeats: int | None, budget_s: float,
              warmup: int) -> tuple[np.ndarray, Any]:
    """Warms up, then times ``call``.

    Every rank must call this with the same arguments; the number of warm-up and
    timed calls is derived from times agreed over ``world``, so ranks stay in step.

    Args:
        world: the communicator for the barriers and the max-over-ranks reduction.
        call: runs the collective once and returns its output.
        repeats: timed calls; None picks clamp(budget_s / warm-up time, 3, 50).
        budget_s: target seconds of timed calls when ``repeats`` is None.
        warmup: most warm-up calls (the first is always made; further ones only
            while they fit in a fifth of a second).

    Returns:
        The per-call times (max over ranks), and the last call's output.
    """
    from mpi4py import MPI

    def timed() -> tuple[float, Any]:
        world.Barrier()
        t0 = time.perf_counter()
        out = call()
        return time.perf_counter() - t0, out

    est, out = timed()
    est = max(world.allreduce(est, op=MPI.MAX), 1e-9)
    extra = min(warmup - 1, int(WARMUP_BUDGET_S / est))  # same on every rank: est is agreed
    if extra > 0:
        out = None
        warm = np.array([timed()[0] for _ in range(extra)])
        world.Allreduce(MPI.IN_PLACE, warm, op=MPI.MAX)
        est = float(warm.min())
    count = repeats or min(MAX_REPEATS, max(MIN_REPEATS, int(budget_s / est)))
    times = np.empty(count)
    for i in range(count):
        out = None  # let the previous output go before the next call allocates
        times[i], out = timed()
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return times, out


def plan(ops: Sequence[str], impls: Sequence[str], sizes: Sequence[int],
         gloo: Gloo | None) -> list[tuple[str, int, str]]:
    """The (op, bytes, impl) cases to run: impls side by side at each size."""
    cases = []
    for op in ops:
        for nbytes in sizes:
            for impl in impls:
                if impl in UNISON_ALGORITHMS and op not in UNISON_ALGORITHMS[impl]:
                    continue
                if impl == "gloo" and (gloo is None or op in gloo.missing):
                    continue
                if impl == "mpi+agree" and nbytes > ROUND_BYTES:  # (the targets' sizes: 4 KiB-1 MiB)
                    continue
                cases.append((op, nbytes, impl))
    return cases


def schedule(cases: Sequence[tuple[str, int, str]], rounds: int) -> list[tuple[str, int, str]]:
    """Every case once, then the cases of at most :data:`ROUND_BYTES` again, ``rounds - 1`` more times.

    [Note: rounds] A case of a few microseconds is timed within a few milliseconds, so one
    descheduled rank or a page-cache flush in that window sets its median (64 KiB all-to-alls of
    13-45 us against 5-9 us in a quiet job, 2026-12-07). Each round runs every impl once at
    each size, in the same order, so a slow spell hits them alike; :func:`main` keeps each case's
    fastest round, as a quiet machine would measure it. Larger cases take long enough to average
    such spells out and run once.
    """
    again = [c for c in cases if c[1] <= ROUND_BYTES]
    return list(cases) + again * (rounds - 1)


def keep_fastest(best: dict[tuple[str, int, str], Record], case: tuple[str, int, str], rec: Record) -> None:
    """Keeps ``case``'s faster round in ``best`` ([Note: rounds] in :func:`schedule`), counting the rounds."""
    old = best.get(case)
    if old is not None:
        rec = min(old, rec, key=lambda r: r.time_s)
        rec.rounds = old.rounds + 1
    best[case] = rec


def run_case(world: Any, mpi_comm: Any, gloo: Gloo | None, op: str, nbytes: int, impl: str,
             args: argparse.Namespace, membw: float) -> Record:
    """Times one case and checks its answer.

    Args:
        world: ``COMM_WORLD``, for timing and agreeing on the check.
        mpi_comm: the communicator ``mpi-native`` runs on.
        gloo: the started gloo group, or None.
        op, nbytes, impl: the case; ``nbytes`` is each rank's input size.
        args: the command line (``repeats``, ``budget_s``, ``warmup``).
        membw: rank 0's memory bandwidth in GB/s, copied into the record.

    Returns:
        The measured record.

    Raises:
        WrongResultError: the collective returned a wrong answer on some rank (raised on
            every rank).
    """
    n, r = world.Get_size(), world.Get_rank()
    count = nbytes // 4 - (nbytes // 4) % n if op in ("reducescatter", "alltoall") else nbytes // 4
    accumulates = impl == "gloo" and op == "allreduce"  # in place: keep the sums bounded
    fills = np.zeros(n, np.float32) if accumulates else np.arange(1, n + 1, dtype=np.float32)
    x = np.full(count, fills[r], dtype=np.float32)
    if impl in UNISON_ALGORITHMS:
        call = unison_call(op, UNISON_ALGORITHMS[impl][op], x)
    elif impl == "mpi-native":
        call = mpi_call(op, mpi_comm, x)
    elif impl == "mpi+agree":
        call = agreed_call(mpi_comm, mpi_call(op, mpi_comm, x))
    else:
        assert gloo is not None
        call = gloo.call(op, x)
    times, out = time_case(world, call, args.repeats, args.budget_s, args.warmup)
    try:
        _checker(op, n, fills)(out)
        err = ""
    except ValueError as exc:
        err = f"rank {r}: {exc}"
    errs = [e for e in world.allgather(err) if e]
    if errs:
        raise WrongResultError("; ".join(errs))
    t = float(np.median(times))
    logger.debug("%s %s %s: %d repeats, median %s", op, impl, human_bytes(count * 4), times.size,
                 human_time(t))
    return Record(op, impl, n, count * 4, t, busbw_gbps(op, count * 4, n, t), membw)


# --- reporting --------------------------------------------------------------------------------


def print_table(records: Sequence[Record]) -> None:
    print(f"{'op':<14}{'impl':<13}{'np':>3}{'bytes':>10}{'time':>12}{'busbw GB/s':>12}"
          f"{'of bound':>10}")
    for rec in records:
        bound = memory_bound_busbw(rec.op, rec.np, rec.membw_gbps)
        share = rec.busbw_gbps / bound if bound else math.nan
        print(f"{rec.op:<14}{rec.impl:<13}{rec.np:>3}{human_bytes(rec.bytes):>10}"
              f"{human_time(rec.time_s):>12}{rec.busbw_gbps:>12.3f}{share:>10.1%}")


def _ratio(by: dict[tuple[str, str, int], Record], op: str, nbytes: int, other: str,
           metric: str) -> float | None:
    mine, theirs = by.get((op, "unison-auto", nbytes)), by.get((op, other, nbytes))
    if mine is None or theirs is None:
        return None
    if metric == "time":
        return mine.time_s / theirs.time_s
    return mine.busbw_gbps / theirs.busbw_gbps if theirs.busbw_gbps else math.inf


def auto_picks_mpi(op: str, nbytes: int, n: int) -> bool:
    """Whether ``algorithm="auto"`` runs MPI's own call for ``op`` at ``nbytes`` per rank in this job."""
    import types

    import unison
    from unison.collectives.header import INLINE_BYTES
    from unison.collectives.select import choose_allreduce, choose_simple

    if nbytes <= INLINE_BYTES:
        return False
    topo = types.SimpleNamespace(spans_hosts=unison.local_size() != unison.size())
    if op == "allreduce":
        return choose_allreduce("auto", nbytes, n, topo) == "mpi"
    total = nbytes * n if op == "allgather" else nbytes
    return choose_simple(op, "auto", total, n, topo) == "mpi"


def print_summaries(records: Sequence[Record]) -> None:
    by = {(r.op, r.impl, r.bytes): r for r in records}
    keys = sorted({(r.op, r.bytes) for r in records}, key=lambda k: (OPS.index(k[0]), k[1]))
    fmt = lambda v: "-" if v is None else f"{v:.2f}"
    print("\nunison-auto busbw / other busbw (> 1: unison-auto is faster)")
    print(f"{'op':<14}{'bytes':>10}{'/ mpi-native':>14}{'/ gloo':>10}")
    for op, nbytes in keys:
        print(f"{op:<14}{human_bytes(nbytes):>10}"
              f"{fmt(_ratio(by, op, nbytes, 'mpi-native', 'busbw')):>14}"
              f"{fmt(_ratio(by, op, nbytes, 'gloo', 'busbw')):>10}")
    n = records[0].np if records else 0
    print(f"\ntargets (np={n})")
    for op, nbytes, metric, other, cmp, bound in TARGETS:
        value = _ratio(by, op, nbytes, other, metric)
        what = f"{human_bytes(nbytes)} {op} unison-auto {metric} / {other} {metric}"
        if value is None:
            print(f"  {what:<58} = n/a   (target {cmp} {bound})  not measured")
            continue
        ok = value >= bound if cmp == ">=" else value <= bound
        print(f"  {what:<58} = {shown(value, ok, bound, cmp == '>=')}  (target {cmp} {bound})  "
              f"{'PASS' if ok else 'MISS'}")
    floors = [(op, nbytes) for op, nbytes, metric, other, _, _ in TARGETS
              if metric == "time" and other == "mpi-native" and (op, "mpi+agree", nbytes) in by]
    if floors:
        print("  floor (no target; [Note: the agreement's floor]): mpi+agree = the agreement's all-gather, then "
              "MPI's call")
        for op, nbytes in floors:
            floor = by[(op, "mpi+agree", nbytes)].time_s
            native, mine = by.get((op, "mpi-native", nbytes)), by.get((op, "unison-auto", nbytes))
            what = f"{human_bytes(nbytes)} {op}"
            print(f"  {what:<20} mpi+agree / mpi-native = {fmt(native and floor / native.time_s):>5}   "
                  f"unison-auto / mpi+agree = {fmt(mine and mine.time_s / floor):>5}")
    print(f"  where auto picks MPI's own call: unison-auto time / mpi-native time <= {AUTO_MPI_BOUND}")
    for op, nbytes in keys:
        value = _ratio(by, op, nbytes, "mpi-native", "time")
        if value is None or not auto_picks_mpi(op, nbytes, n):
            continue
        what = f"{human_bytes(nbytes)} {op} (auto = mpi) unison-auto time / mpi-native time"
        ok = value <= AUTO_MPI_BOUND
        print(f"  {what:<58} = {shown(value, ok, AUTO_MPI_BOUND, False)}  (target <= {AUTO_MPI_BOUND})  "
              f"{'PASS' if ok else 'MISS'}")


def write_png(path: Path, records: Sequence[Record], membw: float) -> None:
    """One subplot per op: busbw against size, a line per impl, memory bandwidth dashed.

    Both axes are logarithmic: busbw spans four decades between 4 KiB and 256 MiB.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OPS if any(r.op == op for r in records)]
    cols = min(2, len(ops))
    rows = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, op in zip(axes.flat, ops, strict=False):
        for impl in IMPLS:
            pts = sorted((r.bytes, r.busbw_gbps) for r in records if r.op == op and r.impl == impl)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=impl,
                        color=f"C{IMPLS.index(impl)}")
        bound = memory_bound_busbw(op, records[0].np, membw)
        ax.axhline(bound, linestyle="--", color="gray",
                   label=f"memory bound ({bound:.1f} GB/s: bytes a rank must\n"
                         f"read + write at {membw:.1f} GB/s copy bw)")
        sizes = sorted({r.bytes for r in records if r.op == op})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [human_bytes(s) for s in sizes], rotation=45, fontsize=8)
        ax.set(title=f"{op} (np={records[0].np})", xlabel="bytes per rank", ylabel="busbw (GB/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120), "wb")
    plt.close(fig)


# --- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Time Unison's collectives against mpi4py's native calls and torch's gloo, "
                    "with nccl-tests' bus bandwidth. Run under unisonrun/mpirun; rank 0 prints.",
        epilog="Sizes take binary units: 4096, 4K, 16M, 1G. Lists take commas or spaces.")
    p.add_argument("--ops", type=list_choices(OPS), nargs="+", default=[list(OPS)],
                   help=f"collectives to run (default: all of {', '.join(OPS)})")
    p.add_argument("--impls", type=list_choices(IMPLS), nargs="+", default=[list(IMPLS)],
                   help=f"implementations to run (default: all of {', '.join(IMPLS)})")
    p.add_argument("--min-bytes", type=parse_bytes, default=4 << 10,
                   help="smallest per-rank input size (default 4K)")
    p.add_argument("--max-bytes", type=parse_bytes, default=256 << 20,
                   help="largest per-rank input size (default 256M); sizes step by 4x")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed calls per case (default: adaptive, {MIN_REPEATS}-{MAX_REPEATS})")
    p.add_argument("--budget-s", type=float, default=1.0,
                   help="target timed seconds per case when --repeats is not given (default 1.0)")
    p.add_argument("--rounds", type=int, default=3,
                   help=f"interleaved rounds for cases up to {ROUND_BYTES >> 20} MiB, the fastest kept "
                        "(default 3)")
    p.add_argument("--warmup", type=int, default=3,
                   help="most warm-up calls per case; large messages get 1 (default 3)")
    p.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    p.add_argument("--png", type=Path, default=None,
                   help="write the busbw plot here (default: the --json path with .png)")
    p.add_argument("--log-level", default="WARNING",
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="diagnostics on stderr")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.ops = selected(args.ops, OPS)
    args.impls = selected(args.impls, IMPLS)
    if args.min_bytes > args.max_bytes:
        p.error(f"--min-bytes ({args.min_bytes}) is larger than --max-bytes ({args.max_bytes})")
    if (args.repeats is not None and args.repeats < 1) or args.warmup < 1 or args.rounds < 1 \
            or args.budget_s <= 0:
        p.error("--repeats, --rounds and --warmup must be at least 1 and --budget-s positive")
    if args.png is None and args.json is not None:
        args.png = args.json.with_suffix(".png")
    return args


def _start_gloo(world: Any, args: argparse.Namespace, notes: list[str]) -> Gloo | None:
    if "gloo" not in args.impls:
        return None
    import unison

    if unison.local_size() != unison.size():
        notes.append("gloo skipped: it runs over 127.0.0.1 and this job spans hosts")
        return None
    try:
        import torch  # noqa: F401
    except ImportError:
        notes.append("gloo skipped: torch is not installed")
        return None
    gloo = Gloo(world)
    for op, why in gloo.missing.items():
        if op in args.ops:
            notes.append(f"gloo has no usable {op} ({why}); skipping {op} for gloo")
    return gloo


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI
    from tqdm import tqdm

    import unison

    unison.init()
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"[collectives rank {rank}] %(levelname)s %(message)s")
    load_start = os.getloadavg()[0]
    membw = measure_membw(world)
    notes: list[str] = []
    gloo = _start_gloo(world, args, notes)
    mpi_comm = world.Dup()
    cases = plan(args.ops, args.impls, size_range(args.min_bytes, args.max_bytes), gloo)
    if rank == 0:
        print(f"np={n}, memory bandwidth {membw:.2f} GB/s (rank 0, 256 MiB copy, read + write); cases up to "
              f"{human_bytes(ROUND_BYTES)}: the fastest of {args.rounds} interleaved rounds")
        for note in notes:
            print(f"note: {note}")
    best: dict[tuple[str, int, str], Record] = {}
    failed: set[tuple[str, int, str]] = set()
    failures: list[str] = []
    bar = tqdm(schedule(cases, args.rounds), disable=rank != 0, file=sys.stderr, unit="case",
               dynamic_ncols=True)
    for op, nbytes, impl in bar:
        if (op, nbytes, impl) in failed:
            continue
        bar.set_description(f"{op} {impl} {human_bytes(nbytes)}")
        case = f"{op} {impl} {human_bytes(nbytes)} np={n}"
        try:
            keep_fastest(best, (op, nbytes, impl), run_case(world, mpi_comm, gloo, op, nbytes, impl, args, membw))
        except (WrongResultError, unison.UnisonError) as exc:
            failed.add((op, nbytes, impl))
            best.pop((op, nbytes, impl), None)  # (a case that failed in any round has no record)
            # Both are raised on every rank alike (Unison agrees on errors before moving
            # data), so all ranks can go on to the next case.
            failures.append(f"{case}: {type(exc).__name__}: {exc}")
            if rank == 0:
                logger.error("%s", failures[-1])
        except BaseException:
            logger.critical("%s failed on rank %d; the job ends", case, rank)
            raise
    bar.close()
    records = [best[c] for c in cases if c in best]
    if rank == 0:
        print_table(records)
        print_summaries(records)
        for f in failures:
            print(f"FAILED: {f}")
        print(f"\nhost load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} "
              f"at end, on {os.cpu_count()} CPUs with {n} ranks; more than the ranks means other "
              "work shared the CPUs")
        if args.json is not None:
            write_json(args.json, records)
            print(f"wrote {args.json}")
        if args.png is not None and records:
            write_png(args.png, records, membw)
            print(f"wrote {args.png}")
    if gloo is not None:
        gloo.close()
    mpi_comm.Free()
    unison.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
