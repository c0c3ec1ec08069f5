"""``save_sharded`` / ``load_sharded`` for Keras 3: a model and its (ZeRO or plain) optimizer in the core's
sharded-checkpoint format (unison/common/checkpoints, docs/checkpoints.md).

The same names and meaning as ``unison.torch_backend.save_sharded`` / ``load_sharded``. Entries:

* ``model.<path>``: every weight of the model, ``<path>`` its Keras variable path without the
  model's own name (``hidden/kernel``). Under ZeRO each rank writes only the runs of the trained
  variables it owns (the weights are full on every rank, so this only spreads the writing);
  non-trainable weights are written once.
* ``optim.<path>.<slot>``: every per-variable optimizer variable (Adam's ``momentum`` and
  ``velocity``, SGD's ``momentum``, gradient accumulators ...) with the global shape of the
  model variable. A sharded optimizer keeps them for its flat shard only; each rank writes its
  runs, which together cover every element once. A plain optimizer's are written whole.
* ``optim.<name>``: the optimizer's other variables (``iteration``, ``learning_rate`` when it is
  a variable; one Keras left unnamed by the attribute that holds it, see [Note: unnamed optimizer
  variables]), and ``optim.loss_scale.<name>`` a ``LossScaleOptimizer``'s (``dynamic_scale``,
  ``step_counter``): replicated. A float8 scale's gradient accumulator (the variable is kept out
  of the shards) is ``optim.<path>.gradient_accumulator``, replicated, as a plain optimizer's.
* The manifest's metadata: the user's ``metadata`` and the optimizer's class, zero stage and
  Keras config (hyper-parameters), for reference.

Because the names do not depend on how the state was sharded, a checkpoint saved on N ranks loads
on any M: a sharded optimizer reads the ranges its own plan gives it, a plain optimizer whole
tensors, and a checkpoint of a plain optimizer loads into a sharded one and the reverse.

[Note: Keras slot names]
Keras names a slot variable ``<reference path with '/' as '_'>_<slot>``
(``BaseOptimizer.add_variable_from_reference``), where the reference is the model variable for a
plain optimizer and the shard variable for a sharded one. The slot's name is what follows the
reference's prefix (the longest prefix that matches, with the reference's shape).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from unison.common import checkpoints as ck
from unison.common import runtime
from unison.common.checkpoints import agree

__all__ = ["save_sharded", "load_sharded"]

LOSS_SCALE = "loss_scale"


# -------------------------------------------------------------------- naming
def _comm() -> Any:
    """The job's communicator (None in a job of one). Unison must be initialized, as for the PyTorch
    ``save_sharded``: without it every process of a job saved to the path alone, and the last one's save
    removed the others' data files (found in this repository's own test, 2026-12-06)."""
    st = runtime.state("unison.tf_backend.save_sharded()")
    return st.comm if st.size > 1 else None


def _split(optimizer: Any) -> tuple[Any, Any]:
    """``(loss-scale wrapper or None, the optimizer that keeps the slots)``."""
    import keras  # here, so that importing unison.tf_backend does not import Keras

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer, optimizer.inner_optimizer
    return None, optimizer


def _keys(model: Any) -> dict[str, Any]:
    """Entry key -> variable for every weight of ``model``; keys are unique.

    Raises:
        ValueError: two weights share a path.
    """
    prefix = f"{model.name}/"
    out: dict[str, Any] = {}
    for v in model.weights:
        path = _path(v)
        key = path[len(prefix):] if path.startswith(prefix) else path
        if key in out:
            raise ValueError(f"two weights of model {model.name!r} have the path {path!r}; give the layers "
                             "unique names so the checkpoint can tell them apart")
        out[key] = v
    return out


def _ref_prefix(ref: Any) -> str:
    return str(getattr(ref, "path", None) or ref.name).replace("/", "_").replace(":", "_") + "_"


def _slots(optimizer: Any, refs: list[Any]) -> tuple[dict[tuple[int, str], Any], list[Any]]:
    """``{(reference index, slot name): variable}`` and the optimizer's other variables.

    See [Note: Keras slot names].
    """
    prefixes = sorted(((_ref_prefix(r), i) for i, r in enumerate(refs)), key=lambda p: -len(p[0]))
    slots: dict[tuple[int, str], Any] = {}
    others: list[Any] = []
    for v in optimizer.variables:
        name = str(v.name)
        match = next((i for p, i in prefixes if name.startswith(p) and len(name) > len(p)
                      and tuple(v.shape) == tuple(refs[i].shape)), None)
        if match is None:
            others.append(v)
        else:
            slots[(match, name[len(_ref_prefix(refs[match])):])] = v
    return slots, others


_AUTO_NAME = re.compile(r"variable(_\d+)?")  # Keras's name for a variable made without one


def _other_entries(inner: Any, others: list[Any]) -> dict[str, Any]:
    """Entry key -> variable for the optimizer's variables that are no slot.

    [Note: unnamed optimizer variables]
    Keras names a variable made without a name from a per-process counter (``variable``,
    ``variable_1``, ...): Nadam's ``_u_product`` was ``optim.variable`` in one process and
    ``optim.variable_1`` in one that had made another unnamed variable first, and the resume was
    refused (before 2026-12-07). Such a variable is keyed by the optimizer attribute that holds it
    (``optim.u_product``), or else by its position among the unnamed ones (``optim.unnamed.<k>``);
    a load takes the old key when it is the checkpoint's only one (:func:`_accept_old_names`).
    """
    import keras

    attrs = {id(v): a.lstrip("_") for a, v in vars(inner).items() if isinstance(v, keras.Variable)}
    out: dict[str, Any] = {}
    unnamed = 0
    for v in others:
        if not _AUTO_NAME.fullmatch(str(v.name)):
            out[f"optim.{v.name}"] = v
        elif id(v) in attrs:
            out[f"optim.{attrs[id(v)]}"] = v
        else:
            out[f"optim.unnamed.{unnamed}"] = v
            unnamed += 1
    return out


def _accept_old_names(plan: dict[str, Any], manifest: ck.Manifest, inner: Any) -> None:
    """Read an unnamed variable from its old key (``optim.variable_<n>``, see [Note: unnamed optimizer
    variables]) when the checkpoint lacks the new one and holds exactly one old key for exactly one
    such variable of this optimizer."""
    unnamed = {id(v) for v in inner.variables if _AUTO_NAME.fullmatch(str(v.name))}
    missing = [k for k, (_, target, _) in plan.items() if id(target) in unnamed and k not in manifest.entries]
    old = [k for k in manifest.entries if k.startswith("optim.") and _AUTO_NAME.fullmatch(k[len("optim."):])]
    if len(missing) == 1 and len(old) == 1 and len(unnamed) == 1:
        plan[old[0]] = plan.pop(missing[0])


def _numpy(v: Any) -> np.ndarray:
    """A variable's value as numpy (Keras and TensorFlow variables both have ``numpy()``)."""
    return np.asarray(v.numpy())


def _dtype(v: Any) -> str:
    return tf.as_dtype(v.dtype).name


def _layout(inner: Any) -> Any:
    """The :class:`~unison.tf_backend.zero.ShardLayout` of a sharded optimizer; None for a plain one."""
    if not getattr(type(inner), "_unison_zero_sharded", False):
        return None
    layout = inner.__dict__.get("_unison_zero")
    if layout is None:
        raise ValueError(f"the sharded optimizer {type(inner).__name__} is not built yet; run a step or call "
                         "optimizer.build(model.trainable_variables) before saving")
    return layout


def _owned(layout: Any) -> dict[int, list[Any]]:
    """Per model variable (its index in the layout): this rank's pieces of the shard, with the key's index."""
    out: dict[int, list[Any]] = {}
    index = {n: i for i, n in enumerate(layout.names)}
    for k, runs in enumerate(layout.runs):
        for p in runs:
            out.setdefault(index[p.name], []).append((k, p))
    return out


def _layout_keys(layout: Any, model_keys: dict[str, Any]) -> list[str]:
    """The model entry key of each variable the sharded optimizer was built on."""
    return _keys_of(layout.variables, model_keys, "the sharded optimizer")


def _keys_of(variables: Any, model_keys: dict[str, Any], who: str) -> list[str]:
    """The model entry key of each of ``variables`` (what ``who`` was built on), or raise naming it."""
    by_id = {id(_unwrap(v)): k for k, v in model_keys.items()}
    out = []
    for v in variables:
        key = by_id.get(id(_unwrap(v)))
        if key is None:
            raise ValueError(f"{who} was built on {_path(v)}, which is not a weight of this model; pass the "
                             "model whose trainable_variables it was built on")
        out.append(key)
    return out


def _unwrap(v: Any) -> Any:
    """The TensorFlow variable inside a Keras variable (the two are the same weight)."""
    inner = getattr(v, "value", None)
    return inner if isinstance(inner, tf.Variable) else v


def _path(v: Any) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", "variable"))


# -------------------------------------------------------------------- save
def _model_entries(model_keys: dict[str, Any], layout: Any) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    owned = _owned(layout) if layout is not None else {}
    sharded = dict(zip(_layout_keys(layout, model_keys), range(len(layout.variables)), strict=True)) \
        if layout is not None else {}
    for key, v in model_keys.items():
        if key in sharded:
            flat = _numpy(v).reshape(-1)
            runs = [(p.param_offset, flat[p.param_offset:p.param_offset + p.length])
                    for _, p in owned.get(sharded[key], [])]
            entries[f"model.{key}"] = ck.LocalShard(tuple(v.shape), _dtype(v), runs)
        else:
            entries[f"model.{key}"] = ck.Replicated(_numpy(v))
    return entries


def _zero_optimizer_entries(inner: Any, layout: Any, model_keys: dict[str, Any]) -> dict[str, Any]:
    slots, others = _slots(inner, layout.shards + layout.overwritten)
    slots, whole = _whole_slots(slots, layout, model_keys)
    keys = _layout_keys(layout, model_keys)
    owned = _owned(layout)
    values = {ks: _numpy(v) for ks, v in slots.items()}
    entries: dict[str, Any] = {}
    for i, var in enumerate(layout.variables):
        pieces = owned.get(i, [])
        shard_index = layout.keys.index(layout._key(layout.names[i]))
        for slot in sorted({s for k, s in slots if k == shard_index}):
            data = values[(shard_index, slot)]
            runs = [(p.param_offset, data[p.offset:p.offset + p.length]) for _, p in pieces]
            dtype = _dtype(slots[(shard_index, slot)])
            entries[f"optim.{keys[i]}.{slot}"] = ck.LocalShard(tuple(var.shape), dtype, runs)
    entries.update({k: ck.Replicated(_numpy(v)) for k, v in whole.items()})
    entries.update({k: ck.Replicated(_numpy(v)) for k, v in _other_entries(inner, others).items()})
    return entries


def _whole_slots(slots: dict[tuple[int, str], Any], layout: Any,
                 model_keys: dict[str, Any]) -> tuple[dict[tuple[int, str], Any], dict[str, Any]]:
    """The shards' slots, and entry key -> variable for the slots of the variables kept out of the shards
    (``layout.overwritten``, whose reference index follows the shards'): whole, alike on every rank."""
    n = len(layout.shards)
    keys = _keys_of(layout.overwritten, model_keys, "the sharded optimizer")
    whole = {f"optim.{keys[i - n]}.{slot}": v for (i, slot), v in slots.items() if i >= n}
    return {k: v for k, v in slots.items() if k[0] < n}, whole


def _plain_optimizer_entries(inner: Any, model_keys: dict[str, Any]) -> dict[str, Any]:
    refs = _plain_refs(inner, model_keys)
    slots, others = _slots(inner, [v for _, v in refs])
    entries = {f"optim.{refs[i][0]}.{slot}": ck.Replicated(_numpy(v)) for (i, slot), v in slots.items()}
    entries.update({k: ck.Replicated(_numpy(v)) for k, v in _other_entries(inner, others).items()})
    return entries


def _plain_refs(inner: Any, model_keys: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(entry key, model variable)`` for each variable a plain optimizer was built on."""
    if not inner.built:
        raise ValueError(f"optimizer {type(inner).__name__} is not built yet; run a step or call "
                         "optimizer.build(model.trainable_variables) first")
    variables = list(inner._trainable_variables)
    keys = _keys_of(variables, model_keys, f"optimizer {type(inner).__name__}")
    return list(zip(keys, variables, strict=True))


def _config(optimizer: Any) -> Any:
    """The optimizer's Keras config as JSON-safe data (hyper-parameters, for reference)."""
    import keras

    try:
        config = keras.saving.serialize_keras_object(optimizer)
        return json.loads(json.dumps(config, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
    except (TypeError, ValueError, NotImplementedError):
        return None


def save_sharded(path: str | os.PathLike[str], model: Any, optimizer: Any = None,
                 metadata: dict[str, Any] | None = None, consolidated: bool = False) -> ck.Manifest:
    """Save ``model`` (and ``optimizer``) collectively; every rank calls it with the same ``path``.

    Args:
        path: a folder (sharded) or a file (``consolidated=True``) every rank can see.
        model: the Keras model whose weights are saved.
        optimizer: a built optimizer: a ZeRO (sharded) one, whose ranks each write their shard of
            the state, a plain one (written once), a ``LossScaleOptimizer`` of either, or None.
        metadata: JSON-serializable extras (epoch, step, ...), returned by :func:`load_sharded`.
        consolidated: write one file from rank 0 instead of a file per rank.

    Returns:
        The committed manifest, on every rank.

    Raises:
        unison.common.checkpoints.CheckpointError: (a ``ValueError``) on every rank, naming what
            failed: the optimizer is not built or was built on another model's variables, or the
            save itself failed.
    """
    comm = _comm()
    agree.enter(comm, "save_sharded")  # [Note: a collective save is entered through the engine]

    def prepare() -> tuple[dict[str, Any], dict]:
        _same_kind_everywhere(comm, optimizer, "save_sharded")  # first: a collective every rank reaches
        return _save_entries(model, optimizer, metadata)

    entries, meta = agree.agreed(comm, prepare)
    save = ck.save_consolidated if consolidated else ck.save_sharded
    return save(path, entries, comm, metadata=meta)


def _save_entries(model: Any, optimizer: Any, metadata: dict[str, Any] | None) -> tuple[dict[str, Any], dict]:
    """This rank's entries and the manifest's metadata."""
    model_keys = _keys(model)
    wrapper, inner = _split(optimizer)
    layout = _layout(inner) if inner is not None else None
    entries = _model_entries(model_keys, layout)
    meta: dict[str, Any] = {"user": metadata or {}, "optimizer": None}
    if inner is not None:
        if layout is not None:
            entries.update(_zero_optimizer_entries(inner, layout, model_keys))
        else:
            entries.update(_plain_optimizer_entries(inner, model_keys))
        if wrapper is not None:
            entries.update({f"optim.{LOSS_SCALE}.{v.name}": ck.Replicated(_numpy(v)) for v in wrapper._variables})
        stage = inner.__dict__.get("_unison_zero_stage", 0) if layout is not None else 0
        meta["optimizer"] = {"class": type(optimizer).__name__, "inner": type(inner).__name__,
                             "zero_stage": stage, "config": _config(optimizer)}
    return entries, meta


# -------------------------------------------------------------------- load
def _build(model: Any, optimizer: Any) -> None:
    """Build ``optimizer`` on the model's trainable variables, as ``model.fit`` would, if it is not built."""
    import keras

    if optimizer.built:
        return
    strategy = getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()
    with strategy.scope(), keras.name_scope(optimizer.name, caller=optimizer):
        optimizer.build(model.trainable_variables)


def _missing(wanted: Iterable[str], manifest: ck.Manifest, path: Any, fix: str) -> None:
    missing = [n for n in wanted if n not in manifest.entries]
    if missing:
        raise ValueError(f"the checkpoint at {os.fspath(path)!r} has no entries {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}; {fix}")


def load_sharded(path: str | os.PathLike[str], model: Any, optimizer: Any = None,
                 verify: str = "read") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_sharded` on any number of ranks; returns the user metadata.

    Collective when the job has several ranks (every rank calls it). The model gets full
    weights; a ZeRO optimizer reads only its own ranges of the state (under its own plan,
    whatever rank count saved it); a plain optimizer gets whole tensors. An optimizer that is
    not built yet is built on ``model.trainable_variables`` first (as ``model.fit`` would), so
    a freshly compiled model can be loaded before its first step. ``verify`` is
    :func:`unison.common.checkpoints.load`'s (``"read"`` checks every byte read; ``"all"`` reads and
    checks every run a read touches in full).

    Raises:
        unison.common.checkpoints.CheckpointError: (a ``ValueError``) on every rank: a missing,
            corrupt or mismatched checkpoint; weights or optimizer state of the model missing from
            it (the message names them); ``optimizer`` given for a checkpoint without one, or of
            another class than the one saved (``Adam``'s state into ``SGD``, a ``LossScaleOptimizer``'s
            into a bare optimizer: both named); an optimizer on some ranks and None (or another
            kind) on others.
    """
    comm = _comm()
    agree.enter(comm, "load_sharded")  # [Note: a collective save is entered through the engine]
    manifest, model_keys = agree.agreed(comm, lambda: _open(path, model, optimizer, comm))
    wanted: dict[str, Any] = {f"model.{k}": "full" for k in model_keys}
    wrapper, inner = _split(optimizer)
    plan: dict[str, Any] = {}
    if inner is not None:
        _build(model, optimizer)  # collective under a strategy or ZeRO: after the ranks agreed above
        plan = agree.agreed(comm, lambda: _checked_plan(path, manifest, wrapper, inner, model_keys))
        wanted.update({name: spec for name, (spec, _, _) in plan.items()})
    got = ck.load(path, wanted, comm, verify)
    for key, v in model_keys.items():
        v.assign(np.asarray(got[f"model.{key}"]).reshape(tuple(v.shape)))
    for name, (_, target, assemble) in plan.items():
        value = assemble(got[name])
        if value is not None:  # a shard's slot is assigned once its last entry is in
            target.assign(value)
    return (manifest.metadata or {}).get("user", {})


def _open(path: Any, model: Any, optimizer: Any, comm: Any) -> tuple[ck.Manifest, dict[str, Any]]:
    """The manifest and the model's entry keys, checked: the same kind of optimizer on every rank,
    every weight there, optimizer state if wanted, saved from an optimizer of this one's class."""
    _same_kind_everywhere(comm, optimizer)  # first: a collective every rank reaches
    manifest = ck.read_manifest(path)
    model_keys = _keys(model)
    _missing([f"model.{k}" for k in model_keys], manifest, path, "load it into the model it was saved from "
             "(the same layer names)")
    manifest.refuse_unexpected(path, "model.", model_keys, "load it into the model it was saved from (the same "
                               "layers)")
    wrong = [f"{k!r} saved {tuple(manifest.entries[f'model.{k}'].shape)}, this model's {tuple(v.shape)}"
             for k, v in model_keys.items() if tuple(manifest.entries[f"model.{k}"].shape) != tuple(v.shape)]
    if wrong:  # (a reshape took a (4, 6) kernel into a (6, 4) one, scrambled, when the sizes matched)
        raise ck.CheckpointError(f"the checkpoint at {os.fspath(path)!r} does not fit this model: "
                                 f"{'; '.join(wrong[:4])}; load it into the model it was saved from")
    if optimizer is not None and (manifest.metadata or {}).get("optimizer") is None:
        raise ValueError(f"the checkpoint at {os.fspath(path)!r} holds no optimizer state; pass optimizer=None")
    if optimizer is not None:
        _check_class(os.fspath(path), manifest.metadata["optimizer"], optimizer)
    return manifest, model_keys


def _kind(optimizer: Any) -> str:
    """``"LossScaleOptimizer(Adam)"`` or ``"Adam"``: the classes a checkpoint's optimizer state belongs to."""
    wrapper, inner = _split(optimizer)
    return f"{type(wrapper).__name__}({type(inner).__name__})" if wrapper is not None else type(inner).__name__


def _same_kind_everywhere(comm: Any, optimizer: Any, what: str = "load_sharded") -> None:
    """Raise (on every rank alike) unless every rank passed an optimizer, of the same classes and all
    sharded or all plain, or every rank None.

    [Note: load_sharded's optimizer on every rank] The ranks with an optimizer build it (a
    collective under ZeRO or a strategy) and agree on its plan; a rank with ``optimizer=None``
    went straight to the reads' collectives: before 2026-12-05 the job hung. One small all-gather.
    A save took rank 0's choice for the manifest and every rank's entries: a checkpoint that said it
    held no optimizer state held some, which no load would read (before 2026-12-07; found by an audit).
    """
    if comm is None:
        return
    mine = "None" if optimizer is None else \
        f"{_kind(optimizer)}, {'sharded' if _is_sharded(optimizer) else 'plain'}"
    everyone = comm.allgather(mine)
    if any(other != everyone[0] for other in everyone):
        shown = "; ".join(f"rank {r}: {d}" for r, d in enumerate(everyone))
        raise ValueError(f"{what}: the ranks passed different optimizers ({shown}); pass the same "
                         "optimizer on every rank (created alike, in the same strategy scope), or "
                         "optimizer=None on every rank")


def _is_sharded(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or a loss-scale optimizer around a sharded one) is a sharded optimizer."""
    return bool(getattr(type(optimizer), "_unison_zero_sharded", False))


def _check_class(where: str, saved: dict[str, Any], optimizer: Any) -> None:
    """Raise when the checkpoint's optimizer state was saved from other optimizer classes.

    Entries are matched by slot name only: Adam's first moment (``optim.<path>.momentum``) went
    into SGD's momentum and the saved ``learning_rate`` replaced this optimizer's, with no error,
    before 2026-12-05. The classes compared are the one that keeps the slots and whether a
    ``LossScaleOptimizer`` is around it (as torch's ``check_optimizer_class``: every rank reads
    the same manifest, so all raise, before anything is loaded).

    Raises:
        ValueError: the classes differ, naming both.
    """
    inner = saved.get("inner") or saved.get("class")
    if inner is None:
        return
    outer = saved.get("class") or inner
    saved_kind = f"{outer}({inner})" if outer != inner else inner
    mine = _kind(optimizer)
    if saved_kind != mine:
        raise ValueError(f"the checkpoint at {where!r} holds the state of a {saved_kind} optimizer; this one is "
                         f"a {mine}. Load it into a {saved_kind}, or pass optimizer=None to load the weights only")


def _checked_plan(path: Any, manifest: ck.Manifest, wrapper: Any, inner: Any,
                  model_keys: dict[str, Any]) -> dict[str, tuple[Any, Any, Any]]:
    plan = _optimizer_plan(wrapper, inner, model_keys)
    _accept_old_names(plan, manifest, inner)
    _missing(plan, manifest, path, "load it into the same kind of optimizer it was saved from")
    return plan


def _optimizer_plan(wrapper: Any, inner: Any, model_keys: dict[str, Any]) -> dict[str, tuple[Any, Any, Any]]:
    """Per entry: what to read, the variable it fills and how to turn what was read into its value."""
    layout = _layout(inner)
    plan: dict[str, tuple[Any, Any, Any]] = {}
    if layout is not None:
        plan.update(_zero_plan(inner, layout, model_keys))
    else:
        refs = _plain_refs(inner, model_keys)
        slots, others = _slots(inner, [v for _, v in refs])
        for (i, slot), v in slots.items():
            plan[f"optim.{refs[i][0]}.{slot}"] = ("full", v, lambda a, v=v: a.reshape(tuple(v.shape)))
        plan.update({k: ("full", v, lambda a, v=v: a.reshape(tuple(v.shape)))
                     for k, v in _other_entries(inner, others).items()})
    if wrapper is not None:
        plan.update({f"optim.{LOSS_SCALE}.{v.name}": ("full", v, lambda a, v=v: a.reshape(tuple(v.shape)))
                     for v in wrapper._variables})
    return plan


def _zero_plan(inner: Any, layout: Any, model_keys: dict[str, Any]) -> dict[str, tuple[Any, Any, Any]]:
    """A sharded optimizer reads, for each slot of each shard, the ranges of its own pieces."""
    slots, others = _slots(inner, layout.shards + layout.overwritten)
    slots, whole = _whole_slots(slots, layout, model_keys)
    keys = _layout_keys(layout, model_keys)
    owned = _owned(layout)
    plan: dict[str, tuple[Any, Any, Any]] = {k: ("full", v, lambda a, v=v: a.reshape(tuple(v.shape)))
                                             for k, v in whole.items()}
    for (k, slot), target in slots.items():
        sources = [(f"optim.{keys[i]}.{slot}", pieces) for i, pieces in sorted(owned.items())
                   if any(kk == k for kk, _ in pieces)]
        filler = _ShardFiller(target, layout.plan.shard_numel(layout.keys[k]), len(sources))
        for entry, pieces in sources:
            mine = [p for kk, p in pieces if kk == k]
            plan[entry] = ([(p.param_offset, p.length) for p in mine], target,
                           lambda parts, mine=mine, f=filler: f.add(mine, parts))
    plan.update({k: ("full", v, lambda a, v=v: a.reshape(tuple(v.shape)))
                 for k, v in _other_entries(inner, others).items()})
    return plan


class _ShardFiller:
    """Collects one shard slot's runs from several entries; the last one returns the whole shard
    (its padding zero, as a fresh slot's)."""

    def __init__(self, target: Any, numel: int, expected: int) -> None:
        self.value = np.zeros(numel, tf.as_dtype(target.dtype).as_numpy_dtype)
        self.expected, self.seen = expected, 0

    def add(self, pieces: list[Any], parts: list[np.ndarray]) -> np.ndarray | None:
        for p, part in zip(pieces, parts, strict=True):
            self.value[p.offset:p.offset + p.length] = part
        self.seen += 1
        return self.value if self.seen == self.expected else None
