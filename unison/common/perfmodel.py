"""An alpha-beta model of Unison's all-reduce algorithms, to predict scaling past one machine.

Why it exists: the benchmarks run on at most a few namespace "hosts" of one machine, but users
ask what a job of 512 ranks will do. A latency-bandwidth (Hockney) model, calibrated from links
we *can* measure and checked against collectives we can run (``benchmarks/hosts.py``), answers
that with its assumptions written down, instead of a guess.

[Note: the alpha-beta model]
Sending one message of ``s`` bytes over a link costs ``alpha + s * beta`` seconds. A cluster has
two link kinds: ``intra`` (between ranks of one host: shared memory, NVLink) and ``inter``
(between hosts: the NIC). ``gamma`` is the cost per byte of the local reduction (memory-bound on
a CPU: it reads two operands and writes one). ``c`` is Unison's piece size (``chunk_bytes``,
default 1 MiB): a transfer of ``s`` bytes is ``ceil(s / c)`` messages, each paying ``alpha``.
Notation: ``m`` bytes per rank, ``H`` hosts, ``k`` ranks per host, ``p = H k`` ranks,
``msgs(s) = ceil(s / c)``. A step of an algorithm runs on every rank at once, so its time is
that of its slowest link; ``k`` flows through one NIC share it (each sees ``k * beta_inter``)::

    host 1 (k=2)                 host 2 (k=2)
    r0 --intra-- r1 ==inter==> r2 --intra-- r3 ==inter==> back to r0      flat ring:
                                                                          1 flow per NIC
    r0 --RS--> r1 (local)        r2 --RS--> r3 (local)                    hierarchical:
    r0 <==========cross AR==========> r2   (segment 0, ranks with local rank 0)
    r1 <==========cross AR==========> r3   (segment 1)  -> k flows per NIC
    r0 --AG--> r1 (local)        r2 --AG--> r3 (local)

Flat ring (``ring``; ranks in host order, so each host's NIC carries one flow each way)::

    s = m / p;  a, b = the slower link's alpha, beta (inter when H > 1, else intra)
    T_ring = 2 (p - 1) (msgs(s) a + s b) + (p - 1) s gamma

Hierarchical (``hierarchical``: local reduce-scatter, cross-host all-reduce among the ranks of
equal local rank, local all-gather)::

    T_rs  = (k - 1) (msgs(m/k) a_l + (m/k) b_l + (m/k) gamma)
    T_x   = 2 (H - 1) (msgs_x(m/p) a_x + (m/p) k b_x) + (H - 1) (m/p) gamma  (k flows per NIC)
    T_ag  = (k - 1) (msgs(m/k) a_l + (m/k) b_l)
    T_hier = T_rs + T_x + T_ag

As in ``unison.collectives.hierarchical``, the cross-host step's pieces are not ``c`` but
``c_x``, sized to the link (``cross_piece_bytes``; by default a power of two near a quarter
millisecond of the link's rate, 64 KiB .. 4 MiB): ``msgs_x(s) = ceil(s / c_x)`` replaces
``msgs(m/p)`` in ``T_x``. The flat ring, when it spans hosts, goes in pieces of
``min(c, c_x)`` for the same reason, and its ``msgs`` counts those.

Recursive halving and doubling (``rhd``: Rabenseifner's algorithm, ``unison.collectives.rhd``;
``p' = 2^floor(log2 p)``): the halving steps exchange half of the current window with the
partner at distance ``p'/2, p'/4, ..., 1`` and reduce the half kept, the doubling steps send the
windows back. Every step is a pairwise exchange (two-way). Which steps pair ranks of different
hosts, and ``f_i``, the most ranks of one host whose partners are elsewhere (the flows sharing
its NIC), come from the kernel's own partner map (:func:`_rhd_plan`; ranks in host order: for a
power-of-two count a step at distance ``>= k`` crosses with ``k`` flows). The kernel sends pieces
of ``c`` at every step::

    s_i = m / 2^i, i = 1 .. log2 p'
    step_i = f_i > 0 ? msgs(s_i) a_x + s_i f_i b_x : msgs(s_i) a_l + s_i b_l
    T_rhd = fold + 2 sum_i step_i + (1 - 1/p') m gamma
    fold  = (p > p') ? 2 (msgs(m) a + m f b) + m gamma : 0   (pairs (2i, 2i+1), one way there and
            back; the inter link with f flows when a pair spans two hosts)

so ``2 log2 p`` latencies against the ring's ``2 (p - 1)``, and the textbook
``2 log2(p) a + 2 (p-1)/p m b + (p-1)/p m gamma`` on one link kind.

Tree (``tree``: **not an algorithm Unison runs**; NCCL's, shown for comparison: a chain inside
each host and a double binary tree across hosts, reduce then broadcast, pipelined in pieces of
``c`` bytes; each rank sends about ``2 m`` in all, like the ring, but the path is only
``D = ceil(log2 H) + (k - 1)`` hops deep)::

    T_tree = 2 (ceil(log2 H) a_x + (k - 1) a_l) + msgs(m) a + 2 m b + m gamma

[Note: two-way transfers]
In a ring of three or more, each rank sends to one neighbour and receives from the other, so each
connection carries data one way. In a ring of two (the cross-host step at ``H = 2``, the local
step at ``k = 2``), two ranks send to *each other* at once, and
on a rate-limited TCP link each direction's acknowledgements queue behind the other's data: such
a link is calibrated separately (``Link.beta_two_way_s_per_byte``) and used for those steps.

Per-bucket cost: every fused buffer (see below) also pays ``overhead`` once (the agreement between
ranks and the Python call path; 0 unless calibrated).

Bus bandwidth (nccl-tests' convention) is ``2 (p - 1) / p * m / T``; on a network-bound flat ring
it tends to ``1 / b_x``, and the hierarchical algorithm's can exceed it, since only
``2 (H - 1) / H * m`` bytes cross each NIC instead of ``2 (p - 1) / p * m``.

[Note: fusion and overlap in the step model]
A step is ``compute`` seconds of forward and backward; the backward is the last
``backward_share`` of it (default 2/3) and its gradients become ready in reverse order, evenly
spaced by tensor. Like the engine, every ``cycle`` the ready, unsent gradients go out one buffer
at a time: a tensor of at least ``min(DIRECT_BYTES, fusion_threshold)`` (1 MiB) alone, the smaller
ones packed into buffers of at most ``fusion_threshold`` bytes (:func:`fuse`). Communication
overlaps the backward; what is left after it is *exposed*::

    step = compute + exposed;    scaling efficiency = compute / step

(the throughput of p ranks over p times one rank's, which has no communication). With
``overlap=False`` every byte waits for the backward to end. Not modelled: the optimizer step,
input loading, stragglers, congestion beyond the NIC share, and contention for the host's cores.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from unison.collectives.hierarchical import piece_for_bandwidth
from unison.common.engine.executor import DIRECT_BYTES, Executor
from unison.common.files import atomic_path

__all__ = ["Link", "Cluster", "Calibration", "ALGORITHMS", "allreduce_time", "busbw_gbps",
           "fuse", "StepPrediction", "predict_step", "fit_link", "parse_rate", "parse_seconds",
           "SUSTAINED_SPAN"]

#: The modelled all-reduce algorithms; the last, ``tree``, is NCCL's, not one Unison runs (for comparison).
ALGORITHMS = ("ring", "hierarchical", "rhd", "tree")
CALIBRATION_VERSION = 1
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_FUSION_THRESHOLD = 128 << 20
DEFAULT_CYCLE_S = 1e-3
DEFAULT_BACKWARD_SHARE = 2 / 3
_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
               "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class Link:
    """One kind of link: ``alpha_s`` seconds per message, ``beta_s_per_byte`` seconds per byte.

    ``beta_two_way_s_per_byte`` is ``beta`` when two ranks send to *each other* at once (a
    ring of two): see [Note: two-way transfers]. ``None``: the same
    as ``beta``.
    """

    alpha_s: float
    beta_s_per_byte: float
    beta_two_way_s_per_byte: float | None = None

    def __post_init__(self) -> None:
        two_way = self.beta_two_way_s_per_byte
        if not (0 <= self.alpha_s < math.inf and 0 <= self.beta_s_per_byte < math.inf
                and (two_way is None or 0 <= two_way < math.inf)):
            raise ValueError(f"a link needs finite alpha >= 0 and beta >= 0; got alpha={self.alpha_s}, "
                             f"beta={self.beta_s_per_byte}, two-way beta={two_way}")

    @property
    def two_way(self) -> float:
        """Seconds per byte of a transfer whose peer sends back on the same connection at once."""
        return self.beta_s_per_byte if self.beta_two_way_s_per_byte is None else self.beta_two_way_s_per_byte

    @classmethod
    def from_rate(cls, bytes_per_s: float, latency_s: float) -> Link:
        """The link of a given bandwidth (bytes per second) and latency (seconds)."""
        if bytes_per_s <= 0:
            raise ValueError(f"link bandwidth must be positive; got {bytes_per_s} bytes/s")
        return cls(latency_s, 1.0 / bytes_per_s)

    def time(self, nbytes: float) -> float:
        """Seconds for one message of ``nbytes``."""
        return self.alpha_s + nbytes * self.beta_s_per_byte


@dataclass(frozen=True)
class Cluster:
    """``hosts`` x ``ranks_per_host`` ranks, the two link kinds, and Unison's per-byte costs.

    Attributes:
        gamma_s_per_byte: local reduction cost per byte of the buffer.
        chunk_bytes: Unison's piece size; each piece of a transfer is one message (``alpha``).
        overhead_s: fixed cost per all-reduce call (agreement, call path).
        cross_piece_bytes: the hierarchical cross-host step's piece size; 0: chosen from the
            inter link's rate as ``unison.collectives.hierarchical`` chooses it.
    """

    hosts: int
    ranks_per_host: int
    intra: Link
    inter: Link
    gamma_s_per_byte: float = 0.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    overhead_s: float = 0.0
    cross_piece_bytes: int = 0

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise ValueError(f"a cluster needs at least 1 host and 1 rank per host; got hosts="
                             f"{self.hosts}, ranks_per_host={self.ranks_per_host}")
        if not (self.chunk_bytes >= 1 and 0 <= self.gamma_s_per_byte < math.inf and 0 <= self.overhead_s < math.inf
                and self.cross_piece_bytes >= 0):  # (before 2026-12-07 an infinite or NaN gamma or overhead from a
            # calibration file passed: an OverflowError traceback, or an error naming no field)
            raise ValueError(f"chunk_bytes must be >= 1 and gamma, overhead finite and >= 0; got chunk_bytes="
                             f"{self.chunk_bytes}, gamma={self.gamma_s_per_byte}, "
                             f"overhead={self.overhead_s}, cross_piece_bytes={self.cross_piece_bytes}")

    @property
    def cross_piece(self) -> int:
        """The hierarchical cross-host step's piece size in bytes."""
        if self.cross_piece_bytes:
            return self.cross_piece_bytes
        rate = 1.0 / self.inter.beta_s_per_byte if self.inter.beta_s_per_byte > 0 else math.inf
        return piece_for_bandwidth(rate)

    @property
    def size(self) -> int:
        return self.hosts * self.ranks_per_host

    def with_ranks(self, ranks: int) -> Cluster:
        """This cluster resized to ``ranks`` (whole hosts, or one partly filled host).

        Raises:
            ValueError: ``ranks`` is not a multiple of ``ranks_per_host`` (nor below it).
        """
        if ranks <= self.ranks_per_host:
            return replace(self, hosts=1, ranks_per_host=ranks)
        if ranks % self.ranks_per_host:
            raise ValueError(f"{ranks} ranks do not fill whole hosts of {self.ranks_per_host}; "
                             f"give a multiple of {self.ranks_per_host}")
        return replace(self, hosts=ranks // self.ranks_per_host)


def _msgs(nbytes: float, chunk: int) -> int:
    return max(1, math.ceil(nbytes / chunk))


def _slowest(c: Cluster) -> Link:
    return c.inter if c.hosts > 1 else c.intra


def ring_time(m: float, c: Cluster) -> float:
    """Flat ring all-reduce of ``m`` bytes per rank (formula in the module docstring)."""
    p = c.size
    if p == 1:
        return 0.0
    s, link = m / p, _slowest(c)
    beta = link.two_way if p == 2 else link.beta_s_per_byte  # a ring of two is an exchange
    piece = min(c.chunk_bytes, c.cross_piece) if c.hosts > 1 else c.chunk_bytes
    step = _msgs(s, piece) * link.alpha_s + s * beta
    return 2 * (p - 1) * step + (p - 1) * s * c.gamma_s_per_byte


def hierarchical_time(m: float, c: Cluster) -> float:
    """Local reduce-scatter, cross-host ring all-reduce (k flows per NIC), local all-gather."""
    h, k = c.hosts, c.ranks_per_host
    if h == 1:
        return ring_time(m, c)
    local = m / k
    local_beta = c.intra.two_way if k == 2 else c.intra.beta_s_per_byte
    local_step = _msgs(local, c.chunk_bytes) * c.intra.alpha_s + local * local_beta
    t_rs = (k - 1) * (local_step + local * c.gamma_s_per_byte)
    t_ag = (k - 1) * local_step
    s = m / c.size
    reduce = (h - 1) * s * c.gamma_s_per_byte
    beta = c.inter.two_way if h == 2 else c.inter.beta_s_per_byte
    cross_step = _msgs(s, c.cross_piece) * c.inter.alpha_s + s * k * beta
    return t_rs + 2 * (h - 1) * cross_step + reduce + t_ag


@functools.lru_cache(maxsize=256)
def _rhd_plan(n: int, k: int) -> tuple[int, tuple[int, ...]]:
    """For :func:`rhd_time`: the most ranks of one host whose partner is on another host (0: the step
    stays inside hosts), for the fold and for each halving step (largest mask first), from the kernel's
    own partner map (``unison.collectives.rhd``: the first ``2 (n - p)`` ranks fold in pairs
    ``(2i, 2i+1)``, virtual rank ``v`` is real rank ``2v+1`` below ``n - p``, ``v + n - p`` above)."""
    p = 1 << (n.bit_length() - 1)
    rem = n - p

    def real(v: int) -> int:
        return 2 * v + 1 if v < rem else v + rem

    def busiest(pairs: list[tuple[int, int]]) -> int:
        out: dict[int, int] = {}
        for a, b in pairs:
            if a // k != b // k:
                out[a // k] = out.get(a // k, 0) + 1
        return max(out.values(), default=0)

    fold = busiest([(2 * i, 2 * i + 1) for i in range(rem)])
    steps = []
    mask = p >> 1
    while mask:
        steps.append(busiest([(real(v), real(v ^ mask)) for v in range(p)]))
        mask >>= 1
    return fold, tuple(steps)


def rhd_time(m: float, c: Cluster) -> float:
    """Recursive halving and doubling, with the fold of a non-power-of-two count (module docstring).

    Which steps cross hosts, and how many flows share a NIC, come from the kernel's partner map
    (:func:`_rhd_plan`); before 2026-12-05 a step crossed when its distance was at least ``k``,
    which held only for power-of-two counts (2 hosts x 3 ranks came out 10x too fast, below what
    the link can carry). Every message is one of the kernel's pieces (``chunk_bytes``: it does not
    size them to the link as the ring and the hierarchical step do).
    """
    n = c.size
    if n == 1:
        return 0.0
    p = 1 << (n.bit_length() - 1)
    fold_flows, step_flows = _rhd_plan(n, c.ranks_per_host)
    chunk = c.chunk_bytes
    t = 0.0
    if n > p:  # the first 2 (n - p) ranks hand their data to a neighbour and get the result back (one-way)
        if fold_flows:
            one = _msgs(m, chunk) * c.inter.alpha_s + m * fold_flows * c.inter.beta_s_per_byte
        else:
            one = _msgs(m, chunk) * c.intra.alpha_s + m * c.intra.beta_s_per_byte
        t += 2 * one + m * c.gamma_s_per_byte
    s, steps = float(m), 0.0
    for flows in step_flows:  # each an exchange: both directions at once (two-way)
        s /= 2
        if flows:
            steps += _msgs(s, chunk) * c.inter.alpha_s + s * flows * c.inter.two_way
        else:
            steps += _msgs(s, chunk) * c.intra.alpha_s + s * c.intra.two_way
    return t + 2 * steps + (1 - 1 / p) * m * c.gamma_s_per_byte


def tree_time(m: float, c: Cluster) -> float:
    """Chain within hosts, double binary tree across them, pipelined (module docstring)."""
    if c.size == 1:
        return 0.0
    h, k = c.hosts, c.ranks_per_host
    link = _slowest(c)
    depth = 2 * (math.ceil(math.log2(h)) * c.inter.alpha_s + (k - 1) * c.intra.alpha_s)
    return (depth + _msgs(m, c.chunk_bytes) * link.alpha_s + 2 * m * link.beta_s_per_byte
            + m * c.gamma_s_per_byte)


_TIMES: dict[str, Callable[[float, Cluster], float]] = {
    "ring": ring_time, "hierarchical": hierarchical_time, "rhd": rhd_time, "tree": tree_time}


def allreduce_time(algorithm: str, nbytes: float, cluster: Cluster) -> float:
    """Predicted seconds of one all-reduce of ``nbytes`` per rank, its call overhead included.

    Raises:
        ValueError: an unknown algorithm or a negative size.
    """
    if algorithm not in _TIMES:
        raise ValueError(f"algorithm {algorithm!r} is not modelled; choose from {', '.join(ALGORITHMS)}")
    if not 0 <= nbytes < math.inf:  # (NaN reached int() before 2026-12-07: an error naming no argument)
        raise ValueError(f"nbytes must be a finite number >= 0; got {nbytes}")
    if nbytes == 0 or cluster.size == 1:
        return 0.0
    return cluster.overhead_s + _TIMES[algorithm](nbytes, cluster)


def busbw_gbps(nbytes: float, ranks: int, seconds: float) -> float:
    """nccl-tests' all-reduce bus bandwidth, GB/s (1e9 bytes)."""
    return 2 * (ranks - 1) / ranks * nbytes / seconds / 1e9 if seconds > 0 else math.inf


# --- fusion and the training step -------------------------------------------------------------


def fuse(sizes: Sequence[int], ready: Sequence[float], threshold: int, cycle_s: float,
         run: Callable[[int], float], direct_bytes: int = DIRECT_BYTES) -> tuple[list[int], float]:
    """Simulates the engine: each cycle, the tensors ready by then go as the executor sends them,
    one buffer at a time.

    As in ``Executor`` ([Note: fusion buffer] in unison/common/engine/executor.py), a tensor of at
    least ``min(direct_bytes, threshold)`` bytes is all-reduced alone, straight into its result, and
    the smaller ones are packed into buffers of at most ``threshold`` bytes (``Executor._batches``),
    the packed run taking the place of its first member. Before 2026-12-05 this packed every tensor
    (ResNet-50 as one buffer where the engine sends 30: 29 of its tensors are 1 MiB or more), which
    put each buffer's latency, 2 (p - 1) alphas on the ring, into the step once instead of 30 times.

    Args:
        sizes: bytes of each tensor, in the order they become ready.
        ready: when each is ready (seconds, non-decreasing).
        threshold: most bytes per fused buffer (0: no fusion, one tensor per buffer).
        cycle_s: the engine's cycle; a cycle's buffers start at a cycle boundary.
        run: seconds to all-reduce one buffer of the given size.
        direct_bytes: the executor's ``DIRECT_BYTES``.

    Returns:
        The buffer sizes, and when the last one finishes.
    """
    alone = min(direct_bytes, threshold)
    buffers: list[int] = []
    free, i, n = 0.0, 0, len(sizes)
    while i < n:
        start = max(free, ready[i])
        if cycle_s > 0:
            start = math.ceil(start / cycle_s - 1e-9) * cycle_s
        j = i + 1
        while j < n and ready[j] <= start:
            j += 1
        cycle: list[int | None] = []  # None: where the packed run goes (its first member's place)
        small: list[int] = []
        for size in sizes[i:j]:
            if size < alone:
                if not small:
                    cycle.append(None)
                small.append(size)
            else:
                cycle.append(size)
        packed = [sum(small[a:b]) for a, b in Executor._batches(small, threshold)] if small else []
        for item in cycle:
            for size in (packed if item is None else [item]):
                buffers.append(size)
                start += run(size)
        free, i = start, j
    return buffers, free


@dataclass(frozen=True)
class StepPrediction:
    """One algorithm at one cluster size: communication, exposure and efficiency of a step."""

    algorithm: str
    ranks: int
    hosts: int
    buffers: int
    comm_s: float
    exposed_s: float
    step_s: float
    efficiency: float


def predict_step(algorithm: str, tensor_bytes: Sequence[int], cluster: Cluster, compute_s: float,
                 fusion_threshold: int = DEFAULT_FUSION_THRESHOLD, cycle_s: float = DEFAULT_CYCLE_S,
                 backward_share: float = DEFAULT_BACKWARD_SHARE, overlap: bool = True) -> StepPrediction:
    """Predicts one training step (see [Note: fusion and overlap in the step model]).

    Args:
        algorithm: one of :data:`ALGORITHMS`.
        tensor_bytes: gradient sizes in bytes, in forward (parameter) order.
        cluster: the cluster.
        compute_s: forward + backward seconds of one rank, without communication.
        fusion_threshold, cycle_s: the engine's fusion settings.
        backward_share: the share of ``compute_s`` that is the backward pass.
        overlap: whether communication may start during the backward.

    Raises:
        ValueError: a non-positive compute time or a backward share outside (0, 1].
    """
    if not 0 < compute_s < math.inf or not 0 < backward_share <= 1:  # (NaN and inf passed before 2026-12-07)
        raise ValueError(f"compute_s must be > 0 and backward_share in (0, 1]; got compute_s="
                         f"{compute_s}, backward_share={backward_share}")
    sizes = list(reversed(tensor_bytes))
    backward = compute_s * backward_share
    n = len(sizes)
    ready = [backward * (i + 1) / n for i in range(n)] if overlap else [backward] * n
    buffers, done = fuse(sizes, ready, fusion_threshold, cycle_s,
                         lambda b: allreduce_time(algorithm, b, cluster))
    comm = sum(allreduce_time(algorithm, b, cluster) for b in buffers)
    exposed = max(0.0, done - backward) if cluster.size > 1 else 0.0
    step = compute_s + exposed
    return StepPrediction(algorithm, cluster.size, cluster.hosts, len(buffers), comm, exposed, step,
                          compute_s / step)


# --- calibration ------------------------------------------------------------------------------


#: points within this factor of the largest transfer set the sustained rate (see fit_link)
SUSTAINED_SPAN = 16


def fit_link(points: Sequence[Sequence[float]]) -> Link:
    """Fits ``time = alpha * messages + beta * bytes`` to measured points.

    Each point is ``(bytes, seconds)`` (one message) or ``(bytes, seconds, messages)`` for a
    transfer sent as several pieces. Two stages:

    1. ``alpha``: least squares on *relative* error over all points (each residual divided by
       its time, so that a 4 KiB point counts as much as a 16 MiB one), kept non-negative.
    2. ``beta``: the sustained rate, fitted to absolute time (``alpha`` per message taken off)
       over the transfers within :data:`SUSTAINED_SPAN` of the largest. Small transfers can run
       ahead of it: a rate limiter's burst allowance (``tc``'s token bucket lets 64 KiB through
       at 3-4x a 1 Gbit/s link's rate), a socket buffer that absorbs them; a relative fit then
       promises large transfers a rate they never see. Without such effects both stages agree.

    Raises:
        ValueError: fewer than two distinct sizes, or a non-positive time or message count.
    """
    rows = [list(p) + [1.0] * (3 - len(p)) for p in points]
    pts = np.asarray(rows, dtype=np.float64).reshape(-1, 3)
    if len(np.unique(pts[:, 0])) < 2 or (pts[:, 1] <= 0).any() or (pts[:, 0] < 0).any() \
            or (pts[:, 2] < 1).any():
        raise ValueError(f"fitting alpha and beta needs points at two or more sizes, bytes >= 0, "
                         f"times > 0 and messages >= 1; got {pts.tolist()}")
    b, t, k = pts[:, 0], pts[:, 1], pts[:, 2]
    design = np.stack([k / t, b / t], axis=1)
    (alpha, _), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    alpha = max(0.0, float(alpha))
    big = b * SUSTAINED_SPAN >= b.max()
    beta = float(np.sum(b[big] * (t[big] - alpha * k[big])) / np.sum(b[big] ** 2))
    if beta < 0:  # alpha alone over-explains the large transfers: a bandwidth-free link
        alpha, beta = float(np.sum(k / t) / np.sum((k / t) ** 2)), 0.0
    return Link(alpha, beta)


@dataclass
class Calibration:
    """Fitted link and cost parameters, kept as JSON next to the points they came from."""

    intra: Link
    inter: Link
    gamma_s_per_byte: float = 0.0
    overhead_s: float = 0.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    points: dict[str, list[list[float]]] = field(default_factory=dict)
    notes: str = ""
    cross_piece_bytes: int = 0

    @classmethod
    def fit(cls, intra: Sequence[Sequence[float]], inter: Sequence[Sequence[float]],
            reduce: Sequence[Sequence[float]] = (), inter_two_way: Sequence[Sequence[float]] = (),
            inter_flows: int = 1, two_way_flows: int | None = None, **kwargs: Any) -> Calibration:
        """Fits both links (points as :func:`fit_link` takes them) and ``gamma``.

        Args:
            intra, inter: transfer points within a host and across hosts (one-way connections).
            reduce: ``(bytes, seconds)`` of local reductions; ``gamma`` is their slope.
            inter_two_way: optional cross-host points of two ranks sending to each other.
            inter_flows: how many flows shared each host's link each way while ``inter`` was
                measured; the link's own ``beta`` is the per-flow one divided by this.
            two_way_flows: the same for ``inter_two_way`` (default: ``inter_flows``).
            kwargs: the other fields (``overhead_s``, ``chunk_bytes``, ``notes``,
                ``cross_piece_bytes``: the cross-host piece the collectives used, 0 = from the
                fitted rate).
        """
        two_way_flows = inter_flows if two_way_flows is None else two_way_flows
        if inter_flows < 1 or two_way_flows < 1:
            raise ValueError(f"inter_flows and two_way_flows must be >= 1; got {inter_flows} and "
                             f"{two_way_flows}")
        gamma = fit_link(reduce).beta_s_per_byte if len(reduce) else 0.0
        pts = {"intra": [list(p) for p in intra], "inter": [list(p) for p in inter],
               "inter_two_way": [list(p) for p in inter_two_way], "reduce": [list(p) for p in reduce]}
        one = fit_link(inter)
        two = fit_link(inter_two_way).beta_s_per_byte / two_way_flows if len(inter_two_way) else None
        link = Link(one.alpha_s, one.beta_s_per_byte / inter_flows, two)
        return cls(fit_link(intra), link, gamma, points=pts, **kwargs)

    def cluster(self, hosts: int, ranks_per_host: int) -> Cluster:
        return Cluster(hosts, ranks_per_host, self.intra, self.inter, self.gamma_s_per_byte,
                       self.chunk_bytes, self.overhead_s, self.cross_piece_bytes)

    def save(self, path: str | Path) -> None:
        data = {"version": CALIBRATION_VERSION, **asdict(self)}
        with atomic_path(path) as tmp:  # a reader never sees half a file
            Path(tmp).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Reads a file written by :meth:`save`.

        Raises:
            ValueError: the file is not a calibration of this version.
        """
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON ({exc}); write it with Calibration.save or {_WRITER}") from None
        if not isinstance(data, dict) or data.get("version") != CALIBRATION_VERSION:
            got = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{path} is not a Unison calibration file of version "
                             f"{CALIBRATION_VERSION} (found version {got!r}); write it with "
                             f"Calibration.save or {_WRITER}")
        data.pop("version")
        _check_numbers(path, data)
        try:
            return cls(intra=Link(**data.pop("intra")), inter=Link(**data.pop("inter")), **data)
        except (TypeError, KeyError) as exc:  # (a missing link was a KeyError traceback)
            raise ValueError(f"{path}: malformed calibration (missing or unexpected {exc}); write it with "
                             f"Calibration.save or {_WRITER}") from None


#: what writes a calibration file (named in the errors about one)
_WRITER = "benchmarks/hosts.py --json OUT.json (which writes OUT.calibration-<link>.json)"


def _check_numbers(path: str | Path, data: dict[str, Any]) -> None:
    """A calibration file's numeric fields are finite numbers >= 0 (a string there was a TypeError traceback;
    before 2026-12-07 JSON's ``Infinity`` or ``NaN`` passed, to an OverflowError traceback or an error
    naming no field)."""
    def number(where: str, value: Any, integer: bool = False, optional: bool = False, least: int = 0) -> None:
        # (null only where the format allows it: before 2026-12-07 any null passed here, to a TypeError traceback
        # later, and chunk_bytes 0 to an error naming no file)
        if value is None and optional:
            return
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not least <= value < math.inf:
            raise ValueError(f"{path}: {where} must be {'an integer' if integer else 'a finite number'} "
                             f">= {least}; got {value!r}; write the file with Calibration.save or {_WRITER}")

    for kind in ("intra", "inter"):
        link = data.get(kind)
        if isinstance(link, dict):
            for key, value in link.items():
                number(f"{kind}.{key}", value, optional=key == "beta_two_way_s_per_byte")
    for key in ("gamma_s_per_byte", "overhead_s"):
        if key in data:
            number(key, data[key])
    for key in ("chunk_bytes", "cross_piece_bytes"):
        if key in data:
            number(key, data[key], integer=True, least=1 if key == "chunk_bytes" else 0)


def parse_rate(text: str) -> float:
    """``"100gbit"`` -> bytes per second (``bit``/``kbit``/``mbit``/``gbit``, or ``...bps`` bytes).

    Raises:
        ValueError: not a rate.
    """
    s = text.strip().lower()
    for unit in sorted(_RATE_UNITS, key=len, reverse=True):
        if s.endswith(unit):
            try:
                value = float(s[:-len(unit)])
            except ValueError:
                break
            rate = value * _RATE_UNITS[unit]
            if 0 < rate < math.inf and 1 / rate < math.inf:  # (a model works with 1 / rate)
                return rate
            break
    raise ValueError(f"{text!r} is not a link rate; give a finite positive one, e.g. 100gbit, 25gbit or "
                     "12.5gbps (bytes)")


def parse_seconds(text: str) -> float:
    """``"5us"`` -> 5e-6 (units ``s``, ``ms``, ``us``, ``ns``).

    Raises:
        ValueError: not a duration.
    """
    s = text.strip().lower()
    for unit in sorted(_TIME_UNITS, key=len, reverse=True):
        if s.endswith(unit):
            try:
                value = float(s[:-len(unit)])
            except ValueError:
                break
            if 0 <= value * _TIME_UNITS[unit] < math.inf:
                return value * _TIME_UNITS[unit]
            break
    raise ValueError(f"{text!r} is not a duration; give a finite one >= 0, e.g. 5us, 1.5ms or 0s")
