"""ZeRO stage 3 for PyTorch: ``shard_module(model)`` keeps only this rank's share of every weight.

After ``shard_module(model)`` each rank holds, per *unit* (below), only its segment of the unit's
flattened parameters: one flat ``nn.Parameter`` per dtype, registered on the unit's module as
``zero3_flat_<dtype>``. ``model.parameters()`` then yields only these shards, so a plain
``torch.optim`` optimizer built **after** ``shard_module`` steps the shards and keeps sharded
state (Adam's moments: 8/N bytes per parameter). With gradients reduce-scattered into the shards
too, a rank holds ``(w + g + k) * P / N`` bytes (see ``unison/common/zero/memory.py``) plus the
gathered working units.

Units
    By default every module that directly owns parameters (``module._parameters``: a
    ``Linear``, a ``LayerNorm``, an ``Embedding``) is one unit; its forward is when its weights are
    needed. A ``MultiheadAttention`` is one unit with its ``out_proj`` (it reads
    ``out_proj.weight`` without calling ``out_proj``); a custom module that reads a child's
    parameters without calling the child needs ``unit_classes`` the same way. With
    ``unit_classes=(Block,)`` (like FSDP's auto-wrap policy) each instance of those classes is one
    unit owning every parameter below it that no nested instance owns, and the model itself is a
    unit for the rest. Bigger units mean fewer, larger collectives and more memory while one is
    gathered. A parameter shared by two units (tied weights) is refused; put both
    users in one unit (``unit_classes``, or the model itself) and it is supported.

Lifecycle of one unit in a step (see [Note: ZeRO-3 unit buffers] in ``zero3_unit.py``)::

    forward pre-hook   gather (wait for the prefetch) ; prefetch the next unit in forward order
    forward            the module's parameters are views of the gathered full buffer
    forward hook       free the full buffer (storage resized to 0 bytes)
    backward           re-gathered only if an op saved its weights ([Note: ZeRO-3 re-gather in
                       backward]), prefetching the unit before it in forward order
    grads complete     flatten, reduce-scatter (average over ranks) into shard.grad; free
    end of backward    units still owing a reduction (unused parameters count as zeros) reduce;
                       every result lands in shard.grad (``+=``, so passes accumulate until
                       ``zero_grad``); everything gathered is freed

The forward order is recorded the first time the units run; every later step prefetches from it.
Collectives go through the engine under names derived from the unit's position, so ranks agree
by name whatever the order their hooks fire in; every rank must run the same units each step.

Rules for users
    - Call ``shard_module`` once, before building the optimizer; it broadcasts rank 0's weights
      first (``sync_module_states=True``), so do **not** call ``broadcast_parameters`` on the
      sharded model afterwards (that would copy rank 0's *segments* over the others').
    - A unit's weights exist only inside its module's forward (and in backward): reading
      ``model.fc.weight`` elsewhere sees a freed tensor. Use :func:`full_state_dict`.
    - ``model.state_dict()`` holds the shards (resumable on the same rank count);
      :func:`full_state_dict` gives the ordinary keys and full tensors, which a plain module loads,
      and :func:`load_full_state_dict` loads such a dict into a sharded model.
    - Clip with :func:`clip_sharded_grad_norm_`: the norm of the whole gradient, not a shard's.
    - CPU tensors. Trainable float16/bfloat16 parameters get float32 master shards
      (``master_weights=True``, [Note: ZeRO-3 master weights] in ``zero3_unit.py``): the optimizer
      steps float32, forward and backward run in the parameters' dtype.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from unison.common.engine import frontend
from unison.common.engine.objects import allgather_object
from unison.common.engine.process_sets import ProcessSet, set_rank, set_size
from unison.common.zero.plan import DEFAULT_BUCKET_BYTES, ShardPlan
from unison.torch_backend.handles import set_or_none
from unison.torch_backend.tensors import from_numpy, to_numpy
from unison.torch_backend.zero3_hooks import Sharded
from unison.torch_backend.zero3_unit import ParamRef, build_unit, install, param_specs
from unison.torch_backend.zero_state import (
    check_optimizer,
    global_norm,
    norm_part,
    tensor_group,
    tensor_parallel_groups,
)

__all__ = ["shard_module", "full_state_dict", "load_full_state_dict", "clip_sharded_grad_norm_",
           "zero3_memory"]

log = logging.getLogger(__name__)

#: the models sharded so far, per process set: their collectives' names ([Note: a counter per process set]:
#: one counter for every set left a rank that sat out a subset's model a number behind, before 2026-12-07)
_MODELS: dict[int, itertools.count] = {}
#: the sharded models alive, whose prefetches an optimizer's step must not leave in flight
_LIVE: weakref.WeakSet = weakref.WeakSet()
_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}
#: modules that read their children's parameters without calling the children (MultiheadAttention
#: passes ``out_proj.weight`` to a function): under the default policy each is one unit with its subtree
_WHOLE = (torch.nn.MultiheadAttention,)


class _Found:
    """A unit found in the model before sharding: its module, parameters and references."""

    def __init__(self, name: str, module: torch.nn.Module) -> None:
        self.name, self.module = name, module
        self.params: list[torch.nn.Parameter] = []
        self.names: list[str] = []
        self.refs: list[ParamRef] = []
        self.whole = False  # the unit takes its whole subtree (the default policy's _WHOLE classes)


def shard_module(model: torch.nn.Module, process_set: ProcessSet | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, prefetch: bool = True,
                 unit_classes: tuple[type, ...] | None = None,
                 sync_module_states: bool = True, master_weights: bool = True) -> torch.nn.Module:
    """Shard ``model``'s parameters over the ranks of ``process_set`` (ZeRO stage 3), in place.

    Args:
        model: the module; every rank passes the same architecture.
        process_set: the ranks sharing the model (every rank when None).
        bucket_bytes: the most bytes of one dtype a unit gathers in one collective.
        prefetch: gather the next unit while the current one computes.
        unit_classes: module classes whose instances are units (default: every module that
            directly owns parameters is a unit).
        sync_module_states: first broadcast rank 0's parameters and buffers.
        master_weights: keep float32 master shards for trainable float16/bfloat16 parameters
            (the optimizer steps them; the gathered weights are rounded from them). False trains
            half-precision parameters in their own dtype.

    Returns:
        ``model`` itself, now sharded.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``unit_classes`` holds a non-module class,
            or a parameter is not on the CPU.
        ValueError: tied parameters in two units, no parameters, a bad ``bucket_bytes``, or
            ranks built different plans (raised on every rank).
        RuntimeError: ``model`` (or a submodule) is already sharded.
    """
    if isinstance(model, torch.nn.Module) and getattr(model, "_unison_zero3", None) is not None:
        raise RuntimeError("shard_module was already applied to this model; call it once per model "
                           "(to change its settings, build the model again and shard that)")
    ps = set_or_none(process_set)
    sid = int(getattr(ps, "process_set_id", None) or 0)
    tag = f"zero3.m{next(_MODELS.setdefault(sid, itertools.count()))}" + (f".s{sid}" if sid else "")
    world, rank = set_size(ps), set_rank(ps)
    error, found, mine = None, [], ("",)  # type: tuple[Exception | None, list[_Found], tuple]
    split: tuple[ProcessSet | None, set[tuple[int, int]]] = (None, set())
    try:
        found = _discover(model, unit_classes, prefetch)
        split = _tensor_split(found, ps)
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights={master_weights!r} must be True or False")
        mine = ("ok", _signature(found, world, bucket_bytes, master_weights, bool(sync_module_states)),
                sum(len(f.params) for f in found))
    except (TypeError, ValueError, RuntimeError) as exc:
        error, mine = exc, ("error", type(exc).__name__, str(exc))
    _agree(allgather_object(mine, f"{tag}.agree", ps), error, rank)
    if sync_module_states:
        _broadcast_from_first(model, tag, ps)
    keys = _state_keys(model, found)
    units = [build_unit(f.name, f.module, f.params, f.names, f.refs, f"{tag}.u{i}", rank, world,
                        bucket_bytes, ps, master_weights) for i, f in enumerate(found)]
    for unit in units:
        install(unit)
        unit.module.__dict__["_unison_zero3_unit"] = True
    state = Sharded(model, units, keys, prefetch, ps, tag)
    # read by clip_sharded_grad_norm_: the units' views no longer show which parameters were shards
    state.tensor_group, state.tensor_split = split  # type: ignore[attr-defined]
    state.install_hooks()
    _LIVE.add(state)
    model.__dict__["_unison_zero3"] = state
    model.__dict__["__deepcopy__"] = _refuse_deepcopy
    _check_optimizers_at_step()
    log.info("zero3: %d units, %d parameters sharded over %d ranks", len(units), mine[2], world)
    return model


def _tensor_split(found: list[_Found], ps: ProcessSet | None) -> tuple[ProcessSet | None, set[tuple[int, int]]]:
    """The tensor group of the model's tensor-parallel shards and their ``(unit, parameter)`` indices.

    Raises:
        ValueError: ``ps`` holds two ranks of a shard's tensor group: sharding over them broadcast rank 0's
            shard over the others' and averaged the gradients of different shards, silently (before
            2026-12-07); or the shards span two tensor groups.
    """
    from unison.torch_backend.tensor_parallel import shards_across

    shards_across([(n, p) for f in found for n, p in zip(f.names, f.params, strict=True)], ps, "shard_module")
    params = [(u, i, p) for u, f in enumerate(found) for i, p in enumerate(f.params)]
    groups = tensor_parallel_groups([p for _, _, p in params])
    return (tensor_group(groups, "shard_module"),
            {(u, i) for (u, i, _), g in zip(params, groups, strict=True) if g is not None})


def _refuse_deepcopy(memo: Any) -> Any:
    """``copy.deepcopy`` of a sharded model (an EMA or teacher copy): its hooks would gather the original's
    units and leave the copy's placeholders in place (a cryptic shape error at forward, before 2026-12-05)."""
    raise TypeError("a model sharded by shard_module (ZeRO stage 3) cannot be deep-copied: the copy's hooks "
                    "would still serve the original's shards. Build a second model, load "
                    "full_state_dict(model) into it (load_state_dict), and shard_module it if needed")


_STEP_HOOK: list[Any] = []


def _check_optimizers_at_step() -> None:
    """Refuse, at its first ``step()``, an optimizer over ZeRO-3 shards whose update is not elementwise.

    A shard is a flat slice of several parameters, so only an elementwise optimizer's numbers equal the
    unsharded model's (Adafactor factored 1-D slices: rank-count-dependent results, before 2026-12-05).
    The optimizer is built by the user after ``shard_module``, so the check is one global step pre-hook
    (each optimizer checked once; the others pay an attribute read).
    """
    if _STEP_HOOK:
        return

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for live in list(_LIVE):  # a prefetch started before the step would serve the old weights
            live.drain()
        if optimizer.__dict__.get("_unison_zero3_checked"):
            return
        if any(getattr(p, "_unison_zero3_shard", False) for g in optimizer.param_groups for p in g["params"]):
            check_optimizer(optimizer)  # raises on every rank alike: they build the same optimizer
        optimizer.__dict__["_unison_zero3_checked"] = True

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _STEP_HOOK.append(register_optimizer_step_pre_hook(hook))


def _discover(model: Any, unit_classes: tuple[type, ...] | None, prefetch: Any) -> list[_Found]:
    """The units of ``model`` (see the module docstring), checked."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ZeRO stage 3 shards a torch.nn.Module; got {type(model).__name__}. Pass the model "
                        "(shard_module(model)), or use DistributedOptimizer(..., zero_stage=1 or 2) "
                        "to shard only optimizer state and gradients")
    classes = _check_classes(unit_classes)
    if not isinstance(prefetch, bool):
        raise TypeError(f"prefetch={prefetch!r} must be True or False")
    taken = [n for n, m in model.named_modules() if getattr(m, "_unison_zero3_unit", False)]
    if taken:
        raise RuntimeError(f"modules {taken[:5]} already belong to a model sharded by shard_module; "
                           "shard each model once, at its top")
    units: dict[int, _Found] = {}
    owner: dict[int, tuple[_Found, str]] = {}
    _visit(model, "", None, model, classes, units, owner, set())
    found = [u for u in units.values() if u.params]
    if not found:
        raise ValueError(f"{type(model).__name__} has no parameters to shard")
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
            raise ValueError(f"{name or type(model).__name__!r} is an {type(m).__name__} with sparse=True; ZeRO "
                             "stage 3 reduce-scatters dense gradients (a sparse one failed in backward with "
                             "'reshape is not implemented for sparse tensors'). Use sparse=False, or zero_stage=0")
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None:
            raise ValueError(f"{name or type(model).__name__!r} is an {type(m).__name__} with max_norm="
                             f"{m.max_norm}, which renormalises rows of its weight in place during forward; "
                             "ZeRO stage 3 gathers a copy of the weight for the forward and frees it, so the "
                             "renormalised rows were silently lost. Renormalise outside forward (torch.renorm "
                             "on the shards' owner, e.g. after load_full_state_dict), or use zero_stage=0")
    bad = [(n, p.device) for f in found for n, p in zip(f.names, f.params, strict=True) if p.device.type != "cpu"]
    if bad:
        raise TypeError(f"ZeRO stage 3 handles CPU parameters; {bad[:3]} are not. Call model.cpu() first")
    hooked = [n for f in found for n, p in zip(f.names, f.params, strict=True)
              if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)]
    if hooked:  # (they stay on the replaced parameters, and a shard's gradient is written, not accumulated)
        raise ValueError(f"parameters {hooked[:5]} have gradient hooks (register_hook or "
                         "register_post_accumulate_grad_hook), which ZeRO stage 3 cannot run: the parameters "
                         "become views of gathered weights and their gradients are reduce-scattered into the "
                         "shards (the hooks were dropped silently before 2026-12-07). Remove them before "
                         "shard_module (act on the shards' .grad after backward instead), or zero_stage=1 or 2")
    return found


def _check_classes(unit_classes: Any) -> tuple[type, ...] | None:
    if unit_classes is None:
        return None
    classes = tuple(unit_classes) if isinstance(unit_classes, (list, tuple, set)) else (unit_classes,)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
    if bad or not classes:
        raise TypeError(f"unit_classes must be nn.Module subclasses, e.g. (nn.TransformerEncoderLayer,); "
                        f"got {unit_classes!r}")
    return classes


def _visit(mod: torch.nn.Module, prefix: str, current: _Found | None, model: torch.nn.Module,
           classes: tuple[type, ...] | None, units: dict[int, _Found],
           owner: dict[int, tuple[_Found, str]], seen: set[int]) -> None:
    """Assign every parameter under ``mod`` to a unit (depth first, like ``named_modules``)."""
    if id(mod) in seen:
        # met again under another parent: fine when it is a unit of its own (its hooks gather it) or
        # when its parameters are in this same unit; a module inside two units would read the other
        # unit's placeholders (a cryptic shape error at forward, before 2026-12-05)
        if id(mod) not in units:
            for pname, p in mod.named_parameters():
                if id(p) in owner and owner[id(p)][0] is not current:
                    raise ValueError(
                        f"module {prefix.rstrip('.')!r} is the same module as the one holding "
                        f"{owner[id(p)][1]!r}, but the two places belong to different ZeRO-3 units, which "
                        "shard separately (its parameter "
                        f"{pname!r} would be gathered by one only). Put both in one unit: shard_module(model, "
                        "unit_classes=(TheirCommonParentClass,)), or make the shared module a unit class itself")
        return
    seen.add(id(mod))
    direct = [(a, p) for a, p in mod._parameters.items() if p is not None]
    if classes:
        starts = mod is model or isinstance(mod, classes)
    else:
        starts = (bool(direct) or isinstance(mod, _WHOLE)) and not (current is not None and current.whole)
    if starts:
        current = units.setdefault(id(mod), _Found(prefix.rstrip("."), mod))
        current.whole = classes is None and isinstance(mod, _WHOLE)
    for attr, p in direct:
        name = prefix + attr
        if id(p) in owner and owner[id(p)][0] is not current:
            first = owner[id(p)][1]
            raise ValueError(f"parameter {name!r} is the same tensor as {first!r} (tied weights) but the two "
                             "belong to different ZeRO-3 units, which shard separately. Put both modules in "
                             "one unit: shard_module(model, unit_classes=(TheirCommonParentClass,))")
        if current is None:  # cannot happen: the model starts a unit whenever classes are given
            raise RuntimeError(f"internal error: parameter {name!r} has no ZeRO-3 unit")
        if id(p) not in owner:
            owner[id(p)] = (current, name)
            current.params.append(p)
            current.names.append(name)
        current.refs.append(ParamRef(mod, attr, current.names.index(owner[id(p)][1])))
    for cname, child in mod._modules.items():
        if child is not None:
            _visit(child, f"{prefix}{cname}.", current, model, classes, units, owner, seen)


def _signature(found: list[_Found], world: int, bucket_bytes: int, master_weights: bool,
               sync_module_states: bool = False) -> str:
    """A digest of every unit's plan and the settings every rank must share (only the ranks with
    ``sync_module_states`` broadcast: a rank without it hung the others, before 2026-12-05)."""
    desc: list[Any] = [["master_weights", master_weights], ["sync_module_states", sync_module_states]]
    for f in found:
        desc.append([f.name, ShardPlan.build(param_specs(f.names, f.params), world, bucket_bytes).signature()])
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def _agree(everyone: list[tuple], error: Exception | None, rank: int) -> None:
    """Raise on every rank when any rank failed or the plans differ."""
    if error is not None:
        raise error
    for r, entry in enumerate(everyone):
        if entry[0] == "error":
            raise _ERRORS.get(entry[1], RuntimeError)(f"shard_module failed on rank {r}: {entry[2]}")
    sigs = [e[1] for e in everyone]
    if len(set(sigs)) > 1:
        detail = ", ".join(f"rank {r}: {e[1]} ({e[2]} parameters)" for r, e in enumerate(everyone))
        raise ValueError(f"ranks would shard different models (plan signatures {detail}; this is rank {rank}). "
                         "Every rank must build the same model (parameter names, shapes, dtypes) and pass "
                         "the same bucket_bytes, unit_classes, master_weights and sync_module_states")


def _broadcast_from_first(model: torch.nn.Module, tag: str, ps: ProcessSet | None) -> None:
    """Overwrite every rank's parameters and buffers with the set's first rank's."""
    tensors = list(OrderedDict((id(t), t) for t in itertools.chain(model.parameters(), model.buffers())).values())
    handles = [frontend.broadcast_async(to_numpy(t), 0, f"{tag}.sync.{i}", ps) for i, t in enumerate(tensors)]
    for t, h in zip(tensors, handles, strict=True):
        # copied into the tensor itself: to_numpy of a non-contiguous one (channels_last, a transposed weight)
        # is a copy, and writing that lost rank 0's values (every rank kept its own, before 2026-12-07)
        with torch.no_grad():
            t.detach().copy_(from_numpy(frontend.synchronize(h)).view(t.shape))


def _state_keys(model: torch.nn.Module, found: list[_Found]) -> dict[str, tuple]:
    """The original ``state_dict`` keys: ``("param", unit index, param index)`` or ``("buffer", module, name)``."""
    where = {id(p): (u, i) for u, f in enumerate(found) for i, p in enumerate(f.params)}
    keys: dict[str, tuple] = OrderedDict()
    for prefix, mod in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for attr, p in mod._parameters.items():
            if p is not None:
                keys[pre + attr] = ("param", *where[id(p)])
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set:
                keys[pre + attr] = ("buffer", mod, attr)
    return keys


def _sharded(model: Any, what: str) -> Sharded:
    state = getattr(model, "_unison_zero3", None) if isinstance(model, torch.nn.Module) else None
    if state is None:
        raise TypeError(f"{what} takes a model sharded by shard_module; got {type(model).__name__} that is "
                        "not. Call unison.torch_backend.shard_module(model) first")
    return state


def full_state_dict(model: torch.nn.Module) -> OrderedDict[str, torch.Tensor]:
    """The model's ``state_dict`` with its original keys and full tensors, on every rank.

    Gathers one unit at a time (a collective: call it on every rank). The result loads into the
    unsharded model class with ``load_state_dict``.
    """
    state = _sharded(model, "full_state_dict")
    state.drain()
    values: dict[tuple[int, int], torch.Tensor] = {}
    for u, unit in enumerate(state.units):
        was = unit.is_gathered()
        state.gather(unit)
        for i, v in enumerate(unit.views):
            values[(u, i)] = v.detach().clone()
        if not was:
            state.free(unit)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, (kind, a, b) in state.keys.items():
        out[key] = values[(a, b)] if kind == "param" else getattr(a, b).detach().clone()
    return out


def load_full_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a full (unsharded) ``state_dict`` into a sharded model: each rank keeps its segments.

    Raises:
        KeyError: keys missing from or unexpected in ``state_dict`` (all named).
        ValueError: a tensor whose shape differs from the model's.
    """
    state = _sharded(model, "load_full_state_dict")
    missing = [k for k in state.keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in state.keys]
    if missing or unexpected:
        raise KeyError(f"load_full_state_dict: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}; "
                       "pass a state_dict of the same (unsharded) model, e.g. from full_state_dict()")
    state.drain()
    for key, (kind, a, b) in state.keys.items():
        value = state_dict[key]
        target = state.units[a].views[b] if kind == "param" else getattr(a, b)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"load_full_state_dict: {key!r} has shape {tuple(value.shape)} in the state_dict "
                             f"but {tuple(target.shape)} in the model")
        if kind == "param":
            state.units[a].write_owned(b, value)
        else:
            with torch.no_grad():
                target.copy_(value)


def clip_sharded_grad_norm_(model: torch.nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a sharded model by the norm of the *whole* gradient, as
    ``torch.nn.utils.clip_grad_norm_`` would on the unsharded model (a collective).

    Each rank sums ``|g|^p`` over its shards' gradients (padding holds zeros), the sums are
    all-reduced (the maximum for ``inf``), and every shard is scaled by
    ``min(1, max_norm / (norm + 1e-6))``. A tensor-parallel model's sums are added over its tensor
    group too, each replicated parameter counted once ([Note: the global norm of a tensor-parallel
    model] in ``zero_state.py``).

    Returns:
        The total norm (float32 scalar tensor), the same on every rank.
    """
    state = _sharded(model, "clip_sharded_grad_norm_")
    norm_type = float(norm_type)
    grads = [f.shard.grad for u in state.units for f in u.flats.values() if f.shard.grad is not None]
    group, split_at = getattr(state, "tensor_group", None), getattr(state, "tensor_split", set())
    if group is None:
        split, rest = 0.0, norm_part(grads, norm_type)
    else:
        parts: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        for u, unit in enumerate(state.units):
            for name, pieces in unit.owned.items():
                i = unit.index[name]
                grad = unit.flats[unit.flat_of[i]].shard.grad
                if grad is not None:
                    parts[(u, i) in split_at].extend(grad[pc.offset:pc.offset + pc.length] for pc in pieces)
        split, rest = norm_part(parts[True], norm_type), norm_part(parts[False], norm_type)
    total = global_norm(split, rest, norm_type, f"{state.tag}.clip", state.process_set, group)
    coef = float(max_norm) / (total + 1e-6)
    if not coef >= 1.0:  # (NaN too: every gradient NaN, as torch's clip_grad_norm_; kept before 2026-12-07)
        for g in grads:
            g.detach().mul_(coef)
    return torch.tensor(total, dtype=torch.float32)


def zero3_memory(model: torch.nn.Module) -> dict[str, int]:
    """Bytes this rank holds for a sharded model now, counted from the allocated storages.

    Returns:
        ``shard_bytes`` (the flat shards, float32 masters included), ``master_bytes`` (the part of
        ``shard_bytes`` that is float32 masters of half-precision parameters), ``grad_bytes``
        (their ``.grad``), ``gathered_bytes`` (full unit buffers allocated now),
        ``peak_gathered_bytes`` (the most held at once so far), ``full_param_bytes`` (the unsharded
        model's parameter bytes in their own dtypes, for comparison).
    """
    state = _sharded(model, "zero3_memory")
    flats = [f for u in state.units for f in u.flats.values()]
    return {
        "shard_bytes": sum(f.shard.untyped_storage().nbytes() for f in flats),
        "master_bytes": sum(f.shard.untyped_storage().nbytes() for f in flats if f.master),
        "grad_bytes": sum(f.shard.grad.untyped_storage().nbytes() for f in flats if f.shard.grad is not None),
        "gathered_bytes": sum(u.full_bytes() for u in state.units),
        "peak_gathered_bytes": state.peak_gathered_bytes,
        "full_param_bytes": sum(v.numel() * v.element_size() for u in state.units for v in u.views),
    }
