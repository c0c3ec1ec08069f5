"""Tensor-parallel checkpoints under mpirun (np 4), torch and Keras: tp = 2 -> one process and back.

Every rank builds the same unsplit float64 model from one seed (random normal weights, so a
transposed or misordered block shows) holding every parallel layer kind: a vocabulary-parallel
embedding, a transformer block, a standalone self-attention, an MLP, a column layer and a row
layer. Its tensor-parallel twin is built with the ``from_*`` constructors over a tensor group.

* dp 2 x tp 2 (Grid(dp=2, tp=2): tensor groups {0,1} {2,3}, data groups {0,2} {1,3}): the
  twin is saved with ``data_process_set`` so only data replica 0 writes (replica 1's weights are
  perturbed, and its data files are empty); each rank alone then loads it into the plain model:
  it equals the unsplit source exactly.
* The same checkpoint loaded collectively at tp = 4, 2 and 1 into twins built from another seed
  equals the ``from_*`` shards of the source.
* "And back": rank 0 saves the plain source alone; every rank loads it into tp = 2 and tp = 4
  twins, equal to the ``from_*`` shards.
* Bad input: a column layer's checkpoint loaded into a row layer of the same shape, and an entry
  that only rank 3's model has: the same CheckpointError on every rank.
"""

from __future__ import annotations

import os
import shutil
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from tensor_parallel_groups import register_groups  # noqa: E402
from torch import nn  # noqa: E402

import unison.tf_backend as kvd  # noqa: E402
import unison.torch_backend as hvd  # noqa: E402
from unison.common.checkpoints import CheckpointError, read_manifest  # noqa: E402
from unison.common.tensor_parallel import Grid  # noqa: E402
from unison.tf_backend import tensor_parallel_checkpoint as kck  # noqa: E402
from unison.torch_backend import tensor_parallel_checkpoint as tck  # noqa: E402

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
torch.set_num_threads(1)
D = torch.float64
KD = "float64"
SETS: dict[int, hvd.ProcessSet | None] = {}
GRID: list = []
DIRS: dict[str, str] = {}
SAVED: set[str] = set()  # checkpoints this rank has saved (each once, the first test that needs it)

pytestmark = pytest.mark.skipif(N != 4, reason="the dp 2 x tp 2 grid needs 4 ranks")


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    SETS.update(register_groups(hvd))
    GRID.append(Grid(dp=2, tp=2).register())
    DIRS["root"] = WORLD.bcast(tempfile.mkdtemp(prefix="tpck-") if R == 0 else None)
    yield
    hvd.barrier()
    hvd.shutdown()
    WORLD.Barrier()
    if R == 0:
        shutil.rmtree(DIRS["root"], ignore_errors=True)


def shared(name: str) -> str:
    return os.path.join(DIRS["root"], name)


def same_error_everywhere(excinfo: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, message
    assert len(set(WORLD.allgather(message))) == 1, message


# ------------------------------------------------------------------------------------------- torch

class TorchMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16, dtype=D), nn.Linear(16, 8, dtype=D)


class TorchBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(8, dtype=D), nn.LayerNorm(8, dtype=D)
        self.attn = nn.MultiheadAttention(8, 4, batch_first=True, dtype=D)
        self.mlp = TorchMLP()


class TorchModel(nn.Module):
    """Every parallel layer kind's unsplit source, under the names the twin keeps."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8, dtype=D)
        self.block = TorchBlock()
        self.attn = nn.MultiheadAttention(8, 4, batch_first=True, dtype=D)
        self.mlp = TorchMLP()
        self.head = nn.Linear(8, 16, dtype=D)   # column
        self.proj = nn.Linear(16, 8, dtype=D)   # row
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=D))


def torch_twin(seed: int, ps: hvd.ProcessSet) -> nn.Module:
    """The model of ``seed`` with every layer replaced by its tensor-parallel shard over ``ps``."""
    src, twin = TorchModel(seed), TorchModel(seed)
    b = src.block
    twin.embed = hvd.VocabParallelEmbedding.from_embedding(src.embed, process_set=ps)
    twin.block = hvd.ParallelTransformerBlock.from_modules(b.ln1, b.attn, b.ln2, b.mlp.fc1, b.mlp.fc2,
                                                           process_set=ps)
    twin.attn = hvd.ParallelSelfAttention.from_multihead_attention(src.attn, process_set=ps)
    twin.mlp = hvd.ParallelMLP.from_linears(src.mlp.fc1, src.mlp.fc2, process_set=ps)
    twin.head = hvd.ColumnParallelLinear.from_linear(src.head, process_set=ps)
    twin.proj = hvd.RowParallelLinear.from_linear(src.proj, process_set=ps)
    return twin


def torch_equal(actual: nn.Module, expected: nn.Module) -> None:
    a, e = actual.state_dict(), expected.state_dict()
    assert list(a) == list(e)
    for key in e:
        assert torch.equal(a[key], e[key]), key


def torch_dp_tp_save() -> str:
    """The seed-1 twin on Grid(dp=2, tp=2), saved once (replica 1 perturbed: it must not write)."""
    path = shared("torch-dp2-tp2")
    if path not in SAVED:
        SAVED.add(path)
        sets = GRID[0]
        twin = torch_twin(1, sets.tp)
        if sets.dp.rank() == 1:
            with torch.no_grad():
                for p in twin.parameters():
                    p.add_(1.0)
        manifest = tck.save_tensor_parallel(path, twin, metadata={"step": 7}, data_process_set=sets.dp)
        sizes = {int(name[-9:-4]): size for name, size in manifest.files.items()}
        assert sizes[2] == sizes[3] == 0 and sizes[0] > 0 and sizes[1] > 0, sizes
    return path


def test_torch_tp2_to_one_process():
    path = torch_dp_tp_save()
    plain = TorchModel(99)
    assert tck.load_tensor_parallel(path, plain, local=True) == {"step": 7}
    torch_equal(plain, TorchModel(1))
    spec = read_manifest(path).metadata["tensor_parallel"]["entries"]
    assert spec["block.attn.qkv.weight"] == {"axis": 0, "blocks": 3, "tp": 2}
    assert spec["proj.weight"] == {"axis": 1, "blocks": 1, "tp": 2} and "proj.bias" not in spec


@pytest.mark.parametrize("tp", [4, 2, 1])
def test_torch_tp2_to_any_tp(tp):
    path = torch_dp_tp_save()
    twin = torch_twin(99, SETS[tp])
    tck.load_tensor_parallel(path, twin)
    torch_equal(twin, torch_twin(1, SETS[tp]))


@pytest.mark.parametrize("tp", [2, 4])
def test_torch_one_process_back_to_tp(tp):
    path = shared("torch-plain")
    if R == 0 and path not in SAVED:
        SAVED.add(path)
        tck.save_tensor_parallel(path, TorchModel(5), local=True)
    WORLD.Barrier()
    twin = torch_twin(99, SETS[tp])
    tck.load_tensor_parallel(path, twin)
    torch_equal(twin, torch_twin(5, SETS[tp]))


@pytest.mark.parametrize("consolidated", [False, True])
def test_torch_parallelize_round_trip(consolidated):
    """The user story: a plain model split by ``parallelize`` at tp 2, saved, served unsplit."""
    def plain(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 8, dtype=D), nn.GELU(), nn.Linear(8, 6, dtype=D))

    split = hvd.parallelize(plain(3), {"0": "colwise", "2": "rowwise"}, SETS[2])
    path = shared(f"torch-parallelize-{consolidated}")
    tck.save_tensor_parallel(path, split, data_process_set=GRID[0].dp, consolidated=consolidated)
    served = plain(4)
    tck.load_tensor_parallel(path, served, local=True)
    torch_equal(served, plain(3))


def test_torch_pp2_tp2_to_one_process():
    """Pipeline stages save their own layers by their global names; one process loads the whole model."""
    stage = R // 2  # Grid(pp=2, tp=2): stage 0 = ranks {0, 1}, stage 1 = {2, 3}; tensor groups as SETS[2]
    twin = torch_twin(6, SETS[2])
    for name in (("attn", "mlp", "head", "proj") if stage == 0 else ("embed", "block")):
        delattr(twin, name)
    tck.save_tensor_parallel(shared("torch-pp2-tp2"), twin)
    plain = TorchModel(99)
    tck.load_tensor_parallel(shared("torch-pp2-tp2"), plain, local=True)
    torch_equal(plain, TorchModel(6))


class OneLinear(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.fc = layer


def test_torch_column_checkpoint_into_row_layer_refused():
    ps = SETS[2]
    tck.save_tensor_parallel(shared("torch-column"), OneLinear(hvd.ColumnParallelLinear(8, 8, process_set=ps,
                                                                                       dtype=D)),
                             data_process_set=GRID[0].dp)
    with pytest.raises(CheckpointError) as excinfo:
        tck.load_tensor_parallel(shared("torch-column"), OneLinear(hvd.RowParallelLinear(8, 8, process_set=ps,
                                                                                       dtype=D)))
    same_error_everywhere(excinfo, "'fc.weight'", "saved split along axis 0", "split along axis 1",
                          "load into the plain unsplit model")


def test_torch_missing_entry_refused_on_every_rank():
    twin = torch_twin(99, SETS[2])
    if R == 3:
        twin.extra = nn.Linear(2, 2, dtype=D)
    with pytest.raises(CheckpointError) as excinfo:
        tck.load_tensor_parallel(torch_dp_tp_save(), twin)
    same_error_everywhere(excinfo, "rank 3", "no entry 'extra.weight'")


def test_torch_entries_no_rank_loads_refused_unless_not_strict():
    """A model without a saved layer would drop its saved weights silently: refused on every rank, as
    ``load_state_dict`` refuses unexpected keys; ``strict=False`` loads the layers the model has."""
    path = torch_dp_tp_save()
    twin = torch_twin(99, SETS[2])
    del twin.proj
    with pytest.raises(CheckpointError) as excinfo:
        tck.load_tensor_parallel(path, twin)
    same_error_everywhere(excinfo, "2 entries that no loading rank's model has", "['proj.bias', 'proj.weight']",
                          "strict=False")
    assert tck.load_tensor_parallel(path, twin, strict=False) == {"step": 7}
    expected = torch_twin(1, SETS[2])
    del expected.proj
    torch_equal(twin, expected)


def test_torch_a_model_one_rank_cannot_describe_is_refused_on_every_rank(monkeypatch):
    """Before 2026-12-07 each rank described its model (its tensor positions, its tensors as numpy) before the
    first collective, outside any agreement: a tensor numpy cannot take (a meta tensor) on one rank, or a
    layer outside its tensor group there, raised on that rank alone and the others waited for ever."""
    path = shared("torch-undescribable")
    twin = torch_twin(1, SETS[2])
    if R == 1:  # a writing rank (data replica 0) holding a tensor without data
        twin.head.bias = nn.Parameter(torch.zeros(twin.head.bias.shape, dtype=D, device="meta"))
    with pytest.raises(CheckpointError) as excinfo:
        tck.save_tensor_parallel(path, twin, data_process_set=GRID[0].dp)
    same_error_everywhere(excinfo, "rank 1: unison.torch_backend handles CPU tensors; got a tensor on meta")
    assert not os.path.exists(path)
    good = torch_twin(1, SETS[2])
    tck.save_tensor_parallel(path, good, data_process_set=GRID[0].dp)  # the ranks go on together
    if R == 2:
        def outside(process_set, owner):
            raise ValueError(f"{owner}: this rank (2) is not in the tensor group; build tensor-parallel layers "
                             "only on the ranks of their group")
        monkeypatch.setattr(tck, "group_position", outside)
    loaded = torch_twin(99, SETS[2])
    with pytest.raises(CheckpointError) as excinfo:
        tck.load_tensor_parallel(path, loaded)
    same_error_everywhere(excinfo, "rank 2: save_tensor_parallel/load_tensor_parallel: this rank (2) is not in "
                          "the tensor group")
    monkeypatch.undo()
    tck.load_tensor_parallel(path, loaded)
    torch_equal(loaded, good)


# ------------------------------------------------------------------------------------------- Keras

class KerasMLP(keras.layers.Layer):
    def __init__(self) -> None:
        super().__init__(dtype=KD)
        self.fc1, self.fc2 = keras.layers.Dense(16, activation="gelu", dtype=KD), keras.layers.Dense(8, dtype=KD)
        self.fc1.build((None, 8))
        self.fc2.build((None, 16))


def keras_norm() -> keras.layers.LayerNormalization:
    norm = keras.layers.LayerNormalization(epsilon=1e-5, dtype=KD)
    norm.build((None, None, 8))
    return norm


def keras_mha() -> keras.layers.MultiHeadAttention:
    mha = keras.layers.MultiHeadAttention(4, 2, dtype=KD)
    mha.build((None, 3, 8), (None, 3, 8))
    return mha


class KerasBlock(keras.layers.Layer):
    def __init__(self) -> None:
        super().__init__(dtype=KD)
        self.ln1, self.attn, self.ln2, self.mlp = keras_norm(), keras_mha(), keras_norm(), KerasMLP()


class KerasModel(keras.layers.Layer):
    """The Keras twin of :class:`TorchModel`: every parallel layer kind's unsplit source."""

    def __init__(self, seed: int) -> None:
        super().__init__(dtype=KD)
        self.embed = keras.layers.Embedding(16, 8, dtype=KD)
        self.embed.build((None,))
        self.block, self.attn, self.mlp = KerasBlock(), keras_mha(), KerasMLP()
        self.head, self.proj = keras.layers.Dense(16, dtype=KD), keras.layers.Dense(8, dtype=KD)
        self.head.build((None, 8))
        self.proj.build((None, 16))
        rng = np.random.default_rng(seed)
        for v in self.weights:
            v.assign(rng.standard_normal(tuple(v.shape)))


PARTS = ("embed", "block", "attn", "mlp", "head", "proj")


def keras_twin(seed: int, ps: hvd.ProcessSet) -> keras.layers.Layer:
    src, twin = KerasModel(seed), KerasModel(seed)
    b = src.block
    twin.embed = kvd.VocabParallelEmbedding.from_embedding(src.embed, process_set=ps)
    twin.block = kvd.ParallelTransformerBlock.from_layers(b.ln1, b.attn, b.ln2, b.mlp.fc1, b.mlp.fc2,
                                                          process_set=ps)
    twin.attn = kvd.ParallelSelfAttention.from_multi_head_attention(src.attn, process_set=ps)
    twin.mlp = kvd.ParallelMLP.from_dense_pair(src.mlp.fc1, src.mlp.fc2, process_set=ps)
    twin.head = kvd.ColumnParallelLinear.from_dense(src.head, process_set=ps)
    twin.proj = kvd.RowParallelLinear.from_dense(src.proj, process_set=ps)
    return twin


def keras_equal(actual: keras.layers.Layer, expected: keras.layers.Layer) -> None:
    """Layer by layer (a replaced attribute's old variables stay in the root's ``weights``)."""
    for part in PARTS:
        a, e = getattr(actual, part).weights, getattr(expected, part).weights
        assert [tuple(v.shape) for v in a] == [tuple(v.shape) for v in e], part
        for va, ve in zip(a, e, strict=True):
            np.testing.assert_array_equal(va.numpy(), ve.numpy(), err_msg=f"{part}: {ve.path}")


def keras_dp_tp_save() -> str:
    path = shared("keras-dp2-tp2")
    if path not in SAVED:
        SAVED.add(path)
        sets = GRID[0]
        twin = keras_twin(1, sets.tp)
        if sets.dp.rank() == 1:
            for part in PARTS:
                for v in getattr(twin, part).weights:
                    v.assign(v.numpy() + 1.0)
        manifest = kck.save_tensor_parallel(path, twin, metadata={"step": 8}, data_process_set=sets.dp)
        sizes = {int(name[-9:-4]): size for name, size in manifest.files.items()}
        assert sizes[2] == sizes[3] == 0 and sizes[0] > 0 and sizes[1] > 0, sizes
    return path


def test_keras_tp2_to_one_process():
    path = keras_dp_tp_save()
    plain = KerasModel(99)
    assert kck.load_tensor_parallel(path, plain, local=True) == {"step": 8}
    keras_equal(plain, KerasModel(1))
    spec = read_manifest(path).metadata["tensor_parallel"]["entries"]
    assert spec["block/attn/qkv/kernel"] == {"axis": 1, "blocks": 3, "tp": 2}
    assert spec["head/kernel"] == {"axis": 1, "blocks": 1, "tp": 2}
    assert spec["proj/kernel"] == {"axis": 0, "blocks": 1, "tp": 2} and "proj/bias" not in spec


@pytest.mark.parametrize("tp", [4, 2, 1])
def test_keras_tp2_to_any_tp(tp):
    path = keras_dp_tp_save()
    twin = keras_twin(99, SETS[tp])
    kck.load_tensor_parallel(path, twin)
    keras_equal(twin, keras_twin(1, SETS[tp]))


@pytest.mark.parametrize("tp", [2, 4])
def test_keras_one_process_back_to_tp(tp):
    path = shared("keras-plain")
    if R == 0 and path not in SAVED:
        SAVED.add(path)
        kck.save_tensor_parallel(path, KerasModel(5), local=True)
    WORLD.Barrier()
    twin = keras_twin(99, SETS[tp])
    kck.load_tensor_parallel(path, twin)
    keras_equal(twin, keras_twin(5, SETS[tp]))


def test_keras_sequential_round_trip():
    """A Sequential's layers are named by their names: a tp = 2 twin saves, the plain model loads it."""
    def plain(seed: int) -> keras.Sequential:
        model = keras.Sequential([keras.Input((6,), dtype=KD), keras.layers.Dense(8, name="up", dtype=KD),
                                  keras.layers.Dense(6, name="down", dtype=KD)])
        rng = np.random.default_rng(seed)
        for v in model.weights:
            v.assign(rng.standard_normal(tuple(v.shape)))
        return model

    src = plain(3)
    split = keras.Sequential([keras.Input((6,), dtype=KD),
                              kvd.ColumnParallelLinear.from_dense(src.layers[0], process_set=SETS[2]),
                              kvd.RowParallelLinear.from_dense(src.layers[1], process_set=SETS[2])])
    split.layers[0].name, split.layers[1].name = "up", "down"
    kck.save_tensor_parallel(shared("keras-sequential"), split, data_process_set=GRID[0].dp)
    served = plain(4)
    kck.load_tensor_parallel(shared("keras-sequential"), served, local=True)
    for actual, expected in zip(served.weights, src.weights, strict=True):
        np.testing.assert_array_equal(actual.numpy(), expected.numpy())


def keras_chain(seed: int) -> keras.Sequential:
    """up (column-split on a tensor grid) -> down (row-split) -> head, every weight drawn from ``seed``."""
    model = keras.Sequential([keras.Input((4,), dtype=KD), keras.layers.Dense(8, activation="tanh", name="up",
                                                                              dtype=KD),
                              keras.layers.Dense(4, name="down", dtype=KD), keras.layers.Dense(2, name="head",
                                                                                               dtype=KD)])
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.standard_normal(tuple(v.shape)) * 0.5)
    return model


def keras_chain_pipeline(seed: int, grid: Grid, sets) -> kvd.Pipeline:
    from unison.common.tensor_parallel import grid_pipeline

    model = keras_chain(seed)
    if grid.tp > 1:
        model = kvd.parallelize(model, {"up": "colwise", "down": "rowwise"}, sets.tp)
    return kvd.Pipeline(model, balance=[2, 1], chunks=2, loss="mse", optimizer=lambda: keras.optimizers.SGD(0.1),
                        grid=grid_pipeline(grid, sets))


@pytest.mark.parametrize("dp,pp,tp", [(2, 2, 1), (1, 2, 2)])
def test_keras_pipeline_saves_its_stages_and_one_process_loads_the_trained_model(dp, pp, tp):
    """save_tensor_parallel(path, pipe) of a Keras Pipeline (pp = 2, with data replicas or tensor-split
    stages) writes each stage's layers under their names in the Sequential: the plain model loads them in
    one process and equals the same model trained in one process on the whole batches, and a pipeline
    built from another seed loads them back. Before 2026-12-07 the Keras save raised AttributeError
    "'Pipeline' object has no attribute 'weights'" (the torch Pipeline saved)."""
    grid = Grid(dp=dp, pp=pp, tp=tp)
    sets = grid.register()
    rng = np.random.default_rng(80)
    x, y = rng.standard_normal((8, 4)), rng.standard_normal((8, 2))
    ref = keras_chain(81)
    optimizer = keras.optimizers.SGD(0.1)
    _, d, _ = grid.coords(R)
    rows = slice(d * 8 // dp, (d + 1) * 8 // dp)  # this replica's part of each global batch
    path = shared(f"keras-pipeline-{dp}-{pp}-{tp}")
    pipe = keras_chain_pipeline(81, grid, sets)
    try:
        for _ in range(2):
            pipe.train_step(x[rows], y[rows])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.mean_squared_error(y, ref(x)))
            optimizer.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables,
                                          strict=True))
        kck.save_tensor_parallel(path, pipe, metadata={"step": 2}, data_process_set=sets.dp if dp > 1 else None)
        held = {layer.name: layer for s in pipe.layer_ranges for layer in pipe.stages[s].layers}
    finally:
        pipe.close()
    served = keras_chain(99)
    assert kck.load_tensor_parallel(path, served, local=True) == {"step": 2}
    for actual, expected in zip(served.weights, ref.weights, strict=True):  # the pipeline's loss is float32
        np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=1e-6, atol=1e-7, err_msg=expected.path)
    again = keras_chain_pipeline(98, grid, sets)
    try:
        kck.load_tensor_parallel(path, again)
        for layer in (layer for s in again.layer_ranges for layer in again.stages[s].layers):
            for actual, expected in zip(layer.weights, held[layer.name].weights, strict=True):
                np.testing.assert_array_equal(actual.numpy(), expected.numpy(), err_msg=actual.path)
    finally:
        again.close()


class KerasOne(keras.layers.Layer):
    def __init__(self, layer: keras.layers.Layer) -> None:
        super().__init__(dtype=KD)
        self.fc = layer


def test_keras_column_checkpoint_into_row_layer_refused():
    ps = SETS[2]
    kck.save_tensor_parallel(shared("keras-column"), KerasOne(kvd.ColumnParallelLinear(8, 8, process_set=ps,
                                                                                      dtype=KD)),
                             data_process_set=GRID[0].dp)
    with pytest.raises(CheckpointError) as excinfo:
        kck.load_tensor_parallel(shared("keras-column"), KerasOne(kvd.RowParallelLinear(8, 8, process_set=ps,
                                                                                       dtype=KD)))
    same_error_everywhere(excinfo, "'fc/kernel'", "saved split along axis 1", "split along axis 0")


def test_keras_missing_entry_refused_on_every_rank():
    twin = keras_twin(99, SETS[2])
    if R == 3:
        twin.extra = keras.layers.Dense(2, dtype=KD)
        twin.extra.build((None, 2))
    with pytest.raises(CheckpointError) as excinfo:
        kck.load_tensor_parallel(keras_dp_tp_save(), twin)
    same_error_everywhere(excinfo, "rank 3", "no entry 'extra/kernel'")


class KerasHead(keras.layers.Layer):
    def __init__(self, layer: keras.layers.Layer) -> None:
        super().__init__(dtype=KD)
        self.head = layer


def test_keras_entries_no_rank_loads_refused_unless_not_strict():
    path = keras_dp_tp_save()
    served = KerasHead(keras_twin(99, SETS[2]).head)  # every saved entry but the head's has no variable here
    with pytest.raises(CheckpointError) as excinfo:
        kck.load_tensor_parallel(path, served)
    same_error_everywhere(excinfo, "that no loading rank's model has", "'block/attn/qkv/kernel'", "strict=False")
    assert kck.load_tensor_parallel(path, served, strict=False) == {"step": 8}
    expected = keras_twin(1, SETS[2]).head
    for actual, want in zip(served.head.weights, expected.weights, strict=True):
        np.testing.assert_array_equal(actual.numpy(), want.numpy())


def test_keras_replicated_copies_that_differ_are_refused_on_every_rank():
    """A replicated trained variable (a row layer's bias, a norm's gamma) that differs within a
    tensor group would be kept from one rank only: refused, as the torch adapter refuses it (the
    Keras save kept rank 0's copy silently)."""
    twin = keras_twin(1, SETS[2])
    if R % 2 == 1:
        twin.proj.bias.assign(twin.proj.bias.numpy() + 1.0)
    with pytest.raises(CheckpointError) as excinfo:
        kck.save_tensor_parallel(shared("keras-diverged"), twin)
    same_error_everywhere(excinfo, "replicated parameter(s) differ between the ranks", "'proj/bias'")
    with pytest.raises(CheckpointError):  # nothing was committed
        read_manifest(shared("keras-diverged"))
