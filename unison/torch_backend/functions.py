"""Broadcasting model and optimizer state, and exchanging picklable objects."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from unison.common import runtime
from unison.common.engine import frontend, objects
from unison.common.engine.objects import allgather_object, broadcast_object
from unison.common.engine.process_sets import ProcessSet, set_size
from unison.common.exceptions import MismatchError
from unison.torch_backend.handles import set_or_none
from unison.torch_backend.mpi_ops import broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int, prefix: str | None = None, process_set: ProcessSet | None = None) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or ``model.parameters()``.
        root_rank: the rank whose values win (a rank of the job, in ``process_set`` if given).
        prefix: prepended to the names the broadcasts are negotiated under.
        process_set: broadcast within these ranks only (every rank when None). A model with
            tensor-parallel layers needs its data-parallel group here: the ranks of one tensor
            group hold different shards.

    Raises:
        ValueError: ``params`` holds something other than tensors, or shards of a tensor-parallel
            layer that ``process_set`` would overwrite with another rank's shard.
    """
    from unison.torch_backend.tensor_parallel import shards_across

    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:  # pairs, or bare tensors (model.parameters()), which Horovod takes too: named by position
        items = [(f"param.{i}", p) if isinstance(p, torch.Tensor) else p for i, p in enumerate(params)]
    shards_across([(n, p) for n, p in items if isinstance(p, torch.Tensor)], process_set, "broadcast_parameters")
    refusal = next((r for r in (_refused(name, p) for name, p in items) if r is not None), None)
    # one named broadcast per item: a name on one rank only waited for ever (before 2026-12-05); a refusal is
    # agreed with the names, so that every rank raises it (before 2026-12-07 it was raised after the names'
    # agreement on that rank alone, and the others waited in their broadcasts for ever)
    names = [name for name, _ in items] + ([f"(refused: {refusal})"] if refusal else [])
    try:
        objects.agree_on_names("broadcast_parameters", names, f"broadcast.{prefix or ''}.names",
                               set_or_none(process_set))
    except MismatchError:
        if refusal:
            raise ValueError(refusal) from None
        raise
    if refusal:
        raise ValueError(refusal)
    handles = []
    for name, p in items:
        target = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(broadcast_async_(target, root_rank, f"broadcast.{prefix or ''}{name}", process_set))
    for h in handles:
        synchronize(h)


def _refused(name: str, p: Any) -> str | None:
    """Why ``broadcast_parameters`` cannot broadcast item ``name``, or None."""
    if not isinstance(p, torch.Tensor):
        return (f"broadcast_parameters expects tensors; {name!r} is a {type(p).__name__}. "
                "Pass model.state_dict() or model.named_parameters()")
    if getattr(p, "_unison_zero3_shard", False) or "zero3_flat_" in str(name):
        return (f"{name!r} is a shard made by shard_module: every rank holds a different part, so "
                "broadcasting rank 0's would corrupt the others. shard_module already started every "
                "rank from rank 0's weights; use load_full_state_dict(model, ...) to load weights")
    return None


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              prefix: str | None = None, model: Any = None,
                              process_set: ProcessSet | None = None) -> None:
    """Make every rank's optimizer state (moments, step counts, hyperparameters) ``root_rank``'s.

    Works whether or not the other ranks' optimizers have taken a step yet: the
    root's ``state_dict()`` travels whole and is loaded everywhere (every rank of
    ``process_set``, when given: the data-parallel group of a tensor-parallel model).

    Raises:
        ValueError: a rank could not load the root's state (on every rank), the optimizer
            steps shards of a tensor-parallel layer that ``process_set`` would overwrite with
            another rank's, or it steps ``shard_module``'s shards (on more than one rank).
    """
    from unison.torch_backend.tensor_parallel import shards_across

    opt = optimizer  # a DistributedOptimizer is an instance of the original class: same state_dict
    shards = [f"param_groups[{g}]['params'][{i}]" for g, group in enumerate(opt.param_groups)
              for i, p in enumerate(group["params"]) if getattr(p, "_unison_zero3_shard", False)]
    if shards and set_size(process_set) > 1:  # (the same on every rank: each holds a shard of every unit)
        raise ValueError(f"broadcast_optimizer_state: the optimizer steps shards made by shard_module "
                         f"({shards[:3]}{' ...' if len(shards) > 3 else ''}): every rank's state belongs to a "
                         "different part of the model, so loading rank 0's would corrupt the others (silently, "
                         "before 2026-12-05). Each rank keeps its own; to resume, use load_sharded(path, model, "
                         "optimizer)")
    shards_across([(f"param_groups[{g}]['params'][{i}]", p) for g, group in enumerate(opt.param_groups)
                   for i, p in enumerate(group["params"])], process_set, "broadcast_optimizer_state")
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    state = broadcast_object(buf.getvalue(), root_rank, name=f"broadcast_optimizer_state.{prefix or ''}",
                             process_set=process_set)
    if frontend.engine() is None:
        opt.load_state_dict(torch.load(io.BytesIO(state), weights_only=False))
        return
    problem = None
    if root_rank != runtime.rank():
        try:
            opt.load_state_dict(torch.load(io.BytesIO(state), weights_only=False))
        except Exception as exc:  # (different parameter groups): the root must not carry on alone
            problem = f"{type(exc).__name__}: {exc}"
    everyone = allgather_object(problem, name=f"broadcast_optimizer_state.{prefix or ''}.agree",
                                process_set=process_set)
    members = list(range(len(everyone))) if process_set is None or process_set.ranks is None else list(
        process_set.ranks)
    failed = [(members[i], p) for i, p in enumerate(everyone) if p]
    if failed:
        raise ValueError(f"broadcast_optimizer_state: rank {failed[0][0]} could not load root rank {root_rank}'s "
                         f"state: {failed[0][1]} (ranks {[r for r, _ in failed]} failed). Build the same "
                         "optimizer (the same parameter groups) on every rank")


