"""Save and load a sharded table through the sharded-checkpoint format (unison.common.checkpoints).

The table is saved in storage order (see [Note: storage order]): entry ``rows`` is ``num_rows x
dim`` and each server writes its block as one run, and the optimizer's per-row state likewise
(``state/<name>``). The manifest's metadata records the table's definition. Loading reads each
server's block on any number of servers: storage order does not depend on it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from unison.common import checkpoints as ck

__all__ = ["save", "load", "entries_of"]


def entries_of(table: Any) -> dict[str, Any]:
    """This rank's entries: a run of each array from its shard (nothing on a worker-only rank)."""
    shard = table.shard
    shapes: dict[str, tuple[tuple[int, ...], Any]] = {"rows": ((table.num_rows, table.dim), table.dtype)}
    for name in table.optimizer.state_names:
        if name == "steps":
            shapes[f"state/{name}"] = ((table.num_rows,), np.dtype(np.int64))
        else:
            shapes[f"state/{name}"] = ((table.num_rows, table.dim), table.dtype)
    copies: dict[str, np.ndarray] = {}
    if shard is not None:
        # one snapshot of the rows and their optimizer state together: the server thread applies pushes
        # meanwhile (SSP/ASP), and copied under a lock each, rows and moments could come from different
        # steps (found by an audit, 2026-12-06, by reading)
        with shard.cond:
            for name in shapes:
                array = shard.weights if name == "rows" else shard.state[name.split("/", 1)[1]]
                copies[name] = array.reshape(-1).copy()
    out = {}
    for name, (shape, dtype) in shapes.items():
        width = int(np.prod(shape[1:], dtype=np.int64))
        runs = [(shard.lo * width, copies[name])] if shard is not None else []
        out[name] = ck.LocalShard(shape, dtype, runs)
    return out


def definition(table: Any) -> dict[str, Any]:
    return {
        "kind": "unison.ps.ShardedTable",
        "name": table.name,
        "num_rows": table.num_rows,
        "dim": table.dim,
        "dtype": str(table.dtype),
        "sharding": table.sharding.kind,
        "optimizer": table.optimizer.config(),
    }


def save(table: Any, path: str | os.PathLike[str], metadata: dict[str, Any] | None = None) -> ck.Manifest:
    meta = {"table": definition(table), "user": metadata or {}}
    return ck.save_sharded(path, entries_of(table), table.comm, meta)


def load(table: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Fill this rank's shard from ``path``; returns the saved user metadata. Collective."""
    from unison.common.agreement import raise_together

    problem: str | None = None
    manifest: ck.Manifest | None = None
    try:
        manifest = ck.read_manifest(path)
    except ck.CheckpointError as exc:
        problem = str(exc)
    raise_together(table.comm, problem, ck.CheckpointError)
    if manifest is None:  # unreachable: raise_together raised on every rank
        raise ck.CheckpointError(f"no manifest read from {str(path)!r}")
    saved = (manifest.metadata or {}).get("table", {})
    mine = definition(table)
    for key in ("num_rows", "dim", "sharding"):
        if saved.get(key) != mine[key]:
            problem = (
                f"checkpoint {str(path)!r} holds a table with {key}={saved.get(key)!r}, this table has "
                f"{key}={mine[key]!r}; create the table with the saved definition to load it"
            )
            break
    saved_opt, my_opt = saved.get("optimizer", {}).get("name"), mine["optimizer"]["name"]
    if problem is None and saved_opt != my_opt:  # its per-row state would be dropped or made up
        problem = (f"checkpoint {str(path)!r} was saved with optimizer {saved_opt}, this table uses {my_opt}; "
                   f"create the table with {saved_opt} (its hyper-parameters may differ) to load it")
    names = ["rows"] + [f"state/{n}" for n in table.optimizer.state_names]
    if problem is None:
        missing = [n for n in names if n not in manifest.entries]
        if missing:
            problem = (
                f"checkpoint {str(path)!r} has no {missing} (saved with optimizer "
                f"{saved.get('optimizer', {}).get('name')!r}, this table uses {type(table.optimizer).__name__})"
            )
    raise_together(table.comm, problem, ck.CheckpointError)
    shard = table.shard
    wanted: dict[str, Any] = {}
    for name in names:
        width = 1 if name == "state/steps" else table.dim
        wanted[name] = [] if shard is None else [(shard.lo * width, (shard.hi - shard.lo) * width)]
    got = ck.load(path, wanted, table.comm)
    if shard is not None:
        with shard.cond:
            shard.weights[...] = got["rows"][0].reshape(shard.weights.shape)
            for name in table.optimizer.state_names:
                target = shard.state[name]
                target[...] = got[f"state/{name}"][0].reshape(target.shape)
    return dict((manifest.metadata or {}).get("user", {}))
