"""The Horovod-compatible TensorFlow API under mpirun: values, gradients, tape equivalence."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import unison.tf_backend as hvd

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
tf.config.threading.set_intra_op_parallelism_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_collective_values(graph):
    def run():
        t = tf.fill([3], float(R))
        s = hvd.allreduce(t, op=hvd.Sum, name=f"v.sum.{graph}")
        a = hvd.allreduce(t, name=f"v.avg.{graph}")
        g = hvd.allgather(tf.fill([R + 1, 2], R), name=f"v.ag.{graph}")
        b = hvd.broadcast(tf.range(4) + R, root_rank=N - 1, name=f"v.bc.{graph}")
        gr = hvd.grouped_allreduce([tf.ones([2]), tf.ones([3, 1]) * 2.0], op=hvd.Sum, name=f"v.gr.{graph}")
        rs = hvd.reducescatter(tf.ones([2 * N, 2]), op=hvd.Sum, name=f"v.rs.{graph}")
        out, splits = hvd.alltoall(tf.range(N, dtype=tf.float32) + 10.0 * R, splits=[1] * N,
                                   name=f"v.a2a.{graph}")
        return s, a, g, b, gr, rs, out, splits

    s, a, g, b, gr, rs, out, splits = (tf.function(run) if graph else run)()
    np.testing.assert_array_equal(s.numpy(), [sum(range(N))] * 3)
    np.testing.assert_allclose(a.numpy(), [(N - 1) / 2] * 3)
    assert g.shape == (N * (N + 1) // 2, 2)
    np.testing.assert_array_equal(b.numpy(), np.arange(4) + N - 1)
    np.testing.assert_array_equal(gr[0].numpy(), [N] * 2)
    np.testing.assert_array_equal(gr[1].numpy(), [[2 * N]] * 3)
    assert rs.shape == (2, 2) and np.all(rs.numpy() == N)
    np.testing.assert_array_equal(out.numpy(), [R + 10.0 * r for r in range(N)])
    np.testing.assert_array_equal(splits.numpy(), [1] * N)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_gradients(graph):
    def run():
        x = tf.ones([N, 2])
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y1 = tf.reduce_sum(hvd.allreduce(x, op=hvd.Average, name=f"g.ar.{graph}") * float(R + 1))
            y2 = tf.reduce_sum(hvd.allgather(x, name=f"g.ag.{graph}") * float(R + 1))
            y3 = tf.reduce_sum(hvd.broadcast(x, 0, name=f"g.bc.{graph}") * float(R + 1))
            y4 = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum, name=f"g.rs.{graph}") * float(R + 1))
            y5 = tf.reduce_sum(hvd.alltoall(x, name=f"g.a2a.{graph}") * float(R + 1))  # no splits: rows only
            y6 = tf.add_n([tf.reduce_sum(t) * float(R + 1) for t in
                           hvd.grouped_allreduce([x, 2.0 * x], op=hvd.Sum, name=f"g.gr.{graph}")])
        return [tape.gradient(y, x) for y in (y1, y2, y3, y4, y5, y6)]

    g1, g2, g3, g4, g5, g6 = (tf.function(run) if graph else run)()
    total = float(sum(r + 1 for r in range(N)))
    np.testing.assert_allclose(g1.numpy(), np.full((N, 2), total / N))
    # Horovod's gradient rules: allgather and broadcast average the upstream gradients over the
    # ranks; reducescatter(Sum) all-gathers them times the set size
    np.testing.assert_allclose(g2.numpy(), np.full((N, 2), total / N))
    np.testing.assert_allclose(g3.numpy(), np.full((N, 2), total / N if R == 0 else 0.0))
    np.testing.assert_allclose(g4.numpy(), np.concatenate([np.full((1, 2), float((r + 1) * N)) for r in range(N)]))
    # alltoall: row r of x went to rank r, whose upstream gradient is r + 1
    np.testing.assert_allclose(g5.numpy(), np.concatenate([np.full((1, 2), float(r + 1)) for r in range(N)]))
    np.testing.assert_allclose(g6.numpy(), np.full((N, 2), 3.0 * total))


def test_distributed_gradient_tape_matches_one_process():
    b, steps = 4, 4
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(steps, N * b, 5)).astype(np.float32)
    ys = rng.normal(size=(steps, N * b, 1)).astype(np.float32)
    w = tf.Variable(np.random.default_rng(R).normal(size=(5, 1)).astype(np.float32))  # ranks differ
    emb = tf.Variable(np.random.default_rng(R + 7).normal(size=(10, 1)).astype(np.float32))
    hvd.broadcast_variables([w, emb], root_rank=0)
    w_ref = tf.Variable(w.numpy())
    emb_ref = tf.Variable(emb.numpy())
    ids = tf.constant([1, 3, 3, 7])

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((x @ w + tf.reduce_sum(tf.gather(emb, ids)) - y) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        gw, ge = tape.gradient(loss, [w, emb])
        w.assign_sub(0.1 * gw)
        emb.assign_sub(0.1 * tf.convert_to_tensor(ge))

    for s in range(steps):
        step(xs[s, R * b:(R + 1) * b], ys[s, R * b:(R + 1) * b])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((xs[s] @ w_ref + tf.reduce_sum(tf.gather(emb_ref, ids)) - ys[s]) ** 2)
        gw, ge = tape.gradient(loss, [w_ref, emb_ref])
        w_ref.assign_sub(0.1 * gw)
        emb_ref.assign_sub(0.1 * tf.convert_to_tensor(ge))
    np.testing.assert_allclose(w.numpy(), w_ref.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(emb.numpy(), emb_ref.numpy(), rtol=1e-5, atol=1e-6)
    everyone = WORLD.allgather(w.numpy())
    assert all(np.array_equal(everyone[0], e) for e in everyone)


def test_objects_and_errors():
    assert hvd.broadcast_object({"r": R}, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(R) == list(range(N))
    if N > 1:
        with pytest.raises(hvd.MismatchError, match="shape"):
            hvd.allreduce(tf.ones([R + 1]), name="tf.mismatch")
    assert int(hvd.size_op()) == N and int(hvd.rank_op()) == R


def _branch_loss(r, x, a, b, emb, mixed):
    """Rank ``r``'s loss: even ranks use ``a`` and gather ``emb``; odd ranks use ``b``.

    ``mixed`` gets a sparse gradient on rank 0 and a dense one on rank 1; nobody uses a fifth variable.
    """
    ids = tf.constant([0, 2, 2])
    if r % 2 == 0:
        y = tf.reduce_sum(tf.tanh(x @ a)) + tf.reduce_sum(tf.gather(emb, ids)) * float(r + 1)
    else:
        y = 2.0 * tf.reduce_sum(tf.tanh(x @ b))
    if r == 0:
        y += tf.reduce_sum(tf.gather(mixed, ids))
    if r == 1:
        y += tf.reduce_sum(mixed * mixed)
    return y


def _branch_reference(x_of, init):
    """The mean over ranks of each rank's gradient, computed in one process (None: nobody has one)."""
    total, seen = [np.zeros_like(v) for v in init], [False] * len(init)
    for r in range(N):
        vs = [tf.Variable(v) for v in init]
        with tf.GradientTape() as tape:
            loss = _branch_loss(r, x_of(r), *vs[:4])
        for i, g in enumerate(tape.gradient(loss, vs)):
            if g is not None:
                total[i] += tf.convert_to_tensor(g).numpy()
                seen[i] = True
    return [t / N if s else None for t, s in zip(total, seen, strict=True)]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_tape_gradients_none_on_some_ranks_match_one_process(graph):
    """Issue 10 item 3: a gradient None on some ranks must not shift the pairing of the others."""
    rng = np.random.default_rng(5)
    init = [rng.normal(size=s).astype(np.float32) for s in [(3, 2), (3, 2), (4, 2), (4, 2), (2,)]]
    vs = [tf.Variable(v) for v in init]  # a and b have the same shape: a shifted pairing would not raise

    def x_of(r):
        return tf.constant(np.random.default_rng(100 + r).normal(size=(5, 3)).astype(np.float32))

    def step(x):
        with tf.GradientTape() as tape:
            loss = _branch_loss(R, x, *vs[:4])
        grads = hvd.DistributedGradientTape(tape).gradient(loss, vs)
        return [None if g is None else tf.convert_to_tensor(g) for g in grads]

    got = (tf.function(step) if graph else step)(x_of(R))
    want = _branch_reference(x_of, init)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, f"variable {i}: no rank has a gradient, so it must stay None"
        else:
            np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-6, err_msg=f"variable {i}")


def _mixed_group(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng([11, rank])
    return [rng.integers(-9, 9, (3, 4)).astype(np.float32), rng.integers(-9, 9, 7).astype(np.int32),
            rng.integers(0, 9, 5).astype(np.uint16), rng.integers(-9, 9, 300_000).astype(np.float32),
            rng.integers(-9, 9, (2, 2)).astype(np.float64), rng.integers(-9, 9, 6).astype(np.float32),
            rng.integers(-9, 9, 9).astype(np.float32)]


@pytest.mark.parametrize("threshold", [None, 64], ids=["one-buffer", "64-byte-buffers"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_grouped_allreduce_packs_members_and_matches_numpy(graph, threshold):
    """Small members come back as one tensor per dtype, split in the graph; large ones (> 1 MiB),
    ones of unknown shape and uint16 ones (int32 on the wire) alike give numpy's sums; with a
    fusion threshold that splits the packed members over several buffers, they are joined."""
    from unison.common.engine import frontend

    xs = [tf.constant(a) for a in _mixed_group(R)]
    dynamic = tf.TensorSpec([None], tf.float32)

    def reduce(last: tf.Tensor) -> list[tf.Tensor]:
        return hvd.grouped_allreduce(xs[:-1] + [last], op=hvd.Sum, name=f"tf.grp.mixed.{graph}.{threshold}")

    fn = tf.function(reduce, input_signature=[dynamic]) if graph else reduce
    eng = frontend.engine()
    default = eng.fusion_threshold if eng is not None else None
    if eng is not None and threshold is not None:
        eng.fusion_threshold = threshold
    try:
        outs = [fn(xs[-1]) for _ in range(2)]
    finally:
        if eng is not None:
            eng.fusion_threshold = default
    want = [sum(_mixed_group(r)[i] for r in range(N)) for i in range(len(xs))]
    for out in outs:
        for i, (got, ref) in enumerate(zip(out, want, strict=True)):
            assert got.dtype.as_numpy_dtype == ref.dtype and tuple(got.shape) == ref.shape, (i, got)
            np.testing.assert_array_equal(got.numpy(), ref, err_msg=f"member {i}")
    if graph:  # the plan: the float32 members of static shape but the large one travel as one output
        graph_def = fn.get_concrete_function().graph
        collect = [op for op in graph_def.get_operations() if op.name.endswith("_collect")]
        assert len(collect) == 1
        dtypes = [t.dtype for t in collect[0].outputs]
        # packs (float32: members 0 and 5) first, then the single members in order
        assert dtypes == [tf.float32, tf.int32, tf.uint16, tf.float32, tf.float64, tf.float32], dtypes


def test_unison_code_is_left_to_run_as_written_under_autograph():
    """Unison's functions are on AutoGraph's do-not-convert list: a host callback built inside a
    user's tf.function runs as plain Python (converted, it paid AutoGraph per call per tensor)."""
    from tensorflow.python.autograph.impl import conversion

    from unison.tf_backend import host_ops, mpi_ops

    assert host_ops.AUTOGRAPH_EXCLUDED
    for fn in (host_ops.run_grouped, mpi_ops.grouped_allreduce, hvd.DistributedGradientTape.gradient):
        assert conversion.is_allowlisted(fn), fn
