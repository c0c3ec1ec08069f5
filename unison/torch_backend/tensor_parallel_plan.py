"""``parallelize(model, plan, process_set)``: split an existing PyTorch model's layers in place.

The plan is matched and checked by :func:`unison.common.tensor_parallel.resolve_plan` (the same
rules and messages for both backends); this module only lists the model's layers and swaps each
matched ``nn.Linear`` / ``nn.Embedding`` for the parallel layer built from it with
``from_linear`` / ``from_embedding``, so the shards hold the unsplit layer's weights (a
pretrained model can be split). Every parallel layer is built before the first is swapped in:
a size that the tensor group does not divide raises and leaves the model as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.tensor_parallel.plan import Placement, resolve_plan
from unison.torch_backend.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = ["parallelize"]

logger = logging.getLogger(__name__)
_KIND_NAMES = {"linear": "torch.nn.Linear", "embedding": "torch.nn.Embedding"}


def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return type(module).__name__


def _build(module: nn.Module, placement: Placement, process_set: ProcessSet) -> nn.Module:
    style, options = placement
    if style == "colwise":
        return ColumnParallelLinear.from_linear(module, process_set=process_set, **options)
    if style == "rowwise":
        return RowParallelLinear.from_linear(module, process_set=process_set, **options)
    return VocabParallelEmbedding.from_embedding(module, process_set=process_set, **options)


def _swap(model: nn.Module, path: str, layer: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path), name, layer)


def parallelize(model: nn.Module, plan: Mapping[str, Any],
                process_set: ProcessSet = global_process_set) -> nn.Module:
    """Replace the layers ``plan`` names by tensor-parallel layers over ``process_set``; returns ``model``.

    Args:
        model: any ``nn.Module``; its layers are named by ``model.named_modules()`` paths
            (``"0"``, ``"encoder.fc1"``). The model itself (path ``""``) cannot be replaced.
        plan: regular expression (matched against the whole path) -> ``"colwise"``
            (:class:`ColumnParallelLinear`), ``"rowwise"`` (:class:`RowParallelLinear`),
            ``"vocab"`` (:class:`VocabParallelEmbedding`), or ``{"style": ..., "gather_output":
            bool}`` / ``{"style": "rowwise", "input_is_parallel": bool}``.
        process_set: the tensor group; every rank of it calls ``parallelize`` with the same
            model and plan.

    Raises:
        ValueError: a bad plan (see :func:`~unison.common.tensor_parallel.resolve_plan`), a size
            the group does not divide, or this rank not in ``process_set``; the model is then
            unchanged.
    """
    layers = [(path, _kind(module)) for path, module in model.named_modules() if path]
    placements = resolve_plan(layers, plan, _KIND_NAMES)
    built = {path: _build(model.get_submodule(path), placement, process_set)
             for path, placement in placements.items()}
    for path, layer in built.items():
        _swap(model, path, layer)
    logger.debug("parallelize: %s", {path: p.style for path, p in placements.items()})
    return model
