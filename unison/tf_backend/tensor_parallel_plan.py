"""``parallelize(model, plan, process_set)``: split an existing Keras 3 model's layers over a tensor group.

The twin of the PyTorch backend's ``tensor_parallel_plan.py``: the plan is matched and checked by
:func:`unison.common.tensor_parallel.resolve_plan` (the same rules and messages for both
backends), and each matched ``keras.layers.Dense`` / ``keras.layers.Embedding`` becomes the
parallel layer built from it with ``from_dense`` / ``from_embedding``, so the shards hold the
unsplit layer's weights (a pretrained model can be split).

[Note: a new Keras model, not surgery] A built Keras model cannot have a layer swapped in place:
a ``Sequential`` or functional model is a graph of symbolic calls recorded when it was built. So
this ``parallelize`` returns a *new* model made by ``keras.models.clone_model`` with a
``clone_function`` that returns the parallel layer for a matched layer and the *original layer
object* for every other one (Keras 3 then reuses that object, so unmatched layers share their
weights with the given model; nothing is re-initialised). Nested ``Sequential``/functional models
are cloned the same way (``recursive=True``); their layers' paths are ``"inner/dense"``. The given
model is left as it was and stays usable. Subclassed models have no recorded graph, so
``clone_model`` cannot rebuild them: they are refused (build them from the parallel layers).

Every parallel layer is built before the new model is assembled, so a plan error or a size the
group does not divide raises before anything is returned. Assembling the new model calls the
parallel layers on symbolic inputs, which names (but does not run) their collectives from the
group's counter: every rank of the group must call ``parallelize`` with the same model and plan.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import keras
from keras.src.models.functional import Functional  # clone_model's own test for a functional model

from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.tensor_parallel.groups import agree_on_source, group_position
from unison.common.tensor_parallel.plan import Placement, resolve_plan
from unison.tf_backend.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    refuse_other_backend,
)

__all__ = ["parallelize"]

logger = logging.getLogger(__name__)
_KIND_NAMES = {"linear": "keras.layers.Dense", "embedding": "keras.layers.Embedding"}


def _is_graph_model(layer: Any) -> bool:
    """A model ``clone_model`` can rebuild: ``Sequential`` or functional (not subclassed)."""
    return isinstance(layer, (keras.Sequential, Functional))


def _check_model(model: Any) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(f"parallelize needs a keras.Model (Sequential or functional); received "
                        f"{type(model).__name__}. Wrap the layers in keras.Sequential([...]) or build the "
                        "parallel layers directly")
    if not _is_graph_model(model):
        raise TypeError(f"parallelize splits keras.Sequential and functional models (keras.Model(inputs, "
                        f"outputs)); received the subclassed model {type(model).__name__}, whose layers Keras "
                        "cannot rebuild into a new model. Build it from hvd.ColumnParallelLinear / "
                        "RowParallelLinear / VocabParallelEmbedding (their from_dense / from_embedding copy "
                        "a pretrained layer's shard) or write it as a Sequential or functional model")
    if not model.built:
        raise ValueError(f"parallelize copies shards out of the model's weights, but {model.name!r} is not built; "
                         "give it a keras.Input or call it on a batch first")


def _walk(model: keras.Model, prefix: str = "") -> Iterator[tuple[str, keras.layers.Layer]]:
    """``(path, layer)`` of every layer, nested Sequential/functional models included, in model order."""
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        path = prefix + layer.name
        yield path, layer
        if _is_graph_model(layer):
            yield from _walk(layer, path + "/")


def _layers(model: keras.Model) -> dict[str, keras.layers.Layer]:
    """path -> layer; a layer reached by two paths (shared) is listed at the first only."""
    seen: set[int] = set()
    found: dict[str, keras.layers.Layer] = {}
    for path, layer in _walk(model):
        if id(layer) not in seen:
            seen.add(id(layer))
            found[path] = layer
    return found


def _kind(layer: keras.layers.Layer) -> str:
    if isinstance(layer, keras.layers.Dense):
        return "linear"
    if isinstance(layer, keras.layers.Embedding):
        return "embedding"
    return type(layer).__name__


def _build(layer: keras.layers.Layer, placement: Placement, process_set: ProcessSet) -> keras.layers.Layer:
    """The parallel layer for ``layer``, with its name and trainability (paths stay the same)."""
    style, options = placement
    if style == "colwise":
        built = ColumnParallelLinear.from_dense(layer, process_set=process_set, **options)
    elif style == "rowwise":
        built = RowParallelLinear.from_dense(layer, process_set=process_set, **options)
    else:
        built = VocabParallelEmbedding.from_embedding(layer, process_set=process_set, **options)
    built.name = layer.name  # the auto name (column_parallel_linear_7) differs between ranks
    built.trainable = layer.trainable
    return built


def parallelize(model: keras.Model, plan: Mapping[str, Any],
                process_set: ProcessSet = global_process_set) -> keras.Model:
    """A new model in which the layers ``plan`` names are tensor-parallel layers over ``process_set``.

    See [Note: a new Keras model, not surgery]: the result is a clone of ``model`` whose other
    layers are ``model``'s own layer objects (shared weights); ``model`` itself is unchanged.

    Args:
        model: a built ``keras.Sequential`` or functional model; its layers are named by paths
            made of layer names (``"dense_a"``, ``"encoder/fc1"`` inside a nested model).
        plan: regular expression (matched against the whole path) -> ``"colwise"``
            (:class:`ColumnParallelLinear`), ``"rowwise"`` (:class:`RowParallelLinear`),
            ``"vocab"`` (:class:`VocabParallelEmbedding`), or ``{"style": ..., "gather_output":
            bool}`` / ``{"style": "rowwise", "input_is_parallel": bool}``.
        process_set: the tensor group; every rank of it calls ``parallelize`` with the same
            model and plan.

    Returns:
        The new model (uncompiled unless ``model`` was compiled; then compiled from its config,
        except with Unison's ``DistributedOptimizer``, which is refused: parallelize first).

    Raises:
        TypeError: ``model`` is not a Sequential or functional Keras model (a subclassed model).
        ValueError: an unbuilt model, a bad plan (see
            :func:`~unison.common.tensor_parallel.resolve_plan`), a size the group does not
            divide, an ``Embedding`` with ``mask_zero``, a column layer whose activation is not
            element-wise without ``gather_output=True``, this rank not in ``process_set``, or a
            Keras backend other than TensorFlow (on every rank, before any collective).
    """
    refuse_other_backend("parallelize")
    _check_model(model)
    optimizer = getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None
    if optimizer is not None and (getattr(optimizer, "_unison_distributed", False)
                                  or type(optimizer).__module__.startswith("unison.")):
        # Keras recompiles the clone from the config, which rebuilds the optimizer's own class (plain,
        # not distributed; before 2026-12-07 it raised "Could not locate class" on every rank); and the
        # group matters
        raise ValueError(f"parallelize: the model is compiled with Unison's {type(optimizer).__name__} "
                         "wrapper, which Keras cannot rebuild from its config for the new model. Parallelize "
                         "the model before compiling it, then compile the result with DistributedOptimizer"
                         "(..., process_set=sets.dp) (the data-parallel group, not the whole job)")
    layers = _layers(model)
    found: dict[str, dict[str, Placement]] = {}

    def source() -> list:
        placements = resolve_plan([(path, _kind(layer)) for path, layer in layers.items()], plan, _KIND_NAMES)
        found["placements"] = placements
        order = {path: index for index, path in enumerate(layers)}  # (auto names may differ between ranks)
        split = {id(w) for path in placements for w in layers[path].weights}
        return ([f"layer {order[path]}: {placement.style} {sorted(placement.options.items())}"
                 for path, placement in placements.items()]
                + [keras.ops.convert_to_numpy(w) for w in model.weights if id(w) not in split])

    group_position(process_set, "parallelize")
    # [Note: one unsplit source on every rank]: the same plan and, outside the split layers (each from_* compares
    # its own), the same weights on every rank of the group
    agree_on_source("parallelize", process_set, source)
    placements = found["placements"]
    built = {id(layers[path]): _build(layers[path], placement, process_set)
             for path, placement in placements.items()}
    new = keras.models.clone_model(model, clone_function=lambda layer: built.get(id(layer), layer), recursive=True)
    logger.debug("parallelize: %s", {path: p.style for path, p in placements.items()})
    return new
