"""Ring algorithms: bandwidth-optimal reduce-scatter, all-gather and all-reduce.

With n ranks the buffer is cut into n segments. Reduce-scatter runs n-1 steps;
in each, every rank passes one partially reduced segment to its right
neighbour and folds the segment arriving from its left into its own input::

    step 0      step 1      (n = 3, rank r sends segment r - step + shift - 1)
    r0: s0 ->   r0: s2 ->
    r1: s1 ->   r1: s0 ->
    r2: s2 ->   r2: s1 ->

After it, rank r holds segment (r + shift) mod n reduced over all ranks; an
all-gather with the same rotation then circulates the finished segments. Each
rank sends and receives 2(n-1)/n of the buffer, the minimum for all-reduce.

[Note: ring in host order] The kernels run these on ``Topology.ring``
(:mod:`.topology`), a communicator whose ranks are numbered host by host. A
ring over ranks placed round robin (``--map-by node``: 0 and 2 on host A, 1 and
3 on host B) would cross between hosts at every step of its way round, 0 -> 1
-> 2 -> 3 -> 0, sending each host's whole share over the network twice; in host
order, 0 -> 2 -> 1 -> 3 -> 0, it crosses each host boundary once. Segment
ownership follows the ring's ranks, so ``reduce_scatter`` callers pass counts
and offsets in that order; the result does not depend on it.

Every finished segment is computed by exactly one rank and then copied, so the
result is bitwise identical on all ranks. Segment k of the output is written as
``input[k] op received`` the one time it arrives, so the input is never copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from unison.collectives.p2p import exchange, segments

__all__ = ["reduce_scatter", "allgatherv", "allreduce"]

TAG_RS = 11
TAG_AG = 12


def reduce_scatter(comm: Any, mpi: Any, inp: np.ndarray, work: np.ndarray,
                   counts: list[int], offsets: list[int], op: np.ufunc, chunk: int,
                   shift: int) -> int:
    """Ring reduce-scatter of ``inp`` into ``work``; returns the segment index this rank owns.

    ``work[segment]`` holds the partial results; the owned segment
    ``(rank + shift) % n`` is complete on return. ``inp`` is only read.
    """
    n, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    tmp = np.empty(min(chunk, max(counts)), dtype=inp.dtype)

    def seg(buf: np.ndarray, i: int) -> np.ndarray:
        return buf[offsets[i]:offsets[i] + counts[i]]

    for step in range(n - 1):
        send_idx = (r + shift - 1 - step) % n
        recv_idx = (r + shift - 2 - step) % n
        send = seg(inp if step == 0 else work, send_idx)
        exchange(comm, mpi, send, right, seg(work, recv_idx), left, TAG_RS, chunk,
                 op=op, base=seg(inp, recv_idx), tmp=tmp)
    return (r + shift) % n


def allgatherv(comm: Any, mpi: Any, buf: np.ndarray, counts: list[int], offsets: list[int],
               chunk: int, shift: int = 0) -> None:
    """Ring all-gather in place: rank r's block ``(r + shift) % n`` is already in ``buf``."""
    n, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        s = (r + shift - step) % n
        d = (r + shift - step - 1) % n
        exchange(comm, mpi, buf[offsets[s]:offsets[s] + counts[s]], right,
                 buf[offsets[d]:offsets[d] + counts[d]], left, TAG_AG, chunk)


def allreduce(comm: Any, mpi: Any, inp: np.ndarray, out: np.ndarray, op: np.ufunc, chunk: int,
              finish: Callable[[np.ndarray], None] | None = None) -> None:
    """Ring all-reduce of ``inp`` into ``out`` (1-D, same size; ``inp`` is not modified).

    ``finish`` runs on the owned segment between the two phases (averaging and
    post-scaling once per element instead of once per rank).
    """
    n = comm.Get_size()
    counts, offsets = segments(out.size, n)
    own = reduce_scatter(comm, mpi, inp, out, counts, offsets, op, chunk, shift=1)
    if finish is not None:
        finish(out[offsets[own]:offsets[own] + counts[own]])
    allgatherv(comm, mpi, out, counts, offsets, chunk, shift=1)
