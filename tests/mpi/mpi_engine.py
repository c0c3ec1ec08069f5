"""The engine under mpirun: negotiation, fusion, errors, join, process sets, timeline.

Every rank runs these tests in the same order; results are checked against numpy
references that each rank rebuilds from every rank's inputs.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import unison
from unison.common.engine import frontend, objects
from unison.common.engine.errors import JoinError
from unison.common.exceptions import UnsupportedError

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()


@pytest.fixture(scope="module", autouse=True)
def _unison_session():
    unison.init()
    yield
    unison.shutdown()
needs_engine = pytest.mark.skipif(N == 1, reason="a size-1 job computes locally, without the engine")


def data(rank: int, i: int, size: int) -> np.ndarray:
    return (np.random.default_rng([i, rank]).integers(-50, 50, size)).astype(np.float32)


def test_random_submission_order_gives_correct_results():
    names = [f"order.{i}" for i in range(60)]
    mine = names[:]
    random.Random(R).shuffle(mine)  # every rank submits in its own order
    handles = {nm: unison.allreduce_async(data(R, int(nm[6:]), 5 + int(nm[6:]) * 37), op=unison.Sum,
                                          name=nm) for nm in mine}
    for nm, h in handles.items():
        i = int(nm[6:])
        want = sum(data(r, i, 5 + i * 37).astype(np.float64) for r in range(N))
        np.testing.assert_array_equal(unison.synchronize(h), want)


def test_poll_and_average_default():
    h = unison.allreduce_async(np.full(3, float(R)), name="poll.avg")
    res = unison.synchronize(h)
    assert unison.poll(h)
    np.testing.assert_allclose(res, np.full(3, (N - 1) / 2))


def _run_set(tag: str):
    return [unison.synchronize(unison.allreduce_async(data(R, i, 1000 * (i % 7) + 3), op=unison.Sum,
                                                      name=f"{tag}.{i}"))
            for i in range(40)] + \
        [unison.synchronize(h) for h in [unison.allreduce_async(data(R, i, 50 + i), op=unison.Sum,
                                                                name=f"{tag}.b{i}") for i in range(40)]]


@needs_engine
def test_fusion_on_and_off_give_identical_results():
    eng = frontend.engine()
    default = eng.fusion_threshold
    try:
        fused = _run_set("fuse.on")
        eng.fusion_threshold = 0
        unfused = _run_set("fuse.off")
        eng.fusion_threshold = 4096  # many small buffers
        small = _run_set("fuse.small")
    finally:
        eng.fusion_threshold = default
    for a, b, c in zip(fused, unfused, small, strict=True):
        assert a.tobytes() == b.tobytes() == c.tobytes()


def test_zero_d_arrays_keep_their_shape():
    b = unison.broadcast(np.float32(R + 5), root_rank=0, name="zd.bc")
    a = unison.allreduce(np.float64(R), op=unison.Sum, name="zd.ar")
    assert b.shape == () and float(b) == 5.0
    assert a.shape == () and float(a) == sum(range(N))


def test_grouped_allreduce_fuses_and_matches():
    tensors = [data(R, i, 10 * i + 1) for i in range(25)]
    out = unison.grouped_allreduce(tensors, op=unison.Sum, name="grouped")
    for i, got in enumerate(out):
        np.testing.assert_array_equal(got, sum(data(r, i, 10 * i + 1) for r in range(N)))


def _group_members(rank: int) -> list[np.ndarray]:
    """A group as a model's gradients come: mixed dtypes and shapes, 0-d, large (direct) and small
    (packed) members, one non-contiguous."""
    rng = np.random.default_rng([7, rank])
    return [rng.integers(-9, 9, (3, 4)).astype(np.float32), np.float64(rank + 0.5),
            rng.integers(-9, 9, 300_000).astype(np.float32),  # 1.2 MB: reduced on its own
            rng.integers(-9, 9, 17).astype(np.int32), rng.integers(-9, 9, (5, 6)).astype(np.float32).T,
            rng.integers(0, 9, 11).astype(np.uint8), rng.integers(-9, 9, 1).astype(np.float32)]


@needs_engine
def test_allgather_of_rows_with_no_elements():
    """Rows of zero elements ((3, 0): the first dimension is in the shape only) are gathered like any
    rows; the engine thread used to die on them (numpy cannot infer -1 from a size of 0)."""
    shapes = [lambda r: (0,), lambda r: (3, 0), lambda r: (r + 1, 0), lambda r: (2, 0, 3), lambda r: (0, 2)]
    for k, shape_of in enumerate(shapes):
        out = unison.allgather(np.zeros(shape_of(R), np.float32), name=f"ag.empty.{k}")
        rows = sum(shape_of(r)[0] for r in range(N))
        assert out.shape == (rows, *shape_of(R)[1:]) and out.dtype == np.float32, (k, out.shape)
    np.testing.assert_array_equal(unison.allreduce(np.ones(2), op=unison.Sum, name="ag.empty.after"), [N, N])


@needs_engine
@pytest.mark.parametrize("threshold", [None, 0, 64], ids=["default", "fusion-off", "64-byte-buffers"])
def test_grouped_allreduce_is_one_request_with_every_dtype_and_shape(threshold):
    eng = frontend.engine()
    default = eng.fusion_threshold
    eng.fusion_threshold = default if threshold is None else threshold
    try:
        for step in range(3):  # the first negotiates the layout in full, later ones hit the cache
            h = unison.grouped_allreduce_async(_group_members(R), op=unison.Sum, name=f"grp.mixed.{threshold}")
            out = unison.synchronize(h)
            want = [sum(_group_members(r)[i] for r in range(N)) for i in range(7)]
            assert len(out) == 7, step
            for i, (got, ref) in enumerate(zip(out, want, strict=True)):
                assert got.shape == np.shape(ref) and got.dtype == np.asarray(ref).dtype, (i, got.shape, got.dtype)
                np.testing.assert_array_equal(got, ref, err_msg=f"member {i}")
    finally:
        eng.fusion_threshold = default
    # one request: the group's name is in flight, not a name per member
    h = unison.grouped_allreduce_async([np.ones(3)], op=unison.Sum, name="grp.inflight")
    with pytest.raises(unison.DuplicateNameError, match="grp.inflight"):
        unison.grouped_allreduce_async([np.ones(3)], op=unison.Sum, name="grp.inflight")
    np.testing.assert_array_equal(unison.synchronize(h)[0], [N] * 3)


@needs_engine
def test_grouped_allreduce_packs_small_members_back_to_back():
    from unison.common.engine.executor import GroupResult

    out = unison.grouped_allreduce([np.full(4, 1.0 + R), np.full((2, 3), 2.0), np.full(5, 3.0)],
                                   op=unison.Sum, name="grp.packed")
    assert isinstance(out, GroupResult) and [idx for idx, _ in out.packed] == [(0, 1, 2)]
    flat = out.packed[0][1]
    np.testing.assert_array_equal(flat, np.concatenate([np.full(4, N * (N + 1) / 2), np.full(6, 2.0 * N),
                                                        np.full(5, 3.0 * N)]))
    assert all(np.shares_memory(flat, member) for member in out)


@needs_engine
def test_grouped_allreduce_member_that_differs_is_named_on_every_rank():
    def members(shape_of_2: tuple, dtype_of_3: type, count: int = 4) -> list[np.ndarray]:
        return [np.ones(3), np.ones((2, 2)), np.ones(shape_of_2), np.ones(5, dtype_of_3)][:count]

    cases = [(members((4,) if R else (2, 2), np.float64), "grp.mm.2", "shape=\\(2, 2\\)"),
             (members((3,), np.float32 if R else np.float64), "grp.mm.3", "dtype=float32"),
             (members((3,), np.float64, count=3 if R else 4), "grp.mm.3", "holds 3 or 4 tensors")]
    for i, (tensors, member, pattern) in enumerate(cases):
        with pytest.raises(unison.MismatchError, match=pattern) as info:
            unison.grouped_allreduce(tensors, op=unison.Sum, name="grp.mm")
        assert f"{member!r}" in str(info.value) or f"'{member}'" in str(info.value), (i, info.value)
        for r in range(N):
            assert f"rank {r}:" in str(info.value)
    # a bad member is refused on every rank, named
    with pytest.raises(TypeError, match="grp.bad.1.*complex64"):
        unison.grouped_allreduce([np.ones(2), np.ones(2, np.complex64 if R == 0 else np.float64)],
                                 op=unison.Sum, name="grp.bad")
    got = unison.grouped_allreduce(members((3,), np.float64), op=unison.Sum, name="grp.mm")
    np.testing.assert_array_equal(got[3], [N] * 5)


@needs_engine
def test_an_adasum_group_of_another_length_raises_on_every_rank_and_leaves_nothing_pending():
    # Adasum groups go one request per member: the longer group's extra member waited for ever (before
    # 2026-12-05); now a count agreement goes first, and the shorter rank refuses the members it lacks
    if N & (N - 1):
        pytest.skip("Adasum needs a power-of-two job")
    mine = [np.full(4, 1.0), np.full(4, 2.0)][:1 if R else 2]
    with pytest.raises(unison.MismatchError, match="groups of 1 to 2 tensors"):
        unison.grouped_allreduce(mine, op=unison.Adasum, name="grp.adasum")
    # the same name again: nothing of the first call is left in flight (Adasum of equal vectors is the vector)
    got = unison.grouped_allreduce([np.full(4, 3.0), np.arange(4.0)], op=unison.Adasum, name="grp.adasum")
    np.testing.assert_allclose(got[0], np.full(4, 3.0))
    np.testing.assert_allclose(got[1], np.arange(4.0))


@needs_engine
def test_broadcasts_of_lists_of_different_lengths_raise_on_every_rank_and_the_next_pairs():
    # one broadcast per array: rank 0's extra array paired with the others' next broadcast (its value there),
    # then a hang (before 2026-12-05); now the ranks agree on the arrays first
    from unison.common.data_parallel import broadcast_arrays

    mine = [np.full(3, 1.0 + R), np.full(3, 7.0)][:2 if R == 0 else 1]
    with pytest.raises(unison.MismatchError, match=r"broadcast_arrays: .*rank 1: 1 item\(s\), 1 fewer \(1: f"):
        broadcast_arrays(mine)
    got = broadcast_arrays([np.full(3, 5.0 + R)])
    np.testing.assert_array_equal(got[0], [5.0] * 3)
    with pytest.raises(unison.MismatchError, match=r"other: .*in another order"):
        objects.agree_on_names("other", ["a", "b"] if R == 0 else ["b", "a"], name="names.order")
    objects.agree_on_names("same", ["a", "b"], name="names.order")


@needs_engine
def test_agree_on_values_names_each_field_that_differs_and_its_ranks():
    objects.agree_on_values("same", {"width": "4", "bias": "True"}, name="values.same")
    last = N - 1
    mine = {"width": "8" if R == last else "4", "bias": "True"}
    if R != last:
        mine["dropout"] = "0.1"  # a field the last rank does not give
    others = "rank 0" if N == 2 else f"ranks {list(range(N - 1))}"
    with pytest.raises(unison.MismatchError) as caught:
        objects.agree_on_values("layer", mine, name="values.differ", fix="Build it alike")
    assert str(caught.value) == (f"layer: the ranks passed different values: dropout is 0.1 on {others}, "
                                 f"(not given) on rank {last}; width is 4 on {others}, 8 on rank {last}. "
                                 "Build it alike")
    objects.agree_on_values("after", {"width": "4"}, name="values.after")  # nothing left over


@needs_engine
def test_grouped_allreduce_with_compression_and_scale_factors():
    tensors = [np.full(6, R + 1.0, np.float32), np.full((2, 2), 2.0, np.float64)]
    out = unison.grouped_allreduce(tensors, op=unison.Sum, name="grp.fp16", prescale_factor=0.5,
                                   postscale_factor=4.0, compression=unison.Compression.fp16)
    assert [o.dtype for o in out] == [np.float32, np.float64]
    np.testing.assert_allclose(out[0], np.full(6, 2.0 * N * (N + 1) / 2))
    np.testing.assert_allclose(out[1], np.full((2, 2), 4.0 * N))


def test_other_collectives_through_the_engine():
    g = unison.allgather(np.full((R + 1, 2), R, np.int32), name="eng.ag")
    np.testing.assert_array_equal(g[:, 0], np.repeat(np.arange(N), np.arange(1, N + 1)))
    b = unison.broadcast(np.arange(5) + R, root_rank=N - 1, name="eng.bc")
    np.testing.assert_array_equal(b, np.arange(5) + N - 1)
    rs = unison.reducescatter(np.ones((2 * N + 1, 3)) * (R + 1), op=unison.Sum, name="eng.rs")
    assert rs.shape == (3 if R == 0 else 2, 3) and np.all(rs == N * (N + 1) / 2)
    out, splits = unison.alltoall(np.arange(N) + 100 * R, splits=[1] * N, name="eng.a2a")
    np.testing.assert_array_equal(out, [R + 100 * s for s in range(N)])
    np.testing.assert_array_equal(splits, [1] * N)
    unison.barrier()


def test_mismatches_raise_on_every_rank_and_engine_goes_on():
    if N == 1:
        pytest.skip("needs two ranks")
    cases = [
        (lambda: unison.allreduce(np.ones(R + 2), name="mm.shape"), "shape=\\(2,\\)"),
        (lambda: unison.allreduce(np.ones(2, np.float32 if R else np.float64), name="mm.dtype"), "dtype"),
        (lambda: unison.allreduce(np.ones(2), op=unison.Sum if R else unison.Max, name="mm.op"), "op="),
        (lambda: unison.broadcast(np.ones(2), root_rank=R % 2, name="mm.root"), "root_rank"),
        (lambda: unison.allreduce(np.ones(2), prescale_factor=1.0 + R, name="mm.scale"), "prescale"),
    ]
    for fn, pattern in cases:
        with pytest.raises(unison.MismatchError, match=pattern) as info:
            fn()
        for r in range(N):
            assert f"rank {r}:" in str(info.value)
    # a cached name whose shape changes is re-negotiated and caught
    for _ in range(2):
        unison.allreduce(np.ones(4), name="mm.cached")
    with pytest.raises(unison.MismatchError, match="mm.cached"):
        unison.allreduce(np.ones(4 + R), name="mm.cached")
    np.testing.assert_array_equal(unison.allreduce(np.ones(4), op=unison.Sum, name="mm.cached"), [N] * 4)


def test_invalid_arguments_raise_on_every_rank():
    bad = np.ones(3, np.complex64) if R == 0 else np.ones(3)
    with pytest.raises(TypeError, match="complex64"):
        unison.allreduce(bad, name="inv.dtype")
    with pytest.raises(ValueError, match=f"root_rank={N}"):
        unison.broadcast(np.ones(2), root_rank=N, name="inv.root")
    with pytest.raises(TypeError, match="Average is not defined for bool"):
        unison.allreduce(np.ones(2, bool), name="inv.bool")


def test_duplicate_name_in_flight_raises_at_submission():
    if N == 1:
        pytest.skip("a size-1 job completes at submission")
    first = unison.allreduce_async(np.ones(2), name="dup") if R == 0 else None
    if R == 0:
        with pytest.raises(unison.DuplicateNameError, match="'dup' is already in flight"):
            unison.allreduce_async(np.ones(2), name="dup")
        with pytest.raises(ValueError):  # Horovod's type for it
            unison.broadcast_async(np.ones(2), 0, name="dup")
    WORLD.Barrier()
    if R != 0:
        first = unison.allreduce_async(np.ones(2), name="dup")
    np.testing.assert_array_equal(unison.synchronize(first), np.ones(2))


def test_join_with_uneven_step_counts():
    steps = R + 2  # rank r has r + 2 batches
    results = []
    for s in range(steps):
        results.append(unison.allreduce(np.full(4, 1.0), op=unison.Sum, name=f"join.{s}"))
    last = unison.join()
    assert last == N - 1
    for s, res in enumerate(results):
        contributors = sum(1 for r in range(N) if r + 2 > s)
        np.testing.assert_array_equal(res, np.full(4, float(contributors)))
    # the engine is usable after a join
    np.testing.assert_array_equal(unison.allreduce(np.ones(2), op=unison.Sum, name="after.join"), [N, N])


def test_join_contributes_each_ops_identity():
    """A joined rank adds the op's identity: Product 1, Min +max, Max -max, Band all bits, Bor/Bxor 0."""
    ops = [unison.Sum, unison.Product, unison.Min, unison.Max, unison.Band, unison.Bor, unison.Bxor]
    mine = np.array([0b0110 + R, -3 - R, 5 * R + 1], np.int64)
    if R == N - 1:  # the last rank joins at once; the others reduce without it
        assert 0 <= unison.join() < N
        return
    got = [unison.allreduce(mine, op=op, name=f"ident.{op.name}") for op in ops]
    # a grouped all-reduce too: every member gets the identity, packed and direct alike
    grouped = unison.grouped_allreduce([mine, mine.astype(np.float32), np.full(300_000, 2.0 + R)],
                                       op=unison.Min, name="ident.grouped")
    live = [np.array([0b0110 + r, -3 - r, 5 * r + 1], np.int64) for r in range(N - 1)]
    fns = [np.add, np.multiply, np.minimum, np.maximum, np.bitwise_and, np.bitwise_or, np.bitwise_xor]
    for op, fn, res in zip(ops, fns, got, strict=True):
        want = live[0]
        for arr in live[1:]:
            want = fn(want, arr)
        np.testing.assert_array_equal(res, want, err_msg=repr(op))
    lowest = np.minimum.reduce(live)
    np.testing.assert_array_equal(grouped[0], lowest)
    np.testing.assert_array_equal(grouped[1], lowest.astype(np.float32))
    np.testing.assert_array_equal(grouped[2], np.full(300_000, 2.0))
    assert 0 <= unison.join() < N


def test_join_with_a_prescale_factor_keeps_the_identity_an_identity():
    """Before: the joined rank's identity was prescaled with the real inputs: Product gained the factor, and
    Min/Max with a negative factor returned -inf/+inf (Min of -3, -4 times -1 read -inf)."""
    if N == 1:
        pytest.skip("needs a rank that joins and one that reduces")
    if R == N - 1:
        assert 0 <= unison.join() < N
        return
    live = [np.array([3.0 + r, -1.0 - r]) for r in range(N - 1)]
    mine = live[R]
    cases = [(unison.Product, 2.0, np.multiply), (unison.Min, -1.0, np.minimum), (unison.Max, -1.0, np.maximum),
             (unison.Max, 2.0, np.maximum)]
    for op, pre, fn in cases:
        want = fn.reduce([a * pre for a in live])
        got = unison.allreduce(mine, op=op, prescale_factor=pre, name=f"joinpre.{op.name}.{pre}")
        np.testing.assert_array_equal(got, want, err_msg=f"{op!r} prescale {pre}")
        grouped = unison.grouped_allreduce([mine, mine.astype(np.float32)], op=op, prescale_factor=pre,
                                           name=f"joinpre.g.{op.name}.{pre}")
        np.testing.assert_array_equal(grouped[1], want.astype(np.float32), err_msg=f"grouped {op!r} {pre}")
    ints = unison.allreduce(np.array([-3 - R], np.int8), op=unison.Max, prescale_factor=2.0, name="joinpre.i8")
    assert ints.tolist() == [max(2 * (-3 - r) for r in range(N - 1))]
    assert 0 <= unison.join() < N


def test_read_only_out_and_unconvertible_inputs_raise_on_every_rank():
    """Before: a read-only out= killed the engine thread (a rank that passed it alone hung the others); a ragged
    list on one rank raised there before submitting, and the others waited for ever."""
    if N == 1:
        pytest.skip("one rank raises ValueError at once (no engine)")
    frozen = np.zeros(3)
    frozen.setflags(write=False)
    with pytest.raises(unison.InvalidArgumentError, match="writeable=False"):
        unison.allreduce(np.ones(3), op=unison.Sum, name="ro.out", out=frozen if R == 0 else np.zeros(3))
    for call in (lambda x: unison.allreduce(x, op=unison.Sum, name="ragged.ar"),
                 lambda x: unison.allgather(x, name="ragged.ag")):
        with pytest.raises(unison.InvalidArgumentError, match="failed on 1 of"):
            call([[1.0, 2.0], [3.0]] if R == 0 else np.ones(2))
    np.testing.assert_array_equal(unison.allreduce(np.ones(2), op=unison.Sum, name="after.bad"), [N, N])


#: (rank 0's refusal, rank 1's or None, the class every rank raises): [Note: refusal kinds] in errors.py
REFUSALS = [
    (UnsupportedError("a refusal whose message names no backend"), None, UnsupportedError),
    (UnsupportedError("not implemented here"), ValueError("a bad root"), UnsupportedError),
    (UnsupportedError("unsupported by the unison backend: not implemented"), TypeError("a bad dtype"),
     unison.CollectiveError),
    (TypeError("a bad dtype, quoting unsupported by the unison backend: "), None, unison.CollectiveError),
    (ValueError("a bad root, quoting unsupported by the unison backend: "), None, unison.InvalidArgumentError),
]


@needs_engine
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("first, second, cls", REFUSALS)
def test_a_refusal_arrives_as_its_kind_on_every_rank(first, second, cls, grouped):
    """An ``UnsupportedError`` travels as a kind of its own ("U"), so every rank raises it whatever its
    message says; a plain TypeError elsewhere wins (``CollectiveError``), a ValueError does not. Before
    2026-12-06 (a second change) it travelled as a TypeError's "T": every rank raised ``CollectiveError``."""
    if second is not None and N < 2:
        pytest.skip("needs two refusing ranks")
    mine = first if R == 0 else second if R == 1 else None
    data = np.ones(2) if mine is None else frontend.Refused(mine)
    name = f"refusal.{REFUSALS.index((first, second, cls))}.{grouped}"
    with pytest.raises(cls, match="failed on") as info:
        if grouped:
            unison.grouped_allreduce([np.ones(3), data], op=unison.Sum, name=name)
        else:
            unison.allreduce(data, op=unison.Sum, name=name)
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    assert str(first) in str(info.value) and (second is None or str(second) in str(info.value))
    np.testing.assert_array_equal(unison.allreduce(np.ones(2), op=unison.Sum, name=f"{name}.after"), [N, N])


def test_broadcast_object_with_a_root_outside_one_ranks_set_raises_on_every_rank():
    from unison.common.engine.objects import broadcast_object

    if N < 3:
        pytest.skip("needs a set of two ranks and another rank naming a root outside it")
    ps = unison.add_process_set([1, 2])
    try:
        if R in (1, 2):
            with pytest.raises((ValueError, unison.InvalidArgumentError), match="not a"):
                broadcast_object(R, root_rank=0 if R == 1 else 2, process_set=ps)
    finally:
        unison.remove_process_set(ps)


def test_join_covers_the_process_sets_of_the_joined_rank(caplog):
    """A joined rank contributes the identity to allreduces on every process set it belongs to, and
    refuses the others there too (an allreduce on a set with a joined member used to wait for ever)."""
    if N == 1:
        pytest.skip("needs a rank that joins and one that does not")
    pair = unison.add_process_set(unison.ProcessSet([0, N - 1]))
    rest = unison.add_process_set(unison.ProcessSet(list(range(1, N)))) if N > 2 else None
    try:
        if R == 0:  # out of data at once
            with caplog.at_level(logging.WARNING, logger="unison"):
                assert 0 < unison.join() < N  # the last rank to join: not this one
            assert "allgather" in caplog.text and "pair.gather" in caplog.text
            return
        got = unison.allreduce(np.array([R + 1.0]), op=unison.Sum, name="pair.sum", process_set=pair) \
            if R == N - 1 else None
        if got is not None:
            np.testing.assert_array_equal(got, [float(N)])  # rank 0 counted as 0
            with pytest.raises(unison.JoinError):
                unison.allgather(np.array([1.0]), name="pair.gather", process_set=pair)
        if rest is not None:  # a set without the joined rank runs as usual
            np.testing.assert_array_equal(unison.allreduce(np.array([1.0]), op=unison.Sum, name="rest.sum",
                                                           process_set=rest), [float(N - 1)])
        assert 0 < unison.join() < N
    finally:
        unison.remove_process_set(pair)
        if rest is not None:
            unison.remove_process_set(rest)


def _refused_while_rank0_joined(calls, caplog):
    """Rank 0 joins; every other rank makes ``calls``: each must raise JoinError, then join.

    Rank 0's join() returns normally (Horovod's contract: the joined rank is not the one that
    erred) and logs a warning naming the refused calls; returns that warning's text on rank 0.
    """
    if R == 0:
        with caplog.at_level(logging.WARNING, logger="unison.common.engine.engine"):
            last = unison.join()
        assert 1 <= last < N  # the last rank to join is one of the others
        return " ".join(rec.getMessage() for rec in caplog.records if "had joined" in rec.getMessage())
    for what, call in calls:
        with pytest.raises(JoinError, match="only allreduce and barrier") as info:
            call()
        assert "[0]" in str(info.value), (what, info.value)
    # allreduce still works with rank 0 joined (it contributes zeros)
    got = unison.allreduce(np.ones(3), op=unison.Sum, name="jr.ar")
    np.testing.assert_array_equal(got, np.full(3, N - 1.0))
    assert 1 <= unison.join() < N  # the last rank to join
    return ""


@needs_engine
def test_join_refuses_collectives_that_need_every_ranks_data(caplog):
    # a broadcast cached before the join must be refused too (the cache path)
    for _ in range(2):
        np.testing.assert_array_equal(unison.broadcast(np.full(4, 7.0 + R), 1, name="jr.cached"),
                                      np.full(4, 8.0))
    calls = [
        ("broadcast from a joined root", lambda: unison.broadcast(np.full(4, 7.0), 0, name="jr.bc0")),
        ("broadcast from a live root", lambda: unison.broadcast(np.full(4, 7.0), 1, name="jr.bc1")),
        ("cached broadcast", lambda: unison.broadcast(np.full(4, 7.0), 1, name="jr.cached")),
        ("allgather", lambda: unison.allgather(np.ones((2, 3)), name="jr.ag")),
        ("alltoall", lambda: unison.alltoall(np.arange(N, dtype=np.float32), name="jr.a2a")),
        ("reducescatter", lambda: unison.reducescatter(np.ones((N, 2)), name="jr.rs")),
    ]
    message = _refused_while_rank0_joined(calls, caplog)
    if R == 0:  # the joined rank is told which collectives were refused, and who submitted them
        assert "JoinError" in message and "Only allreduce and barrier" in message, message
        for name in ("jr.bc0", "jr.bc1", "jr.cached", "jr.ag", "jr.a2a", "jr.rs"):
            assert f"{name!r} submitted by rank(s) {list(range(1, N))}" in message, message
    # after the join everything works again, on every rank
    np.testing.assert_array_equal(unison.broadcast(np.full(4, 7.0 + R), 0, name="jr.bc0"), np.full(4, 7.0))
    np.testing.assert_array_equal(unison.broadcast(np.full(4, 7.0 + R), 1, name="jr.cached"),
                                  np.full(4, 8.0))
    g = unison.allgather(np.full((1, 2), R), name="jr.ag")
    np.testing.assert_array_equal(g[:, 0], np.arange(N))


@needs_engine
def test_add_and_remove_process_set_while_a_rank_joined_raise_everywhere(caplog):
    before = len(frontend.engine()._set_objs)
    message = _refused_while_rank0_joined(
        [("add_process_set", lambda: unison.add_process_set(list(range(N))))], caplog)
    assert R != 0 or f"'unison.add_process_set.{before}' submitted by rank(s)" in message, message
    assert len(frontend.engine()._set_objs) == before  # nothing half-registered
    ps = unison.add_process_set(list(range(N)))
    assert ps.process_set_id == before
    got = unison.allreduce(np.full(2, float(R)), op=unison.Sum, name="jr.ps", process_set=ps)
    np.testing.assert_array_equal(got, np.full(2, float(sum(range(N)))))
    _refused_while_rank0_joined([("remove_process_set", lambda: frontend.remove_process_set(ps))], caplog)
    assert ps.process_set_id == before  # still registered everywhere, and usable
    got = unison.allreduce(np.full(2, float(R)), op=unison.Sum, name="jr.ps", process_set=ps)
    np.testing.assert_array_equal(got, np.full(2, float(sum(range(N)))))
    assert frontend.remove_process_set(ps) is True


@needs_engine
def test_collectives_right_after_join_never_meet_a_joined_rank():
    """After every rank joined, a rank whose join() returned first submits at once: the next
    collectives (cached and new names, a process set, registering a set) must run with every
    rank live, never be refused or see a rank still joined (a rank must not "run ahead")."""
    pair = unison.add_process_set([0, N - 1])
    for i in range(12):
        if R == i % N:
            time.sleep(0.02)  # a different rank joins last each time
        last = unison.join()
        assert 0 <= last < N
        root = (i + 1) % N
        got = unison.broadcast(np.full(3, float(R + 10 * i)), root, name="aj.bc")  # cached after i=0
        np.testing.assert_array_equal(got, np.full(3, float(root + 10 * i)))
        got = unison.broadcast(np.full(2, float(R)), root, name=f"aj.bc.{i}")  # new each time
        np.testing.assert_array_equal(got, np.full(2, float(root)))
        if R in (0, N - 1):  # (the engine's root_rank is a rank of the set)
            got = unison.broadcast(np.full(2, float(R + i)), i % 2, name="aj.ps.bc", process_set=pair)
            np.testing.assert_array_equal(got, np.full(2, float(pair.ranks[i % 2] + i)))
            got = unison.allreduce(np.full(2, 1.0), op=unison.Sum, name="aj.ps.ar", process_set=pair)
            np.testing.assert_array_equal(got, np.full(2, float(len({0, N - 1}))))
        g = unison.allgather(np.full((1, 2), R), name="aj.ag")
        np.testing.assert_array_equal(g[:, 0], np.arange(N))
        if i % 4 == 3:  # registering and removing a set right after a join
            extra = unison.add_process_set(list(range(N)))
            got = unison.allreduce(np.ones(2), op=unison.Sum, name=f"aj.extra.{i}", process_set=extra)
            np.testing.assert_array_equal(got, np.full(2, float(N)))
            assert frontend.remove_process_set(extra) is True
    assert frontend.remove_process_set(pair) is True



@needs_engine
def test_unnamed_calls_after_a_join_pair_alike_on_every_rank():
    """[Note: unnamed calls after a join] The last rank has extra batches each epoch, made of unnamed calls on the
    job and on a process set; after the join, two unnamed all-reduces in flight at once must pair by position.
    Before: the joined ranks' counters lagged, so rank 0's loss was summed with the last rank's accuracy, and
    the calls after it hung."""
    pair = unison.add_process_set(unison.ProcessSet([0, N - 1]))
    try:
        for epoch in range(2):
            for _ in range(1 + (epoch + 1) * (R == N - 1)):  # the last rank: 2, then 3 batches; the others 1
                unison.allreduce(np.ones(1), op=unison.Sum)
                if R in (0, N - 1):
                    unison.allreduce(np.ones(1), op=unison.Sum, process_set=pair)
            assert unison.join() == N - 1
            loss = unison.allreduce_async(np.array([float(R)]), op=unison.Sum)
            acc = unison.allreduce_async(np.array([100.0 + R]), op=unison.Sum)
            np.testing.assert_array_equal(unison.synchronize(acc), [100.0 * N + sum(range(N))])
            np.testing.assert_array_equal(unison.synchronize(loss), [float(sum(range(N)))])
            if R in (0, N - 1):
                np.testing.assert_array_equal(unison.allreduce(np.array([float(R)]), op=unison.Sum,
                                                               process_set=pair), [float(N - 1)])
            assert objects.broadcast_object(("epoch", epoch, R), root_rank=N - 1) == ("epoch", epoch, N - 1)
    finally:
        unison.remove_process_set(pair)

@needs_engine
def test_remove_process_set_frees_it_on_every_rank():
    eng = frontend.engine()
    assert frontend.remove_process_set(unison.global_process_set) is False
    assert frontend.remove_process_set(unison.ProcessSet([0])) is False  # never registered
    members = [0, N - 1]
    ps = unison.add_process_set(members)
    sid = ps.process_set_id
    state = eng._sets.get(sid)
    assert (state is not None) == (R in members)
    pending = None
    if R in members:
        got = unison.allreduce(np.full(2, float(R)), op=unison.Sum, name="rm.ar", process_set=ps)
        np.testing.assert_array_equal(got, np.full(2, float(sum(set(members)))))
        if R == 0:  # submitted on one member only: removal fails it instead of leaving it pending
            pending = unison.allreduce_async(np.ones(2), name="rm.pending", process_set=ps)
    assert frontend.remove_process_set(ps) is True
    assert ps.process_set_id is None and sid not in eng._sets
    if state is not None:
        assert state.comm == MPI.COMM_NULL  # its communicator was freed
    if pending is not None:
        with pytest.raises(ValueError, match="was removed"):
            unison.synchronize(pending)
    if R in members:
        with pytest.raises(ValueError, match="not registered"):
            unison.allreduce(np.ones(1), name="rm.after", process_set=ps)
    assert frontend.remove_process_set(ps) is False  # already removed
    again = unison.add_process_set(ps)  # a removed set can be added again, under a new id
    assert again is ps and ps.process_set_id not in (None, sid)
    if R in members:
        got = unison.allreduce(np.full(2, float(R)), op=unison.Sum, name="rm.ar", process_set=ps)
        np.testing.assert_array_equal(got, np.full(2, float(sum(set(members)))))
    assert frontend.remove_process_set(ps) is True


def test_broadcast_object_root_is_a_global_rank_with_a_process_set():
    from unison.common.engine.objects import broadcast_object

    members = list(range(1, N)) or [0]
    ps = unison.add_process_set(members)
    root = members[-1]  # a rank of the job: its rank in the set is len(members) - 1
    if R in members:
        got = broadcast_object({"from": R, "blob": list(range(R))}, root, name="bo.ps", process_set=ps)
        assert got == {"from": root, "blob": list(range(root))}
        if N > 1:
            with pytest.raises(ValueError, match="root_rank=0 is not a member"):
                broadcast_object(1, 0, name="bo.nonmember", process_set=ps)
    assert broadcast_object(("g", R), N - 1, name="bo.global") == ("g", N - 1)
    assert frontend.remove_process_set(ps) is (N > 1)


@pytest.mark.parametrize("algorithm", ["auto", "ring", "rhd", "mpi"])
def test_uint16_reductions_gather_and_broadcast(algorithm):
    top = np.iinfo(np.uint16).max

    def mine(r):
        return np.array([top - r, r, 1000 + 7 * r, top, 40000], np.uint16)

    stack = np.stack([mine(r) for r in range(N)]).astype(np.int64)
    wants = {unison.Sum: stack.sum(0) % (top + 1), unison.Average: stack.sum(0) // N,
             unison.Min: stack.min(0), unison.Max: stack.max(0)}
    for op, want in wants.items():
        got = unison.allreduce(mine(R), op=op, name=f"u16.{algorithm}.{op!r}", algorithm=algorithm)
        assert got.dtype == np.uint16, (op, got.dtype)
        np.testing.assert_array_equal(got, want.astype(np.uint16), err_msg=f"{op!r}")
    big = np.full(600_000, 40000 + R, np.uint16)  # > 1 MiB: reduced on its own, not fused
    got = unison.allreduce(big, op=unison.Average, name=f"u16.big.{algorithm}", algorithm=algorithm)
    assert got.dtype == np.uint16 and np.all(got == (sum(40000 + r for r in range(N)) // N))
    g = unison.allgather(np.full((R + 1, 2), top - R, np.uint16), name=f"u16.ag.{algorithm}")
    assert g.dtype == np.uint16
    np.testing.assert_array_equal(g[:, 0], np.repeat(top - np.arange(N), np.arange(1, N + 1)))
    b = unison.broadcast(mine(R), N - 1, name=f"u16.bc.{algorithm}")
    assert b.dtype == np.uint16
    np.testing.assert_array_equal(b, mine(N - 1))


def test_process_set_from_a_communicator_and_ranks_that_are_not_integers():
    # Horovod takes a communicator (it raised "not iterable"); 1.7 became rank 1 and '2' was taken
    with pytest.raises(ValueError, match="must be integers"):
        unison.ProcessSet([0, 1.7])
    with pytest.raises(ValueError, match="must be integers"):
        unison.ProcessSet(["2", 0])
    assert unison.ProcessSet([np.int64(0)]).ranks == [0]
    comm = WORLD.Split(R % 2, R)
    try:
        assert unison.ProcessSet(comm).ranks == [r for r in range(N) if r % 2 == R % 2]
    finally:
        comm.Free()


def test_process_sets():
    evens = unison.add_process_set([r for r in range(N) if r % 2 == 0])
    odds = unison.add_process_set([r for r in range(N) if r % 2 == 1]) if N > 1 else None
    mine = evens if R % 2 == 0 else odds
    members = [r for r in range(N) if r % 2 == R % 2]
    got = unison.allreduce(np.full(3, float(R)), op=unison.Sum, name="ps.sum", process_set=mine)
    np.testing.assert_array_equal(got, np.full(3, float(sum(members))))
    avg = unison.allreduce(np.full(3, float(R)), name="ps.avg", process_set=mine)
    np.testing.assert_allclose(avg, np.full(3, sum(members) / len(members)))
    g = unison.allgather(np.array([R]), name="ps.ag", process_set=mine)
    np.testing.assert_array_equal(g, members)
    grouped = unison.grouped_allreduce([np.full(3, float(R)), np.full((2, 2), R, np.int32)], op=unison.Sum,
                                       name="ps.grouped", process_set=mine)  # one request on the set
    np.testing.assert_array_equal(grouped[0], np.full(3, float(sum(members))))
    np.testing.assert_array_equal(grouped[1], np.full((2, 2), sum(members), np.int32))
    if N > 1:
        other = odds if R % 2 == 0 else evens
        with pytest.raises(ValueError, match="not a member"):
            unison.allreduce(np.ones(1), name="ps.bad", process_set=other)
    with pytest.raises(ValueError, match="not registered"):
        unison.allreduce(np.ones(1), process_set=unison.ProcessSet([0]))


def test_unnamed_calls_on_a_subset_leave_the_global_names_aligned():
    """Frontend [Note: a counter per process set]: ranks 0..N-2 make unnamed calls on their own
    set; rank N-1 does not. The next unnamed global calls must still carry the same names on
    every rank (with one counter for all sets they did not: a hang)."""
    if N < 2:
        pytest.skip("needs two ranks")
    most = unison.add_process_set(list(range(N - 1)))
    if R < N - 1:
        for _ in range(2):
            got = unison.allreduce(np.ones(2), op=unison.Sum, process_set=most)
            np.testing.assert_array_equal(got, np.full(2, float(N - 1)))
        unison.allgather(np.array([R]), process_set=most)
    total = unison.allreduce(np.full(2, float(R)), op=unison.Sum)
    np.testing.assert_array_equal(total, np.full(2, float(N * (N - 1) // 2)))
    assert frontend._auto_name("allreduce", None, most).startswith(f"allreduce.set{most.process_set_id}.noname.")
    # an elastic reset restarts a set's counters as well as the global ones (a set's went on before
    # 2026-12-05: recovery registers the same set objects under the same ids, so ranks that had made
    # different numbers of calls before a failure named their next calls differently)
    frontend.reset_auto_names()
    assert frontend._auto_name("allreduce", None, most) == f"allreduce.set{most.process_set_id}.noname.0"
    assert frontend._auto_name("allreduce", None) == "allreduce.noname.0"
    unison.remove_process_set(most)


@needs_engine
def test_unnamed_calls_from_two_live_threads_warn_once_and_each_call_takes_its_own_name(caplog):
    """Unnamed calls pair across ranks by their order, which two threads interleave differently on each rank: a
    loader thread's metric was summed with another rank's gradient, silently (an audit, 2026-12-06). Each
    rank now warns once per kind while both threads live. Eight threads taking names at once each get their
    own (a read-then-bump without a lock could give two calls one name)."""
    from unison.common.engine import frontend

    frontend._auto_warned.discard("broadcast")
    with caplog.at_level(logging.WARNING, logger="unison"):
        first = unison.broadcast(np.full(2, float(R)), root_rank=0)  # the main thread's
        got = []
        side = threading.Thread(target=lambda: got.append(unison.broadcast(np.full(2, R + 10.0), root_rank=0)),
                                name="loader")
        side.start()
        side.join()  # (kept in order here, so the results are right)
        unison.broadcast(np.ones(2), root_rank=0)  # again from the main thread: warned already
    np.testing.assert_array_equal(first, [0.0, 0.0])
    np.testing.assert_array_equal(got[0], [10.0, 10.0])
    warned = [m for m in caplog.messages if "come from two live threads" in m]
    assert len(warned) == 1 and "'loader'" in warned[0] and "'MainThread'" in warned[0], caplog.messages
    assert "Give the calls of every thread but one a name" in warned[0]
    names: list[str] = []
    barrier = threading.Barrier(8)

    def take():
        barrier.wait()
        names.extend(frontend._auto_name("thread.names.test", None) for _ in range(50))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(names) == 400
    assert sorted(int(n.rsplit(".", 1)[1]) for n in names) == sorted(i % 128 for i in range(400))


@needs_engine
def test_unnamed_calls_reuse_names_and_more_in_flight_than_names_still_run_in_order():
    """Frontend [Note: unnamed calls reuse names]: the n-th unnamed call is named by slot
    n % AUTO_NAME_SLOTS (so a repeated lone call hits the negotiation cache), and a call whose
    slot is still in flight is held, not refused, then runs with its own data. Rank 0
    synchronizes in reverse order, so its later calls wait on held ones."""
    from unison.common.engine import requests

    count = requests.AUTO_NAME_SLOTS + 40
    frontend._counters.clear()
    handles = [unison.allreduce_async(np.full(3, float(i + R)), op=unison.Sum) for i in range(count)]
    order = range(count - 1, -1, -1) if R == 0 else range(count)
    got = {i: unison.synchronize(handles[i]) for i in order}
    for i in range(count):
        np.testing.assert_array_equal(got[i], np.full(3, float(N * i + N * (N - 1) // 2)))
    names = {frontend._auto_name("allreduce", None) for _ in range(2 * requests.AUTO_NAME_SLOTS)}
    assert len(names) == requests.AUTO_NAME_SLOTS
    frontend._counters.clear()


@pytest.mark.parametrize("compression, unit_roundoff", [(unison.Compression.fp16, 2.0 ** -11),
                                                        (unison.Compression.bf16, 2.0 ** -8)])
def test_compression_error_bounds(compression, unit_roundoff):
    # N roundings of the inputs and N - 1 of partial sums, each <= u relative to sum(|x|)
    rtol = (2 * N - 1) * unit_roundoff
    x = np.random.default_rng(R).normal(size=5000)
    got = unison.allreduce(x, op=unison.Sum, name=f"comp.{compression.__name__}", compression=compression)
    want = sum(np.random.default_rng(r).normal(size=5000) for r in range(N))
    assert got.dtype == np.float64
    scale = sum(np.abs(np.random.default_rng(r).normal(size=5000)) for r in range(N))
    assert np.max(np.abs(got - want) / scale) <= rtol
    assert np.max(np.abs(got - want) / scale) > 0  # it really was compressed


@needs_engine
def test_timeline_parses_and_holds_phases(tmp_path_factory):
    path = WORLD.bcast(str(tmp_path_factory.mktemp("tl") / "timeline.json") if R == 0 else None)
    unison.start_timeline(path)
    for _step in range(3):
        hs = [unison.allreduce_async(np.ones(100 + i), name=f"tl.{i}") for i in range(5)]
        for h in hs:
            unison.synchronize(h)
    unison.allreduce(np.ones(300_000, np.float32), name="tl.big")
    unison.stop_timeline()
    unison.barrier()
    if R == 0:
        events = json.load(open(path))
        assert not os.path.exists(path + ".tmp")
        phases = {e["name"] for e in events if e["ph"] in "BE"}
        for phase in ("NEGOTIATE_ALLREDUCE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE",
                      "MEMCPY_OUT_FUSION_BUFFER"):
            assert phase in phases, phases
        rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert {"tl.0", "tl.4", "tl.big"} <= rows
        marks = {e["name"] for e in events if e["ph"] == "i"}
        assert {f"rank {r} ready" for r in range(N)} <= marks
        opened = {}
        for e in events:  # every begin has its end
            if e["ph"] == "B":
                opened[(e["tid"], e["name"])] = opened.get((e["tid"], e["name"]), 0) + 1
            elif e["ph"] == "E":
                opened[(e["tid"], e["name"])] -= 1
        assert all(v == 0 for v in opened.values()), opened


@needs_engine
def test_a_restarted_timeline_marks_every_step_and_ends_failed_slices(tmp_path_factory):
    # the marks were a toggle: a second start_timeline turned them off (and UNISON_TIMELINE never
    # on); a failed collective's NEGOTIATE slice stayed open for ever
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("tl2")) if R == 0 else None)
    unison.start_timeline(folder + "/a.json")
    unison.allreduce(np.ones(3), name="tl2.warm")
    unison.start_timeline(folder + "/b.json")
    unison.allreduce(np.ones(3), name="tl2.warm2")
    for _ in range(3):
        unison.allreduce(np.ones(3), name="tl2.x")  # cached after the first
    with pytest.raises(unison.MismatchError):
        unison.allreduce(np.ones(3 + R), name="tl2.mismatch")
    unison.stop_timeline()
    unison.barrier()
    if R == 0:
        events = json.load(open(folder + "/b.json"))
        tid = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
        marks = [e for e in events if e["ph"] == "i" and e["tid"] == tid["tl2.x"]]
        assert len(marks) == 3 * N, marks
        for name, t in tid.items():
            begun = sum(e["ph"] == "B" for e in events if e.get("tid") == t)
            ended = sum(e["ph"] == "E" for e in events if e.get("tid") == t)
            assert begun == ended, (name, begun, ended)


def _nesting_faults(events: list) -> list:
    """Begin/end pairs that do not nest on their row: an end that is not the row's latest open slice,
    or a phase begun again inside itself."""
    stacks: dict = {}
    faults = []
    for e in events:
        st = stacks.setdefault(e.get("tid"), [])
        if e["ph"] == "B":
            if e["name"] in st:
                faults.append(("begun again inside itself", e))
            st.append(e["name"])
        elif e["ph"] == "E":
            if not st or st[-1] != e["name"]:
                faults.append(("ends a slice that is not the latest open one", e, list(st)))
            if e["name"] in st:
                del st[len(st) - 1 - st[::-1].index(e["name"])]
    return faults + [("left open", tid, st) for tid, st in stacks.items() if st]


@needs_engine
def test_timeline_rows_nest_for_held_unnamed_calls_and_for_one_name_on_two_sets(tmp_path_factory):
    """Before 2026-12-07: an unnamed call held behind an earlier one of the same automatic name began its
    negotiation slice at submission, inside the earlier one's on the same row (300 calls on 128 names: 172
    slices nested wrongly, negotiation times given to other calls); one name in flight on the job and on a
    process set shared a row; and a set's ready marks named ranks of the set ('rank 1' for job rank 2)."""
    path = WORLD.bcast(str(tmp_path_factory.mktemp("tl3") / "timeline.json") if R == 0 else None)
    last = N - 1
    ps = unison.add_process_set([0, last])
    try:
        unison.start_timeline(path)
        hs = [unison.allreduce_async(np.full(2, float(i)), op=unison.Sum) for i in range(300)]
        for i, h in enumerate(hs):
            np.testing.assert_array_equal(unison.synchronize(h), [N * float(i)] * 2)
        for _step in range(3):
            inner = unison.allreduce_async(np.ones(2), op=unison.Sum, name="tl3.same", process_set=ps) \
                if R in (0, last) else None
            if R == last:
                time.sleep(0.02)  # the last rank is late on both
            outer = unison.allreduce_async(np.ones(2), op=unison.Sum, name="tl3.same")
            assert unison.synchronize(outer).tolist() == [N, N]
            if inner is not None:
                assert unison.synchronize(inner).tolist() == [2, 2]
        unison.stop_timeline()
        unison.barrier()
    finally:
        unison.remove_process_set(ps)
    if R == 0:
        events = json.load(open(path))
        assert _nesting_faults(events) == []
        rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        set_rows = [t for t, name in rows.items() if name.startswith("tl3.same [process set ")]
        job_rows = [t for t, name in rows.items() if name == "tl3.same"]
        assert len(set_rows) == 1 and len(job_rows) == 1, rows
        marks = {e["name"] for e in events if e["ph"] == "i" and e["tid"] == set_rows[0]}
        assert marks == {"rank 0 ready", f"rank {last} ready"}, marks
        negotiations = [e for e in events if e["ph"] == "B" and e["name"] == "NEGOTIATE_ALLREDUCE"
                        and e["tid"] == set_rows[0]]
        assert len(negotiations) == 3


@needs_engine
def test_response_cache_evicts_least_recently_used_consistently():
    ctl = frontend.engine()._sets[0].controller
    old = ctl.capacity
    ctl.capacity = 3  # every rank, same point in the program
    try:
        for _step in range(4):
            for i in range(7):
                got = unison.allreduce(np.full(2, float(i + R)), op=unison.Sum, name=f"lru.{i}")
                np.testing.assert_array_equal(got, np.full(2, float(N * i + sum(range(N)))))
            assert len(ctl.cache_bit) <= 3
        cached = WORLD.allgather(sorted(ctl.cache_bit.items()))
        assert all(c == cached[0] for c in cached)  # same names on the same bits everywhere
    finally:
        ctl.capacity = old


_REFERENCE = {unison.Sum: lambda s: s.sum(axis=0), unison.Average: lambda s: s.mean(axis=0),
              unison.Min: lambda s: s.min(axis=0), unison.Max: lambda s: s.max(axis=0),
              unison.Product: lambda s: s.prod(axis=0)}


@needs_engine
def test_a_names_repeated_allreduces_run_each_calls_own_signature():
    """A name's single all-reduce that MPI's own call runs is looked up once, on its second run
    (executor._NativeAllreduce); a later call of that name with another shape, dtype, op or scale
    factor is announced anew and must run as itself, never with the lookup kept for the old one,
    and the lookup must give the same numbers as the full path (Average and postscale finish after
    MPI's sum; float16 goes to MPI with numpy's op; an int8 average sums in a wider type, the
    kernels' own path, so it is not looked up)."""
    cases = [((5,), np.float32, unison.Sum, 1.0), ((3, 2), np.float32, unison.Sum, 1.0),
             ((5,), np.float64, unison.Average, 1.0), ((5,), np.int32, unison.Max, 1.0),
             ((5,), np.float32, unison.Sum, 0.5), ((), np.float64, unison.Min, 1.0),
             ((5,), np.int8, unison.Average, 1.0), ((5,), np.float16, unison.Sum, 1.0),
             ((2, 2), np.int64, unison.Product, 1.0), ((5,), np.float32, unison.Sum, 1.0)]
    eng = frontend.engine()
    # each signature three times in a row: the first runs in full, the second makes its lookup, the
    # third uses it; under "sig.same" the first call of each signature finds the lookup made for the
    # signature before it, which it must not use
    for i, (shape, dtype, op, post) in enumerate(cases):
        for rep in range(3):
            stack = np.stack([(np.arange(int(np.prod(shape))).reshape(shape) % 3 + r + i - rep).astype(dtype)
                              for r in range(N)])
            for name in ("sig.same", f"sig.{i}"):
                got = unison.allreduce(stack[R], op=op, name=name, postscale_factor=post)
                want = _REFERENCE[op](stack.astype(np.float64)) * post
                assert got.shape == shape and got.dtype == dtype, (name, got.shape, got.dtype)
                if np.issubdtype(dtype, np.integer):
                    want = np.trunc(want)
                rtol = 1e-3 if dtype == np.float16 else 1e-12
                np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol,
                                           err_msg=f"{name} {shape} {np.dtype(dtype)} {op} {post}")
    plans = eng._sets[0].executor._plans
    assert plans["sig.0"].direct and plans["sig.7"].direct and plans["sig.same"].sig == plans["sig.9"].sig
    assert not plans["sig.6"].direct  # int8 average: a wider sum, the kernels' own path


@needs_engine
def test_threads_blocked_on_handles_wake_when_another_threads_cycle_completes_them():
    """A thread blocked in ``synchronize`` wakes as soon as another thread's cycle completes its
    handle; the completing side takes no lock when no thread is blocked, so a wake-up lost to that
    shortcut would leave the waiter asleep until its liveness check, a second later. The waits count
    such late finds (``handles.lost_wakeups``): none may happen. (Until 2026-12-05 this compared the
    slowest calls with 0.9 s, which a call across test hosts' TCP links once exceeded, at 2.25 s, with
    no wake-up lost.)"""
    import threading

    from unison.common.engine import handles

    lost_before = handles.lost_wakeups()

    times: list[float] = []
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(15):
                t0 = time.perf_counter()
                got = unison.allreduce(np.full(3, float(R + k)), op=unison.Sum, name=f"wake.{k}.{i}")
                times.append(time.perf_counter() - t0)
                np.testing.assert_array_equal(got, np.full(3, float(sum(range(N)) + N * k)))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(times) == 45
    lost = WORLD.allgather(handles.lost_wakeups() - lost_before)
    slow = WORLD.allgather(sorted(times)[-3:])
    assert lost == [0] * N, f"waits woken only by the liveness timeout, per rank: {lost}; slowest calls {slow}"


# keep last: it kills this rank's engine thread on purpose
@needs_engine
def test_row_weighted_averages_stay_in_fp16_range():
    """Before: with uneven rows each rank multiplied its gradient by its rows before the fp16 cast and the sum
    was divided after it, so gradients whose mean fits fp16 came back inf (an uneven last batch under
    unison.keras with compression=fp16)."""
    from unison.common.data_parallel import GradientStream, average_gradients

    rows = 100 + 37 * R
    mine = np.full(3, 400.0 * (R + 1), np.float32)
    want = sum((100 + 37 * r) * 400.0 * (r + 1) for r in range(N)) / sum(100 + 37 * r for r in range(N))
    (got,) = average_gradients([mine], rows=rows, compression=unison.Compression.fp16)
    np.testing.assert_allclose(got, np.full(3, want), rtol=2e-3)
    stream = GradientStream(rows, compression=unison.Compression.fp16, prefix="fp16.rows")
    stream.submit(0, mine)
    np.testing.assert_allclose(stream.results([0])[0], np.full(3, want), rtol=2e-3)


@needs_engine
def test_row_weighting_beside_the_gradients_matches_deciding_first():
    """The ranks' rows travel beside the gradients' plain average (data_parallel [Note: rows beside the
    gradients]); a step whose rows differ reduces again, weighed. Equal rows give exactly the plain average;
    unequal ones the weighted mean; rows of 0 everywhere the plain average; in a stream too, several steps
    in a row (a decision left over from one step would weigh the next)."""
    from unison.common.data_parallel import GradientStream, average_gradients

    grads = [np.linspace(-1, 1, 7, dtype=np.float32) * (R + 1) / 3, np.full((2, 2), 0.1 * (R + 1), np.float64)]
    plain = unison.grouped_allreduce(grads, op=unison.Average, name="rows.plain")
    for rows in (32, 0):
        got = average_gradients(grads, rows=rows)
        for g, p in zip(got, plain, strict=True):
            np.testing.assert_array_equal(g, p)
    rows = [5, 3, 1, 4][R]
    total = sum([5, 3, 1, 4][:N])
    want = [sum(np.linspace(-1, 1, 7) * (r + 1) / 3 * [5, 3, 1, 4][r] for r in range(N)) / total,
            sum(np.full((2, 2), 0.1 * (r + 1)) * [5, 3, 1, 4][r] for r in range(N)) / total]
    for step_rows in (rows, 8, rows):
        got = average_gradients(grads, rows=step_rows)
        expect = want if step_rows == rows and N > 1 else plain
        for g, w, a in zip(got, expect, grads, strict=True):
            assert g.dtype == a.dtype and g.shape == a.shape
            np.testing.assert_allclose(g, w, rtol=1e-6)
        stream = GradientStream(step_rows, prefix="rows.stream")
        for key in (1, 0):  # any order
            stream.submit(key, grads[key])
        for g, w in zip(stream.results([0, 1]), expect, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6)
        stream.drain()
    with pytest.raises(ValueError, match="cannot be negative"):
        average_gradients(grads, rows=-100)
    stream = GradientStream(rows, prefix="rows.unused")  # a step that ended before any gradient
    stream.drain()
    np.testing.assert_array_equal(unison.allreduce(np.ones(2), op=unison.Sum, name="rows.after"), np.full(2, N))


@needs_engine
def test_allreduce_with_compression_writes_into_out():
    """Before: out= was checked against the float16 wire array (a float32 out= was refused on every rank) and a
    float16 one was left out of the result."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3) + R
    want = sum(np.arange(6, dtype=np.float32).reshape(2, 3) + r for r in range(N))
    out = np.zeros((2, 3), np.float32)
    got = unison.allreduce(x, op=unison.Sum, name="comp.out", compression=unison.Compression.fp16, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)
    got = unison.allreduce(x, op=unison.Sum, name="comp.inplace", compression=unison.Compression.bf16, out=x)
    assert got is x
    np.testing.assert_array_equal(x, want)
    with pytest.raises(unison.InvalidArgumentError, match="out="):
        unison.allreduce(x, name="comp.bad", compression=unison.Compression.fp16, out=np.zeros(4, np.float32))


@needs_engine
@pytest.mark.parametrize("algorithm", ["ring", "auto", "mpi"])
@pytest.mark.parametrize("where", ["inside", "before"])
def test_an_engine_out_overlapping_part_of_the_input_gets_the_sum(algorithm, where):
    """Before 2026-12-07 the engine handed an out= half way into the input to the ring as it came, which read
    segments it had already overwritten: 50000 of 300000 elements wrong on every rank at np 3 (an audit; the
    direct API had been fixed the same day). A true in-place call (out=x) keeps writing into x."""
    n = 300_000
    want = sum(np.arange(n, dtype=np.float64) + r for r in range(N))
    for k in range(2):  # the first call, then one the engine may have planned
        buf = np.zeros(n + n // 2)
        x, out = (buf[:n], buf[n // 2:]) if where == "inside" else (buf[n // 2:], buf[:n])
        x[:] = np.arange(n, dtype=np.float64) + R
        got = unison.allreduce(x, op=unison.Sum, name=f"overlap.{algorithm}.{where}.{k}", out=out,
                               algorithm=algorithm)
        assert got is out
        np.testing.assert_array_equal(out, want)
    x = np.arange(n, dtype=np.float64) + R
    assert unison.allreduce(x, op=unison.Sum, name=f"overlap.{algorithm}.{where}.inplace", out=x,
                            algorithm=algorithm) is x
    np.testing.assert_array_equal(x, want)


@needs_engine
def test_a_process_forked_after_init_refuses_collectives_and_leaves_the_parents_engine_alone():
    """[Note: a process forked after init()]: before 2026-12-07 a collective in a forked child ran the engine's
    negotiation over the parent's MPI endpoints: it paired with the other ranks' children or hung, and the
    parent's next collective failed (MPI_ERR_TRUNCATE, the job aborted) or hung (an audit)."""
    unison.allreduce(np.ones(3), op=unison.Sum, name="before.fork")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what it can read, then the collective
        try:
            said = f"{unison.rank()} {unison.size()} "
            try:
                unison.allreduce(np.ones(3), op=unison.Sum, name="in.the.child")
                said += "no error"
            except unison.UnisonError as exc:
                said += f"{type(exc).__name__}: {exc}"
            os.write(write_fd, said.encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    with os.fdopen(read_fd) as pipe:
        said = pipe.read()
    assert said.startswith(f"{R} {N} ForkedProcessError: this process was forked from rank {R} after "
                           "unison.init()"), said
    assert "'spawn' or 'forkserver'" in said
    for k in range(3):  # the parent's engine goes on, every rank alike
        got = unison.allreduce(np.full(3, float(R)), op=unison.Sum, name=f"after.fork.{k}")
        np.testing.assert_array_equal(got, np.full(3, float(sum(range(N)))))


def test_is_homogeneous_asked_on_one_rank_after_init_is_local():
    """Before: the query's init hook was registered only when a backend was imported, so a backend imported after
    init() made its first call a collective on the job's communicator: one rank asking alone hung the job or
    garbled the next collective (MPI_ERR_TRUNCATE). `import unison` now registers the hook."""
    from unison.common import capabilities

    if R == 0:
        assert capabilities.is_homogeneous() is True  # (one host here)
    np.testing.assert_array_equal(unison.allreduce(np.full(3, 1.0), op=unison.Sum, name="after.homogeneous"),
                                  np.full(3, float(N)))

@pytest.mark.skipif(N < 3, reason="a set whose positions differ from its job ranks")
def test_errors_on_a_process_set_name_job_ranks(caplog):
    """On the set [1, 2], positions 0 and 1 are job ranks 1 and 2. Before: mismatch, argument and join errors
    named positions ("rank 0" for job rank 1, a rank not even in the set)."""
    tail = unison.add_process_set(unison.ProcessSet([1, 2]))
    try:
        if R in (1, 2):
            with pytest.raises(unison.MismatchError, match=r"rank 1: [^;]*\(2,\)[^;]*; rank 2: [^;]*\(3,\)"):
                unison.allreduce(np.ones(R + 1), name="jobranks.shape", process_set=tail)
            with pytest.raises(unison.CollectiveError, match=r"failed on 1 of 2 rank\(s\): rank 2: "):
                unison.allreduce(np.ones(2, np.float32), op=unison.Band if R == 2 else unison.Sum,
                                 name="jobranks.op", process_set=tail)
        if R == 1:
            with caplog.at_level(logging.WARNING, logger="unison"):
                unison.join()
            assert "submitted by rank(s) [2]" in caplog.text, caplog.text
        elif R == 2:
            with pytest.raises(JoinError, match=r"rank\(s\) \[1\] had joined"):
                unison.allgather(np.ones(1), name="jobranks.gather", process_set=tail)
            unison.join()
        else:
            unison.join()
    finally:
        unison.remove_process_set(tail)

@needs_engine
def test_engine_thread_error_reaches_caller(monkeypatch):
    from unison.collectives import kernels

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure in the engine thread")

    monkeypatch.setattr(kernels, "alltoallv", boom)
    with pytest.raises(RuntimeError, match="injected failure") as info:
        unison.alltoall(np.arange(N, dtype=np.float32), name="boom")
    assert any("boom" in str(tb.name) for tb in info.traceback)  # the original traceback
    with pytest.raises(RuntimeError, match="injected failure"):
        unison.allreduce(np.ones(2), name="after.boom")


@needs_engine
def test_zz_a_shutdown_frees_the_engines_communicators_and_a_removed_set_is_let_go():
    """A leak audit (2026-12-06): every init()/shutdown() kept the engine's communicators (three, six with a
    process set; Open MPI keeps about 65,000), and every added and removed set stayed in the engine's table
    with its counters. Now a clean stop frees them, and a removed set's slot is emptied (ids not reused)."""
    from mpi4py import MPI

    from unison.common.engine import frontend

    unison.shutdown()  # (a test before failed this engine on purpose: a failed engine keeps its communicators)
    unison.init()
    ps = unison.add_process_set(list(range(N)))
    sid = ps.process_set_id
    eng = frontend.running_engine()
    np.testing.assert_array_equal(unison.allreduce(np.ones(2), op=unison.Sum, process_set=ps), [N, N])
    assert unison.remove_process_set(ps) and eng._set_objs[sid] is None and ps not in eng.registered_sets()
    kept = unison.add_process_set(list(range(N)))
    assert kept.process_set_id == sid + 1  # (ids are never reused)
    comms = [st.comm for st in eng._sets.values()]
    assert len(comms) == 2
    unison.shutdown()
    assert all(c == MPI.COMM_NULL for c in comms)  # (mpi4py nulls a freed handle)
    unison.init()
    np.testing.assert_array_equal(unison.allreduce(np.ones(2), op=unison.Sum, name="after.free"), [N, N])


def test_zz_a_new_init_names_unnamed_calls_alike_whatever_each_rank_counted_before():
    """Ranks reach a new init() with different counts of unnamed calls (here rank 0 called broadcast_object
    before init, which raised but had taken a name; a peer's shutdown fails some calls on some ranks alike).
    Before: the counters carried over, and the first unnamed call after init() hung on every rank."""
    unison.shutdown()
    if R == 0:
        with pytest.raises(unison.NotInitializedError):
            objects.broadcast_object("too early")
    unison.init()
    assert objects.broadcast_object(R, root_rank=0) == 0
    np.testing.assert_array_equal(unison.allreduce(np.ones(2), op=unison.Sum), [N, N])


def test_a_call_on_a_removed_set_takes_no_name_from_the_global_sets_unnamed_calls():
    """Before 2026-12-07 a refused call on a removed set still took the global set's next unnamed name, so the
    ranks that made it paired their next unnamed calls with the others' previous ones: rank 0's second sum got
    the others' first (silently), and the rest stalled (found by an audit)."""
    if N == 1:
        pytest.skip("needs a rank that makes the refused call and one that does not")
    stale = unison.add_process_set(list(range(1, N)))
    unison.remove_process_set(stale)
    if R > 0:
        for call in (lambda: unison.allreduce(np.ones(1), process_set=stale),
                     lambda: unison.allgather(np.ones(1), process_set=stale),
                     lambda: unison.grouped_allreduce([np.ones(1)], process_set=stale),
                     lambda: objects.broadcast_object(1, root_rank=1, process_set=stale)):
            with pytest.raises(ValueError, match="is not registered"):
                call()
    first = unison.allreduce_async(np.ones(1), op=unison.Sum)
    second = unison.allreduce_async(np.full(1, 100.0), op=unison.Sum)
    np.testing.assert_array_equal(unison.synchronize(first), [N])
    np.testing.assert_array_equal(unison.synchronize(second), [100.0 * N])


def test_an_empty_group_returns_an_empty_list_and_never_pairs_with_a_plain_allreduce():
    """Before 2026-12-07 an empty group was described as a plain all-reduce of its empty uint8 placeholder: it
    returned that array (a list in one process) and paired with another rank's allreduce of 0 uint8s."""
    assert unison.grouped_allreduce([], name="empty.group") == []
    assert unison.grouped_allreduce([], op=unison.Sum, name="empty.group") == []  # (the cached name again)
    if N == 1:
        return
    with pytest.raises(unison.MismatchError) as info:
        if R == 0:
            unison.grouped_allreduce([], name="empty.vs.plain")
        else:
            unison.allreduce(np.zeros(0, np.uint8), name="empty.vs.plain")
    message = str(info.value)
    assert "allreduce of a group of 0 tensors" in message and "shape=(0,) dtype=uint8" in message, message
    assert len(set(WORLD.allgather(message))) == 1


class _RebuiltOnRankZeroOnly:
    """Pickles everywhere, unpickles on rank 0 only (as a class importable on one host only would)."""

    def __reduce__(self):
        return (_rebuild, ())


def _rebuild():
    if R != 0:
        raise RuntimeError("cannot rebuild here")
    return "rebuilt"


def test_an_object_that_cannot_be_unpickled_on_some_ranks_raises_on_every_rank():
    """Before 2026-12-07 broadcast_object's root returned at once (it does not unpickle) and allgather_object's
    rank 0 too, while the other ranks raised: their next collectives paired with the wrong calls (an audit)."""
    if N == 1:
        pytest.skip("needs a rank that cannot rebuild the object")
    failing = list(range(1, N))
    for call in (lambda: objects.broadcast_object(_RebuiltOnRankZeroOnly(), root_rank=0),
                 lambda: objects.allgather_object(_RebuiltOnRankZeroOnly())):
        with pytest.raises(TypeError) as info:
            call()
        assert f"ranks {failing} could not unpickle the object" in str(info.value), info.value
        assert (R == 0) == ("here:" not in str(info.value))
    np.testing.assert_array_equal(unison.allreduce(np.ones(1), op=unison.Sum, name="after.unpickle"), [N])
