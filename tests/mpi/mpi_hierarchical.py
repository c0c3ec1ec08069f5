"""Topology, hierarchical and host-ordered algorithms, and the deterministic mode, under mpirun.

Hosts are simulated on one machine: the test builds a communicator's topology with
``topology.build(comm, MPI, host_of)`` (ranks ``r // 2`` or ``r % 2`` on one "host") and
attaches it, so the kernels run their cross-host paths at 1-4 ranks anywhere. Run
across real test hosts (``unison.run.testhosts``) the ``real`` layout is the hosts'.
References are numpy, rebuilt on each rank from every rank's inputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import unison
from unison import collectives as C
from unison.collectives import hierarchical, kernels, native, ordered, ring, select, topology
from unison.common.engine import frontend
from unison.common.ops import ReduceOp
from unison.common.runtime import state

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
#: simulated layouts: a rank's host key (None: the machine's real hosts)
LAYOUTS = {"real": None, "block": lambda r: r // 2, "roundrobin": lambda r: r % 2}
SIZES = [1, 3, 1001, 70_001]  # fewer elements than ranks, odd, > 1 chunk with small chunks
CHUNK = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _unison_session():
    unison.init()
    yield
    unison.shutdown()


@pytest.fixture(scope="module")
def comms():
    """One communicator per layout, with its (simulated) topology attached."""
    made = {}
    for name, host_of in LAYOUTS.items():
        comm = WORLD.Dup()
        if host_of is not None:
            topology.attach(comm, MPI, topology.build(comm, MPI, host_of))
        made[name] = comm
    yield made
    for comm in made.values():
        comm.Free()


def digest_everywhere(arr: np.ndarray) -> None:
    digest = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    assert len(set(WORLD.allgather(digest))) == 1, "results differ between ranks"


def make(rank: int, n: int, dtype: np.dtype, seed: int, exact: bool = True) -> np.ndarray:
    """Small integers (exact sums in any order) or wide-ranging floats (order shows in the bits)."""
    rng = np.random.default_rng([seed, rank])
    if exact or not np.issubdtype(np.dtype(dtype), np.floating) and dtype != BF16:
        return rng.integers(-3, 4, size=n).astype(dtype)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, size=n)).astype(dtype)


def fold(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Rank-order reference in the inputs' dtype: ((x0 op x1) op x2) ..."""
    f = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum,
         ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}[op]
    out = inputs[0].copy()
    for x in inputs[1:]:
        out = f(out, x).astype(inputs[0].dtype)
    return out


def reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    stack = np.stack([x.astype(np.float64) for x in inputs])
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        out = stack.sum(axis=0)
        return out / len(inputs) if op is ReduceOp.AVERAGE else out
    return {ReduceOp.MIN: np.min, ReduceOp.MAX: np.max, ReduceOp.PRODUCT: np.prod}[op](stack, axis=0)


def run_allreduce(comm, x: np.ndarray, op: ReduceOp, algorithm: str, pre: float = 1.0, post: float = 1.0,
                  chunk: int = CHUNK, **kw) -> np.ndarray:
    out = np.empty_like(x)
    kernels.allreduce(comm, MPI, x, out, op, pre, post, algorithm, chunk, **kw)
    return out


# ------------------------------------------------------------------ topology

def test_topology_of_the_real_hosts(comms):
    topo = topology.of(comms["real"], MPI)
    assert topology.of(comms["real"], MPI) is topo  # cached on the communicator
    assert (topo.local_size, topo.local_rank) == (unison.local_size(), unison.local_rank())
    assert (topo.cross_size, topo.cross_rank) == (unison.cross_size(), unison.cross_rank())
    assert sum(topo.local_sizes) == N and topo.host_order[0] == 0
    everyone = WORLD.allgather((MPI.Get_processor_name(), topo.hosts[R], topo.local_rank))
    for name, host, _ in everyone:  # same processor name <=> same host index
        assert [h for nm, h, _ in everyone if nm == name] == [host] * sum(nm == name for nm, _, _ in everyone)
    assert sorted(lr for _, h, lr in everyone if h == topo.hosts[R]) == list(range(topo.local_size))


@pytest.mark.parametrize("layout", ["block", "roundrobin"])
def test_topology_of_simulated_hosts(comms, layout):
    topo = topology.of(comms[layout], MPI)
    key = LAYOUTS[layout]
    keys = sorted({key(r) for r in range(N)}, key=lambda k: min(r for r in range(N) if key(r) == k))
    assert topo.hosts == tuple(keys.index(key(r)) for r in range(N))
    assert topo.local_ranks == tuple(sum(key(q) == key(r) for q in range(r)) for r in range(N))
    assert topo.num_hosts == len(keys) and topo.spans_hosts == (len(keys) > 1)
    assert topo.homogeneous == (len({sum(key(r) == k for r in range(N)) for k in keys}) == 1)
    assert topo.host_order == tuple(sorted(range(N), key=lambda r: (topo.hosts[r], topo.local_ranks[r])))
    assert topo.ring.Get_rank() == topo.host_order.index(R)
    assert topo.cross.Get_size() == len(topo.members(topo.local_rank))
    assert topo.members(topo.local_rank)[topo.cross_rank] == R
    assert WORLD.allgather(topo.host_order) == [topo.host_order] * N


def test_topology_is_freed_with_its_communicator():
    comm = WORLD.Dup()
    topo = topology.build(comm, MPI, LAYOUTS["block"])
    topology.attach(comm, MPI, topo)
    made = list(topo.owned)
    comm.Free()
    assert topo.owned == [] and all(c == MPI.COMM_NULL for c in made)


# ------------------------------------------------------------------ selection (one process)

class FakeTopo:
    def __init__(self, hosts: int, rate: float | None = None) -> None:
        self.spans_hosts, self.num_hosts = hosts > 1, hosts
        self.cross_rate = rate


def test_auto_picks_by_topology_and_size():
    one, two = FakeTopo(1), FakeTopo(2)
    big, small = 64 << 20, 64 << 10
    assert select.choose_allreduce("auto", big, 4, one) == "ring"
    assert select.choose_allreduce("auto", small, 4, one) == "mpi"
    assert select.choose_allreduce("auto", big, 4, two) == "hierarchical"
    assert select.choose_allreduce("auto", select.HIER_MIN_BYTES - 1, 4, two) == "mpi"
    fast, slow = FakeTopo(2, 2 * select.SLOW_LINK_BYTES_PER_S), FakeTopo(2, select.SLOW_LINK_BYTES_PER_S / 4)
    assert select.choose_allreduce("auto", big, 4, fast) == "hierarchical"
    assert select.choose_allreduce("auto", big, 4, slow) == "mpi"  # the link, not the cores, is the limit
    # from 3 hosts on MPI's call took 1.8-3.1x the ring's time on a slow link (docs/collectives.md, "Many hosts")
    slow3 = FakeTopo(3, select.SLOW_LINK_BYTES_PER_S / 4)
    assert select.choose_allreduce("auto", big, 6, slow3) == "ring"
    assert select.choose_allreduce("auto", select.HIER_MIN_BYTES - 1, 6, slow3) == "mpi"
    assert select.choose_allreduce("auto", small, 4, slow, force=True) == "hierarchical"
    assert select.choose_allreduce("hierarchical", big, 4, slow) == "hierarchical"
    assert select.choose_allreduce("auto", small, 4, two, force=True) == "hierarchical"
    assert select.choose_allreduce("auto", small, 4, one, force=True) == "mpi"  # one host: no effect
    assert select.choose_allreduce("ring", big, 4, two, force=True) == "ring"  # a named algorithm wins
    assert select.choose_simple("allgather", "mpi", small, 4, two, force=True) == "mpi"  # not auto
    assert select.choose_simple("allgather", "auto", small, 4, two, force=True) == "hierarchical"
    assert select.choose_simple("broadcast", "auto", big, 4, two, force=True) == "hierarchical"
    assert select.choose_simple("broadcast", "auto", big, 4, one, force=True) == "mpi"
    assert select.choose_simple("broadcast", "auto", small, 4, two) == "hierarchical"
    assert select.choose_simple("allgather", "auto", select.HIER_SIMPLE_MIN_BYTES - 1, 4, two) == "mpi"
    assert select.choose_simple("reducescatter", "auto", small, 4, two) == "ordered"  # the direct algorithm
    assert select.choose_simple("reducescatter", "auto", big, 4, one) == "ring"
    assert select.choose_simple("alltoall", "auto", big, 4, two) == "mpi"


# ------------------------------------------------------------------ hierarchical all-reduce

@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", FLOATS + [np.dtype(np.int32), np.dtype(np.int8), np.dtype(np.bool_)], ids=str)
def test_hierarchical_allreduce_every_op(comms, layout, dtype):
    comm = comms[layout]
    for op in OPS:
        if dtype == np.bool_ and op is ReduceOp.AVERAGE:
            continue
        for i, n in enumerate(SIZES):
            inputs = [make(r, n, dtype, 100 + i) for r in range(N)]
            if dtype == np.bool_:
                inputs = [x > 0 for x in inputs]
            got = run_allreduce(comm, inputs[R], op, "hierarchical")
            digest_everywhere(got)
            if dtype == np.bool_:
                want = np.any(inputs, axis=0) if op in (ReduceOp.SUM, ReduceOp.MAX) else np.all(inputs, axis=0)
                np.testing.assert_array_equal(got, want)
                continue
            want = reference(inputs, op)
            if op is ReduceOp.AVERAGE and dtype.kind in "iu":
                want = np.trunc(want)
            exact = not (op is ReduceOp.AVERAGE and dtype in FLOATS and N not in (1, 2, 4))
            if exact:
                np.testing.assert_array_equal(got.astype(np.float64), want)
                ring = run_allreduce(comm, inputs[R], op, "ring")  # exact maths: the same bits
                assert got.tobytes() == ring.tobytes()
            else:
                np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [np.dtype(np.int64), np.dtype(np.uint8), np.dtype(np.int8), np.dtype(np.bool_)],
                         ids=str)
def test_hierarchical_allreduce_bitwise(comms, layout, dtype):
    """Band/Bor/Bxor through the hierarchical algorithm (its local reduce-scatter, cross-host all-reduce and
    local all-gather) over every bit pattern of the dtype, against numpy, the same bits on every rank."""
    comm = comms[layout]
    ops = {ReduceOp.BAND: (np.bitwise_and, np.logical_and), ReduceOp.BOR: (np.bitwise_or, np.logical_or),
           ReduceOp.BXOR: (np.bitwise_xor, np.logical_xor)}
    for op, fns in ops.items():
        for i, n in enumerate(SIZES):
            rngs = [np.random.default_rng([88 + i, r]) for r in range(N)]
            if dtype == np.bool_:
                inputs = [g.integers(0, 2, size=n).astype(bool) for g in rngs]
            else:
                info = np.iinfo(dtype)
                inputs = [g.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True) for g in rngs]
            got = run_allreduce(comm, inputs[R], op, "hierarchical")
            digest_everywhere(got)
            want = inputs[0]
            for other in inputs[1:]:
                want = fns[1 if dtype == np.bool_ else 0](want, other)
            assert got.dtype == dtype
            np.testing.assert_array_equal(got, want, err_msg=f"{op} n={n}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hierarchical_allreduce_inexact_floats_and_scaling(comms, layout):
    comm = comms[layout]
    for dtype, rtol in [(np.dtype(np.float32), 1e-5), (np.dtype(np.float64), 1e-12), (BF16, 2e-2)]:
        for n in (5, 20_001):
            inputs = [make(r, n, dtype, 7, exact=False) for r in range(N)]
            for op, pre, post in [(ReduceOp.SUM, 1.0, 1.0), (ReduceOp.AVERAGE, 0.5, 3.0),
                                  (ReduceOp.SUM, 2.0, 0.25)]:
                got = run_allreduce(comm, inputs[R], op, "hierarchical", pre, post, chunk=4000)
                digest_everywhere(got)
                want = reference([x.astype(np.float64) * pre for x in inputs], op) * post
                scale = np.abs(np.stack([x.astype(np.float64) for x in inputs])).sum(axis=0) * abs(pre * post)
                assert np.all(np.abs(got.astype(np.float64) - want) <= rtol * scale + 1e-30)


def test_hierarchical_integer_average_and_in_place(comms):
    for layout in LAYOUTS:
        comm = comms[layout]
        inputs = [np.full(5000, 60 + 20 * r, np.int8) for r in range(N)]  # sums overflow int8
        got = run_allreduce(comm, inputs[R], ReduceOp.AVERAGE, "hierarchical")
        np.testing.assert_array_equal(got, np.full(5000, int(sum(60 + 20 * r for r in range(N)) / N)))
        buf = make(R, 3001, np.dtype(np.float32), 9)
        kernels.allreduce(comm, MPI, buf, buf, ReduceOp.SUM, 1.0, 1.0, "hierarchical", 1000)
        np.testing.assert_array_equal(buf, sum(make(r, 3001, np.dtype(np.float32), 9) for r in range(N)))


def test_non_homogeneous_layout_falls_back_to_the_ring_and_says_so(caplog):
    if N < 3 or N % 2 == 0:
        pytest.skip("needs a host with fewer ranks (3 ranks: hosts of 2 and 1)")
    comm = WORLD.Dup()  # a fresh topology: the fallback is logged once per communicator
    topology.attach(comm, MPI, topology.build(comm, MPI, LAYOUTS["block"]))
    assert not topology.of(comm, MPI).homogeneous
    inputs = [make(r, 10_001, np.dtype(np.float32), 3, exact=False) for r in range(N)]
    with caplog.at_level(logging.INFO, logger="unison.collectives.topology"):
        got = run_allreduce(comm, inputs[R], ReduceOp.SUM, "hierarchical")
        again = run_allreduce(comm, inputs[R], ReduceOp.SUM, "hierarchical")
    ring = run_allreduce(comm, inputs[R], ReduceOp.SUM, "ring")
    comm.Free()
    assert got.tobytes() == ring.tobytes() == again.tobytes()
    lines = [r.getMessage() for r in caplog.records if "same number of ranks" in r.getMessage()]
    assert len(lines) == 1 and "[2, 1] ranks per host" in lines[0], lines


def test_piece_for_bandwidth_is_a_bounded_power_of_two():
    assert hierarchical.piece_for_bandwidth(125e6) == hierarchical.PIECE_MIN_BYTES  # 1 Gbit/s: 31 KB -> 64 KiB
    assert hierarchical.piece_for_bandwidth(1e9) == 256 << 10  # 250 KB -> 256 KiB
    assert hierarchical.piece_for_bandwidth(3.125e9) == 1 << 20  # 25 Gbit/s: 781 KB -> 1 MiB
    assert hierarchical.piece_for_bandwidth(1e12) == hierarchical.PIECE_MAX_BYTES
    assert hierarchical.piece_for_bandwidth(float("inf")) == hierarchical.PIECE_MAX_BYTES
    for bad in (0.0, -1.0, float("nan")):
        assert hierarchical.piece_for_bandwidth(bad) == hierarchical.PIECE_MIN_BYTES


def test_cross_piece_is_measured_once_agreed_and_overridable(comms, monkeypatch):
    """The link is probed at the first hierarchical all-reduce of a communicator, every rank takes
    the same piece size, later calls reuse it, and ``UNISON_CROSS_PIECE_BYTES`` cuts the pieces."""
    from unison.collectives import ring

    probes, pieces = [], []
    real_probe, real_ring = hierarchical._probe, ring.allreduce
    monkeypatch.setattr(hierarchical, "_probe", lambda *a: (probes.append(1), real_probe(*a))[1])
    monkeypatch.setattr(ring, "allreduce", lambda comm, mpi, i, o, op, chunk, *a: (
        pieces.append(chunk), real_ring(comm, mpi, i, o, op, chunk, *a)))
    for layout in ("block", "roundrobin", "real"):
        comm = WORLD.Dup()  # a fresh topology: nothing measured yet
        if LAYOUTS[layout] is not None:
            topology.attach(comm, MPI, topology.build(comm, MPI, LAYOUTS[layout]))
        topo = topology.of(comm, MPI)
        probes.clear(), pieces.clear()
        inputs = [make(r, 50_001, np.dtype(np.float64), 4) for r in range(N)]
        for _ in range(2):
            got = run_allreduce(comm, inputs[R], ReduceOp.SUM, "hierarchical")
            np.testing.assert_array_equal(got, reference(inputs, ReduceOp.SUM))
        if not topo.spans_hosts:
            assert topo.cross_rate is None and not probes, layout
            comm.Free()
            continue
        assert len(set(WORLD.allgather(topo.cross_rate))) == 1 and 0 < topo.cross_rate < math.inf, layout
        assert len(probes) == (1 if topo.cross_size > 1 else 0), layout  # every rank with a peer, once
        piece = hierarchical.piece_for_bandwidth(topo.cross_rate)
        assert hierarchical.PIECE_MIN_BYTES <= piece <= hierarchical.PIECE_MAX_BYTES and piece & (piece - 1) == 0
        if topo.homogeneous:
            assert pieces == [piece // 8] * 2, layout
        else:  # the ring runs instead, in pieces no larger than the link's
            assert pieces == [min(CHUNK, piece) // 8] * 2, layout
        pieces.clear()
        with reinit(cross_piece_bytes=1000):  # not a multiple of 8: 125 float64s a message
            got = run_allreduce(comm, inputs[R], ReduceOp.SUM, "hierarchical")
            np.testing.assert_array_equal(got, reference(inputs, ReduceOp.SUM))
            assert pieces == [125] and len(probes) <= 1, layout
            got = run_allreduce(comm, inputs[R], ReduceOp.SUM, "ring")  # the flat ring across hosts too
            np.testing.assert_array_equal(got, reference(inputs, ReduceOp.SUM))
            assert pieces == [125, 125], layout
            # the hierarchical all-gather and broadcast cross hosts in the same pieces: 1000-byte
            # messages of blocks of unequal, odd sizes
            blocks = [np.arange(2500 + 7 * q, dtype=np.uint8) + q for q in range(N)]
            out = np.empty(sum(b.size for b in blocks), np.uint8)
            kernels.allgatherv(comm, MPI, blocks[R], out, [b.size for b in blocks], "hierarchical", CHUNK)
            np.testing.assert_array_equal(out, np.concatenate(blocks))
            for root in range(N):
                buf = blocks[root].copy() if R == root else np.zeros(blocks[root].size, np.uint8)
                kernels.broadcast(comm, MPI, buf, root, "hierarchical", CHUNK)
                np.testing.assert_array_equal(buf, blocks[root])
        comm.Free()


def test_auto_across_hosts_measures_the_link_and_uses_mpi_on_a_slow_one(comms, monkeypatch):
    calls = []
    monkeypatch.setattr(hierarchical, "allreduce", lambda *a, **k: calls.append("hierarchical"))
    real_native = kernels.native.allreduce
    monkeypatch.setattr(kernels.native, "allreduce", lambda *a, **k: (calls.append("mpi"), real_native(*a, **k)))
    x = make(R, (1 << 20) // 4, np.dtype(np.float32), 2)  # 1 MiB: above HIER_MIN_BYTES
    for layout in ("block", "roundrobin"):
        comm = WORLD.Dup()
        topo = topology.build(comm, MPI, LAYOUTS[layout])
        topology.attach(comm, MPI, topo)
        if not (topo.spans_hosts and topo.homogeneous):
            comm.Free()
            continue
        run_allreduce(comm, x, ReduceOp.SUM, "mpi")  # a named algorithm measures nothing
        assert topo.cross_rate is None
        calls.clear()
        run_allreduce(comm, x, ReduceOp.SUM, "auto")
        assert topo.cross_rate is not None  # measured, the same on every rank
        assert len(set(WORLD.allgather(topo.cross_rate))) == 1
        want = "mpi" if topo.cross_rate < select.SLOW_LINK_BYTES_PER_S else "hierarchical"
        assert calls == [want], layout
        topo.cross_rate = select.SLOW_LINK_BYTES_PER_S / 10  # as if the hosts were 1 Gbit/s apart
        calls.clear()
        got = run_allreduce(comm, x, ReduceOp.SUM, "auto")
        assert calls == ["mpi"], layout
        np.testing.assert_array_equal(got, sum(make(r, x.size, np.dtype(np.float32), 2) for r in range(N)))
        comm.Free()


def test_forced_hierarchical_only_when_the_job_spans_hosts(comms, monkeypatch):
    calls = []
    real = hierarchical.allreduce
    monkeypatch.setattr(hierarchical, "allreduce", lambda *a, **k: (calls.append(1), real(*a, **k)))
    x = make(R, 300, np.dtype(np.float32), 1)
    for layout, comm in comms.items():
        calls.clear()
        got = run_allreduce(comm, x, ReduceOp.SUM, "auto", hierarchical_forced=True)
        np.testing.assert_array_equal(got, sum(make(r, 300, np.dtype(np.float32), 1) for r in range(N)))
        topo = topology.of(comm, MPI)
        assert len(calls) == (1 if topo.spans_hosts and topo.homogeneous else 0), layout


# ------------------------------------------------------------------ host-ordered ring

def test_ring_runs_in_host_order(comms, monkeypatch):
    """With ranks placed round robin the ring runs on the host-ordered communicator."""
    from unison.collectives import ring

    seen = []
    real = ring.allreduce
    monkeypatch.setattr(ring, "allreduce", lambda comm, *a, **k: (seen.append(comm), real(comm, *a, **k)))
    comm = comms["roundrobin"]
    topo = topology.of(comm, MPI)
    inputs = [make(r, 20_001, np.dtype(np.float64), 4, exact=False) for r in range(N)]
    got = run_allreduce(comm, inputs[R], ReduceOp.SUM, "ring")
    if N == 1:  # one rank computes locally
        assert seen == []
        return
    assert seen == [topo.ring] and seen[0].Get_rank() == topo.host_order.index(R)
    np.testing.assert_allclose(got, reference(inputs, ReduceOp.SUM), rtol=1e-12)
    digest_everywhere(got)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("algorithm", ["ring", "mpi", "auto"])
def test_reducescatter_on_every_layout(comms, layout, algorithm):
    comm = comms[layout]
    for count in (N, 3 * N + 1, 40_000 * N + 1):
        counts = [count // N + (1 if i < count % N else 0) for i in range(N)]
        start = sum(counts[:R])
        inputs = [make(r, count, np.dtype(np.float32), 12) for r in range(N)]
        out = np.empty(counts[R], np.float32)
        kernels.reducescatter(comm, MPI, inputs[R], out, counts, ReduceOp.SUM, 1.0, 1.0, algorithm, 4000)
        np.testing.assert_array_equal(out, reference(inputs, ReduceOp.SUM)[start:start + counts[R]])


# ------------------------------------------------------------------ all-gather, broadcast

@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("algorithm", ["hierarchical", "ring", "auto"])
def test_allgatherv_in_rank_order(comms, layout, algorithm):
    comm = comms[layout]
    for rows_of in (lambda r: r + 1, lambda r: 0 if r % 2 else 3000, lambda r: 0):
        blocks = [np.arange(rows_of(r), dtype=np.int32) + 10_000 * r for r in range(N)]
        out = np.empty(sum(b.size for b in blocks), np.int32)
        kernels.allgatherv(comm, MPI, blocks[R], out, [b.nbytes for b in blocks], algorithm, 1000,
                           hierarchical_forced=True)
        np.testing.assert_array_equal(out, np.concatenate(blocks))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("algorithm", ["hierarchical", "tree", "auto"])
def test_broadcast_from_every_root(comms, layout, algorithm):
    comm = comms[layout]
    for root in range(N):
        for n in (1, 5000):
            buf = np.arange(n, dtype=np.float64) * (root + 1) if R == root else np.zeros(n)
            kernels.broadcast(comm, MPI, buf, root, algorithm, 1000, hierarchical_forced=True)
            np.testing.assert_array_equal(buf, np.arange(n, dtype=np.float64) * (root + 1))


# ------------------------------------------------------------------ deterministic mode

@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_deterministic_allreduce_folds_in_rank_order(comms, layout, dtype):
    comm = comms[layout]
    for op in OPS:
        for n in (1, 3, 1001, 20_001):
            inputs = [make(r, n, dtype, 200 + n, exact=False) for r in range(N)]
            if op is ReduceOp.PRODUCT:  # values near 1, so that float16 products stay finite
                inputs = [(1 + x.astype(np.float32) / 1e4).astype(dtype) for x in inputs]
            pre, post = (0.5, 3.0) if op in (ReduceOp.SUM, ReduceOp.AVERAGE) else (1.0, 1.0)
            scaled = [(x.astype(np.float32) * np.float32(pre)).astype(dtype) if dtype.itemsize == 2
                      else x * dtype.type(pre) for x in inputs]
            want = fold(scaled, op)
            results = {}
            for algorithm in ("hierarchical", "auto"):
                for chunk in (CHUNK, 3000):
                    got = run_allreduce(comm, inputs[R], op, algorithm, pre, post, chunk,
                                        deterministic=True)
                    results[algorithm, chunk] = got.tobytes()
            assert len(set(results.values())) == 1, "the algorithm or chunk changed the bits"
            want_final = want.copy()
            from unison.collectives.reduce import finalize
            finalize(want_final, op, N, post)
            assert results["auto", CHUNK] == want_final.tobytes()
            digest_everywhere(np.frombuffer(results["auto", CHUNK], np.uint8))


def test_deterministic_reducescatter_and_inline_rows_fold_in_rank_order(comms):
    comm = comms["roundrobin"]
    for count in (N, 5 * N + 2, 30_000 * N + 1):
        counts = [count // N + (1 if i < count % N else 0) for i in range(N)]
        start = sum(counts[:R])
        inputs = [make(r, count, np.dtype(np.float32), 77, exact=False) for r in range(N)]
        for chunk in (CHUNK, 400):
            out = np.empty(counts[R], np.float32)
            kernels.reducescatter(comm, MPI, inputs[R], out, counts, ReduceOp.SUM, 1.0, 1.0, "ring", chunk,
                                  deterministic=True)
            assert out.tobytes() == fold(inputs, ReduceOp.SUM)[start:start + counts[R]].tobytes()
    # the inline path's rows: numpy's reduce is pairwise from 9 rows on; fold_rows is not
    rows = np.array([[1e8], [1.0], [-1e8]] + [[1.0]] * 9, np.float32)
    out = np.empty(1, np.float32)
    ordered.reduce_stack(rows, ReduceOp.SUM, out, len(rows), 1.0)
    assert out.tobytes() == fold(list(rows), ReduceOp.SUM).tobytes()


@contextlib.contextmanager
def reinit(**settings):
    unison.shutdown()
    unison.init(**settings)
    try:
        yield
    finally:
        unison.shutdown()
        unison.init()


def engine_set(tag: str, count: int = 30) -> list[np.ndarray]:
    handles = [unison.allreduce_async(make(R, 10 * i + 1, np.dtype(np.float32), i, exact=False),
                                      op=unison.Sum, name=f"{tag}.{i}") for i in range(count)]
    return [unison.synchronize(h) for h in handles]


@pytest.mark.skipif(N == 1, reason="a size-1 job computes locally, without the engine")
def test_deterministic_engine_fused_equals_unfused_equals_numpy():
    with reinit(deterministic=True):
        assert state().config.deterministic
        eng = frontend.engine()
        fused = engine_set("det.fused")
        eng.fusion_threshold = 0
        unfused = engine_set("det.unfused")
        eng.fusion_threshold = 2048
        small = engine_set("det.small")
        direct = [C.allreduce(make(R, 10 * i + 1, np.dtype(np.float32), i, exact=False), op=unison.Sum,
                              algorithm="auto") for i in range(30)]
        for i, (a, b, c, d) in enumerate(zip(fused, unfused, small, direct, strict=True)):
            want = fold([make(r, 10 * i + 1, np.dtype(np.float32), i, exact=False) for r in range(N)],
                        ReduceOp.SUM)
            assert a.tobytes() == b.tobytes() == c.tobytes() == d.tobytes() == want.tobytes(), i


@pytest.mark.skipif(N == 1, reason="a size-1 job computes locally, without the engine")
def test_engine_fused_buffers_take_the_hierarchical_algorithm(monkeypatch):
    """UNISON_HIERARCHICAL_ALLREDUCE reaches the engine's fused buffers through the kernels."""
    calls = []
    real = hierarchical.allreduce
    monkeypatch.setattr(hierarchical, "allreduce", lambda topo, *a, **k: (calls.append(topo), real(topo, *a, **k)))
    with reinit(hierarchical_allreduce=True):
        eng = frontend.engine()
        comm = eng._sets[0].comm
        # simulated hosts for the engine's communicator: built on a copy (the engine thread owns
        # the communicator itself), attached with local calls only
        helper = WORLD.Dup()
        topo = topology.build(helper, MPI, LAYOUTS["block" if N % 2 == 0 else "real"])
        topology.attach(comm, MPI, topo)
        handles = [unison.allreduce_async(make(R, 10 * i + 1, np.dtype(np.float32), i), op=unison.Sum,
                                          name=f"hier.{i}") for i in range(20)]
        got = [unison.synchronize(h) for h in handles]
        for i, g in enumerate(got):
            np.testing.assert_array_equal(g, sum(make(r, 10 * i + 1, np.dtype(np.float32), i) for r in range(N)))
        spans = topo.spans_hosts
        assert (len(calls) > 0) == spans and all(t is topo for t in calls)
        assert len(calls) < 20 or not spans  # fused: fewer collectives than tensors
    helper.Free()


@pytest.mark.skipif(N == 1, reason="a size-1 job computes locally, without the engine")
def test_the_engine_runs_the_algorithm_settings_of_the_job(monkeypatch):
    """Before: UNISON_<OP>_ALGORITHM (and HOROVOD_*) reached unison.collectives only; the engine (unison.allreduce,
    hvd.*) ran ``auto`` whatever was set, and ``algorithm=None`` raised."""
    seen = []
    for op in ("allreduce", "allgatherv", "broadcast", "reducescatter", "alltoallv"):
        real = getattr(kernels, op)

        def record(*a, _op=op, _real=real, **k):
            seen.append((_op, next(v for v in a if isinstance(v, str) and v in {"ring", "tree", "pairwise", "auto",
                                                                                 "mpi", "rhd", "hierarchical"})))
            return _real(*a, **k)

        monkeypatch.setattr(kernels, op, record)
    x = np.arange(6 * N, dtype=np.float32) + R
    settings = dict(allreduce_algorithm="rhd", allgather_algorithm="ring", broadcast_algorithm="tree",
                    reducescatter_algorithm="ring", alltoall_algorithm="pairwise")
    with reinit(**settings):
        np.testing.assert_allclose(unison.allreduce(x, op=unison.Sum, name="setting.ar"),
                                   sum(np.arange(6 * N, dtype=np.float32) + r for r in range(N)))
        np.testing.assert_allclose(unison.allreduce(x, op=unison.Sum, name="setting.ar.none", algorithm=None),
                                   sum(np.arange(6 * N, dtype=np.float32) + r for r in range(N)))
        unison.allreduce(x, op=unison.Sum, name="setting.ar.auto", algorithm="auto")  # an explicit choice wins
        unison.allgather(x, name="setting.ag")
        unison.broadcast(x, root_rank=0, name="setting.bc")
        unison.reducescatter(x, name="setting.rs")
        unison.alltoall(x, name="setting.a2a")
    assert seen == [("allreduce", "rhd"), ("allreduce", "rhd"), ("allreduce", "auto"), ("allgatherv", "ring"),
                    ("broadcast", "tree"), ("reducescatter", "ring"), ("alltoallv", "pairwise")], seen
    seen.clear()
    unison.allreduce(x, name="setting.default")  # back to the default settings
    assert seen == [("allreduce", "auto")]


@pytest.mark.skipif(N == 1, reason="one rank sends nothing")
def test_messages_over_the_mpi_count_limit_take_pieces_or_our_algorithms(monkeypatch):
    """Before: a count or byte displacement over 2**31 - 1 made MPI's calls (and the steps within a host of the
    hierarchical and deterministic algorithms) fail with MPI_ERR_ARG; through the engine its thread died. The
    limit is lowered to 4 KiB here so that small arrays take the paths a 2 GiB one takes (checked at 2 GiB + 4
    MiB by hand: docs/collectives.md); every result against numpy, the algorithms spied on."""
    monkeypatch.setattr(select, "MAX_MPI_BYTES", 4096)
    ran = []
    for mod, fn in ((ring, "allreduce"), (ring, "allgatherv"), (ring, "reduce_scatter"), (native, "allreduce"),
                    (native, "allgatherv"), (native, "alltoallv"), (native, "reduce_scatter")):
        real, label = getattr(mod, fn), f"{mod.__name__.split('.')[-1]}.{fn}"
        monkeypatch.setattr(mod, fn, lambda *a, _r=real, _n=label, **k: (ran.append(_n), _r(*a, **k))[1])
    small = 100  # float32: 400 bytes, under the limit (3000: 12 KiB, over it)
    xs = [make(r, 3000, np.dtype(np.float32), 5) for r in range(N)]
    for algorithm in ("mpi", "hierarchical", "auto"):
        ran.clear()
        np.testing.assert_array_equal(C.allreduce(xs[R], op=unison.Sum, name=f"big.ar.{algorithm}",
                                                  algorithm=algorithm), sum(xs))
        assert "ring.allreduce" in ran and "native.allreduce" not in ran, (algorithm, ran)
    ran.clear()
    np.testing.assert_array_equal(C.allreduce(xs[R][:small], op=unison.Sum, name="big.ar.small", algorithm="mpi"),
                                  sum(x[:small] for x in xs))
    assert ran == ["native.allreduce"]
    # deterministic (rank-order folds): its pieces packed, its gather by the ring
    floats = [make(r, 5000, np.dtype(np.float32), 6, exact=False) for r in range(N)]
    out = np.empty(5000, np.float32)
    kernels.allreduce(WORLD, MPI, floats[R], out, ReduceOp.SUM, 1.0, 1.0, "auto", 1024, deterministic=True)
    assert out.tobytes() == fold(floats, ReduceOp.SUM).tobytes()
    counts = [5000 // N + (1 if i < 5000 % N else 0) for i in range(N)]
    mine = np.empty(counts[R], np.float32)
    kernels.reducescatter(WORLD, MPI, floats[R], mine, counts, ReduceOp.SUM, 1.0, 1.0, "auto", 1024,
                          deterministic=True)
    lo = sum(counts[:R])
    assert mine.tobytes() == fold(floats, ReduceOp.SUM)[lo:lo + counts[R]].tobytes()
    # all-gather of uneven rows, broadcast, reduce-scatter and all-to-all by MPI's name
    rows = [np.full((400 + 50 * r, 3), r, np.float32) for r in range(N)]
    ran.clear()
    np.testing.assert_array_equal(C.allgather(rows[R], name="big.ag", algorithm="mpi"), np.concatenate(rows))
    assert "ring.allgatherv" in ran and "native.allgatherv" not in ran, ran
    sent = np.arange(3000 * N, dtype=np.float32)
    for root in range(N):
        got = C.broadcast(sent + R if R == root else np.zeros_like(sent), root_rank=root, name=f"big.bc.{root}",
                          algorithm="mpi")
        np.testing.assert_array_equal(got, sent + root)
    ran.clear()
    scattered = C.reducescatter(np.tile(xs[R], 2), op=unison.Sum, name="big.rs", algorithm="mpi")
    whole = np.tile(sum(xs), 2)
    rs_counts = [len(whole) // N + (1 if i < len(whole) % N else 0) for i in range(N)]
    start = sum(rs_counts[:R])
    np.testing.assert_array_equal(scattered, whole[start:start + rs_counts[R]])
    assert "ring.reduce_scatter" in ran and "native.reduce_scatter" not in ran, ran
    # all-to-all: only the last rank sends more than the limit, and every rank leaves MPI's call alike
    splits = [[(1200 if r == N - 1 else 10) for _ in range(N)] for r in range(N)]
    payload = np.repeat(np.arange(sum(splits[R]), dtype=np.float32)[:, None] + 1000 * R, 2, axis=1)
    for path in ("direct", "engine"):
        ran.clear()
        if path == "direct":
            got, received = C.alltoall(payload, splits=splits[R], name="big.a2a", algorithm="mpi")
        else:
            got, received = unison.alltoall(payload, splits=splits[R], name="big.a2a.engine")
        want = np.concatenate([np.repeat(np.arange(sum(splits[r]), dtype=np.float32)[:, None] + 1000 * r, 2,
                                         axis=1)[sum(splits[r][:R]):sum(splits[r][:R + 1])] for r in range(N)])
        np.testing.assert_array_equal(got, want)
        assert list(received) == [splits[r][R] for r in range(N)]
        assert "native.alltoallv" not in ran, (path, ran)
    ok = WORLD.allreduce(1, op=MPI.SUM)
    assert ok == N


def test_direct_api_takes_the_hierarchical_algorithm_by_name():
    """``algorithm="hierarchical"`` through the agreeing API (one host: the degenerate hierarchy)."""
    xs = [np.random.default_rng([7, r]).standard_normal(5000).astype(np.float32) for r in range(N)]
    got = C.allreduce(xs[R], op=unison.Sum, algorithm="hierarchical")
    np.testing.assert_allclose(got, np.sum(xs, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)
    digest_everywhere(got)
    rows = [np.full((r + 1, 1000), r, np.int32) for r in range(N)]
    np.testing.assert_array_equal(C.allgather(rows[R], algorithm="hierarchical"), np.concatenate(rows))
    root = N - 1
    sent = np.arange(3000, dtype=np.float64) * (R == root)
    np.testing.assert_array_equal(C.broadcast(sent, root_rank=root, algorithm="hierarchical"),
                                  np.arange(3000, dtype=np.float64))
