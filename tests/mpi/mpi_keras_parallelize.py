"""``parallelize(model, plan)`` for Keras 3 under mpirun: the split model equals the unsplit one.

The same groups as mpi_keras_tensor_parallel.py (tensor_parallel_groups.py: tp = 1..4, the job cut
into consecutive groups of tp ranks, rank 3 idle at tp = 3 of 4). Every rank builds the same
unsplit float64 model from one seed and computes the reference locally; the ranks of a group
split it with ``parallelize`` and compare the output, the input's gradient and their shard of
every weight's gradient, a cross-entropy over a split vocabulary, ``model.fit`` against the
unsplit model fitted the same way, and the errors of bad plans (the same message on every rank,
the given model unchanged).
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras_tp_helpers import close, piece, seeded  # noqa: E402
from mpi4py import MPI  # noqa: E402
from tensor_parallel_groups import TPS, group_or_refusal, register_groups  # noqa: E402

import unison.tf_backend as hvd  # noqa: E402
from unison.tf_backend.tensor_parallel_plan import parallelize  # noqa: E402

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
D = "float64"
SETS: dict[int, hvd.ProcessSet | None] = {}  # tp -> this rank's registered group (None: idle)
MLP_PLAN = {"dense_a": "colwise", "dense_b": "rowwise"}
LM_PLAN = {"embed": "vocab", "head": "colwise"}
VOCAB = 12


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    SETS.update(register_groups(hvd))
    yield
    hvd.barrier()  # a rank that shuts down stops the engine for all: wait for every group's last call
    hvd.shutdown()


def group(tp: int) -> hvd.ProcessSet | None:
    return group_or_refusal(hvd, SETS, tp)


def randomize(model: keras.Model, seed: int) -> keras.Model:
    """Every weight from one seed (biases too: Keras starts them at zero)."""
    rng = np.random.default_rng(seed)
    for w in model.weights:
        w.assign(rng.standard_normal(w.shape) * 0.5)
    return model


def mlp(seed: int, fan_in: int = 8, hidden: int = 16, fan_out: int = 8) -> keras.Sequential:
    return randomize(keras.Sequential([keras.Input((fan_in,), dtype=D),
                                       keras.layers.Dense(hidden, activation="gelu", name="dense_a", dtype=D),
                                       keras.layers.Dense(fan_out, name="dense_b", dtype=D)]), seed)


def tiny_lm(seed: int) -> keras.Model:
    """Functional: Embedding(12, 4), tanh, a Dense head over the vocabulary."""
    ids = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Activation("tanh", name="act", dtype=D)(keras.layers.Embedding(VOCAB, 4, name="embed",
                                                                                          dtype=D)(ids))
    return randomize(keras.Model(ids, keras.layers.Dense(VOCAB, name="head", dtype=D)(hidden)), seed)


def run(model, x, upstream):
    """``model(x)`` and the gradients of ``sum(model(x) * upstream)`` for ``x`` and every weight."""
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = model(x)
        loss = tf.reduce_sum(out * upstream)
    dx, *dw = tape.gradient(loss, [x, *model.trainable_weights])
    return out, dx, dw


def weights_of(model: keras.Model) -> list[np.ndarray]:
    return [np.array(tf.convert_to_tensor(w)) for w in model.weights]


# ------------------------------------------------------------------ equal to the unsplit model


@pytest.mark.parametrize("tp", [tp for tp in TPS if 16 % tp == 0])
def test_parallelize_mlp_equals_the_unsplit_model(tp):
    ref = mlp(31)
    x, upstream = seeded(32, 4, 8), seeded(33, 4, 8)
    expected, dx, (dka, dba, dkb, dbb) = run(ref, x, upstream)
    ps = group(tp)
    if ps is None:
        return
    model = parallelize(ref, MLP_PLAN, ps)
    assert model is not ref and [type(layer) for layer in model.layers] == [hvd.ColumnParallelLinear,
                                                                           hvd.RowParallelLinear]
    assert [layer.name for layer in model.layers] == ["dense_a", "dense_b"]
    out, dx_par, (dka_par, dba_par, dkb_par, dbb_par) = run(model, x, upstream)
    close(out, expected)
    close(dx_par, dx)
    close(dka_par, piece(dka, ps, 1))
    close(dba_par, piece(dba, ps, 0))
    close(dkb_par, piece(dkb, ps, 0))
    close(dbb_par, dbb)
    close(tf.function(model)(tf.constant(x)), expected)  # traced: graph-named collectives
    assert isinstance(ref.layers[0], keras.layers.Dense)  # the given model is left as it was
    close(ref(x), expected)


@pytest.mark.parametrize("tp", TPS)
def test_parallelize_embedding_and_head_with_the_vocab_parallel_loss(tp):
    ids = np.random.default_rng(35).integers(0, VOCAB, (3, 5)).astype("int32")
    target = np.random.default_rng(36).integers(0, VOCAB, (3, 5))
    ref = tiny_lm(34)
    with tf.GradientTape() as tape:
        expected = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(target, ref(ids), from_logits=True))
    d_embed, d_kernel, d_bias = tape.gradient(expected, ref.trainable_weights)
    ps = group(tp)
    if ps is None:
        return
    model = parallelize(ref, LM_PLAN, ps)
    embed, act, head = (model.get_layer(name) for name in ("embed", "act", "head"))
    assert isinstance(embed, hvd.VocabParallelEmbedding) and isinstance(head, hvd.ColumnParallelLinear)
    assert act is ref.get_layer("act")
    with tf.GradientTape() as tape:
        loss = hvd.vocab_parallel_cross_entropy(model(ids), target, process_set=ps)
    close(loss, expected)
    mine = tape.gradient(loss, [embed.embeddings, head.kernel, head.bias])
    close(mine[0], piece(d_embed, ps, 0))
    close(mine[1], piece(d_kernel, ps, 1))
    close(mine[2], piece(d_bias, ps, 0))


def _widest_tp() -> int:
    return max(tp for tp in TPS if 16 % tp == 0)


def test_unmatched_layers_share_the_original_weights():
    """Only ``dense_a`` is split (gathered); ``dense_b`` is the given model's own layer object."""
    ref, ps = mlp(39), SETS[_widest_tp()]
    model = parallelize(ref, {"dense_a": {"style": "colwise", "gather_output": True}}, ps)
    assert isinstance(model.layers[0], hvd.ColumnParallelLinear) and model.layers[0].gather_output
    assert model.layers[1] is ref.layers[1] and model.layers[1].kernel is ref.layers[1].kernel
    x = seeded(40, 3, 8)
    close(model(x), ref(x))
    ref.layers[1].kernel.assign(seeded(41, 16, 8))  # a change to the original shows in the split model
    close(model(x), ref(x))


def test_layers_of_a_nested_model_are_named_by_their_path():
    ps = SETS[_widest_tp()]
    inner = keras.Sequential([keras.layers.Dense(16, activation="gelu", name="dense_a", dtype=D),
                              keras.layers.Dense(8, name="dense_b", dtype=D)], name="block")
    outer = [keras.Input((8,), dtype=D), inner, keras.layers.Dense(3, name="out", dtype=D)]
    ref = randomize(keras.Sequential(outer), 42)
    model = parallelize(ref, {"block/dense_a": "colwise", "block/dense_b": "rowwise"}, ps)
    block = model.get_layer("block")
    assert [type(layer) for layer in block.layers] == [hvd.ColumnParallelLinear, hvd.RowParallelLinear]
    assert model.get_layer("out") is ref.get_layer("out") and inner.layers[0].__class__ is keras.layers.Dense
    x = seeded(43, 3, 8)
    close(model(x), ref(x))


# ------------------------------------------------------------------ model.fit


def test_fit_of_the_split_model_equals_the_unsplit_model_fitted_the_same_way():
    """tp = 2 (every rank in a group of two), plain SGD with momentum, one fixed batch on every
    rank, 3 epochs of one step: each rank's shards end equal to the slices of the unsplit model."""
    if N % 2:
        pytest.skip("tp = 2 with every rank in a group needs an even job")
    ps = SETS[2]
    x, y = seeded(44, 6, 8), seeded(45, 6, 8)
    ref, model = mlp(46), parallelize(mlp(46), MLP_PLAN, ps)
    for m in (ref, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    fitted = [m.fit(x, y, batch_size=6, epochs=3, shuffle=False, verbose=0).history["loss"] for m in (ref, model)]
    np.testing.assert_allclose(fitted[1], fitted[0], rtol=1e-10)
    assert fitted[0][-1] < fitted[0][0]  # it trained
    a, b = ref.layers
    close(model.layers[0].kernel, piece(a.kernel, ps, 1))
    close(model.layers[0].bias, piece(a.bias, ps, 0))
    close(model.layers[1].kernel, piece(b.kernel, ps, 0))
    close(model.layers[1].bias, b.bias)


# ------------------------------------------------------------------ bad input


BAD_PLANS = [
    ({"nothing": "colwise"}, r"plan entry 'nothing' matches no layer path .* paths are "
                             r"\['embed', 'act', 'head'\]"),
    ({"act": "colwise"}, r"style 'colwise' splits a keras.layers.Dense layer, but 'act' is a Activation"),
    ({"head": "vocab"}, r"style 'vocab' splits a keras.layers.Embedding layer, but 'head' is a "
                        r"keras.layers.Dense"),
    ({"embed": "rowwise"}, r"style 'rowwise' splits a keras.layers.Dense layer, but 'embed' is a "
                           r"keras.layers.Embedding"),
    ({"head": "colwise", "h.*": "rowwise"}, r"layer 'head' is matched by two plan entries, 'head' and 'h\.\*'"),
    ({"head": "diagonal"}, r"the style must be one of \['colwise', 'rowwise', 'vocab'\]; received 'diagonal'"),
    ({"head": {"style": "colwise", "input_is_parallel": True}},
     r"style 'colwise' takes the options \['gather_output'\]; received \['input_is_parallel'\]"),
]


@pytest.mark.parametrize("plan,message", BAD_PLANS, ids=["nothing", "not-dense", "not-embedding", "row-embedding",
                                                         "twice", "style", "option"])
def test_bad_plans_raise_the_same_error_on_every_rank(plan, message):
    model = tiny_lm(47)
    before, ids = weights_of(model), np.arange(10, dtype="int32").reshape(2, 5)
    out = np.array(model(ids))
    with pytest.raises(ValueError, match=message) as err:
        parallelize(model, plan, hvd.global_process_set)
    assert hvd.allgather_object(str(err.value)) == [str(err.value)] * N
    assert [type(layer) for layer in model.layers[1:]] == [keras.layers.Embedding, keras.layers.Activation,
                                                           keras.layers.Dense]
    for got, want in zip(weights_of(model), before, strict=True):
        np.testing.assert_array_equal(got, want)
    close(model(ids), out)


def test_sizes_the_group_does_not_divide_raise_and_leave_the_model():
    """The column layer is built, then the row layer's in_features (2N+1) raises: nothing returned."""
    if N == 1:
        pytest.skip("every size divides a group of one")
    keras.utils.set_random_seed(7)  # one model on every rank ([Note: one unsplit source on every rank])
    model = keras.Sequential([keras.Input((8,), dtype=D), keras.layers.Dense(4 * N, name="dense_a", dtype=D),
                              keras.layers.Dense(2 * N + 1, name="dense_c", dtype=D),
                              keras.layers.Dense(8, name="dense_b", dtype=D)])
    with pytest.raises(ValueError, match=rf"RowParallelLinear in_features \({2 * N + 1}\) is not divisible by the "
                                         rf"tensor group size \({N}\)") as err:
        parallelize(model, MLP_PLAN, hvd.global_process_set)
    assert hvd.allgather_object(str(err.value)) == [str(err.value)] * N
    assert all(type(layer) is keras.layers.Dense for layer in model.layers)


class Subclassed(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.dense_a = keras.layers.Dense(4, dtype=D)

    def call(self, x):
        return self.dense_a(x)


@pytest.mark.parametrize("case", ["rest", "plan"])
def test_splitting_models_that_differ_between_ranks_raises_on_every_rank(case):
    """[Note: one unsplit source on every rank]: a layer the plan leaves whole that differs on one rank (a
    model built without a common seed: before 2026-12-05 the ranks trained different replicated weights
    silently), or a plan that differs on one rank, raise MismatchError on every rank of the group."""
    ps = group(2)
    if ps is None:
        return
    odd = ps.rank() == 1
    ref = mlp(31)
    plan = dict(MLP_PLAN)
    if case == "rest":
        ref = randomize(keras.Sequential([keras.Input((8,), dtype=D), *ref.layers,
                                          keras.layers.Dense(3, name="dense_c", dtype=D)]), 31)
        if odd:  # a layer the plan leaves whole, different on one rank
            ref.layers[2].kernel.assign(ref.layers[2].kernel + 1.0)
    elif odd:
        plan.pop("dense_b")
    with pytest.raises(hvd.MismatchError, match=r"parallelize: the ranks passed different values: .* on rank "
                                                r"\d.*Every rank of a tensor group must split the same unsplit"):
        parallelize(ref, plan, ps)
    model = parallelize(mlp(31), MLP_PLAN, ps)  # made alike, it works
    x = seeded(34, 4, 8)
    close(model(x), mlp(31)(x))


def test_a_subclassed_or_unbuilt_model_is_refused():
    model = Subclassed()
    model(np.zeros((1, 3)))
    with pytest.raises(TypeError, match=r"received the subclassed model Subclassed.*hvd.ColumnParallelLinear.*"
                                        r"Sequential or functional"):
        parallelize(model, {"dense_a": "colwise"}, hvd.global_process_set)
    with pytest.raises(TypeError, match=r"needs a keras.Model .*received Dense"):
        parallelize(keras.layers.Dense(4), {"dense_a": "colwise"}, hvd.global_process_set)
    unbuilt = keras.Sequential([keras.layers.Dense(4, name="dense_a")])
    with pytest.raises(ValueError, match=r"is not built; give it a keras.Input or call it on a batch first"):
        parallelize(unbuilt, {"dense_a": "colwise"}, hvd.global_process_set)
    compiled = mlp(3)  # Keras recompiles the clone from a config that names a class Unison made on the fly
    compiled.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    with pytest.raises(ValueError, match=r"compiled with Unison's SGD wrapper.*Parallelize the model before "):
        parallelize(compiled, MLP_PLAN, hvd.global_process_set)


def test_a_split_model_broadcasts_within_its_data_group_and_refuses_a_rank_0_backup(tmp_path):
    """On a dp 2 x tp 2 grid each rank holds other shards than its tensor group's: the broadcast
    callbacks overwrote every rank's shards with rank 0's (kernels 2.5 off). They now take the
    data-parallel group, and without it refuse on every rank; BackupAndRestore (rank 0's weights
    only) refuses such a model."""
    if N != 4:
        pytest.skip("the dp 2 x tp 2 grid needs 4 ranks")
    import unison.keras as ukeras
    import unison.tf_backend.keras as hvdk
    from unison.common.tensor_parallel import Grid

    grid = Grid(dp=2, tp=2)
    sets = grid.register()
    replica = grid.coords(R).dp
    x, y = seeded(47, 4, 8), seeded(48, 4, 8)
    for callback in (ukeras.callbacks.BroadcastGlobalVariablesCallback,
                     hvdk.callbacks.BroadcastGlobalVariablesCallback):
        model = parallelize(mlp(46 + replica), MLP_PLAN, sets.tp)  # replica 1 starts elsewhere
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        with pytest.raises(ValueError, match=r"layers \['dense_a', 'dense_b'\] are split over a tensor group") \
                as info:
            model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[callback(0)])
        assert len(set(WORLD.allgather(str(info.value)))) == 1
        model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                  callbacks=[callback(sets.dp.ranks[0], process_set=sets.dp)])
        want = mlp(46)  # replica 0's weights, each rank's own shard of them
        close(model.layers[0].kernel, piece(want.layers[0].kernel, sets.tp, 1))
        close(model.layers[1].kernel, piece(want.layers[1].kernel, sets.tp, 0))
        close(model.layers[1].bias, want.layers[1].bias)
    with pytest.raises(ValueError, match="root_rank=0 is not a member of its"):  # ranks 1 and 3's set lacks 0
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[callback(0, process_set=sets.dp)])
    folder = WORLD.bcast(str(tmp_path) if R == 0 else None)
    with pytest.raises(ValueError, match="save and restore it with save_tensor_parallel"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[hvdk.callbacks.BackupAndRestore(folder)])
