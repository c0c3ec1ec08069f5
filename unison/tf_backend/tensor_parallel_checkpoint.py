"""``save_tensor_parallel`` / ``load_tensor_parallel``: a tensor-parallel Keras 3 model, one shard per rank.

The Keras twin of ``unison/torch_backend/tensor_parallel_checkpoint.py``, over the same
framework-neutral core ([Note: canonical layout of a tensor-parallel entry] in
``unison/common/tensor_parallel/checkpoint.py``). Keras keeps a ``Dense`` kernel as ``(in, out)``,
so a column layer splits kernel axis 1 and a row layer axis 0 (the transpose of torch's); the
spec carries the axis, the layout follows.

[Note: Keras entry names are attribute paths]
Entries are named ``<attribute path>/<variable name>`` (``block/attn/qkv/kernel``), found by
walking the model's public attributes that are layers, and the lists, tuples and dicts that
hold layers (``heads/cls/kernel`` for ``self.heads = {"cls": Dense(...)}``), at any depth; a
``Sequential`` or functional model's layers by their names. A layer Keras tracks but the walk
cannot name (one in a private attribute or a set) is refused on every rank, not skipped: before
2026-12-05 the layers of a dict attribute were left out of the checkpoint, and a load left them
at their random initial values without a word. Keras's own ``variable.path`` does not serve: a layer
made in its parent's ``__init__`` gets no parent prefix, and an auto-generated layer name
(``column_parallel_linear_3``) counts the layers this process made before, so it differs between
a parallel model and its plain source. A plain ``keras.layers.MultiHeadAttention`` (self-attention
as :class:`ParallelSelfAttention` accepts it) is named like the parallel layer: ``qkv/kernel`` is
its q, k and v kernels reshaped to ``(hidden, hidden)`` and concatenated along the output axis,
``out/kernel`` its output kernel as ``(hidden, hidden)``, so a block built by
``from_multi_head_attention`` and its plain source share a checkpoint (with or without biases).

[Note: a Keras pipeline saves its stages' layers]
``save_tensor_parallel(path, pipe)`` with a Keras ``Pipeline`` walks the layers of the stages this
rank holds (``pipe.stages[s].layers`` for ``s`` in ``pipe.layer_ranges``) under their names, the
names the ``Sequential`` it was made from gives them: the stages together write the whole model,
which the plain ``Sequential`` loads in one process, and ``load_tensor_parallel(path, pipe)``
reads them back at any pp (or tp). This is the PyTorch backend's ``Pipeline.local_module()``
path, with Keras's names for indices. Before 2026-12-07 a Keras pipeline failed with
"'Pipeline' object has no attribute 'weights'", and saving the ``Sequential`` on every rank
was refused (the stages a rank does not hold are not trained there).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import keras
import numpy as np

from unison.common import runtime
from unison.common.checkpoints import Manifest, agree
from unison.common.engine.process_sets import ProcessSet
from unison.common.tensor_parallel import checkpoint as tpck
from unison.common.tensor_parallel.checkpoint import REPLICATED, ShardSpec, TPParam
from unison.common.tensor_parallel.groups import group_position
from unison.tf_backend.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from unison.tf_backend.tensor_parallel_blocks import ParallelSelfAttention

__all__ = ["save_tensor_parallel", "load_tensor_parallel"]

#: layer class -> {variable path inside the layer: how the layer splits it}; variables not listed
#: are replicated; a container's entries override its children's (fused q/k/v: 3 blocks).
SPLITS: list[tuple[type, dict[str, ShardSpec]]] = [
    (ColumnParallelLinear, {"kernel": ShardSpec(1), "bias": ShardSpec(0)}),
    (RowParallelLinear, {"kernel": ShardSpec(0)}),
    (VocabParallelEmbedding, {"embeddings": ShardSpec(0)}),
    (ParallelSelfAttention, {"qkv/kernel": ShardSpec(1, 3), "qkv/bias": ShardSpec(0, 3)}),
]


class _Slot(NamedTuple):
    """One entry of a Keras model: its name, the layer whose group splits it, read and write."""

    name: str
    owner: Any
    get: Callable[[], np.ndarray]
    set: Callable[[np.ndarray], None]
    dtype: str
    trainable: bool = True  # a trained variable: its replicated copies must agree when saved


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _contained(name: str, value: Any) -> list[tuple[str, Any]]:
    """The layers in ``value`` (a layer, or lists, tuples and dicts of them), named ``name/index``
    and ``name/key`` (Keras tracks a dict attribute as a ``TrackedDict``: its layers' variables
    are the model's)."""
    if isinstance(value, keras.layers.Layer):
        return [(name, value)]
    if isinstance(value, (list, tuple)):
        items: Any = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    else:
        return []
    return [found for key, item in items for found in _contained(f"{name}/{key}", item)]


def _children(layer: Any) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    for attr, value in vars(layer).items():
        if not attr.startswith("_"):
            found += _contained(attr, value)
    if not found and isinstance(layer, keras.Model):  # Sequential / functional: layers by name
        found = [(child.name, child) for child in layer.layers]
    return found


#: Keras's own bookkeeping attributes, which list every layer ever assigned (replaced ones too),
#: and TensorFlow's (``_self_*``: a Keras layer on the TensorFlow backend is a ``tf.Module``)
_KERAS_BOOKKEEPING = frozenset({"_layers", "_tracker"})


def _bookkeeping(attr: str) -> bool:
    return attr in _KERAS_BOOKKEEPING or attr.startswith("_self_")


def _holds(value: Any, layer: Any, depth: int = 0) -> bool:
    if value is layer:
        return True
    if depth > 8 or not isinstance(value, (list, tuple, dict, set, frozenset)):
        return False
    items = value.values() if isinstance(value, dict) else value
    return any(_holds(item, layer, depth + 1) for item in items)


def _unnamed(layers: list[tuple[str, Any]]) -> str | None:
    """A problem for a layer with variables that Keras tracks under a visited layer (so they are
    among ``model.weights``) and that is still held by one of its attributes, yet has no name in
    the walk (a private attribute, a set): saved without it, a load would leave it as it was.
    A layer Keras tracks but no attribute holds any more (replaced) is not the model's."""
    named = {id(layer) for _, layer in layers}
    for path, layer in layers:
        if isinstance(layer, keras.layers.MultiHeadAttention):
            continue
        for child in getattr(layer, "_layers", []):
            if id(child) in named or not child.weights:
                continue
            held = [attr for attr, value in vars(layer).items()
                    if not _bookkeeping(attr) and _holds(value, child)]
            if held:
                return (f"layer {child.name!r}, held by attribute {held[0]!r} of {path or 'the model'!r}, has "
                        f"variables ({', '.join(v.path for v in child.weights)}) that no checkpoint entry names: "
                        "entries are named by public attributes that hold layers, or lists, tuples and dicts of "
                        "them. Hold it in one of those, or the checkpoint would skip it")
    return None


def _layers(root: Any, tops: list[tuple[str, Any]] | None = None) -> Iterator[tuple[str, Any]]:
    """``(attribute path, layer)``, parents before children, each layer once (at its first path); from
    ``tops`` (named layers without a root) when given."""
    seen: set[int] = set()
    stack = list(tops) if tops is not None else [("", root)]
    while stack:
        path, layer = stack.pop(0)
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield path, layer
        if not isinstance(layer, keras.layers.MultiHeadAttention):
            stack[0:0] = [(_join(path, name), child) for name, child in _children(layer)]


def _model_layers(model: Any) -> list[tuple[str, Any]]:
    """``model``'s layers as :func:`_layers` walks them; for a Keras :class:`~unison.tf_backend.Pipeline`,
    this rank's stages' layers under their names in the whole ``Sequential`` ([Note: a Keras pipeline
    saves its stages' layers])."""
    from unison.tf_backend.pipeline import Pipeline

    if not isinstance(model, Pipeline):
        return list(_layers(model))
    held = [layer for s in sorted(model.layer_ranges) for layer in model.stages[s].layers]
    return list(_layers(None, [(layer.name, layer) for layer in held]))


def _variable_slot(name: str, owner: Any, variable: Any) -> _Slot:
    return _Slot(name, owner, lambda: np.asarray(variable.numpy()), lambda a: variable.assign(a),
                 str(variable.dtype), bool(variable.trainable))


def _plain_mha(mha: keras.layers.MultiHeadAttention) -> bool:
    if not mha.built:
        return False
    hidden = int(mha.query_dense.kernel.shape[0])
    return (mha.num_heads * mha.key_dim == hidden and mha.value_dim == mha.key_dim
            and int(mha.output_dense.kernel.shape[-1]) == hidden
            and tuple(mha.query_dense.kernel.shape) == tuple(mha.key_dense.kernel.shape))


def _mha_slots(path: str, mha: keras.layers.MultiHeadAttention) -> list[_Slot]:
    """A plain MultiHeadAttention as ParallelSelfAttention's four entries, two without biases
    (see the module's note)."""
    parts = (mha.query_dense, mha.key_dense, mha.value_dense)
    hidden = int(mha.query_dense.kernel.shape[0])
    out = mha.output_dense

    def put(variables: list[Any], array: np.ndarray, axis: int) -> None:
        for variable, piece in zip(variables, np.split(array, len(variables), axis=axis), strict=True):
            variable.assign(piece.reshape(tuple(variable.shape)))

    dtype = str(out.kernel.dtype)
    kernels = [
        _Slot(_join(path, "qkv/kernel"), mha,
              lambda: np.concatenate([np.reshape(p.kernel.numpy(), (hidden, hidden)) for p in parts], 1),
              lambda a: put([p.kernel for p in parts], a, 1), dtype),
        _Slot(_join(path, "out/kernel"), mha, lambda: np.reshape(out.kernel.numpy(), (hidden, hidden)),
              lambda a: out.kernel.assign(a.reshape(tuple(out.kernel.shape))), dtype),
    ]
    if not mha.use_bias:
        return kernels
    return kernels + [
        _Slot(_join(path, "qkv/bias"), mha,
              lambda: np.concatenate([np.reshape(p.bias.numpy(), -1) for p in parts]),
              lambda a: put([p.bias for p in parts], a, 0), dtype),
        _variable_slot(_join(path, "out/bias"), mha, out.bias),
    ]


def _own_variables(layer: Any, children: list[tuple[str, Any]]) -> list[Any]:
    """The variables ``layer`` made itself (not its children's, nor those of layers it replaced).

    Keras keeps a layer's own variables in ``_trainable_variables`` / ``_non_trainable_variables``
    (Keras 3); ``layer.weights`` also lists every layer ever assigned to an attribute, including
    one since replaced (a plain ``Dense`` swapped for its parallel layer), so it cannot serve.
    """
    own = getattr(layer, "_trainable_variables", None)
    if own is not None:
        return list(own) + list(getattr(layer, "_non_trainable_variables", []))
    theirs = {id(v) for _, child in children for v in child.weights}
    return [v for v in layer.weights if id(v) not in theirs]


def _slots(layers: list[tuple[str, Any]]) -> tuple[list[_Slot], dict[str, ShardSpec]]:
    """Every variable of a model's ``layers`` as a named slot, and entry name -> spec for the split ones."""
    slots: list[_Slot] = []
    specs: dict[str, ShardSpec] = {}
    for path, layer in layers:
        if isinstance(layer, keras.layers.MultiHeadAttention):
            slots += _mha_slots(path, layer) if _plain_mha(layer) else [
                _variable_slot(_join(path, "/".join(v.path.split("/")[-2:])), layer, v) for v in layer.weights]
            continue
        slots += [_variable_slot(_join(path, v.name), layer, v) for v in _own_variables(layer, _children(layer))]
    for path, layer in reversed(layers):  # children first: containers override
        for cls, table in SPLITS:
            if isinstance(layer, cls):
                specs.update({_join(path, key): spec for key, spec in table.items()})
    return slots, specs


def _describe(layers: list[tuple[str, Any]], with_arrays: bool) -> list[tuple[TPParam, _Slot]]:
    slots, specs = _slots(layers)
    owners = {slot.name: slot.owner for slot in slots}
    out = []
    for slot in slots:
        spec = specs.get(slot.name, REPLICATED)
        array = slot.get()
        tp, index = (1, 0) if spec.axis is None else group_position(
            owners[slot.name].process_set, "save_tensor_parallel/load_tensor_parallel")
        shape = list(array.shape)
        if spec.axis is not None:
            shape[spec.axis] *= tp
        out.append((TPParam(slot.name, tuple(shape), spec, tp, index, array if with_arrays else None,
                            str(array.dtype)), slot))
    return out


def _comm(local: bool) -> Any:
    if local:
        return None
    st = runtime.state("unison.tf_backend.save_tensor_parallel()")
    return st.comm if st.size > 1 else None


def save_tensor_parallel(path: str | os.PathLike[str], model: Any, metadata: dict[str, Any] | None = None,
                         data_process_set: ProcessSet | None = None, consolidated: bool = False,
                         local: bool = False) -> Manifest:
    """Save a (tensor-, pipeline-, data-) parallel Keras model collectively: each shard once, by its own rank.

    Every rank of the job calls it with the same ``path`` (unless ``local``). Entries are named
    by attribute paths ([Note: Keras entry names are attribute paths]); split variables are
    written one run per shard, replicated ones once.

    Args:
        path: a folder (or one file with ``consolidated=True``) every rank can see.
        model: this rank's built model or layer: parallel layers, plain layers, or both; or a
            Keras ``Pipeline`` (each rank writes its stages' layers, named as in the whole model).
        metadata: JSON-serializable extras, returned by :func:`load_tensor_parallel`.
        data_process_set: this rank's data-parallel group: only data replica 0 writes. None:
            every rank writes. A pipeline on a grid with ``dp > 1`` passes its data group
            (``pipe.grid.data_set``, or ``Grid.register().dp``).
        consolidated: one file written by rank 0 instead of a folder.
        local: this process saves alone; no other rank calls.

    Returns:
        The committed manifest, on every rank.

    Raises:
        unison.common.checkpoints.CheckpointError: on every rank, naming what failed (a layer
            with variables that no entry names among them).
    """
    comm = _comm(local)
    agree.enter(comm, "save_tensor_parallel")  # [Note: a collective save is entered through the engine]
    layers = _model_layers(model)
    agree.raise_together(comm, _unnamed(layers))
    writes = tpck.replica_writes(data_process_set, comm)
    # (agreed: a rank that could not describe its layers raised alone, the others waited; before 2026-12-07)
    described = agree.agreed(comm, lambda: _describe(layers, with_arrays=writes))
    same = {p.name for p, slot in described if slot.trainable}  # trained copies must agree (as torch's)
    return tpck.save(path, [p for p, _ in described], comm, writes, metadata, consolidated, same)


def load_tensor_parallel(path: str | os.PathLike[str], model: Any, local: bool = False,
                         verify: str = "read", strict: bool = True) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_tensor_parallel` into a built Keras model at any tp / pp.

    Each rank reads only its own shards when its layers split them as the saving layers did; a
    plain layer reads the entry whole; a split layer slices an entry saved whole.

    Args:
        path: the checkpoint folder or file.
        model: this rank's built model (its variables exist), or a Keras ``Pipeline`` (each rank
            reads its stages' layers).
        local: this process loads alone; no other rank calls.
        verify: ``"read"`` or ``"all"``, as ``unison.common.checkpoints.load``.
        strict: refuse a checkpoint holding entries that no loading rank's model has (as
            ``load_state_dict`` refuses unexpected keys); False loads the entries the model has.

    Returns:
        The user metadata given to :func:`save_tensor_parallel`.

    Raises:
        unison.common.checkpoints.CheckpointError: on every rank: a missing entry, a different
            full shape, a variable split differently from the saved one, a layer with variables
            that no entry names, an entry no rank loads (``strict``), or a missing, corrupt or
            mismatched checkpoint.
    """
    comm = _comm(local)
    agree.enter(comm, "load_tensor_parallel")  # [Note: a collective save is entered through the engine]
    layers = _model_layers(model)
    agree.raise_together(comm, _unnamed(layers))
    described = agree.agreed(comm, lambda: _describe(layers, with_arrays=False))
    pieces, user = tpck.load(path, [p for p, _ in described], comm, verify, strict)
    for param, slot in described:
        slot.set(pieces[param.name].astype(param.dtype, copy=False))
    return user
