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
in host order) differs from the flat ring's.

The data moves through MPI's own ``Alltoallv`` and ``Allgatherv`` (the direct
reduce-scatter of :mod:`.ordered`: each segment's owner receives every rank's
piece and folds them), not through our Python-driven ring: on the test hosts,
where the cores are shared and the ranks wait for CPU as much as for the link,
that was faster (docs/collectives.md, "Many hosts"), and it keeps the sums in
a fixed order.

All-gather: each rank's block goes first to the ranks of its local rank on the
other hosts (cross all-gather, straight into its place in the output), then
within each host every rank shares the blocks it received (local all-gather of
packed blocks). Broadcast: the root's cross communicator first, then each host
from the rank with the root's local rank.

Steps 1 and 3 of the all-reduce, and the all-gather's local step, need the same
number of ranks on every host (``Topology.homogeneous``); the kernels fall back
to the host-ordered flat ring otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from unison.collectives import ordered
from unison.collectives.p2p import segments
from unison.collectives.topology import Topology

__all__ = ["allreduce", "allgatherv", "broadcast", "CROSS_ROUND_BYTES"]

#: Each round of the cross-host phase receives up to this many bytes (from all hosts together;
#: at least ``chunk`` from each): a round waits for the slowest connection, so across hosts
#: fewer, larger rounds keep the link busier (64 MiB over 2 test hosts at 1 Gbit/s: 0.85 s
#: with 8 MiB per host and round, 1.16 s with 1 MiB).
CROSS_ROUND_BYTES = 16 << 20


def allreduce(topo: Topology, mpi: Any, src: np.ndarray, out: np.ndarray, op: np.ufunc, chunk: int,
              finish: Callable[[np.ndarray], None] | None = None) -> None:
    """Hierarchical all-reduce of ``src`` into ``out`` (1-D; ``out`` may be ``src``).

    ``finish`` (average, postscale) runs once on every element, on the rank that
    completes it. Needs ``topo.homogeneous``.
    """
    local, cross = topo.local, topo.cross
    counts, offsets = segments(out.size, topo.local_size)
    j = topo.local_rank
    seg = out[offsets[j]:offsets[j] + counts[j]]
    if topo.local_size > 1:
        ordered.reduce_scatter(local, mpi, src, seg, counts, offsets, op, chunk)
    elif out.ctypes.data != src.ctypes.data:
        np.copyto(out, src)
    if topo.cross_size > 1:
        piece = max(chunk, CROSS_ROUND_BYTES // (topo.cross_size * out.itemsize))
        ordered.allreduce(cross, mpi, seg, seg, op, piece, finish)
    elif finish is not None and seg.size:
        finish(seg)
    if topo.local_size > 1:
        item = out.itemsize
        local.Allgatherv(mpi.IN_PLACE, [out.reshape(-1).view(np.uint8), [c * item for c in counts],
                                        [o * item for o in offsets], mpi.BYTE])


def allgatherv(topo: Topology, mpi: Any, ob: np.ndarray, byte_counts: list[int],
               offsets: list[int]) -> None:
    """Hierarchical all-gather in place: this rank's bytes are already at ``ob[offsets[rank]]``.

    ``byte_counts``/``offsets`` are indexed by rank of the communicator; blocks
    land in rank order whatever the placement. Needs ``topo.homogeneous``.
    """
    peers = topo.members(topo.local_rank)  # my cross communicator's ranks, by cross rank
    if topo.cross_size > 1:
        topo.cross.Allgatherv(mpi.IN_PLACE, [ob, [byte_counts[p] for p in peers],
                                             [offsets[p] for p in peers], mpi.BYTE])
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


def broadcast(topo: Topology, mpi: Any, ob: np.ndarray, root: int) -> None:
    """Broadcast ``ob`` (bytes) from ``root``: across hosts among the root's local rank, then within hosts.

    Needs every host to have a rank with the root's local rank (true when homogeneous).
    """
    root_local = topo.local_ranks[root]
    if topo.cross_size > 1 and topo.local_rank == root_local:
        topo.cross.Bcast([ob, mpi.BYTE], root=topo.members(root_local).index(root))
    if topo.local_size > 1:
        topo.local.Bcast([ob, mpi.BYTE], root=root_local)
