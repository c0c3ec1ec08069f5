"""``save_sharded`` / ``load_sharded`` for a model sharded by ``shard_module`` (ZeRO stage 3).

Reached through :func:`unison.torch_backend.save_sharded` and ``load_sharded`` when the model is
sharded. The entries are the ones stages 1 and 2 write (``zero_checkpoint.py``), so checkpoints
move between the stages and plain models:

    model.<state_dict key>     the weights in their own dtype: each rank writes the runs its shards
                               own (rounded from the masters for half precision); buffers once
    master.<parameter name>    the float32 masters of half-precision parameters, runs as above
    optim.<parameter name>.<k> the optimizer's state of that parameter: the runs of every state
                               tensor shaped like the shard (listed as ``sharded_keys`` in the
                               metadata), scalars (Adam's step) once

The optimizer is a plain ``torch.optim`` optimizer over the model's shards (built after
``shard_module``); its state is per shard, so each shard's state tensors are cut into the
parameters the shard holds parts of. Loading on any number of ranks reads, per rank, only the
ranges its own plan gives it (``ShardPlan.owned``) and refills padding with zeros.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from unison.common import agreement, runtime
from unison.common import checkpoints as ck
from unison.common.checkpoints import agree
from unison.common.engine.process_sets import set_size
from unison.torch_backend.tensors import from_numpy, to_numpy
from unison.torch_backend.zero3_hooks import Sharded
from unison.torch_backend.zero3_unit import Flat, Unit, dtype_name
from unison.torch_backend.zero_checkpoint import (
    _groups_metadata,
    _jsonable,
    _refuse_unclaimed,
    agree_optimizers,
    check_optimizer_class,
    mixed_state_problem,
)

__all__: list[str] = []


def _state(model: Any) -> Sharded:
    state = getattr(model, "_unison_zero3", None) if isinstance(model, torch.nn.Module) else None
    if state is None:
        raise TypeError(f"zero3_checkpoint takes a model sharded by shard_module; got {type(model).__name__}. "
                        "Use unison.torch_backend.save_sharded/load_sharded, which handle every model")
    return state


def _comm(state: Sharded) -> Any:
    if getattr(state, "tensor_group", None) is not None:  # (before 2026-12-07 the advice below, which cannot
        # apply: shard_module over every rank is refused for such a model, and full_state_dict is one shard's)
        raise ValueError("save_sharded/load_sharded of a tensor-parallel model sharded by shard_module is not "
                         "built (its weights are split twice: by the tensor group and by shard_module over the "
                         "data group). Checkpoint a tensor-parallel model without shard_module: "
                         "save_tensor_parallel(path, model, data_process_set=...) saves its weights")
    if set_size(state.process_set) != runtime.size():
        raise ValueError(f"save_sharded/load_sharded run over every rank; this model is sharded over "
                         f"{set_size(state.process_set)} of {runtime.size()} ranks. Shard it over the global "
                         "process set to checkpoint it this way, or save full_state_dict(model)")
    st = runtime.state("unison.torch_backend.save_sharded()")
    return st.comm if st.size > 1 else None


def _params(state: Sharded) -> list[tuple[str, Unit, int, Flat]]:
    """Every parameter once (tied references excluded): (key, unit, index, its flat)."""
    out = []
    for key, (kind, a, b) in state.keys.items():
        if kind == "param" and state.units[a].names[b] == key:
            unit = state.units[a]
            out.append((key, unit, b, unit.flats[unit.flat_of[b]]))
    return out


def _runs(unit: Unit, name: str, values: torch.Tensor, dtype: torch.dtype | None = None) -> list[tuple[int, Any]]:
    """This rank's runs of parameter ``name`` cut from the shard-shaped ``values``."""
    values = values.detach()
    return [(pc.param_offset, to_numpy(values[pc.offset:pc.offset + pc.length].to(dtype or values.dtype)))
            for pc in unit.owned.get(name, [])]


def _ranges(unit: Unit, name: str) -> list[tuple[int, int]]:
    return [(pc.param_offset, pc.length) for pc in unit.owned.get(name, [])]


def _model_entries(state: Sharded) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for key, (kind, a, b) in state.keys.items():
        if kind == "buffer":
            entries[f"model.{key}"] = ck.Replicated(to_numpy(getattr(a, b).detach()))
            continue
        unit = state.units[a]
        flat, shape = unit.flats[unit.flat_of[b]], tuple(unit.views[b].shape)
        name = unit.names[b]
        runs = _runs(unit, name, flat.shard, flat.dtype)
        entries[f"model.{key}"] = ck.LocalShard(shape, dtype_name(flat.dtype), runs)
        if flat.master and key == name:
            entries[f"master.{name}"] = ck.LocalShard(shape, "float32", _runs(unit, name, flat.shard))
    return entries


def _where(state: Sharded, optimizer: torch.optim.Optimizer) -> list[tuple[torch.nn.Parameter, Unit, str]]:
    """Each parameter of ``optimizer`` (state-dict order) with its unit and flat key; foreign ones raise."""
    shards = {id(f.shard): (u, k) for u in state.units for k, f in u.flats.items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = [i for i, p in enumerate(params) if id(p) not in shards]
    if foreign:
        raise ValueError(f"the optimizer's parameters at positions {foreign[:5]} are not shards of this model; "
                         "build the optimizer over the sharded model's parameters (after shard_module)")
    return [(p, *shards[id(p)]) for p in params]


def _names_in(unit: Unit, key: str) -> list[str]:
    return [n for i, n in enumerate(unit.names) if unit.flat_of[i] == key]


def _optimizer_entries(state: Sharded, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], set[str]]:
    entries: dict[str, Any] = {}
    sharded: set[str] = set()
    for p, unit, key in _where(state, optimizer):
        for k, v in optimizer.state.get(p, {}).items():
            whole = torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape)
            if whole:
                sharded.add(k)
            for name in _names_in(unit, key):
                shape = tuple(unit.views[unit.index[name]].shape)
                entries[f"optim.{name}.{k}"] = (ck.LocalShard(shape, dtype_name(v.dtype), _runs(unit, name, v))
                                                if whole else ck.Replicated(np.asarray(_jsonable(v))))
    return entries, sharded


def save(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any, metadata: dict[str, Any] | None,
         consolidated: bool) -> ck.Manifest:
    """:func:`unison.torch_backend.save_sharded` for a sharded model (see the module docstring)."""
    state = _state(model)
    comm = _comm(state)
    agree.enter(comm, "save_sharded")  # [Note: a collective save is entered through the engine]
    agree_optimizers(comm, optimizer, "save_sharded")

    def prepare() -> tuple[dict[str, Any], dict[str, Any]]:
        entries = _model_entries(state)
        meta: dict[str, Any] = {"user": metadata or {}, "optimizer": None}
        if optimizer is not None:
            opt_entries, sharded = _optimizer_entries(state, optimizer)
            entries.update(opt_entries)
            meta["optimizer"] = {"class": type(optimizer).__name__, "zero": True, "stage": 3,
                                 "groups": _groups_metadata(optimizer), "sharded_keys": sorted(sharded)}
        return entries, meta

    # agreed: an optimizer over another model's parameters, or state numpy cannot take, raised on one rank
    # alone while the others waited in the save's first collective for ever (before 2026-12-07)
    entries, meta = agree.agreed(comm, prepare)
    save_fn = ck.save_consolidated if consolidated else ck.save_sharded
    return save_fn(path, entries, comm, metadata=meta)


def _check_model(state: Sharded, manifest: ck.Manifest, path: str) -> None:
    missing = [k for k in state.keys if f"model.{k}" not in manifest.entries]
    if missing:
        raise ValueError(f"the checkpoint at {path!r} has no weights for {missing[:5]}; load it into the model it "
                         "was saved from")
    manifest.refuse_unexpected(path, "model.", state.keys, "load it into the model it was saved from")
    for key, unit, b, _ in _params(state):
        saved, mine = tuple(manifest.entries[f"model.{key}"].shape), tuple(unit.views[b].shape)
        if saved != mine:
            raise ValueError(f"the checkpoint at {path!r} holds {key!r} with shape {saved}; the model's is {mine}")


def _model_wanted(state: Sharded, manifest: ck.Manifest) -> dict[str, Any]:
    wanted: dict[str, Any] = {f"model.{k}": "full" for k, v in state.keys.items() if v[0] == "buffer"}
    for key, unit, _, _ in _params(state):
        # the float32 masters where saved, into any model: a float32 one loaded the half-precision copy, the
        # rounded weights, silently (before 2026-12-06; found by an audit); a half one rounds them itself
        entry = f"master.{key}" if f"master.{key}" in manifest.entries else f"model.{key}"
        if _ranges(unit, key):
            wanted[entry] = _ranges(unit, key)
    return wanted


def _optimizer_wanted(state: Sharded, optimizer: torch.optim.Optimizer, manifest: ck.Manifest,
                      sharded: set[str]) -> dict[str, Any]:
    wanted: dict[str, Any] = {}
    for _, unit, key in _where(state, optimizer):
        for name in _names_in(unit, key):
            prefix = f"optim.{name}."
            for entry in manifest.entries:
                if entry.startswith(prefix):
                    ranges = _ranges(unit, name)
                    if entry[len(prefix):] not in sharded:
                        wanted[entry] = "full"
                    elif ranges:
                        wanted[entry] = ranges
    return wanted


def load(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any,
         verify: str = "read") -> dict[str, Any]:
    """:func:`unison.torch_backend.load_sharded` into a sharded model; returns the user metadata."""
    state = _state(model)
    comm, where = _comm(state), os.fspath(path)
    agree.enter(comm, "load_sharded")  # [Note: a collective save is entered through the engine]
    agree_optimizers(comm, optimizer)

    def prepare() -> tuple[ck.Manifest, dict[str, Any], set[str], dict[str, Any]]:
        manifest = ck.read_manifest(path)
        _check_model(state, manifest, where)
        saved_opt: dict[str, Any] = (manifest.metadata or {}).get("optimizer") or {}
        if optimizer is not None and not saved_opt:
            raise ValueError(f"the checkpoint at {where!r} holds no optimizer state; pass optimizer=None")
        if optimizer is not None:
            check_optimizer_class(where, saved_opt, optimizer)
        if optimizer is not None and not saved_opt.get("zero"):
            raise ValueError(f"the checkpoint at {where!r} was saved from a plain optimizer, whose state is "
                             "numbered, not named; load it into the plain model and optimizer, then use "
                             "load_full_state_dict, or save it from a ZeRO optimizer or a sharded model")
        sharded = set(saved_opt.get("sharded_keys", [])) if optimizer is not None else set()
        wanted = _model_wanted(state, manifest)
        if optimizer is not None:
            _refuse_unclaimed(where, manifest, {n for _, unit, key in _where(state, optimizer)
                                                for n in _names_in(unit, key)})
            wanted.update(_optimizer_wanted(state, optimizer, manifest, sharded))
        return manifest, saved_opt, sharded, wanted

    manifest, saved_opt, sharded, wanted = agree.agreed(comm, prepare)
    meta = manifest.metadata or {}
    got = ck.load(path, wanted, comm, verify)
    if optimizer is not None:
        groups = [_names_in(unit, key) for _, unit, key in _where(state, optimizer)]
        problem = mixed_state_problem(where, groups, manifest.entries, sharded, got)
        agreement.raise_together(comm, problem, ValueError)
    _restore_model(state, got)
    if optimizer is not None:
        _restore_optimizer(state, optimizer, manifest, saved_opt, sharded, got)
    return meta.get("user", {})


def _restore_model(state: Sharded, got: dict[str, Any]) -> None:
    state.drain()  # [Note: no prefetch across a change of the shards]
    with torch.no_grad():
        for key, (kind, a, b) in state.keys.items():
            if kind == "buffer":
                getattr(a, b).copy_(from_numpy(np.array(got[f"model.{key}"])))
        for key, unit, _, flat in _params(state):
            parts = got.get(f"master.{key}", got.get(f"model.{key}", []))
            for pc, part in zip(unit.owned.get(key, []), parts, strict=True):
                flat.shard[pc.offset:pc.offset + pc.length] = from_numpy(np.array(part)).to(flat.shard.dtype)


def _shard_state(unit: Unit, key: str, p: torch.Tensor, manifest: ck.Manifest, sharded: set[str],
                 got: dict[str, Any]) -> dict[str, Any]:
    """One shard's optimizer state from the loaded runs (zeros where no run lands: padding)."""
    out: dict[str, Any] = {}
    for name in _names_in(unit, key):
        prefix = f"optim.{name}."
        for entry in [e for e in manifest.entries if e.startswith(prefix)]:
            k = entry[len(prefix):]
            if k not in sharded:
                value = torch.as_tensor(np.array(got[entry]))
                out.setdefault(k, value.float() if value.is_floating_point() else value)
                continue
            dtype = from_numpy(np.zeros(0, manifest.entries[entry].dtype)).dtype
            seg = out.setdefault(k, torch.zeros(p.shape, dtype=dtype))
            for pc, part in zip(unit.owned.get(name, []), got.get(entry, []), strict=True):
                seg[pc.offset:pc.offset + pc.length] = from_numpy(np.array(part))
    return out


def _restore_optimizer(state: Sharded, optimizer: torch.optim.Optimizer, manifest: ck.Manifest,
                       saved: dict[str, Any], sharded: set[str], got: dict[str, Any]) -> None:
    sd = optimizer.state_dict()
    for mine, group in zip(sd["param_groups"], saved.get("groups", []), strict=False):
        mine.update({k: tuple(v) if isinstance(mine.get(k), tuple) else v for k, v in group.items()})
    values = {}
    for i, (p, unit, key) in enumerate(_where(state, optimizer)):
        shard_state = _shard_state(unit, key, p, manifest, sharded, got)
        if shard_state:
            values[i] = shard_state
    optimizer.load_state_dict({"state": values, "param_groups": sd["param_groups"]})
