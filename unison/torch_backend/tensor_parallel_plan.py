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
from unison.common.tensor_parallel.groups import agree_on_source, group_position
from unison.common.tensor_parallel.plan import Placement, resolve_plan
from unison.torch_backend.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    source_arrays,
)

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


def _check_matched(model: nn.Module, paths: list[str]) -> None:
    """Refuse a matched layer that a swap would break: one whose parent reads its weights directly
    (``nn.MultiheadAttention.out_proj``), or a subclass with its own ``forward``."""
    for path in paths:
        module = model.get_submodule(path)
        parent_path = path.rpartition(".")[0]
        if isinstance(model.get_submodule(parent_path), nn.MultiheadAttention):
            raise ValueError(f"parallelize: {path!r} belongs to an nn.MultiheadAttention, which reads its weights "
                             "directly and would not call a split layer; split the whole attention with "
                             "ParallelSelfAttention.from_multihead_attention, or leave it out of the plan")
        base = nn.Linear if isinstance(module, nn.Linear) else nn.Embedding
        if type(module).forward is not base.forward:
            raise ValueError(f"parallelize: {path!r} is a {type(module).__name__}, a subclass of {base.__name__} "
                             f"with its own forward, which the split layer would not run; leave it out of the "
                             "plan or split it by hand")


def _ties(model: nn.Module, placements: Mapping[str, Placement]) -> dict[str, str]:
    """``{path: first path}`` for matched layers whose weight is the same tensor as an earlier matched
    layer's, where both shards are the same rows of it (a ``"vocab"`` embedding and ``"colwise"`` linears
    of the same shape: the tied input embedding and output head of a language model), so the split layers
    can share one shard. Any other sharing (a split tensor also used unsplit, or split two different
    ways) raises: untying it would train two copies where the model has one."""
    users: dict[int, list[tuple[str, str]]] = {}
    seen: set[tuple[int, str]] = set()  # (module, attribute): a module reached by two paths is one user
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if (id(module), attr) not in seen:
                seen.add((id(module), attr))
                users.setdefault(id(param), []).append((path, attr))
    ties: dict[str, str] = {}
    for path in placements:
        module = model.get_submodule(path)
        for attr, param in module.named_parameters(recurse=False):
            holders = sorted({(p, a) for p, a in users[id(param)]})
            if len(holders) < 2:
                continue
            names = [f"{p or '<model>'}.{a}" for p, a in holders]
            how = ("differently in each place" if all(p in placements for p, _ in holders)
                   else "in some places and not in others")
            tied_ok = attr == "weight" and all(
                a == "weight" and p in placements and placements[p].style in ("vocab", "colwise")
                for p, a in holders)
            if not tied_ok:
                raise ValueError(f"parallelize: {names} are one shared tensor, and the plan would split it {how}, "
                                 "untying it (each copy would train on its own). Split every user of it as "
                                 "'vocab' (embedding) or 'colwise' (linear): those take the same rows; or leave "
                                 "all of them out of the plan")
            first = holders[0][0]
            if first != path:
                ties[path] = first
    return ties


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

    Tied weights (one tensor used by several layers, as a language model's input embedding and
    output head) stay tied when every user is split the same way: ``"vocab"`` embeddings and
    ``"colwise"`` linears of that tensor share one shard. The split layers keep each weight's
    ``requires_grad``.

    Raises:
        ValueError: a bad plan (see :func:`~unison.common.tensor_parallel.resolve_plan`), a size
            the group does not divide, this rank not in ``process_set``, a tensor the plan would
            untie, a layer that a split would break (``nn.MultiheadAttention``'s ``out_proj``, a
            subclass with its own ``forward``, a parametrized layer or one with hooks); the model
            is then unchanged.
    """
    found: dict[str, Any] = {}

    def source() -> list:
        layers = [(path, _kind(module)) for path, module in model.named_modules() if path]
        placements = resolve_plan(layers, plan, _KIND_NAMES)
        _check_matched(model, list(placements))
        found["placements"], found["ties"] = placements, _ties(model, placements)
        split = {id(p) for path in placements for p in model.get_submodule(path).parameters()}
        rest = [(name, p) for name, p in model.named_parameters() if id(p) not in split]
        return ([f"{path}: {placement.style} {sorted(placement.options.items())}"
                 for path, placement in placements.items()]
                + [name for name, _ in rest] + source_arrays(*(p for _, p in rest)))

    group_position(process_set, "parallelize")
    # [Note: one unsplit source on every rank]: the same plan and, outside the split layers (each from_* compares
    # its own), the same weights on every rank of the group
    agree_on_source("parallelize", process_set, source)
    placements, ties = found["placements"], found["ties"]
    built = {path: _build(model.get_submodule(path), placement, process_set)
             for path, placement in placements.items()}
    for path, first in ties.items():  # one shard, shared as the unsplit model shared one tensor
        built[path].weight = built[first].weight
    for path, layer in built.items():
        _swap(model, path, layer)
    logger.debug("parallelize: %s", {path: p.style for path, p in placements.items()})
    return model
