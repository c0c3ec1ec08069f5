"""The opening of every save: check the input, agree on the path and a save id, derive the layout.

One allgather carries each rank's path, its local problem (if any), the description of its
entries and (from rank 0) the save id and metadata; every rank then reaches the same verdict from
the same data, so a mistake on one rank raises the same error on all of them before anything is
written.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from unison.common.checkpoints import agree, layout
from unison.common.checkpoints.format import CheckpointError

__all__: list[str] = []


@dataclass
class Start:
    """What a save knows once the ranks agree: this rank's data, the layout, the save id, the metadata."""

    local: dict[str, layout.LocalEntry]
    layout: layout.Layout
    save_id: str
    metadata: dict[str, Any]
    path: str


def begin(path: Any, entries: Mapping[str, Any], comm: Any, metadata: Any, what: str) -> Start:
    """Check and agree everything a save needs before writing (collective over ``comm``).

    Args:
        what: the calling function's name, for messages.

    Raises:
        CheckpointError: on every rank, for any rank's bad input, different paths, declarations
            that differ across ranks, or runs with a gap or an overlap.
    """
    local: dict[str, layout.LocalEntry] = {}
    problem = None
    try:
        target = os.path.normpath(os.fspath(path))
        local = layout.prepare(entries)
        meta = _check_metadata(metadata) if agree.rank(comm) == 0 else None
    except Exception as exc:  # any rank's mistake must reach the others, not leave them waiting
        detail = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        target, meta, problem = str(path), None, f"{what}: {detail}"
    mine = {name: e.describe() for name, e in local.items()}
    save_id = uuid.uuid4().hex[:16] if agree.rank(comm) == 0 else None
    views = agree.allgather(comm, (target, problem, mine, save_id, meta, what))
    _raise_first_problem(views)
    _check_same_kind([v[5] for v in views])
    _check_same_path([v[0] for v in views], what)
    plan = layout.plan([v[2] for v in views])
    return Start(local, plan, views[0][3], views[0][4], target)


def _check_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"metadata must be a dict (stored as JSON) or None; got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"metadata must be JSON-serializable ({exc}); convert arrays with .tolist() or "
                              "store them as entries") from exc


def _raise_first_problem(views: list[tuple[Any, ...]]) -> None:
    bad = [r for r, v in enumerate(views) if v[1] is not None]
    if bad:
        also = f" ({agree.ranks_text(bad[1:])} reported problems too)" if len(bad) > 1 else ""
        raise CheckpointError(f"rank {bad[0]}: {views[bad[0]][1]}{also}" if len(views) > 1 else views[0][1])


def _check_same_kind(kinds: list[str]) -> None:
    """Every rank runs the same kind of save (a consolidated file or a sharded folder): ranks that passed
    ``consolidated=`` differently each waited in their own kind's next collective, for ever (before
    2026-12-06; found by an audit)."""
    if len(set(kinds)) == 1:
        return
    raise CheckpointError(f"the ranks ran different kinds of save on one checkpoint ({_by_value(kinds, str)}); "
                          "every rank must make the same call (pass the same consolidated= on every rank)")


def _by_value(values: list[str], show: Any = repr) -> str:
    """``"rank 0: 'a'; ranks [1, 2]: 'b'"``: which ranks passed each value."""
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{agree.ranks_text(rs)}: {show(v)}" for v, rs in groups.items())


def _check_same_path(paths: list[str], what: str) -> None:
    if len(set(paths)) == 1:
        return
    raise CheckpointError(f"{what}: the ranks passed different paths ({_by_value(paths)}); every rank must pass "
                          "the same path (a folder on a filesystem every rank sees)")
