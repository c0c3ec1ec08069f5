"""horovod.tensorflow 0.28 parity under mpirun: each test asserts Horovod's behaviour against numpy.

Every test body runs unchanged at any rank count (np 3 in
tests/test_tf_parity_mpi.py). Tests named after docs/horovod.md rows.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import unison.tf_backend as hvd

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
MODES = pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
MULTI = pytest.mark.skipif(N == 1, reason="ranks can only disagree, or a set leave some out, with 2+ ranks")
NUMERIC = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32,
           tf.float64]


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    yield
    hvd.shutdown()


def run(fn, graph, *args):
    return (tf.function(fn) if graph else fn)(*args)


def within(seconds, fn):
    """``fn()`` in a thread; fails (and the suite aborts the job) if it has not returned in time."""
    box = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["exc"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"rank {R}: hung for {seconds}s (TF_NUM_INTEROP_THREADS="
                    f"{os.environ.get('TF_NUM_INTEROP_THREADS')})")
    if "exc" in box:
        raise box["exc"]
    return box["out"]


# ------------------------------------------------------------------------ hangs
def test_independent_ops_in_one_graph_do_not_hang():
    """20 allreduces + allgather + broadcast built in a different order on each rank, evaluated at once."""
    k = 20
    order = list(range(k)) if R % 2 == 0 else list(reversed(range(k)))

    @tf.function
    def step(x):
        out = {}
        for i in order:
            out[i] = hvd.allreduce(x * float(i + R), op=hvd.Sum, name=f"hang.ar.{i}")
            if i == k // 2:
                out["g"] = hvd.allgather(tf.fill([R + 1], float(R)), name="hang.ag")
                out["b"] = hvd.broadcast(x + float(R), root_rank=N - 1, name="hang.bc")
        return [out[i] for i in range(k)] + [out["g"], out["b"]]

    res = within(150, lambda: step(tf.ones([3])))
    for i in range(k):
        np.testing.assert_allclose(res[i].numpy(), np.full(3, sum(i + r for r in range(N))))
    np.testing.assert_allclose(res[k].numpy(), np.concatenate([np.full(r + 1, float(r)) for r in range(N)]))
    np.testing.assert_allclose(res[k + 1].numpy(), np.full(3, float(N)))


def test_a_nested_function_and_its_caller_name_their_ops_apart():
    """A tf.function called inside another has a graph of its own: the unnamed allreduces of both were
    ``HorovodAllreduce_x_0``, two collectives in flight under one name (a duplicate-name error on every
    rank, every step). Gradients through the nested function too."""
    @tf.function
    def helper(x):
        return hvd.allreduce(x, op=hvd.Sum)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            tape.watch(y)
            b = helper(y)
            loss = tf.reduce_sum(b)
        a = hvd.allreduce(x, op=hvd.Sum)
        return a, b, tape.gradient(loss, y)

    for _ in range(2):
        a, b, g = within(150, lambda: step(tf.constant([1.0]), tf.constant([10.0 * (R + 1)])))
        assert a.numpy().tolist() == [float(N)]
        assert b.numpy().tolist() == [10.0 * sum(range(1, N + 1))]
        assert g.numpy().tolist() == [float(N)]  # the allreduce's gradient: the Sum of ones


def test_an_op_in_a_cond_agrees_on_its_name_after_one_rank_traced_more():
    # a tf.cond body's graph is named by a process-wide counter (cond_true_12): in the name of the op
    # inside it, ranks that had traced other code (rank 0's logging) disagreed, and waited for ever
    if R == 0:
        tf.function(lambda x: tf.cond(x > 0, lambda: x, lambda: -x))(tf.constant(1.0))

    @tf.function
    def inner(x):
        return tf.cond(x[0] > 0, lambda: hvd.allreduce(x, op=hvd.Sum), lambda: x)

    @tf.function
    def step(x):
        return inner(x)

    out = within(150, lambda: step(tf.ones(2)))
    assert out.numpy().tolist() == [float(N)] * 2


def test_dependent_and_variable_ops_in_one_graph():
    """Chains (allreduce of an allreduce), variable writes then reads, and independent ops together."""
    v = tf.Variable(tf.zeros([2]))

    @tf.function
    def step(x):
        a = hvd.allreduce(x, op=hvd.Sum, name="dep.a")
        v.assign(hvd.broadcast(x * float(R + 1), root_rank=0, name="dep.b"))
        b = hvd.allreduce(v.read_value() + a, op=hvd.Sum, name="dep.c")
        c = hvd.allreduce(a * 2.0, op=hvd.Sum, name="dep.d")
        d = hvd.allreduce(x * 3.0, op=hvd.Sum, name="dep.e")
        return a, b, c, d

    a, b, c, d = within(150, lambda: step(tf.ones([2])))
    np.testing.assert_allclose(a.numpy(), [N, N])
    np.testing.assert_allclose(b.numpy(), [N * (1 + N)] * 2)
    np.testing.assert_allclose(c.numpy(), [2 * N * N] * 2)
    np.testing.assert_allclose(d.numpy(), [3 * N] * 2)


def test_broadcast_gradient_in_graph_does_not_hang():
    xs = [tf.Variable(tf.fill([2], float(R + i))) for i in range(6)]
    order = list(range(6)) if R % 2 == 0 else list(reversed(range(6)))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            outs = {i: hvd.broadcast(xs[i], root_rank=i % N, name=f"bgrad.{i}") for i in order}
            loss = tf.add_n([tf.reduce_sum(outs[i]) * float(R + 1) for i in range(6)])
        return tape.gradient(loss, xs)

    grads = within(150, step)
    mean = sum(r + 1 for r in range(N)) / N
    for i, g in enumerate(grads):
        np.testing.assert_allclose(g.numpy(), np.full(2, mean if R == i % N else 0.0), rtol=1e-6)


def test_tf1_graph_session_independent_ops_and_errors():
    """A TF1 graph run by a Session: no program-order chain, same guarantees and error classes."""
    order = list(range(8)) if R % 2 == 0 else list(reversed(range(8)))
    graph = tf.Graph()
    with graph.as_default():
        outs = {i: hvd.allreduce(tf.constant([float(i + R)]), op=hvd.Sum, name=f"tf1.{i}") for i in order}
        bad = hvd.allreduce(tf.ones([2 + R]), name="tf1.bad")
        with tf.compat.v1.Session(graph=graph) as sess:
            res = within(150, lambda: sess.run([outs[i] for i in range(8)]))
            if N > 1:
                with pytest.raises(tf.errors.FailedPreconditionError):
                    sess.run(bad)
    for i in range(8):
        np.testing.assert_allclose(res[i], [sum(i + r for r in range(N))])


def test_tf1_session_running_one_collective_of_several_leaves_nothing_behind():
    """A run of one op also runs the others' submits, never collected ([Note: submits a session runs
    without their collects]): they do not pile up, nor collide with the next run's submissions."""
    from unison.tf_backend import host_ops

    graph = tf.Graph()
    with graph.as_default():
        a = hvd.allreduce(tf.constant([1.0 + R]), op=hvd.Sum, name="tf1s.a")
        b = hvd.allreduce(tf.constant([2.0 * R]), op=hvd.Sum, name="tf1s.b")
        with tf.compat.v1.Session(graph=graph) as sess:
            before = len(host_ops._pending)
            for i in range(30):
                fetch, want = (a, N + N * (N - 1) / 2) if i % 3 == 0 else (b, N * (N - 1))
                np.testing.assert_allclose(within(60, lambda f=fetch: sess.run(f)), [want])
            assert len(host_ops._pending) <= before + 2


def test_broadcast_global_variables_hook_in_a_monitored_session():
    """Horovod's hook for MonitoredTrainingSession (Horovod lacks it under TF 2.16+; TF1's hook class
    is still in tf.compat.v1): every rank starts from the root's variables."""
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.fill([2], float(R + 1)))
        step = tf.compat.v1.assign_add(w, hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="hook.step"))
        hook = hvd.BroadcastGlobalVariablesHook(N - 1)
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
            np.testing.assert_array_equal(sess.run(w), [float(N)] * 2)
            np.testing.assert_array_equal(within(60, lambda: sess.run(step)), [2.0 * N] * 2)


def test_tf1_a_run_needs_only_what_its_own_collectives_need():
    """[Note: TF1 graphs: which submits a collect waits for]: a run of one collective neither asks for
    another one's placeholder nor advances another one's iterator."""
    graph = tf.Graph()
    with graph.as_default():
        a = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="need.a")
        x = tf.compat.v1.placeholder(tf.float32, [2])
        b = hvd.allreduce(x, op=hvd.Sum, name="need.b")
        it = tf.compat.v1.data.make_one_shot_iterator(tf.data.Dataset.range(10))
        c = hvd.allreduce(tf.cast(it.get_next(), tf.float32), op=hvd.Sum, name="need.c")
        d = hvd.allreduce(tf.constant([2.0]), op=hvd.Sum, name="need.d")
        with tf.compat.v1.Session(graph=graph) as sess:
            for _ in range(3):
                np.testing.assert_allclose(within(60, lambda: sess.run(d)), [2.0 * N])
            np.testing.assert_allclose(within(60, lambda: sess.run(a)), [1.0 * N])
            np.testing.assert_allclose(within(60, lambda: sess.run(b, {x: [1.0, R]})), [N, sum(range(N))])
            np.testing.assert_allclose(within(60, lambda: sess.run(c)), 0.0)  # its first element


# ------------------------------------------------------------------------ dtypes
def _values(dtype, n=4):
    base = np.arange(n) % 3 + R + 1
    return tf.cast(tf.constant(base), dtype)


@MODES
@pytest.mark.parametrize("dtype", NUMERIC, ids=lambda d: d.name)
def test_dtypes_allreduce(graph, dtype):
    """Every dtype Horovod's TF ops take (uint16, int16, bfloat16 are extras for allreduce); dtype kept."""
    def fn():
        x = _values(dtype)
        return (hvd.allreduce(x, op=hvd.Sum, name=f"dt.s.{dtype.name}.{graph}"),
                hvd.allreduce(x, op=hvd.Max, name=f"dt.m.{dtype.name}.{graph}"),
                hvd.allreduce(x, op=hvd.Average, name=f"dt.a.{dtype.name}.{graph}"))

    s, m, a = run(fn, graph)
    per_rank = [np.arange(4) % 3 + r + 1 for r in range(N)]
    for t in (s, m, a):
        assert t.dtype == dtype
    np.testing.assert_array_equal(tf.cast(s, tf.float64).numpy(), np.sum(per_rank, axis=0))
    np.testing.assert_array_equal(tf.cast(m, tf.float64).numpy(), np.max(per_rank, axis=0))
    mean = np.sum(per_rank, axis=0) / N
    expect = mean if dtype.is_floating else np.trunc(mean)
    np.testing.assert_allclose(tf.cast(a, tf.float64).numpy(), expect, rtol=1e-2 if dtype.is_floating else 0)


@MODES
@pytest.mark.parametrize("dtype", NUMERIC + [tf.bool], ids=lambda d: d.name)
def test_dtypes_allgather_broadcast_alltoall(graph, dtype):
    def fn():
        x = tf.cast(tf.fill([N, 2], R + 1) if dtype != tf.bool else tf.fill([N, 2], R % 2 == 0), dtype)
        g = hvd.allgather(x, name=f"dt.g.{dtype.name}.{graph}")
        b = hvd.broadcast(x, root_rank=N - 1, name=f"dt.b.{dtype.name}.{graph}")
        a = hvd.alltoall(x, name=f"dt.t.{dtype.name}.{graph}")
        return g, b, a

    g, b, a = run(fn, graph)
    value = (lambda r: r + 1) if dtype != tf.bool else (lambda r: r % 2 == 0)
    for t in (g, b, a):
        assert t.dtype == dtype
    expect = np.concatenate([np.full((N, 2), value(r)) for r in range(N)])
    np.testing.assert_array_equal(tf.cast(g, tf.int64).numpy(), expect.astype(np.int64))
    np.testing.assert_array_equal(tf.cast(b, tf.int64).numpy(), np.full((N, 2), value(N - 1)).astype(np.int64))
    np.testing.assert_array_equal(tf.cast(a, tf.int64).numpy(),
                                  np.stack([np.full(2, value(r)) for r in range(N)]).astype(np.int64))


def test_uint16_exact_at_the_top_of_its_range():
    x = tf.constant([65535, 40000, 1], tf.uint16)
    g = hvd.allgather(x, name="u16.g")
    m = hvd.allreduce(x, op=hvd.Max, name="u16.m")
    np.testing.assert_array_equal(g.numpy(), np.tile([65535, 40000, 1], N))
    np.testing.assert_array_equal(m.numpy(), [65535, 40000, 1])
    assert g.dtype == tf.uint16 and m.dtype == tf.uint16


def test_unsupported_dtype_is_a_type_error():
    with pytest.raises(TypeError):
        hvd.allreduce(tf.constant(["a"]), name="bad.string")
    with pytest.raises(TypeError):
        hvd.allreduce(tf.constant([True]), name="bad.bool.avg")  # Average of bool


# ------------------------------------------------------------------------ error types
@MODES
@pytest.mark.parametrize("case", ["shape", "rank", "dtype", "root", "gather_trailing", "gather_dtype",
                                  "alltoall_dtype", "reducescatter_shape"])
@MULTI
def test_disagreeing_ranks_raise_failed_precondition(graph, case):
    """Horovod: ranks that disagree get tf.errors.FailedPreconditionError, eagerly and in graphs."""
    name = f"err.{case}.{graph}"

    def fn():
        if case == "shape":
            return hvd.allreduce(tf.ones([2 + R]), name=name)
        if case == "rank":
            return hvd.allreduce(tf.ones([2] * (1 + R % 2)), name=name)
        if case == "dtype":
            return hvd.allreduce(tf.ones([2], tf.float32 if R % 2 else tf.int32), op=hvd.Sum, name=name)
        if case == "root":
            return hvd.broadcast(tf.ones([2]), root_rank=R, name=name)
        if case == "gather_trailing":
            return hvd.allgather(tf.ones([2, 2 + R]), name=name)
        if case == "gather_dtype":
            return hvd.allgather(tf.ones([2], tf.float32 if R % 2 else tf.float64), name=name)
        if case == "alltoall_dtype":
            return hvd.alltoall(tf.ones([N], tf.float32 if R % 2 else tf.int32), name=name)
        return hvd.reducescatter(tf.ones([N, 2 + R]), op=hvd.Sum, name=name)

    with pytest.raises(tf.errors.FailedPreconditionError):
        run(fn, graph)


@MODES
@pytest.mark.parametrize("case", ["equal_split", "splits_sum", "root_out_of_range"])
def test_bad_arguments_raise_invalid_argument(graph, case):
    """Horovod: alltoall with a first dimension that does not split, or splits not summing, or a bad root."""
    name = f"arg.{case}.{graph}"
    if case == "equal_split" and N == 1:
        pytest.skip("every first dimension splits over one rank")

    def fn():
        if case == "equal_split":
            return hvd.alltoall(tf.ones([2 * N + 1]), name=name)
        if case == "splits_sum":
            return hvd.alltoall(tf.ones([N - 1]), splits=tf.ones([N], tf.int32), name=name)
        return hvd.broadcast(tf.ones([2]), root_rank=N + 5, name=name)

    with pytest.raises(tf.errors.InvalidArgumentError):
        run(fn, graph)


def test_reducescatter_scalar_is_invalid_argument():
    with pytest.raises(tf.errors.InvalidArgumentError):
        hvd.reducescatter(tf.constant(1.0))
    with pytest.raises(ValueError):
        tf.function(lambda: hvd.reducescatter(tf.constant(1.0))).get_concrete_function()


# ------------------------------------------------------------------------ alltoall
@MODES
@MULTI
def test_alltoall_splits_int32_and_received_splits(graph):
    """splits as an int32 tensor; rank r sends r+1... rows to rank j; rank 0 sends nothing."""
    splits = [0] * N if R == 0 else [j + 1 for j in range(N)]

    def fn():
        rows = sum(splits)
        x = tf.reshape(tf.range(rows * 2, dtype=tf.float32), [rows, 2]) + 100.0 * R
        return hvd.alltoall(x, splits=tf.constant(splits, tf.int32), name=f"a2a.int32.{graph}")

    out, recv = run(fn, graph)
    assert recv.dtype == tf.int32
    expect_recv = [0] + [R + 1] * (N - 1)
    np.testing.assert_array_equal(recv.numpy(), expect_recv)
    parts = []
    for r in range(1, N):
        send = [j + 1 for j in range(N)]
        start = sum(send[:R])
        x = np.arange(sum(send) * 2, dtype=np.float32).reshape(-1, 2) + 100.0 * r
        parts.append(x[start:start + send[R]])
    np.testing.assert_array_equal(out.numpy(), np.concatenate(parts).reshape(-1, 2))


@MODES
def test_alltoall_equal_split_returns_tensor_only(graph):
    def fn():
        return hvd.alltoall(tf.range(2 * N) + 10 * R, name=f"a2a.eq.{graph}")

    out = run(fn, graph)
    assert isinstance(out, tf.Tensor)
    np.testing.assert_array_equal(out.numpy(), np.concatenate([[2 * R, 2 * R + 1] for _ in range(N)])
                                  + np.repeat(10 * np.arange(N), 2))


@MODES
def test_alltoall_empty_input(graph):
    def fn():
        return hvd.alltoall(tf.zeros([0, 3]), splits=[0] * N, name=f"a2a.empty.{graph}")

    out, recv = run(fn, graph)
    assert out.shape == (0, 3) and recv.numpy().tolist() == [0] * N


# ------------------------------------------------------------------------ IndexedSlices
@MODES
@pytest.mark.parametrize("dtype", [tf.int32, tf.float32])
def test_indexed_slices_sum_and_average(graph, dtype):
    def fn():
        s = tf.IndexedSlices(tf.cast(tf.fill([1, 2], R + 1), dtype), tf.constant([R], tf.int64),
                             dense_shape=tf.constant([N, 2], tf.int64))
        return (hvd.allreduce(s, op=hvd.Sum, name=f"is.s.{dtype.name}.{graph}"),
                hvd.allreduce(s, op=hvd.Average, name=f"is.a.{dtype.name}.{graph}"))

    s, a = run(fn, graph)
    assert s.values.dtype == dtype
    np.testing.assert_array_equal(s.indices.numpy(), np.arange(N))
    np.testing.assert_array_equal(s.values.numpy(), np.stack([np.full(2, r + 1) for r in range(N)]))
    # Horovod divides the values by the size with `/`: integers become floats
    np.testing.assert_allclose(a.values.numpy(), np.stack([np.full(2, (r + 1) / N) for r in range(N)]))


def test_indexed_slices_refuse_scale_factors_and_other_ops():
    s = tf.IndexedSlices(tf.ones([1, 2], tf.int32), tf.constant([0], tf.int64), tf.constant([1, 2], tf.int64))
    with pytest.raises(NotImplementedError):
        hvd.allreduce(s, op=hvd.Sum, prescale_factor=2.0, name="is.pre")
    with pytest.raises(NotImplementedError):
        hvd.allreduce(s, op=hvd.Max, name="is.max")


@MODES
def test_grouped_allreduce_mixes_indexed_slices_and_dense(graph):
    def fn():
        s = tf.IndexedSlices(tf.fill([1, 2], float(R + 1)), tf.constant([R], tf.int64), tf.constant([N, 2],
                                                                                                   tf.int64))
        return hvd.grouped_allreduce([tf.fill([3], float(R)), s, tf.fill([2], R)], op=hvd.Sum,
                                     name=f"mix.{graph}")

    d, s, i = run(fn, graph)
    np.testing.assert_array_equal(d.numpy(), np.full(3, sum(range(N))))
    assert isinstance(s, tf.IndexedSlices)
    np.testing.assert_array_equal(s.values.numpy(), np.stack([np.full(2, r + 1.0) for r in range(N)]))
    np.testing.assert_array_equal(i.numpy(), np.full(2, sum(range(N))))
    assert hvd.grouped_allreduce([]) == []


# ------------------------------------------------------------------------ grouped gather / scatter
@MODES
def test_grouped_allgather_and_reducescatter(graph):
    def fn():
        g = hvd.grouped_allgather([tf.fill([R + 1, 2], R), tf.fill([1], float(R))], name=f"gg.{graph}")
        rs = hvd.grouped_reducescatter([tf.ones([2 * N, 2]) * float(R + 1), tf.ones([N]) * float(R)],
                                       op=hvd.Sum)
        ra = hvd.grouped_reducescatter([tf.ones([N, 3]) * float(R + 1)])
        return g, rs, ra

    g, rs, ra = run(fn, graph)
    np.testing.assert_array_equal(g[0].numpy(), np.concatenate([np.full((r + 1, 2), r) for r in range(N)]))
    np.testing.assert_array_equal(g[1].numpy(), np.arange(N, dtype=np.float32))
    total = sum(r + 1 for r in range(N))
    np.testing.assert_array_equal(rs[0].numpy(), np.full((2, 2), float(total)))
    np.testing.assert_array_equal(rs[1].numpy(), np.full(1, float(sum(range(N)))))
    np.testing.assert_allclose(ra[0].numpy(), np.full((1, 3), total / N))
    assert hvd.grouped_reducescatter([]) == []


# ------------------------------------------------------------------------ gradients
@MODES
def test_gradients_as_horovod(graph):
    """Horovod 0.28's gradients: allgather/broadcast average, reducescatter Sum scales by size."""
    def fn():
        x = tf.ones([N, 2])
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            w = float(R + 1)
            y_ag = tf.reduce_sum(hvd.allgather(x, name=f"gr.ag.{graph}") * w)
            y_bc = tf.reduce_sum(hvd.broadcast(x, 0, name=f"gr.bc.{graph}") * w)
            y_rs = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum, name=f"gr.rs.{graph}") * w)
            y_ra = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Average, name=f"gr.ra.{graph}") * w)
            y_ar = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum, name=f"gr.ar.{graph}") * w)
            y_gg = tf.reduce_sum(hvd.grouped_allgather([x], name=f"gr.gg.{graph}")[0] * w)
        return [tape.gradient(y, x) for y in (y_ag, y_bc, y_rs, y_ra, y_ar, y_gg)]

    g_ag, g_bc, g_rs, g_ra, g_ar, g_gg = run(fn, graph)
    mean = sum(r + 1 for r in range(N)) / N
    rows = np.concatenate([np.full((1, 2), float(r + 1)) for r in range(N)])
    np.testing.assert_allclose(g_ag.numpy(), np.full((N, 2), mean))
    np.testing.assert_allclose(g_gg.numpy(), np.full((N, 2), mean))
    np.testing.assert_allclose(g_bc.numpy(), np.full((N, 2), mean if R == 0 else 0.0))
    np.testing.assert_allclose(g_rs.numpy(), rows * N)
    np.testing.assert_allclose(g_ra.numpy(), rows)
    np.testing.assert_allclose(g_ar.numpy(), np.full((N, 2), mean * N))


# ------------------------------------------------------------------------ compression
@MODES
def test_compression_fp16_on_symbolic_tensors(graph):
    def fn():
        x = tf.fill([3], 1.5 + R)
        wire, ctx = hvd.Compression.fp16.compress(x)
        y = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16, name=f"fp16.{graph}")
        return wire, hvd.Compression.fp16.decompress(wire, ctx), y

    wire, back, y = run(fn, graph)
    assert isinstance(wire, tf.Tensor) and wire.dtype == tf.float16
    assert back.dtype == tf.float32 and y.dtype == tf.float32
    np.testing.assert_allclose(y.numpy(), np.full(3, sum(1.5 + r for r in range(N))))


# ------------------------------------------------------------------------ broadcast_, objects
@MODES
def test_broadcast_inplace_on_variables(graph):
    vs = [tf.Variable(tf.fill([2], float(R))), tf.Variable(tf.fill([3], R))]

    def fn():
        return hvd.broadcast_(vs, root_rank=N - 1, name=f"bip.{graph}")

    out = run(fn, graph)
    np.testing.assert_array_equal(vs[0].numpy(), np.full(2, float(N - 1)))
    np.testing.assert_array_equal(vs[1].numpy(), np.full(3, N - 1))
    np.testing.assert_array_equal(out[1].numpy(), np.full(3, N - 1))


def test_objects_and_global_variables():
    assert hvd.broadcast_object({"r": R}, root_rank=N - 1) == {"r": N - 1}
    assert hvd.broadcast_object_fn(root_rank=0)(R) == 0
    assert hvd.allgather_object(R) == list(range(N))
    with pytest.raises(RuntimeError):
        hvd.broadcast_global_variables(0)


def test_tf1_broadcast_global_variables_is_an_op_that_assigns_the_roots_values():
    """In a TF1 graph Horovod returns the broadcast as an op to run (nothing runs otherwise); then
    training steps run without broadcasting again, and nothing is left pending."""
    from unison.tf_backend import host_ops

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3])  # the batch: the broadcast must not ask for it
        w = tf.compat.v1.get_variable("w", initializer=tf.fill([3], float(R + 1)))
        k = tf.compat.v1.get_variable("k", initializer=tf.fill([2], R + 5), dtype=tf.int32)
        grad = tf.gradients(tf.reduce_sum(x * w * w), [w])[0]
        train = tf.compat.v1.assign_sub(w, 0.1 * hvd.allreduce(grad, name="tf1b.grad"))
        bcast = hvd.broadcast_global_variables(N - 1)
        assert isinstance(bcast, tf.Operation)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(bcast)
            np.testing.assert_array_equal(sess.run(w), np.full(3, float(N)))
            np.testing.assert_array_equal(sess.run(k), np.full(2, N + 4))
            before = len(host_ops._pending)
            for _ in range(3):
                within(60, lambda: sess.run(train, {x: np.ones(3)}))
            np.testing.assert_allclose(sess.run(w), np.full(3, float(N) * 0.8 ** 3), rtol=1e-6)
            assert len(host_ops._pending) <= before + len(graph.get_collection("variables")) + 1


# ------------------------------------------------------------------------ queries, ops, process sets
def test_build_queries_and_scalar_ops():
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert not any(f() for f in (hvd.gloo_built, hvd.gloo_enabled, hvd.nccl_built, hvd.ddl_built,
                                 hvd.ccl_built, hvd.cuda_built, hvd.rocm_built))
    assert hvd.is_homogeneous() is True
    assert hvd.check_num_rank_power_of_2(4) and not hvd.check_num_rank_power_of_2(3)
    assert int(hvd.size_op()) == N and int(hvd.rank_op()) == R
    assert int(hvd.local_size_op()) == hvd.local_size() and int(hvd.local_rank_op()) == hvd.local_rank()
    assert int(hvd.process_set_included_op(0)) == 1
    assert hvd.handle_average_backwards_compatibility(None, None) == hvd.Average
    assert hvd.handle_average_backwards_compatibility(None, False) == hvd.Sum


@MULTI
def test_process_sets():
    ps = hvd.add_process_set([0, N - 1])
    ps_id = ps.process_set_id
    member = R in (0, N - 1)
    if member:
        s = hvd.allreduce(tf.fill([2], float(R)), op=hvd.Sum, process_set=ps, name="ps.sum")
        b = hvd.broadcast(tf.fill([2], float(R)), root_rank=N - 1, process_set=ps, name="ps.bc")
        np.testing.assert_array_equal(s.numpy(), np.full(2, float(N - 1)))
        np.testing.assert_array_equal(b.numpy(), np.full(2, float(N - 1)))
        assert int(hvd.size_op(ps.process_set_id)) == 2
        assert int(hvd.process_set_included_op(ps.process_set_id)) == 1
    else:
        with pytest.raises(tf.errors.InvalidArgumentError):
            hvd.allreduce(tf.ones([2]), process_set=ps, name="ps.nonmember")
        assert int(hvd.process_set_included_op(ps.process_set_id)) == 0
    assert hvd.remove_process_set(ps) is True
    assert hvd.remove_process_set(hvd.global_process_set) is False
    # a set's id after another set was removed (the removed one's slot is emptied: the lookup by id raised
    # AttributeError on it, found by a review, 2026-12-06)
    from unison.tf_backend.basics import process_set_by_id

    later = hvd.add_process_set(list(range(N)))
    assert process_set_by_id(later.process_set_id) is later
    assert int(hvd.size_op(later.process_set_id)) == N
    assert int(hvd.process_set_included_op(later.process_set_id)) == 1
    with pytest.raises(ValueError, match=f"process_set_id={ps_id} names no registered process set"):
        process_set_by_id(ps_id)
    assert hvd.remove_process_set(later) is True


# ------------------------------------------------------------------------ public names
HVD_TF_NAMES = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous", "rank_op", "local_rank_op",
    "size_op", "local_size_op", "process_set_included_op", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Average",
    "Sum", "Adasum", "Min", "Max", "Product", "handle_average_backwards_compatibility",
    "check_num_rank_power_of_2", "join", "allgather_object", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "Compression", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "alltoall", "allreduce", "reducescatter", "grouped_allreduce", "grouped_reducescatter",
    "broadcast_global_variables", "DistributedGradientTape", "DistributedOptimizer", "SyncBatchNormalization",
]


def test_distributed_optimizer_checks_and_delegates():
    import keras

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert isinstance(opt, keras.optimizers.SGD)
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(object())
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)
    for refused in ({"backward_passes_per_step": 2}, {"op": hvd.Adasum}):
        with pytest.raises(NotImplementedError, match="not supported for TF1 optimizers"):
            hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), **refused)


@pytest.mark.parametrize("sparse_as_dense", [False, True], ids=["sparse", "sparse_as_dense"])
def test_tf1_distributed_optimizer_trains_as_one_process_on_the_global_batch(sparse_as_dense):
    """Horovod's TF1 DistributedOptimizer: each rank's mean-loss gradients, averaged (an embedding's
    IndexedSlices gathered, or made dense), step as one process on the ranks' batches together."""
    rng = np.random.default_rng(0)
    xs, ids = rng.normal(size=(N, 4, 3)).astype(np.float32), rng.integers(0, 5, size=(N, 4))
    ys = rng.normal(size=(N, 4)).astype(np.float32)
    w0, e0 = rng.normal(size=3).astype(np.float32), rng.normal(size=5).astype(np.float32)

    def train(x, i, y, wrap):
        graph = tf.Graph()
        with graph.as_default():
            w, e = tf.compat.v1.get_variable("w", initializer=w0), tf.compat.v1.get_variable("e", initializer=e0)
            loss = tf.reduce_mean((tf.linalg.matvec(x, w) + tf.gather(e, i) - y) ** 2)
            step = wrap(tf.compat.v1.train.MomentumOptimizer(0.1, momentum=0.9)).minimize(loss)
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for _ in range(3):
                    within(60, lambda: sess.run(step))
                return sess.run([w, e])

    got = train(xs[R], ids[R], ys[R], lambda o: hvd.DistributedOptimizer(
        o, sparse_as_dense=sparse_as_dense, gradient_predivide_factor=2.0))
    want = train(xs.reshape(-1, 3), ids.reshape(-1), ys.reshape(-1), lambda o: o)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_public_names_exist():
    import unison.tf_backend.keras as hvd_keras

    missing = [n for n in HVD_TF_NAMES if not hasattr(hvd, n)]
    assert not missing, f"unison.tf_backend lacks {missing}"
    missing_keras = [n for n in HVD_TF_NAMES if not hasattr(hvd_keras, n)]
    assert not missing_keras, f"unison.tf_backend.keras lacks {missing_keras}"


# ------------------------------------------------------------------------ horovod.tensorflow.keras flavours
def test_keras_flavoured_value_ops():
    """horovod.tensorflow.keras: allreduce(value, name, average, ...) etc. take values; name comes second."""
    from unison.tf_backend import keras_api as k

    s = k.allreduce([float(R)] * 2, "kv.ar", False)
    a = k.allreduce([float(R)] * 2, "kv.avg")
    g = k.allgather([[R]], "kv.ag")
    b = k.broadcast([R, R], N - 1, "kv.bc")
    r = k.reducescatter(np.ones((N, 2), np.float32) * (R + 1), "kv.rs", op=hvd.Sum)
    np.testing.assert_allclose(s.numpy(), [sum(range(N))] * 2)
    np.testing.assert_allclose(a.numpy(), [sum(range(N)) / N] * 2)
    np.testing.assert_array_equal(g.numpy(), np.arange(N).reshape(N, 1))
    np.testing.assert_array_equal(b.numpy(), [N - 1, N - 1])
    np.testing.assert_allclose(r.numpy(), np.full((1, 2), sum(r + 1 for r in range(N))))


def test_keras_load_model_wraps_optimizer_and_keeps_state(tmp_path):
    import keras

    from unison.tf_backend import keras_api as k

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)  # the same on every rank
    path = tmp_path / f"model-rank{R}.keras"
    model.save(path)
    loaded = k.load_model(path)
    assert getattr(loaded.optimizer, "_unison_distributed", False)
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations.numpy()) == 1
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy())
    loaded.fit(np.ones((4, 3)) * (R + 1), np.ones((4, 2)), verbose=0)  # averaged gradients: same weights
    weights = [w.numpy() for w in loaded.weights]
    gathered = hvd.allgather_object(weights)
    for other in gathered:
        for x, y in zip(other, weights, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-6)


def test_keras_module_exports_the_keras_flavours():
    import unison.tf_backend.keras as hvd_keras
    from unison.tf_backend import keras_api

    for name in ("allreduce", "allgather", "broadcast", "reducescatter", "load_model"):
        assert getattr(hvd_keras, name) is getattr(keras_api, name)


# ------------------------------------------------------------------------ Adasum
@MODES
def test_adasum_eager_as_horovod(graph):
    """Horovod: Adasum of CPU tensors needs a power-of-two rank count (NotImplementedError otherwise);
    inside tf.function it runs through the engine's Adasum, with the same result."""
    from unison.collectives import adasum

    x = tf.constant(np.arange(4, dtype=np.float32) + 2.0 * R)
    tag = "graph" if graph else "eager"
    if not hvd.check_num_rank_power_of_2(N):
        with pytest.raises(NotImplementedError):
            run(lambda t: hvd.allreduce(t, op=hvd.Adasum, name=f"adasum.bad.{tag}"), graph, x)
        return
    y = run(lambda t: hvd.allreduce(t, op=hvd.Adasum, name=f"adasum.{tag}"), graph, x)
    expect = adasum.reference([np.arange(4, dtype=np.float32) + 2.0 * r for r in range(N)])
    np.testing.assert_allclose(y.numpy(), expect, rtol=1e-5)


# ------------------------------------------------------------------------ SyncBatchNormalization
@MODES
def test_sync_batch_norm_matches_one_process_on_the_concatenated_batch(graph):
    """Unequal batches per rank, large-mean activations: the statistics of the union of all batches."""
    batches = [np.random.default_rng(r).normal(loc=100.0, size=(r + 2, 3)).astype(np.float32) for r in range(N)]
    layer = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    layer.build((None, 3))
    out = run(lambda x: layer(x, training=True), graph, tf.constant(batches[R]))
    full = np.concatenate(batches).astype(np.float64)
    mean, var = full.mean(axis=0), full.var(axis=0)
    np.testing.assert_allclose(out.numpy(), (batches[R] - mean) / np.sqrt(var + 1e-3), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * mean, rtol=1e-4)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 0.5 + 0.5 * var, rtol=1e-3)


@MULTI
def test_sync_batch_norm_in_a_graph_when_one_rank_built_another_layer():
    """Keras names layers by a count per process: rank 0's extra layer made this one
    ``sync_batch_normalization_1`` there only, the traced collectives were named after it, and every rank
    waited for ever (before 2026-12-05)."""
    if R == 0:
        hvd.SyncBatchNormalization()
    batches = [np.random.default_rng(r).normal(size=(4, 3)).astype(np.float32) for r in range(N)]
    layer = hvd.SyncBatchNormalization(epsilon=1e-3)
    layer.build((None, 3))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * tf.range(1.0, 4.0))
        return y, tape.gradient(loss, [x, layer.gamma])

    out, (dx, dgamma) = step(tf.constant(batches[R]))
    full = np.concatenate(batches).astype(np.float64)
    np.testing.assert_allclose(out.numpy(), (batches[R] - full.mean(0)) / np.sqrt(full.var(0) + 1e-3), rtol=2e-3,
                               atol=2e-3)
    assert np.isfinite(dx.numpy()).all() and dgamma.shape == (3,)


@MODES
def test_sync_batch_norm_selects_masked_positions_out(graph):
    """Padded steps holding inf or NaN were multiplied by a zero weight (inf * 0 = NaN): every statistic
    and the moving mean were NaN on every rank, where Keras's own layer selects them out (found by an audit,
    2026-12-07). And Horovod's fused=False is accepted, fused=True refused, as Horovod's layer does."""
    rng = np.random.default_rng(R)
    x = rng.normal(size=(2, 4, 3)).astype(np.float32)
    mask = np.array([[True, True, False, False], [True, True, True, False]])
    x[~mask] = np.inf if R == 0 else np.nan
    layer = hvd.SyncBatchNormalization(momentum=0.0, epsilon=1e-3, fused=False)
    layer.build((None, 4, 3))
    out = run(lambda t: layer(t, training=True, mask=tf.constant(mask)), graph, tf.constant(x))
    valid = np.concatenate([np.random.default_rng(r).normal(size=(2, 4, 3)).astype(np.float64)[mask]
                            for r in range(N)])
    np.testing.assert_allclose(layer.moving_mean.numpy(), valid.mean(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out.numpy()[mask], (x[mask] - valid.mean(0)) / np.sqrt(valid.var(0) + 1e-3),
                               rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="does not support fused=True"):
        hvd.SyncBatchNormalization(fused=True)


def test_a_saved_model_with_sync_batch_norm_loads_without_custom_objects(tmp_path):
    """Keras's load_model raised "could not be deserialized" without custom_objects before 2026-12-05."""
    import keras

    from unison.tf_backend import keras_api as k

    model = keras.Sequential([keras.Input((3,)), hvd.SyncBatchNormalization(momentum=0.7), keras.layers.Dense(2)])
    model(np.ones((4, 3), np.float32), training=True)
    path = str(tmp_path / f"sbn-{R}.keras")
    model.save(path)
    for load in (keras.models.load_model, k.load_model):
        back = load(path)
        assert type(back.layers[0]) is hvd.SyncBatchNormalization and back.layers[0].momentum == 0.7
        for a, b in zip(back.get_weights(), model.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(N < 3, reason="a set that leaves a rank out")
def test_a_broadcast_root_outside_its_set_names_the_root_and_the_set_on_every_member():
    ps = hvd.add_process_set([0, 2])
    try:
        if ps.included():
            with pytest.raises(ValueError) as info:
                hvd.broadcast(tf.ones([2]), root_rank=1, process_set=ps)
            assert "root_rank=1 is not a rank of process set" in str(info.value) and "[0, 2]" in str(info.value)
    finally:
        hvd.remove_process_set(ps)


def test_graph_error_marker_names_the_class_and_never_raises_itself():
    """[Note: error classes from graphs]: the marker picks the class, is removed from the message, and a
    code with no class of its own (UNKNOWN) or none at all leaves an UnknownError instead of failing."""
    marked = tf.errors.UnknownError(None, None, "boom [unison-tf-error-code=9]")
    assert isinstance(marked, tf.errors.FailedPreconditionError) and marked.error_code == 9
    assert marked.message == "boom"
    for code in (2, 999):
        kept = tf.errors.UnknownError(None, None, f"boom [unison-tf-error-code={code}]")
        assert type(kept) is tf.errors.UnknownError and kept.message == "boom"


def test_query_ops_in_a_graph_are_read_when_it_runs():
    """Horovod's size_op and the others run when their graph runs: one built before init() works."""
    hvd.shutdown()
    graph = tf.Graph()
    with graph.as_default():
        queries = [hvd.size_op(), hvd.rank_op(), hvd.local_size_op(), hvd.local_rank_op(),
                   hvd.process_set_included_op(0)]
    hvd.init()
    with tf.compat.v1.Session(graph=graph) as sess:
        assert [int(v) for v in sess.run(queries)] == [N, R, hvd.local_size(), hvd.local_rank(), 1]
    assert int(tf.function(hvd.size_op)()) == N and int(tf.function(hvd.rank_op)()) == R


# ---------------------------------------------------------------- a peer's shutdown
@MULTI
@MODES
def test_a_peers_shutdown_is_an_unknown_error(graph):
    """Horovod reports its shut-down error as ``UnknownError``; in a graph too, without our marker
    ([Note: error classes from graphs]). Then every rank starts again."""
    if R == 0:
        hvd.shutdown()
    else:
        def op():
            return hvd.allreduce(tf.ones([2]), name=f"after.stop.{graph}")

        with pytest.raises(tf.errors.UnknownError, match="shut down|stopped") as info:
            within(60, lambda: run(op, graph))
        assert info.value.error_code == tf.errors.UNKNOWN and "unison-tf-error-code" not in str(info.value)
        hvd.shutdown()
    hvd.init()
    np.testing.assert_allclose(hvd.allreduce(tf.ones([2]), op=hvd.Sum, name=f"restarted.{graph}"), [N, N])


# ---------------------------------------------------------------- join (last: it changes the engine's state)
def test_zz_broadcast_and_allgather_while_a_rank_has_joined_raise_failed_precondition():
    """Horovod's class for collectives that need every rank's data while one has joined (ours is
    also the engine's JoinError); the joined rank's join() returns, and allreduce still works."""
    from unison.common.engine.errors import JoinError

    if R == 0:
        assert 1 <= int(hvd.join()) < N
        return
    for what, call in (("broadcast", lambda: hvd.broadcast(tf.ones(3), 1, name="tfjoin.b")),
                       ("allgather", lambda: hvd.allgather(tf.ones(2), name="tfjoin.g"))):
        with pytest.raises(tf.errors.FailedPreconditionError, match="only allreduce and barrier") as info:
            call()
        assert isinstance(info.value, JoinError), what
    got = hvd.allreduce(tf.ones(3), op=hvd.Sum, name="tfjoin.ar")  # rank 0 contributes zeros
    np.testing.assert_array_equal(got.numpy(), np.full(3, N - 1.0))
    assert 1 <= int(hvd.join()) < N


def test_zz_join_returns_an_int32_tensor():
    last = hvd.join()
    assert isinstance(last, tf.Tensor) and last.dtype == tf.int32 and 0 <= int(last) < N


@pytest.mark.skipif(N == 1, reason="needs two ranks")
def test_zz_barrier_in_a_tf_function_waits_at_every_call_and_a_retrace_pairs_nothing():
    """Before: the barrier ran once, while tracing, and the graph held no op: later calls did not wait, and a
    rank that retraced alone (a new shape) paired its trace's barrier with a peer's real one (a hang after)."""
    import time

    @tf.function
    def step(x):
        hvd.barrier()
        return x + 1

    step(tf.constant(1.0))
    assert any(op.type == "PyFunc" for op in step.get_concrete_function(tf.constant(1.0)).graph.get_operations())
    if R == 0:
        time.sleep(1.5)
    start = time.perf_counter()
    step(tf.constant(1.0))
    waited = time.perf_counter() - start
    if R != 0:
        assert waited > 1.0, waited  # it waited for rank 0
    if R == 0:
        step(tf.constant([1.0, 2.0]))  # a new shape: this rank alone traces again, and the traced barrier runs
    else:
        hvd.barrier()  # pairs with rank 0's call above
    hvd.barrier()  # eagerly, on every rank: pairs
    np.testing.assert_array_equal(hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum).numpy(), [sum(range(N))])


@pytest.mark.skipif(N == 1, reason="needs two ranks")
@pytest.mark.parametrize("case", ["allreduce-dtype", "allreduce-bool-average", "reducescatter-scalar",
                                  "allgather-dtype", "broadcast-dtype", "alltoall-float-splits",
                                  "sparse-max", "grouped-allreduce-dtype", "grouped-allgather-empty",
                                  "grouped-allreduce-empty", "reducescatter-op", "grouped-allgather-dtype"])
def test_zz_an_argument_refused_on_one_rank_raises_on_every_rank_and_the_next_unnamed_call_pairs(case):
    """[Note: a refusal travels] Only the last rank passes the bad argument. Before: that rank raised alone, before
    submitting, so the others' call paired with its next unnamed one (another step's data) or hung."""
    odd = R == N - 1
    good = tf.ones([4])
    with pytest.raises(Exception) as info:
        if case == "allreduce-dtype":
            hvd.allreduce(tf.ones([4], tf.complex64) if odd else good)
        elif case == "allreduce-bool-average":
            hvd.allreduce(tf.ones([4], tf.bool) if odd else good, op=hvd.Average if odd else hvd.Sum)
        elif case == "reducescatter-scalar":
            hvd.reducescatter(tf.constant(1.0) if odd else tf.ones([N]))
        elif case == "allgather-dtype":
            hvd.allgather(tf.ones([4], tf.complex64) if odd else good)
        elif case == "broadcast-dtype":
            hvd.broadcast(tf.ones([4], tf.complex64) if odd else good, 0)
        elif case == "alltoall-float-splits":
            hvd.alltoall(tf.ones([N]), splits=tf.constant([1.0] * N) if odd else tf.constant([1] * N))
        elif case == "sparse-max":
            hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2])),
                          op=hvd.Max if odd else hvd.Sum)
        elif case == "grouped-allreduce-dtype":
            hvd.grouped_allreduce([good, tf.ones([2], tf.complex64) if odd else tf.ones([2])])
        elif case == "reducescatter-op":
            hvd.reducescatter(tf.ones([N]), op="no such op" if odd else hvd.Sum)
        elif case == "grouped-allgather-dtype":
            hvd.grouped_allgather([good, tf.ones([2], tf.complex64) if odd else tf.ones([2])])
        elif case == "grouped-allgather-empty":
            hvd.grouped_allgather([] if odd else [good])
        else:
            hvd.grouped_allreduce([] if odd else [good])
        if not odd:  # (an empty group returns at once on that rank: the error is the others')
            pytest.fail("no error on this rank")
        raise RuntimeError("the empty group's rank")  # (the others' MismatchError names it)
    if odd and "empty" not in case:
        assert any(word in str(info.value) for word in ("hvd.", "IndexedSlices", "splits", "scalar", "op")), \
            info.value
    if not odd:
        text = str(info.value)
        assert f"rank {N - 1}" in text or "different" in text or "tensors" in text, text
    np.testing.assert_array_equal(hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum).numpy(), [sum(range(N))])
    np.testing.assert_array_equal(hvd.allgather(tf.constant([float(R)])).numpy(), np.arange(N, dtype=np.float32))
    got = hvd.grouped_allgather([tf.constant([float(R)]), tf.constant([[float(R)]])])  # a group pairs too
    np.testing.assert_array_equal(got[0].numpy(), np.arange(N, dtype=np.float32))
