"""``save_sharded`` / ``load_sharded``: a model and its (ZeRO or plain) optimizer in the core's
sharded-checkpoint format (unison/common/checkpoints, docs/checkpoints.md).

Under ZeRO each rank writes only what it owns: its segments of the weights, of the fp32 master
weights and of every piece of optimizer state, so no rank ever holds the whole state. Everything
else (buffers, frozen parameters, the step counts) is written once. Entries are named after the
model's ``state_dict`` keys (``model.<key>``) and the parameter names (``optim.<name>.<state>``,
``master.<name>``), with the flat ranges of the full tensors, so a checkpoint saved on N ranks
loads on any M: each rank reads the ranges its own plan gives it, or whole tensors for a plain
optimizer. ``consolidated=True`` writes one file from rank 0 instead of a folder. A model sharded
by ``shard_module`` (stage 3) is handled by ``zero3_checkpoint.py`` with the same entry names.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from unison.common import agreement, runtime
from unison.common import checkpoints as ck
from unison.common.checkpoints import agree
from unison.torch_backend.tensors import from_numpy, to_numpy
from unison.torch_backend.zero_state import tensor_parallel_groups

__all__ = ["save_sharded", "load_sharded"]


def _subset_problem(optimizer: Any) -> str | None:
    pset = getattr(optimizer, "process_set", None)
    if pset is not None and pset.ranks is not None and len(pset.ranks) != runtime.size():
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if any(g is not None for g in tensor_parallel_groups(params)):
            # (one over every rank is refused for such a model: "use the global set" could not be followed)
            return (f"save_sharded/load_sharded run over every rank, and this rank's optimizer runs over "
                    f"{pset!r}, a subset, training shards of a tensor-parallel model: saving the optimizer state "
                    "of a tensor-parallel model is not built. Save its weights with save_tensor_parallel(path, "
                    "model, data_process_set=<this rank's data group, e.g. Grid(...).register().dp>)")
        return (f"save_sharded/load_sharded run over every rank; this optimizer's process set {pset!r} is a "
                "subset. Save with the global process set")
    return None


def _refuse_tensor_parallel(model: Any, what: str) -> None:
    """Raise when ``model`` holds live shards of tensor-parallel layers (its state dict's tensors).

    Stored as one copy (rank 0's, ``Replicated``), a shard loaded into every rank: the ranks of the other
    shards got shard 0's weights, silently (before 2026-12-07; found by an audit).

    Raises:
        ValueError: naming the first shard and :func:`save_tensor_parallel`.
    """
    named = list(model.state_dict(keep_vars=True).items()) if isinstance(model, torch.nn.Module) else []
    groups = tensor_parallel_groups([t for _, t in named])
    split = [(name, group) for (name, _), group in zip(named, groups, strict=True) if group is not None]
    if split:
        name, group = split[0]
        ranks = "every rank" if group.ranks is None else f"ranks {list(group.ranks)}"
        raise ValueError(f"{what}: {name!r} is one shard of a tensor-parallel layer split over {ranks} "
                         f"({len(split)} such tensor(s)); {what} keeps one copy of each weight it does not "
                         "shard itself, so every rank would load one rank's shard. Save a tensor-parallel model "
                         "with save_tensor_parallel(path, model, data_process_set=<this rank's data group, e.g. "
                         "Grid(...).register().dp>) and load it with load_tensor_parallel(path, model) (weights "
                         "only: its optimizer state is not saved)")


def _comm(optimizer: Any, check: bool = True) -> Any:
    problem = _subset_problem(optimizer) if check else None
    if problem is not None:
        raise ValueError(problem)
    st = runtime.state("unison.torch_backend.save_sharded()")
    return st.comm if st.size > 1 else None


def _stage3(model: Any) -> bool:
    return isinstance(model, torch.nn.Module) and getattr(model, "_unison_zero3", None) is not None


def _is_zero(optimizer: Any) -> bool:
    return getattr(optimizer, "zero_stage", 0) in (1, 2)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if torch.is_tensor(value):
        return value.item()
    return value


def _model_names(model: torch.nn.Module, optimizer: Any) -> dict[int, str]:
    """The model's name of each parameter a ZeRO optimizer trains (by ``id``): the names its state is saved under.

    [Note: optimizer state is named by the model] A ZeRO optimizer's own names come from
    ``named_parameters`` when it was given them, else from a per-process counter
    (``DistributedOptimizer.noname.<k>...``), which another optimizer built first, or a wrapper's prefix,
    changes. Saved under those names, the state of a run that named its parameters differently found
    no entries on load and restarted from zero without a word (before 2026-12-07; found by an audit).
    Named after the model's ``named_parameters``, as a sharded model's (stage 3) already were, the
    entries do not depend on how the optimizer was built.

    Raises:
        ValueError: a parameter of the optimizer is not the model's.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    foreign = [optimizer._names[p] for st in optimizer._buckets for p in st.params if id(p) not in names]
    if foreign:
        raise ValueError(f"the optimizer trains parameters that are not this model's ({foreign[:5]}); pass the "
                         "model whose parameters the optimizer was built over")
    return {id(p): names[id(p)] for st in optimizer._buckets for p in st.params}


def _model_entries(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Weights: under ZeRO this rank's segments of trained parameters, the rest replicated."""
    entries: dict[str, Any] = {}
    owned_params: dict[int, tuple[Any, Any]] = {}
    if _is_zero(optimizer):
        for st in optimizer._buckets:
            for p in st.params:
                owned_params[id(p)] = (st, p)
    tensors = dict(model.state_dict(keep_vars=True))
    for key, t in tensors.items():
        if id(t) in owned_params:
            st, p = owned_params[id(t)]
            name = optimizer._names[p]
            runs = [(pc.param_offset, to_numpy(st.segment[pc.offset:pc.offset + pc.length]))
                    for pc in st.bucket.owned(optimizer._rank) if pc.name == name]
            entries[f"model.{key}"] = ck.LocalShard(tuple(t.shape), _dtype(t), runs)
        else:
            entries[f"model.{key}"] = ck.Replicated(to_numpy(t.detach()))
    return entries


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _zero_optimizer_entries(optimizer: Any, names: dict[int, str]) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for st in optimizer._buckets:
        owned = st.bucket.owned(optimizer._rank)
        state = optimizer._inner.state.get(st.master, {})
        halves = st.master.data_ptr() != st.segment.data_ptr()
        for p, piece in zip(st.params, st.bucket.pieces, strict=True):
            mine = [pc for pc in owned if pc.name == piece.name]
            name = names[id(p)]  # [Note: optimizer state is named by the model]
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == st.master.shape:
                    runs = [(pc.param_offset, to_numpy(value[pc.offset:pc.offset + pc.length])) for pc in mine]
                    entries[f"optim.{name}.{key}"] = ck.LocalShard(tuple(p.shape), _dtype(value), runs)
                elif torch.is_tensor(value):  # a scalar such as NAdam's mu_product: its own dtype, exactly
                    entries[f"optim.{name}.{key}"] = ck.Replicated(to_numpy(value.detach().cpu()).reshape(
                        tuple(value.shape)))
                else:
                    entries[f"optim.{name}.{key}"] = ck.Replicated(np.asarray(_jsonable(value)))
            if halves:
                runs = [(pc.param_offset, to_numpy(st.master.detach()[pc.offset:pc.offset + pc.length]))
                        for pc in mine]
                entries[f"master.{name}"] = ck.LocalShard(tuple(p.shape), "float32", runs)
    return entries


def _plain_optimizer_entries(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    sd = optimizer.state_dict()
    entries = {}
    for index, state in sd["state"].items():
        for key, value in state.items():
            arr = to_numpy(value.detach()) if torch.is_tensor(value) else np.asarray(value)
            entries[f"optim.{index}.{key}"] = ck.Replicated(arr)
    return entries


def _sharded_keys(optimizer: Any) -> list[str]:
    """The state keys a ZeRO optimizer keeps per element (``exp_avg``), not per parameter (``step``)."""
    return sorted({k for st in getattr(optimizer, "_buckets", [])
                   for k, v in optimizer._inner.state.get(st.master, {}).items()
                   if torch.is_tensor(v) and v.shape == st.master.shape})


def _groups_metadata(optimizer: Any) -> list[dict[str, Any]]:
    return [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def save_sharded(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None,
                 metadata: dict[str, Any] | None = None, consolidated: bool = False) -> ck.Manifest:
    """Save ``model`` (and ``optimizer``) collectively; every rank calls it with the same ``path``.

    Args:
        path: a folder (sharded) or a file (``consolidated=True``) every rank can see.
        model: the model whose ``state_dict`` is saved, or a model sharded by ``shard_module``
            (each rank writes its shards' runs of every parameter).
        optimizer: a ZeRO ``DistributedOptimizer`` (each rank writes its shards), a plain
            optimizer over a sharded model's shards (likewise), any other optimizer (rank 0
            writes its state), or None.
        metadata: JSON-serializable extras (epoch, step, ...), returned by :func:`load_sharded`.
        consolidated: write one file from rank 0 instead of a file per rank.

    Returns:
        The committed manifest, on every rank.

    Raises:
        unison.common.checkpoints.CheckpointError: on every rank, naming what failed.
    """
    if _stage3(model):
        from unison.torch_backend import zero3_checkpoint  # imports this module's helpers

        return zero3_checkpoint.save(path, model, optimizer, metadata, consolidated)
    comm = _comm(optimizer, check=False)
    agree.enter(comm, "save_sharded")  # [Note: a collective save is entered through the engine]
    agree_optimizers(comm, optimizer, "save_sharded")  # (the subset check included)

    def prepare() -> tuple[dict[str, Any], dict[str, Any]]:
        _refuse_tensor_parallel(model, "save_sharded")
        entries = _model_entries(model, optimizer)
        meta: dict[str, Any] = {"user": metadata or {}, "optimizer": None}
        if optimizer is not None:
            zero = _is_zero(optimizer)
            entries.update(_zero_optimizer_entries(optimizer, _model_names(model, optimizer)) if zero
                           else _plain_optimizer_entries(optimizer))
            meta["optimizer"] = {"class": type(optimizer).__name__, "zero": zero,
                                 "groups": _groups_metadata(optimizer),
                                 "sharded_keys": _sharded_keys(optimizer)}
        return entries, meta

    entries, meta = agree.agreed(comm, prepare)
    save = ck.save_consolidated if consolidated else ck.save_sharded
    return save(path, entries, comm, metadata=meta)


def load_sharded(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None,
                 verify: str = "read") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_sharded` on any number of ranks; returns the user metadata.

    The model gets full weights; a ZeRO optimizer reads only its own segments of the state
    (under its own plan, whatever the saving run's rank count); a plain optimizer gets the
    whole state. A model sharded by ``shard_module`` (and a plain optimizer over its shards)
    reads only the ranges of its own shards.

    ``verify`` is :func:`unison.common.checkpoints.load`'s: ``"read"`` checks every byte read (runs
    read whole by their CRC, parts of runs by the CRCs of the 1 MiB blocks they touch); ``"all"``
    reads and checks every run a read touches in full.

    Raises:
        unison.common.checkpoints.CheckpointError: a missing, corrupt or mismatched checkpoint.
        ValueError: the checkpoint holds no optimizer state but ``optimizer`` was given, or
            the model's keys differ from the saved ones.
    """
    if _stage3(model):
        from unison.torch_backend import zero3_checkpoint  # imports this module's helpers

        return zero3_checkpoint.load(path, model, optimizer, verify)
    comm = _comm(optimizer, check=False)
    agree.enter(comm, "load_sharded")  # [Note: a collective save is entered through the engine]
    agree_optimizers(comm, optimizer)  # (before any rank can raise alone: the subset check included)

    def prepare() -> tuple[ck.Manifest, list[str], Any, dict[str, Any], dict[str, str]]:
        _refuse_tensor_parallel(model, "load_sharded")
        manifest = ck.read_manifest(path)
        keys = list(model.state_dict().keys())
        missing = [k for k in keys if f"model.{k}" not in manifest.entries]
        if missing:
            raise ValueError(f"the checkpoint at {os.fspath(path)!r} has no weights for {missing[:5]}; load it "
                             "into the model it was saved from")
        manifest.refuse_unexpected(path, "model.", keys, "load it into the model it was saved from")
        source = _weight_sources(model, manifest, keys)
        wanted: dict[str, Any] = {source[k]: "full" for k in keys}
        saved_opt = (manifest.metadata or {}).get("optimizer")
        if optimizer is not None and saved_opt is None:
            raise ValueError(f"the checkpoint at {os.fspath(path)!r} holds no optimizer state; pass "
                             "optimizer=None")
        if optimizer is not None:
            check_optimizer_class(os.fspath(path), saved_opt, optimizer)
        names: dict[int, str] = {}
        if optimizer is not None and _is_zero(optimizer):
            if not saved_opt.get("zero"):
                raise ValueError(f"the checkpoint at {os.fspath(path)!r} was saved from a plain optimizer; load "
                                 "it into one (zero_stage=0), or save from a ZeRO optimizer")
            names = _saved_names(model, optimizer, manifest)
            _refuse_unclaimed(os.fspath(path), manifest, set(names.values()))
            ranges = _zero_wanted(optimizer, manifest, set(saved_opt.get("sharded_keys", [])), names)
            # (a master a float32 model reads whole: its optimizer keeps no masters, so needs no ranges of it)
            wanted.update({k: v for k, v in ranges.items() if wanted.get(k) != "full"})
        elif optimizer is not None:
            if saved_opt.get("zero"):
                _refuse_unclaimed(os.fspath(path), manifest, set(_plain_names(model, optimizer)))
            else:
                _refuse_unclaimed(os.fspath(path), manifest,
                                  {str(i) for i in range(sum(len(g["params"]) for g in optimizer.param_groups))})
            wanted.update({name: "full" for name in manifest.entries if name.startswith("optim.")})
        return manifest, keys, saved_opt, wanted, source, names

    manifest, keys, saved_opt, wanted, source, names = agree.agreed(comm, prepare)
    meta = manifest.metadata or {}
    got = ck.load(path, wanted, comm, verify)
    if optimizer is not None and _is_zero(optimizer):
        groups = [[names[id(p)] for p in st.params] for st in optimizer._buckets]
        problem = mixed_state_problem(os.fspath(path), groups, manifest.entries,
                                      set(saved_opt.get("sharded_keys", [])), got)
        agreement.raise_together(comm, problem, ValueError)
    with torch.no_grad():
        model.load_state_dict({k: from_numpy(np.array(got[source[k]])) for k in keys})
    if optimizer is not None:
        if saved_opt.get("zero") and not _is_zero(optimizer):  # ZeRO's entries are named; a plain one's numbered
            names = {n: i for i, n in enumerate(_plain_names(model, optimizer))}
            got = {_numbered(k, names): v for k, v in got.items()
                   if not k.startswith("optim.") or k[6:].rsplit(".", 1)[0] in names}
        _restore_optimizer(optimizer, saved_opt, got, names)
    return meta.get("user", {})


def _state_owners(manifest: ck.Manifest) -> set[str]:
    """The parameter names (or plain indices) the checkpoint's optimizer state (``optim.`` entries) belongs to."""
    return {e[len("optim."):].rsplit(".", 1)[0] for e in manifest.entries if e.startswith("optim.")}


def _saved_names(model: torch.nn.Module, optimizer: Any, manifest: ck.Manifest) -> dict[int, str]:
    """Per parameter of a ZeRO optimizer (by ``id``), the name its saved state has: the model's name
    ([Note: optimizer state is named by the model]), or the optimizer's own where a checkpoint written before
    2026-12-07 used that."""
    saved = _state_owners(manifest) | {e[len("master."):] for e in manifest.entries if e.startswith("master.")}
    model_names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for st in optimizer._buckets:
        for p in st.params:
            mine = model_names.get(id(p))
            out[id(p)] = mine if mine in saved or optimizer._names[p] not in saved else optimizer._names[p]
            if mine is None and out[id(p)] not in saved:
                raise ValueError(f"the optimizer trains a parameter that is not this model's "
                                 f"({optimizer._names[p]!r}); pass the model its parameters belong to")
    return out


def _refuse_unclaimed(where: str, manifest: ck.Manifest, claimed: set[str]) -> None:
    """Raise when the checkpoint holds optimizer state for parameters the optimizer loading it does not train:
    that state would be dropped without a word (the optimizer restarting from zero where no name matched)."""
    extra = sorted(_state_owners(manifest) - claimed)
    if extra:
        raise ValueError(f"the checkpoint at {where!r} holds optimizer state for parameters this optimizer does "
                         f"not train: {extra[:5]}{' and more' if len(extra) > 5 else ''} (of {len(claimed)} it "
                         f"trains: {sorted(claimed)[:5]}); build the optimizer over the same parameters of the "
                         "same model, or pass optimizer=None to load the weights only")


def _weight_sources(model: torch.nn.Module, manifest: ck.Manifest, keys: list[str]) -> dict[str, str]:
    """Per state-dict key, the entry its weights load from: ``model.<key>``, or ``master.<key>`` (the float32
    masters of a half-precision save) where this model holds the key in float32 or wider. Loaded from the
    half-precision copy, such a model got the rounded weights, up to one Adam step of the last updates
    away from the masters, silently (before 2026-12-06; found by an audit)."""
    state = model.state_dict()
    out = {}
    for k in keys:
        saved, master = manifest.entries.get(f"model.{k}"), f"master.{k}"
        wide = state[k].is_floating_point() and state[k].element_size() >= 4
        half = saved is not None and saved.dtype in ("float16", "bfloat16")
        out[k] = master if wide and half and master in manifest.entries else f"model.{k}"
    return out


def agree_optimizers(comm: Any, optimizer: Any, what: str = "load_sharded") -> list[str | None]:
    """Every rank's optimizer class name (None where it passed none); raises ``ValueError`` on every rank
    when they differ: each rank loaded what it was given (states out of step), and a rank with a ZeRO
    optimizer waited in a collective the others skipped (a hang), before 2026-12-05. A save took rank 0's
    choice for the manifest and every rank's entries, so a checkpoint claiming no optimizer state held
    some, which no load would read (before 2026-12-07; found by an audit)."""
    mine = None if optimizer is None else (f"{type(optimizer).__name__} (zero_stage "
                                           f"{getattr(optimizer, 'zero_stage', 0)})")
    own = _subset_problem(optimizer)
    passed = agree.allgather(comm, (mine, own))
    # each rank names its own set where it has one (the others' differ: a data group per tensor shard)
    subset = own or next((problem for _, problem in passed if problem), None)
    if subset is not None:
        raise ValueError(subset)
    kinds = [kind for kind, _ in passed]
    if len(set(kinds)) > 1:
        raise ValueError(f"{what}: the ranks passed different optimizers ({kinds}, by rank); pass the "
                         "same optimizer (class and zero_stage) on every rank, or optimizer=None on every rank")
    return kinds


def mixed_state_problem(where: str, groups: list[list[str]], entries: Any, sharded: set[str],
                        got: dict[str, Any]) -> str | None:
    """Why a load cannot give each group of parameter names (one optimizer segment here: a bucket, or
    a sharded unit's flat) its saved optimizer state, or None.

    A segment has one state: one step count for all its parameters, moments for all or none. A
    checkpoint whose parameters in one such group stepped differently (a stage-3 unit that never
    ran, loaded with its neighbour into one merged unit, or into a ZeRO 1/2 bucket) got the first
    one's count and zero moments for the others, silently, before 2026-12-05 (Adam 5.8e-3 off).
    The same on every rank: every rank reads the whole scalars and the manifest's names.
    """
    for names in groups:
        keys = {n: tuple(sorted(e[len(f"optim.{n}."):] for e in entries if e.startswith(f"optim.{n}.")
                                and "." not in e[len(f"optim.{n}."):])) for n in names}
        differ = len(set(keys.values())) > 1
        if not differ:
            for k in [k for k in keys[names[0]] if k not in sharded] if names else []:
                values = {n: np.asarray(got[f"optim.{n}.{k}"]).tolist() for n in names if f"optim.{n}.{k}" in got}
                differ = differ or len({repr(v) for v in values.values()}) > 1
        if differ:
            shown = {n: {k: (np.asarray(got[f"optim.{n}.{k}"]).tolist() if k not in sharded and
                             f"optim.{n}.{k}" in got else "...") for k in keys[n]} or "no state"
                     for n in names[:4]}
            return (f"the checkpoint at {where!r} saved different optimizer state for parameters that share "
                    f"one optimizer segment here ({shown}{' ...' if len(names) > 4 else ''}): a segment has one "
                    "state (one step count), so they would all get the first one's, silently. Load it with the "
                    "layout it was saved with (the same unit_classes, or zero stage), or into the plain model "
                    "and optimizer")
    return None


def check_optimizer_class(where: str, saved_opt: dict[str, Any], optimizer: Any) -> None:
    """Raise when the checkpoint's optimizer state was saved from another optimizer class (its state
    keys differ: the load would succeed and the first ``step()`` fail on a missing key), or with
    another number of parameter groups.

    Raises:
        ValueError: the classes or group counts differ, naming both (every rank reads the same
            manifest: all raise, before anything is loaded).
    """
    saved, mine = saved_opt.get("class"), type(optimizer).__name__
    if saved is not None and saved != mine:
        raise ValueError(f"the checkpoint at {where!r} holds the state of a {saved} optimizer; this one is a "
                         f"{mine}. Load it into a {saved}, or pass optimizer=None to load the weights only")
    groups = saved_opt.get("groups")
    if groups is not None and len(groups) != len(optimizer.param_groups):  # (they were zipped: lr=0.5 from
        # the first saved group landed in a one-group optimizer built with lr=0.001, and the rest was dropped)
        raise ValueError(f"the checkpoint at {where!r} holds {len(groups)} parameter group(s); this optimizer has "
                         f"{len(optimizer.param_groups)} (torch's load_state_dict refuses that too). Build the "
                         "optimizer with the groups it was saved with, or pass optimizer=None to load the weights "
                         "only")


def _numbered(entry: str, names: dict[str, int]) -> str:
    """``optim.<parameter name>.<key>`` as a plain optimizer's ``optim.<index>.<key>``."""
    if not entry.startswith("optim."):
        return entry
    name, key = entry[len("optim."):].rsplit(".", 1)
    return f"optim.{names[name]}.{key}"


def _plain_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model's name of each parameter of a plain optimizer, in state-dict index order."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    unknown = [i for i, p in enumerate(params) if id(p) not in names]
    if unknown:
        raise ValueError(f"the optimizer's parameters at positions {unknown[:5]} are not the model's; pass the "
                         "optimizer over this model's parameters")
    return [names[id(p)] for p in params]


def _zero_wanted(optimizer: Any, manifest: ck.Manifest, sharded_keys: set[str],
                 names: dict[int, str]) -> dict[str, Any]:
    """Per entry: this rank's ranges of sharded state and masters, whole scalars (step counts)."""
    of_param: dict[str, list[str]] = {}  # parameter name -> its optim.<name>.<key> / master.<name> entries
    for entry in manifest.entries:
        if entry.startswith("optim."):  # state keys (exp_avg, step, ...) hold no dot; names may
            of_param.setdefault(entry[len("optim."):].rsplit(".", 1)[0], []).append(entry)
        elif entry.startswith("master."):
            of_param.setdefault(entry[len("master."):], []).append(entry)
    wanted: dict[str, Any] = {}
    for st in optimizer._buckets:
        owned = st.bucket.owned(optimizer._rank)
        for p in st.params:
            name = names[id(p)]
            mine = optimizer._names[p]  # (the plan's name; ``name`` is the checkpoint's)
            for entry in of_param.get(name, []):
                if entry.startswith("master.") or entry[len(f"optim.{name}."):] in sharded_keys:
                    wanted[entry] = [(pc.param_offset, pc.length) for pc in owned if pc.name == mine]
                else:
                    wanted[entry] = "full"
    return {k: v for k, v in wanted.items() if v != []}


def _restore_optimizer(optimizer: Any, saved: dict[str, Any], got: dict[str, Any], names: dict[int, str]) -> None:
    for mine, group in zip(optimizer.param_groups, saved["groups"], strict=False):
        mine.update({k: tuple(v) if isinstance(mine.get(k), tuple) else v for k, v in group.items()})
    if not _is_zero(optimizer):
        state: dict[int, dict[str, Any]] = {}
        for name, value in got.items():
            if name.startswith("optim."):
                _, index, key = name.split(".", 2)
                state.setdefault(int(index), {})[key] = from_numpy(np.array(value))
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        return
    sharded = set(saved.get("sharded_keys", []))
    for st in optimizer._buckets:
        state = _bucket_state(optimizer, st, got, names)
        if state:  # a rank owning only padding of a bucket still needs every piece of state
            for key in sharded:
                state.setdefault(key, torch.zeros(st.master.shape, dtype=st.master.dtype))
        optimizer._inner.state[st.master] = state
    optimizer._sync_hyperparameters()


def _bucket_state(optimizer: Any, st: Any, got: dict[str, Any], names: dict[int, str]) -> dict[str, Any]:
    """This rank's segment of the bucket's state (and its fp32 masters) from the loaded ranges."""
    owned = st.bucket.owned(optimizer._rank)
    state: dict[str, Any] = {}
    for p in st.params:
        name = names[id(p)]
        runs = [pc for pc in owned if pc.name == optimizer._names[p]]
        for entry, value in got.items():
            if not entry.startswith(f"optim.{name}."):
                continue
            key = entry[len(f"optim.{name}."):]
            if isinstance(value, list):
                for pc, part in zip(runs, value, strict=True):
                    saved = from_numpy(part[:0]).dtype  # floats take the masters' dtype (a float32 save
                    kind = st.master.dtype if saved.is_floating_point else saved  # into a float64 model)
                    seg = state.setdefault(key, torch.zeros(st.master.shape, dtype=kind))
                    seg[pc.offset:pc.offset + pc.length] = from_numpy(np.array(part))
            else:
                state.setdefault(key, torch.as_tensor(np.array(value)))
        masters = got.get(f"master.{name}")
        if st.master.data_ptr() != st.segment.data_ptr():
            with torch.no_grad():
                if masters is None:
                    for pc in runs:
                        st.master[pc.offset:pc.offset + pc.length] = st.segment[pc.offset:pc.offset + pc.length]
                else:
                    for pc, part in zip(runs, masters, strict=True):
                        st.master[pc.offset:pc.offset + pc.length] = from_numpy(np.array(part))
    return state
