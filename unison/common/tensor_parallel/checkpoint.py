"""Tensor-parallel checkpoints: each rank saves its shards, and any tp (one process included) loads them.

Both backends' adapters (``tensor_parallel_checkpoint.py``) describe a model as a list of
:class:`TPParam` (a name, the full shape, how the layer splits it, this rank's piece) and call
:func:`save` / :func:`load` here; the bytes go through the one sharded-checkpoint format
(``unison.common.checkpoints``, docs/checkpoints.md), never a format of our own.

[Note: canonical layout of a tensor-parallel entry]
A layer splits a parameter along one axis into ``tp`` equal pieces; a fused parameter (the
q/k/v projection of a parallel attention) is ``blocks`` equal blocks along that axis, each split
the same way, and a shard is its piece of every block, concatenated. In the parameter's natural
layout a shard is many separate stretches of the flattened array (one per block, and one per row
when the split axis is not the first). The checkpoint stores each split entry in a *canonical*
permutation of the full tensor instead, in which every shard of every tp is one stretch::

    full, shape S, split axis a of length L = blocks * n
      reshape   S[:a] + (blocks, n) + S[a+1:]
      move n first   ->   canonical shape (n,) + S[:a] + (blocks,) + S[a+1:]

    shard r of tp  =  canonical rows [r * n/tp, (r+1) * n/tp)   (one flat range)

    (flattened, element order)
    torch ColumnParallelLinear weight (out, in), axis 0, 1 block:  canonical = weight
    torch RowParallelLinear weight (out, in), axis 1:               canonical = weight.T
    Keras column kernel (in, out), axis 1: kernel.T;  Keras row kernel (in, out), axis 0: kernel
    torch ParallelSelfAttention qkv weight (3h, h), axis 0, 3 blocks: (h, 3, h): row j holds
        row j of q, of k and of v, so the heads of a shard are one stretch

The layout does not depend on tp, so a save at tp = 2 loads at tp = 4 by reading other ranges,
and a shard's own array, put through the same reshape and move, is exactly its range: saving is
one ``LocalShard`` run per rank, loading one range per rank (no rank reads more than it holds).
One process reads the entry whole and inverts the permutation. Replicated parameters (a row
layer's bias, layer norms, any plain layer) are stored as they are, once (``Replicated``).

The manifest's metadata records each split entry's spec (``axis``, ``blocks``, and the tp it was
saved at) under ``"tensor_parallel"``, so a loader inverts the right permutation, and refuses a
model whose layer splits the entry differently (a column layer's weight loaded into a row layer of
the same shape). A loader that holds a parameter whole (a plain, unsplit model) takes any entry;
an entry saved whole (from a plain model) is sliced for a split parameter.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from unison.common import checkpoints as ck
from unison.common import runtime
from unison.common.checkpoints import agree, storage
from unison.common.engine.process_sets import ProcessSet, set_rank

__all__ = ["ShardSpec", "REPLICATED", "TPParam", "to_canonical", "from_canonical", "canonical_range",
           "shard_of_full", "replica_writes", "save", "load", "METADATA_KEY"]

logger = logging.getLogger(__name__)

METADATA_KEY = "tensor_parallel"
LAYOUT_VERSION = 1


class ShardSpec(NamedTuple):
    """How a layer splits one parameter over its tensor group.

    Attributes:
        axis: the split axis of the parameter (None: replicated, every rank holds it whole).
        blocks: equal blocks along ``axis`` that are each split (3 for a fused q/k/v projection).
    """

    axis: int | None
    blocks: int = 1

    def describe(self) -> str:
        if self.axis is None:
            return "whole (replicated)"
        return f"split along axis {self.axis} in {self.blocks} block(s)"


REPLICATED = ShardSpec(None)


class TPParam(NamedTuple):
    """One parameter of a model as the adapters describe it to :func:`save` and :func:`load`.

    Attributes:
        name: the entry name (the parameter's path in the model).
        shape: the full (unsplit) shape.
        spec: how this rank's layer splits it.
        tp: size of the tensor group the layer spans (1 for a replicated parameter).
        shard: this rank's position in that group (its shard's index).
        array: this rank's piece (the whole parameter when replicated); None when only loading.
        dtype: numpy dtype name of the parameter.
    """

    name: str
    shape: tuple[int, ...]
    spec: ShardSpec
    tp: int
    shard: int
    array: np.ndarray | None
    dtype: str

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.spec.axis is None:
            return self.shape
        shape = list(self.shape)
        shape[self.spec.axis] //= self.tp
        return tuple(shape)


def _split_shape(shape: Sequence[int], spec: ShardSpec) -> tuple[int, ...]:
    a, b = int(spec.axis or 0), spec.blocks  # only called for split specs
    return tuple(shape[:a]) + (b, shape[a] // b) + tuple(shape[a + 1:])


def check_spec(name: str, shape: Sequence[int], spec: ShardSpec, tp: int) -> None:
    """Raise unless ``tp`` shards of ``spec`` tile a parameter of full ``shape``.

    Raises:
        CheckpointError: the axis is outside the shape or the split axis is not ``blocks * tp`` pieces.
    """
    if spec.axis is None:
        return
    if not 0 <= spec.axis < len(shape):
        raise ck.CheckpointError(f"{name}: split axis {spec.axis} is outside its shape {tuple(shape)}")
    if spec.blocks < 1 or shape[spec.axis] % (spec.blocks * tp):
        raise ck.CheckpointError(f"{name}: axis {spec.axis} of shape {tuple(shape)} cannot hold {spec.blocks} "
                                 f"block(s) each split in {tp} equal pieces; the layer's sizes must be divisible "
                                 "by blocks x tensor group size")


def to_canonical(array: np.ndarray, spec: ShardSpec) -> np.ndarray:
    """The canonical permutation of a full tensor or of one shard (see [Note: canonical layout ...])."""
    if spec.axis is None:
        return array
    return np.moveaxis(array.reshape(_split_shape(array.shape, spec)), spec.axis + 1, 0)


def from_canonical(canonical: np.ndarray, shape: Sequence[int], spec: ShardSpec) -> np.ndarray:
    """Invert :func:`to_canonical`: ``canonical`` (any rows, flat or shaped) back to ``shape``."""
    if spec.axis is None:
        return np.asarray(canonical).reshape(shape)
    split = _split_shape(shape, spec)
    rows = split[spec.axis + 1]
    moved = split[:spec.axis + 1] + split[spec.axis + 2:]
    return np.ascontiguousarray(np.moveaxis(np.asarray(canonical).reshape((rows,) + moved), 0, spec.axis + 1)
                                .reshape(tuple(shape)))


def canonical_range(shape: Sequence[int], spec: ShardSpec, tp: int, index: int) -> tuple[int, int]:
    """``(flat_start, length)`` of shard ``index`` of ``tp`` in the canonical entry of full ``shape``."""
    size = int(np.prod(shape, dtype=np.int64))
    if spec.axis is None:
        return 0, size
    rows = shape[spec.axis] // spec.blocks
    per_row = size // rows
    return index * (rows // tp) * per_row, (rows // tp) * per_row


def shard_of_full(full: np.ndarray, spec: ShardSpec, tp: int, index: int) -> np.ndarray:
    """Shard ``index`` of ``tp`` of a full tensor, laid out as the layers hold it."""
    if spec.axis is None:
        return full
    start, length = canonical_range(full.shape, spec, tp, index)
    local = list(full.shape)
    local[spec.axis] //= tp
    return from_canonical(to_canonical(full, spec).reshape(-1)[start:start + length], local, spec)


# --------------------------------------------------------------------------------------------- save

def _entry(param: TPParam) -> Any:
    """This rank's part of ``param`` (its piece checked by :func:`_local_problem`)."""
    array = np.asarray(param.array)
    if param.spec.axis is None:
        return ck.Replicated(np.ascontiguousarray(array).reshape(array.shape))  # (0-d stays 0-d)
    start, _ = canonical_range(param.shape, param.spec, param.tp, param.shard)
    return ck.LocalShard(param.shape, param.dtype, [(start, np.ascontiguousarray(to_canonical(array, param.spec))
                                                     .reshape(-1))])


def replica_writes(data_process_set: ProcessSet | None, comm: Any) -> bool:
    """Whether this rank's data replica writes: index 0 of ``data_process_set`` (None: every rank).

    Collective over ``comm`` (the refusal is raised on every rank).

    Raises:
        CheckpointError: on every rank, when a rank is not in the ``data_process_set`` it passed.
    """
    index = 0 if data_process_set is None else set_rank(data_process_set)
    problem = None
    if index < 0:
        problem = (f"save_tensor_parallel: rank {runtime.rank()} is not in its data_process_set "
                   f"{data_process_set!r}; pass each rank its own data-parallel group (Grid.register().dp)")
    agree.raise_together(comm, problem)
    return index == 0


def _spec_json(param: TPParam) -> dict[str, Any]:
    return {"axis": param.spec.axis, "blocks": param.spec.blocks, "tp": param.tp}


def _merge_specs(views: list[dict[str, dict[str, Any]]]) -> tuple[dict[str, Any], str | None]:
    """Every rank's split entries, merged; the first conflict between ranks as a problem."""
    merged: dict[str, dict[str, Any]] = {}
    for rank, view in enumerate(views):
        for name, spec in view.items():
            seen = merged.setdefault(name, spec)
            if seen != spec:
                return merged, (f"ranks describe tensor-parallel entry {name!r} differently ({seen} vs {spec} on "
                                f"rank {rank}); every rank must save the same model with the same tensor groups")
    return merged, None


def _shared_shard_problem(views: list[dict[str, tuple[dict[str, Any], int]]]) -> str | None:
    """Two ranks declaring the same shard of a split entry: data replicas saving without
    ``data_process_set``. The core save refused them as overlapping runs, advising ``Replicated``,
    which a caller of ``save_tensor_parallel`` cannot pass (before 2026-12-07; found by an audit)."""
    holder: dict[tuple[str, int, int], int] = {}
    for rank, view in enumerate(views):
        for name, (spec, shard) in sorted(view.items()):
            first = holder.setdefault((name, spec["tp"], shard), rank)
            if first != rank:
                return (f"ranks {first} and {rank} both hold shard {shard} of {spec['tp']} of tensor-parallel "
                        f"entry {name!r}: they are data-parallel replicas of each other, and one shard is written "
                        "once. Pass each rank its data-parallel group, save_tensor_parallel(path, model, "
                        "data_process_set=sets.dp) with sets = Grid(...).register(), so that only data replica 0 "
                        "writes")
    return None


def _check_unique(params: Sequence[TPParam]) -> None:
    seen: set[str] = set()
    for p in params:
        if p.name in seen:
            raise ck.CheckpointError(f"two parameters of this model are both named {p.name!r}; every entry needs "
                                     "its own name (give the layers distinct attribute names)")
        seen.add(p.name)


def _local_problem(params: Sequence[TPParam]) -> str | None:
    try:
        _check_unique(params)
        for p in params:
            check_spec(p.name, p.shape, p.spec, p.tp)
            if p.array is None or tuple(p.array.shape) != p.local_shape:
                raise ck.CheckpointError(f"{p.name}: this rank's piece has shape "
                                         f"{None if p.array is None else tuple(p.array.shape)}, expected "
                                         f"{p.local_shape} ({p.spec.describe()} over tp={p.tp} of {p.shape})")
    except ck.CheckpointError as exc:
        return str(exc)
    return None


def _copies_problem(comm: Any, mine: Sequence[TPParam], same: set[str]) -> str | None:
    """Where ranks hold different copies of a replicated entry in ``same`` (one rank writes it)."""
    digests = {p.name: storage.crc32(np.ascontiguousarray(p.array).view(np.uint8))
               for p in mine if p.name in same and p.spec.axis is None and p.array is not None}
    seen: dict[str, dict[int, list[int]]] = {}
    for r, table in enumerate(agree.allgather(comm, digests)):
        for name, digest in table.items():
            seen.setdefault(name, {}).setdefault(digest, []).append(r)
    differ = {name: list(by.values()) for name, by in seen.items() if len(by) > 1}
    if not differ:
        return None
    shown = "; ".join(f"{name!r}: ranks {groups}" for name, groups in sorted(differ.items())[:5])
    return (f"{len(differ)} replicated parameter(s) differ between the ranks that hold them ({shown}), so the "
            "checkpoint would keep one rank's copy and silently drop the others. A pipeline (torch or Keras) "
            "saves with the Pipeline object itself, save_tensor_parallel(path, pipe) (each stage writes only "
            "its own layers); data replicas pass data_process_set; otherwise make the copies equal "
            "(broadcast) before saving")


def save(path: str | os.PathLike[str], params: Sequence[TPParam], comm: Any = None, writes: bool = True,
         metadata: dict[str, Any] | None = None, consolidated: bool = False,
         same: set[str] | None = None) -> ck.Manifest:
    """Save the parameters collectively over ``comm``; split ones as one canonical run per shard.

    Args:
        path: a folder (or one file with ``consolidated=True``) every rank of ``comm`` sees.
        params: this rank's parameters (every stage's ranks give their own names).
        comm: an mpi4py communicator over every saving rank, or None (one process).
        writes: False on the ranks of the other data-parallel replicas: they hold copies of what
            replica 0 writes, so they declare nothing (but take part in the collective save).
        metadata: JSON-serializable user data, returned by :func:`load`.
        consolidated: one file written by rank 0 instead of a folder.
        same: names of replicated entries whose copies must be equal on every rank declaring
            them (trained parameters; buffers such as running statistics may differ): each is
            compared by checksum, since only one rank's copy is written.

    Returns:
        The committed manifest, on every rank.

    Raises:
        CheckpointError: on every rank: ranks that disagree on an entry's split, two ranks
            declaring the same shard (data replicas that all write), a piece whose shape does not
            match its layer, copies in ``same`` that differ, or anything the core save refuses
            (gaps, overlaps, a folder not shared).
    """
    mine = [p for p in params if writes]
    agree.raise_together(comm, _local_problem(mine))
    if same and comm is not None:
        agree.raise_together(comm, _copies_problem(comm, mine, same))
    told = agree.allgather(comm, {p.name: (_spec_json(p), p.shard) for p in mine if p.spec.axis is not None})
    specs, problem = _merge_specs([{name: spec for name, (spec, _) in view.items()} for view in told])
    agree.raise_together(comm, problem or _shared_shard_problem(told))
    meta = {METADATA_KEY: {"version": LAYOUT_VERSION, "entries": specs}, "user": metadata or {}}
    entries = {p.name: _entry(p) for p in mine}
    writer = ck.save_consolidated if consolidated else ck.save_sharded
    logger.debug("tensor-parallel save of %d entries (%d split) to %s", len(entries), len(specs), path)
    return writer(path, entries, comm, metadata=meta)


# --------------------------------------------------------------------------------------------- load

def _saved_spec(manifest: ck.Manifest, name: str) -> ShardSpec:
    tp_meta = (manifest.metadata or {}).get(METADATA_KEY, {})
    spec = tp_meta.get("entries", {}).get(name)
    return REPLICATED if spec is None else ShardSpec(spec["axis"], spec["blocks"])


def _wanted(param: TPParam, manifest: ck.Manifest, where: str) -> Any:
    """What to read for ``param``: one canonical range (same split), or the whole entry."""
    entry = manifest.entries.get(param.name)
    if entry is None:
        known = sorted(manifest.entries)
        raise ck.CheckpointError(f"the checkpoint at {where!r} has no entry {param.name!r} (it holds "
                                 f"{len(known)}: {known[:8]}{' ...' if len(known) > 8 else ''}); load it into a "
                                 "model with the same parameter paths as the one saved")
    if tuple(entry.shape) != tuple(param.shape):
        raise ck.CheckpointError(f"entry {param.name!r} of {where!r} has full shape {tuple(entry.shape)}, this "
                                 f"model's parameter {param.shape}; load it into a model of the same sizes")
    saved = _saved_spec(manifest, param.name)
    check_spec(param.name, param.shape, param.spec, param.tp)
    if saved.axis is not None and param.spec.axis is not None and saved != param.spec:
        raise ck.CheckpointError(
            f"entry {param.name!r} of {where!r} was saved {saved.describe()}, but this model's layer holds it "
            f"{param.spec.describe()}: the layer kinds differ (for example a column-parallel layer saved, a "
            "row-parallel one loading). Build the model with the layers (plan) it was saved with, at any tp, or "
            "load into the plain unsplit model and split that")
    if saved.axis is not None and saved == param.spec:
        return [canonical_range(param.shape, param.spec, param.tp, param.shard)]
    return "full"


def _place(param: TPParam, got: Any, saved: ShardSpec) -> np.ndarray:
    if isinstance(got, list):  # one canonical range of the same split
        return from_canonical(got[0], param.local_shape, param.spec)
    full = from_canonical(got, param.shape, saved)
    return shard_of_full(full, param.spec, param.tp, param.shard)


def _unloaded(manifest: ck.Manifest, comm: Any, names: set[str], where: str, strict: bool) -> str | None:
    """Entries of ``manifest`` that no loading rank asked for, when ``strict``; or ranks passing different
    ``strict`` (every rank takes part in the same exchange whatever it passed)."""
    told = agree.allgather(comm, (bool(strict), sorted(names)))
    stricts = [s for s, _ in told]
    if len(set(stricts)) > 1:
        return (f"ranks passed different strict= values to the load ({stricts}, by rank); pass the same on "
                "every rank")
    if not strict:
        return None
    every = set().union(*(got for _, got in told))
    extra = sorted(set(manifest.entries) - every)
    if not extra:
        return None
    return (f"the checkpoint at {where!r} holds {len(extra)} entr{'y' if len(extra) == 1 else 'ies'} that no "
            f"loading rank's model has ({extra[:8]}{' ...' if len(extra) > 8 else ''}), so their saved values "
            "would be dropped silently; load it into the model it was saved from (every pipeline stage "
            "together), or pass strict=False to load a part of it on purpose")


def load(path: str | os.PathLike[str], params: Sequence[TPParam], comm: Any = None,
         verify: str = "read", strict: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read each parameter's piece for this rank's layout, whatever the tp (or pp) it was saved at.

    Args:
        path: a checkpoint written by :func:`save` (or by ``unison.common.checkpoints`` with
            entries named after the parameters: they load as saved whole).
        params: this rank's parameters (``array`` unused), each with its own spec and tp.
        comm: an mpi4py communicator over every loading rank, or None (this process alone).
        verify: passed to ``unison.common.checkpoints.load``.
        strict: refuse a checkpoint with entries that no rank of ``comm`` loads (as
            ``torch.nn.Module.load_state_dict`` refuses unexpected keys); False loads a part.

    Returns:
        ``(name -> this rank's piece, laid out as its layer holds it; the user metadata)``.

    Raises:
        CheckpointError: on every rank: a missing entry, a full shape or split that differs from
            the saved one, an entry no rank loads (``strict``), or a missing, corrupt or
            mismatched checkpoint.
    """
    where = os.fspath(path)
    manifest, wanted, problem = None, {}, None
    try:
        _check_unique(params)
        manifest = ck.read_manifest(path)
        wanted = {p.name: _wanted(p, manifest, where) for p in params}
    except ck.CheckpointError as exc:
        problem = str(exc)
    agree.raise_together(comm, problem)
    # (every rank read the manifest: none had a problem)
    agree.raise_together(comm, _unloaded(manifest, comm, set(wanted), where, strict))  # type: ignore[arg-type]
    got = ck.load(path, wanted, comm, verify=verify)
    saved = manifest if manifest is not None else ck.read_manifest(path)  # read above: no rank had a problem
    pieces = {p.name: _place(p, got[p.name], _saved_spec(saved, p.name)) for p in params}
    return pieces, dict((saved.metadata or {}).get("user", {}))
