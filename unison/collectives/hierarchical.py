"""Hierarchical all-reduce, all-gather and broadcast: within hosts, then across, then within.

Between hosts the network is the bottleneck; within a host, shared memory is
ten or more times faster. These algorithms send each byte across the network
once per host instead of once per rank. With H hosts of L ranks each
(:class:`~unison.collectives.topology.Topology`; ``x`` = one message of S bytes)::

    all-reduce                          host A: a0 a1      host B: b0 b1
    1. local reduce-scatter             a0: A[0]  a1: A[1] b0: B[0]  b1: B[1]   (S/L each)
    2. cross all-reduce, local rank j   a0 <-> b0: A[0]+B[0]     a1 <-> b1: A[1]+B[1]
    3. local all-gather                 every rank: [AB[0] AB[1]]

Each host sends 2(H-1)/H * S across the network in step 2, spread over its L
ranks (so over L connections); a flat ring over all H*L ranks sends
2(HL-1)/(HL) * S from each host boundary: at 2 hosts x 2 ranks 1.0 S against
1.5 S. Every element of the result is computed by one rank (the owner of its
cross segment) and then only copied, so all ranks get the same bits -- but the
summation order (each host's ranks first, in local-rank order, then the hosts
in ring order from the one after the segment's owner) differs from the flat ring's.

Step 2 is our ring (:mod:`.ring`) on the cross communicator, moved in pieces of
a bounded size (:func:`cross_piece_bytes`): each piece is one ``Sendrecv``, so at
most one piece per connection and direction is in flight. Large transfers in one
go (MPI's ``Alltoallv`` in rounds of 16 MiB, our first version) overfilled the
queue of a slow link and stalled on TCP retransmission timeouts: 64 MiB at
1 Gbit/s took 0.9-1.0 s against 0.59 s in 64 KiB pieces (the link's floor is
0.54 s); on a fast link small pieces cost per-message overhead instead (64 KiB:
0.14 s, 256 KiB: 0.06 s unshaped). So the piece size follows the link: measured
once per communicator (every rank's fastest of three 4 MiB exchanges with its
cross-host peers, summed per host), agreed by all ranks;
``UNISON_CROSS_PIECE_BYTES`` fixes it.

All-gather: each rank's block goes first to the ranks of its local rank on the
other hosts (cross all-gather: our ring in the same link-sized pieces, straight
into its place in the output), then
within each host every rank shares the blocks it received (local all-gather of
packed blocks). Broadcast: the root's cross communicator first (our tree, in the
same pieces), then each host from the rank with the root's local rank.

Steps 1 and 3 of the all-reduce, and the all-gather's local step, need the same
number of ranks on every host (``Topology.homogeneous``); the kernels fall back
to the host-ordered flat ring otherwise.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from unison.collectives import native, ordered, ring, tree
from unison.collectives.p2p import exchange, segments
from unison.collectives.reduce import same_start
from unison.collectives.topology import Topology

__all__ = ["allreduce", "allgatherv", "broadcast", "link_rate", "cross_piece_bytes", "piece_for_bandwidth",
           "PIECE_MIN_BYTES", "PIECE_MAX_BYTES", "PIECE_SECONDS"]

logger = logging.getLogger(__name__)

#: Bounds of the cross-host piece size (bytes).
PIECE_MIN_BYTES = 64 << 10
PIECE_MAX_BYTES = 4 << 20
#: A piece should take about this long on the link: long enough that the per-message cost
#: (tens of microseconds) stays small, short enough that a slow link's queue never overflows.
PIECE_SECONDS = 0.25e-3
#: The probe: one warm-up piece (it also opens the connections), then PROBE_ROUNDS exchanges of
#: PROBE_BYTES; the fastest counts (on shared cores a round is slowed by whoever else runs, never
#: sped up).
PROBE_BYTES = 4 << 20
PROBE_PIECE_BYTES = 1 << 20
PROBE_ROUNDS = 3
TAG_PROBE = 19


def piece_for_bandwidth(bytes_per_s: float) -> int:
    """The cross-host piece size for a link of ``bytes_per_s``: a power of two near
    ``bytes_per_s * PIECE_SECONDS`` within [``PIECE_MIN_BYTES``, ``PIECE_MAX_BYTES``]."""
    if not math.isfinite(bytes_per_s) or bytes_per_s <= 0:
        return PIECE_MAX_BYTES if bytes_per_s == math.inf else PIECE_MIN_BYTES
    target = bytes_per_s * PIECE_SECONDS
    piece = 1 << max(0, round(math.log2(max(target, 1.0))))
    return min(PIECE_MAX_BYTES, max(PIECE_MIN_BYTES, piece))


def _probe(cross: Any, mpi: Any) -> float:
    """Bytes per second one rank sends to the next host while receiving from the previous one."""
    n, r = cross.Get_size(), cross.Get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    send = np.zeros(PROBE_BYTES, dtype=np.uint8)
    recv = np.empty_like(send)
    piece = PROBE_PIECE_BYTES
    exchange(cross, mpi, send[:piece], right, recv[:piece], left, TAG_PROBE, piece)
    best = math.inf
    for _ in range(PROBE_ROUNDS):
        cross.Barrier()
        started = time.perf_counter()
        exchange(cross, mpi, send, right, recv, left, TAG_PROBE, piece)
        best = min(best, time.perf_counter() - started)
    return PROBE_BYTES / max(best, 1e-9)


def link_rate(topo: Topology, mpi: Any) -> float:
    """The slowest host's rate to the next host (bytes/s) on ``topo``'s communicator, measured once.

    Every rank times exchanges with its peers on its cross communicator
    (:func:`_probe`), all at once, as the hierarchical all-reduce uses them (so
    no rank spins idle while others measure); a host's rate is the sum over its
    ranks, and every rank takes the slowest host's (also when hosts run
    different numbers of ranks). Kept on ``topo``; ``inf`` on one host.
    Collective over the communicator, like building the topology: every rank
    enters its collectives in the same order and asks at the same point (see
    [Note: topology is collective]).
    """
    if topo.cross_rate is None:
        rate = math.inf
        if topo.spans_hosts:
            if topo.local_size > 1:
                topo.local.Barrier()
            mine = _probe(topo.cross, mpi) if topo.cross_size > 1 else 0.0
            rate = topo.local.allreduce(mine, op=mpi.SUM) if topo.local_size > 1 else mine
            if topo.local_rank == 0:
                rate = topo.cross.allreduce(rate, op=mpi.MIN)
            if topo.local_size > 1:
                rate = topo.local.bcast(rate, root=0)
        topo.cross_rate = rate
        if topo.rank == 0 and topo.spans_hosts:
            logger.info("cross-host link measured at %.0f MB/s: pieces of %d KiB across hosts", rate / 1e6,
                        piece_for_bandwidth(rate) >> 10)
    return topo.cross_rate


def cross_piece_bytes(topo: Topology, mpi: Any, setting: int = 0) -> int:
    """The piece size (bytes) of the steps that cross hosts on ``topo``'s communicator.

    ``setting`` (``UNISON_CROSS_PIECE_BYTES``) > 0 is used as is; otherwise
    :func:`piece_for_bandwidth` of :func:`link_rate` (collective on first use).
    """
    if setting > 0:
        return setting
    return piece_for_bandwidth(link_rate(topo, mpi))


def allreduce(topo: Topology, mpi: Any, src: np.ndarray, out: np.ndarray, op: np.ufunc, chunk: int,
              finish: Callable[[np.ndarray], None] | None = None, piece_bytes: int = 0) -> None:
    """Hierarchical all-reduce of ``src`` into ``out`` (1-D; ``out`` may be ``src``).

    ``finish`` (average, postscale) runs once on every element, on the rank that
    completes it. ``chunk`` (elements) cuts the steps within hosts; ``piece_bytes``
    the step across them (0: measured, see :func:`cross_piece_bytes`). Needs
    ``topo.homogeneous``.
    """
    local, cross = topo.local, topo.cross
    counts, offsets = segments(out.size, topo.local_size)
    j = topo.local_rank
    seg = out[offsets[j]:offsets[j] + counts[j]]
    if topo.local_size > 1:
        ordered.reduce_scatter(local, mpi, src, seg, counts, offsets, op, chunk)
    elif not same_start(out, src):
        np.copyto(out, src)
    if topo.cross_size > 1:
        piece = max(1, cross_piece_bytes(topo, mpi, piece_bytes) // out.itemsize)
        ring.allreduce(cross, mpi, seg, seg, op, piece, finish)
    elif finish is not None and seg.size:
        finish(seg)
    if topo.local_size > 1:
        item = out.itemsize
        local.Allgatherv(mpi.IN_PLACE, [out.reshape(-1).view(np.uint8), [c * item for c in counts],
                                        [o * item for o in offsets], mpi.BYTE])


def allgatherv(topo: Topology, mpi: Any, ob: np.ndarray, byte_counts: list[int],
               offsets: list[int], piece_bytes: int = 0) -> None:
    """Hierarchical all-gather in place: this rank's bytes are already at ``ob[offsets[rank]]``.

    ``byte_counts``/``offsets`` are indexed by rank of the communicator; blocks
    land in rank order whatever the placement. The cross-host step is our ring
    in link-sized pieces (``piece_bytes``, 0: measured; see :func:`cross_piece_bytes`).
    Needs ``topo.homogeneous``.
    """
    peers = topo.members(topo.local_rank)  # my cross communicator's ranks, by cross rank
    if topo.cross_size > 1:
        piece = cross_piece_bytes(topo, mpi, piece_bytes)
        ring.allgatherv(topo.cross, mpi, ob, [byte_counts[p] for p in peers], [offsets[p] for p in peers],
                        piece)
    if topo.local_size == 1:
        return
    packs = [topo.members(j) for j in range(topo.local_size)]  # what local rank j gathered
    sizes = [sum(byte_counts[p] for p in pack) for pack in packs]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    staged = np.empty(sum(sizes), dtype=np.uint8)
    _pack(ob, staged[starts[topo.local_rank]:], packs[topo.local_rank], byte_counts, offsets)
    topo.local.Allgatherv(mpi.IN_PLACE, [staged, sizes, starts, mpi.BYTE])
    for i, pack in enumerate(packs):
        if i != topo.local_rank:
            _unpack(staged[starts[i]:], ob, pack, byte_counts, offsets)


def _pack(ob: np.ndarray, dst: np.ndarray, ranks: list[int], counts: list[int], offsets: list[int]) -> None:
    pos = 0
    for p in ranks:
        dst[pos:pos + counts[p]] = ob[offsets[p]:offsets[p] + counts[p]]
        pos += counts[p]


def _unpack(src: np.ndarray, ob: np.ndarray, ranks: list[int], counts: list[int], offsets: list[int]) -> None:
    pos = 0
    for p in ranks:
        ob[offsets[p]:offsets[p] + counts[p]] = src[pos:pos + counts[p]]
        pos += counts[p]


def broadcast(topo: Topology, mpi: Any, ob: np.ndarray, root: int, piece_bytes: int = 0) -> None:
    """Broadcast ``ob`` (bytes) from ``root``: across hosts among the root's local rank, then within hosts.

    The cross-host step is our binomial tree in link-sized pieces (``piece_bytes``,
    0: measured; every rank takes part in the measurement). Needs every host to
    have a rank with the root's local rank (true when homogeneous).
    """
    root_local = topo.local_ranks[root]
    if topo.cross_size > 1:
        piece = cross_piece_bytes(topo, mpi, piece_bytes)  # collective: before only some ranks go on
        if topo.local_rank == root_local:
            tree.broadcast(topo.cross, ob, topo.members(root_local).index(root), piece)
    if topo.local_size > 1:
        native.bcast_bytes(topo.local, mpi, ob, root_local)  # (pieces under 2 GiB)
