"""horovod.tensorflow(.keras) 0.28 parity, second part: partial (local) gradients, the Keras optimizer's
keywords, callbacks' ``device``, ``BestModelCheckpoint`` and the Keras module's names.

Every test body runs unchanged at any rank count (np 2 and 3 in tests/test_tf_parity2_mpi.py) and
compares with numpy. Rows: docs/horovod.md.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import unison.tf_backend as hvd  # noqa: E402
import unison.tf_backend.keras as hvd_keras  # noqa: E402

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
MODES = pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    yield
    hvd.shutdown()


def dense(units: int, inputs: int, seed: int) -> keras.layers.Dense:
    layer = keras.layers.Dense(units, kernel_initializer=keras.initializers.Constant(0.5 + seed),
                               bias_initializer="zeros")
    layer.build((None, inputs))
    return layer


def same_everywhere(a: np.ndarray) -> bool:
    return all(np.array_equal(a, other) for other in WORLD.allgather(a))


# ------------------------------------------------------------------------ partial gradient tapes
@MODES
@pytest.mark.parametrize("scale", [True, False])
def test_register_local_source_keeps_the_local_gradient(graph, scale):
    """register_local_source: that gradient is not reduced; divided by the set size if scale_local_gradients."""
    shared = tf.Variable(np.ones(3, np.float32))
    local = tf.Variable(np.ones(2, np.float32))
    c = np.float32(R + 1)

    def step():
        with tf.GradientTape() as tape:
            loss = c * tf.reduce_sum(shared) + c * c * tf.reduce_sum(local)
        tape = hvd.DistributedGradientTape(tape, scale_local_gradients=scale)
        tape.register_local_source(local)
        return tape.gradient(loss, [shared, local])

    gs, gl = (tf.function(step) if graph else step)()
    mean_c = np.mean([r + 1.0 for r in range(N)])
    np.testing.assert_allclose(gs.numpy(), np.full(3, mean_c), rtol=1e-6)
    np.testing.assert_allclose(gl.numpy(), np.full(2, c * c / (N if scale else 1)), rtol=1e-6)


@MODES
def test_partial_distributed_gradient_tape_with_local_layers(graph):
    """PartialDistributedGradientTape(local_layers=...): those layers' variables keep local gradients."""
    shared, local = dense(2, 3, 0), dense(1, 2, 1)
    x = np.full((4, 3), R + 1.0, np.float32)
    variables = shared.trainable_weights + local.trainable_weights

    def grads_of(tape_wrapper):
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(local(shared(x)))
            return tape_wrapper(tape).gradient(loss, variables)
        return [g.numpy() for g in (tf.function(step) if graph else step)()]

    got = grads_of(lambda t: hvd_keras.PartialDistributedGradientTape(t, local_layers=local))
    plain = grads_of(lambda t: t)  # this rank's own gradients
    everyone = WORLD.allgather(plain)
    for i, g in enumerate(got):
        if i < 2:  # shared: the mean over the ranks
            np.testing.assert_allclose(g, np.mean([e[i] for e in everyone], axis=0), rtol=1e-5)
        else:  # local: this rank's, divided by the set size
            np.testing.assert_allclose(g, plain[i] / N, rtol=1e-5)
    none = grads_of(lambda t: hvd_keras.PartialDistributedGradientTape(t))  # no local layers: all averaged
    for i, g in enumerate(none):
        np.testing.assert_allclose(g, np.mean([e[i] for e in everyone], axis=0), rtol=1e-5)


def test_partial_tape_and_optimizer_refuse_non_layers():
    with pytest.raises(ValueError, match="local layers must be of tf.keras.layers.Layer"):
        hvd_keras.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[tf.Variable(1.0)])
    with pytest.raises(ValueError, match="local layers must be of tf.keras.layers.Layer"):
        hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=["dense"])


def test_tape_groups_checked_as_horovod():
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedGradientTape(tf.GradientTape(), groups=0)
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedGradientTape(tf.GradientTape(), groups=[[1.0]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.DistributedGradientTape(tf.GradientTape(), num_groups=2)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    v = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = (R + 1.0) * tf.reduce_sum(v)
    g = hvd.DistributedGradientTape(tape, groups=[[v]], device_dense="/cpu:0").gradient(loss, [v])[0]
    np.testing.assert_allclose(g.numpy(), np.full(2, (N + 1) / 2), rtol=1e-6)


# ------------------------------------------------------------------------ Keras DistributedOptimizer keywords
def test_keras_distributed_optimizer_takes_horovod_keywords():
    """device_dense/device_sparse (ignored on CPU), groups, scale_local_gradients: accepted; mean gradient."""
    layer = dense(2, 2, 0)
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), device_dense="/cpu:0", device_sparse="",
                                         average_aggregated_gradients=False, groups=1,
                                         scale_local_gradients=True, process_set=hvd.global_process_set)
    before = [v.numpy() for v in layer.trainable_weights]
    grads = [tf.fill(v.shape, float(R + 1)) for v in layer.trainable_weights]
    opt.apply(grads, layer.trainable_weights)
    for b, v in zip(before, layer.trainable_weights, strict=True):
        np.testing.assert_allclose(v.numpy(), b - (N + 1) / 2, rtol=1e-6)
    with pytest.raises(ValueError, match="groups"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), groups=-1)


@pytest.mark.parametrize("average", [False, True])
def test_keras_backward_passes_apply_the_sum_unless_averaged(average):
    """backward_passes_per_step=k: Horovod applies the sum of the k averaged gradients (mean if averaging)."""
    v = keras.Variable(np.zeros(2, np.float32))
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                         average_aggregated_gradients=average)
    for step in range(2):
        opt.apply([tf.fill((2,), float((R + 1) * (step + 1)))], [v])
    per_step = [np.mean([(r + 1) * (s + 1) for r in range(N)]) for s in range(2)]
    expect = -(np.mean(per_step) if average else np.sum(per_step))
    np.testing.assert_allclose(v.numpy(), np.full(2, expect), rtol=1e-6)


@pytest.mark.parametrize("scale", [True, False])
def test_partial_distributed_optimizer_keeps_local_layers_local(scale):
    shared, local = dense(2, 2, 0), dense(1, 2, 1)
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=local,
                                                scale_local_gradients=scale)
    variables = shared.trainable_weights + local.trainable_weights
    before = [v.numpy() for v in variables]
    opt.apply([tf.fill(v.shape, float(R + 1)) for v in variables], variables)
    for i, (b, v) in enumerate(zip(before, variables, strict=True)):
        step = (N + 1) / 2 if i < 2 else (R + 1) / (N if scale else 1)
        np.testing.assert_allclose(v.numpy(), b - step, rtol=1e-6)
    assert same_everywhere(np.concatenate([v.numpy().ravel() for v in shared.trainable_weights]))


def test_partial_distributed_optimizer_in_fit():
    """model.fit with a local head: the shared layer stays identical on every rank, the head differs."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    head = model.layers[-1]
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(0.05), local_layers=[head])
    model.compile(optimizer=opt, loss="mse")
    rs = np.random.RandomState(R)
    x, y = rs.randn(16, 3).astype("float32"), rs.randn(16, 1).astype("float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0, device="")])
    assert same_everywhere(model.layers[0].get_weights()[0])
    if N > 1:
        heads = WORLD.allgather(head.get_weights()[0])
        assert not all(np.array_equal(heads[0], h) for h in heads[1:])


# ------------------------------------------------------------------------ callbacks
def test_metric_average_callback_takes_device():
    cb = hvd_keras.callbacks.MetricAverageCallback(device="")
    assert cb.device == ""
    logs = {"loss": float(R), "acc": 2.0 * R, "f1": np.array([R, 2.0 * R])}
    cb.on_epoch_end(0, logs)
    assert logs["loss"] == pytest.approx((N - 1) / 2) and logs["acc"] == pytest.approx(float(N - 1))
    # an array metric (F1Score(average=None)) is averaged too: it was left per rank before 2026-12-05
    np.testing.assert_allclose(logs["f1"], [(N - 1) / 2, float(N - 1)])
    assert hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0, device="/cpu:0").device == "/cpu:0"


def shared_dir() -> str:
    return WORLD.bcast(tempfile.mkdtemp(prefix="unison-best-") if R == 0 else None, root=0)


def test_best_model_checkpoint_saves_on_improvement_from_rank_0():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    path = os.path.join(shared_dir(), "best.keras")
    cb = hvd_keras.callbacks.BestModelCheckpoint(monitor="val_loss", mode="min")
    assert cb.save_best_only and cb.filepath is None
    cb.set_model(model)
    with pytest.raises(ValueError, match="filepath"):
        cb.on_epoch_end(0, {"val_loss": 1.0})
    cb.filepath = path
    saved = []
    for epoch, val in enumerate([1.0, 2.0, 0.5]):
        cb.on_epoch_end(epoch, {"val_loss": val})
        WORLD.Barrier()
        saved.append(os.path.exists(path))
        WORLD.Barrier()
        if R == 0 and os.path.exists(path):
            os.remove(path)
        WORLD.Barrier()
    if R == 0:
        shutil.rmtree(os.path.dirname(path))
    assert saved == [True, False, True]  # rank 0 wrote it where every rank looks; only on improvement
    if R == 0:
        assert cb.best == 0.5


# ------------------------------------------------------------------------ module names
HVD_TF_KERAS = ("init shutdown is_initialized start_timeline stop_timeline size local_size cross_size rank "
                "local_rank cross_rank is_homogeneous mpi_threads_supported mpi_enabled mpi_built gloo_enabled "
                "gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built Average Sum Adasum Compression "
                "ProcessSet global_process_set add_process_set remove_process_set callbacks DistributedOptimizer "
                "PartialDistributedOptimizer broadcast_global_variables allreduce allgather broadcast "
                "reducescatter load_model").split()
HVD_CALLBACKS = ("BroadcastGlobalVariablesCallback MetricAverageCallback LearningRateScheduleCallback "
                 "LearningRateWarmupCallback BestModelCheckpoint").split()
#: horovod.tensorflow.elastic and horovod.tensorflow.keras.elastic 0.28
HVD_TF_ELASTIC = "run State ObjectState TensorFlowState TensorFlowKerasState".split()
HVD_KERAS_ELASTIC = ("run KerasState CommitStateCallback UpdateBatchStateCallback "
                     "UpdateEpochStateCallback").split()


_GATHERED_OPS = {
    "allreduce": lambda x: hvd.allreduce(x, op=hvd.Sum), "allgather": hvd.allgather,
    "broadcast": lambda x: hvd.broadcast(x, 0), "reducescatter": hvd.reducescatter, "alltoall": hvd.alltoall,
    "grouped_allreduce": lambda x: hvd.grouped_allreduce([x], op=hvd.Sum)[0],
    "grouped_allgather": lambda x: hvd.grouped_allgather([x])[0],
}


@MODES
@pytest.mark.parametrize("kind", sorted(_GATHERED_OPS))
def test_a_gathered_output_sends_back_the_dense_gradient(graph, kind):
    # tf.gather of an op's output gives its gradient function a tf.IndexedSlices, which it handed
    # on to a collective or a nested custom gradient (AttributeError eagerly, TypeError in a graph)
    op = _GATHERED_OPS[kind]
    x = tf.reshape(tf.range(2 * N * 2, dtype=tf.float32), (2 * N, 2)) + R

    def grads(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y = op(x)
            sparse = tf.reduce_sum(tf.gather(y, [0]))  # -> IndexedSlices
            dense = tf.reduce_sum(y * tf.one_hot([0], tf.shape(y)[0], axis=0)[:, :1])  # the same loss
        return tape.gradient(sparse, x), tape.gradient(dense, x)

    got, want = (tf.function(grads) if graph else grads)(x)
    np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), want.numpy())


@MODES
def test_broadcast_in_place_takes_keras_variables(graph):
    # in a tf.function it called read_value(), which Keras 3 variables lack (eagerly it worked)
    root = N - 1
    v = keras.Variable(np.full((2,), float(R), np.float32))
    run = tf.function(lambda: hvd.broadcast_([v], root)) if graph else (lambda: hvd.broadcast_([v], root))
    out = run()
    assert [t.numpy().tolist() for t in out] == [[float(root)] * 2]  # the value after the assignment
    assert v.numpy().tolist() == [float(root)] * 2


@MODES
@pytest.mark.parametrize("kind", ["allgather", "reducescatter"])
def test_grouped_ops_with_groups_of_different_lengths_raise_on_every_rank(graph, kind):
    # one request per member: the rank with more members waited for ever on the extra one
    tensors = [tf.ones([N * 2]) for _ in range(1 if R == 0 else 2)]
    call = {"allgather": hvd.grouped_allgather, "reducescatter": hvd.grouped_reducescatter}[kind]
    run = tf.function(lambda: call(tensors)) if graph else (lambda: call(tensors))
    with pytest.raises((ValueError, tf.errors.OpError), match="groups of 1 to 2 tensors"):
        run()
    # [Note: a longer group's extra members] left pending, the longer group's extra member met the name's next
    # use: the graph run again raised DuplicateNameError on that rank alone (the others waited), and unnamed
    # eager groups, whose names come back every AUTO_NAME_SLOTS calls, paired a later member with it (stale data)
    with pytest.raises((ValueError, tf.errors.OpError), match="groups of 1 to 2 tensors"):
        run()

    def check(k, got):
        for j, out in enumerate(got):
            if kind == "allgather":
                want = np.repeat([100.0 * k + 10 * j + r for r in range(N)], N * 2)
            else:  # this rank's 2 rows of the average
                want = np.full(2, 100.0 * k + 10 * j + (N - 1) / 2)
            np.testing.assert_allclose(out.numpy(), want, err_msg=f"call {k} member {j}")

    def group(k):
        return [tf.fill([N * 2], 100.0 * k + 10 * j + R) for j in range(2)]

    if graph:
        check(0, tf.function(lambda: call(group(0)))())
        return
    from unison.common.engine.requests import AUTO_NAME_SLOTS

    for k in range(AUTO_NAME_SLOTS + 1):
        check(k, call(group(k)))


def test_a_sparse_group_whose_op_one_rank_refuses_raises_on_every_rank():
    """grouped_allreduce with IndexedSlices and op=Min on one rank: that rank raised alone and the others
    waited for ever in the values' all-gather (before 2026-12-05)."""
    if N == 1:
        pytest.skip("needs two ranks")
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([R]), dense_shape=tf.constant([N, 2]))
    with pytest.raises((NotImplementedError, ValueError, tf.errors.OpError), match="Only Sum and Average"):
        hvd.grouped_allreduce([slices], op=hvd.Min if R == 0 else hvd.Sum)
    out = hvd.grouped_allreduce([slices], op=hvd.Sum)[0]
    assert sorted(out.indices.numpy().tolist()) == list(range(N))


def test_broadcast_variables_of_different_models_raises_on_every_rank():
    """A variable on one rank only was a named broadcast no other rank made: that rank waited for ever
    (before 2026-12-05). Eagerly the ranks now agree on the variables first, and every rank raises."""
    from unison.common.exceptions import MismatchError

    if N == 1:
        pytest.skip("needs two ranks")
    mine = [tf.Variable(tf.zeros([3]), name="bv_a")] + ([tf.Variable(tf.zeros([2]), name="bv_extra")] if R == 0
                                                        else [])
    with pytest.raises(MismatchError, match=r"broadcast_variables: .* 1 fewer \(1\.bv_extra"):
        hvd.broadcast_variables(mine, root_rank=0)
    v = tf.Variable(tf.fill([3], float(R)), name="bv_b")
    hvd.broadcast_variables([v], root_rank=N - 1)
    assert v.numpy().tolist() == [float(N - 1)] * 3


def test_elastic_keras_state_of_models_that_differ_across_ranks_raises_on_every_rank():
    """A Keras model with a Dense layer more on one rank: the sync broadcast its variables by position
    and the ranks waited for ever on the broadcast only one of them made. Now every rank raises."""
    from unison.common.exceptions import MismatchError
    from unison.tf_backend import elastic

    if N == 1:
        pytest.skip("needs two ranks")
    units = [4, 2, 1] if R == N - 1 else [4, 1]
    model = keras.Sequential([keras.Input((3,))] + [keras.layers.Dense(u) for u in units])
    state = elastic.TensorFlowKerasState(model, keras.optimizers.SGD(0.1), epoch=0)
    with pytest.raises(MismatchError, match=rf"elastic sync of the model: rank\(s\) \[{N - 1}\]"):
        state.sync()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    good = elastic.TensorFlowKerasState(model, keras.optimizers.SGD(0.1), epoch=0)
    good.sync()
    w = hvd.allgather_object(model.weights[0].numpy().tolist())
    assert all(x == w[0] for x in w)


def test_elastic_sync_of_states_with_different_values_raises_on_every_rank():
    """[Note: a sync agrees on what it syncs]: a value on one rank only was dropped from that rank's commits
    (rank 0's names replaced its own), silently; now every rank raises MismatchError naming it."""
    from unison.common.exceptions import MismatchError
    from unison.tf_backend import elastic

    if N == 1:
        pytest.skip("needs two ranks")
    v = tf.Variable([1.0, 2.0])
    extra = {"best": 1.0} if R == N - 1 else {}
    state = elastic.TensorFlowState([v], epoch=0, **extra)
    with pytest.raises(MismatchError, match=r"elastic sync of a TensorFlowState .*value 'best'"):
        state.sync()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    keras_state = elastic.TensorFlowKerasState(model, keras.optimizers.SGD(0.1), epoch=0, **extra)
    with pytest.raises(MismatchError, match=r"elastic sync of a TensorFlowKerasState .*value 'best'"):
        keras_state.sync()
    elastic.TensorFlowState([v], epoch=0).sync()


def test_keras_module_has_every_horovod_keras_name():
    """horovod.tensorflow.keras and horovod.keras 0.28 in unison.tf_backend.keras, ``elastic`` included."""
    assert [n for n in HVD_TF_KERAS if not hasattr(hvd_keras, n)] == []
    assert [n for n in HVD_TF_ELASTIC + HVD_KERAS_ELASTIC if not hasattr(hvd_keras.elastic, n)] == []
    assert hvd_keras.elastic.HorovodInternalError is hvd_keras.HorovodInternalError
    assert [n for n in HVD_CALLBACKS if not hasattr(hvd_keras.callbacks, n)] == []
    assert len(hvd_keras.__all__) == len(set(hvd_keras.__all__))
    assert all(hasattr(hvd_keras, n) for n in hvd_keras.__all__)


# ---------------------------------------------------------------- several reductions in one tf.function (audit)
def test_a_persistent_tape_reduces_each_gradient_call_apart_in_one_function():
    """Before: every gradient() call of one tape reduced under one name; in one graph the ranks paired the calls
    the wrong way (a rank's first call averaged with another's second: [5.5, 5.5, 100] for [1, 10, 100])."""
    v = tf.Variable(1.0, dtype=tf.float64)
    scales = tf.constant([1.0, 10.0, 100.0], tf.float64) * (R + 1)

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape(persistent=True) as t:
            losses = [scales[i] * v for i in range(3)]
        tape = hvd.DistributedGradientTape(t)
        return tf.stack([tape.gradient(losses[i], v) for i in range(3)])

    want = np.array([1.0, 10.0, 100.0]) * (N + 1) / 2
    for _ in range(20):
        np.testing.assert_allclose(step().numpy(), want)


def test_two_apply_gradients_of_one_keras_optimizer_in_one_function():
    """Before: both applies reduced under the optimizer's one name: v and w got each other's gradients."""
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0))
    v, w = tf.Variable([0.0, 0.0], dtype=tf.float32), tf.Variable([0.0, 0.0], dtype=tf.float32)
    opt.build([v, w])

    @tf.function
    def step() -> None:
        opt.apply_gradients([(tf.ones(2) * (R + 1), v)])
        opt.apply_gradients([(tf.ones(2) * 10 * (R + 1), w)])

    for _ in range(5):
        step()
    mean = (N + 1) / 2
    np.testing.assert_allclose(v.numpy(), [-5 * mean] * 2)
    np.testing.assert_allclose(w.numpy(), [-50 * mean] * 2)


def test_a_tape_built_in_a_function_that_one_rank_retraces_does_not_hang():
    """Horovod's TF2 pattern with a short last batch on rank 0 only: rank 0 retraces. Before, its tape took the
    next unnamed-call name while the others kept the first: both waited for ever on different names."""
    v = tf.Variable([[1.0], [2.0]])

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(tf.matmul(x, v))
        return hvd.DistributedGradientTape(t).gradient(loss, [v])[0]

    rows = [4, 3 if R == 0 else 4, 4]
    got = [step(tf.ones([r, 2])).numpy().ravel() for r in rows]
    np.testing.assert_allclose(got[0], [4.0, 4.0])
    np.testing.assert_allclose(got[1], [(3.0 + 4.0 * (N - 1)) / N] * 2)
    np.testing.assert_allclose(got[2], [4.0, 4.0])


def test_allgather_gradient_with_a_rank_unknown_while_tracing():
    """Before: an input of unknown rank was taken for a scalar (1 row per rank): the gradient's reshape failed."""

    @tf.function(input_signature=[tf.TensorSpec(None, tf.float64)])
    def grad(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as t:
            t.watch(x)
            y = hvd.allgather(x, name="unknown_rank_gather")
            loss = tf.reduce_sum(y * tf.cast(tf.range(tf.shape(y)[0]), tf.float64)[:, None])
        return t.gradient(loss, x)

    rows = R + 2
    start = sum(r + 2 for r in range(R))
    got = grad(tf.ones([rows, 3], tf.float64)).numpy()
    np.testing.assert_allclose(got, np.repeat(np.arange(start, start + rows, dtype=float)[:, None], 3, axis=1))


def test_sparse_gradients_with_an_op_other_than_sum_or_average_raise_not_implemented():
    emb = tf.Variable(tf.ones([4, 2]))
    with tf.GradientTape() as t:
        loss = tf.reduce_sum(tf.gather(emb, [0, 2]))
    with pytest.raises(NotImplementedError, match="op=Sum or Average only"):
        hvd.DistributedGradientTape(t, op=hvd.Max).gradient(loss, [emb])


# ------------------------------------------------------------ audit 2026-12-05: cached agreements, loss scaling
def test_tapes_in_two_functions_agree_apart_on_none_gradients():
    """Before: the agreed None pattern was cached by (name, local pattern), and the first tape of every function
    is named ``DistributedGradientTape``: ``second`` found ``first``'s entry on the ranks whose pattern matched
    it (all but rank 0) and skipped the exchange rank 0 waited in (a hang)."""
    a, b = tf.Variable([1.0, 2.0]), tf.Variable([3.0, 4.0])

    @tf.function
    def first() -> list:  # b is used on rank 0 only (a trace-time branch): agreed (dense, dense)
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(a * a) + (tf.reduce_sum(b * b) if R == 0 else 0.0)
        return hvd.DistributedGradientTape(t).gradient(loss, [a, b])

    @tf.function
    def second() -> list:  # b is used by no rank: its gradient is None everywhere
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(a * 3.0)
        return hvd.DistributedGradientTape(t).gradient(loss, [a, b])

    ga, gb = first()
    np.testing.assert_allclose(ga.numpy(), [2.0, 4.0])
    np.testing.assert_allclose(gb.numpy(), np.array([6.0, 8.0]) / N)
    for _ in range(2):  # a retrace-free second call, then the cached agreement
        ga, gb = second()
        np.testing.assert_allclose(ga.numpy(), [3.0, 3.0])
        assert gb is None


@pytest.mark.parametrize("wrapper", ["horovod.tensorflow", "keras_global_process_set"])
def test_loss_scale_skips_agree_with_the_global_process_set(wrapper):
    """Before: only an optimizer with process_set=None agreed on the LossScaleOptimizer's skips, and
    horovod.tensorflow's DistributedOptimizer passes the global process set: under mixed_float16 the rank
    whose batch overflowed skipped alone while the others waited in its all-reduce (a hang)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        rs = np.random.RandomState(0)
        x = 1e-3 * rs.randn(32, 4).astype("float32")
        y = x.sum(1, keepdims=True).astype("float32")
        if R == N - 1:
            x[:8] *= 3e7  # this rank's first batch overflows in float16
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        if wrapper == "horovod.tensorflow":
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))
        else:
            opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01), process_set=hvd.global_process_set)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                  callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
        # every rank skipped the first step (one rank overflowed) and applied the other three
        assert int(model.optimizer.inner_optimizer.iterations.numpy()) == 3
        assert float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** 15 / 2
        assert same_everywhere(np.concatenate([w.ravel() for w in model.get_weights()]))
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ------------------------------------------------------------------ from an audit of 2026-12-07
@pytest.mark.parametrize("who", ["members only", "every rank"])
def test_the_keras_optimizer_on_a_process_set_trains_its_members_and_leaves_the_others_their_own(who):
    """Horovod's reduction is the identity outside the set. Before 2026-12-07 a rank outside it raised in
    its tape or fit, and a model trained by the set's ranks only hung in its first step (the optimizer's
    build agreed over every rank)."""
    if N < 2:
        pytest.skip("needs a set of some ranks only")
    members = list(range(N - 1))  # the last rank is outside
    ps = hvd.add_process_set(members)
    try:
        if who == "every rank" or R in members:
            model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False,
                                                                            kernel_initializer="zeros")])
            model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=ps),
                          loss=lambda y, p: tf.reduce_mean(p) * float(R + 1))
            model.fit(np.ones((1, 1)), np.zeros((1, 1)), batch_size=1, epochs=1, verbose=0)
            mean = sum(r + 1.0 for r in members) / len(members)
            assert model.get_weights()[0].ravel().tolist() == [-(mean if R in members else R + 1.0)]
        hvd.barrier()
    finally:
        hvd.remove_process_set(ps)


@pytest.fixture
def all_but_the_last():
    """(members, process set) of every rank but the last; removed afterwards."""
    if N < 2:
        pytest.skip("needs a set of some ranks only")
    members = list(range(N - 1))
    ps = hvd.add_process_set(members)
    try:
        yield members, ps
    finally:
        hvd.remove_process_set(ps)


@MODES
def test_a_tape_on_a_process_set_gives_a_rank_outside_it_its_own_gradient(graph, all_but_the_last):
    members, ps = all_but_the_last
    w = tf.Variable(np.ones(3, np.float32))

    def grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w) * float(R + 1)
        return hvd.DistributedGradientTape(tape, process_set=ps).gradient(loss, [w])[0]
    got = (tf.function(grads) if graph else grads)().numpy()
    mean = sum(r + 1.0 for r in members) / len(members)
    np.testing.assert_array_equal(got, np.full(3, mean if R in members else R + 1.0))


def test_a_tape_made_by_a_sets_members_only_leaves_the_next_global_tape_in_step(all_but_the_last):
    """Before: an eager tape on a process set, made by its members only, took the global unnamed-call counter, so
    the members' next global tape had another name than the other ranks': a 60 s StallError (an audit). Also
    Horovod's ``gradient(..., use_generic_names=...)`` keyword, which TensorFlow's tape refused."""
    members, ps = all_but_the_last
    w = tf.Variable(np.ones(3, np.float32))
    if R in members:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w) * float(R + 1)
        got = hvd.DistributedGradientTape(tape, process_set=ps).gradient(loss, [w])[0].numpy()
        np.testing.assert_array_equal(got, np.full(3, sum(r + 1.0 for r in members) / len(members)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w) * float(R + 1)
    got = hvd.DistributedGradientTape(tape).gradient(loss, [w], use_generic_names=True)[0].numpy()
    np.testing.assert_array_equal(got, np.full(3, sum(r + 1.0 for r in range(N)) / N))


def test_a_model_saved_with_the_distributed_optimizer_loads_with_and_without_unison(tmp_path_factory):
    """Horovod keeps the optimizer's class name so that the model loads without Horovod. Before 2026-12-07 it
    was saved as a class of unison.tf_backend.keras.optimizer: keras.models.load_model and hvd.load_model both
    failed ('Could not locate class Adam')."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    path = str(tmp_path_factory.mktemp("saved") / f"m{R}.keras")
    model.save(path)
    plain = keras.models.load_model(path)
    assert type(plain.optimizer) is keras.optimizers.Adam and int(plain.optimizer.iterations.numpy()) == 1
    again = hvd_keras.load_model(path)
    assert getattr(again.optimizer, "_unison_distributed", False)
    np.testing.assert_array_equal(again.get_weights()[0], model.get_weights()[0])


def test_unison_keras_optimizer_applies_the_sum_of_accumulated_steps_as_horovod():
    """Before 2026-12-07 unison.keras.DistributedOptimizer applied the mean of backward_passes_per_step steps'
    gradients (Keras's accumulation) where Horovod applies their sum unless average_aggregated_gradients, and
    took ops Horovod refuses."""
    import unison.keras as uk

    def trained(**kwargs):
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False,
                                                                        kernel_initializer="zeros")])
        model.compile(optimizer=uk.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                                        **kwargs), loss=lambda y, p: tf.reduce_mean(p))
        model.fit(np.ones((4, 1)), np.zeros((4, 1)), batch_size=1, epochs=1, verbose=0, shuffle=False)
        return float(model.get_weights()[0].ravel()[0])
    assert trained() == -4.0  # gradient 1 per step: two updates of the sum of two
    assert trained(average_aggregated_gradients=True) == -2.0
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        with pytest.raises(ValueError, match="only supports Average and Sum"):
            uk.DistributedOptimizer(keras.optimizers.SGD(1.0), op=op)
