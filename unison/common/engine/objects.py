"""Moving picklable Python objects between ranks, for every backend.

This is the one place where Unison unpickles what another rank sent, because the
caller asks for exactly that: ``pickle.loads`` can run arbitrary code, so use these
functions only among ranks of the same trusted job (as with Horovod's
``broadcast_object``). The engine's own traffic never uses pickle (controller
[Note: wire records]).
"""

from __future__ import annotations

import hashlib
import operator
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from unison.common import runtime
from unison.common.agreement import ranks_text
from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet
from unison.common.exceptions import MismatchError

T = TypeVar("T")

__all__ = ["broadcast_object", "allgather_object", "agree_on_names", "agree_on_values"]


def _set_root(root_rank: int, process_set: ProcessSet | None) -> int:
    """Horovod's rule: ``root_rank`` is a rank of the job; the engine wants its rank in the set.

    Raises:
        ValueError: ``root_rank`` is not a member of ``process_set``.
    """
    if process_set is None or process_set.ranks is None:
        return root_rank
    if root_rank not in process_set.ranks:
        raise ValueError(f"root_rank={root_rank} is not a member of {process_set!r}: as in Horovod, "
                         "broadcast_object's root_rank is a rank of the job (unison.rank()) that "
                         "belongs to the process set")
    return process_set.ranks.index(root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Return ``root_rank``'s ``obj`` (pickled) on every rank (of ``process_set``).

    Args:
        obj: the object to send (read on the root only).
        root_rank: the sending rank, a rank of the job even with a process set
            (Horovod's rule, as the backends' ``broadcast``).
        name: the collective's name (auto-named when None).
        process_set: the ranks taking part (every rank when None).

    Raises:
        ValueError: ``root_rank`` is not a member of ``process_set``.
    """
    name = name or frontend._auto_name("broadcast_object", None, process_set)
    try:
        given = operator.index(root_rank)
    except TypeError:
        given = None
    try:
        if given is None:
            raise ValueError(f"broadcast_object: root_rank={root_rank!r} is not an integer; pass the root's rank "
                             "(unison.rank() on it)")
        root = _set_root(given, process_set)
        outside = None
    except ValueError as exc:  # still take part, the error in place of the data: every rank raises it
        outside, root = exc, 0  # (a placeholder root no peer sees: the request's error comes first)
    is_root = outside is None and runtime.rank() == given
    payload, error = _pickled(obj) if is_root else (None, None)  # (as Horovod: only the root pickles)
    count: Any = np.array([-1 if payload is None else payload.size], dtype=np.int64)
    size = frontend.broadcast(count if outside is None else frontend.Refused(outside), root, f"{name}.size",
                              process_set)
    if int(size[0]) < 0:  # the root could not pickle it: every rank raises, none waits for the data
        raise TypeError(f"broadcast_object: the root, rank {int(root_rank)}, could not pickle its object"
                        f"{f' ({error})' if error is not None else ''}; send something picklable") from error
    buf = payload if is_root else np.zeros(int(size[0]), dtype=np.uint8)
    data = frontend.broadcast(buf, root, f"{name}.data", process_set)
    # the root's own object, as Horovod's
    return _unpickled_together(lambda: obj if is_root else pickle.loads(data.tobytes()), "broadcast_object",
                               name, process_set)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet | None = None) -> list:
    """Return the list of every rank's ``obj`` (pickled), in rank order.

    Raises:
        TypeError: on every rank, when a rank could not pickle its object (the others waited for
            it for ever before).
    """
    name = name or frontend._auto_name("allgather_object", None, process_set)
    payload, error = _pickled(obj)
    sizes = frontend.allgather(np.array([-1 if payload is None else payload.size], dtype=np.int64),
                               f"{name}.sizes", process_set)
    members = _members(len(sizes), process_set)
    failed = [members[i] for i, size in enumerate(sizes.tolist()) if size < 0]  # ranks of the job
    if failed:
        raise TypeError(f"allgather_object: the objects of ranks {failed} could not be "
                        f"pickled{f' (here: {error})' if error is not None else ''}; send something picklable")
    data = frontend.allgather(payload, f"{name}.data", process_set)

    def load() -> list:
        out, start = [], 0
        for size in sizes.tolist():
            out.append(pickle.loads(data[start:start + size].tobytes()))
            start += size
        return out

    return _unpickled_together(load, "allgather_object", name, process_set)


def _unpickled_together(load: Callable[[], T], what: str, name: str, process_set: ProcessSet | None) -> T:
    """``load()`` (the unpickling), its failure raised on every rank as a TypeError naming the ranks that failed.

    An object that pickles but cannot be rebuilt on some rank (its class not importable there, a
    ``__reduce__`` that raises) failed on those ranks only, while the others went on to their next collective,
    which then paired with the wrong call or hung (before 2026-12-07; found by an audit; Horovod has the same
    gap). One more small all-gather per call tells every rank.
    """
    try:
        value, error = load(), None
    except Exception as exc:  # noqa: BLE001 (whatever unpickling raises: every rank must hear of it)
        value, error = None, exc
    flags = frontend.allgather(np.array([error is not None], dtype=np.uint8), f"{name}.loaded", process_set)
    members = _members(len(flags), process_set)
    failed = [members[i] for i, flag in enumerate(flags.tolist()) if flag]
    if failed:
        here = f" (here: {type(error).__name__}: {error})" if error is not None else ""
        raise TypeError(f"{what}: ranks {failed} could not unpickle the object{here}; send an object that every "
                        "rank can rebuild (its class importable there)") from error
    return value  # type: ignore[return-value]  # (set: load() returned)


def _digests_agree(text: str, name: str, process_set: ProcessSet | None) -> bool:
    """Whether every rank (of ``process_set``) has the same ``text``: one all-gather of its 16-byte digest."""
    mine = np.frombuffer(hashlib.blake2b(text.encode(), digest_size=16).digest(), np.uint8)
    return bool((frontend.allgather(mine.reshape(1, -1), f"{name}.digest", process_set) == mine).all())


def _members(count: int, process_set: ProcessSet | None) -> list[int]:
    """The job ranks of ``process_set``'s ``count`` members, in order."""
    return list(range(count)) if process_set is None or process_set.ranks is None else list(process_set.ranks)


def agree_on_names(what: str, names: Sequence[str], name: str | None = None,
                   process_set: ProcessSet | None = None) -> None:
    """Return when every rank (of ``process_set``) passed the same ``names`` in the same order; else raise
    :class:`MismatchError` on every rank, naming what each rank has that the first lacks and the reverse.

    For calls that submit one collective per item (``broadcast_parameters``, ``broadcast_variables``):
    a rank with an item more submitted a collective no other rank made, and waited for it for ever (a
    named one), or its next unnamed call paired with the others' (another item's data: before
    2026-12-05). One all-gather of a 16-byte digest when the names agree.
    """
    name = name or frontend._auto_name("agree_on_names", None, process_set)
    names = [str(n) for n in names]
    if _digests_agree("\0".join(names), name, process_set):
        return
    lists = allgather_object(names, f"{name}.names", process_set)
    members = _members(len(lists), process_set)
    first = lists[0]
    first_set = set(first)
    parts = []
    for r, theirs in zip(members, lists, strict=True):
        if theirs == first:
            continue
        theirs_set = set(theirs)
        extra = [n for n in theirs if n not in first_set]
        missing = [n for n in first if n not in theirs_set]
        shown = []
        if extra:
            shown.append(f"{len(extra)} more ({', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''})")
        if missing:
            shown.append(f"{len(missing)} fewer ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
        parts.append(f"rank {r}: {len(theirs)} item(s), " + (" and ".join(shown) if shown else "in another order"))
    raise MismatchError(f"{what}: the ranks passed different items: rank {members[0]} passed {len(first)}; "
                        + "; ".join(parts) + ". Every rank must pass the same ones (the same model), in the "
                        "same order")


def agree_on_values(what: str, values: Mapping[str, str], name: str | None = None,
                    process_set: ProcessSet | None = None, fix: str = "") -> None:
    """Return when every rank (of ``process_set``) passed the same ``values`` (a field's name to its text);
    else raise :class:`MismatchError` on every rank, naming each field that differs and the ranks holding
    each of its values.

    For what every rank must build alike, where a difference runs without an error: a tensor-parallel layer
    built with other sizes on one rank of its group computed a wrong result or waited for ever. One
    all-gather of a 16-byte digest when the values agree; ``fix`` ends the message.
    """
    name = name or frontend._auto_name("agree_on_values", None, process_set)
    mine_values = {str(k): str(v) for k, v in values.items()}
    if _digests_agree("\0".join(f"{k}={v}" for k, v in sorted(mine_values.items())), name, process_set):
        return
    dicts = allgather_object(mine_values, f"{name}.values", process_set)
    members = _members(len(dicts), process_set)
    parts = []
    for key in sorted({k for d in dicts for k in d}):
        holders: dict[str, list[int]] = {}
        for r, theirs in zip(members, dicts, strict=True):
            holders.setdefault(theirs.get(key, "(not given)"), []).append(r)
        if len(holders) > 1:
            parts.append(f"{key} is " + ", ".join(f"{v} on {ranks_text(rs)}" for v, rs in holders.items()))
    raise MismatchError(f"{what}: the ranks passed different values: " + "; ".join(parts)
                        + (f". {fix}" if fix else ""))


def _pickled(obj: Any) -> tuple[np.ndarray | None, Exception | None]:
    """``obj`` pickled as bytes, or the error that stopped it. cloudpickle when it is installed (Horovod's
    choice: lambdas and locally defined functions travel too), the standard pickle otherwise; both
    unpickle with ``pickle.loads`` (cloudpickle's output needs cloudpickle on the receiving rank)."""
    try:
        return np.frombuffer(_dumps(obj), dtype=np.uint8), None
    except Exception as exc:  # noqa: BLE001 - handed to every rank as a TypeError
        return None, exc


try:
    from cloudpickle import dumps as _dumps
except ImportError:  # pragma: no cover - cloudpickle comes with the dev dependencies (joblib)
    _dumps = pickle.dumps
